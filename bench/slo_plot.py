"""The plot of a bench.slo result: each deployment's rolling p95 TTFT over the replay, the SLO
line, and the scale and restart moments. Run with the python that has matplotlib (aiperf's venv,
`make bench-tools`): `.venv/aiperf/bin/python -m bench.slo_plot RESULT.json OUT.png`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"static": "tab:blue", "restart": "tab:red", "elastic": "tab:green"}


def main(src: str, dst: str) -> None:
    res = json.loads(Path(src).read_text())
    fig, ax = plt.subplots(figsize=(10, 5))
    for d in res["deployments"]:
        pts = d["rolling_p95"]
        c = COLORS.get(d["kind"], None)
        label = f"{d['kind']} ({d['completed']}/{d['requests']} completed)"
        ax.plot([t for t, _ in pts], [v for _, v in pts], color=c, label=label)
        for m in d["marks"]:
            ax.axvspan(m["t"], max(m["t_end"], m["t"] + 0.2), color=c, alpha=0.15)
            # x in seconds, y in axes units: the label sits at the bottom whatever the TTFT scale.
            ax.text(m["t"], 0.02, m["what"], transform=ax.get_xaxis_transform(), color=c, fontsize=7, rotation=90)
    ax.axhline(res["slo_s"], color="black", linestyle="--", label=f"SLO {res['slo_s']:g} s")
    t = res["trace"]
    ax.set_title(
        f"rolling {res['window_s']:g} s p95 TTFT, {t['requests']} requests, "
        f"{t['rate_from']:g} -> {t['rate_to']:g} req/s (failed = {res['penalty_s']:g} s), {res['deployment']['device']}"
    )
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("p95 TTFT (s)")
    ax.set_yscale("log")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m bench.slo_plot RESULT.json OUT.png")
    main(sys.argv[1], sys.argv[2])
