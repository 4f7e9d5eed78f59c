"""Gemma 4's text decoder (``Gemma4ForCausalLM``) over the paged KV cache, as transformers defines it.

What sets it apart from the Llama-family ``decoder.TextModel`` (hence a family
module of its own):

- two layer types with their own shapes: ``sliding_attention`` layers
  (``head_dim``, ``num_key_value_heads``, a causal window of
  ``sliding_window`` tokens, default RoPE) and ``full_attention`` layers
  (``per_layer_config``: a wider ``head_dim``, their own KV heads,
  ``proportional`` RoPE on a fraction of each head; with
  ``attention_k_eq_v`` the values are the keys' projection);
- q / k RMSNorms with scale, a scale-free v norm, attention scaling 1;
- KV sharing: the last ``num_kv_shared_layers`` layers compute no K/V and read
  the cache of the last earlier layer of their type (its ``store`` layer);
  their MLPs are twice as wide with ``use_double_wide_mlp``;
- per-layer inputs (PLE): a second embedding table and a projection of the
  input embedding give every layer a small input, gated into its residual;
- four norms around attention and MLP, a per-layer ``layer_scalar``,
  embeddings scaled by ``sqrt(hidden)``, and final logit soft-capping
  (``cap * tanh(logits / cap)``).

Sliding-window layers attend within their window and keep only it: their
caches are a KV cache group of their own (``layer_windows``; the engine frees
each block once it lies before every future query's window), with its own
pool (``allocate_kv_caches``' ``num_window_blocks``) and block table
(``layers.attention.GroupedAttn``), so a long context costs what the global
layers need plus the window.

Shape letters: T tokens in the step, H hidden, L layers, P per-layer input width.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from ifb_plugins.common.layers.attention import AttnMetadata, GroupedAttn, layer_attn, window_start, write_kv

SLIDING, FULL = "sliding_attention", "full_attention"


class Gemma4ConfigError(ValueError):
    """A Gemma 4 config.json this decoder cannot serve; the message names the field."""


@attrs.frozen
class LayerShape:
    """One attention layer's shapes and RoPE."""

    kind: str
    head_dim: int
    num_kv_heads: int
    rope_theta: float
    #: the rotated fraction of each head (``proportional`` RoPE; 1.0: all of it)
    rotary_fraction: float
    #: the index of the layer whose KV this one reads (itself unless KV-shared)
    kv_source: int
    values_are_keys: bool
    mlp_width: int


