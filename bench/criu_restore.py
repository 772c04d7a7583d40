"""What a CRIU restore costs by image size, beside the floor this machine puts under it.

A restored joiner's "criu restore" step grows with its image (1.3-1.7 s for the 2.4 GB CUDA
image on an H200). This finds out where the time goes. Per size: a process holding that many GiB
(written, so every page is in the image) is dumped (`snapshot.criu_image.dump`) and restored
`--repeats` times the way the capacity provider restores a joiner (`restore`, in a PID and network
namespace of its own, the manifest already verified), then the image's page file is read three
ways: into memory that was touched before (a copy out of the page cache), into fresh anonymous
memory (a copy plus the first touch of every page, which is what CRIU does: one preadv into the
new mappings), and into fresh memory advised MADV_HUGEPAGE. The first-touch rate is the floor:
CRIU cannot restore faster than the kernel can fault the pages in, and on a VM each first touch
also goes to the host. Results: a table and bench/results/criu_restore.json (`--out`).

    python -m bench.criu_restore                 # 0, 0.5, 1 and 2 GiB, as root, CRIU from make install
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.measure import write_results
from snapshot.criu import find_criu
from snapshot.criu_image import dump, restore, spawn, verify_image

CHILD = """
import sys, time
payload = bytearray(int(float(sys.argv[1]) * 2**30))
for i in range(0, len(payload), 4096):  # every page written: in the image, not a hole
    payload[i] = 1
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def read_rates(pages: Path) -> dict[str, float]:
    """GB/s of reading `pages` into memory touched before, into fresh anonymous memory, and into
    fresh memory advised MADV_HUGEPAGE."""
    fd = os.open(pages, os.O_RDONLY)
    try:
        n = os.fstat(fd).st_size
        if n == 0:
            return {}
        out = {}
        for name, huge in (("first_touch_gbps", False), ("first_touch_hugepage_gbps", True)):
            m = mmap.mmap(-1, n)
            if huge:
                m.madvise(mmap.MADV_HUGEPAGE)
            t = time.perf_counter()
            os.preadv(fd, [m], 0)
            out[name] = n / (time.perf_counter() - t) / 1e9
            if not huge:
                t = time.perf_counter()
                os.preadv(fd, [m], 0)
                out["touched_gbps"] = n / (time.perf_counter() - t) / 1e9
            m.close()
        return out
    finally:
        os.close(fd)


def measure(gib: float, repeats: int, work: Path) -> dict:
    d = work / f"{gib}"
    d.mkdir()
    (d / "child.py").write_text(CHILD)
    log = d / "start.log"
    p = spawn([sys.executable, str(d / "child.py"), str(gib)], log)
    deadline = time.monotonic() + 300
    while b"ready" not in log.read_bytes():
        if p.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the {gib} GiB process did not come up: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    try:
        m = dump(p, d / "img")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    manifest = verify_image(d / "img")
    times = []
    for i in range(repeats):
        with open(d / f"copy{i}.log", "ab") as out:
            t = time.perf_counter()
            copy = restore(d / "img", output=out, manifest=manifest)
            times.append(time.perf_counter() - t)
        copy.close()
    pages = max((d / "img").glob("pages-*.img"), key=lambda f: f.stat().st_size)
    rates = read_rates(pages)
    image = m.image_bytes
    row = {
        "payload_gib": gib,
        "image_bytes": image,
        "dump_s": round(m.seconds, 3),
        "restore_s": [round(t, 3) for t in times],
        "restore_s_median": round(statistics.median(times), 3),
        "restore_gbps": round(image / statistics.median(times) / 1e9, 3),
        **{k: round(v, 3) for k, v in rates.items()},
    }
    if rates:  # the page file at the first-touch rate: what no restore of this image beats here
        row["floor_s"] = round(pages.stat().st_size / rates["first_touch_gbps"] / 1e9, 3)
    shutil.rmtree(d, ignore_errors=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", default="0,0.5,1,2", help="comma-separated payloads in GiB (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="restores per size (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("bench/results/criu_restore.json"), help="JSON results file")
    args = p.parse_args()
    try:
        sizes = [float(s) for s in args.gib.split(",")]
    except ValueError:
        p.error(f"--gib: not a list of numbers: {args.gib!r}")
    if any(s < 0 for s in sizes) or args.repeats < 1:
        p.error("--gib takes sizes >= 0 and --repeats at least 1")
    criu = find_criu()
    if criu is None:
        raise SystemExit("criu not found: `make install` unpacks Debian trixie's CRIU 4.1.1 into .venv/criu")
    work = Path(tempfile.mkdtemp(prefix="bench-criu-"))
    rows = []
    try:
        for gib in sizes:
            print(f"  {gib} GiB: dump, {args.repeats} restores, page-file reads...", file=sys.stderr, flush=True)
            rows.append(measure(gib, args.repeats, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    version = subprocess.run([criu, "--version"], capture_output=True, text=True).stdout.split()
    result = {
        "command": " ".join([sys.executable, "-m", "bench.criu_restore", *sys.argv[1:]]),
        "criu": version[1] if len(version) > 1 else "",
        "rows": rows,
    }
    print("| payload GiB | image GiB | dump s | restore s (median) | restore GB/s | floor s | first touch GB/s "
          "| hugepage GB/s | touched GB/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [r.get(k, "-") for k in ("floor_s", "first_touch_gbps", "first_touch_hugepage_gbps", "touched_gbps")]
        print(
            f"| {r['payload_gib']} | {r['image_bytes'] / 2**30:.2f} | {r['dump_s']} | {r['restore_s_median']} "
            f"| {r['restore_gbps']} | " + " | ".join(str(c) for c in cells) + " |"
        )
    write_results(args.out, result)


if __name__ == "__main__":
    main()
