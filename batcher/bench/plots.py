"""PNG plots of a run (matplotlib, headless Agg backend): latency CDFs, the run over time, and
goodput against offered rate for a sweep. Inputs are the per-request dicts of the JSON report, so a
saved run can be plotted again, or several runs side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on servers and in CI
import matplotlib.pyplot as plt

Runs = dict[str, list[dict[str, Any]]]


def _cdf(ax: Any, values: list[float], label: str) -> None:
    xs = sorted(values)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")


def plot_cdfs(runs: Runs, path: Path, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> Path:
    """TTFT and TPOT CDFs (ms) of successful requests, one line per run."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for label, reqs in runs.items():
        ok = [r for r in reqs if r["ok"]]
        _cdf(a, [r["ttft"] * 1000 for r in ok if r["ttft"] is not None], label)
        _cdf(b, [r["tpot"] * 1000 for r in ok if r["tpot"] is not None], label)
    for ax, slo, name in ((a, slo_ttft_ms, "TTFT"), (b, slo_tpot_ms, "TPOT")):
        if slo is not None:
            ax.axvline(slo, color="red", linestyle="--", linewidth=1, label=f"SLO {slo:g} ms")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("share of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        ax.set_title(f"{name} CDF")
    return _save(fig, path)


def plot_timeline(reqs: list[dict[str, Any]], server: dict[str, Any] | None, path: Path,
                  title: str = "") -> Path:
    """Per-request TTFT and E2E over time; KV blocks used, running and waiting over time."""
    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    ok = [r for r in reqs if r["ok"]]
    # Each latency sits at the moment it ended (first token, last token), so a queue building up
    # shows as a rising cloud, whatever the arrival pattern.
    a.scatter([r["start"] + r["e2e"] for r in ok], [r["e2e"] for r in ok], s=10, label="E2E")
    with_ttft = [r for r in ok if r["ttft"] is not None]
    a.scatter([r["start"] + r["ttft"] for r in with_ttft], [r["ttft"] for r in with_ttft], s=10,
              label="TTFT")
    bad = [r for r in reqs if not r["ok"]]
    if bad:
        a.scatter([r["start"] + (r["e2e"] or 0.0) for r in bad], [r["e2e"] or 0.0 for r in bad],
                  s=14, marker="x", color="red", label=f"failed ({len(bad)})")
    a.set_ylabel("latency (s), at the time it ended")
    a.set_title(title or "latency over time")
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
    if server and server.get("series"):
        s = server["series"]
        t = [p["t"] for p in s]
        b.plot(t, [p["kv_used"] for p in s], label="KV blocks used")
        total = server.get("kv_blocks_total")
        if total:
            b.axhline(total, color="gray", linestyle=":", label=f"KV blocks total ({total:g})")
        b.set_ylabel("KV blocks")
        c = b.twinx()
        c.plot(t, [p["running"] for p in s], color="tab:green", alpha=0.7, label="running")
        c.plot(t, [p["waiting"] for p in s], color="tab:red", alpha=0.7, label="waiting")
        c.set_ylabel("sequences")
        c.legend(fontsize=8, loc="upper right")
        b.legend(fontsize=8, loc="upper left")
    else:
        b.text(0.5, 0.5, "no server metrics scraped", ha="center", va="center",
               transform=b.transAxes)
    b.set_xlabel("time since start (s)")
    b.grid(alpha=0.3)
    return _save(fig, path)


def plot_goodput(points: list[dict[str, Any]], capacity: float | None, path: Path,
                 target_share: float = 0.9) -> Path:
    """Goodput (req/s) and SLO attainment against offered rate."""
    fig, a = plt.subplots(figsize=(8, 4.5))
    rates = [p["rate"] for p in points]
    a.plot(rates, rates, color="gray", linestyle=":", label="offered")
    a.plot(rates, [p["goodput_rps"] for p in points], marker="o", label="goodput")
    a.plot(rates, [p["request_throughput"] for p in points], marker=".", alpha=0.6,
           label="throughput")
    a.set_xlabel("offered rate (requests/s)")
    a.set_ylabel("requests/s")
    a.grid(alpha=0.3)
    b = a.twinx()
    b.plot(rates, [p["goodput_share"] for p in points], color="tab:purple", marker="s",
           alpha=0.6, label="within SLO (share)")
    b.axhline(target_share, color="tab:purple", linestyle="--", linewidth=1)
    b.set_ylim(0, 1.05)
    b.set_ylabel("share within SLO")
    if capacity is not None:
        a.axvline(capacity, color="red", linestyle="--", linewidth=1,
                  label=f"capacity {capacity:g}/s")
    a.legend(fontsize=8, loc="upper left")
    b.legend(fontsize=8, loc="lower right")
    a.set_title(f"goodput vs offered rate (capacity: highest rate with >= "
                f"{target_share:.0%} within SLO)")
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
