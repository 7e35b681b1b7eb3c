"""Admission (token buckets, concurrency, queue bounds, SLO shedding, drain) and auth (keys,
tenants files). Pure Python on a fake clock: fast and deterministic."""

from __future__ import annotations

import hashlib
import math
import sys
from pathlib import Path

import pytest

from batcher.admission.admission import Admission, Rejected, Ticket
from batcher.core.request import Priority, Request
from batcher.core.sampling import SamplingParams
from batcher.server.auth import Authenticator, AuthError, main
from batcher.admission.tenants import DEFAULT_TENANT, TenantConfig, hash_key, load_tenants
from batcher.admission.token_bucket import TokenBucket
from batcher.core.backlog import Backlog
from batcher.admission.ttft_predictor import CORRECTION_MIN, CORRECTION_SAMPLES

IDLE = Backlog()


def queued(n: int, tokens: int) -> Backlog:
    """`n` interactive requests waiting with `tokens` prompt tokens between them."""
    return Backlog(waiting=n, waiting_interactive=n, ahead_interactive=tokens,
                   ahead_batch=tokens)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def tenant(name: str = "acme", *, tpm: float = 600.0, burst: int = 0, mc: int = 4,
           prios: tuple[str, ...] = ("interactive", "batch")) -> TenantConfig:
    return TenantConfig(name=name, key_sha256=(hash_key(name + "-key"),), tokens_per_minute=tpm,
                        burst=burst, max_concurrent=mc, priorities=frozenset(prios))


def make(*tenants: TenantConfig, **kw) -> tuple[Admission, FakeClock]:
    clock = FakeClock()
    return Admission({t.name: t for t in tenants}, clock=clock, **kw), clock


# -- token bucket ---------------------------------------------------------------------------------

@pytest.mark.parametrize("rate", [1.0, 1000 / 60, 0.3, 7.0])
def test_bucket_retry_after_is_exact_and_honouring_it_succeeds(rate: float) -> None:
    clock = FakeClock()
    b = TokenBucket(rate, 100, clock)
    assert b.try_take(70) == 0.0
    wait = b.try_take(50)  # 30 left, 20 short
    assert wait == pytest.approx(20 / rate)
    assert b.tokens == pytest.approx(30)  # a refusal takes nothing
    clock.advance(wait * 0.999)
    assert b.try_take(50) > 0
    clock.advance(wait * 0.001)
    assert b.try_take(50) == 0.0
    assert b.tokens == pytest.approx(0, abs=1e-6)


def test_bucket_caps_at_capacity_and_refund() -> None:
    clock = FakeClock()
    b = TokenBucket(10.0, 100, clock)
    clock.advance(1000)
    assert b.tokens == 100
    assert b.try_take(101) == math.inf
    assert b.try_take(80) == 0.0
    b.refund(50)
    assert b.tokens == 70
    b.refund(1000)
    assert b.tokens == 100


# -- admission: budget ----------------------------------------------------------------------------

def test_charge_refund_and_exact_429() -> None:
    acme = tenant(tpm=600, burst=100)  # 10 tokens/s
    adm, clock = make(acme)
    t1 = adm.admit(acme, "interactive", 30, 50, IDLE)
    assert (t1.tenant, t1.cost, t1.max_tokens, t1.released) == ("acme", 80, 50, False)
    with pytest.raises(Rejected) as e:
        adm.admit(acme, "interactive", 10, 30, IDLE)  # 20 left, 40 needed
    assert (e.value.status, e.value.reason) == (429, "tenant_tokens")
    assert e.value.retry_after == pytest.approx(2.0)
    assert e.value.retry_after_header == "2"
    assert adm.rejections["tenant_tokens"] == 1
    clock.advance(e.value.retry_after)
    t2 = adm.admit(acme, "interactive", 10, 30, IDLE)
    adm.release(t1, generated_tokens=10)  # refunds 40 unused
    with pytest.raises(Rejected):
        adm.admit(acme, "interactive", 0, 41, IDLE)
    adm.admit(acme, "interactive", 0, 40, IDLE)
    adm.release(t2, generated_tokens=999)  # over-reporting never charges extra
    assert adm.in_flight("acme") == 1


def test_release_is_idempotent() -> None:
    acme = tenant(tpm=600, burst=100)
    adm, _ = make(acme)
    t = adm.admit(acme, "interactive", 0, 100, IDLE)
    adm.release(t, 0)
    adm.release(t, 0)
    assert t.released and adm.in_flight("acme") == 0
    adm.admit(acme, "interactive", 0, 100, IDLE)  # refunded exactly once, to full
    with pytest.raises(Rejected):
        adm.admit(acme, "interactive", 0, 1, IDLE)


def test_cost_over_burst_is_a_value_error() -> None:
    acme = tenant(tpm=600, burst=100)
    adm, _ = make(acme)
    with pytest.raises(ValueError, match=r"101 tokens \(prompt 1 \+ max_tokens 100\).*100"):
        adm.admit(acme, "interactive", 1, 100, IDLE)
    assert sum(adm.rejections.values()) == 0


