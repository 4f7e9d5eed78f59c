"""DiffusionGemma's checkpoint configuration and its block-diffusion sampler settings.

``config.json`` is what transformers' ``DiffusionGemmaConfig.save_pretrained``
writes: a ``text_config`` (the Gemma-4-style backbone the encoder and the
denoiser share) and ``canvas_length``. ``generation_config.json`` holds the
sampler's settings; what it leaves unset takes the reference's defaults
(``DiffusionGemmaGenerationConfig._get_default_generation_params``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

import attrs

SLIDING = "sliding_attention"
FULL = "full_attention"
#: the RoPE variants DiffusionGemma's layer types use (``modeling_rope_utils``' names)
ROPE_TYPES = ("default", "proportional")

#: the reference's defaults for what a checkpoint's generation_config.json leaves unset
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_DENOISING_STEPS = 48
DEFAULT_ENTROPY_BOUND = 0.1
DEFAULT_T_MIN = 0.4
DEFAULT_T_MAX = 0.8
DEFAULT_STABILITY_THRESHOLD = 1
DEFAULT_CONFIDENCE_THRESHOLD = 0.005


@attrs.frozen
class RopeSpec:
    """One layer type's rotary embedding: ``inv_freq`` over the layer's head dim."""

    rope_type: str
    theta: float
    #: proportional RoPE rotates this share of the head's pairs; the rest pass unrotated (inv_freq 0)
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


@attrs.frozen
class LayerSpec:
    """What differs between layers: sliding layers have their own head size, KV heads and values."""

    layer_type: str
    head_dim: int
    num_kv_heads: int

    @property
    def is_sliding(self) -> bool:
        return self.layer_type == SLIDING

    @property
    def has_v_proj(self) -> bool:
        # full-attention layers take their values from the keys' projection (attention_k_eq_v)
        return self.is_sliding


@attrs.frozen
class DiffusionGemmaConfig:
    """The text backbone and the canvas, as ``config.json`` has them."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    rms_norm_eps: float
    sliding_window: int
    final_logit_softcapping: float | None
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    canvas_length: int
    max_position_embeddings: int
    layers: tuple[LayerSpec, ...]
    rope: Mapping[str, RopeSpec]
    hidden_activation: str = "gelu_pytorch_tanh"
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def embed_scale(self) -> float:
        return self.hidden_size ** 0.5

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> DiffusionGemmaConfig:
        """Parse a ``diffusion_gemma`` config.json; ValueError on anything this backbone does not build."""
        if raw.get("model_type") != "diffusion_gemma":
            raise ValueError(f"not a DiffusionGemma checkpoint: model_type is {raw.get('model_type')!r}")
        text = raw.get("text_config") or {}
        if text.get("attention_bias"):
            raise ValueError("attention_bias is not built for DiffusionGemma (its checkpoints have none)")
        if text.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {text['hidden_activation']!r} is not built")
        if not text.get("num_experts"):
            raise ValueError("DiffusionGemma layers always carry experts: num_experts is missing")
        window = int(text.get("sliding_window", 512))
        if text.get("use_bidirectional_attention") == "all":
            raise ValueError("use_bidirectional_attention 'all' (a bidirectional encoder) is not built")
        types = list(text["layer_types"])
        types[-1] = FULL  # the reference forces the last layer to full attention
        per_layer = {int(k): v for k, v in (text.get("per_layer_config") or {}).items()}
        layers = tuple(LayerSpec(
            layer_type=t,
            head_dim=int(per_layer.get(i, {}).get("head_dim", text["head_dim"])),
            num_kv_heads=int(per_layer.get(i, {}).get("num_key_value_heads", text["num_key_value_heads"])),
        ) for i, t in enumerate(types))
        rope = {}
        for layer_type in set(types):
            params = text["rope_parameters"][layer_type]
            spec = RopeSpec(rope_type=params.get("rope_type", "default"), theta=float(params["rope_theta"]),
                            partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
                            factor=float(params.get("factor", 1.0)))
            if spec.rope_type not in ROPE_TYPES:
                raise ValueError(f"RoPE type {spec.rope_type!r} ({layer_type}) is not built; {ROPE_TYPES} are")
            if spec.rope_type == "default" and (spec.partial_rotary_factor != 1.0 or spec.factor != 1.0):
                raise ValueError(f"default RoPE with partial_rotary_factor / factor ({layer_type}) is not built")
            rope[layer_type] = spec
        eos = text.get("eos_token_id")
        return cls(
            vocab_size=int(text["vocab_size"]), hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]), num_heads=int(text["num_attention_heads"]),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), sliding_window=window,
            final_logit_softcapping=text.get("final_logit_softcapping", 30.0),
            num_experts=int(text["num_experts"]), top_k_experts=int(text["top_k_experts"]),
            moe_intermediate_size=int(text["moe_intermediate_size"]),
            canvas_length=int(raw.get("canvas_length") or 256),
            max_position_embeddings=int(text.get("max_position_embeddings", 131072)),
            layers=layers, rope=rope,
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
            pad_token_id=text.get("pad_token_id"),
        )


