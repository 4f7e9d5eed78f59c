"""Where each sequence of a step sits: its tokens on the flat axis, its seat, its KV blocks."""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from ifb_plugins.mamba.attention import token_positions
from ifb_plugins.common.attention import AttnMetadata, build_attn_metadata


@attrs.frozen
class StepLayout:
    """One step's sequences, split into single-token ones (decode) and chunks (prefill).

    A prefill chunk of one token is a decode as far as the recurrence goes:
    one step of the state update.
    """

    attn: AttnMetadata
    #: per flat token: the index of its sequence, its position in that sequence
    token_seq: torch.Tensor
    token_pos: torch.Tensor
    #: flat token index and seat of each single-token sequence
    decode_token_idx: torch.Tensor
    decode_seats: torch.Tensor
    #: flat token indices of the multi-token chunks, packed in sequence order
    prefill_token_idx: torch.Tensor
    #: host copies: the seat and the packed [start, end) offsets of each chunk
    prefill_seats: tuple[int, ...]
    prefill_cu_seqlens: tuple[int, ...]

    @property
    def has_decode(self) -> bool:
        return self.decode_token_idx.numel() > 0

    @property
    def has_prefill(self) -> bool:
        return bool(self.prefill_seats)


def build_layout(seqs: Sequence[tuple[int, int, int, Sequence[int]]], block_size: int,
                 device: torch.device | str = "cpu") -> StepLayout:
    """Build the layout from ``(seat, start_pos, num_new_tokens, block_ids)`` per sequence."""
    attn = build_attn_metadata([(start, n, blocks) for _, start, n, blocks in seqs], block_size, device)
    token_seq, token_pos = token_positions(attn, device)
    decode_idx, decode_seats, prefill_idx, prefill_seats, cu = [], [], [], [], [0]
    offset = 0
    for seat, _, n, _ in seqs:
        if n == 1:
            decode_idx.append(offset)
            decode_seats.append(seat)
        else:
            prefill_idx.extend(range(offset, offset + n))
            prefill_seats.append(seat)
            cu.append(cu[-1] + n)
        offset += n

    def longs(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return StepLayout(
        attn=attn, token_seq=token_seq, token_pos=token_pos,
        decode_token_idx=longs(decode_idx), decode_seats=longs(decode_seats),
        prefill_token_idx=longs(prefill_idx), prefill_seats=tuple(prefill_seats), prefill_cu_seqlens=tuple(cu),
    )
