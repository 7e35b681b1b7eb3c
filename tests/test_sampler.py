"""The batched sampler: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from batcher.core.outputs import ScheduledSeq
from batcher.runtime.sampler import Sampler, row_seed
from batcher.core.sampling import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def seq(i: int = 0, output_index: int = 0, sample: bool = True, **params: object) -> ScheduledSeq:
    return ScheduledSeq(
        request_id=f"r{i}",
        token_ids=[1],
        start_pos=10,
        block_ids=[0],
        sample=sample,
        sampling=SamplingParams(**params).validate(),  # type: ignore[arg-type]
        output_index=output_index,
    )


def random_logits(n: int, vocab: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, vocab, generator=gen) * 3).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device: str) -> None:
    logits = random_logits(16, 500, device=device)
    tokens, logprobs = Sampler(seed=0).sample(logits, [seq(i, temperature=0.0) for i in range(16)])
    assert tokens == logits.argmax(dim=-1).tolist()
    assert logprobs == [None] * 16


def test_greedy_on_bf16_logits() -> None:
    logits = random_logits(4, 300).to(torch.bfloat16)
    seqs = [seq(0, temperature=0.0), seq(1, temperature=0.0, logprobs=1)]
    seqs += [seq(2, temperature=0.0), seq(3, temperature=0.0)]
    tokens, _ = Sampler(seed=0).sample(logits, seqs)
    assert tokens == logits.float().argmax(dim=-1).tolist()


def test_top_k_one_is_greedy() -> None:
    logits = random_logits(32, 400, seed=1)
    seqs = [seq(i, temperature=1.5, top_k=1, seed=i) for i in range(32)]
    tokens, _ = Sampler(seed=0).sample(logits, seqs)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_is_greedy() -> None:
    logits = random_logits(32, 400, seed=2)
    seqs = [seq(i, temperature=1.5, top_p=1e-6, seed=i if i % 2 else None) for i in range(32)]
    tokens, _ = Sampler(seed=0).sample(logits, seqs)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_rows_without_sampling_are_skipped() -> None:
    logits = random_logits(2, 50, seed=3)
    seqs = [seq(0, temperature=0.0), seq(1, sample=False), seq(2, temperature=0.0)]
    tokens, _ = Sampler().sample(logits, seqs)
    assert tokens == logits.argmax(dim=-1).tolist()
    with pytest.raises(ValueError, match="logit rows"):
        Sampler().sample(logits, [seq(0)])
    assert Sampler().sample(torch.empty(0, 50), [seq(0, sample=False)]) == ([], [])


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_ignore_batch_composition(device: str) -> None:
    """Same seed, same output index, same logits: same token, whatever else is in the batch."""
    vocab = 1000
    target = random_logits(1, vocab, seed=4, device=device) / 3  # a fairly flat distribution
    others = random_logits(5, vocab, seed=5, device=device)
    params = {"temperature": 1.0, "top_p": 0.95, "seed": 1234}
    for index in range(20):
        alone, _ = Sampler(seed=1).sample(target, [seq(0, index, **params)])
        batch = torch.cat([others[:2], target, others[2:]])
        mates = [
            seq(1, temperature=0.0),
            seq(2, temperature=0.7, top_k=5),  # forces the sorted path for the whole batch
            seq(0, index, **params),
            seq(3, temperature=1.0, seed=99),
            seq(4, temperature=1.3, logprobs=2),
            seq(5, temperature=1.0),
        ]
        mixed, _ = Sampler(seed=2).sample(batch, mates)
        assert mixed[2] == alone[0]


def test_seeded_rows_vary_with_output_index_and_seed() -> None:
    logits = torch.zeros(1, 1000)  # uniform: every draw is a fresh token
    draws = {Sampler().sample(logits, [seq(0, k, seed=7)])[0][0] for k in range(30)}
    assert len(draws) > 20
    by_seed = {Sampler().sample(logits, [seq(0, 0, seed=s)])[0][0] for s in range(30)}
    assert len(by_seed) > 20
    assert row_seed(7, 0) != row_seed(7, 1) and 0 <= row_seed(-1, 3) < 2**63


def test_seeded_sequence_repeats_after_preemption() -> None:
    """A preempted request recomputes and samples again at the same output indices."""
    logits = random_logits(1, 300, seed=6) / 4
    run1 = [Sampler().sample(logits, [seq(0, k, seed=3)])[0][0] for k in range(10)]
    run2 = [Sampler().sample(logits, [seq(0, k, seed=3)])[0][0] for k in range(10)]
    assert run1 == run2


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.8])
def test_temperature_sampling_follows_distribution(temperature: float) -> None:
    base = torch.log(torch.tensor([0.35, 0.25, 0.15, 0.1, 0.08, 0.05, 0.02]))
    n = 20_000
    logits = base.expand(n, -1).clone()
    tokens, _ = Sampler(seed=11).sample(logits, [seq(0, temperature=temperature)] * n)
    counts = torch.bincount(torch.tensor(tokens), minlength=7).double()
    expected = torch.softmax(base.double() / temperature, dim=-1)
    # 6 degrees of freedom: 40 is far in the tail (p < 1e-6); the run is seeded, so no flakes.
    assert chi_square(counts, expected) < 40


def test_banned_and_edge_tokens_in_unseeded_rows() -> None:
    """Unseeded rows draw by the inverse of their distribution: a banned (-inf) token is never
    chosen, at either end of the vocabulary, and a row with all its mass on the last token
    always gets it."""
    n, vocab = 4_000, 9
    logits = torch.zeros(n, vocab)
    logits[:, 0] = logits[:, -1] = float("-inf")
    tokens, _ = Sampler(seed=3).sample(logits, [seq(0, temperature=1.0)] * n)
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab)
    assert counts[0] == counts[-1] == 0 and (counts[1:-1] > 0).all()
    last = torch.full((8, vocab), float("-inf"))
    last[:, -1] = 0.0
    tokens, _ = Sampler(seed=4).sample(last, [seq(0, temperature=0.7)] * 8)
    assert tokens == [vocab - 1] * 8


@pytest.mark.parametrize("temperature", [1e-7, 1e-30, 5e-324])
def test_a_vanishing_temperature_is_greedy(temperature: float) -> None:
    """A temperature too small for float32 samples the best token, not NaN's token 0."""
    logits = random_logits(6, 50, seed=5)
    tokens, _ = Sampler(seed=2).sample(logits, [seq(i, temperature=temperature)
                                                for i in range(6)])
    assert tokens == logits.argmax(dim=-1).tolist()