@attrs.frozen
class Gemma4Config:
    vocab_size: int
    hidden_size: int
    num_heads: int
    layers: tuple[LayerShape, ...]
    sliding_window: int
    rms_norm_eps: float
    per_layer_input_size: int
    per_layer_vocab_size: int
    final_logit_softcapping: float | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    attention_bias: bool = False
    #: what computes attention: ``torch`` (``windowed_attention``), ``triton`` (``layers.triton_attention``,
    #: the choice of a model built for a CUDA device) or ``native`` (``quant.kernels``, float32 on a CPU)
    attention_backend: str = "torch"
    #: the token a media placeholder reads as for the per-layer inputs (the image-text model)
    pad_token_id: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that hold a KV cache (every layer that is not KV-shared)."""
        return tuple(i for i, s in enumerate(self.layers) if s.kv_source == i)

    def kv_bytes_per_token(self, element_size: int, kind: str | None = None) -> int:
        """KV bytes a context token takes in the layers of ``kind`` (None: every layer)."""
        return sum(2 * self.layers[i].num_kv_heads * self.layers[i].head_dim * element_size for i in self.kv_layers
                   if kind is None or self.layers[i].kind == kind)

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> Gemma4Config:
        return read_gemma4_config(cfg)


def read_gemma4_config(cfg: Mapping[str, Any]) -> Gemma4Config:
    """``config.json`` of a ``gemma4_text`` model; unsupported variants raise naming the field."""
    def get(name: str, default: Any = None) -> Any:
        value = cfg.get(name)
        return default if value is None else value

    if cfg.get("model_type") != "gemma4_text":
        raise Gemma4ConfigError(f"model_type {cfg.get('model_type')!r} is not gemma4_text")
    if get("enable_moe_block", False):
        raise Gemma4ConfigError("config.json: enable_moe_block (Gemma 4's mixture-of-experts layers) is not served")
    if get("use_bidirectional_attention") == "all":
        raise Gemma4ConfigError("config.json: use_bidirectional_attention 'all' is not served (a causal LM here)")
    if get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise Gemma4ConfigError(f"config.json: hidden_activation {cfg['hidden_activation']!r} is not supported")
    num_layers = int(get("num_hidden_layers", 30))
    kinds = list(get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)])
    if any(k not in (SLIDING, FULL) for k in kinds) or len(kinds) != num_layers:
        raise Gemma4ConfigError(f"config.json: layer_types must list {num_layers} of {SLIDING!r} / {FULL!r}")
    kinds[-1] = FULL  # as transformers' config forces it
    rope = get("rope_parameters", {})
    per_layer = {int(k): v for k, v in (get("per_layer_config") or {}).items()}
    shared = int(get("num_kv_shared_layers", 0))
    first_shared = num_layers - shared
    k_eq_v = bool(get("attention_k_eq_v", False))
    intermediate = int(get("intermediate_size", 9216))
    layers = []
    for i, kind in enumerate(kinds):
        params = rope.get(kind) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type not in ("default", "proportional") or float(params.get("factor", 1.0)) != 1.0:
            raise Gemma4ConfigError(f"config.json: rope_parameters.{kind} {params!r} is not supported "
                                    "(default, or proportional without a factor)")
        over = per_layer.get(i, {})
        if i < first_shared:
            source = i
        else:  # the last earlier layer of this type produces the KV
            earlier = [j for j in range(first_shared) if kinds[j] == kind]
            if not earlier:
                raise Gemma4ConfigError(f"config.json: num_kv_shared_layers ({shared}) leaves no {kind} layer to "
                                        f"share KV from")
            source = earlier[-1]
        double = bool(get("use_double_wide_mlp", False)) and i >= first_shared
        layers.append(LayerShape(
            kind=kind, head_dim=int(over.get("head_dim", get("head_dim", 256))),
            num_kv_heads=int(over.get("num_key_value_heads", get("num_key_value_heads", 4))),
            rope_theta=float(params.get("rope_theta", 10000.0)),
            rotary_fraction=float(params.get("partial_rotary_factor", 1.0)) if rope_type == "proportional" else 1.0,
            kv_source=source, values_are_keys=k_eq_v and kind == FULL, mlp_width=intermediate * (2 if double else 1)))
    eos = get("eos_token_id", 1)
    return Gemma4Config(
        vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        num_heads=int(get("num_attention_heads", 8)), layers=tuple(layers),
        sliding_window=int(get("sliding_window", 512)), rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        per_layer_input_size=int(get("hidden_size_per_layer_input", 0)),
        per_layer_vocab_size=int(get("vocab_size_per_layer_input", cfg["vocab_size"])),
        final_logit_softcapping=get("final_logit_softcapping"),
        max_position_embeddings=int(get("max_position_embeddings", 131072)),
        tie_word_embeddings=bool(get("tie_word_embeddings", True)), attention_bias=bool(get("attention_bias", False)),
        pad_token_id=int(get("pad_token_id", 0)),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]))


class Norm(nn.Module):
    """Gemma 4's RMSNorm: ``x * (mean(x^2) + eps)^-1/2``, times ``weight`` when it has one."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (h if self.weight is None else h * self.weight.float()).to(x.dtype)


