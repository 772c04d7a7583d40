"""Is the CRIU tier possible here? CRIU >= 4.0 with its CUDA plugin (cuda_plugin.so) is needed:
Debian bookworm ships 3.17, whose `criu check` fails on recent kernels, and no CUDA plugin.
Detect, never assume."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

MIN_VERSION = (4, 0)
PLUGIN_NAME = "cuda_plugin.so"
PLUGIN_DIRS = (
    "/usr/lib/criu",
    "/usr/lib64/criu",
    "/usr/local/lib/criu",
    "/usr/local/lib64/criu",
    "/usr/lib/x86_64-linux-gnu/criu",
    "/usr/lib/aarch64-linux-gnu/criu",
    "/usr/libexec/criu",
)
NOT_INSTALLED = (
    "CRIU not installed (apt-get install criu; CRIU >= 4.0 with the CUDA plugin is needed for the criu tier)"
)


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


def find_plugin(criu: str | None = None, dirs=None) -> Path | None:
    """cuda_plugin.so in the usual CRIU plugin directories (and $CRIU_LIBS_DIR, and a lib/criu
    beside the criu binary)."""
    cands = list(dirs) if dirs is not None else [*filter(None, [os.environ.get("CRIU_LIBS_DIR")]), *PLUGIN_DIRS]
    if criu and dirs is None:
        prefix = Path(criu).resolve().parent.parent
        cands += [str(prefix / "lib" / "criu"), str(prefix / "lib64" / "criu")]
    for d in cands:
        p = Path(d) / PLUGIN_NAME
        if p.is_file():
            return p
    return None


def criu_status(criu: str | None = None, plugin_dirs=None) -> tuple[bool, str]:
    """(usable, a sentence saying what was found or what is missing)."""
    criu = criu or shutil.which("criu")
    if not criu:
        return False, NOT_INSTALLED
    got = criu_version(criu)
    if got is None:
        return (
            False,
            f"CRIU found at {criu} but `criu --version` gave no version; "
            "the criu tier needs >= 4.0 with its CUDA plugin",
        )
    ver, shown = got
    if ver < MIN_VERSION:
        return False, f"CRIU {shown} found; the criu tier needs >= 4.0 with its CUDA plugin"
    plugin = find_plugin(criu, plugin_dirs)
    if plugin is None:
        where = ", ".join(plugin_dirs if plugin_dirs is not None else PLUGIN_DIRS[:3])
        return False, (f"CRIU {shown} found but not its CUDA plugin ({PLUGIN_NAME} in {where}); the criu tier needs it")
    return True, f"CRIU {shown} with its CUDA plugin ({plugin})"