def test_concurrency_limit() -> None:
    acme = tenant(tpm=60000, mc=2)
    adm, _ = make(acme)
    a = adm.admit(acme, "interactive", 1, 1, IDLE)
    adm.admit(acme, "batch", 1, 1, IDLE)
    with pytest.raises(Rejected) as e:
        adm.admit(acme, "interactive", 1, 1, IDLE)
    assert (e.value.status, e.value.reason, e.value.retry_after) == (429, "tenant_concurrency", 1.0)
    adm.observe_service(3.0)
    with pytest.raises(Rejected) as e:
        adm.admit(acme, "interactive", 1, 1, IDLE)
    assert e.value.retry_after == 3.0
    adm.release(a, 1)
    adm.admit(acme, "interactive", 1, 1, IDLE)


def test_tenants_are_isolated() -> None:
    a, b = tenant("a", tpm=60, burst=10), tenant("b", tpm=60, burst=10)
    adm, _ = make(a, b)
    adm.admit(a, "interactive", 5, 5, IDLE)
    with pytest.raises(Rejected):
        adm.admit(a, "interactive", 0, 1, IDLE)
    adm.admit(b, "interactive", 5, 5, IDLE)


# -- admission: queue, SLO, drain, priority -------------------------------------------------------

def test_queue_bound_sheds_batch_first() -> None:
    acme = tenant(tpm=1e6)
    adm, _ = make(acme, max_waiting=10)
    adm.admit(acme, "batch", 1, 1, queued(4, 400))
    with pytest.raises(Rejected) as e:
        adm.admit(acme, "batch", 1, 1, queued(5, 500))
    assert (e.value.status, e.value.reason) == (503, "queue_full")
    assert e.value.retry_after >= 1.0
    adm.admit(acme, "interactive", 1, 1, queued(9, 900))
    with pytest.raises(Rejected) as e:
        adm.admit(acme, "interactive", 1, 1, queued(10, 1000))
    assert e.value.reason == "queue_full"
    assert adm.rejections["queue_full"] == 2
    assert adm.in_flight("acme") == 2  # 503s charge nothing and hold no slot


def test_draining_is_503_and_checked_first() -> None:
    acme = tenant(tpm=60, burst=10, prios=("batch",))
    adm, _ = make(acme)
    adm.set_draining(True)
    with pytest.raises(Rejected) as e:
        adm.admit(acme, "interactive", 0, 10**6, IDLE)  # otherwise a ValueError twice over
    assert (e.value.status, e.value.reason, e.value.retry_after) == (503, "draining", 1.0)
    assert adm.rejections["draining"] == 1
    adm.set_draining(False)
    adm.admit(acme, "batch", 5, 5, IDLE)


def test_priority_not_allowed_is_a_value_error() -> None:
    acme = tenant(prios=("batch",))
    adm, _ = make(acme)
    with pytest.raises(ValueError, match="'interactive' is not allowed"):
        adm.admit(acme, "interactive", 1, 1, IDLE)
    with pytest.raises(ValueError, match="priority must be one of"):
        adm.admit(acme, "urgent", 1, 1, IDLE)


@pytest.mark.parametrize("tenants", [None, {}])
def test_auth_off_default_tenant_is_unlimited(tenants: dict[str, TenantConfig] | None) -> None:
    adm = Admission(tenants, max_waiting=4, clock=FakeClock())
    tickets = [adm.admit(DEFAULT_TENANT, "interactive", 10**5, 10**5, IDLE) for _ in range(100)]
    assert all(isinstance(t, Ticket) for t in tickets)
    with pytest.raises(Rejected):  # the queue still protects the server
        adm.admit(DEFAULT_TENANT, "interactive", 1, 1, queued(4, 4))
    for t in tickets:
        adm.release(t, 1)
    assert adm.in_flight("default") == 0


# -- auth -----------------------------------------------------------------------------------------

def test_hash_key_matches_hashlib() -> None:
    assert hash_key("s3cret") == hashlib.sha256(b"s3cret").hexdigest()
    assert hash_key("ключ") == hashlib.sha256("ключ".encode()).hexdigest()


def test_authenticate() -> None:
    a, b = tenant("a"), tenant("b")
    auth = Authenticator({"a": a, "b": b})
    assert auth.enabled
    assert auth.authenticate("Bearer a-key") is a
    assert auth.authenticate("bearer   b-key  ") is b
    assert auth.authenticate(None, "b-key") is b
    assert auth.authenticate("", "a-key") is a
    with pytest.raises(AuthError, match="invalid API key") as e:
        auth.authenticate("Bearer c-key")
    assert "c-key" not in str(e.value)
    for missing in (None, "", "  "):
        with pytest.raises(AuthError, match="missing API key"):
            auth.authenticate(missing)
    for bad in ("a-key", "Basic a-key", "Bearer", "Bearer   "):
        with pytest.raises(AuthError, match="malformed") as e:
            auth.authenticate(bad)
        assert "a-key" not in str(e.value)


