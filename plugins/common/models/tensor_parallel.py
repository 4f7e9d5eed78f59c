"""A ``TextModel`` sharded over the ranks of ``ifb.parallel``, Megatron-style.

Each rank keeps its share of every attention layer's heads: the rows of Q, K
and V for its query and KV heads (column-parallel: no communication) and the
matching columns of O (row-parallel: one all-reduce). A dense MLP is split the
same way along its intermediate size: gate and up by rows, down by columns, one
all-reduce. The embedding is split along the vocabulary (each rank looks up
the ids it holds, zeros elsewhere, one all-reduce) and the output head (the
same rows when the embeddings are tied) computes each rank's share of the
logits, gathered on rank 0, which samples. KV heads split across ranks, so each
rank's KV pool holds its heads' share of every block.

Mixture-of-experts layers are replicated: every rank holds every expert and
runs the routed MLP on the full (all-reduced) hidden state, so only their
attention is sharded.

The float32 path only: a GGUF is dequantized first (its block path is not
sharded yet).
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ifb.parallel import ParallelContext
from ifb_plugins.common.layers.moe import SparseMoE
from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.common.models.decoder import MLP, TextModel


def check_shardable(config: TextModelConfig, num_ranks: int) -> None:
    """Refuse a model whose heads, KV heads or (dense) intermediate size do not divide by ``num_ranks``."""
    parts = [("attention heads", config.num_heads), ("KV heads", config.num_kv_heads)]
    if config.intermediate_size:
        parts.append(("the MLP's intermediate size", config.intermediate_size))
    for what, n in parts:
        if n % num_ranks:
            raise ValueError(
                f"tensor parallelism over {num_ranks} ranks needs {what} divisible by {num_ranks}: this model has "
                f"{config.num_heads} attention heads, {config.num_kv_heads} KV heads and an intermediate size of "
                f"{config.intermediate_size}")


def shard_config(config: TextModelConfig, num_ranks: int) -> TextModelConfig:
    """One rank's share of ``config``: its heads, KV heads and dense intermediate size."""
    return attrs.evolve(config, num_heads=config.num_heads // num_ranks, num_kv_heads=config.num_kv_heads // num_ranks,
                        intermediate_size=config.intermediate_size // num_ranks)


def _rows(linear: nn.Linear, start: int, stop: int) -> nn.Linear:
    """The output rows ``start:stop`` of ``linear`` (column-parallel: each rank computes its own outputs)."""
    out = nn.Linear(linear.in_features, stop - start, bias=linear.bias is not None)
    out.weight = nn.Parameter(linear.weight.data[start:stop].clone(), requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias.data[start:stop].clone(), requires_grad=False)
    return out


class RowParallelLinear(nn.Module):
    """The input columns ``start:stop`` of a linear layer: each rank's partial sum meets in one all-reduce."""

    def __init__(self, linear: nn.Linear, start: int, stop: int, group) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.data[:, start:stop].clone(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data.clone(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias  # once, after the sum


class VocabParallelEmbedding(nn.Module):
    """Rows ``start:stop`` of the embedding table; the ids outside are zeros here, looked up elsewhere."""

    def __init__(self, weight: torch.Tensor, start: int, stop: int, group) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight[start:stop].clone(), requires_grad=False)
        self.start, self.stop = start, stop
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        held = (ids >= self.start) & (ids < self.stop)
        out = F.embedding((ids - self.start).clamp(0, self.stop - self.start - 1), self.weight)
        out = out * held[:, None].to(out.dtype)  # one nonzero addend per token: the sum is exact
        dist.all_reduce(out, group=self.group)
        return out


class GatheredHead(nn.Module):
    """Each rank's vocabulary share of the logits, gathered on rank 0 (the others get their share only)."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, shard: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.weight = weight  # [V / N (the last rank's may be shorter), H]
        self.vocab_size, self.shard, self.ctx = vocab_size, shard, ctx

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight).float()
        if logits.shape[1] < self.shard:  # gather needs equal shapes: pad the last rank's share
            logits = F.pad(logits, (0, self.shard - logits.shape[1]))
        logits = logits.contiguous()
        if self.ctx.rank != 0:
            dist.gather(logits, None, dst=0, group=self.ctx.group)
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.ctx.world_size)]
        dist.gather(logits, parts, dst=0, group=self.ctx.group)
        return torch.cat(parts, dim=1)[:, : self.vocab_size]


def shard_text_model(model: TextModel, ctx: ParallelContext) -> TextModel:
    """Shard ``model`` (float32, as loaded) in place for rank ``ctx.rank``; returns it."""
    full = model.config
    n, r, group = ctx.world_size, ctx.rank, ctx.group
    check_shardable(full, n)
    local = shard_config(full, n)
    d = full.head_dim
    q0, kv0 = r * local.num_heads * d, r * local.num_kv_heads * d
    i0 = r * local.intermediate_size
    for layer in model.model.layers:
        attn = layer.self_attn
        if attn.qkv_proj is not None or not all(isinstance(getattr(attn, f"{p}_proj"), nn.Linear) for p in "qkvo"):
            raise ValueError("tensor parallelism shards the float32 model only (its projections as loaded)")
        attn.q_proj = _rows(attn.q_proj, q0, q0 + local.q_size)
        attn.k_proj = _rows(attn.k_proj, kv0, kv0 + local.kv_size)
        attn.v_proj = _rows(attn.v_proj, kv0, kv0 + local.kv_size)
        attn.o_proj = RowParallelLinear(attn.o_proj, q0, q0 + local.q_size, group)
        attn.config = local
        mlp = layer.mlp
        if isinstance(mlp, MLP):
            mlp.gate_proj = _rows(mlp.gate_proj, i0, i0 + local.intermediate_size)
            mlp.up_proj = _rows(mlp.up_proj, i0, i0 + local.intermediate_size)
            mlp.down_proj = RowParallelLinear(mlp.down_proj, i0, i0 + local.intermediate_size, group)
        elif not isinstance(mlp, SparseMoE):
            raise ValueError(f"tensor parallelism cannot shard a {type(mlp).__name__} layer")
    vocab = full.vocab_size
    shard = -(-vocab // n)
    v0, v1 = min(r * shard, vocab), min((r + 1) * shard, vocab)
    embed = VocabParallelEmbedding(model.model.embed_tokens.weight.data, v0, v1, group)
    model.model.embed_tokens = embed
    if full.tie_word_embeddings:
        head_weight = embed.weight
    else:
        head_weight = nn.Parameter(model.lm_head.weight.data[v0:v1].clone(), requires_grad=False)
        del model.lm_head
    model.head = GatheredHead(head_weight, vocab, shard, ctx)
    model.config = local  # the KV pool is allocated for this rank's KV heads
    return model
