"""The elastic serving graph: `dynamo serve graphs/elastic:Frontend`.

Frontend (Dynamo's OpenAI HTTP service) -> Router (topology authority, control API) -> Worker
ranks (one process per DP/EP rank)."""

from components.frontend import Frontend
from components.router import Router
from components.worker import Worker

Frontend.link(Router).link(Worker)

__all__ = ["Frontend", "Router", "Worker"]
