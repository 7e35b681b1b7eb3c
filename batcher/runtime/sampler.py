"""The batched sampler: one call per step turns the logits of every sampling row into tokens.

Rows fall into three groups, each handled in one batched pass: greedy rows (argmax), plain
temperature rows, and filtered rows (top-k and/or top-p). Sampling is the exponential race:
`argmax(p_i / E_i)` with `E_i ~ Exponential(1)` draws token i with probability p_i, and in logs it
is `argmax(logit_i / T - log E_i)`, so no softmax, cumulative sum or normalisation is needed for
plain rows. Filtered rows work on their top candidates (`topk`, far cheaper than sorting the whole
vocabulary on a CPU), widening to a full sort only for a row whose top-p nucleus is wider.

Before choosing, rows that ask have their logits adjusted, each from its own tokens only:
repetition, presence and frequency penalties, logit bias, min_p; then a grammar row's mask (see
`runtime/grammar.py`) bans every token its grammar does not allow. Logprobs report the model's
own distribution, before any of these.

Seeds: a seeded row draws its noise over the whole vocabulary from its own generator, seeded by
`(seed, output_index)`, and reads it by token id; so its tokens do not depend on what else is in
the batch or on preemption. Unseeded rows share one draw from the sampler's generator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from batcher.core.outputs import ScheduledSeq, TokenLogprobs
from batcher.runtime.grammar import StepMasks, apply_masks
from batcher.runtime.host_to_device import to_device

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """A well-mixed 64-bit hash, so nearby (seed, index) pairs give unrelated noise streams."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, output_index: int) -> int:
    """Generator seed for the `output_index`-th sampled token of a request seeded with `seed`."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ output_index) >> 1  # torch wants < 2**63


def _take(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`t[rows]`, without a copy when `rows` is every row."""
    return t if len(rows) == t.shape[0] else t[to_device(rows, t.device)]


def _column(values: list[float] | list[int], like: torch.Tensor) -> torch.Tensor:
    """A per-row parameter as a `[rows, 1]` tensor on `like`'s device."""
    return to_device(values, like.device, like.dtype).unsqueeze(1)


# Temperatures below this sample as this one does: a one-hot at the best token, however small.
_MIN_TEMPERATURE = 1e-6


