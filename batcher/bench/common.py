"""Helpers shared by every bench: workload files, percentiles, the machine line, BENCHMARKS.md."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from batcher.system.cpuinfo import cpuinfo_field
from batcher.workloads import DEFAULT_WORKLOAD

# The repository root when run from a checkout (installed, the folder above the package).
ROOT = Path(__file__).resolve().parents[2]
# Relative: results go to the current directory's BENCHMARKS.md, never into an installed package
# (run from a checkout's root, that is the tracked file).
BENCHMARKS = Path("BENCHMARKS.md")
__all__ = ["DEFAULT_WORKLOAD"]


def load_workload(path: str | os.PathLike[str] | None = None, limit: int | None = None
                  ) -> list[dict]:
    """Requests of a workload file: id, prompt_ids (list of int), prompt_text, max_new_tokens."""
    data = json.loads(Path(path or DEFAULT_WORKLOAD).read_text())
    reqs = data["requests"] if isinstance(data, dict) else data
    out = []
    for r in reqs[:limit]:
        ids = r["prompt_ids"]
        ids = json.loads(ids) if isinstance(ids, str) else ids
        out.append({"id": str(r.get("id", len(out))), "prompt_ids": [int(x) for x in ids],
                    "prompt_text": r.get("prompt_text"),
                    "max_new_tokens": int(r["max_new_tokens"])})
    return out


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no values (a table shows it as missing, not as zero)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def machine() -> str:
    cpu = cpuinfo_field("model name") or platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores"


def command_line() -> str:
    """This process's command line as a BENCHMARKS.md row shows it: `python -m PACKAGE ...` for a
    package run with `-m` (the bench scenarios: `python -m scripts.bench NAME ...`)."""
    script = os.path.relpath(sys.argv[0], ROOT) if os.path.isabs(sys.argv[0]) else sys.argv[0]
    if os.path.basename(script) == "__main__.py":
        script = "-m " + os.path.dirname(script).replace(os.sep, ".")
    return " ".join(["python", script, *map(shlex.quote, sys.argv[1:])])


def append_rows(title: str, header: list[str], rows: list[list[str]], notes: str = "",
                command: str | None = None, path: Path | None = None) -> str:
    """Append a dated table to BENCHMARKS.md and return it as text."""
    target = path or BENCHMARKS
    lines = [f"\n### {title} — {time.strftime('%Y-%m-%d %H:%M')}\n",
             f"`{command or command_line()}` on {machine()}\n",
             "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    if notes:
        lines += ["", notes]
    text = "\n".join(lines) + "\n"
    if not target.exists():
        target.write_text("# Benchmarks\n\nEvery row is written by a bench script; ratios are "
                          "measured side by side in the same run.\n")
    with target.open("a") as f:
        f.write(text)
    return text


def wait_until_up(url: str, proc: subprocess.Popen, timeout: float,
                  interval: float = 0.2) -> bool:
    """Poll `url` until it answers 200 (True), or until `proc` exits or `timeout` seconds pass
    (False): how a bench script waits for a server it started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(interval)
    return False
