"""A design review of one deployment from its effective configuration (a replica's or a router's
`/admin/config`): what is right first, then the three highest risks, each with the failure it
would cause and its fix. Pure: a dict in, findings out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# A queue that holds more than this many times what the TTFT SLO lets the replica start in time
# only holds requests that will miss their SLO.
QUEUE_SLACK = 4.0
# An answer without max_tokens longer than this holds a slot for minutes on a CPU replica.
LONG_DEFAULT_OUTPUT = 4096


@dataclass(slots=True)
class Risk:
    score: int  # higher is worse: how likely times how bad
    title: str
    failure: str
    fix: str

    def to_json(self) -> dict[str, Any]:
        return {"score": self.score, "risk": self.title, "failure": self.failure,
                "fix": self.fix}


@dataclass(slots=True)
class Review:
    kind: str
    right: list[str] = field(default_factory=list)
    risks: list[Risk] = field(default_factory=list)  # all found, worst first

    def top(self, n: int = 3) -> list[Risk]:
        return self.risks[:n]

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "right": self.right,
                "risks": [r.to_json() for r in self.top()],
                "more_risks": len(self.risks) > 3}

    def lines(self) -> list[str]:
        out = [f"{self.kind}: what is right: " + ("; ".join(self.right) or "nothing yet")]
        if not self.risks:
            out.append("no risk found among the checks")
        for i, r in enumerate(self.top(), 1):
            out.append(f"{i}. {r.title}: {r.failure} Fix: {r.fix}")
        if len(self.risks) > 3:
            out.append(f"({len(self.risks) - 3} lesser risks not shown)")
        return out


def review(cfg: dict[str, Any]) -> Review:
    kind = cfg.get("kind")
    if kind not in ("replica", "router"):
        raise ValueError("not a batcher replica's or router's configuration")
    rv = Review(kind)
    if kind == "router":
        _router(cfg, rv)
    else:
        _replica(cfg, rv)
    rv.risks.sort(key=lambda r: -r.score)
    return rv


def _replica(cfg: dict[str, Any], rv: Review) -> None:
    adm = cfg.get("admission") or {}
    eng = cfg.get("engine") or {}
    tenants = cfg.get("tenants") or {}
    slo = adm.get("slo_ttft_ms")
    if slo is None:
        rv.risks.append(Risk(9, "no SLO on admission", "past capacity every request is admitted "
                             "and waits, so all users' first tokens slow down together instead "
                             "of a few being refused at once with Retry-After.",
                             "set --slo-ttft-ms (and --slo-tpot-ms) so admission refuses work "
                             "that would miss them."))
    else:
        rv.right.append(f"admission refuses work that would miss a {slo:,.0f} ms TTFT SLO")
        service = adm.get("service_time_s")
        seqs = eng.get("max_num_seqs")
        waiting = adm.get("max_waiting")
        if service and seqs and waiting:
            allowed = seqs * (slo / 1000.0) / service
            if waiting > QUEUE_SLACK * max(1.0, allowed):
                rv.risks.append(Risk(7, "queue bound far beyond what the SLO allows",
                                     f"{waiting} may wait, but at ~{service:,.1f} s a request "
                                     f"only ~{allowed:,.0f} can start within {slo:,.0f} ms: a "
                                     "burst fills the queue with requests that miss anyway.",
                                     f"bound the queue near {max(1, round(allowed))} "
                                     "(--max-waiting) or add replicas."))
            else:
                rv.right.append("the queue bound fits the SLO")
    if not tenants.get("auth"):
        rv.risks.append(Risk(6, "no tenant budgets (auth off)", "any caller can fill the queue "
                             "and the KV cache; one runaway client starves everyone.",
                             "give each tenant a key with tokens_per_minute and "
                             "max_concurrent (--tenants)."))
    elif tenants.get("budgeted", 0) < tenants.get("count", 0):
        rv.risks.append(Risk(6, "tenants without token budgets",
                             f"{tenants['count'] - tenants['budgeted']} of {tenants['count']} "
                             "tenants are unlimited: one burst takes every slot.",
                             "set tokens_per_minute for every tenant."))
    else:
        rv.right.append("every tenant has a token budget")
    if eng.get("prefix_caching") and eng.get("prefix_cache_scope") == "global" and (
            tenants.get("count", 0) > 1 or not tenants.get("auth")):
        rv.risks.append(Risk(8, "prefix cache shared across tenants", "a tenant can learn "
                             "whether another sent a prompt from its cached_tokens and a fast "
                             "first token (a timing side channel).",
                             "--prefix-cache-scope tenant (the default)."))
    elif eng.get("prefix_caching"):
        rv.right.append("the prefix cache is scoped per tenant")
    default = cfg.get("default_max_tokens")
    if default is not None and default >= min(LONG_DEFAULT_OUTPUT,
                                              eng.get("max_model_len") or LONG_DEFAULT_OUTPUT):
        rv.risks.append(Risk(5, "output caps missing", f"a request without max_tokens may "
                             f"generate {default} tokens and hold its slot for minutes.",
                             "lower the default output cap (--default-max-tokens) and cap "
                             "max_tokens per tenant."))
    else:
        rv.right.append("answers without max_tokens are capped")
    if cfg.get("deep_probe"):
        rv.right.append("a one-token deep probe is served")


def _router(cfg: dict[str, Any], rv: Review) -> None:
    routing = cfg.get("routing")
    if routing in ("round-robin", "random"):
        rv.risks.append(Risk(8, f"{routing} routing", "a slow or busy replica gets the same "
                             "share as an idle one: its queue and tail latency grow while "
                             "others wait.", "--policy predicted-wait (the default)."))
    else:
        rv.right.append(f"routing by {routing}")
    retry = cfg.get("retry") or {}
    if retry.get("max_attempts", 1) > 1 and not 0 < retry.get("retry_ratio", 0) <= 0.5:
        rv.risks.append(Risk(7, "no retry budget", "in an outage every failed request is "
                             "retried: the load on the healthy replicas multiplies (a retry "
                             "storm).", "a retry budget of about a tenth of recent traffic "
                             "(--retry-ratio 0.1)."))
    elif retry.get("max_attempts", 1) > 1:
        rv.right.append(f"retries are budgeted at {retry['retry_ratio']:.0%} of traffic")
    if not cfg.get("deep_probe"):
        rv.risks.append(Risk(6, "no deep probe", "a replica whose model hangs still answers "
                             "/health and keeps receiving traffic until clients time out.",
                             "give the router the replicas' admin or fleet key so it probes "
                             "with one token (--replica-admin-key or --fleet-key)."))
    else:
        rv.right.append("replicas are deep-probed with one token")
    default = cfg.get("default_max_tokens")
    if default is not None and default >= LONG_DEFAULT_OUTPUT:
        rv.risks.append(Risk(5, "output caps missing", f"requests without max_tokens are "
                             f"planned as {default}-token answers.",
                             "lower the router's default max_tokens."))
