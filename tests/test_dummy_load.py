"""`--load-format dummy`: the shipped configs are the published architectures (parameter counts
from the config alone, Llama 3 RoPE scaling by its published formula), random weights are made
once on the device in the model's dtype, a model whose vocabulary outgrows the bundled
tokenizer's only ever yields ids the tokenizer decodes, and a model that cannot fit is refused
in one line before anything is allocated."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from batcher.app.cli import _env_defaults, build_parser
from batcher.engine.config import EngineConfig
from batcher.models import dummy, memory
from batcher.models.errors import ModelLoadError
from batcher.models.llama import LlamaConfig, LlamaModel, rope_inv_freq
from batcher.models.loader import dummy_config, load_model
from batcher.app.serve import engine_model_name

TOKENIZER_VOCAB = 49152  # the bundled tokenizer's


def tiny_hf_config(vocab: int = 2 * TOKENIZER_VOCAB, **change: object) -> dict[str, object]:
    """A Hugging Face config.json of a tiny Llama with a vocabulary twice the tokenizer's."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": vocab, "max_position_embeddings": 512,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2} | change


@pytest.fixture
def tiny_config_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny-wide.json"
    path.write_text(json.dumps(tiny_hf_config()))
    return path


def meta_parameter_count(cfg: LlamaConfig) -> int:
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = LlamaModel(cfg)
    return sum(p.numel() for p in model.parameters())  # a tied head counts once


@pytest.mark.parametrize(("name", "params", "shape"), [
    ("llama-3.1-8b", 8_030_261_248, (4096, 32, 32, 8, 14336, 128256, 500000.0, 131072, False)),
    ("qwen2.5-7b", 7_615_616_512, (3584, 28, 28, 4, 18944, 152064, 1000000.0, 131072, False)),
    ("llama-3.2-1b", 1_235_814_400, (2048, 16, 32, 8, 8192, 128256, 500000.0, 131072, True)),
])
def test_shipped_configs_are_the_published_architectures(
        name: str, params: int, shape: tuple[object, ...]) -> None:
    assert name in dummy.config_names()
    got_name, cfg = dummy_config(name)
    assert got_name == name
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta, cfg.max_position_embeddings,
            cfg.tie_word_embeddings) == shape
    assert cfg.num_parameters() == params == meta_parameter_count(cfg)
    assert cfg.attention_bias is (name.startswith("qwen"))
    if name.startswith("llama"):
        assert cfg.rope_scaling["rope_type"] == "llama3"
        rope_inv_freq(cfg)  # a scaling the model implements


def test_bundled_model_name_reads_its_config_from_the_file_header() -> None:
    name, cfg = dummy_config("smollm2-135m")
    assert name == "smollm2-135m"
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size) == (576, 30, TOKENIZER_VOCAB)
    assert cfg.num_parameters() == 134_515_008 == meta_parameter_count(cfg)


def published_llama3_scaling(inv_freq: list[float], factor: float, low: float, high: float,
                             old_len: int) -> list[float]:
    """Meta's Llama 3.1 frequency scaling, element by element as published: long wavelengths
    slowed by `factor`, short ones kept, the band between blended by a smooth factor."""
    out = []
    for freq in inv_freq:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(freq)
        elif wavelen > old_len / low:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.2-1b"])
def test_llama3_rope_scaling_is_the_published_formula(name: str) -> None:
    _, cfg = dummy_config(name)
    s = cfg.rope_scaling
    base = [1.0 / cfg.rope_theta ** (i / cfg.head_dim) for i in range(0, cfg.head_dim, 2)]
    want = published_llama3_scaling(base, s["factor"], s["low_freq_factor"],
                                    s["high_freq_factor"], s["original_max_position_embeddings"])
    got = rope_inv_freq(cfg).tolist()
    assert got == pytest.approx(want, rel=1e-12)
    # All three regimes occur: kept, slowed by the factor, and blended.
    kept = sum(g == pytest.approx(b, rel=1e-12) for g, b in zip(got, base))
    slowed = sum(g == pytest.approx(b / s["factor"], rel=1e-12) for g, b in zip(got, base))
    assert kept and slowed and kept + slowed < len(base)


def test_random_weights_are_made_in_place_on_the_device_in_the_dtype() -> None:
    cfg = LlamaConfig.from_hf(tiny_hf_config(vocab=1000, tie_word_embeddings=True))
    model = dummy.build_random(cfg, torch.bfloat16, torch.device("cpu"), seed=3)
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in params.values())
    assert all(torch.all(p == 1) for n, p in params.items() if n.endswith("norm.weight"))
    w = model.layers[0].mlp.gate_up_proj.weight.float()
    assert abs(w.std().item() - dummy.INIT_STD) < 0.002 and abs(w.mean().item()) < 0.002
    assert model.lm_head.weight is model.embed_tokens.weight  # tied, made once
    again = dummy.build_random(cfg, torch.bfloat16, torch.device("cpu"), seed=3)
    assert torch.equal(again.layers[1].self_attn.qkv_proj.weight,
                       model.layers[1].self_attn.qkv_proj.weight)  # seeded


