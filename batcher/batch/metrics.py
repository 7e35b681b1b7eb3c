"""The batch tier's Prometheus series, on the server's own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class BatchMetrics:
    """`batcher_batch_lines_queued` / `_running` (gauges), `batcher_batch_lines_done_total`
    by outcome (`ok`, `error`, `unanswered`: cancelled or expired before it ran),
    `batcher_batch_spare_capacity_tokens_total` (prompt + output tokens of answered lines: work
    done on capacity interactive traffic left free) and `batcher_batch_deferrals_total` by
    reason (a line refused for now by admission, to run again later, or `yield` / `shed`);
    `batcher_batch_gate_blocked_total` by what kept the next line from starting (`cap`,
    `interactive_queued`, `beside`, `slots`, `kv`, `no_prediction`, `ttft`, `not_serving`), and the
    gate's last predicted interactive TTFT (`batcher_batch_gate_predicted_ttft_seconds`)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry or CollectorRegistry()
        self.queued = Gauge("batcher_batch_lines_queued", "Batch lines waiting to run",
                            registry=r)
        self.running = Gauge("batcher_batch_lines_running", "Batch lines in the engine",
                             registry=r)
        self.done = Counter("batcher_batch_lines_done", "Batch lines answered", ["outcome"],
                            registry=r)
        self.tokens = Counter("batcher_batch_spare_capacity_tokens",
                              "Prompt and output tokens of batch lines served on spare capacity",
                              registry=r)
        self.deferrals = Counter("batcher_batch_deferrals", "Batch line starts put off",
                                 ["reason"], registry=r)
        self.gate_blocked = Counter("batcher_batch_gate_blocked",
                                    "Executor passes that found no room for the next batch line",
                                    ["reason"], registry=r)
        self.gate_predicted = Gauge("batcher_batch_gate_predicted_ttft_seconds",
                                    "Interactive TTFT the gate last predicted for an arrival "
                                    "right after a new batch line", registry=r)