def test_seeded_rows_follow_distribution() -> None:
    base = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    n = 8_000
    seqs = [seq(i, i % 97, temperature=1.0, seed=i // 97) for i in range(n)]
    tokens, _ = Sampler().sample(base.expand(n, -1).clone(), seqs)
    counts = torch.bincount(torch.tensor(tokens), minlength=4).double()
    assert chi_square(counts, torch.softmax(base.double(), dim=-1)) < 35


def test_top_k_never_samples_outside_top_k() -> None:
    n, vocab, k = 4_000, 200, 5
    logits = random_logits(n, vocab, seed=7) / 3
    tokens, _ = Sampler(seed=3).sample(logits, [seq(i, temperature=2.0, top_k=k) for i in range(n)])
    allowed = logits.topk(k, dim=-1).indices
    chosen = torch.tensor(tokens).unsqueeze(1)
    assert bool((allowed == chosen).any(dim=1).all())
    # And it really samples: more than the top token shows up.
    assert bool((chosen.squeeze(1) != allowed[:, 0]).any())


def test_top_p_keeps_the_nucleus_in_proportion() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 10_000
    logits = probs.log().expand(n, -1).clone()
    tokens, _ = Sampler(seed=5).sample(logits, [seq(i, top_p=0.7) for i in range(n)])
    counts = torch.bincount(torch.tensor(tokens), minlength=4).double()
    assert counts[2] == 0 and counts[3] == 0  # 0.5 + 0.3 already covers 0.7
    assert chi_square(counts[:2], torch.tensor([0.5, 0.3], dtype=torch.double) / 0.8) < 25


def test_top_k_then_top_p() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 4_000
    logits = probs.log().expand(n, -1).clone()
    # top_k=3 leaves 0.4/0.9, 0.3/0.9, 0.2/0.9; top_p=0.6 then keeps the first two.
    tokens, _ = Sampler(seed=9).sample(logits, [seq(i, top_k=3, top_p=0.6) for i in range(n)])
    assert set(tokens) == {0, 1}


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_match_log_softmax(device: str) -> None:
    logits = random_logits(5, 300, seed=8, device=device)
    seqs = [
        seq(0, temperature=0.0, logprobs=3),
        seq(1, temperature=0.8, top_k=10, logprobs=5, seed=1),
        seq(2, temperature=1.0),
        seq(3, temperature=0.5, top_p=0.5, logprobs=0),
        seq(4, temperature=0.0, logprobs=1),
    ]
    tokens, logprobs = Sampler(seed=0).sample(logits, seqs)
    ref = torch.log_softmax(logits.double().cpu(), dim=-1)
    assert logprobs[2] is None
    for row, (s, tok, lp) in enumerate(zip(seqs, tokens, logprobs, strict=True)):
        if s.sampling.logprobs is None:
            continue
        assert lp is not None
        assert math.isclose(lp.logprob, float(ref[row, tok]), abs_tol=1e-4)
        k = s.sampling.logprobs
        top_vals, top_ids = ref[row].topk(k) if k else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in lp.top] == top_ids.tolist()
        for (_, got), want in zip(lp.top, top_vals.tolist(), strict=True):
            assert math.isclose(got, want, abs_tol=1e-4)
    assert tokens[0] == int(logits[0].argmax())
    assert logprobs[0] is not None and logprobs[0].top[0][0] == tokens[0]


def reference_nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> set[int]:
    """Token ids in the top-p nucleus, by a plain full sort in float64."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True, stable=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    return set(order[mass_before < top_p].tolist())


def test_wide_nucleus_widens_past_the_candidates() -> None:
    """A flat distribution whose nucleus outgrows every candidate width still samples from
    exactly the nucleus (the row is redone with a full sort)."""
    vocab, n = 20_000, 400
    row = torch.linspace(0.0, 1.0, vocab).flip(0)  # token 0 most likely, all close
    nucleus = reference_nucleus(row, 1.0, 0.95)
    assert len(nucleus) > max(Sampler.CANDIDATE_WIDTHS)
    logits = row.expand(n, -1).clone()
    seqs = [seq(i, i, top_p=0.95, seed=i % 3 if i % 2 else None) for i in range(n)]
    tokens, _ = Sampler(seed=4).sample(logits, seqs)
    assert set(tokens) <= nucleus
    assert max(tokens) > max(Sampler.CANDIDATE_WIDTHS)  # reached tokens past the candidates
    # A seeded wide row gives the same token alone and next to narrow rows.
    peaked = random_logits(1, vocab, seed=12)
    batch = torch.cat([peaked, row.unsqueeze(0), peaked])
    mates = [seq(1, top_p=0.5), seq(0, 5, top_p=0.95, seed=9), seq(2, top_k=3)]
    alone, _ = Sampler().sample(row.unsqueeze(0), [seq(0, 5, top_p=0.95, seed=9)])
    assert Sampler().sample(batch, mates)[0][1] == alone[0]


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.8), (6, 1.0), (6, 0.8), (300, 0.9)])
def test_filtered_sampling_matches_reference_distribution(top_k: int, top_p: float) -> None:
    vocab, n, temperature = 400, 30_000, 0.6
    row = torch.linspace(4.0, -4.0, vocab) ** 3 / 16  # a few likely tokens, a long tail
    ref = torch.softmax(row.double() / temperature, dim=-1)
    if top_k:
        ref[top_k:] = 0
        ref /= ref.sum()
    sorted_ref, _ = ref.sort(descending=True, stable=True)
    ref[(sorted_ref.cumsum(-1) - sorted_ref) >= top_p] = 0  # row is already in descending order
    ref /= ref.sum()
    seqs = [seq(i, temperature=temperature, top_k=top_k, top_p=top_p) for i in range(n)]
    tokens, _ = Sampler(seed=21).sample(row.expand(n, -1).clone(), seqs)
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    assert counts[ref == 0].sum() == 0
    # Pool the tail so every expected count is large enough for the chi-square test.
    keep = ref * n >= 20
    obs = torch.cat([counts[keep], counts[~keep & (ref > 0)].sum().unsqueeze(0)])
    exp = torch.cat([ref[keep], ref[~keep & (ref > 0)].sum().unsqueeze(0)])
    df = int((exp > 0).sum()) - 1
    # Far in the tail (about 8 standard deviations of a chi-square); seeded, so no flakes.
    assert chi_square(obs[exp > 0], exp[exp > 0] / exp.sum()) < df + 8 * math.sqrt(2 * df) + 10
