from __future__ import annotations

import pytest
import torch

# Keep tests deterministic and sized for a 2-core machine.
torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_fp32():
    from batcher.models.loader import load_model

    return load_model("tiny", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm_fp32():
    from batcher.models.loader import load_model

    return load_model("smollm2-135m", dtype="float32", device="cpu")
