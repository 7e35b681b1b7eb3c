"""`batcher bench` reports a replica's prefill and decode rates from the server's step metrics:
tokens per second of model time in prefill-only and decode-only steps over the run."""

from __future__ import annotations

from batcher.bench.report import _rates, parse_metrics, server_lines
from batcher.engine.metrics import Metrics


def _rates_line_of(rates: dict) -> str:
    """The report's replica-rates line for a run whose other server figures are empty."""
    return server_lines({"queue_wait": {"mean": None, "p50": None, "p99": None, "count": 0},
                         "service": {"mean": None, "p50": None, "p99": None},
                         "prefix_cache_hit_rate": None, "kv_blocks_used_max": 0,
                         "kv_blocks_total": 0, "kv_blocks_used_mean": 0, "preemptions": 0,
                         **rates})[-1]


def test_rates_from_step_metrics() -> None:
    m = Metrics()
    m.step_time.labels("prefill").observe(9.0)  # before the run: not counted
    m.step_tokens.labels("prefill").observe(1.0)
    first = parse_metrics(m.exposition().decode())
    for _ in range(4):
        m.step_time.labels("prefill").observe(0.25)
        m.step_tokens.labels("prefill").observe(1000)
    for _ in range(10):
        m.step_time.labels("decode").observe(0.02)
        m.step_tokens.labels("decode").observe(8)
    m.step_time.labels("mixed").observe(5.0)  # neither rate
    m.step_tokens.labels("mixed").observe(1)
    last = parse_metrics(m.exposition().decode())
    rates = _rates(lambda name: last.get(name, 0.0) - first.get(name, 0.0))
    assert rates["prefill_rate"] == 4000.0
    assert abs(rates["decode_rate"] - 400.0) < 1e-6
    assert rates["decode_rows_mean"] == 8.0


def test_no_decode_steps_means_no_decode_rate() -> None:
    rates = _rates(lambda name: 0.0)
    assert rates == {"prefill_rate": None, "decode_rate": None, "decode_rows_mean": None,
                     "prefill_tokens": 0.0, "decode_tokens": 0.0}
    line = _rates_line_of(rates)
    assert "prefill — tok/s" in line and "batcher plan" not in line


def test_too_few_steps_give_no_rate() -> None:
    # A few prefill tokens (a chat burst's first step, its prompt mostly cached) are no rate to
    # plan with: it is left out and the line says why; the decode rate from enough stays.
    m = Metrics()
    m.step_time.labels("prefill").observe(0.7)
    m.step_tokens.labels("prefill").observe(8)
    for _ in range(10):
        m.step_time.labels("decode").observe(0.02)
        m.step_tokens.labels("decode").observe(8)
    last = parse_metrics(m.exposition().decode())
    rates = _rates(lambda name: last.get(name, 0.0))
    assert rates["prefill_rate"] is None and rates["prefill_tokens"] == 8.0
    assert abs(rates["decode_rate"] - 400.0) < 1e-6
    line = _rates_line_of(rates)
    assert "8 tokens in prefill-only steps, too few to measure" in line
    assert "batcher plan" not in line
    assert "400 tok/s in decode-only steps" in line
