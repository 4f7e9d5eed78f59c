"""The KV of a request's finished tokens (prompt and finished blocks), which its canvases read.

DiffusionGemma's encoder writes it (causal attention over what came before);
the denoiser only reads it. As in the reference's dynamic cache, a
sliding-attention layer keeps the last ``sliding_window - 1`` tokens and a
full-attention layer keeps them all.
"""

from __future__ import annotations

import attrs
import torch


@attrs.define(eq=False)
class PrefixKV:
    """Per layer ``keys[l]`` / ``values[l]`` ``[Hkv, n_l, D_l]``; ``num_tokens`` tokens encoded so far."""

    #: tokens kept by a sliding layer (None: a full layer keeps everything)
    keep: tuple[int | None, ...]
    keys: list[torch.Tensor | None] = attrs.field(init=False)
    values: list[torch.Tensor | None] = attrs.field(init=False)
    num_tokens: int = 0

    def __attrs_post_init__(self) -> None:
        self.keys = [None] * len(self.keep)
        self.values = [None] * len(self.keep)

    def num_cached(self, layer: int) -> int:
        k = self.keys[layer]
        return 0 if k is None else k.shape[1]

    def extended(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached KV of ``layer`` followed by ``k`` / ``v [Hkv, T, D]``: ``[Hkv, n + T, D]`` each."""
        if self.keys[layer] is None:
            return k, v
        return torch.cat((self.keys[layer], k), dim=1), torch.cat((self.values[layer], v), dim=1)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep ``k`` / ``v`` (the full ``extended`` KV of ``layer``), trimmed to what the layer keeps."""
        keep = self.keep[layer]
        if keep is not None and k.shape[1] > keep:
            k, v = k[:, k.shape[1] - keep:], v[:, v.shape[1] - keep:]
        self.keys[layer], self.values[layer] = k, v

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)
