"""The CUDA driver's process checkpoint API (driver >= 570 / CUDA 12.8), applied to another process.

``checkpoint(pid)`` locks the process's CUDA state (waiting for its in-flight work, at most
`timeout_ms`) and moves its GPU memory to host memory: the process keeps running on the CPU but
holds no GPU memory until ``restore(pid)`` brings it back (same GPU type) and unlocks it. The calls
are exactly those of shared/probes/ckpt_probe.py; ``cuda.bindings`` is imported lazily, so this
module imports anywhere. Unsupported by the driver: UVM, IPC memory, MIG, MPS.
"""

from __future__ import annotations

import os
import time

MIN_DRIVER = 12080  # cuDriverGetVersion() of the r570 driver, the first with the checkpoint API
FUNCTIONS = (
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
)


class CudaCheckpointError(RuntimeError):
    """A driver call failed; the message names the call, the pid and the CUresult."""


def _gpu_present() -> bool:
    """An NVIDIA driver with a device node (no torch import: this runs in `snapshot-bake tiers`)."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")


def _driver():
    """cuda.bindings.driver, initialised (restore needs cuInit in the caller)."""
    try:
        from cuda.bindings import driver as d
    except ImportError as e:
        raise CudaCheckpointError(f"cuda.bindings is not installed (pip install cuda-python): {e}") from None
    err = _first(d.cuInit(0))
    if err != d.CUresult.CUDA_SUCCESS:
        raise CudaCheckpointError(f"cuInit failed: {_name(err)}")
    return d


def _first(result):
    """cuda.bindings returns (CUresult, *values); tolerate a bare CUresult too."""
    return result[0] if isinstance(result, tuple) else result


def _name(err) -> str:
    return str(getattr(err, "name", err)).split(".")[-1]


def _ok(d, call: str, pid: int, result) -> tuple:
    err = _first(result)
    if err != d.CUresult.CUDA_SUCCESS:
        raise CudaCheckpointError(f"{call}(pid {pid}) failed: {_name(err)}")
    return tuple(result[1:]) if isinstance(result, tuple) else ()


def available() -> tuple[bool, str]:
    """(True, what was found) where this process can checkpoint/restore others, else (False, why)."""
    try:
        from cuda.bindings import driver as d
    except ImportError:
        if not _gpu_present():
            return False, "no CUDA GPU on this machine (and cuda.bindings is not installed)"
        return False, "cuda.bindings is not installed (pip install cuda-python)"
    try:
        err = _first(d.cuInit(0))
    except Exception as e:  # a broken install (no libcuda.so)
        return False, f"the CUDA driver could not be loaded ({e})"
    if err != d.CUresult.CUDA_SUCCESS:
        return False, f"no usable CUDA device (cuInit: {_name(err)})"
    err, ver = d.cuDriverGetVersion()
    if err != d.CUresult.CUDA_SUCCESS:
        return False, f"cuDriverGetVersion failed: {_name(err)}"
    shown = f"{ver // 1000}.{ver % 1000 // 10}"
    if ver < MIN_DRIVER:
        return False, f"the CUDA driver supports CUDA {shown}; the checkpoint API needs driver >= 570 (CUDA 12.8)"
    missing = [f for f in FUNCTIONS if not hasattr(d, f)]
    if missing:
        return False, f"this cuda.bindings lacks {', '.join(missing)} (needs cuda-python >= 12.8)"
    return True, f"CUDA driver checkpoint API available (driver for CUDA {shown})"


def state(pid: int) -> str:
    """ "running", "locked", "checkpointed" or "failed" (the CUprocessState name, lower case)."""
    d = _driver()
    (st,) = _ok(d, "cuCheckpointProcessGetState", pid, d.cuCheckpointProcessGetState(pid))
    return _name(st).removeprefix("CU_PROCESS_STATE_").lower()


def checkpoint(pid: int, timeout_ms: int = 30000) -> dict[str, float]:
    """Lock, then checkpoint `pid`'s CUDA state (its GPU memory is released). Returns seconds per
    call {"lock", "checkpoint"}. If the checkpoint fails, the process is unlocked again."""
    d = _driver()
    t: dict[str, float] = {}
    la = d.CUcheckpointLockArgs()
    la.timeoutMs = int(timeout_ms)
    t0 = time.perf_counter()
    _ok(d, "cuCheckpointProcessLock", pid, d.cuCheckpointProcessLock(pid, la))
    t["lock"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        _ok(
            d,
            "cuCheckpointProcessCheckpoint",
            pid,
            d.cuCheckpointProcessCheckpoint(pid, d.CUcheckpointCheckpointArgs()),
        )
    except CudaCheckpointError:
        d.cuCheckpointProcessUnlock(pid, d.CUcheckpointUnlockArgs())
        raise
    t["checkpoint"] = time.perf_counter() - t0
    return t


def restore(pid: int) -> dict[str, float]:
    """Restore `pid`'s CUDA state (GPU memory back at the same addresses), then unlock it.
    Returns seconds per call {"restore", "unlock"}."""
    d = _driver()
    t: dict[str, float] = {}
    t0 = time.perf_counter()
    _ok(d, "cuCheckpointProcessRestore", pid, d.cuCheckpointProcessRestore(pid, d.CUcheckpointRestoreArgs()))
    t["restore"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    _ok(d, "cuCheckpointProcessUnlock", pid, d.cuCheckpointProcessUnlock(pid, d.CUcheckpointUnlockArgs()))
    t["unlock"] = time.perf_counter() - t0
    return t
