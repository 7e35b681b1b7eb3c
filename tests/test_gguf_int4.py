"""int4 loaded straight from a GGUF file's Q4_1 blocks: the packed layers compute exactly the
weights the file stores (what the dense loader dequantizes them to), fused and with GGUF's rotary
row order undone; and the header reader agrees with the gguf package's. On a small file written
here and, with `-m benchmark`, the bundled model."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch

from batcher.engine.config import EngineConfig
from batcher.models.errors import ModelLoadError
from batcher.models.gguf_file import GGUFFile, StringArray
from batcher.models.llama import LlamaModel
from batcher.models import load_settings
from batcher.models.load_settings import resolve_quantization
from batcher.models.loader import load_model
from batcher.runtime.quant import HEAD_DENSE_ABOVE_ROWS, Int8Embedding, PackedLinear
from batcher.app.serve_flags import add_serve_args

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 4500


def _permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Hugging Face row order -> GGUF's (what a converter writes)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(path: Path, not_q4_1: tuple[str, ...] = ()) -> Path:
    """A seeded random 2-layer Llama: decoder linears in Q4_1 (those named in `not_q4_1` in
    Q8_0), the embedding table in Q8_0 (more rows than one dequantized slice), norms in F32."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_eos_token_id(2)
    # Metadata arrays as a tokenizer's: strings (stepped over by our reader) and numbers.
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(VOCAB)])
    w.add_array("tokenizer.ggml.token_type", [1] * VOCAB)

    def add(name: str, t: np.ndarray, kind: GGMLQuantizationType) -> None:
        t = t.astype(np.float32)
        if kind == GGMLQuantizationType.F32:
            w.add_tensor(name, t)
        else:
            w.add_tensor(name, quantize(t, kind), raw_dtype=kind)

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols)) / cols ** 0.5

    add("token_embd.weight", mat(VOCAB, HIDDEN), GGMLQuantizationType.Q8_0)
    add("output_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN), GGMLQuantizationType.F32)
    d = HIDDEN // HEADS
    for n in range(LAYERS):
        shapes = {"attn_q": (HEADS * d, HIDDEN), "attn_k": (KV_HEADS * d, HIDDEN),
                  "attn_v": (KV_HEADS * d, HIDDEN), "attn_output": (HIDDEN, HEADS * d),
                  "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
                  "ffn_down": (HIDDEN, INTER)}
        for part, (rows, cols) in shapes.items():
            t = mat(rows, cols)
            if part in ("attn_q", "attn_k"):
                t = _permute_rotary(t, HEADS if part == "attn_q" else KV_HEADS)
            name = f"blk.{n}.{part}.weight"
            add(name, t, GGMLQuantizationType.Q8_0 if name in not_q4_1
                else GGMLQuantizationType.Q4_1)
        for norm in ("attn_norm", "ffn_norm"):
            add(f"blk.{n}.{norm}.weight", 1 + 0.1 * rng.standard_normal(HIDDEN),
                GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(autouse=True)
def _own_weight_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The dense loader caches what it dequantizes; these files are the tests' own.
    monkeypatch.setenv("BATCHER_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf")


def _linears(model: LlamaModel, layer: int) -> dict[str, torch.nn.Module]:
    block = model.layers[layer]
    return {"qkv": block.self_attn.qkv_proj, "o": block.self_attn.o_proj,
            "gate_up": block.mlp.gate_up_proj, "down": block.mlp.down_proj}


def assert_computes_the_files_weights(source: str, layers: list[int]) -> None:
    """fp32: every int4 layer taken from Q4_1 blocks equals the dense loader's linear (the file's
    blocks dequantized by the gguf package, rotary rows undone, fused) to rounding."""
    direct = load_model(source, dtype="float32", device="cpu", quantization="int4",
                        dense_above=None).model
    dense = load_model(source, dtype="float32", device="cpu").model
    gen = torch.Generator().manual_seed(1)
    for n in layers:
        for name, packed in _linears(direct, n).items():
            ref = _linears(dense, n)[name]
            assert isinstance(packed, PackedLinear) and packed.dense is None, name
            x = torch.randn(3, ref.in_features, generator=gen)
            want = ref(x)
            torch.testing.assert_close(packed(x), want, rtol=1e-4,
                                       atol=1e-4 * want.abs().max().item())
    torch.testing.assert_close(direct.norm.weight, dense.norm.weight)
    # Tied in the file; with no dense copies the table is one per-row int8 copy, shared.
    assert_int8_table_matches(direct, dense.embed_tokens.weight)


def assert_int8_table_matches(model: LlamaModel, table: torch.Tensor) -> None:
    """The embedding and the LM head read one int8 table, each row within half a step of its
    per-row scale of `table`, and the head computes x @ table.T to that precision."""
    emb, head = model.embed_tokens, model.lm_head
    assert isinstance(emb, Int8Embedding) and isinstance(head, PackedLinear)
    assert emb.qweight is head.qweight and emb.scales is head.scales  # one copy
    ids = torch.arange(table.shape[0])
    rows = emb(ids).float()
    step = table.float().abs().amax(dim=1, keepdim=True) / 127
    assert ((rows - table.float()).abs() <= step / 2 + 1e-6).all()
    x = torch.randn(3, table.shape[1], generator=torch.Generator().manual_seed(4)).to(rows.dtype)
    torch.testing.assert_close(head(x).float(), x.float() @ rows.T, rtol=1e-3, atol=1e-3)
    want = x.float() @ table.float().T
    assert (head(x).float() - want).abs().max() <= 0.02 * want.abs().max()


def assert_reads_as_the_gguf_package_does(path: Path) -> None:
    from gguf import GGUFReader

    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    keys = {k for k in theirs.fields if not k.startswith("GGUF.")}  # its header pseudo-fields
    assert set(ours.fields) == keys
    for key in keys:
        want, got = theirs.fields[key].contents(), ours.fields[key]
        if isinstance(got, StringArray):
            assert len(got) == len(want), key
        elif isinstance(got, np.ndarray):
            assert got.tolist() == list(want), key
        else:
            assert got == want, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.tensor_type, a.data.shape, a.data.dtype) == (b.tensor_type, b.data.shape,
                                                                b.data.dtype), a.name
        assert np.array_equal(a.data, b.data), a.name


def test_header_reader_agrees_with_the_gguf_package(gguf_file: Path) -> None:
    assert_reads_as_the_gguf_package_does(gguf_file)


def test_a_truncated_file_is_a_load_error(gguf_file: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_file.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="past the end"):
        load_model(str(cut), dtype="float32", device="cpu", quantization="int4")
    cut.write_bytes(b"GGUF" + b"\0" * 3)
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        load_model(str(cut), dtype="float32", device="cpu", quantization="int4")


def test_int4_from_q4_1_blocks_computes_the_files_weights(gguf_file: Path) -> None:
    assert_computes_the_files_weights(str(gguf_file), list(range(LAYERS)))


def test_a_fused_linear_with_a_part_not_in_q4_1_is_quantized_from_dense(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "mixed.gguf", not_q4_1=("blk.1.attn_v.weight",))
    direct = load_model(str(path), dtype="float32", device="cpu", quantization="int4",
                        dense_above=None).model
    dense = load_model(str(path), dtype="float32", device="cpu").model
    packed, ref = direct.layers[1].self_attn.qkv_proj, dense.layers[1].self_attn.qkv_proj
    assert isinstance(packed, PackedLinear)
    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(2))
    want = ref(x)
    # Re-quantized to int4 from the dense weights: close to them, not equal.
    err = (packed(x) - want).abs().max().item()
    assert 0 < err <= 0.15 * want.abs().max().item()
    # The other layer's blocks were all Q4_1 and are taken as stored.
    torch.testing.assert_close(direct.layers[0].self_attn.qkv_proj(x),
                               dense.layers[0].self_attn.qkv_proj(x), rtol=1e-4, atol=1e-4)


