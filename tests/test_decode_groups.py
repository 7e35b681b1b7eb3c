from __future__ import annotations

from batcher.runtime.step_inputs import split_decode_groups


def test_uniform_lengths_stay_one_group():
    assert split_decode_groups([10] * 64) == [(64, 10)]


def test_long_head_splits_off_short_tail():
    groups = split_decode_groups([40, 38, 36] + [10] * 30)
    assert groups == [(3, 40), (33, 10)]


def test_small_savings_do_not_split():
    # Two short rows behind a long one save too little to pay for another call.
    assert split_decode_groups([20, 5, 5]) == [(3, 20)]


def test_groups_cover_every_row_and_pad_to_their_head():
    blocks = sorted([1 + (i * 37) % 40 for i in range(64)], reverse=True)
    start = 0
    for end, pad in split_decode_groups(blocks):
        assert end > start and all(b <= pad for b in blocks[start:end])
        assert blocks[start] == pad
        start = end
    assert start == len(blocks)
