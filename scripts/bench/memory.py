"""Resident memory of each server with the bundled model, beside llama.cpp's llama-server.

Every configuration in a process of its own on 127.0.0.1, one short completion sent, then its RSS
and peak RSS (VmRSS, VmHWM) read from /proc and the process stopped. Floors: a Python that only
imports torch, and one that imports the server's modules. llama.cpp's llama-server runs on the
same GGUF file when it has been built (`python -m scripts.bench peers --build-only`).

Usage: python -m scripts.bench memory [--context 8192] [--no-append]
The KV cache is sized alike on both sides for the matched rows: --context tokens (llama-server -c,
batcher --num-blocks context / block size), both 16-bit. Appends a table to BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from batcher.bench.common import append_rows, wait_until_up
from batcher.fleet.launcher import free_port  # below the ephemeral range, never twice
from scripts.bench._shared import ROOT, parser

READY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
BLOCK_SIZE = 16
PEER_BINARIES = (ROOT / ".cache/peers/llama-server", ROOT / ".cache/peers/build/bin/llama-server")
# What `batcher serve` imports before it loads anything: its modules and the whole command line.
IMPORT_SERVER = ("import batcher.app.serve, batcher.models.loader, batcher.runtime.model_runner, "
                 "batcher.tokenizer.tokenizer, batcher.app.cli; batcher.app.cli.build_parser()")


@dataclass(slots=True)
class Row:
    label: str
    rss_mib: float | None
    peak_mib: float | None
    anon_mib: float | None = None
    note: str = ""


def _status(pid: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024
    return out


def _complete(base: str) -> str:
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 8,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        return json.loads(r.read())["choices"][0]["text"]


def measure_server(label: str, argv: list[str], port: int, ready_path: str) -> Row:
    """Start `argv` (listening on `port`), wait until `ready_path` answers 200, send one
    completion, read the memory, stop it (SIGTERM to its group, SIGKILL after 20 s)."""
    log = open(ROOT / "bench_out" / f"memory-{port}.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        if not wait_until_up(base + ready_path, proc, READY_TIMEOUT_S, interval=0.5):
            raise RuntimeError(f"{label}: not ready (exit {proc.poll()}); see {log.name}")
        text = _complete(base)
        st = _status(proc.pid)
        print(f"# {label}: {st} -> {text!r}", flush=True)
        return Row(label, st["VmRSS"], st["VmHWM"], st.get("RssAnon"))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()


def measure_import(label: str, code: str) -> Row:
    """A Python that runs `code` and reports its own memory."""
    probe = (f"{code}\nfor line in open('/proc/self/status'):\n"
             "    k, _, v = line.partition(':')\n"
             "    if k in ('VmRSS', 'VmHWM', 'RssAnon'): print(k, int(v.split()[0]) / 1024)\n")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=300, cwd=ROOT)
    st = {k: float(v) for k, v in (line.split() for line in res.stdout.splitlines())}
    print(f"# {label}: {st}", flush=True)
    return Row(label, st["VmRSS"], st["VmHWM"], st["RssAnon"])


def first_write_cost(tokens: int = 2048, rounds: int = 5) -> tuple[float, float]:
    """ms to write `tokens` tokens of the bundled model's K/V (every layer, bf16) into a pool
    fresh from `lazy_zeros` (pages faulted in by the write) and into the same pool written
    before; best of `rounds`, interleaved. One torch thread: on a loaded machine a parallel
    region on the main thread can stall a scheduler time slice per call (BENCHMARKS.md, "Where
    the thread stall lives"), which would hide the page faults this measures."""
    import torch

    from batcher.runtime.kv_cache import lazy_zeros

    torch.set_num_threads(1)

    layers, kv_heads, head_dim = 30, 3, 64
    src = torch.randn(tokens, kv_heads, head_dim).to(torch.bfloat16)
    fresh, again = [], []
    for _ in range(rounds):
        pool = [lazy_zeros((tokens, kv_heads, head_dim), torch.bfloat16) for _ in range(2 * layers)]
        for times in (fresh, again):
            t0 = time.perf_counter()
            for t in pool:
                t.copy_(src)
            times.append(1000 * (time.perf_counter() - t0))
    return min(fresh), min(again)


def main(argv: list[str]) -> None:
    p = parser(__name__, __doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=8192,
                   help="KV cache tokens of the matched rows (default: %(default)s)")
    p.add_argument("--no-append", action="store_true", help="print only, no BENCHMARKS.md row")
    a = p.parse_args(argv)
    (ROOT / "bench_out").mkdir(exist_ok=True)
    from batcher.bundled import smollm2_gguf_path

    gguf = str(smollm2_gguf_path())
    rows = [measure_import("python -c 'import torch'", "import torch"),
            measure_import("python -c 'import batcher.app.serve, ...' (the server's modules)",
                           IMPORT_SERVER)]
    serve = [sys.executable, "-m", "batcher.app.cli", "serve", "--host", "127.0.0.1",
             "--log-level", "warning"]
    matched = ["--embedding-model", "none", "--num-blocks", str(a.context // BLOCK_SIZE)]
    configs = [
        ("batcher serve (defaults: --quantization auto, no dense copy, 2 GiB KV, embedding "
         "model)", []),
        ("... defaults with the dense copy (--quantized-dense-above 8)",
         ["--quantized-dense-above", "8"]),
        (f"batcher serve, {a.context}-token KV, no embedding model, --quantization none",
         [*matched, "--quantization", "none"]),
        ("... --quantization int4 --quantized-dense-above 8 (the dense copy)",
         [*matched, "--quantization", "int4", "--quantized-dense-above", "8"]),
        ("... --quantization int4 --quantized-dense-above 0",
         [*matched, "--quantization", "int4", "--quantized-dense-above", "0"]),
        # The one-stream configuration: its compiled graph and the compiler's modules resident.
        ("... --quantization int4 --quantized-dense-above 0 --compile-decode",
         [*matched, "--quantization", "int4", "--quantized-dense-above", "0",
          "--compile-decode"]),
    ]
    for label, extra in configs:
        port = free_port()
        rows.append(measure_server(label, [*serve, "--port", str(port), *extra], port, "/ready"))
    binary = next((b for b in PEER_BINARIES if b.is_file() and os.access(b, os.X_OK)), None)
    # PEER_ARGS: extra llama-server flags, as for the peers scenario (--no-repack where its AMX
    # matmul crashes at load).
    peer_extra = os.environ.get("PEER_ARGS", "").split()
    peer_label = " ".join(["llama-server -c", str(a.context), *peer_extra,
                           "(same GGUF, f16 KV)"])
    if binary is None:
        rows.append(Row(peer_label, None, None, note="not built: run `python -m scripts.bench "
                        "peers --build-only`"))
    else:
        port = free_port()
        rows.append(measure_server(peer_label, [
            str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
            "-c", str(a.context), "-np", "1", "-t", "2", *peer_extra], port, "/health"))
    peer = rows[-1].rss_mib

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    table = [[r.label, fmt(r.rss_mib), fmt(r.peak_mib), fmt(r.anon_mib),
              "-" if r.rss_mib is None or peer is None else f"x{r.rss_mib / peer:.2f}",
              r.note] for r in rows]
    for r in table:
        print(" | ".join(r))
    fresh, again = first_write_cost()
    fault_note = (f" The KV pool's pages become resident as they are first written: writing "
                  f"2048 tokens of K/V (all 30 layers, bf16, 45 MiB) took {fresh:.1f} ms into "
                  f"fresh pages vs {again:.1f} ms into written ones (best of 5), the one-time "
                  "cost of not touching the whole pool at start.")
    print(fault_note)
    if not a.no_append:
        load = os.getloadavg()[0]
        append_rows(
            "Resident memory of each server, bundled model (scripts/bench/memory.py)",
            ["process", "RSS MiB", "peak RSS MiB", "anonymous MiB", "x llama-server", "note"],
            table,
            notes=(f"One process per row, in turn; RSS and peak (VmRSS, VmHWM) after one "
                   f"8-token completion. Shared machine, load average {load:.1f} at the end "
                   "(memory does not depend on it)." + fault_note))

