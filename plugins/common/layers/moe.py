"""Sparse mixture-of-experts feed-forward layers, as transformers defines Qwen3-MoE, Qwen2-MoE and Mixtral.

A router (``gate``, a bias-free ``[E, H]`` matmul) scores every expert per
token; each token goes to its top ``k`` experts, whose SwiGLU outputs are
summed with the router's weights. Qwen2-MoE adds an always-on shared expert
scaled by ``sigmoid(shared_expert_gate(x))``.

A step's tokens are dispatched per expert: the rows routed to one expert are
gathered and multiplied by it once (``ExpertWeights`` in float32, or
``ExpertModules`` of ``quant.BlockLinear`` on GGUF blocks). Batch invariance: the router's and the shared
expert gate's logits are one matrix-vector product per row (torch's CPU matmul
picks its kernel, hence its summation order, by the row count), routing is per
row, and each token's expert outputs are summed in one fixed order (ascending
expert id, as transformers' ``index_add_`` loop does), so a token's result
depends on its own row only wherever the expert matmuls compute each row on its
own, as the native block kernels do.

Parameter names follow the transformers 5 layout (``mlp.gate.weight``,
``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``,
``mlp.shared_expert.*``, ``mlp.shared_expert_gate.weight``);
``fuse_expert_state`` converts the per-expert layouts checkpoints store.

Shape letters: T tokens, H hidden, E experts, K experts per token, I expert intermediate size.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ifb_plugins.common.models.config import TextModelConfig

if TYPE_CHECKING:
    from ifb_plugins.common.models.parts import ModelParts


class Experts(Protocol):
    """What ``SparseMoE`` calls: one expert's SwiGLU on the rows routed to it."""

    num_experts: int

    def __call__(self, x: torch.Tensor, expert_id: int) -> torch.Tensor:
        """``x [n, H]`` through expert ``expert_id``: ``[n, H]``."""
        ...


def exp_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``sigmoid(x)`` spelled with ``exp``: torch's sigmoid takes a tensor's tail (the values past
    its last whole vectors) through scalar code that differs from the vector code in the last bit,
    so a token's gate would depend on how many tokens share the step; ``exp`` and arithmetic agree."""
    return 1.0 / (1.0 + torch.exp(-x))