@attrs.frozen
class SamplerSettings:
    """The block-diffusion sampler's settings (the reference's generation config).

    At denoising step ``n`` of ``N`` (counted down from ``N`` to 1) the logits are
    divided by ``t_min + (t_max - t_min) * n / N``.
    """

    max_denoising_steps: int = DEFAULT_DENOISING_STEPS
    entropy_bound: float = DEFAULT_ENTROPY_BOUND
    t_min: float = DEFAULT_T_MIN
    t_max: float = DEFAULT_T_MAX
    stability_threshold: int = DEFAULT_STABILITY_THRESHOLD
    confidence_threshold: float = DEFAULT_CONFIDENCE_THRESHOLD
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    eos_token_ids: tuple[int, ...] = ()

    def __attrs_post_init__(self) -> None:
        if self.max_denoising_steps < 1:
            raise ValueError(f"denoising steps must be at least 1, not {self.max_denoising_steps}")
        if not self.entropy_bound > 0:
            raise ValueError(f"the entropy bound must be above 0, not {self.entropy_bound}")
        if self.t_min < 0 or not self.t_max > self.t_min:
            raise ValueError(f"the temperature schedule needs 0 <= t_min < t_max (got {self.t_min}, {self.t_max})")
        if self.stability_threshold < 0:
            raise ValueError(f"the stability threshold must be 0 or more, not {self.stability_threshold}")
        if not self.confidence_threshold > 0 or not math.isfinite(self.confidence_threshold):
            raise ValueError(f"the confidence threshold must be above 0, not {self.confidence_threshold}")

    def temperature(self, step: int) -> float:
        """The schedule's temperature at ``step`` (``N`` first, 1 last)."""
        return self.t_min + (self.t_max - self.t_min) * (step / self.max_denoising_steps)

    @classmethod
    def from_dir(cls, path: str | Path, overrides: Mapping[str, Any] | None = None) -> SamplerSettings:
        """The settings of ``generation_config.json`` (if any), the reference's defaults, then ``overrides``."""
        file = Path(path) / "generation_config.json"
        raw = json.loads(file.read_text()) if file.exists() else {}
        sampler = raw.get("sampler_config") or {}
        eos = raw.get("eos_token_id")
        found = {
            "max_denoising_steps": raw.get("max_denoising_steps"),
            "entropy_bound": sampler.get("entropy_bound") if isinstance(sampler, dict) else None,
            "t_min": raw.get("t_min"), "t_max": raw.get("t_max"),
            "stability_threshold": raw.get("stability_threshold"),
            "confidence_threshold": raw.get("confidence_threshold"),
            "max_new_tokens": raw.get("max_new_tokens"),
            "eos_token_ids": tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else None,
        }
        found.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return cls(**{k: v for k, v in found.items() if v is not None})
