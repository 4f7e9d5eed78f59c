"""The architecture description of a Llama-family decoder, independent of the file format.

Both loaders (GGUF and Hugging Face directories) reduce what they read to one
``TextModelConfig``; the model is built only from it.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

#: ``model_type`` values of config.json that this model implements.
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")

#: the mixture-of-experts architectures among them (``moe.SparseMoE`` layers)
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")

#: how a router turns its logits into expert weights (see ``moe.route``)
ROUTERS = ("softmax_topk", "topk_softmax")

#: RoPE scaling kinds the model implements (``None`` means plain RoPE).
SUPPORTED_ROPE_TYPES = ("linear", "llama3", "freq_factors")


def _freeze(value: Any) -> Any:
    """Turn lists into tuples so the frozen config stays comparable and hashable."""
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def normalize_rope_scaling(raw: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Reduce the HF ``rope_scaling`` / ``rope_parameters`` dict to ``{"rope_type": ..., ...}``.

    Returns None for plain RoPE. Raises ``NotImplementedError`` for a kind the
    model does not implement, because silently ignoring it would give wrong
    logits on long contexts.
    """
    if not raw:
        return None
    # Old configs say "type", newer ones "rope_type"; v5 nests the theta in here too.
    scaling = {k: _freeze(v) for k, v in raw.items() if k not in ("rope_theta", "type", "rope_type")}
    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"RoPE scaling {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "linear" and float(scaling.get("factor", 1.0)) == 1.0:
        return None
    return {"rope_type": rope_type, **scaling}


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


@attrs.frozen
class TextModelConfig:
    """Shapes and numerics of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM)."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    #: None, or a normalized dict (see ``normalize_rope_scaling``); excluded from hashing.
    rope_scaling: dict[str, Any] | None = attrs.field(default=None, hash=False)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    #: bias on the q/k/v projections (Qwen2 always, Llama when ``attention_bias``)
    attention_bias: bool = False
    #: bias on the output projection (Llama's ``attention_bias`` covers it, Qwen2's does not)
    attention_out_bias: bool = False
    mlp_bias: bool = False
    #: per-head RMSNorm on q and k before RoPE (Qwen3)
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    #: recorded for Mistral/Qwen2; the reference attention does not apply a window
    sliding_window: int | None = None
    #: M-RoPE (Qwen2-VL): the rotary frequency runs ``[D/2]`` rotated by temporal / height / width ids
    mrope_section: tuple[int, ...] | None = None
    #: the runs interleaved over the frequencies (Qwen3-VL) rather than contiguous
    mrope_interleaved: bool = False
    #: routed experts per sparse layer (0: every layer is a dense MLP)
    num_experts: int = 0
    #: experts each token is sent to (top-k)
    num_experts_per_tok: int = 0
    #: intermediate size of one routed expert
    moe_intermediate_size: int = 0
    #: renormalize the top-k weights to sum to one (Mixtral always; Qwen by ``norm_topk_prob``)
    norm_topk_prob: bool = False
    #: ``softmax_topk``: softmax over all experts, then top-k (Qwen, Mixtral); ``topk_softmax``:
    #: top-k of the logits, then softmax over those k
    router: str = "softmax_topk"
    #: intermediate size of Qwen2-MoE's always-on shared expert (0: none), gated by a sigmoid
    shared_expert_intermediate_size: int = 0
    #: every ``decoder_sparse_step``-th layer is sparse (layer i when ``(i + 1) % step == 0``) ...
    decoder_sparse_step: int = 1
    #: ... except these, which keep a dense MLP of ``intermediate_size``
    mlp_only_layers: tuple[int, ...] = ()

    def __attrs_post_init__(self) -> None:
        if self.num_experts:
            if self.router not in ROUTERS:
                raise ValueError(f"router must be one of {', '.join(ROUTERS)}, not {self.router!r}")
            if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size <= 0:
                raise ValueError(f"{self.num_experts_per_tok} of {self.num_experts} experts of intermediate size "
                                 f"{self.moe_intermediate_size} is not a mixture of experts")
            if self.decoder_sparse_step < 1:
                raise ValueError(f"decoder_sparse_step must be at least 1, not {self.decoder_sparse_step}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` runs a mixture of experts, by transformers' rule for Qwen-MoE."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def has_moe(self) -> bool:
        return any(self.is_sparse_layer(i) for i in range(self.num_layers))

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> TextModelConfig:
        """Build from a parsed Hugging Face ``config.json`` (llama, mistral, qwen2, qwen3 and the
        mixture-of-experts mixtral, qwen2_moe, qwen3_moe).

        Understands both the transformers 4.x keys (``rope_theta`` +
        ``rope_scaling``) and the 5.x ``rope_parameters`` dict.
        """
        arch = cfg.get("model_type", "llama")
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"model_type {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        head_dim = cfg.get("head_dim") or hidden // num_heads
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_scaling = normalize_rope_scaling(rope_params or cfg.get("rope_scaling"))

        if arch == "qwen2":
            # Qwen2 hard-codes bias on q/k/v and none on o_proj.
            qkv_bias, out_bias = True, False
        elif arch == "qwen2_moe":
            qkv_bias, out_bias = bool(cfg.get("qkv_bias", True)), False
        else:
            qkv_bias = out_bias = bool(cfg.get("attention_bias", False))
        sliding = cfg.get("sliding_window")
        if arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            attention_out_bias=out_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_tuple(cfg.get("eos_token_id")),
            sliding_window=int(sliding) if sliding else None,
            **_moe_fields(arch, cfg),
        )


def _moe_fields(arch: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of ``TextModelConfig`` from a HF config (none for dense archs)."""
    if arch not in MOE_ARCHS:
        return {}
    # transformers 5 writes Qwen3-MoE's and Mixtral's count as num_local_experts, the hub's configs num_experts
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if arch == "mixtral":
        # every layer sparse, experts of intermediate_size, the top-k weights always renormalized
        return {"num_experts": num_experts, "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
                "moe_intermediate_size": int(cfg["intermediate_size"]), "norm_topk_prob": True}
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0)
        if arch == "qwen2_moe" else 0,
        "decoder_sparse_step": int(cfg.get("decoder_sparse_step") or 1),
        "mlp_only_layers": tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    }
