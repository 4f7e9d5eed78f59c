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


def test_a_window_group_frees_what_every_later_query_cannot_see_and_the_runtime_reads_it_as_null():
    from ifb.kv import WindowGroup, WindowTable
    from ifb.params import SamplingParams
    from ifb.runtime import NewSeq, ScheduledSeq, ScheduledStep, SeatTable, WindowBlocks

    group = WindowGroup(6, BlockManager(5, 4))  # a query at p sees p - 5 .. p
    assert [group.num_out_of_window(p) for p in (0, 8, 9, 12, 13)] == [0, 0, 1, 1, 2]
    assert group.max_blocks_per_seq(1) == 3 and group.max_blocks_per_seq(4) == 4
    table = WindowTable()
    group.grow(table, 3)  # positions 0..11
    first = WindowBlocks(table.num_freed, group.unsent(table))
    group.slide(table, 10)  # the query at 10 sees 5..10: block 0 (0..3) goes back to the pool
    assert table.num_freed == 1 and len(table.block_ids) == 2 and group.blocks.num_free == 3
    group.grow(table, 1)
    second = WindowBlocks(table.num_freed, group.unsent(table))
    assert second == WindowBlocks(1, (table.block_ids[-1],))
    seats = SeatTable(null_block_ids=[5])
    new = NewSeq(request_id="r", seat=0, token_ids=tuple(range(16)), num_prompt_tokens=16, params=SamplingParams())
    seq = ScheduledSeq(request_id="r", seat=0, token_ids=tuple(range(12)), start_pos=0, new_block_ids=(0, 1, 2),
                       is_sampling=False, window_blocks=(first,))
    seats.apply(ScheduledStep(step_id=1, seqs=(seq,), new_seqs=(new,)))
    seq = ScheduledSeq(request_id="r", seat=0, token_ids=(12,), start_pos=12, new_block_ids=(3,), is_sampling=True,
                       window_blocks=(second,))
    (seat,) = seats.apply(ScheduledStep(step_id=2, seqs=(seq,)))
    assert seat.window_block_ids == [[5, *table.block_ids]]  # the freed entry names the null block
    group.release(table)
    group.blocks.check_no_leaks()
    # a lease that starts past freed entries: the runtime's table starts with them, as null blocks
    leased = WindowTable(block_ids=group.blocks.allocate(2), num_freed=2)
    assert (leased.num_freed, group.unsent(leased)) == (2, tuple(leased.block_ids))
