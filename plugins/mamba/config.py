"""The architecture of a hybrid Mamba-2 / attention decoder (Nemotron-H), read from config.json.

The layer pattern is a string with one character per layer: ``M`` a Mamba-2
mixer, ``*`` attention (no RoPE), ``-`` an MLP. Newer configs spell it as a
``layers_block_type`` list; both are accepted.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs

#: config.json ``model_type`` values this model implements
SUPPORTED_MODEL_TYPES = ("nemotron_h",)

MAMBA, ATTENTION, MLP = "M", "*", "-"
_BLOCK_TYPES = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION,
                "mlp": MLP, "moe": "E"}


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _pattern(cfg: Mapping[str, Any]) -> str:
    if cfg.get("hybrid_override_pattern"):
        return str(cfg["hybrid_override_pattern"])
    blocks = cfg.get("layers_block_type") or cfg.get("layer_types")
    if not blocks:
        raise ValueError("config.json has neither hybrid_override_pattern nor layers_block_type")
    unknown = [b for b in blocks if b not in _BLOCK_TYPES]
    if unknown:
        raise ValueError(f"unknown layer type {unknown[0]!r} in layers_block_type")
    return "".join(_BLOCK_TYPES[b] for b in blocks)


@attrs.frozen
class HybridConfig:
    """Shapes and numerics of a Nemotron-H style decoder (dense MLPs only)."""

    pattern: str
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int = 128
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    use_conv_bias: bool = True
    #: bias on in_proj / out_proj of the Mamba mixers (config.json ``use_bias``)
    mamba_proj_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    #: (min, max) clamp on the discretization step after softplus; (0, inf) leaves it free
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __attrs_post_init__(self) -> None:
        bad = sorted(set(self.pattern) - {MAMBA, ATTENTION, MLP})
        if "E" in bad:
            raise ValueError("mixture-of-experts layers ('E' in the layer pattern) are not supported")
        if bad:
            raise ValueError(f"unknown layer kind {bad[0]!r} in the layer pattern {self.pattern!r}")
        if self.mamba_num_heads % self.n_groups:
            raise ValueError(f"mamba_num_heads ({self.mamba_num_heads}) must be a multiple of "
                             f"n_groups ({self.n_groups})")
        if ATTENTION in self.pattern and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                             f"({self.num_kv_heads})")
        if self.conv_kernel < 2:
            raise ValueError("conv_kernel must be at least 2")

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    @property
    def mamba_intermediate(self) -> int:
        """Width of the SSM input x (and of the gate z): heads * head dim."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: x, B and C side by side."""
        return self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size

    @property
    def num_mamba_layers(self) -> int:
        return self.pattern.count(MAMBA)

    @property
    def num_attention_layers(self) -> int:
        return self.pattern.count(ATTENTION)

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> HybridConfig:
        """Build from a parsed Nemotron-H ``config.json`` (legacy ``mamba_*`` key spellings included)."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not a hybrid Mamba model this plugin implements "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        act = cfg.get("mlp_hidden_act", "relu2")
        if act != "relu2":
            raise ValueError(f"mlp_hidden_act {act!r} is not supported (Nemotron-H uses relu2)")

        def get(key: str, legacy: str, default: Any) -> Any:
            return cfg.get(key, cfg.get(legacy, default))

        num_heads = int(cfg.get("num_attention_heads", 1))
        hidden = int(cfg["hidden_size"])
        limit = get("time_step_limit", "mamba_dt_limit", (0.0, math.inf))
        return cls(
            pattern=_pattern(cfg),
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            intermediate_size=int(cfg.get("intermediate_size", 4 * hidden)),
            mamba_num_heads=int(cfg["mamba_num_heads"]),
            mamba_head_dim=int(cfg["mamba_head_dim"]),
            ssm_state_size=int(cfg["ssm_state_size"]),
            n_groups=int(get("n_groups", "mamba_n_groups", 1)),
            conv_kernel=int(get("conv_kernel", "mamba_d_conv", 4)),
            chunk_size=int(get("chunk_size", "mamba_chunk_size", 128)),
            layer_norm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            use_conv_bias=bool(get("use_conv_bias", "mamba_conv_bias", True)),
            mamba_proj_bias=bool(cfg.get("use_bias", False)),  # HF reads use_bias for these
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            time_step_limit=(float(limit[0]), float(limit[1])),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_tuple(cfg.get("eos_token_id")),
        )
