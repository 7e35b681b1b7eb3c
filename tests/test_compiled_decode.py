"""`--compile-decode`: one-row decode steps through torch.compile give the eager steps' tokens,
write the paged cache in place, and compile once for every context length."""

from __future__ import annotations

import pytest
import torch

from batcher.core.outputs import ScheduledSeq, SchedulerOutput
from batcher.models.loader import load_model
from batcher.runtime.model_runner import ModelRunner
from batcher.core.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
BLOCKS = list(range(4))  # 64 tokens of context


def _decode(runner: ModelRunner, prompt: list[int], steps: int) -> list[int]:
    # One sequence through `execute`: a prefill, then one-row decode steps.
    out = runner.execute(SchedulerOutput([ScheduledSeq("s", prompt, 0, BLOCKS, True, GREEDY)]))
    tokens = list(out.token_ids)
    for i in range(steps):
        out = runner.execute(SchedulerOutput([ScheduledSeq(
            "s", [tokens[-1]], len(prompt) + i, BLOCKS, True, GREEDY)]))
        tokens.extend(out.token_ids)
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: eager steps run C kernels
def test_compiled_one_row_steps_match_eager_steps(dtype: str) -> None:
    lm = load_model("tiny", dtype=dtype, device="cpu")
    eager = ModelRunner(lm, num_blocks=8, block_size=16)
    compiled = ModelRunner(lm, num_blocks=8, block_size=16, compile_decode=True)
    if compiled.compiled is None:
        pytest.skip("torch.compile is not usable here (the runner logged why)")
    prompt = list(range(300, 310))
    graph, calls = compiled.compiled._fn, []
    compiled.compiled._fn = lambda *args: calls.append(1) or graph(*args)
    # From a context under one block (the padded table) across two block boundaries; every
    # step reads what the earlier compiled steps wrote into the cache.
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = _decode(compiled, prompt, 40)
    assert len(calls) == 40  # every decode step ran the graph (the prefill did not)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no recompiling
    want = _decode(eager, prompt, 40)
    assert compiled.compiled is not None  # no step fell back to eager
    if dtype == "bfloat16":
        # The graph rounds as torch's ops do, the eager steps as the C kernels do: the tokens
        # agree until a near-tie, and the caches after it differ with them.
        assert got[:16] == want[:16]
        return
    assert got == want
    # The compiled steps wrote the cache as the eager ones did.
    for (k, v), (k_ref, v_ref) in zip(compiled.kv_caches, eager.kv_caches):
        torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-5)


def test_only_one_row_decode_steps_are_taken() -> None:
    from batcher.runtime.compiled_decode import CompiledDecode

    one = SchedulerOutput([ScheduledSeq("a", [5], 20, BLOCKS, True, GREEDY)])
    two = SchedulerOutput([ScheduledSeq(r, [5], 20, BLOCKS[2 * i:2 * i + 2] * 2, True, GREEDY)
                           for i, r in enumerate("ab")])
    prefill = SchedulerOutput([ScheduledSeq("a", [5, 6, 7], 0, BLOCKS, True, GREEDY)])
    drafted = SchedulerOutput([ScheduledSeq("a", [5, 6], 20, BLOCKS, True, GREEDY,
                                            draft_token_ids=[6])])
    scored = SchedulerOutput([ScheduledSeq("a", [5], 20, BLOCKS, True, GREEDY,
                                           score_targets=(6,))])
    verdicts = [CompiledDecode.takes(s) for s in (one, two, prefill, drafted, scored)]
    assert verdicts == [True, False, False, False, False]
