"""`batcher diagnose URL|REPORT [--window S] [--json]`: which latency is slow, where the time
goes, and what to do next.

It reads a replica's `/metrics` twice, `--window` seconds apart (0: once, everything since the
server started; a window that saw no requests falls back to that, and says so), and its
`/v1/state`; or a `batcher bench` report file. When admission refused most requests, the report
names that overload first (the refused share, the reasons, the Retry-After given). From the phase
histograms it finds the phase with the largest mean share (the bottleneck), judges first-token,
per-token and total latency against the SLOs the server exports, and names the next action:
a frozen screen points at the prompt, the queue or prefill; a fast start that drags points at
output length; a bad p99 with a fair mean points at queueing at peaks."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from batcher.bench.report import _bucket_quantile
from batcher.http.text import excerpt
from batcher.app.review import Review, review
from batcher.telemetry.timings import ROUTER_PHASES

LATENCIES = {"first_token": "batcher_ttft_seconds", "per_token": "batcher_tpot_seconds",
             "total": "batcher_request_total_seconds"}
SLO_KINDS = {"first_token": "ttft", "per_token": "tpot", "total": "total"}
# A p99 this many times the mean, with a fair mean: waits that come and go with load.
PEAK_RATIO = 4.0
# Admission refusing this share of requests or more: the server is shedding an overload, and
# that comes first in the report (the phases are those of the few it admitted).
SHEDDING_SHARE = 0.5
REJECTED = "batcher_requests_rejected_total"
SHED_ACTION = ("the replica is shedding an overload: it refuses most requests at the door, so "
               "the few it admits keep their latency. Offer less traffic or add replicas (each "
               "replica's capacity: batcher plan); clients should honour Retry-After rather "
               "than retry at once.")


@dataclass(slots=True)
class Diagnosis:
    source: str
    requests: float
    phases_ms: dict[str, float]  # mean per request
    bottleneck: str | None
    slow: list[str]
    latency_ms: dict[str, dict[str, float | None]]
    slo_ms: dict[str, float | None]
    evidence: list[str] = field(default_factory=list)
    action: str = ""
    note: str = ""  # what the figures cover, when not what was asked (the window's fallback)
    # Admission's refusals over the same span: {"refused", "share", "reasons", "retry_after_s"};
    # `shedding` when it refused most requests.
    refusals: dict[str, Any] = field(default_factory=dict)

    @property
    def shedding(self) -> bool:
        return bool(self.refusals) and self.refusals["share"] >= SHEDDING_SHARE

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "requests": self.requests, "bottleneck": self.bottleneck,
                "slow": self.slow, "phases_ms": self.phases_ms, "latency_ms": self.latency_ms,
                "slo_ms": self.slo_ms, "evidence": self.evidence, "action": self.action,
                "note": self.note, "refusals": self.refusals, "shedding": self.shedding}

    def lines(self) -> list[str]:
        out = [self.note] if self.note else []
        if self.shedding:
            out.append(f"overload: {self.refusal_text()}")
        if self.bottleneck is None:
            if self.shedding:
                return [*out, f"next: {SHED_ACTION}"]
            return [*out, f"{self.source}: no finished requests to judge; send traffic (or "
                    "use a longer --window) and run again"]
        total = sum(self.phases_ms.values()) or 1.0
        split = ", ".join(f"{p} {ms:,.1f} ms ({ms / total:.0%})"
                          for p, ms in self.phases_ms.items())
        slow = ", ".join(self.slow) or "nothing above its SLO"
        admitted = " admitted" if self.shedding else ""
        out += [f"{self.source}: {int(self.requests)}{admitted} requests; slow: {slow}",
                f"bottleneck: {self.bottleneck}; mean per{admitted} request: {split}"]
        if self.refusals and not self.shedding:
            out.append(f"refused: {self.refusal_text()}")
        out += self.evidence
        out.append(f"next: {self.action}")
        return out

    def refusal_text(self) -> str:
        r = self.refusals
        reasons = ", ".join(f"{k} {int(n):,}" for k, n in r["reasons"].items())
        text = (f"admission refused {int(r['refused']):,} of {int(r['refused'] + self.requests):,}"
                f" requests ({r['share']:.0%}): {reasons}")
        if r.get("retry_after_s") is not None:
            text += f"; Retry-After given: mean {r['retry_after_s']:,.1f} s"
        return text


# reading ---------------------------------------------------------------------------------------
def flatten(text: str) -> dict[str, float]:
    """Prometheus text -> {'name' or 'name{le=..}': value}, summed over every other label."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            key = f"{s.name}{{le={s.labels['le']}}}" if "le" in s.labels else s.name
            if "kind" in s.labels and fam.name == "batcher_slo_seconds":
                key = f"{s.name}{{kind={s.labels['kind']}}}"
            if s.name == REJECTED and "reason" in s.labels:  # by reason, and summed below
                by = f"{s.name}{{reason={s.labels['reason']}}}"
                out[by] = out.get(by, 0.0) + float(s.value)
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def _delta(first: dict[str, float], last: dict[str, float], key: str) -> float:
    return last.get(key, 0.0) - first.get(key, 0.0)


