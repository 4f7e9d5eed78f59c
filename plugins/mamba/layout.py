"""Where each sequence of a step sits: its tokens on the flat axis, its seat, its KV blocks."""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from ifb_plugins.mamba.attention import token_positions
from ifb_plugins.common.layers.attention import AttnMetadata, build_attn_metadata


@attrs.frozen
class ScanRound:
    """One pass of the chunk scan: a segment of each prefill chunk, then the captures at its end."""

    token_idx: torch.Tensor  # flat token indices of the segments, packed in sequence order
    seats: tuple[int, ...]
    cu_seqlens: tuple[int, ...]
    captures: tuple[tuple[int, int], ...]  # (seat, capture id) after this round


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
    #: the chunk scan's passes: one when nothing is captured inside a chunk
    prefill_rounds: tuple[ScanRound, ...] = ()
    #: (seat, capture id) of decodes whose state is captured after the step
    decode_captures: tuple[tuple[int, int], ...] = ()
    #: per prefill chunk: (tokens of the chunk consumed, capture id)
    conv_captures: tuple[tuple[tuple[int, int], ...], ...] = ()

    @property
    def has_decode(self) -> bool:
        return self.decode_token_idx.numel() > 0

    @property
    def has_prefill(self) -> bool:
        return bool(self.prefill_seats)


def _rounds(chunks: list[tuple[int, int, int, Sequence[tuple[int, int]]]], longs) -> tuple[ScanRound, ...]:
    """Split each chunk ``(seat, flat offset, length, captures)`` at its inner capture points."""
    segments = []  # per chunk: [(flat start, flat end, captures at the end)]
    for seat, offset, n, captures in chunks:
        cuts = sorted({t for t, _ in captures if t < n}) + [n]
        start, parts = 0, []
        for end in cuts:
            parts.append((offset + start, offset + end, tuple((seat, cid) for t, cid in captures if t == end)))
            start = end
        segments.append(parts)
    rounds = []
    for r in range(max((len(p) for p in segments), default=0)):
        idx, seats, cu, caught = [], [], [0], []
        for (seat, *_), parts in zip(chunks, segments):
            if r < len(parts):
                begin, end, at_end = parts[r]
                idx.extend(range(begin, end))
                seats.append(seat)
                cu.append(cu[-1] + end - begin)
                caught.extend(at_end)
        rounds.append(ScanRound(longs(idx), tuple(seats), tuple(cu), tuple(caught)))
    return tuple(rounds)


def build_layout(seqs: Sequence[tuple[int, int, int, Sequence[int]]], block_size: int,
                 device: torch.device | str = "cpu",
                 captures: Sequence[Sequence[tuple[int, int]]] | None = None) -> StepLayout:
    """Build the layout from ``(seat, start_pos, num_new_tokens, block_ids)`` per sequence.

    ``captures[i]`` lists ``(t, capture id)``: copy sequence i's state after its
    first ``t`` tokens of this step (``0 < t <= num_new_tokens``).
    """
    attn = build_attn_metadata([(start, n, blocks) for _, start, n, blocks in seqs], block_size, device)
    token_seq, token_pos = token_positions(attn, device)
    captures = captures or [()] * len(seqs)
    decode_idx, decode_seats, prefill_idx, prefill_seats, cu = [], [], [], [], [0]
    decode_caught, chunks = [], []
    offset = 0
    for (seat, _, n, _), caught in zip(seqs, captures, strict=True):
        if any(not 0 < t <= n for t, _ in caught):
            raise ValueError(f"a capture point must fall within the step's {n} tokens: {caught}")
        if n == 1:
            decode_idx.append(offset)
            decode_seats.append(seat)
            decode_caught.extend((seat, cid) for _, cid in caught)
        else:
            prefill_idx.extend(range(offset, offset + n))
            prefill_seats.append(seat)
            cu.append(cu[-1] + n)
            chunks.append((seat, len(prefill_idx) - n, n, tuple(caught)))
        offset += n

    def longs(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    # Rounds index the packed prefill tokens; map them back to the flat axis.
    packed_rounds = _rounds(chunks, lambda v: v)
    flat = longs(prefill_idx)
    rounds = tuple(attrs.evolve(r, token_idx=flat[longs(r.token_idx)]) for r in packed_rounds)
    return StepLayout(
        attn=attn, token_seq=token_seq, token_pos=token_pos,
        decode_token_idx=longs(decode_idx), decode_seats=longs(decode_seats),
        prefill_token_idx=flat, prefill_seats=tuple(prefill_seats), prefill_cu_seqlens=tuple(cu),
        prefill_rounds=rounds, decode_captures=tuple(decode_caught),
        conv_captures=tuple(tuple((t, cid) for t, cid in c[3]) for c in chunks),
    )
