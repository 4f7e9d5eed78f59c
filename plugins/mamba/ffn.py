"""The feed-forward layers of the hybrid families, each token computed on its own.

- ``ReluSquaredMLP``: Nemotron-H's MLP layers (``-``), ``down(relu(up(x))^2)``.
- ``SwiGLU``: Bamba's feed-forward after every mixer, ``down(silu(gate(x)) * up(x))``.
- ``GraniteFFN``: Granite 4.0 hybrid's shared MLP (one fused ``input_linear``
  split into gate and up) plus, when the config has experts, a sparse
  mixture of experts: a linear router picks each token's top-k experts and
  weights them by a softmax over the chosen logits.

Every matmul runs per token (``token_linear``) and the softmax is spelled with
``exp``, so a token's output never depends on which tokens share its step.
"""

from __future__ import annotations

import torch
from torch import nn

from ifb_plugins.mamba.config import HybridConfig
from ifb_plugins.mamba.numerics import silu, token_linear


class TokenLinear(nn.Linear):
    """``nn.Linear`` whose rows are computed one token at a time (see ``numerics.token_linear``)."""

    row_invariant = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return token_linear(x, self.weight, self.bias, self.row_invariant)


class ReluSquaredMLP(nn.Module):
    def __init__(self, config: HybridConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        width = intermediate_size or config.intermediate_size  # Nemotron-H's shared expert has its own
        self.up_proj = TokenLinear(config.hidden_size, width, bias=config.mlp_bias)
        self.down_proj = TokenLinear(width, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class SwiGLU(nn.Module):
    def __init__(self, config: HybridConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, intermediate_size or config.intermediate_size, config.mlp_bias
        self.gate_proj = TokenLinear(h, i, bias=bias)
        self.up_proj = TokenLinear(h, i, bias=bias)
        self.down_proj = TokenLinear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class SharedMLP(nn.Module):
    """Granite's dense MLP: ``input_linear`` gives ``[gate | up]``."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.shared_intermediate_size
        self.input_linear = TokenLinear(h, 2 * i, bias=False)
        self.output_linear = TokenLinear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(silu(gate) * up)


class SparseMoE(nn.Module):
    """Top-k routed experts; expert e's weights are ``gate_up_proj[e] [2I, H]`` and ``down_proj[e] [H, I]``."""

    row_invariant = True

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        self.top_k = config.num_experts_per_tok
        self.router = TokenLinear(h, e, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x).float()  # [T, E]
        top_logits, top_experts = logits.topk(self.top_k, dim=-1)  # [T, k]
        weights = torch.exp(top_logits - top_logits.amax(-1, keepdim=True))
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)  # softmax over the chosen experts
        out = torch.zeros_like(x)
        # Experts in index order, so each token sums its experts' outputs in one fixed order.
        for expert in top_experts.unique().tolist():
            rows, slot = (top_experts == expert).nonzero(as_tuple=True)
            gate, up = token_linear(x[rows], self.gate_up_proj[expert], None, self.row_invariant).chunk(2, dim=-1)
            y = token_linear(silu(gate) * up, self.down_proj[expert], None, self.row_invariant)
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out


class GraniteFFN(nn.Module):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.shared = SharedMLP(config)
        self.moe = SparseMoE(config) if config.num_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared(x)
        return shared if self.moe is None else self.moe(x) + shared