def _hist(first: dict[str, float], last: dict[str, float], name: str
          ) -> dict[str, float | None]:
    count = _delta(first, last, name + "_count")
    total = _delta(first, last, name + "_sum")
    buckets = sorted((float(k.split("le=")[1][:-1]), v - first.get(k, 0.0))
                     for k, v in last.items() if k.startswith(name + "_bucket{"))
    out: dict[str, float | None] = {"count": count,
                                    "mean": 1000 * total / count if count else None}
    for q in (50, 90, 99):
        out[f"p{q}"] = 1000 * _bucket_quantile(buckets, count, q / 100) if count else None
    return out


def from_metrics(source: str, first: dict[str, float], last: dict[str, float],
                 state: dict[str, Any] | None, slo_override: dict[str, float | None]
                 ) -> Diagnosis:
    # A router exports the same anatomy under its own prefix, with `route` in front.
    router = any(k.startswith("batcher_router_request_") for k in last)
    prefix = "batcher_router_request_" if router else "batcher_request_"
    phases = {p: _hist(first, last, f"{prefix}{p}_seconds") for p in ROUTER_PHASES}
    phases = {p: h for p, h in phases.items() if h["count"]}
    requests = max((h["count"] or 0.0 for h in phases.values()), default=0.0)
    means = {p: float(h["mean"] or 0.0) for p, h in phases.items()}
    latency = {k: _hist(first, last, name) for k, name in LATENCIES.items()}
    if router:  # first-token and per-token times are the replicas' own: scrape those
        latency["total"] = _hist(first, last, "batcher_router_request_total_seconds")
    slo: dict[str, float | None] = {}
    for k, kind in SLO_KINDS.items():
        exported = last.get(f"batcher_slo_seconds{{kind={kind}}}")
        slo[k] = slo_override.get(k) or (1000 * exported if exported else None)
    prompt = _delta(first, last, "batcher_prompt_tokens_total")
    hits = _delta(first, last, "batcher_prefix_cache_hit_tokens_total")
    generated = _delta(first, last, "batcher_generated_tokens_total")
    ctx = {"prompt_tokens": prompt / requests if requests else None,
           "completion_tokens": generated / requests if requests else None,
           "cache_hit": hits / prompt if prompt else None,
           "queue_p99": phases.get("queue", {}).get("p99"),
           "preemptions": _delta(first, last, "batcher_preemptions_total")}
    d = judge(source, requests, means, latency, slo, ctx, state)
    d.refusals = refusals(first, last, requests)
    if d.shedding and d.bottleneck is not None:
        d.action = f"{SHED_ACTION} Of the admitted requests: {d.action}"
    return d


def refusals(first: dict[str, float], last: dict[str, float], admitted: float
             ) -> dict[str, Any]:
    """Admission's refusals between two reads, by reason, with their share of all requests and
    the mean Retry-After given; {} when none."""
    refused = _delta(first, last, REJECTED)
    if refused <= 0:
        return {}
    head = REJECTED + "{reason="
    reasons = {k[len(head):-1]: _delta(first, last, k) for k in last if k.startswith(head)}
    reasons = dict(sorted(((k, v) for k, v in reasons.items() if v > 0),
                          key=lambda kv: -kv[1]))
    given = _hist(first, last, "batcher_retry_after_seconds")
    mean = given["mean"]
    return {"refused": refused, "share": refused / (refused + admitted), "reasons": reasons,
            "retry_after_s": None if mean is None else mean / 1000}


def from_report(path: Path, slo_override: dict[str, float | None]) -> Diagnosis:
    """A `batcher bench` report: the server's phase split it received, the client's latencies."""
    doc = json.loads(path.read_text())
    summary = doc.get("summary") or {}
    split = summary.get("server_phases") or {}
    means = {p: float(v) for p, v in (split.get("mean_ms") or {}).items() if p != "total"}
    latency = {"first_token": summary.get("ttft_ms") or {},
               "per_token": summary.get("tpot_ms") or {},
               "total": {q: (v * 1000 if v is not None else None)
                         for q, v in (summary.get("e2e_s") or {}).items()}}
    slo = {"first_token": slo_override.get("first_token") or summary.get("slo_ttft_ms"),
           "per_token": slo_override.get("per_token") or summary.get("slo_tpot_ms"),
           "total": slo_override.get("total")}
    timed = [r.get("timings") for r in doc.get("requests") or () if r.get("timings")]
    n = len(timed) or 1
    ctx = {"prompt_tokens": sum(t.get("prompt_tokens", 0) for t in timed) / n,
           "completion_tokens": sum(t.get("completion_tokens", 0) for t in timed) / n,
           "cache_hit": None, "queue_p99": (split.get("at") or {}).get("p99", {}).get("queue"),
           "preemptions": sum(t.get("preemptions", 0) for t in timed)}
    return judge(str(path), float(split.get("requests") or 0), means, latency, slo, ctx, None)


