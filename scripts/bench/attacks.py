"""Another tenant's latency and `/health` while each hardened attack runs against a server.

    python -m scripts.bench attacks [--seconds 10] [--append]

One `batcher serve` (the tiny random-weight model) with two tenants, `victim` and `attacker`.
Phases of `--seconds` each, one after another: the victim alone, then each attack on its own,
then the victim alone again (for drift; not judged). In every phase the victim sends a plain
completion (`"hello"`, 16 tokens, temperature 0) in a closed loop and `/health` is polled every
50 ms; the attacker runs in its own process (so its client-side work does not stall the
measuring event loop) and reports what the server answered it:

1. slow bodies: 40 connections announcing `Content-Length: 1000000`, then a byte every 2 s
   (reconnecting once cut off), as tests/reliability/test_slow_body.py;
2. huge prompts: 4 concurrent 4 MB prompts (`"a " * 2_000_000`, `max_tokens: 1`) in a loop, as
   tests/reliability/test_prompt_bounds.py;
3. an ambiguous grammar: 4 streams of 200 tokens with `ignore_eos` in a loop, as
   tests/reliability/test_grammar_budget.py;
4. JSON nested 2,000 deep (`guided_json` as a string, a chat message's content, the prompt),
   2 loops, as tests/reliability/test_malformed_depth.py;
5. a batch: a 5,000-line JSONL uploaded to /v1/files, a batch created from it and left to run
   (cancelled at the end of the phase).

Server flags as those tests need them: `BATCHER_BODY_TIMEOUT=2` (body deadline 2 s plus 1 MB at
256 KiB/s: 5.8 s), `--max-body-bytes` 8 MiB (a 4 MB prompt is read and refused for its length,
not for its size), `--data-dir` in a temporary folder, `--log-level warning`.

Bounds per attack: the victim's p99 at most 2x its p99 alone (+20 ms for jitter at such small
figures), and `/health` at most 500 ms throughout. `--append` appends the table to
RELIABILITY.md. Exit status 1 when an attack misses a bound.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import aiohttp
import orjson

from batcher.bench.common import append_rows
from scripts.bench._shared import command as bench_command
from scripts.bench._shared import parser, rerun

PHASE_S = 10.0
KEY_ENV = "BENCH_ATTACK_KEY"
TAG = uuid.uuid4().hex[:12]
VICTIM_KEY = f"victim-{TAG}"
ATTACKER_KEY = f"attacker-{TAG}"
BODY_LIMIT = 8 * 2**20
SERVER_ENV = {"BATCHER_BODY_TIMEOUT": "2"}
VICTIM_MAX = 5000  # requests per phase at most (the phase's time ends it first)
HEALTH_EVERY_S = 0.05
HEALTH_TIMEOUT_S = 5.0
P99_FACTOR = 2.0
P99_JITTER_S = 0.020
HEALTH_BOUND_S = 0.5

SLOW_CONNECTIONS = 40
SLOW_GAP_S = 2.0
HUGE_CONCURRENT = 4
GRAMMAR_STREAMS = 4
AMBIGUOUS = 'start: e\ne: e e | e "+" e | "(" e ")" | /[a-z]+/ | " "\n'
DEEP = 2000
DEEP_LOOPS = 2
BATCH_LINES = 5000
ROUNDS_MAX = 20_000  # requests (or connections) per attacking worker at most

ATTACKS = {
    "slow": f"slow bodies: {SLOW_CONNECTIONS} connections, `Content-Length: 1000000`, "
            f"a byte every {SLOW_GAP_S:g} s",
    "huge": f"huge prompts: {HUGE_CONCURRENT} concurrent 4 MB prompts, in a loop",
    "grammar": f"ambiguous grammar: {GRAMMAR_STREAMS} streams, 200 tokens, `ignore_eos`, "
               "in a loop",
    "deep": f"JSON nested {DEEP:,} deep, {DEEP_LOOPS} loops",
    "batch": f"batch: {BATCH_LINES:,}-line upload, then a batch of it",
}
CODE = re.compile(rb'"code"\s*:\s*"([^"]{1,60})"')


def label(status: int | str, raw: bytes = b"") -> str:
    """`status` and the error code in the body, if any."""
    m = CODE.search(raw[:4000]) if raw else None
    return f"{status} {m.group(1).decode()}" if m else str(status)


# The attacker (its own process) ---------------------------------------------------------------

def _nest(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


async def _bounded_loop(until: float, out: Counter, one) -> None:
    """Call `one()` until the phase ends, ROUNDS_MAX times at most; count what it returns."""
    for _ in range(ROUNDS_MAX):
        if time.monotonic() >= until:
            return
        try:
            out[await one()] += 1
        except (aiohttp.ClientError, ConnectionError, TimeoutError) as exc:
            out[type(exc).__name__] += 1
            await asyncio.sleep(0.1)


async def attack_slow(s: aiohttp.ClientSession, url: str, auth: dict, until: float,
                      out: Counter) -> None:
    host, _, port = url.removeprefix("http://").partition(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: {auth['Authorization']}\r\nContent-Length: 1000000\r\n\r\n").encode()

    async def one() -> str:
        reader, writer = await asyncio.open_connection(host, int(port))
        got, outcome = b"", "still sending at the end"
        try:
            writer.write(head)
            while time.monotonic() < until:
                writer.write(b" ")
                await writer.drain()
                try:
                    chunk = await asyncio.wait_for(reader.read(4096),
                                                   min(SLOW_GAP_S, until - time.monotonic()))
                except TimeoutError:
                    continue
                got += chunk
                if b"\r\n\r\n" in got:  # answered: its body (the error code) follows
                    try:
                        got += await asyncio.wait_for(reader.read(4096), 0.2)
                    except TimeoutError:
                        pass
                    break
                if not chunk:
                    break
            if got:
                outcome = label(got.split(b" ", 2)[1].decode(errors="replace"), got)
            elif time.monotonic() < until:
                outcome = "closed"
        except ConnectionError:
            outcome = "reset"
        finally:
            writer.close()
        if time.monotonic() < until:
            await asyncio.sleep(0.2)  # a prompt answer is not a reason to flood
        return outcome

    await asyncio.gather(*(_bounded_loop(until, out, one) for _ in range(SLOW_CONNECTIONS)))


async def _post(s: aiohttp.ClientSession, url: str, body: bytes, auth: dict) -> str:
    async with s.post(url, data=body, headers={**auth, "Content-Type": "application/json"}
                      ) as resp:
        return label(resp.status, await resp.read())


async def attack_huge(s: aiohttp.ClientSession, url: str, auth: dict, until: float,
                      out: Counter) -> None:
    body = orjson.dumps({"prompt": "a " * 2_000_000, "max_tokens": 1})
    await asyncio.gather(*(
        _bounded_loop(until, out, lambda: _post(s, url + "/v1/completions", body, auth))
        for _ in range(HUGE_CONCURRENT)))


async def attack_grammar(s: aiohttp.ClientSession, url: str, auth: dict, until: float,
                         out: Counter) -> None:
    body = {"prompt": "expression:", "max_tokens": 200, "ignore_eos": True, "stream": True,
            "guided_grammar": AMBIGUOUS}

    async def one() -> str:
        async with s.post(url + "/v1/completions", json=body, headers=auth) as resp:
            if resp.status != 200:
                return label(resp.status, await resp.read())
            error, done = None, False
            async for line in resp.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                    break
                if line.startswith(b"data: {") and b'"error"' in line:
                    m = CODE.search(line)
                    error = m.group(1).decode() if m else "without a code"
            what = f"200 stream, error {error}" if error else "200 stream finished"
            return what if done else what + " (no [DONE])"

    await asyncio.gather(*(_bounded_loop(until, out, one) for _ in range(GRAMMAR_STREAMS)))


async def attack_deep(s: aiohttp.ClientSession, url: str, auth: dict, until: float,
                      out: Counter) -> None:
    bodies = [
        ("/v1/completions", '{"prompt":"hi","max_tokens":2,"guided_json":'
         + json.dumps(_nest(DEEP)) + "}"),
        ("/v1/chat/completions", '{"messages":[{"role":"user","content":' + _nest(DEEP)
         + '}],"max_tokens":2}'),
        ("/v1/completions", '{"prompt":' + _nest(DEEP) + ',"max_tokens":2}'),
    ]
    raw = [(url + path, body.encode()) for path, body in bodies]

    def looper():
        i = iter(range(10**9))

        async def one() -> str:
            target, body = raw[next(i) % len(raw)]
            return await _post(s, target, body, auth)
        return one

    await asyncio.gather(*(_bounded_loop(until, out, looper()) for _ in range(DEEP_LOOPS)))


async def attack_batch(s: aiohttp.ClientSession, url: str, auth: dict, until: float,
                       out: Counter) -> None:
    lines = b"".join(orjson.dumps({
        "custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
        "body": {"model": "tiny", "prompt": f"line {i}", "max_tokens": 4, "ignore_eos": True}})
        + b"\n" for i in range(BATCH_LINES))
    form = (b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--B\r\n'
            b'Content-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            b"Content-Type: application/jsonl\r\n\r\n" + lines + b"\r\n--B--\r\n")
    async with s.post(url + "/v1/files", data=form, headers={
            **auth, "Content-Type": "multipart/form-data; boundary=B"}) as resp:
        raw = await resp.read()
        out["upload " + label(resp.status, raw)] += 1
        if resp.status != 200:
            return
        file_id = orjson.loads(raw)["id"]
    async with s.post(url + "/v1/batches", json={
            "input_file_id": file_id, "endpoint": "/v1/completions",
            "completion_window": "24h"}, headers=auth) as resp:
        raw = await resp.read()
        out["create " + label(resp.status, raw)] += 1
        if resp.status != 200:
            return
        batch_id = orjson.loads(raw)["id"]
    counts: dict = {}
    while time.monotonic() < until:
        await asyncio.sleep(min(1.0, max(0.0, until - time.monotonic())))
        async with s.get(f"{url}/v1/batches/{batch_id}", headers=auth) as resp:
            if resp.status == 200:
                got = await resp.json()
                counts = got.get("request_counts") or counts
                if got.get("status") in ("completed", "failed", "expired", "cancelled"):
                    break
    out[f"lines done by the end {counts.get('completed', 0)}"] += 1
    async with s.post(f"{url}/v1/batches/{batch_id}/cancel", headers=auth) as resp:
        out["cancel " + label(resp.status, await resp.read())] += 1


ATTACK_FNS = {"slow": attack_slow, "huge": attack_huge, "grammar": attack_grammar,
              "deep": attack_deep, "batch": attack_batch}


async def attacker(name: str, url: str, seconds: float) -> dict:
    auth = {"Authorization": f"Bearer {os.environ[KEY_ENV]}"}
    out: Counter = Counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=60)) as s:
        print("ready", flush=True)
        cpu = time.process_time()
        until = time.monotonic() + seconds
        task = asyncio.create_task(ATTACK_FNS[name](s, url, auth, until, out))
        try:
            await asyncio.wait_for(task, seconds + 20)
        except TimeoutError:
            out["unfinished 20 s after the phase"] += 1
    return {"outcomes": dict(out), "cpu_s": time.process_time() - cpu}


# The measuring side ---------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float:
    from batcher.bench.common import pct as common_pct
    return common_pct(values, q)


async def victim(s: aiohttp.ClientSession, url: str, until: float, lat: list[float],
                 statuses: Counter) -> None:
    body = orjson.dumps({"prompt": "hello", "max_tokens": 16, "temperature": 0})
    headers = {"Authorization": f"Bearer {VICTIM_KEY}", "Content-Type": "application/json"}
    for _ in range(VICTIM_MAX):
        if time.monotonic() >= until:
            return
        start = time.perf_counter()
        try:
            async with s.post(url + "/v1/completions", data=body, headers=headers) as resp:
                raw = await resp.read()
                status: int | str = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            status, raw = type(exc).__name__, b""
        took = time.perf_counter() - start
        statuses[label(status, raw) if status != 200 else "200"] += 1
        if status == 200:
            lat.append(took)
        else:
            await asyncio.sleep(0.05)


async def health(s: aiohttp.ClientSession, url: str, until: float, lat: list[float],
                 failures: Counter) -> None:
    timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
    while time.monotonic() < until:
        start = time.perf_counter()
        try:
            async with s.get(url + "/health", timeout=timeout) as resp:
                await resp.read()
                if resp.status != 200:
                    failures[str(resp.status)] += 1
        except (aiohttp.ClientError, TimeoutError) as exc:
            failures[type(exc).__name__] += 1
        lat.append(time.perf_counter() - start)
        await asyncio.sleep(HEALTH_EVERY_S)


async def settle(s: aiohttp.ClientSession, url: str, within: float = 30.0) -> None:
    """Wait until nothing runs or waits (what an attack left behind drains), then 1 s more."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        async with s.get(url + "/v1/state") as resp:
            st = await resp.json()
        if st.get("running", 0) == 0 and st.get("waiting", 0) == 0:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)