def route(logits: torch.Tensor, top_k: int, *, normalize: bool, router: str = "softmax_topk"
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` to ``(weights [T, K] float32, expert_ids [T, K])``.

    ``softmax_topk``: softmax over all experts in float32, the top ``k``, renormalized to sum
    to one when ``normalize`` (Qwen's ``norm_topk_prob``; Mixtral always). ``topk_softmax``:
    the top ``k`` logits, then a softmax over them. Each row's picks come back in ascending
    expert order: the order their outputs are summed in.
    """
    if router == "softmax_topk":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif router == "topk_softmax":
        top, expert_ids = torch.topk(logits.float(), top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    else:
        raise ValueError(f"unknown router {router!r}")
    expert_ids, order = expert_ids.sort(dim=-1)
    return weights.gather(-1, order), expert_ids


def route_grouped_sigmoid(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, *, num_groups: int,
                          topk_groups: int, normalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The group-limited sigmoid router of Nemotron-H's MoE layers (DeepSeek-V3's, as transformers has it).

    Scores are ``sigmoid(logits)``; experts are chosen on the scores plus ``correction_bias``,
    only within the ``topk_groups`` groups whose two best biased scores sum highest; the chosen
    experts' unbiased scores, renormalized when ``normalize``, times ``scaling``, are the weights.
    Returns ``(weights [T, K] float32, expert_ids [T, K])`` in ascending expert order.
    """
    num_tokens, num_experts = logits.shape
    scores = exp_sigmoid(logits.float())
    choice = scores + correction_bias.float()
    group_scores = choice.view(num_tokens, num_groups, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    group_ids = torch.topk(group_scores, k=topk_groups, dim=-1)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, num_experts // num_groups).reshape(num_tokens, -1)
    expert_ids = torch.topk(choice.masked_fill(~expert_mask, -math.inf), k=top_k, dim=-1)[1]
    expert_ids = expert_ids.sort(dim=-1)[0]
    weights = scores.gather(1, expert_ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, expert_ids


def dispatch_to_experts(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, experts: Experts
                        ) -> torch.Tensor:
    """Each token's weighted expert outputs ``[T, K, out]``, one ``experts`` call per expert that got rows.

    ``weights`` and ``expert_ids`` are ``[T, K]`` (a router's output); ``experts(rows, e)`` maps
    the rows routed to expert ``e`` to their outputs.
    """
    t, k = expert_ids.shape
    flat = expert_ids.reshape(-1)  # [T K]: slot s is token s // K's pick s % K
    order = torch.argsort(flat, stable=True)  # slots grouped by expert
    counts = torch.bincount(flat, minlength=experts.num_experts).tolist()
    rows = x.index_select(0, order // k)  # [T K, H], grouped by expert
    outs = []
    start = 0
    for expert_id, n in enumerate(counts):
        if n:
            outs.append(experts(rows[start:start + n], expert_id))  # one matmul per expert
            start += n
    grouped = torch.cat(outs) if len(outs) > 1 else outs[0]
    grouped = grouped * weights.reshape(-1, 1).to(grouped.dtype).index_select(0, order)
    return torch.empty_like(grouped).index_copy_(0, order, grouped).view(t, k, -1)


def sum_picks(picks: torch.Tensor) -> torch.Tensor:
    """``picks [T, K, H]`` summed over K in pick order (ascending expert id), whatever the batch."""
    y = picks[:, 0]
    for j in range(1, picks.shape[1]):
        y = y + picks[:, j]
    return y


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` as one matrix-vector product per row of ``x [T, K]``: a row's bits
    do not depend on how many rows share the call (the router is a small ``[E, K]`` matrix)."""
    if x.shape[0] == 1:
        return torch.mv(weight, x[0])[None]
    return torch.stack([torch.mv(weight, row) for row in x.unbind(0)])


class ExpertWeights(nn.Module):
    """All routed experts' weights in float32, stacked as transformers 5 holds them; ``linear(x, w)``
    computes ``x @ w.T`` and ``silu`` the gate's activation (a plugin may pass its row-invariant ones)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, linear=F.linear, silu=F.silu) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.linear = linear
        self.silu = silu
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))  # gate rows, then up
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, expert_id: int) -> torch.Tensor:
        gate, up = self.linear(x, self.gate_up_proj[expert_id]).chunk(2, dim=-1)  # [n, I] each
        return self.linear(self.silu(gate) * up, self.down_proj[expert_id])  # [n, H]


class UngatedExperts(nn.Module):
    """Routed experts without a gate, ``down(act(up(x)))``, stacked as transformers 5 holds Nemotron-H's:
    ``up_proj [E, I, in]``, ``down_proj [E, in, I]``. ``linear(x, w)`` computes ``x @ w.T``
    (a plugin passes its row-invariant product)."""

    def __init__(self, num_experts: int, in_dim: int, intermediate: int, activation, linear=F.linear) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.activation = activation
        self.linear = linear
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, in_dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, in_dim, intermediate))

    def forward(self, x: torch.Tensor, expert_id: int) -> torch.Tensor:
        return self.linear(self.activation(self.linear(x, self.up_proj[expert_id])), self.down_proj[expert_id])


