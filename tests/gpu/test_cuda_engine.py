"""The CUDA path: same engine, fused kernel and CUDA graphs, equal to transformers in fp32.

Tests that need the bundled model's real weights skip, with the reason, where only its tokenizer
was carried (`scripts/gpu_check.sh`); the rest run on the tiny model or on random weights in the
bundled model's shapes."""

from __future__ import annotations

import asyncio

import pytest
import torch

from batcher.core.config import CacheConfig, SchedulerConfig
from batcher.engine.engine import AsyncEngine
from batcher.models.loader import load_model
from batcher.core.request import Request
from batcher.runtime.model_runner import ModelRunner
from batcher.core.sampling import SamplingParams
from batcher.tokenizer.tokenizer import load_tokenizer
from tests.gpu.conftest import bundled_weights_missing
from tests.greedy_loop import greedy_generate, staggered_generate
from tests.test_smollm_reference import CHAT_PROMPTS, NEW_TOKENS, chat_ids

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_fp32():
    reason = bundled_weights_missing()
    if reason:
        pytest.skip(reason)
    return load_model("smollm2-135m", dtype="float32", device="cuda")


def stop_ids(*sources) -> tuple[int, ...]:
    """Every token id any of `sources` ends generation at (an int, a list of them or None).
    transformers versions disagree on which of the GGUF's end tokens the tokenizer calls EOS,
    while the model's generation config names another: both sides suppress the union."""
    ids: set[int] = set()
    for s in sources:
        if s is None:
            continue
        ids.update([int(s)] if isinstance(s, int) else (int(i) for i in s))
    return tuple(sorted(ids))


def test_greedy_equals_hf_on_cuda(cuda_fp32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from batcher.bundled import smollm2_gguf_path

    path = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              dtype=torch.float32).cuda().eval()
    ours_tok = load_tokenizer(cuda_fp32.tokenizer_source)
    # NOTE: the same ids are kept out on both sides, so each generates all NEW_TOKENS tokens and
    # every one of them is compared; suppressing only one side's EOS compares different things.
    suppress = stop_ids(tok.eos_token_id, hf.generation_config.eos_token_id,
                        ours_tok.eos_token_ids)
    prompts = [chat_ids(tok, p) for p in CHAT_PROMPTS]
    runner = ModelRunner(cuda_fp32, num_blocks=128, block_size=16)
    assert runner.backend == "triton" and runner.graphs is not None
    ours = greedy_generate(runner, prompts, NEW_TOKENS, suppress=suppress)
    for prompt, got in zip(prompts, ours):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              suppress_tokens=list(suppress), pad_token_id=suppress[0])
        want = out[0, len(prompt):].tolist()
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        assert got == want, (f"{tok.decode(prompt)!r}: first difference at token {first} "
                             f"(ours {got[first:first + 4] if first is not None else got}, "
                             f"transformers {want[first:first + 4] if first is not None else want})")


@pytest.mark.parametrize("model", ["tiny", "smollm2-135m"])
def test_graphs_equal_eager(model, request):
    loaded = (load_model("tiny", dtype="float32", device="cuda") if model == "tiny"
              else request.getfixturevalue("cuda_fp32"))
    prompts = [[100 + 3 * i + j for j in range(20 + 11 * i)] for i in range(5)]
    eager = ModelRunner(loaded, 128, 16, cuda_graphs=False)
    graphed = ModelRunner(loaded, 128, 16, cuda_graphs=True)
    assert graphed.graphs is not None
    # The graphs take no position past the model's rotary table (8,192 asked by default).
    assert graphed.graphs.max_blocks * 16 <= loaded.config.max_position_embeddings
    assert greedy_generate(graphed, prompts, 24) == greedy_generate(eager, prompts, 24)


@pytest.mark.parametrize("model", ["tiny", "smollm2-135m"])
def test_steps_with_prompt_chunks_replay_as_graphs(model, request):
    """Prompts arriving while others decode, through `execute`: steps with a prompt chunk and
    decode rows replay a token bucket's graph (`mixed_graphs`), decode-only steps theirs, and
    the tokens are the eager runner's (fp32)."""
    loaded = (load_model("tiny", dtype="float32", device="cuda") if model == "tiny"
              else request.getfixturevalue("cuda_fp32"))
    prompts = [[100 + 3 * i + j for j in range(20 + 11 * i)] for i in range(5)]
    eager = ModelRunner(loaded, 128, 16, cuda_graphs=False)
    graphed = ModelRunner(loaded, 128, 16, cuda_graphs=True)
    assert graphed.graphs is not None and graphed.mixed_graphs is not None
    replays = {"mixed": 0, "decode": 0}
    for name, graphs in (("mixed", graphed.mixed_graphs), ("decode", graphed.graphs)):
        def counted(sched, run=graphs.run, name=name):
            replays[name] += 1
            return run(sched)
        graphs.run = counted
    assert staggered_generate(graphed, prompts, 12) == staggered_generate(eager, prompts, 12)
    assert replays == {"mixed": 5, "decode": 11}


