"""The bundled sentence-embedding model, alone and behind a Batcher."""

from __future__ import annotations

import asyncio
import math

import pytest

from batcher.flusher.embeddings import MAX_INPUT_TOKENS, EmbeddingModel, make_embedding_batcher

FOOD = "A man is eating food."
BREAD = "A man is eating a piece of bread."
STOCKS = "The stock market fell sharply today."
HORSE = "A man is riding a horse."
SENTENCES = [FOOD, BREAD, STOCKS, HORSE]


def cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))  # both unit length


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


@pytest.fixture(scope="module")
def model() -> EmbeddingModel:
    return EmbeddingModel(dtype="float32")


def test_vectors_are_unit_length_with_the_expected_neighbours(model: EmbeddingModel) -> None:
    vecs = dict(zip(SENTENCES, model.embed(SENTENCES), strict=True))
    for v in vecs.values():
        assert len(v) == model.dim == 384
        assert math.isclose(math.sqrt(sum(x * x for x in v)), 1.0, abs_tol=1e-5)
    food_bread = cos(vecs[FOOD], vecs[BREAD])
    food_stocks = cos(vecs[FOOD], vecs[STOCKS])
    assert food_bread > food_stocks + 0.5
    # The eating sentences are each other's nearest neighbours.
    others = [s for s in SENTENCES if s not in (FOOD, BREAD)]
    assert all(food_bread > cos(vecs[FOOD], vecs[s]) for s in others)
    assert all(food_bread > cos(vecs[BREAD], vecs[s]) for s in others)


def test_equals_transformers_bert_with_mean_pooling(model: EmbeddingModel) -> None:
    """Our encoder and tokenizer reading against Hugging Face's `BertModel` and fast tokenizer,
    the reference sentence-transformers runs, on the same folder in float32."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer

    from batcher.bundled import minilm_dir

    texts = [*SENTENCES, "Short.", "Ünïcode, CAPS and    spaces!", "word " * 300]
    tok = AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True)
    ref = AutoModel.from_pretrained(minilm_dir(), local_files_only=True, dtype=torch.float32)
    enc = tok(texts, padding=True, truncation=True, max_length=MAX_INPUT_TOKENS,
              return_tensors="pt")
    assert model.count_tokens(texts) == enc["attention_mask"].sum(dim=1).tolist()
    with torch.inference_mode():
        hidden = ref(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    want = F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1).tolist()
    assert max_abs_diff(model.embed(texts), want) < 1e-5


def test_batched_equals_unbatched_in_fp32(model: EmbeddingModel) -> None:
    # Different lengths, so the batch pads the short ones.
    texts = [*SENTENCES, "Short.", "A much longer sentence " * 8]
    batched = model.embed(texts)
    one_by_one = [model.embed([t])[0] for t in texts]
    assert max_abs_diff(batched, one_by_one) < 1e-5


def test_bf16_matches_fp32_closely(model: EmbeddingModel) -> None:
    bf16 = EmbeddingModel(dtype="bfloat16")
    for a, b in zip(model.embed(SENTENCES), bf16.embed(SENTENCES), strict=True):
        assert cos(a, b) > 0.999


def test_long_inputs_are_truncated(model: EmbeddingModel) -> None:
    long_text = "word " * 1000
    assert model.count_tokens([long_text, FOOD]) == [MAX_INPUT_TOKENS, 8]
    (vec,) = model.embed([long_text])
    assert len(vec) == 384


def test_empty_and_bad_inputs(model: EmbeddingModel) -> None:
    assert model.embed([]) == [] and model.count_tokens([]) == []
    with pytest.raises(ValueError):
        model.embed(FOOD)  # type: ignore[arg-type]  # a bare string, not a list
    with pytest.raises(ValueError):
        model.embed([FOOD, 3])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        EmbeddingModel(dtype="float16")


async def test_batcher_over_the_model_gives_each_caller_its_vector(model: EmbeddingModel) -> None:
    texts = [f"{s} ({i})" for i in range(10) for s in SENTENCES]
    expected = model.embed(texts)
    async with make_embedding_batcher(model, 8, 2, max_queue=len(texts)) as b:
        got = await asyncio.gather(*(b.submit(t) for t in texts))
    assert max_abs_diff(got, expected) < 1e-5
    assert b.stats.batches >= 5 and b.stats.items_flushed == len(texts)
