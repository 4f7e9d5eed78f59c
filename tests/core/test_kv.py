"""BlockManager: counts, the free list, and the order blocks are handed out in."""

import pytest

from ifb.kv import BlockManager, OutOfBlocks


def test_a_freed_sequence_s_blocks_come_back_as_an_ascending_run() -> None:
    blocks = BlockManager(12, 4)
    first, second = blocks.allocate(4), blocks.allocate(4)
    assert first == [0, 1, 2, 3] and second == [4, 5, 6, 7]
    blocks.free(first)  # released last block first
    assert blocks.allocate(4) == [8, 9, 10, 11]
    # the freed run, handed out again, ascends: the context reads forward through memory
    again = blocks.allocate(4)
    assert again == [0, 1, 2, 3]
    with pytest.raises(OutOfBlocks, match="1 KV blocks asked, 0 free"):
        blocks.allocate(1)
    blocks.free(second)
    blocks.free(again)
    # first freed, first handed out (7, 6, 5, 4, then 3, 2): neighbours again
    assert blocks.allocate(6) == [2, 3, 4, 5, 6, 7]


def test_every_allocation_ascends_under_churn() -> None:
    blocks = BlockManager(64, 16)
    held = []
    for step in range(200):
        size = 1 + (step * 7) % 9
        if blocks.can_allocate(size):
            ids = blocks.allocate(size)
            assert ids == sorted(ids) and all(blocks.ref_counts[b] == 1 for b in ids)
            held.append(ids)
        if step % 3 == 2 and held:
            blocks.free(held.pop((step * 5) % len(held)))
    for ids in held:
        blocks.free(ids)
    blocks.check_no_leaks()