def test_auth_off() -> None:
    for tenants in (None, {}):
        auth = Authenticator(tenants)
        assert not auth.enabled
        assert auth.authenticate(None) is DEFAULT_TENANT
        assert auth.authenticate("Bearer anything") is DEFAULT_TENANT
    assert DEFAULT_TENANT.name == "default" and DEFAULT_TENANT.unlimited


def test_cli_prints_hash(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["k1"]) == 0
    assert capsys.readouterr().out.strip() == hashlib.sha256(b"k1").hexdigest()
    assert main([]) == 2


GOOD = f"""
[tenants.acme]
keys_sha256 = ["{hash_key('acme-key').upper()}"]
tokens_per_minute = 60000
burst = 20000
max_concurrent = 16
priorities = ["interactive", "batch"]

[tenants.jobs]
keys_sha256 = ["{hash_key('jobs-key')}"]
tokens_per_minute = 1200.5
max_concurrent = 2
priorities = ["batch"]
"""


def test_load_tenants(tmp_path: Path) -> None:
    p = tmp_path / "tenants.toml"
    p.write_text(GOOD)
    t = load_tenants(p)
    assert t["acme"].burst == 20000 and t["acme"].key_sha256 == (hash_key("acme-key"),)
    assert t["jobs"].burst == 1200 and t["jobs"].priorities == frozenset({"batch"})
    assert Authenticator(t).authenticate("Bearer acme-key") is t["acme"]
    assert "key_sha256" not in repr(t["acme"])


def test_example_tenants_file_loads() -> None:
    t = load_tenants(Path(__file__).resolve().parents[1] / "examples" / "tenants.toml")
    assert Authenticator(t).authenticate("Bearer acme-example-key-1").name == "acme"


H = hash_key("x")
BASE = f'[tenants.a]\nkeys_sha256=["{H}"]\ntokens_per_minute=1\nmax_concurrent=1\n'


@pytest.mark.parametrize("body, match", [
    ("", "no \\[tenants.NAME\\]"),
    ("[tenants.a", "invalid TOML"),
    ("[other]\n", "unknown top-level"),
    (f'[tenants.a]\nkeys_sha256=["{H}"]\nmax_concurrent=1\n', "'a': tokens_per_minute is required"),
    ('[tenants.a]\nkeys_sha256=[]\ntokens_per_minute=1\nmax_concurrent=1\n', "'a': keys_sha256"),
    ('[tenants.a]\nkeys_sha256=["abc"]\ntokens_per_minute=1\nmax_concurrent=1\n',
     "'a': keys_sha256 entries must be 64"),
    (f'[tenants.a]\nkeys_sha256=["{H}"]\ntokens_per_minute=0\nmax_concurrent=1\n',
     "'a': tokens_per_minute must be"),
    (f'[tenants.a]\nkeys_sha256=["{H}"]\ntokens_per_minute="9"\nmax_concurrent=1\n',
     "'a': tokens_per_minute must be"),
    (f'[tenants.a]\nkeys_sha256=["{H}"]\ntokens_per_minute=1\nmax_concurrent=0\n',
     "'a': max_concurrent must be"),
    (f'[tenants.a]\nkeys_sha256=["{H}"]\ntokens_per_minute=1\nmax_concurrent=true\n',
     "'a': max_concurrent must be"),
    (f'[tenants.a]\nkeys_sha256=["{H}"]\ntokens_per_minute=1\nmax_concurrent=1\nburst=0\n',
     "'a': burst must be"),
    (f'[tenants.a]\nkeys_sha256=["{H}"]\ntokens_per_minute=1\nmax_concurrent=1\nburst=2.5\n',
     "'a': burst must be"),
    (BASE + 'priorities=["urgent"]\n', "'a': priorities must be"),
    (BASE + "priorities=[]\n", "'a': priorities must be"),
    (f'[tenants.a]\nkeys_sha256=["{H}"]\ntokens_per_minute=1\nmax_concurrent=1\nadmin=true\n',
     "'a': 'admin' is not a tenant field; operator routes take the admin key"),
    (f'[tenants.a]\nkeys_sha256=["{H}"]\ntokens_per_minute=1\nmax_concurent=1\n',
     "'a': unknown field"),
    (f'[tenants."a b"]\nkeys_sha256=["{H}"]\ntokens_per_minute=1\nmax_concurrent=1\n',
     "'a b': name must be"),
    (BASE + BASE.replace("tenants.a", "tenants.b"),
     "'b': keys_sha256 repeats a hash already listed for tenant 'a'"),
])
def test_load_tenants_errors_name_tenant_and_field(tmp_path: Path, body: str, match: str) -> None:
    p = tmp_path / "t.toml"
    p.write_text(body)
    with pytest.raises(ValueError, match=match):
        load_tenants(p)


