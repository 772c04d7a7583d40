"""KubernetesProvider: joining ranks as pods of a worker StatefulSet, scaled through the API server.

Pod `<statefulset>-<i>` is rank i (the manifests in `deploy/` start each pod's worker with
`--rank` from its ordinal and `--join` when the ordinal is at or above the initial DP size).
A StatefulSet adds and removes pods at the top ordinal only, which matches the router: joiners
take the next ranks and a scale-down removes the highest ones. `acquire` raises the StatefulSet's
replicas to cover the new ranks; `release` lowers it to the highest rank still held + 1.

Plain HTTP to the API server (aiohttp, no Kubernetes client library) with the pod's service
account: token and CA from /var/run/secrets/kubernetes.io/serviceaccount, address from
KUBERNETES_SERVICE_HOST / _PORT. The RBAC it needs (get/patch statefulsets/scale, get pods) is in
deploy/rbac.yaml. Tested against a fake API server only; no real cluster was available.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from pathlib import Path

import aiohttp

log = logging.getLogger("components.control.capacity_k8s")

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubernetesProvider:
    def __init__(
        self,
        statefulset: str | None = None,
        namespace: str | None = None,
        api_url: str | None = None,
        token: str | None = None,
        ca_file: str | None = None,
        poll_s: float = 2.0,
        release_timeout_s: float = 60.0,
    ):
        self.statefulset = statefulset or os.environ.get("ELASTIC_EP_WORKER_STATEFULSET", "elastic-ep-worker")
        self.namespace = namespace or os.environ.get("POD_NAMESPACE") or self._read(SA_DIR / "namespace") or "default"
        if api_url is None:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise RuntimeError(
                    "KubernetesProvider: not in a cluster (KUBERNETES_SERVICE_HOST unset) and no api_url given"
                )
            api_url = f"https://{host}:{port}"
        self.api_url = api_url.rstrip("/")
        self._token = token
        ca = ca_file or (str(SA_DIR / "ca.crt") if (SA_DIR / "ca.crt").exists() else None)
        self._ssl = ssl.create_default_context(cafile=ca) if self.api_url.startswith("https") else None
        self.poll_s, self.release_timeout_s = poll_s, release_timeout_s
        self.held: set[int] = set()  # ranks acquired through this provider and not released
        self.refused: dict[int, str] = {}  # pods start as their image says: no snapshot chosen here
        self.snapshot = None
        self._phase: dict[int, str] = {}
        self._session: aiohttp.ClientSession | None = None
        self._watch: asyncio.Task | None = None

    @staticmethod
    def _read(p: Path) -> str | None:
        try:
            return p.read_text().strip()
        except OSError:
            return None

    def _headers(self) -> dict[str, str]:
        # The projected token rotates: read it per request.
        token = self._token if self._token is not None else self._read(SA_DIR / "token")
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def _req(self, method: str, path: str, **kw) -> tuple[int, dict]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        async with self._session.request(
            method, self.api_url + path, headers={**self._headers(), **kw.pop("headers", {})}, ssl=self._ssl, **kw
        ) as r:
            body = await r.json(content_type=None) if r.content_length != 0 else {}
            return r.status, body or {}

    @property
    def _scale_path(self) -> str:
        return f"/apis/apps/v1/namespaces/{self.namespace}/statefulsets/{self.statefulset}/scale"

    async def replicas(self) -> int:
        status, body = await self._req("GET", self._scale_path)
        if status != 200:
            raise RuntimeError(f"GET statefulset {self.namespace}/{self.statefulset} scale: HTTP {status}: {body}")
        return int(body.get("spec", {}).get("replicas", 0))

    async def set_replicas(self, n: int) -> None:
        status, body = await self._req(
            "PATCH",
            self._scale_path,
            json={"spec": {"replicas": n}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        if status not in (200, 201):
            raise RuntimeError(
                f"PATCH statefulset {self.namespace}/{self.statefulset} scale to {n}: HTTP {status}: {body}"
            )

    async def _pod_phase(self, rank: int) -> str:
        status, body = await self._req("GET", f"/api/v1/namespaces/{self.namespace}/pods/{self.statefulset}-{rank}")
        if status == 404:
            return "Gone"
        if status != 200:
            return "Unknown"
        st = body.get("status", {})
        for cs in st.get("containerStatuses", []) or []:
            # A worker that died restarts in place; for the router that rank died.
            if cs.get("restartCount", 0) > 0 or "terminated" in (cs.get("state") or {}):
                return "Failed"
        return st.get("phase", "Unknown")

    async def _watch_pods(self) -> None:
        while True:
            for rank in sorted(self.held):
                try:
                    self._phase[rank] = await self._pod_phase(rank)
                except Exception as e:  # the API server being away is no verdict on the pod
                    log.debug("pod %d: %s", rank, e)
            await asyncio.sleep(self.poll_s)

    # ---- CapacityProvider ------------------------------------------------------------------------
    async def acquire(self, ranks: list[int], op: str, fault: str = "") -> dict[int, str]:
        if fault:
            raise RuntimeError("KubernetesProvider does not inject faults")
        current = await self.replicas()
        want = max(ranks) + 1
        missing = [r for r in range(current, want) if r not in ranks]
        if missing:
            raise RuntimeError(
                f"rank {max(ranks)} cannot start alone: a StatefulSet adds pods in order and "
                f"ranks {missing[0]}..{missing[-1]} are not started"
            )
        self.held.update(ranks)
        for r in ranks:
            self._phase[r] = "Pending"
        if want > current:
            await self.set_replicas(want)
        log.info(
            "[op %s] statefulset %s/%s: %d -> %d replicas for ranks %s",
            op,
            self.namespace,
            self.statefulset,
            current,
            want,
            ranks,
        )
        if self._watch is None:
            self._watch = asyncio.create_task(self._watch_pods())
        return {r: "new" for r in ranks}

    checkpoints_parked = False

    async def park(self, rank: int, pid: int, op: str) -> None:
        # A pod cannot be parked from here (its node would need the checkpoint agent): it goes.
        log.info("[op %s] rank %d: pods are not parked; releasing it", op, rank)
        await self.release(rank, op)

    def alive(self, rank: int) -> bool | None:
        if rank not in self.held:
            return None
        return self._phase.get(rank) not in ("Failed", "Gone")

    def watch(self, rank: int, pid: int) -> None:
        pass  # a PID in another pod: its pod's phase says whether it runs

    def adopt(self, rank: int, pid: int, joiner: bool, parked: bool) -> None:
        # Pods outlive any router; a joiner's pod is this provider's to release again.
        if joiner:
            self.held.add(rank)
            self._phase[rank] = "Running"
            if self._watch is None:
                self._watch = asyncio.create_task(self._watch_pods())

    async def release(self, rank: int, op: str, graceful: bool = True) -> None:
        self.held.discard(rank)
        self._phase.pop(rank, None)
        current = await self.replicas()
        # Only the top ordinals can go; a rank below one still held goes when that one does.
        keep = max([r for r in self.held if r < current] + [self._base(current, rank) - 1]) + 1
        if keep < current:
            await self.set_replicas(keep)
            log.info(
                "[op %s] statefulset %s/%s: %d -> %d replicas (rank %d released)",
                op,
                self.namespace,
                self.statefulset,
                current,
                keep,
                rank,
            )
        if graceful:
            deadline = asyncio.get_running_loop().time() + self.release_timeout_s
            while asyncio.get_running_loop().time() < deadline and await self._pod_phase(rank) != "Gone":
                await asyncio.sleep(self.poll_s)

    async def fence(self, rank: int, pid: int, op: str) -> None:
        # Deleting the pod ends the process wherever it runs; the StatefulSet recreates it, and the
        # new process registers as a fresh rank for the next scale-up.
        status, body = await self._req("DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{self.statefulset}-{rank}")
        log.warning("[op %s] rank %d fenced: pod deleted (HTTP %d)", op, rank, status)

    def prune(self) -> None:
        pass  # no standby copies: pods are the StatefulSet's

    def settled(self, op: str) -> None:
        pass  # nothing is held back: pods are the StatefulSet's to schedule

    def _base(self, current: int, rank: int) -> int:
        """Pods below the released rank that this provider did not start (the initial group)."""
        return min(rank, current)

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self._session is not None:
            await self._session.close()
