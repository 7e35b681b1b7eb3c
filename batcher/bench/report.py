"""What a run measured: client-side latencies and goodput, server-side metrics scraped during it.

Goodput follows DistServe: a request counts only if it finished and met both the TTFT and the TPOT
SLO; its share is over every request sent, so refused requests count as misses, not as absent.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from batcher.bench.client import RequestResult
from batcher.bench.common import pct
from batcher.telemetry.timings import ROUTER_PHASES

# Series kept from each scrape (histograms keep their _sum, _count and _bucket samples).
SCRAPED = ("batcher_kv_blocks_used", "batcher_kv_blocks_total", "batcher_running",
           "batcher_waiting", "batcher_preemptions", "batcher_prefix_cache_hit_tokens",
           "batcher_prompt_tokens", "batcher_prefill_tokens_computed",
           "batcher_generated_tokens", "batcher_queue_wait_seconds", "batcher_service_seconds")
# Per step kind (prefill / decode / mixed): the model time and tokens of the engine's steps, for
# the prefill and decode rates `batcher plan` sizes a fleet with.
BY_KIND = ("batcher_step_seconds", "batcher_step_tokens")
# A router's own series: its replicas' figures (KV, rates) are on their own /metrics.
ROUTER_SCRAPED = ("batcher_router_client_requests", "batcher_retries", "batcher_failovers",
                  "batcher_router_retry_budget_exhausted")
ROUTER_REPLICAS = "batcher_router_replicas"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name' or 'name{le=...}': value} for the series in SCRAPED."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in BY_KIND:
            for s in fam.samples:
                if s.name.endswith(("_sum", "_count")) and "kind" in s.labels:
                    key = f"{s.name}{{kind={s.labels['kind']}}}"
                    out[key] = out.get(key, 0.0) + float(s.value)
            continue
        if fam.name == ROUTER_REPLICAS:
            for sm in fam.samples:
                key = f"{sm.name}{{view={sm.labels.get('view', '')}}}"
                out[key] = float(sm.value)
            continue
        if fam.name not in SCRAPED and fam.name not in ROUTER_SCRAPED:
            continue
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            key = f"{s.name}{{le={s.labels['le']}}}" if "le" in s.labels else s.name
            out[key] = out.get(key, 0.0) + float(s.value)  # summed over other labels
    return out


class MetricsScraper:
    """Polls /metrics every `interval` seconds while a run goes on; silent if there is none."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, interval: float = 0.5,
                 t0: float | None = None, headers: dict[str, str] | None = None):
        self.session = session
        self.headers = headers or {}
        self.url = base_url.rstrip("/") + "/metrics"
        self.interval = interval
        self.t0 = time.perf_counter() if t0 is None else t0
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.available = True
        self._task: asyncio.Task[None] | None = None

    async def scrape(self) -> None:
        if not self.available:
            return
        try:
            async with self.session.get(self.url, headers=self.headers) as resp:
                if resp.status != 200:
                    self.available = False
                    return
                text = await resp.text()
        except (aiohttp.ClientError, ConnectionError, TimeoutError):
            return  # one lost scrape is a gap in a curve, not a failed run
        values = parse_metrics(text)
        if not values:
            self.available = False  # a /metrics with none of ours (another server)
            return
        self.samples.append((time.perf_counter() - self.t0, values))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.scrape()

    async def start(self) -> None:
        await self.scrape()  # the baseline every delta is taken against
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.scrape()

    def summary(self) -> dict[str, Any] | None:
        """Deltas over the run and the KV-use curve, or None when nothing was scraped."""
        if len(self.samples) < 2:
            return None
        first, last = self.samples[0][1], self.samples[-1][1]

        def delta(name: str) -> float:
            return last.get(name, 0.0) - first.get(name, 0.0)

        if not any(k.startswith("batcher_kv_blocks") for k in last) and any(
                k.startswith(ROUTER_REPLICAS) for k in last):
            return {"router": True,
                    "client_requests": delta("batcher_router_client_requests_total"),
                    "retries": delta("batcher_retries_total"),
                    "failovers": delta("batcher_failovers_total"),
                    "budget_exhausted": delta("batcher_router_retry_budget_exhausted_total"),
                    "replicas_routable": last.get(f"{ROUTER_REPLICAS}{{view=routable}}"),
                    "replicas_evicted": last.get(f"{ROUTER_REPLICAS}{{view=evicted}}")}
        used = [v.get("batcher_kv_blocks_used", 0.0) for _, v in self.samples]
        prompt = delta("batcher_prompt_tokens_total")
        return {
            "queue_wait": _hist_delta(first, last, "batcher_queue_wait_seconds"),
            "service": _hist_delta(first, last, "batcher_service_seconds"),
            "kv_blocks_total": last.get("batcher_kv_blocks_total"),
            "kv_blocks_used_max": max(used),
            "kv_blocks_used_mean": sum(used) / len(used),
            "preemptions": delta("batcher_preemptions_total"),
            "prefix_cache_hit_tokens": delta("batcher_prefix_cache_hit_tokens_total"),
            "prompt_tokens": prompt,
            "prefix_cache_hit_rate": (delta("batcher_prefix_cache_hit_tokens_total") / prompt
                                      if prompt > 0 else None),
            "prefill_tokens_computed": delta("batcher_prefill_tokens_computed_total"),
            **_rates(delta),
            "series": [{"t": t, "kv_used": v.get("batcher_kv_blocks_used"),
                        "running": v.get("batcher_running"), "waiting": v.get("batcher_waiting")}
                       for t, v in self.samples],
        }


