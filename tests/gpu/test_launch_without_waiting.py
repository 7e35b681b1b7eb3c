"""On CUDA, launching a step must not wait for the steps queued before it: the host's copies of
small values go through pinned memory (`to_device`), and sampling leaves its tokens on the
device (`Sampler.sample_on_device`). Checked behind a kernel that keeps the device busy."""

from __future__ import annotations

import time

import pytest
import torch

from batcher.core.outputs import ScheduledSeq
from batcher.core.sampling import SamplingParams
from batcher.runtime.host_to_device import to_device
from batcher.runtime.sampler import Sampler

pytestmark = pytest.mark.gpu
BUSY_CYCLES = 2_000_000_000  # about a second of one spinning thread on a GPU


def busy_device() -> float:
    """Queue a kernel that spins for about a second; when it was queued."""
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    return time.perf_counter()


def test_small_values_reach_the_device_without_waiting_for_it():
    dev = torch.device("cuda")
    queued = busy_device()
    t = to_device([3, 1, 4, 1, 5], dev, torch.long)
    waited = time.perf_counter() - queued
    assert waited < 0.2, f"the copy waited {waited:.2f}s for the device"
    assert t.device.type == "cuda" and t.tolist() == [3, 1, 4, 1, 5]


def test_sampling_on_the_device_does_not_wait_for_it():
    dev = torch.device("cuda")
    logits = torch.randn(4, 1000, device=dev)
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
             SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=1.0, top_k=20)]
    seqs = [ScheduledSeq(f"r{i}", [1], 4, [0], True, sp, output_index=i)
            for i, sp in enumerate(kinds)]
    expected, _ = Sampler(seed=1).sample(logits, seqs)
    sampler = Sampler(seed=1)
    queued = busy_device()
    tokens = sampler.sample_on_device(logits, seqs)
    waited = time.perf_counter() - queued
    assert waited < 0.2, f"sampling waited {waited:.2f}s for the device"
    assert tokens.tolist() == expected
