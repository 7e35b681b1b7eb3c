from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


def bundled_weights_missing() -> str | None:
    """Why the bundled model's weights cannot be loaded here, or None when they can. A GPU check
    may carry only the bundled file's header (config and tokenizer, no tensors: the weights do
    not fit its transfer), which serves the tokenizer and `load_format="dummy"` alone."""
    from batcher.bundled import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as exc:
        return str(exc)
    with path.open("rb") as f:
        head = f.read(24)
    # magic, version u32, tensor count u64
    if head[:4] != b"GGUF" or int.from_bytes(head[8:16], "little") == 0:
        return f"{path.name} here holds the tokenizer only: the model's weights were not carried"
    return None
