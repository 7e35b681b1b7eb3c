"""Side-by-side table of a peer comparison (`python -m scripts.bench peers`): both rows per round,
the ratios, one CDF plot with both servers, appended to BENCHMARKS.md.

    python -m batcher.bench.peers bench_out/peers --rounds 1 \\
        --command "python -m scripts.bench peers"
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import orjson

from batcher.bench import plots
from batcher.bench.common import append_rows
from batcher.bench.report import TABLE_HEADER, markdown_table, server_lines, table_row

TITLE = "Peers: chat64, all at t=0, batcher serve vs llama.cpp llama-server (same GGUF)"
SINGLE_TITLE = ("Peers: one stream (100-token prompt, 128 greedy tokens, one user), batcher serve "
                "vs llama.cpp llama-server (same GGUF)")


def load(path: Path) -> dict[str, Any]:
    return orjson.loads((path / "report.json").read_bytes())


def ratios(ours: list[dict[str, Any]], peer: list[dict[str, Any]]) -> dict[str, float]:
    """Ratios of the per-round medians: output tok/s (higher is better for us when > 1) and p50
    TTFT (ours / peer: lower is better when < 1)."""
    def med(runs: list[dict[str, Any]], f: Any) -> float:
        return statistics.median(f(r["summary"]) for r in runs)

    tok = med(ours, lambda s: s["output_tok_s"]) / med(peer, lambda s: s["output_tok_s"])
    ttft = med(ours, lambda s: s["ttft_ms"]["p50"]) / med(peer, lambda s: s["ttft_ms"]["p50"])
    return {"output_tok_s": tok, "ttft_p50": ttft}


CONTENDED = 0.25  # background cores above which a run's timings are not comparable


def background(doc: dict[str, Any]) -> float | None:
    cpu = doc.get("cpu")
    return None if cpu is None else float(cpu["background"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out", type=Path)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--command", default="python -m scripts.bench peers")
    p.add_argument("--no-append", action="store_true", help="print only")
    p.add_argument("--single", action="store_true", help="a one-stream run: its target is "
                   "0.9x the peer's output tok/s")
    p.add_argument("--title", help="the BENCHMARKS.md section's title (default: chat64's, or the "
                   "one stream's with --single)")
    args = p.parse_args(argv)
    rounds = [(load(args.out / f"llama-{i}"), load(args.out / f"batcher-{i}"))
              for i in range(1, args.rounds + 1)]
    header = [*TABLE_HEADER, "background CPU"]
    rows = [[*table_row(d["label"], d["summary"]),
             "—" if (b := background(d)) is None else f"{b:.2f} cores"]
            for pair in rounds for d in pair]
    # A round where either run shared the CPUs with other work compares the neighbours' load,
    # not the servers: take the ratios from clean rounds when there are any, and say which.
    clean = [r for r in rounds if all((background(d) or 0.0) <= CONTENDED for d in r)]
    used = clean or rounds
    r = ratios([o for _, o in used], [p for p, _ in used])
    which = (f"{len(clean)} of {len(rounds)} rounds without background load" if clean else
             f"all {len(rounds)} rounds, every one with background load > {CONTENDED} cores: "
             "the ratio is not trustworthy")
    target = 0.9 if args.single else 2.0  # one stream; batch throughput
    verdict = (f"batcher / llama-server ({which}): output tok/s x{r['output_tok_s']:.2f} "
               f"(target >= {target:.2f}), p50 TTFT x{r['ttft_p50']:.2f}"
               + ("" if args.single else " (target < 1)"))
    docs = [d for pair in rounds for d in pair]
    mismatched = [d["label"] for d in docs if d["summary"]["length_mismatches"]]
    last_ours = used[-1][1]
    notes = [f"- {verdict}"] + [f"- batcher server view ({last_ours['label']}): {line}"
                                for line in server_lines(last_ours["server"])]
    if mismatched:
        notes.append(f"- answers not of the asked length in: {', '.join(mismatched)}")
    print(markdown_table(rows, header) + "\n" + "\n".join(notes))
    peer_doc, our_doc = used[-1]
    plots.plot_cdfs({d["label"]: d["requests"] for d in (peer_doc, our_doc)},
                    args.out / "peers_cdf.png")
    print(f"\nplot: {args.out / 'peers_cdf.png'}")
    if not args.no_append:
        title = args.title or (SINGLE_TITLE if args.single else TITLE)
        append_rows(title, header, rows, "\n".join(notes), args.command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
