"""gpt-oss (``GptOssForCausalLM``) over the paged KV cache, as transformers defines it.

- attention: q/k/v/o with biases, RoPE (``yarn`` as the checkpoints ship it,
  or ``default``), alternating ``sliding_attention`` (a causal window of
  ``sliding_window`` tokens) and ``full_attention`` layers, and a learned
  *sink* per head: one more logit in every softmax whose probability is
  dropped, so a head may attend to nothing;
- a sparse MoE on every layer: a router with bias, the top ``k`` logits
  softmaxed (the shared layer's ``route``, ``topk_softmax``), experts whose
  fused ``gate_up_proj [E, H, 2I]`` interleaves gate and up columns, with
  biases, and a clamped SwiGLU ``(clamp(up) + 1) * g * sigmoid(alpha * g)``,
  ``g = min(gate, limit)``.

The weights run in float32; a GGUF file's experts may run on their blocks
(``gpt_oss_gguf``: MXFP4 and Q8_0 on the native kernels). The MXFP4
``quantization_config`` of a Hugging Face directory is not read. Sliding
layers attend within their window and keep only it: their caches are a KV
cache group of their own (``layer_windows``), with its own pool and block
table, whose blocks the engine frees once they lie before every future
query's window.

Shape letters: T tokens, H hidden, E experts, K experts per token, I expert width.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from ifb_plugins.common.layers.attention import AttnMetadata, GroupedAttn, layer_attn, window_start, write_kv
from ifb_plugins.common.layers.moe import dispatch_to_experts, route, sum_picks
from ifb_plugins.common.models.decoder import RMSNorm

SLIDING, FULL = "sliding_attention", "full_attention"


class GptOssConfigError(ValueError):
    """A gpt-oss config.json this decoder cannot serve; the message names the field."""


@attrs.frozen
class GptOssConfig:
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    swiglu_alpha: float
    swiglu_limit: float
    rms_norm_eps: float
    rope_theta: float
    #: ``rope_parameters`` as the file has them (``yarn`` or ``default``)
    rope: tuple[tuple[str, Any], ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    attention_bias: bool = True
    #: what computes attention: ``torch`` (``sink_attention``), ``triton`` (``layers.triton_attention``,
    #: the choice of a model built for a CUDA device) or ``native`` (``quant.kernels``, float32 on a CPU)
    attention_backend: str = "torch"

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def kv_bytes_per_token(self, element_size: int, kind: str | None = None) -> int:
        """KV bytes a context token takes in the layers of ``kind`` (None: every layer)."""
        num_layers = sum(1 for k in self.layer_types if kind is None or k == kind)
        return 2 * num_layers * self.num_kv_heads * self.head_dim * element_size

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> GptOssConfig:
        def get(name: str, default: Any = None) -> Any:
            return default if cfg.get(name) is None else cfg[name]

        if cfg.get("model_type") != "gpt_oss":
            raise GptOssConfigError(f"model_type {cfg.get('model_type')!r} is not gpt_oss")
        if "quantization_config" in cfg:
            raise GptOssConfigError("config.json: quantization_config (the MXFP4 experts) is not read; a "
                                    "float32 / bfloat16 checkpoint is")
        num_layers = int(get("num_hidden_layers", 36))
        kinds = tuple(get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)])
        if len(kinds) != num_layers or any(k not in (SLIDING, FULL) for k in kinds):
            raise GptOssConfigError(f"config.json: layer_types must list {num_layers} of {SLIDING!r} / {FULL!r}")
        rope = dict(get("rope_parameters") or get("rope_scaling") or {})
        if rope.get("rope_type", "default") not in ("default", "yarn"):
            raise GptOssConfigError(f"config.json: rope_parameters.rope_type {rope['rope_type']!r} is not "
                                    "supported (default or yarn)")
        eos = get("eos_token_id", [])
        hidden, heads = int(cfg["hidden_size"]), int(get("num_attention_heads", 64))
        return cls(
            vocab_size=int(cfg["vocab_size"]), hidden_size=hidden, num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads", 8)), head_dim=int(get("head_dim", hidden // heads)),
            layer_types=kinds, sliding_window=int(get("sliding_window", 128)),
            num_experts=int(get("num_local_experts", 128)), num_experts_per_tok=int(get("num_experts_per_tok", 4)),
            intermediate_size=int(get("intermediate_size", 2880)), swiglu_alpha=float(get("swiglu_alpha", 1.702)),
            swiglu_limit=float(get("swiglu_limit", 7.0)), rms_norm_eps=float(get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope.get("rope_theta", get("rope_theta", 150000.0))),
            rope=tuple(sorted((k, v) for k, v in rope.items() if k != "rope_theta")),
            max_position_embeddings=int(get("max_position_embeddings", 131072)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=bool(get("attention_bias", True)),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]))


def rope_frequencies(c: GptOssConfig) -> tuple[torch.Tensor, float]:
    """``(inv_freq [D/2], attention factor)``: default RoPE, or YaRN's blend of interpolated and
    extrapolated frequencies with its cos/sin scale, as transformers computes them."""
    d, base = c.head_dim, c.rope_theta
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    params = dict(c.rope)
    if params.get("rope_type", "default") == "default":
        return 1.0 / pos_freqs, 1.0
    factor = float(params["factor"])
    original = float(params["original_max_position_embeddings"])
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, D]`` rotated in halves by ``cos / sin [T, 1, D/2]`` (gpt-oss's pairing)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def sink_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttnMetadata,
                   sinks: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """Causal attention of ``q [T, Hq, D]`` over each sequence's paged context with one sink logit per
    head in the softmax (its probability dropped); within the last ``window`` positions when set."""
    out = torch.empty_like(q)
    hq, hkv, d = q.shape[1], k_cache.shape[2], k_cache.shape[3]
    start = 0
    for b, (n, ctx) in enumerate(zip(attn.query_lens_host, attn.seq_lens_host)):
        first, lo = window_start(ctx - n, window, attn.block_size)  # the blocks before are freed
        blocks = attn.block_tables[b, first:math.ceil(ctx / attn.block_size)]
        k = k_cache[blocks].reshape(-1, hkv, d)[:ctx - lo].to(q.dtype).repeat_interleave(hq // hkv, dim=1)
        v = v_cache[blocks].reshape(-1, hkv, d)[:ctx - lo].to(q.dtype).repeat_interleave(hq // hkv, dim=1)
        qb = q[start:start + n]  # [n, Hq, D]
        scores = torch.einsum("nhd,chd->hnc", qb, k) * scale  # [Hq, n, ctx - lo]
        qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        kpos = torch.arange(lo, ctx, device=q.device)[None, :]
        visible = kpos <= qpos
        if window is not None:
            visible &= kpos > qpos - window
        scores = scores.masked_fill(~visible, -math.inf)
        logits = torch.cat([scores, sinks.to(q.dtype)[:, None, None].expand(hq, n, 1)], dim=-1)
        logits = logits - logits.amax(dim=-1, keepdim=True)
        probs = torch.softmax(logits, dim=-1)[..., :-1]  # the sink's share is dropped
        out[start:start + n] = torch.einsum("hnc,chd->nhd", probs, v)
        start += n
    return out


def triton_sink_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttnMetadata,
                          sinks: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """``sink_attention`` on the Triton kernel (a CUDA device)."""
    from ifb_plugins.common.layers.triton_attention import paged_attention

    return paged_attention(q, k_cache, v_cache, attn, scale=scale, window=window, sinks=sinks)


def native_sink_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttnMetadata,
                          sinks: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """``sink_attention`` on the native CPU kernel (``quant.kernels``): every (token, head) on its own,
    no per-sequence gather of the context, blocks before the window never read."""
    from ifb_plugins.common.quant.kernels import require

    out = require().paged_attention(q, k_cache, v_cache, attn, scale=scale, window=window, sinks=sinks)
    return out.to(q.dtype)


#: ``GptOssConfig.attention_backend`` -> its attention
ATTENTION_BACKENDS = {"torch": sink_attention, "triton": triton_sink_attention, "native": native_sink_attention}


class Attention(nn.Module):
    def __init__(self, config: GptOssConfig, index: int) -> None:
        super().__init__()
        c, bias = config, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.window = c.sliding_window if c.layer_types[index] == SLIDING else None
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=bias)
        self.sinks = nn.Parameter(torch.zeros(c.num_heads))
        self.attend = ATTENTION_BACKENDS[c.attention_backend]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnMetadata | GroupedAttn,
                kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        t = x.shape[0]
        attn = layer_attn(attn, self.window)  # the table of this layer's KV cache group
        q = rope(self.q_proj(x).view(t, self.num_heads, self.head_dim), cos, sin)
        k = rope(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        write_kv(k, self.v_proj(x).view(t, self.num_kv_heads, self.head_dim), kv[0], kv[1], attn.slot_mapping)
        out = self.attend(q, kv[0], kv[1], attn, self.sinks, self.head_dim ** -0.5, self.window)
        return self.o_proj(out.reshape(t, -1))


class Experts(nn.Module):
    """gpt-oss's experts as transformers stores them (``[E, in, out]``, gate and up interleaved)."""

    def __init__(self, config: GptOssConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        self.num_experts = e
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))

    def forward(self, x: torch.Tensor, expert_id: int) -> torch.Tensor:
        gate_up = x @ self.gate_up_proj[expert_id] + self.gate_up_proj_bias[expert_id]
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return ((up + 1) * glu) @ self.down_proj[expert_id] + self.down_proj_bias[expert_id]