def test_infinite_rate_tenant_has_no_bucket() -> None:
    big = TenantConfig(name="internal", tokens_per_minute=math.inf, max_concurrent=1)
    assert big.unlimited and big.burst == sys.maxsize
    adm, _ = make(big)
    t = adm.admit(big, "interactive", 10**7, 10**7, IDLE)
    with pytest.raises(Rejected, match="concurrent"):  # its concurrency cap still holds
        adm.admit(big, "interactive", 1, 1, IDLE)
    adm.release(t, 0)


# -- TTFT prediction and the SLO checks -----------------------------------------------------------

def _req(rid: str, prompt: int, computed: int = 0, output: int = 0, max_tokens: int = 16,
         priority: Priority = Priority.INTERACTIVE) -> Request:
    r = Request(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens),
                priority=priority)
    r.token_ids += [7] * output
    r.num_computed_tokens = computed
    return r


def test_backlog_counts_running_prefill_and_the_queue_by_priority() -> None:
    running = [_req("decoding", 100, computed=105, output=6, max_tokens=16),  # 10 steps left
               _req("chunked", 500, computed=320, max_tokens=4)]  # 180 prompt tokens left
    waiting = [_req("i1", 50), _req("b1", 70, priority=Priority.BATCH),
               _req("i2", 30, max_tokens=8)]
    bl = Backlog.of(sorted(waiting, key=lambda r: r.priority), running, max_num_seqs=2)
    assert bl.ahead("interactive") == 180 + 50 + 30  # batch waits behind a new interactive
    assert bl.ahead("batch") == 180 + 50 + 30 + 70
    assert (bl.waiting, bl.waiting_interactive, bl.running, bl.free_slots) == (3, 2, 2, 0)
    assert bl.steps_left == (4, 10)
    assert bl.new_steps == pytest.approx((16 + 16 + 8) / 3)
    assert bl.max_context == 500
    # Slots: two interactive requests queued ahead take the two slots that open first (after 4
    # and 10 steps); the third one round later waits for a newcomer's whole generation too.
    assert bl.steps_to_slot("interactive") == pytest.approx(4 + bl.new_steps)
    assert bl.steps_to_slot("batch") == pytest.approx(10 + bl.new_steps)
    assert Backlog.of([], running, max_num_seqs=3).steps_to_slot("batch") == 0  # a free slot


def _measured(adm: Admission, clock: FakeClock, rate: float, step_s: float = 0.1,
              steps: int = 50) -> None:
    """Steps that each prefill `rate * step_s` tokens in `step_s`, work pending throughout."""
    for _ in range(steps):
        clock.advance(step_s)
        adm.observe_step(step_s, round(rate * step_s), True)


def test_ttft_check_predicts_from_all_work_ahead_and_sheds_batch_first() -> None:
    acme = tenant(tpm=1e9, burst=10**6, mc=1000)
    adm, clock = make(acme, slo_ttft_s=1.0)
    busy = Backlog(running=1, ahead_interactive=10**6, ahead_batch=10**6)
    adm.admit(acme, "interactive", 100, 10, busy)  # no rate measured yet: no SLO shedding
    _measured(adm, clock, rate=1000.0)
    assert adm.prefill_rate == pytest.approx(1000.0)
    assert adm.predictor.step_s == pytest.approx(0.1)

    def ahead(tokens: int, batch: int = 0) -> Backlog:
        return Backlog(running=1, ahead_interactive=tokens, ahead_batch=tokens + batch)

    # 0.1 s step + (640 + 100) / 1000 = 0.84 s: in (interactive may take 85% of the SLO);
    # 1000 ahead -> 1.2 s: out, for 0.35 s more.
    t = adm.admit(acme, "interactive", 100, 10, ahead(640, batch=10**5))  # batch is not ahead
    assert t.predicted_ttft_s == pytest.approx(0.84)
    with pytest.raises(Rejected) as e:
        adm.admit(acme, "interactive", 100, 10, ahead(1000))
    assert (e.value.status, e.value.reason, e.value.retry_after) == (503, "queue_slo", 1.0)
    assert "1.20 s exceeds the 0.85 s" in e.value.message
    with pytest.raises(Rejected) as e:
        adm.admit(acme, "interactive", 100, 10, ahead(3900))  # 4.1 s: retry after 3.25 s
    assert e.value.retry_after == pytest.approx(3.25)
    # Batch gets half the SLO: 0.1 + 390 / 1000 = 0.49 s in, 0.6 s out.
    adm.admit(acme, "batch", 100, 10, ahead(290))
    with pytest.raises(Rejected):
        adm.admit(acme, "batch", 100, 10, ahead(400))
    assert adm.rejections["queue_slo"] == 3


