"""Is the CRIU tier possible here? Detect, never assume: find criu (the venv's own first, as
`make install` unpacks Debian trixie's CRIU 4.1.1 there, then $PATH), read its version and run
`criu check`, which needs root. Debian bookworm's CRIU 3.17 fails that check on recent kernels.

No CRIU plugin is needed for CUDA processes: their GPU state is moved to host memory with the
driver's checkpoint API (snapshot.cuda_checkpoint) before the dump and brought back after the
restore (shared/probes/criu_probe.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

MIN_VERSION = (4, 0)
CHECK_TIMEOUT_S = 60
NOT_INSTALLED = "CRIU not found (`make install` unpacks Debian trixie's CRIU 4.1.1 into .venv/criu)"


CRIU_ENV = "ELASTIC_EP_CRIU"


def find_criu() -> str | None:
    """$ELASTIC_EP_CRIU (a machine whose Python is not the venv's: the GPU machine, given the
    venv's .venv/criu and .venv/bin/criu), else the venv's criu (written by tools/criu-fetch.sh),
    else any criu on $PATH."""
    if os.environ.get(CRIU_ENV):
        return os.environ[CRIU_ENV]
    own = Path(sys.prefix) / "bin" / "criu"
    if os.access(own, os.X_OK):
        return str(own)
    return shutil.which("criu")


def criu_version(criu: str) -> tuple[tuple[int, ...], str] | None:
    """((major, minor, ...), "4.1.1") from `criu --version`, None when it cannot be read."""
    try:
        out = subprocess.run([criu, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"Version:\s*(\d+(?:\.\d+)*)", out.stdout + out.stderr)
    if not m:
        return None
    return tuple(int(x) for x in m.group(1).split(".")), m.group(1)


def _check_failure(criu: str) -> str | None:
    """None when `criu check` says "Looks good", else why not, in one line."""
    try:
        out = subprocess.run([criu, "check"], capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"`criu check` did not finish in {CHECK_TIMEOUT_S} s"
    except OSError as e:
        return f"`criu check` could not run: {e.strerror}"
    text = out.stdout + out.stderr
    if out.returncode == 0 and "Looks good" in text:
        return None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("Error")]
    why = (errors or lines or [f"exit status {out.returncode}, no output"])[0]
    return f"`criu check` failed: {why[:300]}"


# A CRIU found usable, by (path, inode, mtime, euid): `criu --version` and `criu check` take 70-120
# ms, and the capacity provider asks at every scale-up that starts processes, before the first
# restore. What they check (the binary, the kernel, root) does not change under a running
# process; a CRIU found unusable is asked again, so one installed later is seen.
_usable: dict[tuple[str, int, int, int], str] = {}


def criu_status(criu: str | None = None) -> tuple[bool, str]:
    """(usable, one line saying what was found or what is missing)."""
    criu = criu or find_criu()
    if not criu:
        return False, NOT_INSTALLED
    try:
        st = os.stat(criu)
    except OSError as e:  # ELASTIC_EP_CRIU naming nothing, say
        return False, f"CRIU at {criu}: {e.strerror}"
    key = (criu, st.st_ino, st.st_mtime_ns, os.geteuid())
    if key in _usable:
        return True, _usable[key]
    got = criu_version(criu)
    if got is None:
        return False, f"CRIU at {criu}: `criu --version` gave no version"
    ver, shown = got
    if ver < MIN_VERSION:
        return False, f"CRIU {shown} at {criu}; the criu tier needs >= {'.'.join(map(str, MIN_VERSION))}"
    if os.geteuid() != 0:
        return False, f"CRIU {shown} at {criu}; checkpoint and restore need root"
    failed = _check_failure(criu)
    if failed:
        return False, f"CRIU {shown} at {criu}: {failed}"
    _usable[key] = f"CRIU {shown} at {criu}: `criu check` looks good"
    return True, _usable[key]
