"""Recurrent-state checkpoints for prefix reuse: the conv and SSM state at block boundaries, kept in slots.

KV blocks alone cannot resume a hybrid model: a joiner that reuses a prefix
needs every Mamba layer's state at the end of it. During each step the
runtime captures a sequence's state after the tokens that end a full KV
block at a *checkpoint position*: every ``interval`` tokens, and the last
block boundary of the prompt (the end of the prompt, as far as whole blocks
go; and the one before when the prompt fills its last block, which is as far
as the same prompt sent again can reuse). The context cache then keeps a capture in a slot of this pool beside
the block it belongs to (``save``), and a joiner whose prompt reaches a
kept checkpoint starts from it (``stage_restore``; applied by the runtime when
the joiner's first chunk runs).

Slots are carved out of the KV capacity (``plan_capacity``), so the state
counts against ``--max-kv-cache-capacity``. This class implements the
``RecurrentStateCheckpoints`` protocol of the context cache plugin.
"""

from __future__ import annotations

import math
from typing import Sequence

import attrs
import torch

from ifb.runtime import ScheduledSeq, Seat
from ifb_plugins.mamba.config import HybridConfig
from ifb_plugins.mamba.model import HybridCache

#: tokens between two checkpoints inside a long prompt or generation (a multiple of the KV block size)
DEFAULT_CHECKPOINT_INTERVAL = 256


@attrs.frozen
class CapacityPlan:
    num_kv_blocks: int
    num_state_slots: int
    #: KV blocks' worth of memory one slot takes
    blocks_per_slot: int


def state_bytes(config: HybridConfig) -> int:
    """Bytes of one checkpoint: every recurrent layer's conv and SSM state (float32)."""
    c = config
    heads, rows, cols = c.state_shape
    per_layer = c.conv_dim * (c.conv_kernel - 1) + heads * rows * cols
    return 4 * per_layer * c.num_recurrent_layers


def plan_capacity(config: HybridConfig, capacity_tokens: int, block_size: int, interval: int,
                  num_seats: int, *, may_grow: bool = False) -> CapacityPlan:
    """Split a KV capacity between KV blocks and checkpoint slots (at most half of it for slots).

    As many slots as the capacity has checkpoint positions (one per ``interval``
    tokens) plus one prompt end per seat, if half the capacity holds them. With
    ``may_grow`` (the capacity is a default, not the user's) it grows until
    half of it holds a slot per seat and one more.
    """
    total_blocks = -(-capacity_tokens // block_size)
    block_bytes = 4 * 2 * block_size * config.num_kv_heads * config.head_dim * config.num_attention_layers
    cost = max(1, math.ceil(state_bytes(config) / block_bytes)) if block_bytes else 0
    if may_grow:
        total_blocks = max(total_blocks, 2 * (num_seats + 1) * cost)
        capacity_tokens = total_blocks * block_size
    wanted = -(-capacity_tokens // interval) + num_seats
    slots = min(wanted, total_blocks // 2 // cost) if cost else wanted
    if slots < 1:
        raise ValueError(
            f"--max-kv-cache-capacity {capacity_tokens} tokens cannot hold a recurrent-state checkpoint beside "
            f"the KV: one takes {cost} blocks ({cost * block_size} tokens) of it and checkpoints may use half; "
            f"raise the capacity to at least {2 * cost * block_size} tokens")
    return CapacityPlan(total_blocks - slots * cost, slots, cost)


class StateCheckpoints:
    """A pool of ``num_slots`` state slots, the last step's captures, and the restores waiting to run."""

    def __init__(self, config: HybridConfig, num_slots: int, interval: int, block_size: int,
                 device: torch.device | str = "cpu"):
        if interval < block_size or interval % block_size:
            raise ValueError(f"--hybrid-checkpoint-interval ({interval}) must be a multiple of the KV block "
                             f"size ({block_size})")
        self.interval = interval
        self.block_size = block_size
        self.num_slots = num_slots
        c = config
        self.conv = [torch.zeros(num_slots, c.conv_dim, c.conv_kernel - 1, device=device)
                     for _ in range(c.num_recurrent_layers)]
        self.ssm = [torch.zeros(num_slots, *c.state_shape, device=device) for _ in range(c.num_recurrent_layers)]
        #: (request id, position) -> capture id of the last step
        self._captured: dict[tuple[str, int], int] = {}
        self._cache: HybridCache | None = None
        #: request id -> (position, slot) to start from
        self.pending_restores: dict[str, tuple[int, int]] = {}

    # ---- the runtime's side ----
    def checkpoint_positions(self, seq: ScheduledSeq, num_prompt_tokens: int) -> list[int]:
        """Positions in ``(start, end]`` of this chunk whose state may be kept."""
        bs, start, end = self.block_size, seq.start_pos, seq.start_pos + len(seq.token_ids)
        # the prompt's last block boundary (prompts that extend it), and the last one before its last
        # token (the same prompt again: a match always leaves that token to compute)
        prompt_ends = {num_prompt_tokens // bs * bs, (num_prompt_tokens - 1) // bs * bs}
        first = start // bs * bs + bs
        return [p for p in range(first, end + 1, bs) if p % self.interval == 0 or p in prompt_ends]

    def plan(self, seqs: Sequence[ScheduledSeq], seats: Sequence[Seat]) -> list[list[tuple[int, int]]]:
        """Per sequence ``(tokens into its chunk, capture id)`` for ``build_layout``."""
        self._captured = {}
        out = []
        for seq, seat in zip(seqs, seats, strict=True):
            points = []
            for pos in self.checkpoint_positions(seq, seat.num_prompt_tokens):
                capture_id = len(self._captured)
                self._captured[(seq.request_id, pos)] = capture_id
                points.append((pos - seq.start_pos, capture_id))
            out.append(points)
        return out

    def captured(self, cache: HybridCache) -> None:
        """The step ran: its captures are in ``cache.captured``."""
        self._cache = cache

    def apply_restores(self, seqs: Sequence[ScheduledSeq], cache: HybridCache) -> None:
        """Start each seq with a staged restore from its checkpoint (after its seat was cleared)."""
        for seq in seqs:
            staged = self.pending_restores.pop(seq.request_id, None)
            if staged is None:
                continue
            position, slot = staged
            if seq.start_pos == 0:
                continue  # it starts over from the first token (recomputed): nothing to restore
            if seq.start_pos != position:
                raise ValueError(f"{seq.request_id} resumes at token {seq.start_pos}, but its state checkpoint "
                                 f"is at token {position}")
            for layer in range(len(cache.conv)):
                cache.conv[layer][seq.seat] = self.conv[layer][slot]
                cache.ssm[layer][seq.seat] = self.ssm[layer][slot]

    # ---- the context cache's side (RecurrentStateCheckpoints) ----
    def has_capture(self, request_id: str, position: int) -> bool:
        return self._cache is not None and (request_id, position) in self._captured

    def save(self, request_id: str, position: int, slot: int) -> bool:
        """Keep the state ``request_id`` had after ``position`` tokens in the last step in ``slot``."""
        capture_id = self._captured.get((request_id, position))
        if capture_id is None or self._cache is None:
            return False
        for layer, (conv, ssm) in enumerate(self._cache.captured):
            self.conv[layer][slot] = conv[capture_id]
            self.ssm[layer][slot] = ssm[capture_id]
        return True

    def stage_restore(self, request_id: str, position: int, slot: int) -> None:
        """When ``request_id`` first runs (from ``position``), its seat starts from ``slot``."""
        self.pending_restores[request_id] = (position, slot)

    def cancel_restore(self, request_id: str) -> None:
        self.pending_restores.pop(request_id, None)
