"""Every supported architecture against transformers: a tiny random model built with its own
classes, saved as a Hugging Face folder and written as a GGUF file, loaded by us; the paged
mixed-batch forward gives the reference's logits, and greedy decoding through the engine (chunked
prefill, preemption and a prefix-cache hit) its tokens, from the folders and the files."""

from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest
import torch

from batcher.core.config import SchedulerConfig
from batcher.core.outputs import ScheduledSeq, SchedulerOutput
from batcher.engine.engine import AsyncEngine
from batcher.models.errors import ModelLoadError
from batcher.models.loader import load_model
from batcher.core.request import Request
from batcher.runtime.model_runner import ModelRunner
from batcher.core.sampling import SamplingParams
from batcher.tokenizer.tokenizer import load_tokenizer
from tests.greedy_loop import greedy_generate
from tests.model_families import (
    GGUF_ARCH,
    VOCAB,
    WINDOW,
    build_hf,
    hf_greedy,
    save_folder,
    write_gguf,
)

FAMILIES = ["llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "gemma3_mm", "phi3",
            "mixtral", "qwen2_moe", "qwen3_moe"]
BLOCK = 16
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    name = request.param
    hf = build_hf(name)
    folder = save_folder(hf, tmp_path_factory.mktemp(name))
    return name, hf, load_model(str(folder), dtype="float32", device="cpu")


def _seq(rid, tokens, start, blocks, n):
    return ScheduledSeq(rid, tokens[start:start + n], start, blocks, True, SamplingParams())


def _all_logits(runner: ModelRunner, sched: SchedulerOutput) -> torch.Tensor:
    ids, positions, meta, _, _ = runner.prepare(sched)
    return runner.model(ids, positions, meta, runner.kv_caches, torch.arange(len(ids)))


@pytest.fixture(scope="module", params=list(GGUF_ARCH))
def gguf_family(request, tmp_path_factory):
    name = request.param
    # A GGUF header has no attention scale: Gemma's is taken as 1/sqrt(head_dim).
    hf = build_hf(name, seed=1, **({"query_pre_attn_scalar": 32} if name == "gemma2" else {}))
    tmp = tmp_path_factory.mktemp(f"{name}-gguf")
    path = write_gguf(name, hf, tmp / f"{name}.gguf")
    env = pytest.MonkeyPatch()
    env.setenv("BATCHER_CACHE", str(tmp / "cache"))  # the dense weight cache
    try:
        loaded = load_model(str(path), dtype="float32", device="cpu")
    finally:
        env.undo()
    return name, hf, loaded


@pytest.mark.parametrize("fold_gqa", [False, True])
def test_paged_mixed_batch_logits_equal_transformers(family, fold_gqa):
    """Whole prompts, a prompt read in two chunks and decode rows in one flattened batch, on
    shuffled blocks: every row's logits are the dense reference's within 1e-4, with decode
    rows' query heads folded per KV head (bf16 and GPU steps) or not (fp32 on a CPU)."""
    _, hf, loaded = family
    _check_mixed_batch(hf, loaded, fold_gqa)


def test_gguf_logits_equal_transformers(gguf_family):
    name, hf, loaded = gguf_family
    assert loaded.config.architecture == type(hf).__name__
    _check_mixed_batch(hf, loaded)


async def test_gguf_engine_greedy_equals_transformers(gguf_family, tokenizer):
    """The GGUF file through the engine, as the folders go: chunked prefill, preemption and a
    prefix-cache hit."""
    await _check_engine(*gguf_family, tokenizer)