def inv_freq(shape: LayerShape) -> torch.Tensor:
    """Inverse frequencies ``[D/2]``; proportional RoPE rotates the leading fraction, the rest stays put."""
    d = shape.head_dim
    angles = int(shape.rotary_fraction * d // 2)
    rotated = 1.0 / (shape.rope_theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / d))
    return torch.cat([rotated, torch.zeros(d // 2 - angles)])


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, D]`` rotated (rotate-half convention) by ``cos / sin [T, 1, D]``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def windowed_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttnMetadata,
                       window: int | None) -> torch.Tensor:
    """Causal attention (scale 1) of ``q [T, Hq, D]`` over each sequence's paged context, only over the
    last ``window`` positions (itself included) when ``window`` is set. Returns ``[T, Hq, D]``."""
    out = torch.empty_like(q)
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    start = 0
    for b, (n, ctx) in enumerate(zip(attn.query_lens_host, attn.seq_lens_host)):
        first, lo = window_start(ctx - n, window, attn.block_size)
        blocks = attn.block_tables[b, first:math.ceil(ctx / attn.block_size)]
        k = k_cache[blocks].reshape(-1, hkv, d)[:ctx - lo].transpose(0, 1).to(q.dtype)  # [Hkv, ctx - lo, D]
        v = v_cache[blocks].reshape(-1, hkv, d)[:ctx - lo].transpose(0, 1).to(q.dtype)
        qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        kpos = torch.arange(lo, ctx, device=q.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        qb = q[start:start + n].transpose(0, 1)[None]  # [1, Hq, n, D]
        o = F.scaled_dot_product_attention(qb, k[None], v[None], attn_mask=mask, scale=1.0, enable_gqa=True)
        out[start:start + n] = o[0].transpose(0, 1)
        start += n
    return out


def triton_windowed_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttnMetadata,
                              window: int | None) -> torch.Tensor:
    """``windowed_attention`` on the Triton kernel (a CUDA device)."""
    from ifb_plugins.common.layers.triton_attention import paged_attention

    return paged_attention(q, k_cache, v_cache, attn, scale=1.0, window=window)


def native_windowed_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttnMetadata,
                              window: int | None) -> torch.Tensor:
    """``windowed_attention`` on the native CPU kernel (``quant.kernels``); blocks before the window
    are never read."""
    from ifb_plugins.common.quant.kernels import require

    return require().paged_attention(q, k_cache, v_cache, attn, scale=1.0, window=window).to(q.dtype)


#: ``Gemma4Config.attention_backend`` -> its attention
ATTENTION_BACKENDS = {"torch": windowed_attention, "triton": triton_windowed_attention,
                      "native": native_windowed_attention}


class Attention(nn.Module):
    def __init__(self, config: Gemma4Config, index: int) -> None:
        super().__init__()
        s = self.shape = config.layers[index]
        self.index = index
        self.window = config.sliding_window if s.kind == SLIDING else None
        h, bias, eps = config.hidden_size, config.attention_bias, config.rms_norm_eps
        self.num_heads = config.num_heads
        self.q_proj = nn.Linear(h, config.num_heads * s.head_dim, bias=bias)
        self.q_norm = Norm(s.head_dim, eps)
        self.o_proj = nn.Linear(config.num_heads * s.head_dim, h, bias=bias)
        self.computes_kv = s.kv_source == index
        if self.computes_kv:
            self.k_proj = nn.Linear(h, s.num_kv_heads * s.head_dim, bias=bias)
            self.v_proj = None if s.values_are_keys else nn.Linear(h, s.num_kv_heads * s.head_dim, bias=bias)
            self.k_norm = Norm(s.head_dim, eps)
            self.v_norm = Norm(s.head_dim, eps, with_scale=False)
        self.attend = ATTENTION_BACKENDS[config.attention_backend]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnMetadata | GroupedAttn,
                kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        t, s = x.shape[0], self.shape
        attn = layer_attn(attn, self.window)  # the table of this layer's KV cache group
        q = rope(self.q_norm(self.q_proj(x).view(t, self.num_heads, s.head_dim)), cos, sin)
        if self.computes_kv:  # a KV-shared layer reads what its source layer wrote this step
            k = self.k_proj(x).view(t, s.num_kv_heads, s.head_dim)
            v = k if self.v_proj is None else self.v_proj(x).view(t, s.num_kv_heads, s.head_dim)
            write_kv(rope(self.k_norm(k), cos, sin), self.v_norm(v), kv[0], kv[1], attn.slot_mapping)
        out = self.attend(q, kv[0], kv[1], attn, self.window)
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: Gemma4Config, index: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, index)
        self.mlp = MLP(h, config.layers[index].mlp_width)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, Norm(h, eps))
        self.register_buffer("layer_scalar", torch.ones(1))
        self.has_per_layer_input = bool(config.per_layer_input_size)
        if self.has_per_layer_input:
            self.per_layer_input_gate = nn.Linear(h, config.per_layer_input_size, bias=False)
            self.per_layer_projection = nn.Linear(config.per_layer_input_size, h, bias=False)
            self.post_per_layer_input_norm = Norm(h, eps)

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttnMetadata, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, attn, kv))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if self.has_per_layer_input:
            gate = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return x * self.layer_scalar


