"""Prompt logprobs (completions `echo` + `logprobs`): the engine scores prompt rows during
chunked prefill only for requests that ask, keeps every entry exactly once across preemption,
and does not let a prefix-cache hit skip a position it must score. The reference on the bundled
model (Hugging Face's log_softmax, fp32) is in `test_smollm_reference.py`, beside its fixture."""

from __future__ import annotations

import asyncio

import pytest
import torch

from batcher.core.config import SchedulerConfig
from batcher.core.outputs import TokenLogprobs
from batcher.engine.engine import AsyncEngine
from batcher.core.request import Request
from batcher.runtime.model_runner import ModelRunner
from batcher.core.sampling import SamplingParams
from batcher.tokenizer.tokenizer import load_tokenizer
from tests.test_gateway_inprocess import ALICE, TENANTS, app_factory

AUTH = {"Authorization": f"Bearer {ALICE}"}
PROMPTS = [[(7 * i + 13 * j) % 5000 + 100 for j in range(40 + 9 * i)] for i in range(4)]


async def score_prompts(loaded, prompts: list[list[int]], num_blocks: int = 256, budget: int = 256,
                 top: int = 3, max_tokens: int = 2, rounds: int = 1,
                 ) -> tuple[list[list[TokenLogprobs]], AsyncEngine]:
    tok = load_tokenizer()
    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=16)
    # A fixed token budget: chunks (and so the preemption the chunked run needs) do not depend
    # on how fast this machine's steps happen to be.
    engine = AsyncEngine(runner, tok, SchedulerConfig(max_num_seqs=16,
                                                      max_num_batched_tokens=budget,
                                                      prefill_budget="fixed"),
                         debug_checks=True)
    await engine.start()

    async def one(i: int, r: int) -> list[TokenLogprobs]:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                            prompt_logprobs=top)
        got: list[TokenLogprobs] | None = None
        async for ev in engine.generate(Request(f"p{r}-{i}", prompts[i], sp)):
            if ev.prompt_logprobs is not None:
                assert got is None, "prompt logprobs arrive once"
                got = ev.prompt_logprobs
        assert got is not None
        return got

    try:
        outs: list[list[TokenLogprobs]] = []
        for r in range(rounds):
            outs = list(await asyncio.gather(*(one(i, r) for i in range(len(prompts)))))
    finally:
        await engine.stop()
    return outs, engine