def test_slots_bound_the_prediction_when_every_slot_is_held() -> None:
    acme = tenant(tpm=1e9, burst=10**6, mc=1000)
    adm, clock = make(acme, slo_ttft_s=1.0)
    _measured(adm, clock, rate=1000.0)
    full = Backlog(running=4, free_slots=0, steps_left=(5, 20, 20, 20), new_steps=20)
    t = adm.admit(acme, "interactive", 100, 10, full)  # 0.1 + 5 steps x 0.1 + 0.1 = 0.7 s
    assert t.predicted_ttft_s == pytest.approx(0.7)
    with pytest.raises(Rejected):  # one queued ahead takes that slot: 20 steps for the next
        adm.admit(acme, "interactive", 100, 10, Backlog(
            waiting=1, waiting_interactive=1, running=4, free_slots=0, ahead_interactive=50,
            ahead_batch=50, steps_left=(5, 20, 20, 20), new_steps=20))


def test_an_idle_server_and_a_long_prompt_are_never_starved() -> None:
    acme = tenant(tpm=1e9, burst=10**6, mc=1000)
    adm, clock = make(acme, slo_ttft_s=1.0)
    _measured(adm, clock, rate=1000.0)
    # Alone on the server, a 5 s prompt is admitted: waiting would not make it sooner.
    adm.admit(acme, "interactive", 5000, 10, IDLE)
    adm.admit(acme, "batch", 5000, 10, Backlog(running=3))  # only decodes ahead of it
    # Behind others, its wait is held to half its limit (0.425 s): 320 tokens ahead (0.42 s with
    # the step) is in, 500 out.
    adm.admit(acme, "interactive", 5000, 10, Backlog(running=1, ahead_interactive=320))
    with pytest.raises(Rejected):
        adm.admit(acme, "interactive", 5000, 10, Backlog(running=1, ahead_interactive=500))


def test_a_long_prompt_is_not_refused_for_the_streams_it_is_read_beside() -> None:
    """Beside 8 streams a prompt is read at a fifth of the quiet rate (the streams keep their
    pace): a 2,000-token prompt (2 s quiet, long against a 1 s SLO) would take 10 s there. That is
    its own reading, not a wait: with no prompt ahead of it, it is admitted while the streams run;
    with prompts ahead it is held to half its limit as before."""
    acme = tenant(tpm=1e9, burst=10**6, mc=1000)
    adm, clock = make(acme, slo_ttft_s=1.0)
    _measured(adm, clock, rate=1000.0)  # with no decodes beside
    for _ in range(50):
        clock.advance(0.1)
        adm.observe_step(0.1, 20, True, decode_rows=8)  # 200 tokens/s beside 8 streams
    streams = Backlog(running=8, steps_left=(300,) * 8, new_steps=300)
    t = adm.admit(acme, "interactive", 2000, 10, streams)
    assert t.predicted_ttft_s > 5 and not t.held_to_slo
    adm.release(t, 0)
    with pytest.raises(Rejected) as e:  # 200 tokens ahead read beside the streams: about 1 s
        adm.admit(acme, "interactive", 2000, 10, Backlog(
            running=8, waiting=1, waiting_interactive=1, ahead_interactive=200,
            ahead_batch=200, steps_left=(300,) * 8, new_steps=300))
    assert e.value.reason == "queue_slo"
    # Streams about to end read the prompts ahead faster, but 1,000 tokens ahead still take
    # longer than half the limit: refused.
    with pytest.raises(Rejected):
        adm.admit(acme, "interactive", 2000, 10, Backlog(
            running=8, waiting=1, waiting_interactive=1, ahead_interactive=1000,
            ahead_batch=1000, steps_left=(20,) * 8, new_steps=300))
    # A short prompt beside the same streams is still held to the whole limit.
    with pytest.raises(Rejected):
        adm.admit(acme, "interactive", 300, 10, streams)


def test_correction_follows_delivered_ttfts() -> None:
    acme = tenant(tpm=1e9, burst=10**6, mc=1000)
    adm, clock = make(acme, slo_ttft_s=1.0)
    _measured(adm, clock, rate=1000.0)
    light = Backlog(running=1, ahead_interactive=100, ahead_batch=100)
    # Predicted 0.3 s each, delivered in 0.6 s: the model under-states by 2x.
    for _ in range(CORRECTION_MIN):
        t = adm.admit(acme, "interactive", 100, 10, light)
        assert t.predicted_ttft_s == pytest.approx(0.3)
        clock.advance(0.6)
        adm.observe_first_token(t)
        adm.observe_first_token(t)  # once per request
        adm.release(t, 10)
    assert adm.predictor.num_ttft_observations == CORRECTION_MIN
    assert adm.predictor.correction(clock()) == pytest.approx(2.0)
    with pytest.raises(Rejected) as e:  # 0.5 s raw x 2 = 1.0 s, over the 0.85 s limit
        adm.admit(acme, "interactive", 100, 10, Backlog(running=1, ahead_interactive=300))
    assert "1.00 s" in e.value.message
    # The old evidence ages out: delivered as predicted for a while, the correction returns.
    for _ in range(CORRECTION_SAMPLES):
        t = adm.admit(acme, "interactive", 100, 10, light)
        clock.advance(0.3)
        adm.observe_first_token(t)
        adm.release(t, 10)
    assert adm.predictor.correction(clock()) == pytest.approx(1.0)