class Router(nn.Module):
    def __init__(self, config: GptOssConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(config.num_experts))


class MoE(nn.Module):
    def __init__(self, config: GptOssConfig, experts: nn.Module | None = None) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = Router(config)
        #: float32 ``Experts``, or experts on a GGUF's blocks (``gpt_oss_gguf.BlockExperts``)
        self.experts = Experts(config) if experts is None else experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router.weight, self.router.bias)
        weights, expert_ids = route(logits, self.top_k, normalize=False, router="topk_softmax")
        return sum_picks(dispatch_to_experts(x, weights.to(x.dtype), expert_ids, self.experts))


class DecoderLayer(nn.Module):
    def __init__(self, config: GptOssConfig, index: int, experts: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, index)
        self.mlp = MoE(config, experts)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnMetadata,
                kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssDecoder(nn.Module):
    def __init__(self, config: GptOssConfig, experts: Sequence[nn.Module] | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, None if experts is None else experts[i])
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class GptOssModel(nn.Module):
    """A gpt-oss causal LM whose forward is one paged, ragged engine step (``TextModel``'s interface)."""

    #: the attention windows the sliding layers itself: the runtime need not cap the context at the window
    applies_sliding_window = True

    def __init__(self, config: GptOssConfig, experts: Sequence[nn.Module] | None = None) -> None:
        """``experts``: each layer's routed experts (float32 ``Experts`` when None)."""
        super().__init__()
        self.config = config
        self.model = GptOssDecoder(config, experts)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, the window its KV is read in (None: the whole context): its KV cache group."""
        return tuple(self.config.sliding_window if k == SLIDING else None for k in self.config.layer_types)

    def allocate_kv_caches(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str,
                           num_window_blocks: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer its ``(k, v)`` cache; with ``num_window_blocks`` the sliding layers' hold that many blocks
        and the null block (``gemma4.Gemma4Model.allocate_kv_caches``), else every layer ``num_blocks``."""
        caches = []
        for kind in self.config.layer_types:
            rows = num_blocks if num_window_blocks is None or kind == FULL else num_window_blocks + 1
            shape = (rows, block_size, self.config.num_kv_heads, self.config.head_dim)
            caches.append((torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device)))
        return caches

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnMetadata | GroupedAttn,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step over ``input_ids [T]`` at ``positions [T]``; returns normed hidden states ``[T, H]``."""
        x = self.model.embed_tokens(input_ids) if input_embeds is None else input_embeds
        inv_freq, scale = rope_frequencies(self.config)
        angles = positions[:, None].float() * inv_freq.to(positions.device)[None, :]
        cos, sin = ((angles.cos() * scale)[:, None].to(x.dtype), (angles.sin() * scale)[:, None].to(x.dtype))
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, attn, kv)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()