# Fewer tokens than this in prefill-only steps give no prefill rate: a step's fixed cost (reading
# the weights) swamps a few tokens (a chat burst's one prefill-only step, 8 tokens of a cached
# prompt, read as a tenth of the prefill rate its big steps ran at). Each decode row is a sample.
MIN_RATE_TOKENS = {"prefill": 128, "decode": 1}


def _rates(delta: Any) -> dict[str, float | None]:
    """Tokens per second of model time in prefill-only and in decode-only steps over the run
    (None from fewer than `MIN_RATE_TOKENS` of its tokens), the tokens each is from, and the mean
    decode rows the decode rate was measured at: the replica rates `batcher plan
    --prefill-rate --decode-rate` takes. A decode rate holds at about that many streams;
    measure at the concurrency the fleet will run."""
    out: dict[str, float | None] = {}
    for kind in ("prefill", "decode"):
        seconds = delta(f"batcher_step_seconds_sum{{kind={kind}}}")
        tokens = delta(f"batcher_step_tokens_sum{{kind={kind}}}")
        out[f"{kind}_tokens"] = tokens
        out[f"{kind}_rate"] = (tokens / seconds
                               if seconds > 0 and tokens >= MIN_RATE_TOKENS[kind] else None)
    steps = delta("batcher_step_tokens_count{kind=decode}")
    out["decode_rows_mean"] = out["decode_tokens"] / steps if steps > 0 else None
    return out


def _hist_delta(first: dict[str, float], last: dict[str, float], name: str
                ) -> dict[str, float | None]:
    """Mean and quantiles of the observations a histogram gained between two scrapes."""
    count = last.get(f"{name}_count", 0.0) - first.get(f"{name}_count", 0.0)
    total = last.get(f"{name}_sum", 0.0) - first.get(f"{name}_sum", 0.0)
    buckets = sorted(((float(k.split("le=")[1][:-1]), v - first.get(k, 0.0))
                      for k, v in last.items() if k.startswith(f"{name}_bucket{{")))
    out: dict[str, float | None] = {"count": count, "mean": total / count if count else None}
    for q in (50, 90, 99):
        out[f"p{q}"] = _bucket_quantile(buckets, count, q / 100) if count else None
    return out


def _bucket_quantile(buckets: list[tuple[float, float]], count: float, q: float) -> float:
    """Linear interpolation inside the bucket holding the q-quantile (as PromQL does)."""
    rank, lo, below = q * count, 0.0, 0.0
    for upper, cum in buckets:
        if cum >= rank:
            if math.isinf(upper):
                return lo  # beyond the last finite bound: its lower edge is all that is known
            inside = cum - below
            return lo + (upper - lo) * ((rank - below) / inside if inside else 0.0)
        lo, below = upper, cum
    return lo


