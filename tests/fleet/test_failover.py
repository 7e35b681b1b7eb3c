"""Failover over real processes: kill -9 with requests in flight, SIGSTOP eviction and
re-admission, a wedged engine caught by the deep probe."""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import pytest

from tests.fleet.procs import (
    admin,
    completion,
    free_port,
    replica,
    replica_view,
    router,
    router_samples,
    running,
    stream,
    stream_text,
    wait_http,
    wait_routable,
)

pytestmark = pytest.mark.slow
N = 240
TOKENS = 40


def fleet(n: int, *router_flags: str, **replica_kw):
    port = free_port()
    rt = router(*router_flags, port=port)
    reps = [replica(f"r{i}", router=rt.internal_url, **replica_kw) for i in range(n)]
    return rt, reps


async def test_kill9_with_requests_in_flight():
    rt, reps = fleet(3, decode_ms=10, num_blocks=1024)
    victim = reps[0]
    with running(rt, *reps):
        wait_http(rt.url + "/health", procs=(rt,))
        async with aiohttp.ClientSession() as s:
            await wait_routable(s, rt, 3)
            gate = asyncio.Semaphore(30)
            done = [0]

            async def one(i: int):
                async with gate:
                    prompt = f"request number {i}"
                    if i % 3 == 0:
                        out = await completion(s, rt.url, prompt, TOKENS, rid=f"id-{i}")
                    else:
                        mode = "resume" if i % 3 == 1 else "error"
                        out = await stream(s, rt.url, prompt, TOKENS, rid=f"id-{i}",
                                           failover=mode)
                    done[0] += 1
                    return out

            # Steady traffic first (the retry budget is a share of recent requests), then the
            # kill while the victim holds a third of the requests in flight.
            tasks = [asyncio.create_task(one(i)) for i in range(N)]
            deadline = time.monotonic() + 30
            while done[0] < 150 or (await replica_view(s, rt, "r0"))["router_inflight"] < 6:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            # A few decode steps more, so the streams just routed there have sent tokens (a
            # stream killed before its first token is retried whole, which tells nothing here).
            await asyncio.sleep(0.1)
            victim.signal(signal.SIGKILL)
            results = await asyncio.gather(*tasks)

            # The reference answers, 8 at a time on each survivor (well within its TTFT SLO;
            # a 503 is retried a second later).
            ref_gate = asyncio.Semaphore(16)

            async def reference(i: int):
                async with ref_gate:
                    for _ in range(10):
                        status, body = await completion(s, reps[1 + i % 2].url,
                                                        f"request number {i}", TOKENS)
                        if status != 503:
                            break
                        await asyncio.sleep(1.0)
                    return status, body

            fault_free = await asyncio.gather(*(reference(i) for i in range(N)))
            expected = {}
            for i, (_, body) in enumerate(fault_free):
                assert "choices" in body, body
                expected[i] = body["choices"][0]["text"]
            exhausted = await router_samples(s, rt, "batcher_router_retry_budget_exhausted_total")
            failovers = {lb["kind"]: v for lb, v in await router_samples(
                s, rt, "batcher_failovers_total")}
            retries = sum(v for _, v in await router_samples(s, rt, "batcher_retries_total"))
            budget = (await admin(s, rt, "/admin/status"))["retry_budget"]

    resumed = errored = same_after_resume = 0
    for i, (status, out) in enumerate(results):
        assert status == 200, (i, out)
        if i % 3 == 0:  # not streamed: retried from the start, never lost
            assert out["choices"][0]["text"] == expected[i]
            continue
        assert out[-1] == "[DONE]"
        last = out[-2]
        text = stream_text(out)
        if "error" in last:  # the explicit end, with what was sent
            assert i % 3 == 2, (i, last)
            chunks = sum(1 for e in out[:-2] if e["choices"] and e["choices"][0]["text"])
            assert last["error"]["tokens_sent"] == chunks
            assert last["error"]["partial_output"] == [text]
            assert expected[i].startswith(text)
            errored += 1
            continue
        assert last["choices"][0]["finish_reason"] == "length"
        if last.get("resumed"):
            assert i % 3 == 1
            resumed += 1
            chunks = [e["choices"][0]["text"] for e in out[:-1] if e["choices"][0]["text"]]
            # Nothing repeated or lost at the switch: the router resumes from the prompt's
            # token ids plus the ids streamed so far, so the greedy continuation is the very
            # fault-free one, and the replica's token ids never reach the client.
            assert expected[i].startswith("".join(chunks[: last["resumed_at"]]))
            assert text == expected[i], (i, text, expected[i])
            assert all("token_ids" not in e["choices"][0] for e in out[:-1] if e["choices"])
            same_after_resume += 1
        else:
            assert text == expected[i]
    assert resumed + errored >= 1, "the kill hit no stream"
    print(f"resumed {resumed} (identical {same_after_resume}), ended with the error {errored}")
    assert exhausted == [({}, 0.0)], budget
    # Counted where they happen: each resumed or broken stream once, retries as failovers too.
    assert failovers.get("resume", 0) >= resumed and failovers.get("error", 0) >= errored
    assert failovers.get("retry", 0) == retries, (failovers, retries)