async def phase(s: aiohttp.ClientSession, url: str, attack: str | None, seconds: float
                ) -> dict:
    proc = None
    if attack is not None:
        proc = await asyncio.create_subprocess_exec(
            *rerun(__name__, "--attacker", attack, "--url", url, "--seconds", str(seconds)),
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, KEY_ENV: ATTACKER_KEY})
        assert proc.stdout is not None
        first = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert first.strip() == b"ready", f"the attacker did not start: {first!r}"
    lat: list[float] = []
    hlat: list[float] = []
    statuses: Counter = Counter()
    hfail: Counter = Counter()
    until = time.monotonic() + seconds
    await asyncio.gather(victim(s, url, until, lat, statuses), health(s, url, until, hlat, hfail))
    outcomes: dict[str, int] = {}
    cpu_s = None
    if proc is not None:
        assert proc.stdout is not None
        try:
            rest = await asyncio.wait_for(proc.stdout.read(), seconds + 60)
            await proc.wait()
            report = json.loads(rest.decode().strip().splitlines()[-1])
            outcomes, cpu_s = report["outcomes"], report["cpu_s"]
        except (TimeoutError, IndexError, KeyError, ValueError) as exc:
            outcomes = {f"attacker failed ({type(exc).__name__})": 1}
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    return {"lat": lat, "hlat": hlat, "statuses": statuses, "hfail": hfail,
            "outcomes": outcomes, "cpu_s": cpu_s}