def test_tpot_check_refuses_the_stream_that_would_slow_the_others() -> None:
    acme = tenant(tpm=1e9, burst=10**6, mc=1000)
    adm, _ = make(acme, slo_tpot_s=0.1, max_num_seqs=12,
                  decode_step_s=lambda rows, ctx: 0.01 * rows + max(0, ctx - 1000) / 1e5)
    adm.admit(acme, "interactive", 10, 10, Backlog(running=7))  # 8 rows: 0.08 s (85%: 0.085 s)
    with pytest.raises(Rejected) as e:
        adm.admit(acme, "interactive", 10, 10, Backlog(running=8))  # 9 rows: 0.09 s
    assert (e.value.status, e.value.reason, e.value.retry_after) == (503, "tpot_slo", 1.0)
    assert "9 streams would take 90 ms per token" in e.value.message
    with pytest.raises(Rejected):  # the longer context of the new stream counts too
        adm.admit(acme, "interactive", 5000, 5000, Backlog(running=8))
    adm.admit(acme, "interactive", 10, 10, Backlog(running=8, waiting=4))  # slots full: it waits
    adm.admit(acme, "interactive", 10, 10, IDLE)  # alone: never refused


def test_slo_flags_are_validated() -> None:
    with pytest.raises(ValueError, match="slo_tpot_s"):
        Admission(None, slo_tpot_s=0.0)
    with pytest.raises(ValueError, match="slo_ttft_s"):
        Admission(None, slo_ttft_s=-1.0)


# -- the SLO share's controller --------------------------------------------------------------------

def test_slo_share_is_cut_once_per_round_and_recovers_fast_then_probes_slowly() -> None:
    from batcher.admission.slo_limit import CEILING, CUT, FAST_PER_S, FLOOR, SLOW_PER_S, SloLimit

    lim = SloLimit()
    assert lim.share == CEILING
    lim.observe(10.0, admitted_at=8.0, ttft_s=1.9, slo_s=2.0)  # a miss: cut
    assert lim.share == pytest.approx(CEILING * CUT) and lim.cuts == 1
    # Requests admitted before that cut miss too: the same round, no further cut.
    lim.observe(10.2, admitted_at=9.0, ttft_s=1.9, slo_s=2.0)
    assert lim.cuts == 1
    # One admitted after the cut misses: the share that failed it is cut again.
    lim.observe(12.0, admitted_at=10.5, ttft_s=1.9, slo_s=2.0)
    assert lim.share == pytest.approx(CEILING * CUT * CUT) and lim.cuts == 2
    # Without misses it comes back fast to just under the share that last missed ...
    low = lim.share
    lim.observe(13.0, admitted_at=12.5, ttft_s=0.5, slo_s=2.0)
    assert lim.share == pytest.approx(low + FAST_PER_S)
    t = 13.0
    while lim.share < 0.9 * CEILING * CUT:
        t += 0.5
        lim.observe(t, admitted_at=t - 0.5, ttft_s=0.5, slo_s=2.0)
    assert t - 13.0 < 2.0
    # ... then probes past it slowly.
    before = lim.share
    lim.observe(t + 1.0, admitted_at=t, ttft_s=0.5, slo_s=2.0)
    assert lim.share == pytest.approx(before + SLOW_PER_S)
    # Never below the floor, never above the ceiling; a long quiet spell counts one second (and
    # where even the floor missed, the share only probes slowly).
    for i in range(20):
        lim.missed(100.0 + i, admitted_at=100.0 + i)
    assert lim.share == FLOOR
    lim.observe(1000.0, admitted_at=999.0, ttft_s=0.1, slo_s=2.0)
    assert lim.share == pytest.approx(FLOOR + SLOW_PER_S)
    for i in range(200):
        lim.observe(1001.0 + i, admitted_at=1000.0 + i, ttft_s=0.1, slo_s=2.0)
    assert lim.share == CEILING


def test_a_request_on_course_to_miss_cuts_before_its_first_token() -> None:
    acme = tenant(tpm=1e9, burst=10**6, mc=1000)
    adm, clock = make(acme, slo_ttft_s=1.0)
    _measured(adm, clock, rate=1000.0)
    busy = Backlog(running=1, ahead_interactive=600, ahead_batch=600)
    t = adm.admit(acme, "interactive", 100, 10, busy)  # 0.8 s predicted
    assert t.held_to_slo and t.predicted_corrected_s == pytest.approx(0.8)
    clock.advance(0.8)
    adm.admit(acme, "interactive", 100, 10, busy)  # on time so far: no cut
    assert adm.limit.cuts == 0
    clock.advance(0.15)  # 0.95 s: past 90% of the SLO, and still no first token
    with pytest.raises(Rejected):  # the share is cut at once: 0.8 s is now over the limit
        adm.admit(acme, "interactive", 100, 10, busy)
    assert adm.limit.cuts == 1
    assert adm.ttft_limit_s("interactive") == pytest.approx(0.85 * 0.75)
    # Its first token then comes late: the same round, not a second cut.
    adm.observe_first_token(t)
    assert adm.limit.cuts == 1


