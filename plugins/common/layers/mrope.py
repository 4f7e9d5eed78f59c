"""Multimodal rotary positions (M-RoPE), as Qwen2-VL, Qwen2.5-VL and Qwen3-VL define them.

A token has three position ids, temporal / height / width, instead of one.
Text tokens carry the same id in all three rows, so for text alone M-RoPE is
plain RoPE. The ``grid_t x grid_h x grid_w`` tokens of an image all start at
the position after the text before it: row 0 adds the frame index, row 1 the
row, row 2 the column. The text after the image continues from the largest
id so far + 1.

The rotary frequencies ``[D/2]`` are split into ``mrope_section`` runs
(summing to ``D/2``): run ``i`` rotates by the ids of row ``i % 3`` (Qwen3-VL
interleaves the rows over the frequencies instead, see ``section_rows``).

A sequence's ids depend only on its own prompt, never on its batch mates: a
prompt token takes its precomputed ids, and the ``k``-th token of the context
past the prompt (a generated one) sits at ``k + delta`` in every row, where
``delta = max id + 1 - prompt length`` (transformers' ``rope_deltas``).
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch


@attrs.frozen(eq=False)  # a tensor inside: identity, not elementwise, comparison
class MropePositions:
    """The M-RoPE ids of a prompt (``[3, P]``, on the host) and the offset of every later token."""

    prompt: torch.Tensor
    delta: int

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt.shape[1]

    def span(self, start: int, num_tokens: int) -> torch.Tensor:
        """Ids ``[3, num_tokens]`` of context positions ``start .. start + num_tokens - 1``."""
        p = self.num_prompt_tokens
        head = self.prompt[:, start:min(start + num_tokens, p)]  # [3, <= n], the prompt part
        end = start + num_tokens
        tail = torch.arange(min(max(start, p), end), end, dtype=torch.long) + self.delta  # generated tokens
        return torch.cat((head, tail.expand(3, -1)), dim=1)


def grid_ids(grid_t: int, grid_h: int, grid_w: int, time_interval: int = 1) -> torch.Tensor:
    """Relative ids ``[3, t*h*w]`` of a media item's tokens in raster order: frame, row, column."""
    t = torch.arange(grid_t, dtype=torch.long) * time_interval
    h = torch.arange(grid_h, dtype=torch.long)
    w = torch.arange(grid_w, dtype=torch.long)
    return torch.stack(torch.meshgrid(t, h, w, indexing="ij")).reshape(3, -1)


def prompt_positions(num_prompt_tokens: int, media: Sequence[tuple[int, torch.Tensor]]) -> MropePositions:
    """The ids of a prompt whose media spans are ``(first prompt index, relative ids [3, n])``.

    A span's ids are offset by the id after the text before it, and the text
    after it continues from the span's largest id + 1. For whole images
    (``grid_ids``) this is transformers' ``Qwen2_5_VLModel.get_rope_index``;
    the ids stay below the prompt length there, so ``delta <= 0``.
    """
    rows: list[torch.Tensor] = []
    at = 0  # next prompt index
    pos = 0  # next position id
    for start, ids in sorted(media, key=lambda m: m[0]):
        n = ids.shape[1]
        if start < at or start + n > num_prompt_tokens:
            raise ValueError(f"a media span at prompt index {start} ({n} tokens) does not fit "
                             f"a prompt of {num_prompt_tokens} tokens after index {at}")
        rows.append(torch.arange(pos, pos + start - at, dtype=torch.long).expand(3, -1))
        pos += start - at
        span = ids.to(torch.long).cpu() + pos
        rows.append(span)
        pos = int(span.max()) + 1 if n else pos
        at = start + n
    rows.append(torch.arange(pos, pos + num_prompt_tokens - at, dtype=torch.long).expand(3, -1))
    prompt = torch.cat(rows, dim=1)  # [3, P]
    top = int(prompt.max()) + 1 if prompt.numel() else 0
    return MropePositions(prompt=prompt, delta=top - num_prompt_tokens)


def text_positions(start: int, num_tokens: int) -> torch.Tensor:
    """Ids ``[3, n]`` of a text-only sequence: its context positions, in all three rows."""
    return torch.arange(start, start + num_tokens, dtype=torch.long).expand(3, -1)


def step_positions(spans: Sequence[tuple[MropePositions | None, int, int]]) -> torch.Tensor:
    """Ids ``[3, T]`` of a step: per sequence ``(its positions or None for text alone, start, num_tokens)``."""
    return torch.cat([text_positions(start, n) if mp is None else mp.span(start, n) for mp, start, n in spans], dim=1)


def section_rows(mrope_section: Sequence[int], head_dim: int, interleaved: bool = False) -> torch.Tensor:
    """For each of the ``D`` rotary columns, the position row (0, 1, 2) that rotates it: ``[D]``.

    Contiguous runs (Qwen2-VL, Qwen2.5-VL), or, ``interleaved`` (Qwen3-VL), frequency ``j``
    rotated by row ``j % 3`` while that row's run lasts (``j < 3 * mrope_section[row]``), else by row 0.
    """
    half = head_dim // 2
    if sum(mrope_section) != half:
        raise ValueError(f"mrope_section {list(mrope_section)} must sum to half the head dim ({half})")
    # on the host even while a model is built on the meta device
    if interleaved:
        j = torch.arange(half, device="cpu")
        rows = torch.zeros(half, dtype=torch.long, device="cpu")
        for row in (1, 2):
            rows[(j % 3 == row) & (j < 3 * mrope_section[row])] = row
    else:
        rows = torch.cat([torch.full((n,), i % 3, dtype=torch.long, device="cpu")
                          for i, n in enumerate(mrope_section)])
    return torch.cat((rows, rows))  # the two rotate-half halves share their frequencies


def select_sections(table: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rotary rows ``[T, 2, D]`` for ids ``positions [3, T]`` out of a per-position ``table [L, 2, D]``.

    Column ``j`` of a token comes from the table row of its id in position row ``rows[j]``.
    """
    t = positions.shape[1]
    per_row = table.index_select(0, positions.reshape(-1)).view(3, t, *table.shape[1:])  # [3, T, 2, D]
    index = rows.to(table.device).view(1, 1, 1, -1).expand(1, t, table.shape[1], -1)
    return per_row.gather(0, index)[0]