def test_a_prompt_read_in_chunks_that_sample_nothing_replays_its_own_inputs():
    """A long prompt read in 96-token chunks with nothing else running: consecutive replays
    that sample nothing (so nothing syncs with the device between them) each copy their own
    step's inputs, so the cache holds the whole prompt and the first token is the eager
    runner's (fp32)."""
    from batcher.core.outputs import ScheduledSeq, SchedulerOutput

    loaded = load_model("tiny", dtype="float32", device="cuda")
    prompt = [(37 * i) % 5000 + 100 for i in range(96 * 6)]
    blocks = list(range(-(-(len(prompt) + 8) // 16)))
    greedy = SamplingParams(temperature=0.0)
    caches = {}
    for mode in (False, True):
        runner = ModelRunner(loaded, 64, 16, cuda_graphs=mode)
        assert (runner.mixed_graphs is not None) == mode
        for start in range(0, len(prompt), 96):
            last = start + 96 == len(prompt)
            out = runner.execute(SchedulerOutput([ScheduledSeq(
                "p", prompt[start:start + 96], start, blocks, last, greedy)]))
        caches[mode] = ([t.float().cpu() for kv in runner.kv_caches for t in kv], out.token_ids)
    (eager_kv, eager_tok), (graph_kv, graph_tok) = caches[False], caches[True]
    assert graph_tok == eager_tok
    used = len(blocks)
    for e, g in zip(eager_kv, graph_kv):
        torch.testing.assert_close(g[:used], e[:used], rtol=1e-4, atol=1e-4)


def test_engine_sizes_kv_from_free_memory_and_serves():
    # Sizing and serving do not depend on the weights' values: random ones in the bundled
    # model's shapes stand in where its weights were not carried.
    fmt = "dummy" if bundled_weights_missing() else "auto"
    loaded = load_model("smollm2-135m", dtype="bfloat16", device="cuda", load_format=fmt)
    tok = load_tokenizer(loaded.tokenizer_source)
    engine = AsyncEngine.from_loaded(loaded, tok, SchedulerConfig(max_num_seqs=256,
                                     max_num_batched_tokens=8192), CacheConfig())
    assert engine.kv.num_total_blocks > 10_000  # tens of GB of an H200-class card

    async def run():
        await engine.start()
        outs = []
        for i in range(8):
            req = Request(f"g{i}", tok.encode(f"Count to {i}:"), SamplingParams(
                max_tokens=16, temperature=0.0, ignore_eos=True))
            outs.append([ev async for ev in engine.generate(req)][-1])
        await engine.stop()
        return outs

    finals = asyncio.run(run())
    assert all(f.finish_reason == "length" and f.num_output_tokens == 16 for f in finals)


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_steps_scheduled_ahead_decode_the_same_greedy_tokens_on_cuda(monkeypatch, cuda_graphs):
    """In steady decoding the engine queues each next step before the running one's tokens are
    known, its inputs taken on the device from the step before (`Scheduler.schedule_ahead`,
    `launched_step.fed_tokens`), launched while that step runs. On CUDA, with the decode graphs
    replaying those inputs, and eagerly (the inputs scattered into rows laid out longest
    context first): the same greedy tokens as without."""
    from batcher.runtime import model_runner as model_runner_module
    from batcher.runtime.launched_step import fed_tokens

    loaded = load_model("tiny", dtype="float32", device="cuda")
    tok = load_tokenizer(loaded.tokenizer_source)
    fed = [0]

    def counted_feed(sched, before):
        fed[0] += 1
        return fed_tokens(sched, before)

    monkeypatch.setattr(model_runner_module, "fed_tokens", counted_feed)

    async def run(ahead: bool) -> tuple[list[list[int]], int]:
        engine = AsyncEngine.from_loaded(loaded, tok, SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=512), CacheConfig(num_blocks=512),
            cuda_graphs=cuda_graphs)
        assert (engine.runner.graphs is not None) is cuda_graphs
        engine.ahead, engine.ahead_max_step_s = ahead, float("inf")
        schedule_ahead, queued = engine.scheduler.schedule_ahead, [0]

        def counted(prev):
            out = schedule_ahead(prev)
            queued[0] += out is not None and not out.is_empty
            return out

        engine.scheduler.schedule_ahead = counted
        await engine.start()

        async def one(i: int) -> list[int]:
            req = Request(f"a{i}", [100 + (i * 13 + j) % 900 for j in range(5 + 7 * i)],
                          SamplingParams(max_tokens=20 + 3 * i, temperature=0.0,
                                         ignore_eos=True))
            return [t async for ev in engine.generate(req) for t in ev.token_ids]

        try:
            return await asyncio.gather(*(one(i) for i in range(6))), queued[0]
        finally:
            await engine.stop()

    plain, none_ahead = asyncio.run(run(False))
    assert fed[0] == 0
    ahead, steps_ahead = asyncio.run(run(True))
    assert none_ahead == 0 and steps_ahead > 10 and fed[0] > 10
    assert ahead == plain