def test_the_dense_copy_computes_what_the_packed_kernel_does(gguf_file: Path) -> None:
    model = load_model(str(gguf_file), dtype="bfloat16", device="cpu", quantization="int4",
                       dense_above=2).model
    lin = model.layers[0].mlp.gate_up_proj
    assert isinstance(lin, PackedLinear) and lin.dense is not None
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    # The tied head: int8 for a few rows, its dense copy (the same values) past them.
    head = model.lm_head
    assert isinstance(head, PackedLinear) and head.kind == "int8" and head.dense_above == 2
    for layer in (lin, head):
        by_rows = torch.cat([layer(x[i:i + 2]) for i in range(0, 4, 2)] + [layer(x[4:])])
        whole = layer(x)  # 5 rows > 2: the dense copy
        torch.testing.assert_close(whole.float(), by_rows.float(), rtol=3e-2,
                                   atol=3e-2 * whole.abs().max().item())
    bare = load_model(str(gguf_file), dtype="bfloat16", device="cpu", quantization="int4",
                      dense_above=None).model
    no_copy = bare.layers[0].mlp.gate_up_proj
    held = sum(b.numel() * b.element_size() for b in no_copy.buffers())
    assert no_copy.dense is None and held < INTER * 2 * HIDDEN * 2 / 3  # under a third of bf16
    # Without the layers' copies the head still keeps its own, past HEAD_DENSE_ABOVE_ROWS rows.
    assert bare.lm_head.dense is not None and bare.lm_head.dense_above == HEAD_DENSE_ABOVE_ROWS
    x = x[:HEAD_DENSE_ABOVE_ROWS + 1]
    torch.testing.assert_close(bare.lm_head(x).float(), torch.cat(
        [bare.lm_head(x[:1]), bare.lm_head(x[1:])]).float(), rtol=3e-2,
        atol=3e-2 * bare.lm_head(x).abs().max().item())


