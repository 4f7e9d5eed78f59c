"""The architecture of a hybrid Mamba-2 / attention decoder, whatever family wrote it.

One layer pattern character per layer: ``M`` a Mamba-2 mixer, ``*``
attention, ``-`` an MLP, ``E`` a mixture of experts (MLP and experts:
Nemotron-H only; Nemotron 3 is Nemotron-H with ``E`` layers), ``L`` a Gated
DeltaNet linear-attention layer (Qwen3.5, whose ``*`` layers are gated
attention). Nemotron-H layers hold one mixer
each; Bamba and Granite 4.0 hybrid layers hold a mixer and a feed-forward
(``ffn``) side by side. ``ifb_plugins.mamba.hf_config`` reads the
``config.json`` spellings of each family into this.
"""

from __future__ import annotations

import math

import attrs

MAMBA, ATTENTION, MLP, MOE, DELTANET = "M", "*", "-", "E", "L"
#: the layers that hold recurrent state per seat (a conv window and a state matrix)
RECURRENT = (MAMBA, DELTANET)

#: the feed-forward after each mixer: none (Nemotron-H), SwiGLU (Bamba, Qwen3.5), shared MLP + sparse MoE
#: (Granite), routed experts + gated shared expert (Qwen3.5-MoE)
FFN_NONE, FFN_SWIGLU, FFN_GRANITE, FFN_QWEN_MOE = "none", "swiglu", "granite", "qwen_moe"


class ConfigError(ValueError):
    """A config.json this plugin cannot read; the message names the field."""


@attrs.frozen
class HybridConfig:
    """Shapes and numerics of a hybrid decoder."""

    family: str
    pattern: str
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    #: Nemotron-H MLP layers and Bamba's SwiGLU; Granite: each routed expert
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
    #: bias on in_proj / out_proj of the Mamba mixers
    mamba_proj_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    #: (min, max) clamp on the discretization step after softplus; (0, inf) leaves it free
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    ffn: str = FFN_NONE
    #: Granite's shared MLP width, its routed experts and how many each token uses (0: dense)
    shared_intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    #: Nemotron-H ``E`` layers: each routed expert's width, the latent the experts run in (0: none),
    #: the group-limited sigmoid router's groups, the groups kept per token and its weight scaling
    moe_intermediate_size: int = 0
    moe_latent_size: int = 0
    num_expert_groups: int = 1
    topk_groups: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    #: Gated DeltaNet layers (Qwen3.5): key / value heads and their widths
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    #: Qwen3.5's attention: a sigmoid output gate (q_proj gives query and gate per head) and q/k RMSNorms
    gated_attention: bool = False
    #: RoPE on the leading ``rotary_dim`` channels of each head (0: no position embedding)
    rotary_dim: int = 0
    rope_theta: float = 10000.0
    #: Qwen3.5's image-text model: interleaved M-RoPE over these runs of rotary frequencies (empty: plain RoPE)
    mrope_section: tuple[int, ...] = ()
    #: attention logit scale (None: 1/sqrt(head_dim))
    attention_scale: float | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    #: logits are divided by this
    logits_scaling: float = 1.0

    def __attrs_post_init__(self) -> None:
        bad = sorted(set(self.pattern) - {MAMBA, ATTENTION, MLP, MOE, DELTANET})
        if bad:
            raise ConfigError(f"unknown layer kind {bad[0]!r} in the layer pattern {self.pattern!r}")
        if not self.pattern:
            raise ConfigError("the layer pattern is empty: the model has no layers")
        if self.ffn != FFN_NONE and (MLP in self.pattern or MOE in self.pattern):
            raise ConfigError(f"{self.family} layers are Mamba or attention; the pattern {self.pattern!r} has "
                              "MLP or MoE layers")
        if MOE in self.pattern:
            self._check_moe_layers()
        if MAMBA in self.pattern and DELTANET in self.pattern:
            raise ConfigError(f"the layer pattern {self.pattern!r} mixes Mamba and DeltaNet layers")
        if DELTANET in self.pattern and (not self.linear_num_key_heads or
                                         self.linear_num_value_heads % self.linear_num_key_heads):
            raise ConfigError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                              f"linear_num_key_heads ({self.linear_num_key_heads})")
        if MAMBA in self.pattern and self.mamba_num_heads % self.n_groups:
            raise ConfigError(f"mamba_num_heads ({self.mamba_num_heads}) must be a multiple of "
                              f"n_groups ({self.n_groups})")
        if ATTENTION in self.pattern and self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.conv_kernel < 2:
            raise ConfigError("conv_kernel must be at least 2")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(f"the rotary width {self.rotary_dim} must be even and at most head_dim "
                              f"({self.head_dim})")
        if self.mrope_section and 2 * sum(self.mrope_section) != self.rotary_dim:
            raise ConfigError(f"mrope_section {list(self.mrope_section)} must sum to half the rotary width "
                              f"({self.rotary_dim})")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                              f"num_local_experts ({self.num_experts})")

    def _check_moe_layers(self) -> None:
        if not self.num_experts or not self.moe_intermediate_size:
            raise ConfigError("the layer pattern has MoE layers ('E') but n_routed_experts or "
                              "moe_intermediate_size is 0")
        if self.num_experts % self.num_expert_groups:
            raise ConfigError(f"n_routed_experts ({self.num_experts}) must be a multiple of n_group "
                              f"({self.num_expert_groups})")
        per_group = self.num_experts // self.num_expert_groups
        if per_group < 2:  # the router ranks each group by its two best experts
            raise ConfigError(f"n_group ({self.num_expert_groups}) leaves fewer than 2 experts per group")
        if not 0 < self.topk_groups <= self.num_expert_groups:
            raise ConfigError(f"topk_group ({self.topk_groups}) must be between 1 and n_group "
                              f"({self.num_expert_groups})")
        if self.num_experts_per_tok > self.topk_groups * per_group:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of the "
                              f"topk_group ({self.topk_groups}) groups a token may use")

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    @property
    def mamba_intermediate(self) -> int:
        """Width of the SSM input x (and of the gate z): heads * head dim."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: x, B and C side by side (DeltaNet: q, k and v)."""
        if DELTANET in self.pattern:
            return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_value_dim
        return self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """One seat's recurrent state per recurrent layer: Mamba's ``[heads, head_dim, state]``,
        DeltaNet's ``[value heads, key head dim, value head dim]``."""
        if DELTANET in self.pattern:
            return self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim
        return self.mamba_num_heads, self.mamba_head_dim, self.ssm_state_size

    @property
    def num_recurrent_layers(self) -> int:
        """Layers with per-seat recurrent state (Mamba or DeltaNet)."""
        return sum(self.pattern.count(kind) for kind in RECURRENT)

    @property
    def num_mamba_layers(self) -> int:
        return self.pattern.count(MAMBA)

    @property
    def num_attention_layers(self) -> int:
        return self.pattern.count(ATTENTION)

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else 1.0 / math.sqrt(self.head_dim)

    @classmethod
    def from_hf_config(cls, cfg) -> HybridConfig:
        """Build from a parsed ``config.json`` of any supported family (see ``hf_config``)."""
        from ifb_plugins.mamba.hf_config import read_hf_config

        return read_hf_config(cfg)