def test_only_requests_held_to_the_limit_move_it() -> None:
    acme = tenant(tpm=1e9, burst=10**6, mc=1000)
    adm, clock = make(acme, slo_ttft_s=1.0)
    _measured(adm, clock, rate=1000.0)
    # Alone on an idle server, or a long prompt held by its wait only: a late first token is
    # its own prompt's, not a sign that the limit is too high.
    for backlog, prompt in ((IDLE, 100), (Backlog(running=1, ahead_interactive=100), 5000)):
        t = adm.admit(acme, "interactive", prompt, 10, backlog)
        assert not t.held_to_slo
        clock.advance(3.0)
        adm.observe_first_token(t)
        adm.release(t, 10)
    assert adm.limit.cuts == 0


def test_a_request_with_only_decodes_ahead_is_checked() -> None:
    acme = tenant(tpm=1e9, burst=10**6, mc=1000)
    adm, clock = make(acme, slo_ttft_s=1.0)
    # Alone, the scheduler reads prompts at 1000 tokens/s; beside three decodes at 100 (a slow
    # machine, chunks kept small to protect the streams).
    for _ in range(15):
        clock.advance(0.1)
        adm.observe_step(0.1, 100, True, decode_rows=0)
        clock.advance(0.1)
        adm.observe_step(0.1, 10, True, decode_rows=3)
    with pytest.raises(Rejected):  # 0.1 s + 100 tokens at 100/s = 1.1 s: over the limit
        adm.admit(acme, "interactive", 100, 10, Backlog(running=3))
    adm.admit(acme, "interactive", 100, 10, IDLE)  # alone on the server: admitted


def test_prefill_speeds_up_as_running_streams_end() -> None:
    acme = tenant(tpm=1e9, burst=10**6, mc=1000)
    adm, clock = make(acme, slo_ttft_s=1.0)
    # Steps of 0.1 s: alone, prompts are read at 1000 tokens/s; beside one stream at 100.
    for _ in range(10):
        clock.advance(0.1)
        adm.observe_step(0.1, 100, True, decode_rows=0)
        clock.advance(0.1)
        adm.observe_step(0.1, 10, True, decode_rows=1)
    # The stream has 2 steps left: 20 tokens beside it (0.2 s), the other 80 alone (0.08 s), after
    # the step in progress (0.1 s). Beside it all the way it would have been 1.1 s: refused.
    t = adm.admit(acme, "interactive", 100, 10, Backlog(running=1, steps_left=(2,)))
    assert t.predicted_ttft_s == pytest.approx(0.38)
    with pytest.raises(Rejected):
        adm.admit(acme, "interactive", 100, 10, Backlog(running=1, steps_left=(20,)))


def test_a_stale_prefill_rate_is_passed_over_and_renewed_by_one_request() -> None:
    acme = tenant(tpm=1e9, burst=10**6, mc=1000)
    adm, clock = make(acme, slo_ttft_s=1.0)
    for _ in range(5):  # alone, prompts are read at 1000 tokens/s
        clock.advance(0.1)
        adm.observe_step(0.1, 100, True, decode_rows=0)
    for _ in range(10):  # a slow spell: 50 tokens/s beside two streams
        clock.advance(0.2)
        adm.observe_step(0.2, 10, True, decode_rows=2)
    slow = Backlog(running=2, steps_left=(30, 30))
    with pytest.raises(Rejected):  # 100 tokens at 50/s
        adm.admit(acme, "interactive", 100, 10, slow)
    # Then decodes only, for longer than a rate stays fresh: no step has read a prompt since, so
    # the rate is old news; one request with nothing queued ahead is let in to renew it ...
    for _ in range(25):
        clock.advance(0.1)
        adm.observe_step(0.1, 0, True, decode_rows=2)
    assert adm.predictor.prefill_stale
    t = adm.admit(acme, "interactive", 100, 10, slow)
    assert not t.held_to_slo
    # ... not a second one queued behind it.
    with pytest.raises(Rejected):
        adm.admit(acme, "interactive", 100, 10, Backlog(
            running=2, waiting=1, waiting_interactive=1, ahead_interactive=100,
            ahead_batch=100, steps_left=(30, 30)))
    # A bucket measured recently is preferred over a stale one nearer the shape asked for.
    for _ in range(5):
        clock.advance(0.1)
        adm.observe_step(0.1, 100, True, decode_rows=8)
    assert not adm.predictor.prefill_stale
    assert adm.predictor.prefill_rate_with(2) == pytest.approx(1000.0)


def _priced(fixed_s: float, per_token_s: float, cap: int, paced: bool):
    """A `prefill_step` for a device whose step costs `fixed_s` plus `per_token_s` a prompt
    token, the scheduler giving a new prompt at most `cap` tokens a step."""

    def step(rows: int, ctx: int, tokens: int, prompt: int,
             asked: bool | None) -> tuple[int, float, bool]:
        chunk = min(tokens, cap)
        return chunk, fixed_s + per_token_s * chunk, paced if asked is None else asked

    return step


