from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Iterator

import pytest
import torch

# Keep tests deterministic and sized for a 2-core machine.
torch.manual_seed(0)

# Servers the tests start keep their default data directories (the batch tier's) in a folder of
# the run's own, not in the user's home; child processes inherit it.
_DATA_HOME = tempfile.TemporaryDirectory(prefix="batcher-test-data-")
os.environ["XDG_DATA_HOME"] = _DATA_HOME.name


@pytest.fixture(scope="session")
def tiny_fp32():
    from batcher.models.loader import load_model

    return load_model("tiny", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm_fp32():
    from batcher.models.loader import load_model

    return load_model("smollm2-135m", dtype="float32", device="cpu")


@pytest.fixture
def frozen_gc() -> Iterator[None]:
    """Keep the test process's own garbage collector out of latency figures.

    The test process holds torch, hypothesis and whatever earlier tests left, so a full (gen 2)
    collection takes up to a quarter of a second, and every request in flight on the client
    during one looks that much slower. Freezing what exists now leaves later collections only
    the objects made during the test.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()

