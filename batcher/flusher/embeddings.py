"""Sentence embeddings with the bundled all-MiniLM-L6-v2, ready to sit behind a `Flusher`.

`EmbeddingModel.embed` is a plain synchronous batch function (texts in, one vector per text out, in
order), so `Flusher` runs it in its worker thread; `make_embedding_batcher` wires the two together.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from batcher.bundled import minilm_dir
from batcher.flusher.flusher import Flusher, FlusherMetrics
from batcher.models.bert import BertEncoder
from batcher.system.threads import release_openmp_pool

MAX_INPUT_TOKENS = 256  # the length all-MiniLM-L6-v2 was trained at; longer inputs are truncated
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def _model_folder(path: Path) -> Path:
    """The folder holding the transformer weights: `path` or, for a sentence-transformers module
    folder (e.g. its pooling config, which also carries a config.json), the nearest parent that has
    them."""
    for folder in (path, *path.parents[:2]):
        if (folder / "tokenizer_config.json").is_file() and any(folder.glob("*.safetensors")):
            return folder
    return path


def _check_texts(texts: Sequence[str]) -> None:
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts must be a list of strings")


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"unsupported dtype {dtype}; use float32 or bfloat16")
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use float32 or bfloat16") from None


class EmbeddingModel:
    """all-MiniLM-L6-v2: mean pooling over the attention mask, L2-normalised, 384 dimensions.

    Loaded from a local folder only (never the network). The encoder runs in `dtype`; pooling and
    normalisation run in float32. Thread-compatible: one `embed` call at a time (the `Flusher`
    worker thread); inference does not mutate the module.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        max_length: int = MAX_INPUT_TOKENS,
    ) -> None:
        if max_length < 2:
            raise ValueError("max_length must be >= 2 (room for the special tokens)")
        folder = _model_folder(Path(path) if path is not None else minilm_dir())
        self.dtype = _resolve_dtype(dtype)
        self.device = torch.device(device)
        self.max_length = max_length
        self.tokenizer = _read_tokenizer(folder, max_length)
        self.pad_id = _pad_id(folder, self.tokenizer)
        self.model = BertEncoder.from_folder(folder, self.dtype).to(self.device)
        self.dim: int = self.model.config.hidden_size
        self.name = "all-MiniLM-L6-v2"
        # The process's intra-op thread count at load: a thread started while a generation step
        # runs with fewer (`batcher.runtime.thread_tuner`) would otherwise keep that count.
        self.threads = torch.get_num_threads()
        release_openmp_pool()  # batches run on the flusher's thread

    @torch.inference_mode()
    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """One unit-length vector per text, in input order; `[]` for no texts.

        Inputs over `max_length` tokens are truncated. Padding does not change a text's vector beyond
        float round-off, so batched and one-at-a-time results agree (to ~1e-6 in float32).
        """
        if len(texts) == 0:
            return []
        _check_texts(texts)
        try:
            return self._embed(texts)
        finally:
            # This thread's OpenMP workers go with the batch: kept, they would make a generation
            # engine's model thread in the same process wait by futex between its parallel
            # regions (`batcher.system.threads.release_openmp_pool`; restarting them costs no
            # measurable time). The runtimes were found when the model loaded.
            release_openmp_pool(rescan=False)

    def _embed(self, texts: Sequence[str]) -> list[list[float]]:
        if torch.get_num_threads() != self.threads:  # this thread's own count
            torch.set_num_threads(self.threads)
        encs = self.tokenizer.encode_batch(list(texts))
        width = max(len(e.ids) for e in encs)
        ids = torch.full((len(encs), width), self.pad_id, dtype=torch.long)
        types = torch.zeros((len(encs), width), dtype=torch.long)
        mask = torch.zeros((len(encs), width), dtype=torch.long)
        for row, e in enumerate(encs):
            n = len(e.ids)
            ids[row, :n] = torch.tensor(e.ids)
            types[row, :n] = torch.tensor(e.type_ids)
            mask[row, :n] = 1
        ids, types, mask = (t.to(self.device) for t in (ids, types, mask))
        hidden = self.model(ids, types, mask).float()  # [B, T, H]
        weights = mask.unsqueeze(-1).to(torch.float32)  # [B, T, 1]
        summed = (hidden * weights).sum(dim=1)  # [B, H]
        mean = summed / weights.sum(dim=1).clamp(min=1e-9)
        return F.normalize(mean, p=2, dim=1).cpu().tolist()

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text as the model sees them: special tokens included, after truncation."""
        if len(texts) == 0:
            return []
        _check_texts(texts)
        return [len(e.ids) for e in self.tokenizer.encode_batch(list(texts))]


def _read_tokenizer(folder: Path, max_length: int) -> Any:
    """The folder's tokenizer.json with the `tokenizers` library (what a Hugging Face fast
    tokenizer wraps): truncation at `max_length`, no padding (batches are padded here)."""
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"no tokenizer.json in {folder}")
    tok = Tokenizer.from_file(str(path))
    tok.no_padding()
    tok.enable_truncation(max_length=max_length)
    return tok


def _pad_id(folder: Path, tokenizer: Any) -> int:
    config = folder / "tokenizer_config.json"
    token = json.loads(config.read_text()).get("pad_token") if config.is_file() else None
    pad = tokenizer.token_to_id(token) if isinstance(token, str) else None
    return 0 if pad is None else pad


def make_embedding_batcher(
    model: EmbeddingModel,
    max_batch_size: int = 32,
    max_wait_ms: float = 5,
    *,
    max_queue: int | None = None,
    timeout_ms: float | None = None,
    metrics: FlusherMetrics | None = None,
) -> Flusher:
    """A `Flusher` whose items are single texts and whose results are their vectors.

    A request with a list input submits one item per text and gathers the results in order.
    """
    return Flusher(
        model.embed,
        max_batch_size=max_batch_size,
        max_wait_ms=max_wait_ms,
        max_queue=max_queue,
        timeout_ms=timeout_ms,
        metrics=metrics,
    )
