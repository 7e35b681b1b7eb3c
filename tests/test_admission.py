"""Admission (token buckets, concurrency, queue bounds, SLO shedding, drain) and auth (keys,
tenants files). Pure Python on a fake clock: fast and deterministic."""

from __future__ import annotations

import hashlib
import math
import sys
from pathlib import Path

import pytest

from batcher.admission import Admission, Rejected, Ticket, TokenBucket
from batcher.server.auth import Authenticator, AuthError, main
from batcher.tenants import DEFAULT_TENANT, TenantConfig, hash_key, load_tenants


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
    t1 = adm.admit(acme, "interactive", 30, 50, 0, 0)
    assert (t1.tenant, t1.cost, t1.max_tokens, t1.released) == ("acme", 80, 50, False)
    with pytest.raises(Rejected) as e:
        adm.admit(acme, "interactive", 10, 30, 0, 0)  # 20 left, 40 needed
    assert (e.value.status, e.value.reason) == (429, "tenant_tokens")
    assert e.value.retry_after == pytest.approx(2.0)
    assert e.value.retry_after_header == "2"
    assert adm.rejections["tenant_tokens"] == 1
    clock.advance(e.value.retry_after)
    t2 = adm.admit(acme, "interactive", 10, 30, 0, 0)
    adm.release(t1, generated_tokens=10)  # refunds 40 unused
    with pytest.raises(Rejected):
        adm.admit(acme, "interactive", 0, 41, 0, 0)
    adm.admit(acme, "interactive", 0, 40, 0, 0)
    adm.release(t2, generated_tokens=999)  # over-reporting never charges extra
    assert adm.in_flight("acme") == 1


def test_release_is_idempotent() -> None:
    acme = tenant(tpm=600, burst=100)
    adm, _ = make(acme)
    t = adm.admit(acme, "interactive", 0, 100, 0, 0)
    adm.release(t, 0)
    adm.release(t, 0)
    assert t.released and adm.in_flight("acme") == 0
    adm.admit(acme, "interactive", 0, 100, 0, 0)  # refunded exactly once, to full
    with pytest.raises(Rejected):
        adm.admit(acme, "interactive", 0, 1, 0, 0)


def test_cost_over_burst_is_a_value_error() -> None:
    acme = tenant(tpm=600, burst=100)
    adm, _ = make(acme)
    with pytest.raises(ValueError, match=r"101 tokens \(prompt 1 \+ max_tokens 100\).*100"):
        adm.admit(acme, "interactive", 1, 100, 0, 0)
    assert sum(adm.rejections.values()) == 0


def test_concurrency_limit() -> None:
    acme = tenant(tpm=60000, mc=2)
    adm, _ = make(acme)
    a = adm.admit(acme, "interactive", 1, 1, 0, 0)
    adm.admit(acme, "batch", 1, 1, 0, 0)
    with pytest.raises(Rejected) as e:
        adm.admit(acme, "interactive", 1, 1, 0, 0)
    assert (e.value.status, e.value.reason, e.value.retry_after) == (429, "tenant_concurrency", 1.0)
    adm.observe_service(3.0)
    with pytest.raises(Rejected) as e:
        adm.admit(acme, "interactive", 1, 1, 0, 0)
    assert e.value.retry_after == 3.0
    adm.release(a, 1)
    adm.admit(acme, "interactive", 1, 1, 0, 0)


def test_tenants_are_isolated() -> None:
    a, b = tenant("a", tpm=60, burst=10), tenant("b", tpm=60, burst=10)
    adm, _ = make(a, b)
    adm.admit(a, "interactive", 5, 5, 0, 0)
    with pytest.raises(Rejected):
        adm.admit(a, "interactive", 0, 1, 0, 0)
    adm.admit(b, "interactive", 5, 5, 0, 0)


# -- admission: queue, SLO, drain, priority -------------------------------------------------------