def test_quantized_dense_above_flag_and_config() -> None:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args([]).quantized_dense_above == EngineConfig().quantized_dense_above == 0
    assert p.parse_args(["--quantized-dense-above", "8"]).quantized_dense_above == 8
    with pytest.raises(SystemExit):
        p.parse_args(["--quantized-dense-above", "-1"])
    with pytest.raises(ValueError, match="quantized_dense_above"):
        EngineConfig(quantized_dense_above=-1).validate()


@pytest.mark.benchmark
def test_bundled_model_header_reads_as_the_gguf_package_does() -> None:
    from batcher.bundled import smollm2_gguf_path

    assert_reads_as_the_gguf_package_does(smollm2_gguf_path())  # ~5 s: the package's reader


@pytest.mark.benchmark
def test_bundled_model_int4_from_q4_1_blocks_computes_the_files_weights() -> None:
    # Two loads of the bundled model in fp32 (~15 s on a loaded 2-core machine).
    assert_computes_the_files_weights("smollm2-135m", [0, 29])


def _resident_kib(path: Path) -> int:
    # Resident KiB of this process's mappings of `path` (/proc/self/smaps).
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:  # a mapping's header line
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc")
def test_read_weights_leave_the_resident_set(gguf_file: Path) -> None:
    # A load copies every weight out of the file: once copied, its pages need not stay ours.
    from batcher.models.gguf_weights import drop_file_pages

    reader = GGUFFile(gguf_file)
    for t in reader.tensors:
        np.asarray(t.data).view(np.uint8).sum()  # every page read in
    read = _resident_kib(gguf_file.resolve())
    assert read > 256  # the tensors' pages were read in
    drop_file_pages(reader.tensors[0].data)  # any tensor: they share the mapping
    assert _resident_kib(gguf_file.resolve()) < read / 4


def test_auto_quantization_is_int4_only_for_q4_1_files_in_native_bf16(
        gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(load_settings, "cpu_has_fast_bf16", lambda: True)
    assert resolve_quantization("auto", str(gguf_file), "auto", cpu) == "int4"
    assert resolve_quantization("auto", str(gguf_file), "bfloat16", cpu) == "int4"
    assert resolve_quantization("auto", "smollm2-135m", "auto", cpu) == "int4"  # Q4_1 file
    # float32 asks for the dense reference path; a GPU has no int4 kernel here.
    assert resolve_quantization("auto", str(gguf_file), "float32", cpu) == "none"
    assert resolve_quantization("auto", str(gguf_file), "auto", torch.device("cuda")) == "none"
    # No Q4_1 blocks to keep: the random model, a file mostly in Q8_0, a folder, a bad file.
    assert resolve_quantization("auto", "tiny", "auto", cpu) == "none"
    mostly_q8 = write_gguf(tmp_path / "q8.gguf", not_q4_1=tuple(
        f"blk.{i}.{n}.weight" for i in range(LAYERS)
        for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate")))
    assert resolve_quantization("auto", str(mostly_q8), "auto", cpu) == "none"
    assert resolve_quantization("auto", str(tmp_path), "auto", cpu) == "none"
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf")
    assert resolve_quantization("auto", str(tmp_path / "bad.gguf"), "auto", cpu) == "none"
    # Asked for by name: given as asked.
    assert resolve_quantization("none", str(gguf_file), "auto", cpu) == "none"
    assert resolve_quantization("int8", "tiny", "auto", cpu) == "int8"
    # Without native bf16 the packed kernels would force bf16 onto the batch path.
    monkeypatch.setattr(load_settings, "cpu_has_fast_bf16", lambda: False)
    assert resolve_quantization("auto", str(gguf_file), "auto", cpu) == "none"


def test_auto_quantization_loads_the_blocks_as_int4(gguf_file: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(load_settings, "cpu_has_fast_bf16", lambda: True)
    loaded = load_model(str(gguf_file), device="cpu", quantization="auto")
    assert loaded.quantization == "int4" and loaded.dtype is torch.bfloat16
    assert isinstance(loaded.model.layers[0].mlp.down_proj, PackedLinear)
    monkeypatch.setattr(load_settings, "cpu_has_fast_bf16", lambda: False)
    loaded = load_model(str(gguf_file), device="cpu", quantization="auto")
    assert loaded.quantization == "none" and loaded.dtype is torch.float32