class Sampler:
    """Samples one token per row. `seed` fixes the generator of unseeded rows (tests, benchmarks);
    without it they are random. Holds no per-request state; used from one thread at a time."""

    # Candidate widths tried for filtered rows before sorting the whole vocabulary (on a CPU,
    # sorting 49k logits costs about 4x a `topk` of 8k and 40x a `topk` of 128).
    CANDIDATE_WIDTHS = (128, 1024, 8192)

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        # Noise buffer reused across steps: a fresh [rows, vocab] tensor each step costs page
        # faults comparable to the arithmetic on a CPU.
        self._workspace: dict[torch.device, torch.Tensor] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._generators[device] = gen
        return gen

    def sample(
        self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq], masks: StepMasks | None = None
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Sample a token for each sequence with `sample=True`.

        `logits: [n, vocab]` holds one row per such sequence, in their order in `seqs` (sequences
        with `sample=False` have no row). Returns the n token ids and, per row, a `TokenLogprobs`
        when the request asked for logprobs (else None). Logprobs come from the raw logits
        (temperature 1, no top-k/top-p). Math stays on `logits.device`; one host sync at the end
        (plus one per widening step for a top-p row whose nucleus outgrows its candidates).
        `masks` (grammar rows) bans every token a row's grammar does not allow, after penalties
        and bias, so nothing can bring a banned token back.
        """
        rows = [s for s in seqs if s.sample]
        tokens, raw = self._choose(logits, rows, masks)
        want = [s.sampling.logprobs for s in rows]
        if all(k is None for k in want):
            return tokens.tolist(), [None] * len(rows)
        return _with_logprobs(raw.float(), tokens, want)

    def sample_on_device(
        self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq], masks: StepMasks | None = None
    ) -> torch.Tensor:
        """The tokens `sample` would choose, as a tensor `[n]` on `logits.device`, not read back.
        For rows that want no logprobs. Per-row parameters go to the device without waiting for
        it (`to_device`), so a step launched behind another stays queued behind it; but a top-p
        row without a top-k reads the device to see whether its nucleus outgrew its candidates,
        and a row with presence or frequency penalties counts its tokens there (`unique`)."""
        rows = [s for s in seqs if s.sample]
        if any(s.sampling.logprobs is not None for s in rows):
            raise ValueError("rows that report logprobs are sampled by `sample`")
        return self._choose(logits, rows, masks)[0]

    def _choose(self, logits: torch.Tensor, rows: list[ScheduledSeq], masks: StepMasks | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens `[n]` on `logits.device`, the logits logprobs are read from) for `rows`."""
        n = logits.shape[0]
        if n != len(rows):
            raise ValueError(f"{n} logit rows for {len(rows)} sampling sequences")
        if any(s.suppress for s in rows):
            # Below min_tokens a request may not stop: its stop tokens cannot be chosen.
            logits = logits.clone()
            for i, s in enumerate(rows):
                if s.suppress:
                    logits[i, to_device(list(s.suppress), logits.device)] = float("-inf")
        if n == 0:
            return torch.empty(0, dtype=torch.long, device=logits.device), logits
        params = [s.sampling for s in rows]
        # Logprobs report the model's distribution, before penalties, bias and min_p.
        raw = logits
        if any(p.adjusts_logits for p in params):
            logits = _adjusted(logits, rows)
        if masks is not None:
            logits = apply_masks(logits if logits is not raw else logits.clone(), masks)
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1), raw  # no softmax at all

        logits = logits.float()  # [n, vocab]
        groups: dict[str, list[int]] = {"greedy": [], "plain": [], "filtered": []}
        for i, p in enumerate(params):
            kind = "greedy" if p.greedy else "filtered" if p.top_k or p.top_p < 1 else "plain"
            groups[kind].append(i)
        tokens = torch.empty(n, dtype=torch.long, device=logits.device)  # [n]
        for kind, idx in groups.items():
            if not idx:
                continue
            sub, sub_seqs = _take(logits, idx), [rows[i] for i in idx]
            if kind == "greedy":
                picked = sub.argmax(dim=-1)
            elif kind == "plain":
                picked = self._sample_plain(sub, sub_seqs)
            else:
                picked = self._sample_filtered(sub, sub_seqs)
            tokens[to_device(idx, logits.device)] = picked
        return tokens, raw

    def _log_noise(
        self, seqs: Sequence[ScheduledSeq], vocab: int, ids: torch.Tensor | None, like: torch.Tensor
    ) -> torch.Tensor:
        """`log E` with `E ~ Exponential(1)`, shaped like `like` (`[m, width]`), where `ids`
        (`[m, width]`, or None for the whole vocabulary) names the token of each column. The
        result lives in the workspace: use it before the next call."""
        device = like.device
        buf = self._workspace.get(device)
        if buf is None or buf.numel() < like.numel():
            buf = self._workspace[device] = torch.empty(like.numel(), device=device)
        noise = buf[: like.numel()].view(like.shape)
        noise.uniform_(generator=self._generator(device))
        # U in [0, 1) -> E = -log(U) -> log(E). U == 0 gives E = inf: a token that never wins.
        noise.log_().neg_().log_()
        for r, s in enumerate(seqs):
            if s.sampling.seed is None:
                continue
            gen = torch.Generator(device=device)
            gen.manual_seed(row_seed(s.sampling.seed, s.output_index))
            # The same per-token-id values whatever the row's candidates or the batch.
            full = torch.rand(vocab, generator=gen, device=device).log_().neg_().log_()
            noise[r] = full if ids is None else full[ids[r]]
        return noise

    def _sample_plain(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> torch.Tensor:
        """Temperature only. `logits: [m, vocab]` -> tokens `[m]`. Without a seed, by the
        inverse of each row's distribution at one uniform draw a row; with one, by the noise
        per token id (`_log_noise`), the same whatever the batch."""
        temps = _column([s.sampling.temperature for s in seqs], logits)  # [m, 1]
        if all(s.sampling.seed is None for s in seqs):
            # NOTE: one draw a row, not one per token: on a CPU, drawing and taking logs of a
            # whole vocabulary of noise a row was most of a small model's step.
            # A temperature too small for float32 is the greedy limit: an argmax, not NaNs.
            probs = torch.softmax(logits / temps.clamp_min(_MIN_TEMPERATURE), dim=-1)
            cdf = probs.cumsum(dim=-1)  # [m, vocab]
            u = torch.rand(logits.shape[0], 1, generator=self._generator(logits.device),
                           device=logits.device)
            # In (0, total]: rounding in the sum cannot carry the draw past the last token.
            target = (1.0 - u) * cdf[:, -1:]
            picked = torch.searchsorted(cdf, target).squeeze(1).clamp_(max=logits.shape[1] - 1)
            # A token of probability 0 (banned) is never drawn on a CPU, whose sum adds in
            # order; a device summing in another order may leave its entry a rounding above the
            # one before it. Such a draw takes the row's most likely token instead.
            drawn = probs.gather(1, picked.unsqueeze(1)).squeeze(1) > 0
            return torch.where(drawn, picked, probs.argmax(dim=-1))
        noise = self._log_noise(seqs, logits.shape[1], None, logits)  # [m, vocab]
        # argmax(logit / T - log E) = argmax(logit - T log E) for T > 0: no [m, vocab] temporary.
        return noise.mul_(-temps).add_(logits).argmax(dim=-1)

    def _sample_filtered(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> torch.Tensor:
        """Top-k and/or top-p. `logits: [m, vocab]` -> tokens `[m]`. Each row is sampled at the
        first candidate width that holds its top-k and its top-p nucleus (a per-row choice, so
        seeded rows stay independent of the batch)."""
        vocab = logits.shape[1]
        out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        todo = list(range(len(seqs)))
        for width in sorted({min(w, vocab) for w in (*self.CANDIDATE_WIDTHS, vocab)}):
            ready = [r for r in todo if min(seqs[r].sampling.top_k, vocab) <= width]
            if not ready:
                continue
            ready_seqs = [seqs[r] for r in ready]
            picked, short = self._sample_candidates(_take(logits, ready), ready_seqs, width)
            out[to_device(ready, logits.device)] = picked
            redo = [r for r, s in zip(ready, short or [False] * len(ready), strict=True) if s]
            ready_set = set(ready)
            todo = [r for r in todo if r not in ready_set] + redo
            if not todo:
                break
        return out

    def _sample_candidates(
        self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq], width: int
    ) -> tuple[torch.Tensor, list[bool] | None]:
        """Sample among each row's `width` best tokens. Returns tokens `[m]` and, when some row's
        nucleus may reach past the candidates, which rows must be redone wider (else None)."""
        vocab = logits.shape[1]
        if width < vocab:
            vals, ids = logits.topk(width, dim=-1)  # [m, w] each, best first
        else:  # stable: ties keep the lower token id first, as argmax does
            vals, ids = logits.sort(dim=-1, descending=True, stable=True)
        temps = _column([s.sampling.temperature for s in seqs], vals)  # [m, 1]
        scaled = vals / temps  # [m, w]
        ks = [s.sampling.top_k or width for s in seqs]
        ranks = torch.arange(width, device=vals.device).unsqueeze(0)  # [1, w]
        scaled.masked_fill_(ranks >= _column(ks, ranks), float("-inf"))
        short: list[bool] | None = None
        if any(s.sampling.top_p < 1 for s in seqs):
            # Top-p is measured on the distribution left after top-k: over the candidates for a
            # top-k row, over the whole vocabulary otherwise.
            lse = torch.logsumexp(scaled, dim=-1)  # [m]
            open_rows = [s.sampling.top_k == 0 for s in seqs]
            if width < vocab and any(open_rows):
                full = torch.logsumexp(logits / temps, dim=-1)  # [m]
                lse = torch.where(to_device(open_rows, lse.device), full, lse)
            probs = torch.exp(scaled - lse.unsqueeze(1))  # [m, w]
            mass_before = probs.cumsum(dim=-1) - probs  # [m, w], exclusive cumulative sum
            # 2.0 for top_p = 1 keeps every token despite rounding in the cumulative sum.
            top_p = _column(
                [s.sampling.top_p if s.sampling.top_p < 1 else 2.0 for s in seqs], probs
            )
            outside = mass_before >= top_p
            outside[:, 0] = False  # the best token always stays
            scaled.masked_fill_(outside, float("-inf"))
            if width < vocab and any(open_rows):
                # The last candidate still inside the nucleus: the nucleus may go on past it.
                is_open = to_device(open_rows, ids.device)
                short = ((mass_before[:, -1] < top_p[:, 0]) & is_open).tolist()
        scaled.sub_(self._log_noise(seqs, vocab, ids, scaled))
        picked = ids.gather(1, scaled.argmax(dim=-1, keepdim=True)).squeeze(1)  # [m]
        return picked, short


def _adjusted(logits: torch.Tensor, rows: Sequence[ScheduledSeq]) -> torch.Tensor:
    """A float copy of `logits: [n, vocab]` with each row's penalties, logit bias and min_p
    applied. Only the rows that ask are touched, each from its own tokens alone, so a row's
    result does not depend on the rest of the batch."""
    out = logits.float().clone()  # [n, vocab]
    dev = out.device
    for i, s in enumerate(rows):
        sp = s.sampling
        if not sp.adjusts_logits:
            continue
        row = out[i]  # [vocab], a view
        if sp.repetition_penalty != 1.0 and s.history:
            seen = to_device(sorted(set(s.history)), dev)  # prompt and output
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / sp.repetition_penalty,
                                    vals * sp.repetition_penalty)
        if (sp.presence_penalty or sp.frequency_penalty) and s.output_index and s.history:
            made = to_device(s.history[len(s.history) - s.output_index:], dev)
            ids, counts = made.unique(return_counts=True)
            row[ids] -= sp.presence_penalty + sp.frequency_penalty * counts.to(row.dtype)
        if sp.logit_bias:
            ids = to_device(list(sp.logit_bias), dev)
            row[ids] += to_device(list(sp.logit_bias.values()), dev, row.dtype)
        if sp.min_p > 0 and not sp.greedy:
            # p_i < min_p * p_max  <=>  logit_i < logit_max + T log(min_p), at temperature T.
            floor = row.max() + sp.temperature * math.log(sp.min_p)
            row.masked_fill_(row < floor, float("-inf"))
    return out


def _with_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, want: list[int | None]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Tokens plus, for rows that asked, the chosen token's logprob and the top-k alternatives."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [n, vocab], raw distribution
    chosen = logprobs.gather(1, tokens.unsqueeze(1))  # [n, 1]
    k = max(w for w in want if w is not None)
    top_vals, top_ids = logprobs.topk(k, dim=-1)  # [n, k] each
    # One transfer: ids (exact in float64) and values side by side.
    packed = torch.cat(
        [tokens.unsqueeze(1).double(), chosen.double(), top_ids.double(), top_vals.double()], dim=1
    ).tolist()  # [n, 2 + 2k]
    out = [
        None
        if w is None
        else TokenLogprobs(row[1], [(int(row[2 + j]), row[2 + k + j]) for j in range(w)])
        for row, w in zip(packed, want, strict=True)
    ]
    return [int(row[0]) for row in packed], out