def test_a_backlog_is_predicted_in_the_chunks_the_scheduler_would_fill() -> None:
    """Requests arriving one at a time are each read in a step of their own, which is mostly the
    step's fixed cost: 40 tokens in 0.1 s. Ten of them queued are read in one step of the token
    budget (about 0.12 s), not ten such steps (1 s): refusing the eleventh on the rate measured
    one prompt a step refused what the server serves in a fraction of the SLO."""
    acme = tenant(tpm=1e9, burst=10**6, mc=1000)
    for with_step in (False, True):
        adm, clock = make(acme, slo_ttft_s=1.0)
        if with_step:
            adm.predictor.prefill_step = _priced(0.098, 0.00005, 320, paced=True)
        for _ in range(5):  # each step took all the prefill there was
            clock.advance(0.1)
            adm.observe_step(0.1, 40, True, decode_rows=1, step_modelled_s=0.1,
                             prefill_left=False)
        backlog = Backlog(running=1, waiting=10, waiting_interactive=10, ahead_interactive=400,
                          ahead_batch=400, steps_left=(30,), max_context=64)
        if not with_step:  # 440 tokens at 400 tokens/s: over the limit
            with pytest.raises(Rejected):
                adm.admit(acme, "interactive", 40, 10, backlog)
            continue
        t = adm.admit(acme, "interactive", 40, 10, backlog)
        # 440 tokens in steps of 320 at 0.114 s each, after the step in progress.
        assert t.predicted_ttft_s == pytest.approx(0.1 + 440 / (320 / 0.114), rel=0.01)


def test_chunks_the_scheduler_sized_stand_unless_a_burst_lifts_them() -> None:
    """Steps that left prefill waiting were held to the streams' time target: their measured
    rate is the rate, whatever the model says a bigger chunk would cost. A burst filling the
    batch gets the whole budget, which only the model can price."""
    acme = tenant(tpm=1e9, burst=10**6, mc=1000)
    backlog = Backlog(running=1, waiting=10, waiting_interactive=10, ahead_interactive=400,
                      ahead_batch=400, steps_left=(30,), max_context=64)
    for paced, admitted in ((True, False), (False, True)):
        adm, clock = make(acme, slo_ttft_s=1.0)
        adm.predictor.prefill_step = _priced(0.098, 0.00005, 320, paced=paced)
        for _ in range(5):
            clock.advance(0.1)
            adm.observe_step(0.1, 40, True, decode_rows=1, step_modelled_s=0.1,
                             prefill_left=True)
        if admitted:
            adm.admit(acme, "interactive", 40, 10, backlog)
        else:
            with pytest.raises(Rejected):
                adm.admit(acme, "interactive", 40, 10, backlog)


def test_the_model_never_makes_a_measured_rate_slower() -> None:
    """A model that prices the bigger chunk dearer per token than what was measured (or a
    device compute-bound past a knot) does not push the prediction above the measured rate's."""
    acme = tenant(tpm=1e9, burst=10**6, mc=1000)
    adm, clock = make(acme, slo_ttft_s=1.0)
    adm.predictor.prefill_step = _priced(0.0, 0.01, 320, paced=False)  # 100 tokens/s
    for _ in range(5):
        clock.advance(0.1)
        adm.observe_step(0.1, 100, True, decode_rows=0, step_modelled_s=0.1,
                         prefill_left=False)
    assert adm.predictor.prefill_rate_with(0, 300.0) == pytest.approx(1000.0)


def test_first_tokens_are_compared_with_the_rate_their_prediction_used() -> None:
    """A prediction made in the budget's chunks is rescaled, at its first token, by the change
    of that same rate, not of the rate measured one short prompt a step: otherwise every such
    request would read as several times later than predicted, and the correction would go on
    refusing what the server serves in time."""
    acme = tenant(tpm=1e9, burst=10**6, mc=1000)
    adm, clock = make(acme, slo_ttft_s=1.0)
    adm.predictor.prefill_step = _priced(0.0995, 0.00005, 320, paced=False)
    for _ in range(5):  # 10-token prompts, one a step: 100 tokens/s
        clock.advance(0.1)
        adm.observe_step(0.1, 10, True, decode_rows=1, step_modelled_s=0.1, prefill_left=False)
    backlog = Backlog(running=1, waiting=5, waiting_interactive=5, ahead_interactive=230,
                      ahead_batch=230, steps_left=(30,), max_context=64)
    tickets = [adm.admit(acme, "interactive", 10, 10, backlog) for _ in range(CORRECTION_MIN)]
    # The backlog is read in one step of 240 tokens, as the model priced it.
    clock.advance(0.1115)
    adm.observe_step(0.1115, 240, True, decode_rows=1, step_modelled_s=0.1115,
                     prefill_left=False)
    for t in tickets:
        adm.observe_first_token(t)
    assert adm.predictor.correction(clock()) < 1.5