def test_queue_bound_sheds_batch_first() -> None:
    acme = tenant(tpm=1e6)
    adm, _ = make(acme, max_waiting=10)
    adm.admit(acme, "batch", 1, 1, 4, 400)
    with pytest.raises(Rejected) as e:
        adm.admit(acme, "batch", 1, 1, 5, 500)
    assert (e.value.status, e.value.reason) == (503, "queue_full")
    assert e.value.retry_after >= 1.0
    adm.admit(acme, "interactive", 1, 1, 9, 900)
    with pytest.raises(Rejected) as e:
        adm.admit(acme, "interactive", 1, 1, 10, 1000)
    assert e.value.reason == "queue_full"
    assert adm.rejections["queue_full"] == 2
    assert adm.in_flight("acme") == 2  # 503s charge nothing and hold no slot


def test_slo_shedding_only_after_prefill_rate_is_measured() -> None:
    acme = tenant(tpm=1e6, burst=1000, mc=100)
    adm, _ = make(acme, slo_ttft_s=1.0)
    adm.admit(acme, "batch", 10, 10, 5, 10**6)  # no rate yet: no SLO shedding
    adm.observe_prefill(0, 1.0)  # ignored: not a measurement
    assert adm.prefill_rate is None
    adm.observe_prefill(1000, 1.0)
    assert adm.prefill_rate == pytest.approx(1000.0)
    adm.admit(acme, "batch", 10, 10, 5, 1000)  # 1.0 s: at the limit
    with pytest.raises(Rejected) as e:
        adm.admit(acme, "batch", 10, 10, 5, 1500)  # 1.5 s > 1x SLO
    assert (e.value.status, e.value.reason) == (503, "queue_slo")
    assert e.value.retry_after == 1.0  # floor; excess is 0.5 s
    adm.admit(acme, "interactive", 10, 10, 5, 1500)  # 1.5 s < 2x SLO
    with pytest.raises(Rejected) as e:
        adm.admit(acme, "interactive", 10, 10, 5, 5000)  # 5 s > 2 s
    assert e.value.retry_after == pytest.approx(3.0)
    adm.admit(acme, "batch", 0, 940, 0, 0)  # 3 x 20 admitted; the 503s took no budget


def test_draining_is_503_and_checked_first() -> None:
    acme = tenant(tpm=60, burst=10, prios=("batch",))
    adm, _ = make(acme)
    adm.set_draining(True)
    with pytest.raises(Rejected) as e:
        adm.admit(acme, "interactive", 0, 10**6, 0, 0)  # otherwise a ValueError twice over
    assert (e.value.status, e.value.reason, e.value.retry_after) == (503, "draining", 1.0)
    assert adm.rejections["draining"] == 1
    adm.set_draining(False)
    adm.admit(acme, "batch", 5, 5, 0, 0)


def test_priority_not_allowed_is_a_value_error() -> None:
    acme = tenant(prios=("batch",))
    adm, _ = make(acme)
    with pytest.raises(ValueError, match="'interactive' is not allowed"):
        adm.admit(acme, "interactive", 1, 1, 0, 0)
    with pytest.raises(ValueError, match="priority must be one of"):
        adm.admit(acme, "urgent", 1, 1, 0, 0)


@pytest.mark.parametrize("tenants", [None, {}])
def test_auth_off_default_tenant_is_unlimited(tenants: dict[str, TenantConfig] | None) -> None:
    adm = Admission(tenants, max_waiting=4, clock=FakeClock())
    tickets = [adm.admit(DEFAULT_TENANT, "interactive", 10**5, 10**5, 0, 0) for _ in range(100)]
    assert all(isinstance(t, Ticket) for t in tickets)
    with pytest.raises(Rejected):  # the queue still protects the server
        adm.admit(DEFAULT_TENANT, "interactive", 1, 1, 4, 4)
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
    t = adm.admit(big, "interactive", 10**7, 10**7, 0, 0)
    with pytest.raises(Rejected, match="concurrent"):  # its concurrency cap still holds
        adm.admit(big, "interactive", 1, 1, 0, 0)
    adm.release(t, 0)
