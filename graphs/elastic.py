"""The elastic serving graph: `dynamo serve graphs/elastic:Frontend`.

Frontend (Dynamo's OpenAI HTTP service) -> Router (topology authority, control API) -> Worker
ranks (one process per DP/EP rank). The Planner reads the frontend's and the router's metrics and
scales through the router's API (`--Planner.enabled=false` for manual scaling only)."""

from components.control.router import Router
from components.frontend import Frontend
from components.planner.service import Planner
from components.worker.component import Worker

Frontend.link(Router).link(Worker)
Frontend.link(Planner)

__all__ = ["Frontend", "Planner", "Router", "Worker"]