async def run_all(seconds: float) -> tuple[list[tuple[str, dict]], int]:
    from tests.server_process import serve, write_tenants

    budget = {"tokens_per_minute": 1e9, "max_concurrent": 16}
    with tempfile.TemporaryDirectory(prefix="bench-attacks-") as tmp:
        tenants = write_tenants(Path(tmp) / "tenants.toml", {
            "victim": {"key": VICTIM_KEY, **budget}, "attacker": {"key": ATTACKER_KEY, **budget}})
        with serve("--tenants", str(tenants), "--data-dir", str(Path(tmp) / "data"),
                   "--max-body-bytes", str(BODY_LIMIT), "--log-level", "warning",
                   env=SERVER_ENV, check_log=False) as server:
            url = server.url
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=60)) as s:
                await phase(s, url, None, 3.0)  # warm-up, not reported
                results = []
                for attack in [None, *ATTACKS, None]:
                    name = attack or ("none (alone)" if not results else "none (after)")
                    got = await phase(s, url, attack, seconds)
                    results.append((name if attack is None else attack, got))
                    print(f"{name}: {len(got['lat'])} victim requests, p99 "
                          f"{pct(got['lat'], 99) * 1e3:.0f} ms, /health max "
                          f"{max(got['hlat'], default=0) * 1e3:.0f} ms, attacker "
                          f"{got['outcomes']}", flush=True)
                    await settle(s, url)
            tracebacks = server.log().count("Traceback")
    return results, tracebacks


