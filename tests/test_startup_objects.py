"""Freezing the engine's startup objects out of the garbage collector (engine/startup_objects.py)."""

from __future__ import annotations

import gc

from engine.startup_objects import freeze_startup_objects


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_objects_alive_at_the_freeze_leave_the_collectors_walks_and_later_ones_do_not() -> None:
    before = _Node()
    try:
        freeze_startup_objects()
        after = _Node()
        walked = {id(o) for o in gc.get_objects()}
        assert id(before) not in walked  # a full collection no longer visits it
        assert id(after) in walked
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # the test process goes on collecting as before