def _dense(loaded, prompt: list[int]) -> torch.Tensor:
    """The prompt's log_softmax from one unchunked step: [len - 1] logprobs of tokens 1..."""
    runner = ModelRunner(loaded, num_blocks=64, block_size=16)
    from batcher.core.outputs import ScheduledSeq, SchedulerOutput

    seq = ScheduledSeq("d", prompt, 0, list(range(-(-len(prompt) // 16))), True,
                       SamplingParams(prompt_logprobs=0), score_targets=tuple(prompt[1:]))
    out = runner.execute(SchedulerOutput([seq]))
    return torch.tensor([e.logprob for e in out.prompt_logprobs["d"]])


def _close(a: list[TokenLogprobs], b: list[TokenLogprobs], tol: float = 1e-4) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert abs(x.logprob - y.logprob) < tol
        assert [t for t, _ in x.top] == [t for t, _ in y.top] or all(
            abs(p - q) < tol for (_, p), (_, q) in zip(x.top, y.top))


async def test_chunked_preempted_and_cached_prompts_score_every_token_once(tiny_fp32) -> None:
    whole, _ = await score_prompts(tiny_fp32, PROMPTS)
    for prompt, got in zip(PROMPTS, whole):
        assert len(got) == len(prompt) - 1 and all(len(e.top) == 3 for e in got)
        ref = _dense(tiny_fp32, prompt)
        assert torch.allclose(torch.tensor([e.logprob for e in got]), ref, atol=1e-4)
    # 16-token chunks, and a pool too small for all four: preemption mid-prefill recomputes.
    chunked, engine = await score_prompts(tiny_fp32, PROMPTS, num_blocks=10, budget=16, max_tokens=16)
    assert engine.scheduler.stats.preemptions > 0
    for a, b in zip(whole, chunked):
        _close(a, b)
    # The second round finds every prompt cached, and still scores each position.
    twice, engine = await score_prompts(tiny_fp32, PROMPTS, rounds=2)
    assert engine.scheduler.stats.prefix_hit_tokens == 0
    for a, b in zip(whole, twice):
        _close(a, b)


async def test_other_requests_keep_the_prefix_cache(tiny_fp32) -> None:
    """Only requests that ask skip cached blocks: a plain request still hits."""
    tok = load_tokenizer()
    engine = AsyncEngine(ModelRunner(tiny_fp32, num_blocks=64, block_size=16), tok,
                         SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
    await engine.start()
    try:
        for rid, top in (("a", 0), ("b", None)):
            sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=top)
            async for ev in engine.generate(Request(rid, PROMPTS[1], sp)):
                last = ev
        assert last.num_cached_tokens == 48 and last.prompt_logprobs is None
    finally:
        await engine.stop()


# HTTP, in-process over the tiny model ---------------------------------------------------------
@pytest.fixture
async def client(aiohttp_client, tiny_fp32):
    return await aiohttp_client(app_factory(tiny_fp32, load_tokenizer(), TENANTS)())


async def test_echo_with_logprobs_over_http(client) -> None:
    tok = load_tokenizer()
    prompt = "Scoring a short text"
    ids = tok.encode(prompt)
    body = {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0}
    resp = await client.post("/v1/completions", json=body, headers=AUTH)
    out = await resp.json()
    assert resp.status == 200, out
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:])
    assert all(len(t) <= 2 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # With a completion: the prompt's entries, then the completion's, one text.
    body |= {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    out = await (await client.post("/v1/completions", json=body, headers=AUTH)).json()
    lp2 = out["choices"][0]["logprobs"]
    assert len(lp2["tokens"]) == len(ids) + 3
    assert lp2["token_logprobs"][0] is None
    assert lp2["token_logprobs"][1:len(ids)] == pytest.approx(lp["token_logprobs"][1:], abs=1e-5)
    assert "".join(lp2["tokens"]) == out["choices"][0]["text"]
    # Streamed: the echo chunk carries the prompt's entries.
    from tests.server_process import DONE, sse_events

    resp = await client.post("/v1/completions", json={**body, "stream": True}, headers=AUTH)
    chunks = [ev async for ev in sse_events(resp) if ev != DONE]
    tokens = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
              for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == lp2["tokens"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
        out["choices"][0]["text"]
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0},
                             headers=AUTH)
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "max_tokens"


async def test_prompt_logprobs_per_request_are_bounded(client) -> None:
    """Entries are held until the answer is written: a request whose prompts x n x (1 + logprobs)
    pass the bound is a 400 before any work, streamed or not; one within it is answered."""
    from batcher.server.gateway import MAX_PROMPT_LOGPROB_ENTRIES

    prompt = [100 + j % 4000 for j in range(400)]
    entries = 4 * 16 * (len(prompt) - 1) * 21
    assert entries > MAX_PROMPT_LOGPROB_ENTRIES  # a 20 KB body
    for stream in (False, True):
        body = {"prompt": [prompt] * 4, "n": 16, "echo": True, "logprobs": 20,
                "max_tokens": 0, "stream": stream}
        resp = await client.post("/v1/completions", json=body, headers=AUTH)
        err = (await resp.json())["error"]
        assert resp.status == 400 and err["param"] == "logprobs", err
        assert err["code"] == "prompt_logprobs_too_large" and str(entries) in err["message"]
    # Without prompt logprobs the same prompts are no concern of this bound.
    resp = await client.post("/v1/completions", headers=AUTH, json={
        "prompt": [prompt] * 4, "n": 16, "echo": True, "max_tokens": 1})
    assert resp.status == 200
    resp = await client.post("/v1/completions", headers=AUTH, json={
        "prompt": [prompt[:20]] * 2, "n": 2, "echo": True, "logprobs": 20, "max_tokens": 0})
    out = await resp.json()
    assert resp.status == 200 and len(out["choices"]) == 4
    assert all(len(c["logprobs"]["tokens"]) == 20 for c in out["choices"])


def test_a_scoring_request_takes_bounded_chunks() -> None:
    """Each scored position is a row of logits, so a scoring request's chunk is capped."""
    from batcher.core.kv_cache_manager import KVCacheManager
    from batcher.core.scheduler import MAX_SCORED_CHUNK, Scheduler

    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2048,
                                      max_model_len=4096), KVCacheManager(256, 16))
    prompt = list(range(1, 1500))
    sched.add_request(Request("s", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0)))
    sched.add_request(Request("p", prompt[:1200], SamplingParams(max_tokens=1)))
    out = sched.schedule()
    sizes = {s.request_id: s.num_tokens for s in out.seqs}
    assert sizes["s"] == MAX_SCORED_CHUNK and sizes["p"] == 1200
    scored = next(s for s in out.seqs if s.request_id == "s")
    assert scored.score_targets == tuple(prompt[1:MAX_SCORED_CHUNK + 1])