def fmt_counts(c: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1])) or "-"


def main(argv: list[str]) -> int:
    p = parser(__name__, __doc__, first_paragraph=True)
    p.add_argument("--seconds", type=float, default=PHASE_S, help="length of each phase")
    p.add_argument("--append", action="store_true", help="append the table to RELIABILITY.md")
    p.add_argument("--attacker", choices=sorted(ATTACK_FNS), help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.attacker:
        print(json.dumps(asyncio.run(attacker(args.attacker, args.url, args.seconds))),
              flush=True)
        return 0

    gc.collect()
    gc.freeze()  # the measuring process's collector stays out of the figures
    results, tracebacks = asyncio.run(run_all(args.seconds))
    alone = pct(results[0][1]["lat"], 99)
    rows, verdicts, failed = [], [], False
    for name, got in results:
        p50, p99 = pct(got["lat"], 50), pct(got["lat"], 99)
        hmax = max(got["hlat"], default=float("nan"))
        non200 = sum(v for k, v in got["statuses"].items() if k != "200")
        attack = name in ATTACKS
        if attack:
            ok_p99 = p99 <= P99_FACTOR * alone + P99_JITTER_S
            ok_health = hmax <= HEALTH_BOUND_S and not got["hfail"]
            verdict = "PASS" if ok_p99 and ok_health else "FAIL"
            failed |= verdict == "FAIL"
            refused = {k: v for k, v in got["statuses"].items() if k != "200"}
            extra = f"; victim non-200: {fmt_counts(refused)}" if non200 else ""
            hf = f"; /health failures: {fmt_counts(got['hfail'])}" if got["hfail"] else ""
            verdicts.append(
                f"{verdict} {name}: victim p99 {p99 * 1e3:.1f} ms "
                f"{'<=' if ok_p99 else '>'} 2 x {alone * 1e3:.1f} + 20 ms; /health max "
                f"{hmax * 1e3:.1f} ms {'<=' if hmax <= HEALTH_BOUND_S else '>'} 500 ms{hf}{extra}")
        else:
            verdict = "-"
        health_cell = f"{hmax * 1e3:.0f}" + (f" ({fmt_counts(got['hfail'])})" if got["hfail"]
                                              else "")
        rows.append([ATTACKS.get(name, name), str(len(got["lat"]) + non200),
                     f"{p50 * 1e3:.0f} / {p99 * 1e3:.0f}", f"{p99 / alone:.2f}x",
                     health_cell, str(non200), fmt_counts(got["outcomes"]) + (
                         f" (its client process: {got['cpu_s']:.1f} s CPU)"
                         if got["cpu_s"] is not None else ""), verdict])
    header = ["attack", "victim requests", "victim p50 / p99 ms", "p99 / alone p99",
              "/health max ms", "victim non-200", "attacker outcomes (count)", "result"]
    title = (f"Attacks beside another tenant: its latency and /health while each runs "
             f"(tiny model, {args.seconds:g} s per phase)")
    notes = (f"One `batcher serve --model tiny` with two tenants (each 1e9 tokens/min, 16 at "
             f"once), `BATCHER_BODY_TIMEOUT=2`, `--max-body-bytes {BODY_LIMIT}`, a data dir, "
             f"`--log-level warning`. The victim sends `\"hello\"` (16 tokens, temperature 0) "
             f"in a closed loop; `/health` is polled every 50 ms; the attacker runs in its own "
             f"process (on this machine it shares the CPUs with the server: its CPU time is in "
             f"the outcomes column), each attack alone for the phase, bounded in count and "
             f"time. Bounds: "
             f"victim p99 <= 2x its p99 alone + 20 ms (the allowance is for jitter: the "
             f"figures are tens of ms, where one scheduling hiccup is a large ratio), "
             f"`/health` max <= 500 ms. \"none (after)\" is the victim alone again after the "
             f"attacks, for drift (not judged). Tracebacks in the server log: {tracebacks}.")
    command = bench_command(__name__, *(["--seconds", f"{args.seconds:g}"]
                                        if args.seconds != PHASE_S else []))
    if args.append:
        text = append_rows(title, header, rows, notes, command=command,
                           path=Path("RELIABILITY.md"))
    else:
        text = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                          *("| " + " | ".join(r) + " |" for r in rows), "", notes])
    print(text)
    print("\n".join(verdicts))
    return 1 if failed else 0

