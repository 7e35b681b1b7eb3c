"""`freeze_startup_heap`: what a server holds at the end of start-up is skipped by later full
collections, and what it allocates afterwards is still collected."""

from __future__ import annotations

import gc

from batcher.system.gc_freeze import freeze_startup_heap


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_startup_heap_is_frozen_and_new_garbage_still_collected() -> None:
    try:
        kept = [Cycle() for _ in range(1000)]
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(kept)
        for _ in range(100):
            Cycle()  # unreachable cycles made after start-up
        assert gc.collect() >= 100
        assert all(k.me is k for k in kept)
    finally:
        gc.unfreeze()
