"""The hybrid families' mixture-of-experts layers, as transformers defines them.

``NemotronMoE``: Nemotron-H's ``E`` layers (Nemotron 3).
A layer is a group-limited sigmoid router (``gate``: weight and score
correction bias), routed experts without a gate (``down(relu(up(x))^2)``),
optionally run in a smaller latent (``fc1_latent_proj`` / ``fc2_latent_proj``),
plus one always-on shared expert of the same kind on the layer's input. The
router and the dispatch are the shared layer's (``ifb_plugins.common.layers.moe``);
here every matmul runs per token (``token_linear``), so a token's output does
not depend on its batch mates or how many rows an expert got.

``QwenMoE``: Qwen3.5-MoE's feed-forward (Qwen3-Next's): softmax top-k routing
renormalized over the chosen experts, SwiGLU experts, and a shared SwiGLU
expert scaled by ``sigmoid(shared_expert_gate(x))``; the shared layer's
``route`` and ``ExpertWeights``, again on per-token matmuls.
"""

from __future__ import annotations

import torch
from torch import nn

from ifb_plugins.common.layers.moe import (ExpertWeights, UngatedExperts, dispatch_to_experts, exp_sigmoid, route,
                                           route_grouped_sigmoid, sum_picks)
from ifb_plugins.mamba.config import HybridConfig
from ifb_plugins.mamba.ffn import ReluSquaredMLP, SwiGLU, TokenLinear
from ifb_plugins.mamba.numerics import silu, token_linear


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x).square()


class TopkRouter(nn.Module):
    """``weight [E, H]`` and ``e_score_correction_bias [E]``, as the checkpoint names them."""

    row_invariant = True

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.empty(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        logits = token_linear(x.float(), self.weight.float(), None, self.row_invariant)
        return route_grouped_sigmoid(logits, self.e_score_correction_bias, c.num_experts_per_tok,
                                     num_groups=c.num_expert_groups, topk_groups=c.topk_groups,
                                     normalize=c.norm_topk_prob, scaling=c.routed_scaling_factor)


class NemotronMoE(nn.Module):
    row_invariant = True

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        h, latent = config.hidden_size, config.moe_latent_size
        self.gate = TopkRouter(config)
        self.experts = UngatedExperts(config.num_experts, latent or h, config.moe_intermediate_size, relu_squared,
                                      linear=self._linear)
        self.shared_experts = ReluSquaredMLP(config, intermediate_size=config.shared_intermediate_size)
        self.fc1_latent_proj = TokenLinear(h, latent, bias=config.mlp_bias) if latent else None
        self.fc2_latent_proj = TokenLinear(latent, h, bias=config.mlp_bias) if latent else None

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return token_linear(x, weight, None, self.row_invariant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(x)  # [T, K]
        routed = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        y = sum_picks(dispatch_to_experts(routed, weights, expert_ids, self.experts))
        if self.fc2_latent_proj is not None:
            y = self.fc2_latent_proj(y)
        return y + self.shared_experts(x)


class QwenMoE(nn.Module):
    row_invariant = True

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.gate = TokenLinear(h, config.num_experts, bias=False)
        self.experts = ExpertWeights(config.num_experts, h, config.moe_intermediate_size, linear=self._linear,
                                     silu=silu)
        self.shared_expert = SwiGLU(config, intermediate_size=config.shared_intermediate_size)
        self.shared_expert_gate = TokenLinear(h, 1, bias=False)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return token_linear(x, weight, None, self.row_invariant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = route(self.gate(x), self.top_k, normalize=True)
        y = sum_picks(dispatch_to_experts(x, weights.to(x.dtype), expert_ids, self.experts))
        return y + exp_sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
