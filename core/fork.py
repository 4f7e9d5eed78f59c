"""n > 1 under in-flight batching: one prefill, then n sequences sharing the prompt's KV blocks.

An n > 1 request is fanned out into n sequences (``engine.fan_out``) that take
their n seats together. The first, the *leader*, prefills the prompt but its
last token; the others, the *followers*, wait in their seats. At the boundary
where the leader has computed that much, each follower forks from it: it
leases the leader's full blocks (their reference counts go up, nothing is
recomputed) and gets its own copy of the last, partial block (copy on write:
every sequence writes its own tokens into it), which the runtime makes before
the step's forward (``ScheduledStep.block_copies``). From there on each
sequence computes the prompt's last token itself and samples its own stream
(sequence i seeded ``seed + i``), as n single requests would.

A leader that leaves before the fork (preempted, cancelled, failed) lets its
followers go: each prefills the prompt itself, which is correct, only not
shared. Neither does a follower fork when the pool cannot give it its block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ifb.request import Request

if TYPE_CHECKING:
    from ifb.kv import BlockManager

#: why a follower is left out of a step while its leader prefills the shared prompt
WAITS_FOR_LEADER = "waits for its request's shared prefill (n > 1)"


def num_shared_tokens(leader: Request) -> int:
    """The prompt tokens the leader computes for everyone: all but the last, which each sequence samples from."""
    return leader.num_prompt_tokens - 1


def is_waiting_to_fork(r: Request) -> bool:
    """A follower whose leader has not yet prefilled the shared prompt."""
    return r.group is not None and r in r.group.followers


def leader_cap(r: Request) -> int | None:
    """The most tokens a leader with followers still waiting may compute now (None: no cap)."""
    group = r.group
    if group is None or group.leader is not r or not group.followers:
        return None
    return num_shared_tokens(r) - r.num_computed_tokens


def seats_needed(head: Request) -> int:
    """Seats the queue head takes when it is seated: a whole n > 1 request's n on its first seating."""
    group = head.group
    if group is not None and group.leader is head and not group.is_seated:
        return 1 + len(group.followers)
    return 1


def blocks_needed(head: Request, blocks: BlockManager) -> int:
    """KV blocks seating ``head`` takes: its prefill, plus one block per follower for its copy of the last one."""
    num = blocks.blocks_for(head.num_tokens)
    if seats_needed(head) > 1 and num_shared_tokens(head) % blocks.block_size:
        num += len(head.group.followers)
    return num


def leave(r: Request) -> None:
    """``r`` left its seat: a leader before the fork lets its followers go (each prefills the prompt
    itself); a follower before the fork is a sequence of its own when it comes back."""
    group = r.group
    if group is None:
        return
    if group.leader is r:
        group.followers.clear()
    elif r in group.followers:
        group.followers.remove(r)


def fork_ready(running: list[Request], blocks: BlockManager) -> list[list[tuple[int, int]]]:
    """Fork every follower whose leader has computed the shared prompt; returns the block copies (src, dst)
    of each KV group: the full-attention pool's first, then each window group's."""
    copies: list[list[tuple[int, int]]] = [[] for _ in range(1 + len(blocks.window_groups))]
    for leader in running:
        group = leader.group
        if group is None or group.leader is not leader or not group.followers:
            continue
        shared = num_shared_tokens(leader)
        if leader.num_computed_tokens < shared:
            continue
        num_full, partial = divmod(shared, blocks.block_size)
        for follower in list(group.followers):
            group.followers.remove(follower)
            if partial and not blocks.can_allocate_in_every_group(1):
                continue  # no block for its copy: it prefills the prompt itself
            follower.block_ids = leader.block_ids[:num_full]
            blocks.incref(follower.block_ids)
            for window, own_table, source in zip(blocks.window_groups, follower.window_tables,
                                                 leader.window_tables):
                window.lease(own_table, source, num_full)
            if partial:
                (own,) = blocks.allocate(1)
                copies[0].append((leader.block_ids[num_full], own))
                follower.block_ids = [*follower.block_ids, own]
                for i, (window, own_table, source) in enumerate(
                        zip(blocks.window_groups, follower.window_tables, leader.window_tables), 1):
                    window.grow(own_table, 1)
                    copies[i].append((source.block_ids[num_full - source.num_freed], own_table.block_ids[-1]))
            follower.num_computed_tokens = shared
    return copies