def test_dummy_generation_yields_only_ids_the_tokenizer_decodes(tiny_config_file: Path) -> None:
    from batcher.llm import LLM
    from batcher.core.sampling import SamplingParams

    config = EngineConfig(load_format="dummy", device="cpu", dtype="float32", max_num_seqs=4,
                          kv_cache_memory="16MiB")
    with LLM(str(tiny_config_file), config) as llm:
        runner = llm._llm._engine.runner
        model = runner.model
        assert model.config.vocab_size == 2 * TOKENIZER_VOCAB  # the config's, not the tokenizer's
        # Make every id past the tokenizer's vocabulary the model's favourite: without the
        # runner's mask, greedy decoding would pick one at every step.
        with torch.no_grad():
            model.lm_head.weight[TOKENIZER_VOCAB:] = model.lm_head.weight[:TOKENIZER_VOCAB] * 50
        greedy = llm.generate("Hello there", SamplingParams(max_tokens=12, temperature=0.0,
                                                            ignore_eos=True))
        sampled = llm.generate_many(["Once upon", "The capital of"],
                                    SamplingParams(max_tokens=24, temperature=1.0, seed=7,
                                                   ignore_eos=True, logprobs=3))
        # Whatever the hidden state, the model's own favourite is an id past the tokenizer's.
        hidden = torch.randn(3, model.config.hidden_size)
        assert bool((model.lm_head(hidden).argmax(-1) >= TOKENIZER_VOCAB).all())
    for done in [greedy, *sampled]:
        assert done.token_ids
        assert all(0 <= t < TOKENIZER_VOCAB for t in done.token_ids), done.token_ids


def test_memory_check_refuses_in_one_line_before_allocating(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_allocation(*args: object, **kw: object) -> None:
        raise AssertionError("weights were allocated before the memory check")

    monkeypatch.setattr(dummy, "build_random", no_allocation)
    monkeypatch.setattr(memory, "host_available_bytes", lambda: int(10.2e9))
    with pytest.raises(ModelLoadError) as err:
        load_model("llama-3.1-8b", dtype="bfloat16", device="cpu", load_format="dummy")
    message = str(err.value)
    assert message == ("llama-3.1-8b needs 16.1 GB for bfloat16 weights and 0.5 GB for a "
                       "minimal KV cache but the host has 10.2 GB available")
    assert "\n" not in message
    # On a GPU the free memory comes from the device.
    monkeypatch.setattr(memory, "free_bytes", lambda device: (int(10.2e9), "cuda:0"))
    _, cfg = dummy_config("qwen2.5-7b")
    with pytest.raises(ModelLoadError, match=r"^qwen2.5-7b needs 15.2 GB for bfloat16 weights "
                       r"and 0.2 GB for a minimal KV cache but cuda:0 has 10.2 GB free$"):
        memory.check_fits("qwen2.5-7b", cfg, torch.bfloat16, torch.device("cuda"))
    memory.check_fits("llama-3.2-1b", dummy_config("llama-3.2-1b")[1], torch.bfloat16,
                      torch.device("cuda"))  # 2.5 GB fits


def test_host_memory_is_the_lesser_of_meminfo_and_the_cgroup_limit(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   20000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert memory.host_available_bytes(meminfo, cgroup) == 20000000 * 1024
    (cgroup / "memory.max").write_text("8000000000\n")
    (cgroup / "memory.current").write_text("3000000000\n")
    assert memory.host_available_bytes(meminfo, cgroup) == 5_000_000_000
    (cgroup / "memory.max").write_text("max\n")
    assert memory.host_available_bytes(tmp_path / "none", cgroup) is None


def test_dummy_sources_and_their_names(tmp_path: Path, tiny_config_file: Path) -> None:
    folder = tmp_path / "My-Model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny_hf_config(vocab=1000)))
    (folder / "model.safetensors").write_text("never read")
    assert dummy_config(str(folder))[0] == "My-Model" == engine_model_name(str(folder))
    cfg_json = str(folder / "config.json")
    assert dummy_config(cfg_json)[0] == "My-Model" == engine_model_name(cfg_json)
    assert dummy_config(str(tiny_config_file))[0] == "tiny-wide"
    assert engine_model_name(str(tiny_config_file)) == "tiny-wide"
    assert engine_model_name("llama-3.1-8b") == "llama-3.1-8b"
    loaded = load_model(str(folder), dtype="float32", device="cpu", load_format="dummy")
    assert loaded.name == "My-Model" and loaded.config.vocab_size == 1000
    assert loaded.tokenizer_source.suffix == ".gguf"  # the bundled tokenizer
    with pytest.raises(ModelLoadError, match="llama-3.1-8b, llama-3.2-1b, qwen2.5-7b"):
        load_model("llama-9", device="cpu", load_format="dummy")
    bad = tmp_path / "bert.json"
    bad.write_text(json.dumps(tiny_hf_config(architectures=["BertModel"])))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(str(bad), device="cpu", load_format="dummy")
    with pytest.raises(ModelLoadError, match="load format"):
        load_model("tiny", device="cpu", load_format="safetensors")


def test_serve_takes_load_format_dummy(tiny_config_file: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in __import__("os").environ if k.startswith("BATCHER_")]:
        monkeypatch.delenv(key)
    parser, commands = build_parser()
    argv = ["serve", "--load-format", "dummy", "--model", str(tiny_config_file)]
    args = parser.parse_args(argv)
    assert (args.load_format, args.model) == ("dummy", str(tiny_config_file))
    assert parser.parse_args(["serve"]).load_format == "auto" == EngineConfig().load_format
    monkeypatch.setenv("BATCHER_LOAD_FORMAT", "dummy")
    _env_defaults(commands, ["serve"])
    assert parser.parse_args(["serve"]).load_format == "dummy"
    help_text = " ".join(commands["serve"].format_help().split())
    for name in dummy.config_names():
        assert name in help_text
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(load_format="pt").validate()
