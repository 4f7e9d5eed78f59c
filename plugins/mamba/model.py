"""Hybrid Mamba-2 / attention decoder (Nemotron-H and Nemotron 3, Bamba, Granite 4.0 hybrid) driven one step at a time.

One ``forward`` runs a ragged step (prefill chunks and decode tokens packed on
a flat token axis T). Mamba layers read and advance per-seat recurrent state
in place; attention layers use a paged KV cache. Parameter names follow the
Nemotron-H layout (``backbone.layers.N.mixer.in_proj.weight``, ...); the
loader renames the other families' checkpoints onto it.

A layer is ``x + r * mixer(norm(x))``, then, in Bamba and Granite, ``x + r *
ffn(ffn_norm(x))`` (``r``: Granite's residual multiplier, else 1).

Every op is written so that a token's numbers do not depend on its batch mates
or on how its prompt was chunked (``numerics``, ``attention``, ``ssm``).
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from ifb_plugins.common.layers.attention import write_kv
from ifb_plugins.common.layers.mrope import section_rows
from ifb_plugins.common.models.decoder import RMSNorm, apply_rope
from ifb_plugins.mamba.attention import blockwise_attention
from ifb_plugins.common.layers.moe import exp_sigmoid
from ifb_plugins.mamba.config import (ATTENTION, DELTANET, FFN_GRANITE, FFN_NONE, FFN_QWEN_MOE, FFN_SWIGLU, MAMBA,
                                      MOE, RECURRENT, HybridConfig)
from ifb_plugins.mamba.deltanet import GatedDeltaNet
from ifb_plugins.mamba.ffn import GraniteFFN, ReluSquaredMLP, SwiGLU, TokenLinear
from ifb_plugins.mamba.layout import StepLayout
from ifb_plugins.mamba.mixer import Mamba2Mixer
from ifb_plugins.mamba.moe import NemotronMoE, QwenMoE
from ifb_plugins.mamba.numerics import token_linear

#: RoPE tables are built in pieces of this many positions, so a position's cos/sin never depend on how many exist
_ROPE_PIECE = 1024


@attrs.define
class HybridCache:
    """Per-seat recurrent state of every Mamba layer and the paged KV of every attention layer."""

    conv: list[torch.Tensor]  # per Mamba layer: [seats, conv_dim, K-1]
    ssm: list[torch.Tensor]  # per Mamba layer: [seats, heads, head_dim, state]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per attention layer: [blocks, block_size, Hkv, D] twice
    #: the last step's captures, per Mamba layer: capture id -> conv copy, capture id -> SSM copy
    captured: list[tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]] = attrs.field(factory=list)

    def clear_seats(self, seats: list[int]) -> None:
        """Zero the recurrent state of ``seats`` (a new request starts from nothing)."""
        if not seats or not self.conv:
            return
        index = torch.tensor(seats, dtype=torch.long, device=self.conv[0].device)
        for t in (*self.conv, *self.ssm):
            t.index_fill_(0, index, 0.0)

    def start_captures(self) -> None:
        self.captured = [({}, {}) for _ in self.conv]


def allocate_cache(config: HybridConfig, num_seats: int, num_blocks: int, block_size: int,
                   device: torch.device | str = "cpu") -> HybridCache:
    """Zeroed state for ``num_seats`` seats and a ``num_blocks``-block KV cache (float32)."""
    c = config

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float32, device=device)

    kv_shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
    return HybridCache(
        conv=[zeros(num_seats, c.conv_dim, c.conv_kernel - 1) for _ in range(c.num_recurrent_layers)],
        ssm=[zeros(num_seats, *c.state_shape) for _ in range(c.num_recurrent_layers)],
        kv=[(zeros(*kv_shape), zeros(*kv_shape)) for _ in range(c.num_attention_layers)],
    )


class Rope:
    """cos/sin of RoPE on the leading ``rotary_dim`` channels, per position, built as positions are reached.

    With ``mrope_section`` (Qwen3.5's image-text model) a token has three position ids (``mrope``) and
    each rotary column takes its angle from the row ``section_rows`` assigns it, interleaved.
    """

    def __init__(self, config: HybridConfig) -> None:
        d = config.rotary_dim
        self.rows = section_rows(config.mrope_section, d, interleaved=True) if config.mrope_section else None
        # on the CPU whatever device the model is built on (it is built on "meta" and loaded in place)
        steps = torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float()
        self.inv_freq = 1.0 / (config.rope_theta ** (steps / d))
        self.pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.table: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[T, rotary_dim]``, for ``positions [T]`` (or M-RoPE ids ``[3, T]``)."""
        needed = int(positions.max()) // _ROPE_PIECE + 1 if positions.numel() else 0
        while len(self.pieces) < needed:
            start = len(self.pieces) * _ROPE_PIECE
            pos = torch.arange(start, start + _ROPE_PIECE, dtype=torch.int64, device="cpu").float()
            freqs = pos[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self.pieces.append((emb.cos(), emb.sin()))
            self.table = None
        if self.table is None or self.table[0].device != positions.device:
            self.table = tuple(torch.cat([p[k] for p in self.pieces]).to(positions.device) for k in (0, 1))
        cos, sin = self.table
        if positions.dim() == 1:
            return cos[positions], sin[positions]
        if self.rows is None:
            raise ValueError("three-row positions for a model without M-RoPE")
        index = self.rows.to(positions.device).view(1, 1, -1).expand(1, positions.shape[1], -1)
        return cos[positions].gather(0, index)[0], sin[positions].gather(0, index)[0]  # [3, T, d] -> [T, d]


class Attention(nn.Module):
    """Grouped-query attention over the paged cache, with RoPE where the family has it.

    Qwen3.5's gated attention: ``q_proj`` gives each head's query and output gate side by side,
    q and k are RMS-normed per head before RoPE, and the output is scaled by ``sigmoid(gate)``.
    """

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        c = self.config = config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = TokenLinear(c.hidden_size, q_size * (2 if c.gated_attention else 1), bias=c.attention_bias)
        if c.gated_attention:
            self.q_norm = RMSNorm(c.head_dim, c.layer_norm_epsilon)
            self.k_norm = RMSNorm(c.head_dim, c.layer_norm_epsilon)
        self.k_proj = TokenLinear(c.hidden_size, kv_size, bias=c.attention_bias)
        self.v_proj = TokenLinear(c.hidden_size, kv_size, bias=c.attention_bias)
        self.o_proj = TokenLinear(q_size, c.hidden_size, bias=c.attention_bias)

    def _rotate(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        d = self.config.rotary_dim
        rotated = apply_rope(x[..., :d], *rope)
        return rotated if d == x.shape[-1] else torch.cat([rotated, x[..., d:]], dim=-1)

    def forward(self, x: torch.Tensor, layout: StepLayout, kv: tuple[torch.Tensor, torch.Tensor],
                rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        c = self.config
        t = x.shape[0]
        gate = None
        if c.gated_attention:
            q, gate = self.q_proj(x).view(t, c.num_heads, 2 * c.head_dim).chunk(2, dim=-1)
            q = self.q_norm(q)
            k = self.k_norm(self.k_proj(x).view(t, c.num_kv_heads, c.head_dim))
        else:
            q = self.q_proj(x).view(t, c.num_heads, c.head_dim)
            k = self.k_proj(x).view(t, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(t, c.num_kv_heads, c.head_dim)
        if rope is not None:
            q, k = self._rotate(q, rope), self._rotate(k, rope)
        k_cache, v_cache = kv
        write_kv(k, v, k_cache, v_cache, layout.attn.slot_mapping)
        out = blockwise_attention(q, k_cache, v_cache, layout.attn, layout.token_seq, layout.token_pos,
                                  scale=c.softmax_scale)
        out = out.reshape(t, c.num_heads * c.head_dim)
        if gate is not None:
            out = out * exp_sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)


_FFNS = {FFN_SWIGLU: SwiGLU, FFN_GRANITE: GraniteFFN, FFN_QWEN_MOE: QwenMoE}
_MIXERS = {MAMBA: Mamba2Mixer, DELTANET: GatedDeltaNet, ATTENTION: Attention, MOE: NemotronMoE}


class Block(nn.Module):
    """Pre-norm residual block around one mixer (Mamba, attention, MLP or MoE) and the family's feed-forward."""

    def __init__(self, config: HybridConfig, kind: str, state_index: int) -> None:
        super().__init__()
        self.kind = kind
        self.state_index = state_index  # which recurrent state / KV cache of the HybridCache this layer owns
        self.residual_multiplier = config.residual_multiplier
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        mixer = _MIXERS.get(kind, ReluSquaredMLP)
        self.mixer = mixer(config)
        if config.ffn != FFN_NONE:
            self.ffn_norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
            self.ffn = _FFNS[config.ffn](config)

    def forward(self, x: torch.Tensor, layout: StepLayout, cache: HybridCache,
                rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        h = self.norm(x)
        if self.kind in RECURRENT:
            i = self.state_index
            h = self.mixer(h, layout, cache.conv[i], cache.ssm[i], cache.captured[i])
        elif self.kind == ATTENTION:
            h = self.mixer(h, layout, cache.kv[self.state_index], rope)
        else:
            h = self.mixer(h)
        x = x + h * self.residual_multiplier
        if hasattr(self, "ffn"):
            x = x + self.ffn(self.ffn_norm(x)) * self.residual_multiplier
        return x


class Backbone(nn.Module):
    """The ``backbone.`` prefix of Nemotron-H checkpoints (``model.`` in the others, renamed on load)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        counts = {"recurrent": 0, ATTENTION: 0}
        layers = []
        for kind in config.pattern:
            key = "recurrent" if kind in RECURRENT else kind
            index = counts.get(key, 0)
            if key in counts:
                counts[key] += 1
            layers.append(Block(config, kind, index))
        self.layers = nn.ModuleList(layers)
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)


class HybridModel(nn.Module):
    """A hybrid causal LM whose forward is one ragged engine step."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.backbone = Backbone(config)
        if not config.tie_word_embeddings:
            self.lm_head = TokenLinear(config.hidden_size, config.vocab_size, bias=False)
        self.row_invariant = True
        self.rope = Rope(config) if config.rotary_dim else None

    def set_row_invariant(self, enabled: bool) -> None:
        """Per-token matmuls (batch-invariant, slower) or plain GEMMs."""
        for module in self.modules():
            if hasattr(module, "row_invariant"):
                module.row_invariant = enabled

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, H]``, scaled as the first layer takes them."""
        return self.backbone.embeddings(input_ids) * self.config.embedding_multiplier

    def forward(self, input_ids: torch.Tensor, layout: StepLayout, cache: HybridCache,
                input_embeds: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step over ``input_ids [T]``; returns normed hidden states ``[T, H]``.

        Advances the recurrent state of the step's seats, writes its K/V and
        fills ``cache.captured`` at the layout's capture points. ``input_embeds [T, H]``
        (``embed``'s, with media rows replaced) stand in for the ids' embeddings;
        ``positions`` (M-RoPE ids ``[3, T]``) for the layout's token positions.
        """
        cache.start_captures()
        rope = None
        if self.rope is not None:
            rope = self.rope(layout.token_pos if positions is None else positions)
        x = self.embed(input_ids) if input_embeds is None else input_embeds
        for layer in self.backbone.layers:
            x = layer(x, layout, cache, rope)
        return self.backbone.norm_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states ``[N, H]`` to float32 logits ``[N, V]``."""
        if self.config.tie_word_embeddings:
            weight = self.backbone.embeddings.weight
        else:
            weight = self.lm_head.weight
        return token_linear(hidden, weight, None, self.row_invariant).float() / self.config.logits_scaling
