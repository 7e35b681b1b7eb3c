"""Chunked prefill as a client sees it: streams' gaps over HTTP while a long prompt arrives.

8 streams decoding over HTTP while a ~2,000-token prompt arrives, on the bundled model at
`batcher serve`'s defaults, beside `--prefill-budget fixed` (the old fixed token budget), each
case in its own server, interleaved, one run.

    python -m scripts.bench chunked_client [--rounds 1] [--long 2000] [--flags "..."]

`--flags`: more `batcher serve` flags for every case. At the default TTFT SLO (2 s) a prompt
that cannot be read within the SLO beside running streams is refused (503 + Retry-After) while
they run, so the long prompt of this measurement needs a wider SLO there (`--slo-ttft-ms`).

Per case: the streams' gaps between SSE chunks as the client reads them (everything between the
model step and the socket counts: the event loop, detokenizing, the long request's own host
work), p50/p99 over the steady window before the long prompt arrives and p99/worst from its
arrival to its first token, their ratio (the goal: the p99 during at most 1.5x the steady p99),
and the long prompt's time to first token (the goal: at most 3x the fixed budget's).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson

from batcher.bench.common import append_rows, pct
from scripts.bench._shared import parser
from tests.server_process import serve

STREAMS = 8
STEADY_CHUNKS = 30  # each stream has this many chunks before the long prompt is sent
MAX_TOKENS = 400
CASES = {"default": (), "fixed": ("--prefill-budget", "fixed")}
EXTRA: list[str] = []


async def stream(session: aiohttp.ClientSession, url: str, i: int, times: list[float],
                 stop: asyncio.Event) -> None:
    body = {"prompt": f"Story {i}: the lighthouse keeper opened the door and",
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True}
    for _ in range(20):  # a refusal is retried after its Retry-After, as clients do
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status == 503:
                await resp.read()
                await asyncio.sleep(float(resp.headers.get("Retry-After", "1")))
                continue
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    times.append(time.perf_counter())
                if stop.is_set():
                    return
            return


async def long_prompt(session: aiohttp.ClientSession, url: str, n: int) -> str:
    """A text of about `n` tokens of the served model (measured with /tokenize)."""
    unit = "The quick brown fox jumps over the lazy dog near the river bank. "
    async with session.post(url + "/tokenize", json={"prompt": unit}) as resp:
        per = (await resp.json())["count"]
    return unit * max(1, n // per)


async def one_case(flags: tuple[str, ...], n_long: int) -> dict[str, float]:
    with serve("--model", "smollm2-135m", "--embedding-model", "minilm", "--log-level",
               "warning", *EXTRA, *flags, num_blocks=None, ready_timeout=300) as server:
        url = server.url
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            text = await long_prompt(s, url, n_long)
            async with s.post(url + "/v1/completions", json={
                    "prompt": "Warm up", "max_tokens": 8, "temperature": 0}) as resp:
                await resp.read()
            times: list[list[float]] = [[] for _ in range(STREAMS)]
            stop = asyncio.Event()
            tasks = []
            deadline = time.monotonic() + 300
            for i in range(STREAMS):  # one by one: admission would refuse none of them then
                tasks.append(asyncio.create_task(stream(s, url, i, times[i], stop)))
                while not times[i]:
                    assert time.monotonic() < deadline and not tasks[i].done(), (
                        tasks[i].exception() if tasks[i].done() else "no first token")
                    await asyncio.sleep(0.01)
            while min(len(t) for t in times) < STEADY_CHUNKS:
                assert time.monotonic() < deadline, "the streams did not start"
                await asyncio.sleep(0.01)
            arrive = time.perf_counter()
            async with s.post(url + "/v1/completions", json={
                    "prompt": text, "max_tokens": 1, "temperature": 0}) as resp:
                out = orjson.loads(await resp.read())
            first = time.perf_counter()
            assert resp.status == 200, out
            prompt_tokens = out["usage"]["prompt_tokens"]
            stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    steady, during = [], []
    for ts in times:
        for a, b in zip(ts, ts[1:]):
            if b <= arrive and a >= ts[5]:  # the streams' first chunks come while they start
                steady.append(b - a)
            elif arrive <= b <= first:
                during.append(b - a)
    return {"prompt_tokens": prompt_tokens, "ttft": first - arrive,
            "steady_p50": pct(steady, 50), "steady_p99": pct(steady, 99),
            "during_p99": pct(during, 99), "during_max": max(during, default=0.0)}


def main(argv: list[str]) -> int:
    p = parser(__name__, __doc__, first_paragraph=True)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--long", type=int, default=2000, help="tokens in the long prompt")
    p.add_argument("--no-write", action="store_true", help="print, do not append BENCHMARKS.md")
    p.add_argument("--flags", default="", help="more batcher serve flags for every case")
    args = p.parse_args(argv)
    EXTRA.extend(args.flags.split())
    results: dict[str, list[dict[str, float]]] = {c: [] for c in CASES}
    for r in range(args.rounds):
        for case, flags in CASES.items():
            got = asyncio.run(one_case(flags, args.long))
            results[case].append(got)
            print(f"round {r + 1} {case}: {got}", flush=True)
    fixed_ttft = min(g["ttft"] for g in results["fixed"])
    rows = []
    for case, runs in results.items():
        for i, g in enumerate(runs):
            ratio = g["during_p99"] / g["steady_p99"]
            flags = " ".join([*EXTRA, *CASES[case]]) or "defaults"
            rows.append([f"`{flags}` (round {i + 1})",
                         str(g["prompt_tokens"]),
                         f"{g['steady_p50'] * 1e3:.0f} / {g['steady_p99'] * 1e3:.0f}",
                         f"{g['during_p99'] * 1e3:.0f} / {g['during_max'] * 1e3:.0f}",
                         f"{ratio:.2f}x", f"{g['ttft'] * 1e3:,.0f}",
                         f"{g['ttft'] / fixed_ttft:.2f}x"])
    header = ["server", "long prompt tokens", "steady gap p50 / p99 ms",
              "gap while it is read p99 / max ms", "p99 during / steady", "its TTFT ms",
              "TTFT / fixed budget's"]
    title = (f"Chunked prefill at the client: {STREAMS} streams over HTTP while a "
             f"{args.long}-token prompt arrives, bundled model, defaults vs fixed budget")
    notes = ("Gaps between SSE chunks as the client reads them. Goals: p99 during at most "
             "1.5x the steady p99 at the defaults; the long prompt's TTFT at most 3x the fixed "
             "budget's. Cases alternate in one run, each in its own server.")
    if args.no_write:
        print(rows)
    else:
        print(append_rows(title, header, rows, notes))
    return 0

