"""Read a hybrid model's ``config.json`` in every spelling real checkpoints and transformers use.

- Layer patterns: Nemotron-H's ``hybrid_override_pattern`` string or its
  ``layers_block_type`` list (what transformers 5 writes), Bamba's
  ``attn_layer_indices``, Granite's ``layer_types`` / ``layers_block_type``,
  with old (``mamba``, ``attention``) and new (``linear_attention``,
  ``full_attention``) layer names.
- Infinity however JSON carries it: the bare ``Infinity`` token (Python's
  json reads it), transformers' ``{"__float__": "Infinity"}`` and strings.
- Optional fields absent or ``null``: their defaults, as transformers' own
  config classes have them.

A required field (``vocab_size``, ``hidden_size``, the layer pattern) that is
missing, or any field of the wrong kind, raises ``ConfigError`` naming it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs

from ifb_plugins.mamba.config import (ATTENTION, DELTANET, FFN_GRANITE, FFN_NONE, FFN_QWEN_MOE, FFN_SWIGLU, MAMBA,
                                      MLP, MOE, ConfigError, HybridConfig)

_REQUIRED = object()
_LAYER_NAMES = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION,
                "mlp": MLP, "moe": MOE}
_FLOAT_WORDS = {"inf": math.inf, "+inf": math.inf, "infinity": math.inf, "+infinity": math.inf,
                "-inf": -math.inf, "-infinity": -math.inf}


class Fields:
    """Typed access to a parsed config.json; every error names the field."""

    def __init__(self, cfg: Mapping[str, Any]):
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"config.json must hold a JSON object, not {type(cfg).__name__}")
        self.cfg = cfg

    def raw(self, *names: str, default: Any = _REQUIRED) -> Any:
        """The first of ``names`` present and not null (later names are older spellings)."""
        name = self.name_of(*names)
        if self.cfg.get(name) is not None:
            return self.cfg[name]
        if default is _REQUIRED:
            raise ConfigError(f"config.json: {names[0]} is missing")
        return default

    def name_of(self, *names: str) -> str:
        return next((n for n in names if self.cfg.get(n) is not None), names[0])

    def _typed(self, names: tuple[str, ...], default: Any, check) -> Any:
        """The field through ``check(value, name)``; an absent field is its default, unchecked."""
        name = self.name_of(*names)
        if self.cfg.get(name) is None:
            return self.raw(*names, default=default)
        return check(self.cfg[name], name)

    def int(self, *names: str, default: Any = _REQUIRED) -> int:
        def check(value: Any, name: str) -> int:
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"config.json: {name} must be an integer, not {value!r}")
            return value
        return self._typed(names, default, check)

    def float(self, *names: str, default: Any = _REQUIRED) -> float:
        return self._typed(names, default, to_float)

    def bool(self, *names: str, default: Any = _REQUIRED) -> bool:
        def check(value: Any, name: str) -> bool:
            if not isinstance(value, bool):
                raise ConfigError(f"config.json: {name} must be true or false, not {value!r}")
            return value
        return self._typed(names, default, check)

    def str(self, *names: str, default: Any = _REQUIRED) -> str:
        def check(value: Any, name: str) -> str:
            if not isinstance(value, str):
                raise ConfigError(f"config.json: {name} must be a string, not {value!r}")
            return value
        return self._typed(names, default, check)


def to_float(value: Any, field: str) -> float:
    """A JSON number, ``Infinity``, ``{"__float__": "Infinity"}`` or a numeric string as a float."""
    if isinstance(value, Mapping) and set(value) == {"__float__"}:
        value = value["__float__"]  # transformers' JSON encoding of inf and nan
    if isinstance(value, bool):
        raise ConfigError(f"config.json: {field} must be a number, not {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _FLOAT_WORDS:
            return _FLOAT_WORDS[word]
        try:
            return float(word)
        except ValueError:
            pass
    raise ConfigError(f"config.json: {field} must be a number, not {value!r}")


def _time_step_limit(f: Fields) -> tuple[float, float]:
    name = f.name_of("time_step_limit", "mamba_dt_limit")
    value = f.raw("time_step_limit", "mamba_dt_limit", default=None)
    if value is None:
        return 0.0, math.inf
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(f"config.json: {name} must be a [min, max] pair, not {value!r}")
    low, high = to_float(value[0], f"{name}[0]"), to_float(value[1], f"{name}[1]")
    if not 0.0 <= low <= high:
        raise ConfigError(f"config.json: {name} must satisfy 0 <= min <= max, not {value!r}")
    return low, high


def _eos_ids(f: Fields) -> tuple[int, ...]:
    value = f.raw("eos_token_id", default=2)
    values = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ConfigError(f"config.json: eos_token_id must be an integer or a list of them, not {value!r}")
    return tuple(values)


def _pattern_from_list(f: Fields, *names: str) -> str | None:
    blocks = f.raw(*names, default=None)
    if blocks is None:
        return None
    name = f.name_of(*names)
    if not isinstance(blocks, (list, tuple)) or not all(isinstance(b, str) for b in blocks):
        raise ConfigError(f"config.json: {name} must be a list of layer type names, not {blocks!r}")
    unknown = [b for b in blocks if b not in _LAYER_NAMES]
    if unknown:
        raise ConfigError(f"config.json: unknown layer type {unknown[0]!r} in {name} "
                          f"(known: {', '.join(_LAYER_NAMES)})")
    return "".join(_LAYER_NAMES[b] for b in blocks)


def _nemotron_pattern(f: Fields) -> str:
    listed = _pattern_from_list(f, "layers_block_type", "layer_types")
    string = f.str("hybrid_override_pattern", default=None)
    if string is not None and set(string) - {MAMBA, ATTENTION, MLP, MOE}:
        bad = sorted(set(string) - {MAMBA, ATTENTION, MLP, MOE})[0]
        raise ConfigError(f"config.json: unknown layer kind {bad!r} in hybrid_override_pattern {string!r}")
    if listed is not None and string is not None and listed != string:
        raise ConfigError(f"config.json: layers_block_type ({listed!r}) and hybrid_override_pattern "
                          f"({string!r}) disagree")
    pattern = listed if listed is not None else string
    if pattern is None:
        raise ConfigError("config.json has neither hybrid_override_pattern nor layers_block_type")
    return pattern


def _common(f: Fields, hidden: int, *, kv_heads: int | None, head_dim: int | None = None) -> dict[str, Any]:
    """Fields every family spells alike; ``kv_heads`` / ``head_dim`` None: the query heads / hidden per head."""
    num_heads = f.int("num_attention_heads", default=32)
    return dict(
        vocab_size=f.int("vocab_size"), hidden_size=hidden, num_heads=num_heads,
        num_kv_heads=f.int("num_key_value_heads", default=kv_heads or num_heads),
        head_dim=f.int("head_dim", default=head_dim or hidden // num_heads),
        tie_word_embeddings=f.bool("tie_word_embeddings", default=False),
        attention_bias=f.bool("attention_bias", default=False),
        mlp_bias=f.bool("mlp_bias", default=False),
        time_step_limit=_time_step_limit(f),
        bos_token_id=f.int("bos_token_id", default=1), eos_token_ids=_eos_ids(f),
    )


def _check_act(f: Fields, name: str, expected: str) -> None:
    act = f.str(name, default=expected)
    if act != expected:
        raise ConfigError(f"config.json: {name} {act!r} is not supported (this model uses {expected!r})")


def read_nemotron_h(f: Fields) -> HybridConfig:
    _check_act(f, "mlp_hidden_act", "relu2")
    _check_act(f, "mamba_hidden_act", "silu")
    hidden = f.int("hidden_size")
    pattern = _nemotron_pattern(f)
    return HybridConfig(
        family="nemotron_h", pattern=pattern, **(_nemotron_moe(f) if MOE in pattern else {}), **_common(f, hidden, kv_heads=8, head_dim=128),
        intermediate_size=f.int("intermediate_size", default=21504),
        mamba_num_heads=f.int("mamba_num_heads", default=128), mamba_head_dim=f.int("mamba_head_dim", default=64),
        ssm_state_size=f.int("ssm_state_size", default=128),
        n_groups=f.int("n_groups", "mamba_n_groups", default=8),
        conv_kernel=f.int("conv_kernel", "mamba_d_conv", default=4),
        chunk_size=f.int("chunk_size", "mamba_chunk_size", default=128),
        layer_norm_epsilon=f.float("layer_norm_epsilon", default=1e-5),
        use_conv_bias=f.bool("use_conv_bias", "mamba_conv_bias", default=True),
        mamba_proj_bias=f.bool("use_bias", default=False),  # transformers' NemotronH reads use_bias for these
        max_position_embeddings=f.int("max_position_embeddings", default=4096),
    )


def _nemotron_moe(f: Fields) -> dict[str, Any]:
    """The fields of Nemotron-H's ``E`` layers (Nemotron 3), with transformers' defaults."""
    shared = f.int("n_shared_experts", default=1)
    if shared != 1:  # transformers builds exactly one shared expert of moe_shared_expert_intermediate_size
        raise ConfigError(f"config.json: n_shared_experts {shared} is not supported (transformers builds 1)")
    if f.int("num_nextn_predict_layers", default=0):
        raise ConfigError("config.json: num_nextn_predict_layers > 0 (multi-token prediction layers) is not "
                          "supported")
    return dict(
        num_experts=f.int("n_routed_experts", "num_local_experts", default=8),
        num_experts_per_tok=f.int("num_experts_per_tok", default=2),
        moe_intermediate_size=f.int("moe_intermediate_size", default=7688),
        shared_intermediate_size=f.int("moe_shared_expert_intermediate_size", default=7688),
        moe_latent_size=f.int("moe_latent_size", default=0),
        num_expert_groups=f.int("n_group", default=1), topk_groups=f.int("topk_group", default=1),
        norm_topk_prob=f.bool("norm_topk_prob", default=True),
        routed_scaling_factor=f.float("routed_scaling_factor", default=1.0),
    )


def _mamba_fields(f: Fields, hidden: int, eps: float) -> dict[str, Any]:
    """The ``mamba_*`` spellings Bamba and Granite share."""
    heads = f.int("mamba_n_heads", default=128)
    expand = f.int("mamba_expand", default=2)
    head_dim = f.raw("mamba_d_head", default="auto")
    head_dim = expand * hidden // heads if head_dim == "auto" else f.int("mamba_d_head")
    if head_dim * heads != expand * hidden:
        raise ConfigError(f"config.json: mamba_n_heads ({heads}) * mamba_d_head ({head_dim}) must equal "
                          f"mamba_expand * hidden_size ({expand * hidden})")
    return dict(
        mamba_num_heads=heads, mamba_head_dim=head_dim, ssm_state_size=f.int("mamba_d_state", default=256),
        n_groups=f.int("mamba_n_groups", default=1), conv_kernel=f.int("mamba_d_conv", default=4),
        chunk_size=f.int("mamba_chunk_size", default=256),
        use_conv_bias=f.bool("mamba_conv_bias", default=True),
        mamba_proj_bias=f.bool("mamba_proj_bias", default=False),
        layer_norm_epsilon=f.float("rms_norm_eps", default=eps),
    )


def _rope(f: Fields, head_dim: int, partial: float = 1.0) -> dict[str, Any]:
    params = f.raw("rope_parameters", "rope_scaling", default={})
    if not isinstance(params, Mapping):
        raise ConfigError(f"config.json: rope_parameters must be an object, not {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ConfigError(f"config.json: rope_parameters.rope_type {kind!r} is not supported (only 'default')")
    theta = to_float(params.get("rope_theta", f.raw("rope_theta", default=10000.0)), "rope_parameters.rope_theta")
    factor = to_float(params.get("partial_rotary_factor", partial), "rope_parameters.partial_rotary_factor")
    return dict(rope_theta=theta, rotary_dim=int(head_dim * factor))


def read_bamba(f: Fields) -> HybridConfig:
    _check_act(f, "hidden_act", "silu")
    hidden = f.int("hidden_size")
    num_layers = f.int("num_hidden_layers", default=32)
    indices = f.raw("attn_layer_indices", default=[])
    if not isinstance(indices, (list, tuple)) or not all(isinstance(i, int) and 0 <= i < num_layers
                                                         for i in indices):
        raise ConfigError(f"config.json: attn_layer_indices must list layer indices below num_hidden_layers "
                          f"({num_layers}), not {indices!r}")
    common = _common(f, hidden, kv_heads=8)
    return HybridConfig(
        family="bamba", pattern="".join(ATTENTION if i in indices else MAMBA for i in range(num_layers)),
        **common, **_mamba_fields(f, hidden, 1e-5), intermediate_size=f.int("intermediate_size", default=14336),
        max_position_embeddings=f.int("max_position_embeddings", default=262144), ffn=FFN_SWIGLU,
        # transformers' BambaConfig rotates half of each head when the file names no factor
        **_rope(f, common["head_dim"], partial=0.5),
    )


def read_granite_hybrid(f: Fields) -> HybridConfig:
    _check_act(f, "hidden_act", "silu")
    hidden = f.int("hidden_size")
    pattern = _pattern_from_list(f, "layer_types", "layers_block_type")
    if pattern is None:
        pattern = MAMBA * f.int("num_hidden_layers", default=32)
    position = f.raw("position_embedding_type", default=None)
    if position not in (None, "nope", "rope"):
        raise ConfigError(f"config.json: position_embedding_type {position!r} is not supported "
                          "(null, 'nope' or 'rope')")
    common = _common(f, hidden, kv_heads=None)
    rope = _rope(f, common["head_dim"]) if position == "rope" else {}
    num_experts = f.int("num_local_experts", default=8)
    return HybridConfig(
        family="granitemoehybrid", pattern=pattern, **common, **_mamba_fields(f, hidden, 1e-6),
        intermediate_size=f.int("intermediate_size", default=11008),
        max_position_embeddings=f.int("max_position_embeddings", default=2048), ffn=FFN_GRANITE,
        shared_intermediate_size=f.int("shared_intermediate_size", default=1024), num_experts=num_experts,
        num_experts_per_tok=f.int("num_experts_per_tok", default=2) if num_experts else 0,
        attention_scale=f.float("attention_multiplier", default=1.0),
        embedding_multiplier=f.float("embedding_multiplier", default=1.0),
        residual_multiplier=f.float("residual_multiplier", default=1.0),
        logits_scaling=f.float("logits_scaling", default=1.0), **rope,
    )


def read_qwen3_5(f: Fields) -> HybridConfig:
    """Qwen3.5 and Qwen3.5-MoE text models (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``)."""
    _check_act(f, "hidden_act", "silu")
    hidden = f.int("hidden_size")
    listed = f.raw("layer_types", default=None)
    if listed is None:  # transformers' default: every full_attention_interval-th layer is full attention
        interval, num_layers = f.int("full_attention_interval", default=4), f.int("num_hidden_layers", default=32)
        listed = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    names = {"linear_attention": DELTANET, "full_attention": ATTENTION}
    if not isinstance(listed, (list, tuple)) or any(t not in names for t in listed):
        raise ConfigError(f"config.json: layer_types must list 'linear_attention' / 'full_attention', not {listed!r}")
    common = _common(f, hidden, kv_heads=None, head_dim=256)
    moe = f.raw("model_type") == "qwen3_5_moe_text"
    moe_fields = dict(
        ffn=FFN_QWEN_MOE, num_experts=f.int("num_experts", default=512),
        num_experts_per_tok=f.int("num_experts_per_tok", default=10),
        moe_intermediate_size=f.int("moe_intermediate_size", default=512),
        shared_intermediate_size=f.int("shared_expert_intermediate_size", default=512),
    ) if moe else dict(ffn=FFN_SWIGLU)
    return HybridConfig(
        family="qwen3_5", pattern="".join(names[t] for t in listed), **common, **moe_fields,
        intermediate_size=f.int("intermediate_size", default=12288),
        # the Mamba fields are unused; the DeltaNet conv and state shapes come from the linear_* fields
        mamba_num_heads=0, mamba_head_dim=0, ssm_state_size=0, n_groups=1,
        conv_kernel=f.int("linear_conv_kernel_dim", default=4),
        linear_num_key_heads=f.int("linear_num_key_heads", default=16),
        linear_num_value_heads=f.int("linear_num_value_heads", default=32),
        linear_key_head_dim=f.int("linear_key_head_dim", default=128),
        linear_value_head_dim=f.int("linear_value_head_dim", default=128),
        gated_attention=True, layer_norm_epsilon=f.float("rms_norm_eps", default=1e-6),
        max_position_embeddings=f.int("max_position_embeddings", default=32768),
        **_rope(f, common["head_dim"], partial=0.25),
    )


READERS = {"nemotron_h": read_nemotron_h, "bamba": read_bamba, "granitemoehybrid": read_granite_hybrid,
           "qwen3_5_text": read_qwen3_5, "qwen3_5_moe_text": read_qwen3_5}
#: image-text checkpoints: the decoder is their ``text_config``, with M-RoPE over the image grid
IMAGE_TEXT_TYPES = ("qwen3_5", "qwen3_5_moe")
#: config.json ``model_type`` values this plugin implements
SUPPORTED_MODEL_TYPES = (*READERS, *IMAGE_TEXT_TYPES)


def read_image_text(cfg: Mapping[str, Any]) -> HybridConfig:
    """``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``: the decoder of
    ``text_config`` with interleaved M-RoPE over ``rope_parameters.mrope_section``."""
    text = cfg.get("text_config")
    if not isinstance(text, Mapping) or text.get("model_type") not in READERS:
        raise ConfigError(f"config.json: text_config must be a {cfg.get('model_type')}_text config")
    config = READERS[text["model_type"]](Fields(text))
    section = (text.get("rope_parameters") or {}).get("mrope_section")
    if not isinstance(section, (list, tuple)) or not section:
        raise ConfigError("config.json: text_config.rope_parameters.mrope_section (M-RoPE) is missing")
    return attrs.evolve(config, mrope_section=tuple(int(n) for n in section))


def read_hf_config(cfg: Mapping[str, Any]) -> HybridConfig:
    """Build a ``HybridConfig`` from a parsed config.json; raises ``ConfigError`` naming the bad field."""
    f = Fields(cfg)
    model_type = cfg.get("model_type")
    if model_type in IMAGE_TEXT_TYPES:
        return read_image_text(cfg)
    if model_type not in READERS:
        raise ConfigError(f"model_type {model_type!r} is not a hybrid Mamba model this plugin implements "
                          f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return READERS[model_type](f)
