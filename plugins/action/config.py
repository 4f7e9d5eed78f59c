"""pi0's configuration as transformers saves it (``config.json`` of ``PI0ForConditionalGeneration``).

Defaults are transformers' own (``PI0Config`` and its PaliGemma / Gemma sub-configs) for the keys a
config leaves out.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from ifb_plugins.common.media.vision import VisionConfig


@attrs.frozen
class GemmaConfig:
    """One Gemma stack: the PaliGemma language model, or the action expert (pi0's DiT)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    hidden_act: str = "gelu_pytorch_tanh"
    vocab_size: int = 0
    #: read by ``ifb_plugins.common.models.decoder.rope_inv_freq``: Gemma's rotary is unscaled
    rope_scaling: None = None

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], defaults: Mapping[str, Any]) -> GemmaConfig:
        cfg = {**defaults, **cfg}
        heads = int(cfg.get("num_attention_heads", 8))
        hidden = int(cfg["hidden_size"])
        rope = cfg.get("rope_parameters") or {}
        act = cfg.get("hidden_act") or "gelu_pytorch_tanh"
        return cls(
            hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            hidden_act=str(act), vocab_size=int(cfg.get("vocab_size", 0)),
        )


#: ``PI0Config.sub_configs_defaults``: what transformers fills in for a sub-config's missing keys
_VLM_TEXT_DEFAULTS = {"hidden_size": 2048, "num_hidden_layers": 18, "intermediate_size": 16384,
                      "num_attention_heads": 8, "num_key_value_heads": 1, "vocab_size": 257152, "head_dim": 256}
_VISION_DEFAULTS = {"model_type": "siglip_vision_model", "intermediate_size": 4304, "hidden_size": 1152,
                    "patch_size": 14, "image_size": 224, "num_hidden_layers": 27, "num_attention_heads": 16}
_DIT_DEFAULTS = {"hidden_size": 1024, "num_hidden_layers": 18, "intermediate_size": 4096, "num_attention_heads": 8,
                 "num_key_value_heads": 1, "head_dim": 256}


@attrs.frozen
class Pi0Config:
    """The backbone (SigLIP tower, projector, Gemma), the action expert and the sampler's settings."""

    text: GemmaConfig
    vision: VisionConfig
    expert: GemmaConfig
    image_token_id: int
    #: actions planned per request (rows of ``output_trajectory``)
    chunk_size: int = 50
    max_state_dim: int = 32
    #: values per planned action (columns of ``output_trajectory``)
    max_action_dim: int = 32
    #: Euler steps of the flow-matching sampler
    num_inference_steps: int = 10
    min_period: float = 4e-3
    max_period: float = 4.0

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> Pi0Config:
        if cfg.get("model_type") != "pi0":
            raise ValueError(f"not a pi0 checkpoint (model_type {cfg.get('model_type')!r}, expected 'pi0')")
        vlm = cfg.get("vlm_config") or {}
        text = GemmaConfig.from_hf(vlm.get("text_config") or {}, _VLM_TEXT_DEFAULTS)
        vision = VisionConfig.from_hf({**_VISION_DEFAULTS, **(vlm.get("vision_config") or {})},
                                      default_type="siglip_vision_model")
        expert = GemmaConfig.from_hf(cfg.get("dit_config") or {}, _DIT_DEFAULTS)
        if (expert.num_layers, expert.num_kv_heads, expert.head_dim) != (text.num_layers, text.num_kv_heads,
                                                                         text.head_dim):
            raise ValueError("the action expert attends to the backbone's KV layer by layer: its layers, KV heads "
                             f"and head size ({expert.num_layers}, {expert.num_kv_heads}, {expert.head_dim}) must "
                             f"equal the backbone's ({text.num_layers}, {text.num_kv_heads}, {text.head_dim})")
        image_token = vlm.get("image_token_id", vlm.get("image_token_index", 257152))
        return cls(
            text=text, vision=vision, expert=expert, image_token_id=int(image_token),
            chunk_size=int(cfg.get("chunk_size", 50)), max_state_dim=int(cfg.get("max_state_dim", 32)),
            max_action_dim=int(cfg.get("max_action_dim", 32)),
            num_inference_steps=int(cfg.get("num_inference_steps", 10)),
            min_period=float(cfg.get("min_period", 4e-3)), max_period=float(cfg.get("max_period", 4.0)),
        )
