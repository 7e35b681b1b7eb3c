"""PNG plots of simulator runs and studies (matplotlib, Agg backend; imported only to plot)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from batcher.sim.metrics import FleetResult


def _save(fig, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def per_second(res: FleetResult, t_end: float, value: str = "good") -> tuple[list, list]:
    """Per-second bins by arrival: goodput share ("good"), p99 TTFT ("ttft99"), or requests."""
    n = math.ceil(t_end)
    bins: list[list[int]] = [[] for _ in range(n)]
    for i, a in enumerate(res.arrival):
        k = int(a)
        if k < n:
            bins[k].append(i)
    xs, ys = [], []
    for k, idx in enumerate(bins):
        if not idx:
            continue
        xs.append(k + 0.5)
        if value == "good":
            ys.append(sum(res.good[i] for i in idx) / len(idx))
        elif value == "ttft99":
            v = sorted(res.ttft[i] for i in idx if not math.isnan(res.ttft[i]))
            ys.append(v[min(len(v) - 1, round(0.99 * (len(v) - 1)))] if v else math.nan)
        else:
            ys.append(float(len(idx)))
    return xs, ys


def cdf(ax, values: Sequence[float], label: str) -> None:
    v = sorted(x for x in values if not math.isnan(x))
    if v:
        ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=label)


def plot_run(res: FleetResult, path: str | Path, title: str) -> None:
    """TTFT and TPOT CDFs, and per-second goodput, KV use and queue over the run."""
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    cdf(ax[0][0], res.ttft, "TTFT")
    ax[0][0].set(xlabel="s", ylabel="share of requests", title="TTFT", xscale="log")
    cdf(ax[0][1], res.tpot, "TPOT")
    ax[0][1].set(xlabel="s", title="TPOT")
    t_end = max(res.series["t"], default=1.0)
    xs, ys = per_second(res, t_end)
    ax[1][0].plot(xs, ys)
    ax[1][0].set(xlabel="arrival time s", ylabel="goodput share", ylim=(0, 1.05))
    s = res.series
    ax[1][1].plot(s["t"], s["kv_mean"], label="KV use, mean")
    ax[1][1].plot(s["t"], s["kv_max"], label="KV use, max")
    ax[1][1].set(xlabel="s", ylabel="share of blocks")
    ax[1][1].legend(loc="upper left")
    fig.suptitle(title)
    _save(fig, path)


def plot_compare(results: dict[str, FleetResult], path: str | Path, title: str,
                 series: tuple[str, ...] = ("good",)) -> None:
    """One line per run over time for each of `series` (per second of arrival: "good" is the
    goodput share, "ttft99" the p99 TTFT), then the runs' TTFT CDFs."""
    labels = {"good": "goodput share", "ttft99": "p99 TTFT s", "count": "requests"}
    fig, ax = plt.subplots(1, len(series) + 1, figsize=(5.5 * (len(series) + 1), 4.5))
    for name, res in results.items():
        t_end = max(res.series["t"], default=1.0)
        for a, what in zip(ax, series, strict=False):
            xs, ys = per_second(res, t_end, what)
            a.plot(xs, ys, label=name, lw=1)
        cdf(ax[-1], res.ttft, name)
    for a, what in zip(ax, series, strict=False):
        a.set(xlabel="arrival time s", ylabel=labels[what])
        if what == "ttft99":
            a.set_yscale("log")
    ax[-1].set(xlabel="TTFT s", ylabel="share of requests", xscale="log")
    ax[0].legend(fontsize=8)
    fig.suptitle(title)
    _save(fig, path)


def plot_bars(names: list[str], metrics: dict[str, list[float]], path: str | Path,
              title: str) -> None:
    """One panel per metric, one bar per run."""
    fig, ax = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 4))
    for a, (label, vals) in zip(ax, metrics.items(), strict=True):
        a.bar(range(len(names)), vals)
        a.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        a.set_title(label)
    fig.suptitle(title)
    _save(fig, path)


def plot_xy(xs: list[float], lines: dict[str, list[float]], path: str | Path, title: str,
            xlabel: str, ylabel: str, logy: bool = False, logx: bool = False,
            ylim: tuple[float, float] | None = (0.0, 1.05)) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, ys in lines.items():
        ax.plot(xs, ys, marker="o", label=name)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if ylim is not None and not logy:
        ax.set_ylim(*ylim)
    if logy:
        ax.set_yscale("log")
    if logx:
        ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    _save(fig, path)