@pytest.mark.serial  # eviction within 3.5 s of a ~3 s detection
async def test_sigstop_evicted_within_3_5s_and_readmitted_after_two_probes():
    rt, reps = fleet(2, decode_ms=10)
    stopped = reps[0]
    with running(rt, *reps):
        wait_http(rt.url + "/health", procs=(rt,))
        async with aiohttp.ClientSession() as s:
            await wait_routable(s, rt, 2)
            tasks = [asyncio.create_task(completion(s, rt.url, f"slow {i}", 150))
                     for i in range(6)]
            while (await replica_view(s, rt, "r0"))["router_inflight"] < 1:
                await asyncio.sleep(0.02)
            stopped.signal(signal.SIGSTOP)
            t0 = time.monotonic()
            while not (await replica_view(s, rt, "r0"))["evicted"]:
                assert time.monotonic() - t0 < 3.5, "not evicted within 3.5 s"
                await asyncio.sleep(0.05)
            evicted_after = time.monotonic() - t0
            print(f"evicted {evicted_after:.2f}s after SIGSTOP")
            results = await asyncio.gather(*tasks)  # its work failed over
            assert all(status == 200 for status, _ in results), results
            probes = (await replica_view(s, rt, "r0"))["health"]["probes"]
            stopped.signal(signal.SIGCONT)
            t1 = time.monotonic()
            while (view := await replica_view(s, rt, "r0"))["evicted"]:
                assert time.monotonic() - t1 < 10, view
                await asyncio.sleep(0.05)
            assert view["health"]["readmitted_after"] == 2
            assert view["health"]["probes"] - probes >= 2  # two passing rounds, not one
            assert (await completion(s, rt.url, "after", 4))[0] == 200
    assert evicted_after < 3.5


async def test_wedged_engine_is_caught_by_the_deep_probe():
    port = free_port()
    rt = router("--probe-interval", "1", "--probe-deadline", "0.5", port=port)
    wedged = replica("wedged", "--fake-fault", "hang", "--fake-fault-after-steps", "3",
                     router=rt.internal_url, num_blocks=2048)
    good = replica("good", router=rt.internal_url)
    with running(rt, wedged, good):
        wait_http(rt.url + "/health", procs=(rt,))
        async with aiohttp.ClientSession() as s:
            await wait_routable(s, rt, 2)
            # The wedged replica has more free KV, so it takes the first requests and hangs.
            t0 = time.monotonic()
            results = await asyncio.gather(*(completion(s, rt.url, f"w{i}", 20)
                                             for i in range(3)))
            assert all(status == 200 for status, _ in results), results
            view = await replica_view(s, rt, "wedged")
            assert view["evicted"] and time.monotonic() - t0 < 10
            assert "probe" in view["health"]["last_error"]
            # Moved off a replica health evicted: failover, counted, and no overload retry.
            lost = {lb["reason"]: v for lb, v in await router_samples(
                s, rt, "batcher_retries_total")}.get("replica_lost", 0)
            assert lost >= 1, lost
            status = await admin(s, rt, "/admin/status")
            assert status["retry_budget"]["retries_in_window"] == 0, status["retry_budget"]
        wedged.signal(signal.SIGKILL)  # its engine thread never returns: no clean shutdown


async def test_kill9_in_a_burst_spends_no_retry_budget():
    """A burst of 60 at once on a fresh router (its retry budget allows max(3, 10%) = 6), and
    one of three replicas killed while it holds a third of them: the requests it held move to
    the other two as failover, not as overload retries, so all 60 are answered in full."""
    rt, reps = fleet(3, decode_ms=10, num_blocks=1024)
    with running(rt, *reps):
        wait_http(rt.url + "/health", procs=(rt,))
        async with aiohttp.ClientSession() as s:
            await wait_routable(s, rt, 3)

            async def one(i: int):
                prompt = f"burst request {i}"
                if i % 2 == 0:
                    return await completion(s, rt.url, prompt, 120, rid=f"b-{i}")
                return await stream(s, rt.url, prompt, 120, rid=f"b-{i}", failover="resume")

            tasks = [asyncio.create_task(one(i)) for i in range(60)]
            deadline = time.monotonic() + 20
            while (await replica_view(s, rt, "r0"))["router_inflight"] < 12:
                assert time.monotonic() < deadline and not all(t.done() for t in tasks)
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # the streams there have sent tokens; the rest have not
            reps[0].signal(signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            exhausted = await router_samples(s, rt, "batcher_router_retry_budget_exhausted_total")
            retries = {lb["reason"]: v for lb, v in await router_samples(
                s, rt, "batcher_retries_total")}
    refused = [(i, out) for i, (status, out) in enumerate(results) if status != 200]
    assert not refused, refused
    for i, (_, out) in enumerate(results):
        if i % 2 == 0:
            assert out["choices"][0]["finish_reason"] == "length", out
            assert out["usage"]["completion_tokens"] == 120, out
        else:
            assert out[-1] == "[DONE]" and "error" not in out[-2], (i, out[-2:])
            assert out[-2]["choices"][0]["finish_reason"] == "length"
    assert retries.get("replica_lost", 0) >= 1, retries
    assert exhausted == [({}, 0.0)], retries