# judging ---------------------------------------------------------------------------------------
def judge(source: str, requests: float, means: dict[str, float],
          latency: dict[str, dict[str, Any]], slo: dict[str, float | None],
          ctx: dict[str, Any], state: dict[str, Any] | None) -> Diagnosis:
    d = Diagnosis(source, requests, {p: round(v, 3) for p, v in means.items()}, None, [],
                  latency, slo)
    if not requests or not means:
        d.action = "no finished requests to judge"
        return d
    d.bottleneck = max(means, key=lambda p: means[p])
    for k in LATENCIES:
        p90, limit = (latency.get(k) or {}).get("p90"), slo.get(k)
        if p90 is not None and limit is not None and p90 > limit:
            d.slow.append(k)
            d.evidence.append(f"{k.replace('_', ' ')} p90 ~{p90:,.0f} ms against an SLO of "
                              f"{limit:,.0f} ms")
    if not any(slo.values()):
        # No SLO to judge against: the latency the bottleneck shapes is the slow one.
        d.slow = ["total" if d.bottleneck in ("decode", "post") else "first_token"]
        d.evidence.append("no SLO configured: judged by where the time goes")
    _explain(d, means, ctx, state)
    return d


def _explain(d: Diagnosis, means: dict[str, float], ctx: dict[str, Any],
             state: dict[str, Any] | None) -> None:
    b = d.bottleneck
    total = sum(means.values()) or 1.0
    share = f"{means[b]:,.0f} ms of {total:,.0f} ms ({means[b] / total:.0%})" if b else ""
    service = sum(v for p, v in means.items() if p in ("prefill", "decode"))
    if state is not None:
        d.evidence.append(f"now: {state.get('running', '?')} running, "
                          f"{state.get('waiting', '?')} waiting")
    if ctx.get("preemptions"):
        d.evidence.append(f"{int(ctx['preemptions'])} preemptions: KV memory is short, and "
                          "preempted requests wait again")
    prompt, completion = ctx.get("prompt_tokens"), ctx.get("completion_tokens")
    if b == "queue":
        q99 = ctx.get("queue_p99")
        d.evidence.append(f"queue wait {share}; service (prefill + decode) {service:,.0f} ms")
        peak = q99 is not None and means[b] > 0 and q99 > PEAK_RATIO * means[b]
        if peak:
            d.evidence.append(f"queue p99 ~{q99:,.0f} ms is over {PEAK_RATIO:g}x its mean: the "
                              "waits come with peaks")
        d.action = ("requests wait for a slot, not for the model: the replica is past its "
                    "capacity" + (" at peaks" if peak else "") + ". Keep queue wait apart from "
                    "service time, tighten admission (--slo-ttft-ms refuses work that would "
                    "wait too long, a shorter queue bound), shed or defer batch-priority work, "
                    "or add replicas.")
    elif b == "prefill":
        hit = ctx.get("cache_hit")
        d.evidence.append(f"prefill {share}" + (f" for ~{prompt:,.0f} prompt tokens a request"
                                                 if prompt else "")
                          + (f"; prefix-cache hit {hit:.0%}" if hit is not None else ""))
        d.action = ("a frozen screen: the first token waits on the prompt. Shorten the prompt "
                    "or put its shared part first so the prefix cache serves it, cap prompt "
                    "length, and keep the per-step token budget large enough for prefill.")
    elif b == "decode":
        tpot = (d.latency_ms.get("per_token") or {}).get("mean")
        d.evidence.append(f"decode {share}" + (f" for ~{completion:,.0f} output tokens a "
                                                f"request" if completion else "")
                          + (f" at ~{tpot:,.1f} ms a token" if tpot else ""))
        d.action = ("a fast start that drags: the answer's length sets the time. Cap "
                    "max_tokens, ask for shorter answers, stream them; if the time per token "
                    "itself is over its SLO, run fewer sequences at once or add replicas.")
    elif b == "route":
        d.evidence.append(f"route {share}")
        d.action = ("the router's own share is the largest: check the network between router "
                    "and replicas, retries and failovers, and the router's CPU.")
    else:
        d.evidence.append(f"{b} {share}")
        d.action = (f"the server's own CPU work ({b}) dominates: look for very long inputs or "
                    "outputs, many choices per request, or an event loop starved of CPU.")