class Gemma4Decoder(nn.Module):
    """The ``model.`` prefix of the checkpoint."""

    def __init__(self, config: Gemma4Config) -> None:
        super().__init__()
        h, p = config.hidden_size, config.per_layer_input_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = Norm(h, config.rms_norm_eps)
        if p:
            self.embed_tokens_per_layer = nn.Embedding(config.per_layer_vocab_size, config.num_layers * p)
            self.per_layer_model_projection = nn.Linear(h, config.num_layers * p, bias=False)
            self.per_layer_projection_norm = Norm(p, config.rms_norm_eps)


class Gemma4Model(nn.Module):
    """A Gemma 4 causal LM whose forward is one paged, ragged engine step (``TextModel``'s interface,
    with its own KV layout: ``allocate_kv_caches``)."""

    #: the attention windows the sliding layers itself: the runtime need not cap the context at the window
    applies_sliding_window = True

    def __init__(self, config: Gemma4Config, media_token_ids: tuple[int, ...] = ()) -> None:
        """``media_token_ids``: the image-text model's media placeholders (none for the text model)."""
        super().__init__()
        self.config = config
        self.media_token_ids = tuple(media_token_ids)
        self.model = Gemma4Decoder(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._rope: dict[int, torch.Tensor] = {}

    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, the window its KV is read in (None: the whole context): its KV cache group."""
        return tuple(self.config.sliding_window if s.kind == SLIDING else None for s in self.config.layers)

    def allocate_kv_caches(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str,
                           num_window_blocks: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per layer: its ``(k, v)`` cache ``[blocks, block_size, Hkv, D]``, or None for a KV-shared layer.

        With ``num_window_blocks`` the sliding layers are a group of their own: that many blocks and one
        more, the null block their tables' freed entries name; without it every layer has ``num_blocks``
        under one table."""
        caches: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for i, s in enumerate(self.config.layers):
            rows = num_blocks if num_window_blocks is None or s.kind == FULL else num_window_blocks + 1
            shape = (rows, block_size, s.num_kv_heads, s.head_dim)
            caches.append((torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype,
                                                                                        device=device))
                          if s.kv_source == i else None)
        return caches

    def _cos_sin(self, layer: int, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = inv_freq(self.config.layers[layer]).to(positions.device)
        angles = positions[:, None].float() * freqs[None, :]
        emb = torch.cat((angles, angles), dim=-1)[:, None, :]  # [T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input rows ``[T, H]``: token embeddings scaled by ``sqrt(hidden)``."""
        emb = self.model.embed_tokens(input_ids)
        return emb * torch.tensor(self.config.hidden_size ** 0.5, dtype=emb.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnMetadata | GroupedAttn,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor] | None],
                input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step over ``input_ids [T]`` at ``positions [T]``; returns normed hidden states ``[T, H]``.

        ``input_embeds [T, H]`` replace the first layer's input (``embed``'s rows with media rows replaced
        by their projected features, as the image-text model's ``masked_scatter`` places them). The
        per-layer inputs project those rows, and take their token part from the ids, a media placeholder
        (``media_token_ids``) read as the pad token, as transformers computes them.
        """
        c, m = self.config, self.model
        if self.media_token_ids:
            is_media = torch.isin(input_ids, torch.tensor(self.media_token_ids, device=input_ids.device))
            input_ids = input_ids.masked_fill(is_media, c.pad_token_id)
        x = self.embed(input_ids) if input_embeds is None else input_embeds
        per_layer = None
        if c.per_layer_input_size:
            p, t = c.per_layer_input_size, x.shape[0]
            tokens = m.embed_tokens_per_layer(input_ids) * torch.tensor(p ** 0.5, dtype=x.dtype)
            projected = m.per_layer_model_projection(x) * c.hidden_size ** -0.5
            projected = m.per_layer_projection_norm(projected.view(t, c.num_layers, p))
            per_layer = (projected + tokens.view(t, c.num_layers, p)) * 2.0 ** -0.5  # [T, L, P]
        tables = {}
        for i, layer in enumerate(m.layers):
            s = c.layers[i]
            key = (s.head_dim, s.rope_theta, s.rotary_fraction)
            if key not in tables:
                tables[key] = self._cos_sin(i, positions, x.dtype)
            x = layer(x, None if per_layer is None else per_layer[:, i], *tables[key], attn,
                      kv_caches[s.kv_source])
        return m.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[N, V]``, soft-capped where the config says."""
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        logits = F.linear(hidden, weight).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