def _check_mixed_batch(hf, loaded, fold_gqa: bool = False) -> None:
    runner = ModelRunner(loaded, num_blocks=16, block_size=BLOCK)
    runner.fold_gqa = fold_gqa
    rng = random.Random(1)
    free = list(range(16))
    rng.shuffle(free)
    lens = {"a": 37, "b": 41, "c": 20}
    toks = {k: [rng.randrange(VOCAB) for _ in range(n + 1)] for k, n in lens.items()}
    blocks = {k: [free.pop() for _ in range(-(-(n + 1) // BLOCK))] for k, n in lens.items()}
    out1 = _all_logits(runner, SchedulerOutput([_seq("a", toks["a"], 0, blocks["a"], 37),
                                                _seq("b", toks["b"], 0, blocks["b"], 12),
                                                _seq("c", toks["c"], 0, blocks["c"], 20)]))
    # a and c decode (rows sorted longest context first); b's prompt goes on from token 12.
    out2 = _all_logits(runner, SchedulerOutput([_seq("a", toks["a"], 37, blocks["a"], 1),
                                                _seq("c", toks["c"], 20, blocks["c"], 1),
                                                _seq("b", toks["b"], 12, blocks["b"], 29)]))
    with torch.no_grad():
        ref = {k: hf(torch.tensor([toks[k]])).logits[0] for k in toks}
    want1 = torch.cat([ref["a"][:37], ref["b"][:12], ref["c"][:20]])
    want2 = torch.cat([ref["a"][37:38], ref["c"][20:21], ref["b"][12:41]])
    torch.testing.assert_close(out1, want1, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out2, want2, rtol=1e-4, atol=1e-4)


async def _generate(engine: AsyncEngine, rid: str, prompt: list[int]) -> list[int]:
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    out: list[int] = []
    async for ev in engine.generate(Request(rid, prompt, sp)):
        out += ev.token_ids
    return out


async def test_engine_greedy_equals_transformers(family, tokenizer):
    await _check_engine(*family, tokenizer)


async def _check_engine(name: str, hf, loaded, tokenizer) -> None:
    """A prompt sharing two full blocks with an earlier one (a prefix-cache hit), then four
    prompts at once in 4 blocks (they need 9: preemption), in 24-token steps (chunked
    prefill): every request's greedy tokens are transformers'."""
    prompts = [[(7 * i + 13 * j) % (VOCAB - 3) + 3 for j in range(n)]
               for i, n in enumerate((15, 30, 14, 40))]
    prompts.append(prompts[3][:32] + [5, 6, 7])
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    runner = ModelRunner(loaded, num_blocks=4, block_size=BLOCK)
    engine = AsyncEngine(runner, tokenizer, SchedulerConfig(max_num_seqs=8,
                                                            max_num_batched_tokens=24,
                                                            prefill_budget="fixed"),
                         debug_checks=True)
    # Mistral's window is on every layer: blocks behind it are freed. Gemma's global layers
    # keep them all.
    assert engine.kv.sliding_window == (WINDOW if name == "mistral" else None)
    await engine.start()
    try:
        # One prompt alone, then one that shares its first two blocks: a prefix-cache hit
        # (blocks freed behind a sliding window included), then all four at once.
        first = await _generate(engine, "first", prompts[3])
        again = await _generate(engine, "again", prompts[4])
        assert engine.scheduler.stats.prefix_hit_tokens >= 32
        got = await asyncio.gather(*(_generate(engine, f"r{i}", p)
                                     for i, p in enumerate(prompts[:4])))
        assert first == got[3]
        got.append(again)
        assert engine.scheduler.stats.preemptions > 0
        assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    finally:
        await engine.stop()
    assert got == want


def test_unsupported_architecture_fails_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["FalconForCausalLM"], "model_type": "falcon"}))
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path), dtype="float32", device="cpu")
    msg = str(err.value)
    assert "\n" not in msg and "FalconForCausalLM" in msg
    assert "Qwen3ForCausalLM" in msg and "Gemma2ForCausalLM" in msg


async def test_models_endpoint_reports_architecture_context_and_quantization(
        aiohttp_client, tokenizer, tmp_path):
    from batcher.admission.admission import Admission
    from batcher.engine.metrics import Metrics
    from batcher.app.serve import model_info
    from batcher.server.app import create_app
    from batcher.server.auth import Authenticator
    from batcher.server.gateway import Gateway, GatewayConfig

    loaded = load_model(str(save_folder(build_hf("qwen3_moe"), tmp_path / "m")),
                        dtype="float32", device="cpu")

    async def build() -> Gateway:
        metrics = Metrics()
        engine = AsyncEngine(ModelRunner(loaded, num_blocks=8, block_size=BLOCK), tokenizer,
                             SchedulerConfig(max_model_len=128), metrics=metrics)
        cfg = GatewayConfig(model_name="m", max_model_len=128, model_info=model_info(engine))
        return Gateway(cfg, engine, Authenticator(None), Admission(None), metrics)

    client = await aiohttp_client(create_app(build, 1 << 20))
    body = await (await client.get("/v1/models")).json()
    entry = body["data"][0]
    assert (entry["id"], entry["architecture"], entry["context_length"], entry["quantization"],
            entry["dtype"], entry["max_model_len"]) == (
        "m", "Qwen3MoeForCausalLM", 256, "none", "float32", 128)