# fetching --------------------------------------------------------------------------------------
# A target's answer is read up to this many bytes: a replica's /metrics is tens of kilobytes.
MAX_ANSWER_BYTES = 8 * 2**20
TIMEOUT_S = 30.0


async def _get(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> str:
    async with session.get(url, headers=headers) as resp:
        if resp.status != 200:
            body = (await resp.content.read(200)).decode(errors="replace")
            raise RuntimeError(f"GET {url} answered {resp.status}: {excerpt(body, 120)}")
        data = await resp.content.read(MAX_ANSWER_BYTES + 1)
        if len(data) > MAX_ANSWER_BYTES:
            raise RuntimeError(f"GET {url} answered more than {MAX_ANSWER_BYTES} bytes")
        return data.decode(errors="replace")


def reason(exc: BaseException, timeout: float) -> str:
    """Why a target could not be read, in one bounded, printable line: a hostile or broken
    target's text is cut and its control characters escaped; a timeout says so."""
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return f"no complete answer within {timeout:g} s (timed out)"
    text = str(exc) or type(exc).__name__
    return excerpt(" ".join(text.split()), 300)


async def diagnose_url(url: str, window: float, slo: dict[str, float | None],
                       api_key: str | None = None, timeout_s: float = TIMEOUT_S) -> Diagnosis:
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        first = flatten(await _get(session, base + "/metrics", headers)) if window > 0 else {}
        if window > 0:
            await asyncio.sleep(window)
        last = flatten(await _get(session, base + "/metrics", headers))
        try:
            state = json.loads(await _get(session, base + "/v1/state", headers))
        except (RuntimeError, ValueError):
            state = None
    d = from_metrics(base, first, last, state, slo)
    if window > 0 and not d.requests and not d.refusals:
        # A quiet window after traffic (the run ended before diagnose started): judge
        # everything since the server started, and say so.
        d = from_metrics(base, {}, last, state, slo)
        if d.requests or d.refusals:
            d.note = (f"no requests in the last {window:g} s; judging everything since the "
                      "server started")
    return d


async def review_url(url: str, api_key: str | None, timeout_s: float = TIMEOUT_S) -> Review:
    """The deployment review of a replica's or router's admin listener."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        cfg = json.loads(await _get(session, url.rstrip("/") + "/admin/config", headers))
    return review(cfg if isinstance(cfg, dict) else {})


def add_diagnose_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="a replica's or router's base URL, or a bench report.json")
    p.add_argument("--window", type=float, default=10.0, help="seconds between the two reads "
                   "of /metrics; 0 reads once, everything since the server started, as does a "
                   "window that saw no requests (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    p.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds to wait for each "
                   "answer of the target (default: %(default)s)")
    p.add_argument("--api-key", default=None, help="bearer key: the admin key with --review, "
                   "else where /metrics needs one")
    p.add_argument("--review", action="store_true", help="review the deployment instead: read "
                   "the effective configuration from TARGET, an admin listener's URL, and rank "
                   "its three highest risks")
    for k in LATENCIES:
        p.add_argument(f"--slo-{SLO_KINDS[k]}-ms", type=float, default=None,
                       help=f"{k.replace('_', ' ')} SLO in ms (default: what the server "
                       "exports, if any)")


def run_diagnose(args: argparse.Namespace) -> int:
    slo = {k: getattr(args, f"slo_{SLO_KINDS[k]}_ms") for k in LATENCIES}
    if args.window < 0:
        print("batcher diagnose: --window must be >= 0", file=sys.stderr)
        return 2
    if not 0 < args.timeout < float("inf"):
        print("batcher diagnose: --timeout must be seconds > 0", file=sys.stderr)
        return 2
    target = str(args.target)
    try:
        if args.review:
            rv = asyncio.run(review_url(target, args.api_key, args.timeout))
            print(json.dumps(rv.to_json()) if args.json else "\n".join(rv.lines()))
            return 0
        if target.startswith(("http://", "https://")):
            d = asyncio.run(diagnose_url(target, args.window, slo, args.api_key, args.timeout))
        else:
            d = from_report(Path(target), slo)
    except (OSError, RuntimeError, ValueError, aiohttp.ClientError) as exc:
        print(f"batcher diagnose: cannot read {excerpt(target, 200)}: "
              f"{reason(exc, args.timeout)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(d.to_json()))
    else:
        print("\n".join(d.lines()))
    return 0