def _stats(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {"mean": sum(values) / len(values) * scale, "p50": pct(values, 50) * scale,
            "p90": pct(values, 90) * scale, "p99": pct(values, 99) * scale}


def met_slo(r: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if not r.ok or r.ttft is None:
        return False
    if slo_ttft_ms is not None and r.ttft * 1000 > slo_ttft_ms:
        return False
    tpot = r.tpot  # a one-token answer has no TPOT and cannot miss that SLO
    return not (slo_tpot_ms is not None and tpot is not None and tpot * 1000 > slo_tpot_ms)


def summarize(results: list[RequestResult], slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict[str, Any]:
    """Counts, throughput, latency percentiles (ms; E2E in s), goodput, errors, mismatches."""
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.kind] = errors.get(r.kind, 0) + 1
    ends = [r.start + (r.e2e or 0.0) for r in results]
    duration = max(ends) - min(r.start for r in results) if results else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    good = sum(met_slo(r, slo_ttft_ms, slo_tpot_ms) for r in results)
    per_s = 1.0 / duration if duration > 0 else 0.0
    mismatches = [{"id": r.id, "asked": r.max_tokens, "got": r.output_tokens}
                  for r in ok if not r.length_ok]
    return {
        "sent": len(results), "ok": len(ok), "errors": sum(errors.values()),
        "errors_by_kind": dict(sorted(errors.items())), "duration_s": duration,
        "reconnects": sum(r.reconnected for r in results),
        "retried": sum(r.attempts > 1 for r in results),
        "retries": sum(r.attempts - 1 for r in results),
        # Every refused answer by "STATUS REASON" (retried ones too), the refusals that ended
        # requests, and the time spent waiting as Retry-After asked.
        "refusals_by_reason": _count(x for r in results for x in r.refusals),
        "final_refusals": _count(r.refusals[-1] for r in results
                                 if r.kind in ("429", "503") and r.refusals),
        "retry_wait_s": sum(r.retry_wait_s for r in results),
        "request_throughput": len(ok) * per_s, "output_tokens": out_tokens,
        "output_tok_s": out_tokens * per_s,
        "input_tok_s": sum(r.prompt_len for r in ok) * per_s,
        "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None], 1000),
        "tpot_ms": _stats([t for r in ok if (t := r.tpot) is not None], 1000),
        "itl_ms": _stats([x for r in ok for x in r.itl], 1000),
        "e2e_s": _stats([r.e2e for r in ok if r.e2e is not None]),
        "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
        "goodput_requests": good, "goodput_rps": good * per_s,
        "goodput_share": good / len(results) if results else 0.0,
        "length_mismatches": len(mismatches), "mismatched": mismatches[:20],
        "tokens_from_usage": sum(r.tokens_from == "usage" for r in ok),
        "server_phases": phase_split(ok),
    }


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def refusal_lines(summary: dict[str, Any]) -> list[str]:
    """Why the server refused, and what honouring its Retry-After cost (nothing when it
    refused nothing)."""
    by_reason = summary.get("refusals_by_reason") or {}
    if not by_reason:
        return []
    line = "refusals by reason (every refused answer): " + ", ".join(
        f"{k} {n}" for k, n in by_reason.items())
    if summary.get("retries"):
        line += (f"; {summary['retried']} requests sent again {summary['retries']} times after "
                 f"waiting {summary.get('retry_wait_s', 0.0):,.1f} s in all as Retry-After "
                 "asked")
    else:
        line += "; none sent again (--retries N honours Retry-After as OpenAI's clients do)"
    return [line]


def phase_split(results: list[RequestResult]) -> dict[str, Any] | None:
    """The server's own phase split (its `timings`) of the requests at the 50th, 90th and 99th
    percentile of the server's total, and how often each phase was the bottleneck: where the
    time of a typical and of a slow request went."""
    timed = sorted((r.timings for r in results if r.timings and "total_ms" in r.timings),
                   key=lambda t: float(t["total_ms"]))
    if not timed:
        return None
    phases = [p for p in ROUTER_PHASES if any(p + "_ms" in t for t in timed)]
    out: dict[str, Any] = {"requests": len(timed), "phases": phases, "at": {}, "bottlenecks": {}}
    for q in (50, 90, 99):
        t = timed[min(len(timed) - 1, max(0, math.ceil(q / 100 * len(timed)) - 1))]
        out["at"][f"p{q}"] = {p: float(t.get(p + "_ms", 0.0)) for p in [*phases, "total"]}
    for t in timed:
        b = str(t.get("bottleneck", "?"))
        out["bottlenecks"][b] = out["bottlenecks"].get(b, 0) + 1
    out["mean_ms"] = {p: sum(float(t.get(p + "_ms", 0.0)) for t in timed) / len(timed)
                      for p in [*phases, "total"]}
    return out


def phase_lines(summary: dict[str, Any]) -> list[str]:
    """The server-side phase split as readable lines (nothing when the server sent none)."""
    split = summary.get("server_phases")
    if not split:
        return []
    lines = []
    for q, row in split["at"].items():
        parts = ", ".join(f"{p} {row[p]:,.1f}" for p in split["phases"])
        lines.append(f"server phases at {q} of total ({row['total']:,.1f} ms): {parts}")
    counts = ", ".join(f"{p} {n}" for p, n in sorted(split["bottlenecks"].items(),
                                                     key=lambda kv: -kv[1]))
    lines.append(f"bottleneck by request: {counts} (of {split['requests']})")
    return lines


TABLE_HEADER = ["run", "sent", "ok", "errors", "time s", "req/s", "output tok/s",
                "TTFT p50 / p99 ms", "TPOT p50 / p99 ms", "ITL p50 / p99 ms", "E2E p50 / p99 s",
                "goodput /s (share)", "length ok"]


def _f(x: float | None, digits: int = 1) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


def table_row(label: str, s: dict[str, Any]) -> list[str]:
    final = s.get("final_refusals") or {}

    def why(kind: str) -> str:
        reasons = ", ".join(f"{k.split(' ', 1)[1]} {n}" for k, n in final.items()
                            if k.split(" ", 1)[0] == kind)
        return f" ({reasons})" if reasons else ""

    errs = ", ".join(f"{k}: {v}{why(k)}" for k, v in s["errors_by_kind"].items()) or "0"
    if s.get("reconnects"):  # sent again after a kept-alive connection turned out closed
        errs += f" ({s['reconnects']} resent)"

    def pair(key: str, digits: int = 0) -> str:
        return f"{_f(s[key]['p50'], digits)} / {_f(s[key]['p99'], digits)}"

    return [label, str(s["sent"]), str(s["ok"]), errs, _f(s["duration_s"], 1),
            _f(s["request_throughput"], 2), _f(s["output_tok_s"], 1), pair("ttft_ms"),
            pair("tpot_ms", 1), pair("itl_ms", 1), pair("e2e_s", 1),
            # Without an SLO every finished request is "good": say so rather than repeat req/s.
            "— (no SLO)" if s["slo_ttft_ms"] is None and s["slo_tpot_ms"] is None else
            f"{_f(s['goodput_rps'], 2)} ({s['goodput_share']:.0%})",
            f"{s['ok'] - s['length_mismatches']}/{s['ok']}"]


def markdown_table(rows: list[list[str]], header: list[str] = TABLE_HEADER) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def server_lines(server: dict[str, Any] | None) -> list[str]:
    """The scraped server view as a few readable lines."""
    if server is None:
        return ["server metrics: none (no batcher /metrics at this address)"]
    if server.get("router"):
        return [(f"router metrics: {int(server['client_requests'])} client requests, "
                 f"{int(server['retries'])} retries, {int(server['failovers'])} failovers, "
                 f"{int(server['budget_exhausted'])} retries refused by the budget; replicas "
                 f"routable {_f(server['replicas_routable'], 0)}, evicted "
                 f"{_f(server['replicas_evicted'], 0)} (KV use and rates are on each "
                 "replica's own /metrics)")]
    qw, sv = server["queue_wait"], server["service"]
    hit = server["prefix_cache_hit_rate"]
    return [(f"queue wait mean {_f(qw['mean'], 3)} s (p50 ~{_f(qw['p50'], 3)}, p99 "
             f"~{_f(qw['p99'], 3)}) vs service mean {_f(sv['mean'], 3)} s "
             f"(p50 ~{_f(sv['p50'], 3)}, p99 ~{_f(sv['p99'], 3)}) over {int(qw['count'])} "
             "requests"),
            (f"KV blocks used: max {_f(server['kv_blocks_used_max'], 0)} / "
             f"{_f(server['kv_blocks_total'], 0)}, mean {_f(server['kv_blocks_used_mean'], 0)}; "
             f"preemptions {int(server['preemptions'])}; prefix-cache hit rate "
             f"{'—' if hit is None else f'{hit:.1%}'}"),
            _rates_line(server)]


def _rates_line(server: dict[str, Any]) -> str:
    pre, dec, rows = (server.get("prefill_rate"), server.get("decode_rate"),
                      server.get("decode_rows_mean"))

    def rate(value: float | None, kind: str) -> str:
        tokens = server.get(f"{kind}_tokens") or 0
        if value is None and 0 < tokens < MIN_RATE_TOKENS[kind]:
            return f"— tok/s ({tokens:.0f} tokens in {kind}-only steps, too few to measure)"
        return f"{_f(value, 0)} tok/s in {kind}-only steps"

    text = (f"replica rates (model time): prefill {rate(pre, 'prefill')}, "
            f"decode {rate(dec, 'decode')} at {_f(rows, 1)} streams")
    if pre is not None and dec is not None:
        text += f" -> batcher plan --prefill-rate {pre:.0f} --decode-rate {dec:.0f}"
    return text
