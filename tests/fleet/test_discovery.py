"""Discovery (static, file, DNS) on a scripted clock and prober, then over real processes: a
router that finds replicas in a file and by DNS, and two routers side by side."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import aiohttp
import pytest

from batcher.engine.snapshot import EngineSnapshot
from batcher.fleet.router.discovery import (
    Discovery,
    DnsSource,
    FileSource,
    StaticSource,
    Target,
    parse_source,
    resolve_all,
)
from batcher.fleet.router.registry import Registry
from tests.fleet.procs import (
    admin,
    completion,
    free_port,
    replica,
    replica_view,
    router,
    running,
    served_by,
    wait_http,
    wait_routable,
)

STATE = EngineSnapshot(free_blocks=100, total_blocks=100, block_size=16, running=0, waiting=0,
                     version="v1", draining=False, healthy=True)


# parsing ---------------------------------------------------------------------------------------
def test_parse_source_kinds_and_errors():
    st = parse_source("static:http://a:1,http://b:2/")
    assert isinstance(st, StaticSource)
    assert [t.url for t in st.targets] == ["http://a:1", "http://b:2"]
    f = parse_source("file:/x/replicas.txt")
    assert isinstance(f, FileSource) and f.path == Path("/x/replicas.txt")
    d = parse_source("dns:batcher-replicas:8000")
    assert isinstance(d, DnsSource) and (d.host, d.port, d.interval) == ("batcher-replicas",
                                                                         8000, 5.0)
    assert parse_source("dns:[fd00::1]:80").host == "fd00::1"
    for bad in ("dns:name", "dns:name:0", "dns:name:x", "static:", "static:ftp://a", "file:",
                "consul:x", "http://a:1", "static:http://a:port"):
        with pytest.raises(ValueError):
            parse_source(bad)


async def test_file_source_reloads_on_change_and_keeps_the_list_when_unreadable(tmp_path):
    path = tmp_path / "replicas.txt"
    path.write_text("# fleet\nhttp://10.0.0.1:8000\n\nhttp://10.0.0.2:8000,http://10.0.0.2:8001"
                    "  # with admin\nnot a url\n")
    src = FileSource(path)
    got = await src.poll()
    assert got == [Target("http://10.0.0.1:8000"),
                   Target("http://10.0.0.2:8000", "http://10.0.0.2:8001")]
    assert await src.poll() is None  # unchanged: nothing to do
    path.write_text("http://10.0.0.3:8000\n")
    assert await src.poll() == [Target("http://10.0.0.3:8000")]
    path.unlink()
    assert await src.poll() is None  # unreadable: keep the last answer
    path.write_text("")
    assert await src.poll() == []  # an empty file is an answer: no replicas


async def test_dns_source_answers_errors_and_empty_names():
    answers: list[object] = [["10.1.0.2", "10.1.0.1", "fd00::5"]]

    async def resolve(host: str, port: int) -> list[str]:
        a = answers[0]
        if isinstance(a, BaseException):
            raise a
        assert (host, port) == ("svc", 8000)
        return list(a)  # type: ignore[call-overload]

    src = DnsSource("svc", 8000, resolve=resolve)
    assert {t.url for t in await src.poll() or ()} == {
        "http://10.1.0.1:8000", "http://10.1.0.2:8000", "http://[fd00::5]:8000"}
    answers[0] = socket.gaierror(socket.EAI_AGAIN, "temporary failure")
    assert await src.poll() is None  # a resolver hiccup keeps the fleet
    answers[0] = TimeoutError()
    assert await src.poll() is None
    answers[0] = socket.gaierror(socket.EAI_NONAME, "no such name")
    assert await src.poll() == []  # the name has no addresses: that is an answer


async def test_real_resolver_through_the_event_loop():
    assert "127.0.0.1" in await resolve_all("localhost", 80)


# the reconciler --------------------------------------------------------------------------------
class Scripted:
    """A source whose answer the test sets."""

    def __init__(self, *urls: str):
        self.label, self.interval = "scripted", 3600.0
        self.urls = list(urls)

    async def poll(self) -> list[Target] | None:
        return [Target(u) for u in self.urls]


class Prober:
    """Fails addresses in `failing`; counts probes."""

    def __init__(self) -> None:
        self.failing: set[str] = set()
        self.calls: list[str] = []

    async def __call__(self, t: Target) -> EngineSnapshot | str:
        self.calls.append(t.url)
        return "refused" if t.url in self.failing else STATE


async def settle(d: Discovery) -> None:
    """Poll every source, reconcile, and let the probes started finish."""
    for i in range(len(d.sources)):
        await d.poll(i)
    d.reconcile()
    await asyncio.gather(*(p.task for p in d.pending.values() if p.task is not None))


async def test_new_addresses_join_only_after_a_good_probe():
    now = [0.0]
    reg, src, probe = Registry(), Scripted("http://a:1", "http://b:1"), Prober()
    probe.failing.add("http://b:1")
    d = Discovery(reg, [src], probe, retry=1.0, clock=lambda: now[0])
    await settle(d)
    assert reg.get("a:1") is not None and reg.routable(reg.get("a:1"))
    assert reg.get("b:1") is None and "b:1" in d.pending  # never routable before a good probe
    await settle(d)
    assert probe.calls.count("http://b:1") == 1  # retried only after `retry`
    probe.failing.clear()
    now[0] = 1.0
    await settle(d)
    assert reg.get("b:1") is not None and not d.pending
    assert sorted(d.owned) == ["a:1", "b:1"]


async def test_removed_address_drains_then_is_forgotten():
    now = [0.0]
    reg, src = Registry(), Scripted("http://a:1", "http://b:1")
    forgotten: list[str] = []

    def forget(rid: str) -> None:
        forgotten.append(rid)
        reg.remove(rid)

    d = Discovery(reg, [src], Prober(), forget, drain_timeout=30.0, clock=lambda: now[0])
    await settle(d)
    a = reg.get("a:1")
    token = reg.reserve(a, 2, now[0])  # a request in flight on a
    src.urls = ["http://b:1"]
    await settle(d)
    assert a.router_draining and not reg.routable(a) and reg.get("a:1") is a
    now[0] = 5.0
    d.reconcile()
    assert reg.get("a:1") is a  # its request still runs
    reg.release(a, token)
    d.reconcile()
    assert reg.get("a:1") is None and forgotten == ["a:1"] and "a:1" not in d.owned
    # Coming back later is a fresh admission.
    src.urls = ["http://a:1", "http://b:1"]
    await settle(d)
    assert reg.get("a:1") is not None and reg.routable(reg.get("a:1"))


async def test_drain_timeout_forgets_a_replica_whose_work_never_ends():
    now = [0.0]
    reg, src = Registry(), Scripted("http://a:1")
    d = Discovery(reg, [src], Prober(), drain_timeout=10.0, clock=lambda: now[0])
    await settle(d)
    reg.reserve(reg.get("a:1"), 1, 0.0)
    src.urls = []
    await settle(d)
    now[0] = 9.0
    d.reconcile()
    assert reg.get("a:1") is not None
    now[0] = 10.0
    d.reconcile()
    assert reg.get("a:1") is None


async def test_return_while_draining_lifts_only_discoverys_drain():
    reg, src = Registry(), Scripted("http://a:1", "http://b:1")
    d = Discovery(reg, [src], Prober())
    await settle(d)
    a, b = reg.get("a:1"), reg.get("b:1")
    b.router_draining = True  # an operator drained b through the admin API
    for rep in (a, b):
        reg.reserve(rep, 1, 0.0)
    src.urls = []
    await settle(d)
    assert a.router_draining and b.router_draining
    src.urls = ["http://a:1", "http://b:1"]
    await settle(d)
    assert not a.router_draining and reg.routable(a)
    assert b.router_draining  # still the operator's decision


async def test_replicas_that_joined_another_way_are_left_alone():
    reg = Registry()
    reg.add_static("http://a:1")  # --replica
    beat = {"free_blocks": 1, "total_blocks": 1, "block_size": 16, "running": 0, "waiting": 0,
            "version": "v1", "draining": False, "healthy": True, "replica_id": "named",
            "url": "http://b:1", "epoch": 1, "seq": 1}
    reg.beat(beat, 0.0)  # a heartbeat under its own id
    src, probe = Scripted("http://a:1", "http://b:1"), Prober()
    d = Discovery(reg, [src], probe)
    await settle(d)
    assert not probe.calls and not d.owned and not d.pending
    src.urls = []
    await settle(d)
    assert reg.get("a:1") is not None and not reg.get("a:1").router_draining
    assert reg.get("named") is not None


async def test_sources_are_unioned_and_a_failing_one_keeps_its_answer(tmp_path):
    path = tmp_path / "r.txt"
    path.write_text("http://a:1\n")
    reg = Registry()
    d = Discovery(reg, [FileSource(path), StaticSource(["http://b:1"])], Prober())
    await settle(d)
    assert sorted(d.owned) == ["a:1", "b:1"]
    path.unlink()
    await settle(d)
    assert sorted(d.owned) == ["a:1", "b:1"] and not d.leaving


async def test_start_and_close_run_bounded_loops(tmp_path):
    path = tmp_path / "r.txt"
    path.write_text("http://a:1\n")
    reg = Registry()
    src = FileSource(path, interval=0.05)
    d = Discovery(reg, [src], Prober(), tick=0.05)
    await d.start()
    try:
        assert "a:1" in d.owned or "a:1" in d.pending
        path.write_text("http://b:1\n")
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
        for _ in range(100):
            if reg.get("b:1") is not None and reg.get("a:1") is None:
                break
            await asyncio.sleep(0.02)
        assert reg.get("b:1") is not None and reg.get("a:1") is None
        loops = list(d._tasks)
    finally:
        await d.close()
    assert loops and all(t.done() for t in loops)


# real processes ----------------------------------------------------------------------------------
async def replica_ids(s: aiohttp.ClientSession, rt) -> dict[str, dict]:
    st = await admin(s, rt, "/admin/status")
    return {r["replica_id"]: r for r in st["replicas"]}


async def wait_for(cond, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await cond():
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(what)


@pytest.mark.slow
async def test_router_discovers_by_file_and_dns_admits_after_probe_and_drains_removed(tmp_path):
    listing = tmp_path / "replicas.txt"
    r0 = replica("r0", decode_ms=10)
    r1_port = free_port()  # r1 starts later, after its address is already listed
    listing.write_text(f"{r0.url}\n")
    rt = router("--discover", f"file:{listing}", "--discover-interval", "0.2")
    rd = router("--discover", f"dns:localhost:{r0.port}", "--discover-interval", "0.5")
    with running(r0, rt, rd):
        wait_http(r0.url + "/ready", procs=(r0,))
        wait_http(rt.url + "/health", procs=(rt,))
        wait_http(rd.url + "/health", procs=(rd,))
        async with aiohttp.ClientSession() as s:
            await wait_routable(s, rt, 1)
            await wait_routable(s, rd, 1)  # found by DNS (localhost's A record)
            assert (await completion(s, rd.url, "via dns", 2))[0] == 200
            # An address that does not answer yet is listed but never routable.
            r1_url = f"http://127.0.0.1:{r1_port}"
            listing.write_text(f"{r0.url}\n{r1_url}\n")
            await asyncio.sleep(1.0)
            assert f"127.0.0.1:{r1_port}" not in await replica_ids(s, rt)
            found = (await admin(s, rt, "/admin/status"))["discovery"]
            assert f"127.0.0.1:{r1_port}" in found["pending"], found
            r1 = replica("r1", port=r1_port, decode_ms=10)
            with running(r1):
                wait_http(r1.url + "/ready", procs=(r1,))
                await wait_routable(s, rt, 2)
                # Remove r0 while long requests (4 s) run there: they finish, r0 takes no new
                # work, then the router forgets it.
                r0_id = f"127.0.0.1:{r0.port}"
                long = [asyncio.create_task(completion(s, rt.url, f"long {i}", 400))
                        for i in range(4)]
                await asyncio.sleep(0.5)
                assert (await replica_ids(s, rt))[r0_id]["router_inflight"] > 0
                listing.write_text(f"{r1_url}\n")

                async def draining() -> bool:
                    return (await replica_ids(s, rt))[r0_id]["router_draining"]

                await wait_for(draining, 5.0, "r0 draining")
                mid = await served_by(s, rt)
                for i in range(10):
                    assert (await completion(s, rt.url, f"after {i}", 2))[0] == 200
                after_short = await served_by(s, rt)
                assert after_short.get(r0_id, 0) == mid.get(r0_id, 0)
                assert [st for st, _ in await asyncio.gather(*long)] == [200] * 4

                async def gone() -> bool:
                    return r0_id not in await replica_ids(s, rt)

                await wait_for(gone, 10.0, "r0 forgotten")
                # Its series (the 4 long requests it served) leave the router's /metrics
                # with it.
                assert r0_id not in await served_by(s, rt)


@pytest.mark.slow
async def test_two_routers_share_only_what_replicas_tell_them():
    """Two routers over the same heartbeating replicas: both route, and a drain made through
    one router, an eviction and a re-admission are seen by both."""
    ra, rb = router(), router()
    reps = [replica(f"r{i}", "--router", ra.internal_url, router=rb.internal_url, decode_ms=5) for i in range(3)]
    with running(ra, rb, *reps):
        for p in (ra, rb):
            wait_http(p.url + "/health", procs=(p,))
        async with aiohttp.ClientSession() as s:
            for rt in (ra, rb):
                await wait_routable(s, rt, 3)
            for rt in (ra, rb):
                statuses = await asyncio.gather(*(completion(s, rt.url, f"p{i}", 2)
                                                  for i in range(30)))
                assert [st for st, _ in statuses] == [200] * 30
                assert len(await served_by(s, rt)) >= 2

            # Drain r0 through router A: A stops at once, B learns it from r0's heartbeats.
            await admin(s, ra, "/admin/drain", {"replica": "r0"})

            async def b_sees_drain() -> bool:
                v = await replica_view(s, rb, "r0")
                return v["draining"] and not v["routable"]

            await wait_for(b_sees_drain, 5.0, "router B to see r0 draining")
            # Stop r1 (SIGSTOP): each router's health checks evict it on their own.
            reps[1].signal(signal.SIGSTOP)

            async def both_evicted() -> bool:
                return all([(await replica_view(s, rt, "r1"))["evicted"] for rt in (ra, rb)])

            await wait_for(both_evicted, 15.0, "both routers to evict r1")
            for rt in (ra, rb):
                before = await served_by(s, rt)
                statuses = await asyncio.gather(*(completion(s, rt.url, f"q{i}", 2)
                                                  for i in range(10)))
                assert [st for st, _ in statuses] == [200] * 10
                after = await served_by(s, rt)
                assert {k for k in after if after[k] != before.get(k, 0)} == {"r2"}
            reps[1].signal(signal.SIGCONT)

            async def both_readmitted() -> bool:
                return all([(await replica_view(s, rt, "r1"))["routable"] for rt in (ra, rb)])

            await wait_for(both_readmitted, 20.0, "both routers to re-admit r1")
