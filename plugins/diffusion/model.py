"""DiffusionGemma's text backbone: one weight set that encodes finished tokens and denoises canvases.

transformers builds it as an encoder (a causal Gemma 4 text model that writes
the KV cache) and a denoiser (the same layers, bidirectional inside a canvas,
reading that cache), tied weight for weight. ``forward`` runs both kinds of
segment in one pass over a flat row axis, so a request's finished block and
its next canvas, and the canvases of different requests, share a forward.

A canvas's input embedding is its tokens' embedding plus *self-conditioning*:
the previous denoising step's token probabilities times the embedding matrix,
through a gated MLP between RMS norms (zero at a block's first step). Logits
come from the tied embedding and are soft-capped: ``c * tanh(logits / c)``.

Shape letters: N rows, L canvas length, H hidden size, V vocabulary.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from ifb_plugins.common.models.decoder import RMSNorm
from ifb_plugins.diffusion.cache import PrefixKV
from ifb_plugins.diffusion.config import DiffusionGemmaConfig
from ifb_plugins.diffusion.layers import MLP, Layer, Segment, rope_cos_sin, rope_inv_freq, unit_rms_norm


@attrs.frozen
class SegmentInput:
    """One request's share of a forward.

    ``token_ids [T]`` at positions ``cache.num_tokens`` onwards are finished tokens
    to encode (``is_canvas`` False) or a canvas to denoise, with the previous
    step's ``self_conditioning`` probabilities ``[L, V]`` (None at a block's first step).
    A request's canvas placed after its finished tokens in the same forward sees them.
    """

    token_ids: torch.Tensor
    cache: PrefixKV
    is_canvas: bool
    self_conditioning: torch.Tensor | None = None


class SelfConditioning(MLP):
    """A gated MLP over the normed soft embeddings, added to the canvas's embeddings and normed again."""

    def __init__(self, config: DiffusionGemmaConfig) -> None:
        super().__init__(config.hidden_size, config.intermediate_size)
        self.eps = config.rms_norm_eps
        self.pre_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``embeds``, ``soft [L, H]`` -> ``[L, H]``."""
        return unit_rms_norm(embeds + super().forward(self.pre_norm(soft)), self.eps)


class DiffusionGemmaModel(nn.Module):
    """Parameter names follow the checkpoint's ``model.decoder.*`` (the loader maps them)."""

    def __init__(self, config: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Layer(config, spec) for spec in config.layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_conditioning = SelfConditioning(config)
        self.lm_head: nn.Linear | None = None  # None: tied to embed_tokens
        self.register_buffer("embed_scale", torch.tensor(config.embed_scale, dtype=torch.float32), persistent=False)
        for layer_type, spec in config.rope.items():
            head_dim = next(s.head_dim for s in config.layers if s.layer_type == layer_type)
            self.register_buffer(f"inv_freq_{layer_type}", rope_inv_freq(spec, head_dim), persistent=False)

    def new_cache(self) -> PrefixKV:
        window = self.config.sliding_window
        return PrefixKV(keep=tuple(window - 1 if s.is_sliding else None for s in self.config.layers))

    def _embed(self, seg: SegmentInput) -> torch.Tensor:
        embeds = self.embed_tokens(seg.token_ids) * self.embed_scale  # [T, H]
        if not seg.is_canvas:
            return embeds
        if seg.self_conditioning is None:
            soft = torch.zeros_like(embeds)
        else:
            soft = (seg.self_conditioning @ self.embed_tokens.weight) * self.embed_scale  # [L, V] @ [V, H]
        return self.self_conditioning(embeds, soft)

    @torch.inference_mode()
    def forward(self, inputs: Sequence[SegmentInput]) -> list[torch.Tensor]:
        """Run ``inputs`` in one pass; the float32 logits ``[L, V]`` of each canvas, in order.

        Finished tokens' KV is appended to their cache (and ``num_tokens`` advanced).
        """
        segments, positions, start = [], [], 0
        encoded: dict[int, int] = {}  # finished tokens of each cache in this forward, before its canvas
        for seg in inputs:
            num_rows = seg.token_ids.shape[0]
            pos = seg.cache.num_tokens + encoded.get(id(seg.cache), 0)
            if not seg.is_canvas:
                encoded[id(seg.cache)] = encoded.get(id(seg.cache), 0) + num_rows
            segments.append(Segment(slice(start, start + num_rows), pos, seg.cache, seg.is_canvas))
            positions.append(torch.arange(pos, pos + num_rows))
            start += num_rows
        x = torch.cat([self._embed(seg) for seg in inputs])  # [N, H]
        is_canvas_row = torch.cat([torch.full((s.rows.stop - s.rows.start, 1), s.is_canvas) for s in segments])
        pos = torch.cat(positions)  # [N]
        rope = {t: rope_cos_sin(getattr(self, f"inv_freq_{t}"), pos) for t in self.config.rope}
        requests: list[slice] = []  # each request's rows (its segments are adjacent)
        for seg, prev in zip(segments, [None, *segments[:-1]]):
            if prev is not None and prev.cache is seg.cache:
                requests[-1] = slice(requests[-1].start, seg.rows.stop)
            else:
                requests.append(seg.rows)
        for i, layer in enumerate(self.layers):
            cos, sin = rope[self.config.layers[i].layer_type]
            x = layer(x, cos, sin, i, segments, is_canvas_row, requests)
        for seg, inp in zip(segments, inputs):
            if not seg.is_canvas:
                inp.cache.num_tokens += seg.rows.stop - seg.rows.start
        canvases = [seg.rows for seg in segments if seg.is_canvas]
        if not canvases:
            return []
        rows = torch.cat([x[r] for r in canvases])  # [B L, H]
        head = self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight
        logits = F.linear(self.norm(rows), head).float()  # [B L, V]
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        out, at = [], 0
        for r in canvases:
            out.append(logits[at:at + r.stop - r.start])
            at += r.stop - r.start
        return out