def test_a_rope_scaling_we_cannot_compute_fails_at_load_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
         "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 32,
         "rope_scaling": {"rope_type": "no-such-scaling"}}))
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path), dtype="float32", device="cpu")
    assert "\n" not in str(err.value)
    assert "unsupported rope type 'no-such-scaling'" in str(err.value)


def test_int4_of_a_non_llama_gguf_quantizes_its_dense_weights(tmp_path, monkeypatch):
    """int4 straight from Q4_1 blocks builds Llama's layers; any other architecture's file is
    dequantized and its linears quantized, and then it decodes close to the dense model."""
    monkeypatch.setenv("BATCHER_CACHE", str(tmp_path / "cache"))
    path = write_gguf("qwen3", build_hf("qwen3"), tmp_path / "q.gguf")
    dense = load_model(str(path), dtype="bfloat16", device="cpu")
    packed = load_model(str(path), dtype="bfloat16", device="cpu", quantization="int4")
    assert packed.quantization == "int4" and type(packed.model) is type(dense.model)
    assert type(packed.model.layers[0].self_attn.qkv_proj).__name__ == "PackedLinear"
    prompt = [[(3 * j) % (VOCAB - 3) + 3 for j in range(20)]]
    a = greedy_generate(ModelRunner(dense, num_blocks=4, block_size=BLOCK), prompt, 3)
    b = greedy_generate(ModelRunner(packed, num_blocks=4, block_size=BLOCK), prompt, 3)
    assert a[0][0] == b[0][0]


def test_an_unsupported_gguf_architecture_fails_in_one_line(tmp_path):
    from gguf import GGUFWriter

    w = GGUFWriter(str(tmp_path / "f.gguf"), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path / "f.gguf"), dtype="float32", device="cpu")
    msg = str(err.value)
    assert "\n" not in msg and "'falcon'" in msg and "qwen3moe" in msg and "gemma3" in msg


class _Tensor:
    def __init__(self, name: str) -> None:
        self.name, self.data = name, np.ones(4, dtype=np.float32)


class _Header:
    """A GGUF header's fields and tensor names, without a file."""

    def __init__(self, fields: dict, tensors: tuple[str, ...] = ()) -> None:
        self.fields = {"general.architecture": "qwen3moe", "qwen3moe.attention.head_count": 4,
                       "qwen3moe.embedding_length": 64, "qwen3moe.block_count": 2,
                       **fields}
        self.tensors = [_Tensor(t) for t in tensors]


@pytest.mark.parametrize(("fields", "tensors", "key"), [
    ({"qwen3moe.expert_count": 4}, (), "qwen3moe.expert_used_count"),
    ({"qwen3moe.rope.scaling.type": "yarn"}, (), "qwen3moe.rope.scaling.factor"),
    ({}, ("rope_factors_short.weight",), "rope_factors_long"),
    ({"qwen3moe.block_count": None}, (), "qwen3moe.block_count"),
])
def test_a_gguf_header_missing_a_key_fails_in_one_line(fields, tensors, key):
    from batcher.models.gguf_arch import config

    with pytest.raises(ModelLoadError) as err:
        config(_Header(fields, tensors))  # type: ignore[arg-type]
    msg = str(err.value)
    assert "\n" not in msg and key in msg


def test_a_sharded_checkpoint_loads_through_its_index(tmp_path):
    hf = build_hf("qwen3_moe")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    _check_mixed_batch(hf, load_model(str(tmp_path), dtype="float32", device="cpu"))
