#!/usr/bin/env bash
# Packs aiperf (bench/requirements-aiperf.txt) and its dependencies for a machine that has no
# package index (the GPU machine: python 3.12, torch and CUDA already there) into DIR (default
# .aiperf-packages), in parts of under 44 MiB each so that one device call can carry one part
# beside the working tree and what the run needs (a call carries 64 MiB in all):
#   DIR/pN/*.whl.xz: cp312 manylinux wheels, re-zipped without compression, then xz'd (the
#                  wheels' own deflate would leave xz little to find)
#   DIR/install.sh: on that machine `bash DIR/install.sh [pN ...]` installs the parts named (default:
#                  every part present) into /tmp/aiperf-site (pip --no-index --no-deps --target).
# Then: python -m bench.slo --aiperf "env PYTHONPATH=/tmp/aiperf-site python3 -m aiperf" ...
# aiperf gets a site of its own (PYTHONPATH for its process alone): its prometheus-client pin
# conflicts with the project's (see bench/requirements-aiperf.txt). About 3 minutes on 2 cores (xz).
set -euo pipefail
D=${1:-.aiperf-packages}
PYV=${PYV:-3.12}
PART_MIB=${PART_MIB:-44}
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$D"; mkdir -p "$D/dl" "$D/stored"
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
python3 -m pip download -q --only-binary=:all: --python-version "$PYV" --implementation cp $plat \
    -d "$D/dl" -r "$here/requirements-aiperf.txt"
# Never torch or CUDA: the GPU machine has its own (aiperf does not import torch). Nor what aiperf
# needs only for plots, parquet exports, sweeps and its operator (bench.serve ran without them on
# the CPU and on an H100, 2026-12-07): 68 MB instead of 146, one device call less to install.
rm -f "$D"/dl/torch-*.whl "$D"/dl/triton-*.whl "$D"/dl/nvidia_*.whl
for unused in pyarrow scipy dash dash_bootstrap_components plotly matplotlib fonttools kaleido sqlalchemy \
    optuna alembic datasets; do
    rm -f "$D/dl/$unused"-*.whl
done
python3 - "$D/dl" "$D/stored" <<'PY'
import sys, zipfile
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
for whl in sorted(src.glob("*.whl")):
    with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(dst / whl.name, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            info.compress_type = zipfile.ZIP_STORED
            zout.writestr(info, data)
PY
# Each wheel xz'd once; parts filled largest first, each wheel into the first part it fits.
n=0; declare -A used
for w in $(ls -S "$D"/stored/*.whl); do
    xz -T0 -6 "$w"; sz=$(stat -c %s "$w.xz")
    part=""
    for ((i = 0; i < n; i++)); do
        if (( used[$i] + sz < PART_MIB * 1048576 )); then part=$i; break; fi
    done
    if [[ -z $part ]]; then part=$n; used[$n]=0; mkdir -p "$D/p$n"; n=$((n + 1)); fi
    used[$part]=$(( used[$part] + sz )); mv "$w.xz" "$D/p$part/"
done
rm -rf "$D/dl" "$D/stored"
cat > "$D/install.sh" <<'INSTALL'
#!/usr/bin/env bash
# Installs the parts named (`bash install.sh p1`: a device call carries one part at a time; none
# named: every part beside this script) into /tmp/aiperf-site; run with PYTHONPATH=/tmp/aiperf-site.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); mkdir -p /tmp/aiperf-site
parts=("$@"); [[ $# -gt 0 ]] || parts=($(cd "$here" && ls -d p*))
for p in "${parts[@]}"; do
    t=$(mktemp -d)
    for w in "$here/$p"/*.whl.xz; do xz -d -T0 -c "$w" > "$t/$(basename "${w%.xz}")"; done
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/aiperf-site --upgrade "$t"/*.whl
    rm -rf "$t"; echo "installed $p"
done
PYTHONPATH=/tmp/aiperf-site python3 -m aiperf --version || echo "aiperf not importable yet (parts missing?)"
INSTALL
chmod +x "$D/install.sh"
du -sh "$D"/p*; du -sh "$D"