class ExpertModules(nn.Module):
    """Routed experts as per-expert projection modules (``quant.parts`` builds them over GGUF blocks):
    ``gate_up[e]`` gives gate then up ``[n, 2I]``, ``down[e]`` the output."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module]) -> None:
        super().__init__()
        if len(gate_up) != len(down):
            raise ValueError(f"{len(gate_up)} gate/up projections for {len(down)} down projections")
        self.num_experts = len(down)
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)

    def forward(self, x: torch.Tensor, expert_id: int) -> torch.Tensor:
        gate, up = self.gate_up[expert_id](x).chunk(2, dim=-1)  # [n, I] each
        return self.down[expert_id](F.silu(gate).mul_(up))  # [n, H]


class SharedExpert(nn.Module):
    """Qwen2-MoE's always-on SwiGLU expert (gate and up fused into ``gate_up_proj`` where ``parts`` can)."""

    def __init__(self, hidden: int, intermediate: int, parts: ModelParts | None = None,
                 prefix: str = "shared_expert") -> None:
        super().__init__()
        if parts is None:
            from ifb_plugins.common.models.parts import ModelParts

            parts = ModelParts()
        i = intermediate
        self.gate_up_proj = parts.fused(f"{prefix}.gate_up_proj", [(f"{prefix}.gate_proj", i), (f"{prefix}.up_proj", i)],
                                        hidden, False)
        if self.gate_up_proj is None:
            self.gate_proj = parts.linear(f"{prefix}.gate_proj", hidden, i, False)
            self.up_proj = parts.linear(f"{prefix}.up_proj", hidden, i, False)
        self.down_proj = parts.linear(f"{prefix}.down_proj", i, hidden, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """The sparse MLP of one decoder layer: router, routed experts, optional gated shared expert.

    ``parts`` (``models.parts``) picks the experts and the shared expert's projections; the
    router and the shared expert's gate stay float32 ``nn.Linear`` (llama.cpp stores them so)."""

    def __init__(self, config: TextModelConfig, parts: ModelParts | None = None, prefix: str = "mlp") -> None:
        super().__init__()
        if parts is None:
            from ifb_plugins.common.models.parts import ModelParts

            parts = ModelParts()
        h = config.hidden_size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.normalize = config.norm_topk_prob
        self.router = config.router
        self.gate = nn.Linear(h, config.num_experts, bias=False)
        #: float32 ``ExpertWeights``, or any ``Experts`` (``ExpertModules`` on GGUF blocks), as ``parts`` chose
        self.experts: nn.Module = parts.experts(f"{prefix}.experts", config)
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(h, config.shared_expert_intermediate_size, parts,
                                              f"{prefix}.shared_expert")
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = rowwise_linear(x, self.gate.weight)  # [T, E]
        weights, expert_ids = route(logits, self.top_k, normalize=self.normalize, router=self.router)  # [T, K]
        weights = weights.to(x.dtype)
        if x.shape[0] == 1:  # a decode step alone: no gathers
            picks = [self.experts(x, e) * weights[:, j:j + 1] for j, e in enumerate(expert_ids[0].tolist())]
        else:
            picks = dispatch_to_experts(x, weights, expert_ids, self.experts).unbind(1)
        y = picks[0]
        for pick in picks[1:]:  # ascending expert order, whatever the batch
            y = y + pick
        if self.shared_expert is not None:
            y = y + exp_sigmoid(rowwise_linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        return y


# checkpoint names of per-expert tensors: Qwen's experts.N.{gate,up,down}_proj, Mixtral's experts.N.w{1,3,2}
_PER_EXPERT = re.compile(r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight")
_MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# stacked but not fused (llama.cpp's ffn_{gate,up,down}_exps, named after the HF module by gguf_loader)
_STACKED = re.compile(r"(.*)\.mlp\.experts\.(gate_proj|up_proj|down_proj)\.weight")


def fuse_expert_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every layer's experts in the transformers 5 layout ``SparseMoE`` loads.

    Reads per-expert tensors (``mlp.experts.N.gate_proj.weight`` as transformers saves Qwen
    MoE checkpoints, ``block_sparse_moe.experts.N.w1.weight`` and ``block_sparse_moe.gate``
    as it saves Mixtral) and stacked ones (``mlp.experts.gate_proj.weight [E, I, H]``, from
    GGUF files); the fused ``mlp.experts.gate_up_proj`` / ``down_proj`` pass through.
    """
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in state.items():
        if m := _PER_EXPERT.fullmatch(name):
            part = _MIXTRAL_PARTS.get(m.group(3), m.group(3))
            parts.setdefault(m.group(1), {}).setdefault(part, {})[int(m.group(2))] = tensor
        elif m := _STACKED.fullmatch(name):
            parts.setdefault(m.group(1), {}).setdefault(m.group(2), {}).update(enumerate(tensor.unbind(0)))
        elif ".block_sparse_moe.gate." in name:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
        else:
            out[name] = tensor
    for layer, by_part in parts.items():
        if set(by_part) != {"gate_proj", "up_proj", "down_proj"}:
            raise ValueError(f"{layer}: expert tensors {sorted(by_part)}, expected gate, up and down")
        counts = {len(p) for p in by_part.values()}
        ids = sorted(by_part["gate_proj"])
        if len(counts) != 1 or ids != list(range(len(ids))) or any(sorted(p) != ids for p in by_part.values()):
            raise ValueError(f"{layer}: the experts' gate, up and down tensors do not pair up")

        def stack(part: str) -> torch.Tensor:
            return torch.stack([by_part[part][e] for e in ids])

        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat((stack("gate_proj"), stack("up_proj")), dim=1)
        out[f"{layer}.mlp.experts.down_proj"] = stack("down_proj")
    return out
