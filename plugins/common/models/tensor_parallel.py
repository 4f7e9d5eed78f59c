"""A ``TextModel`` sharded over the ranks of ``ifb.parallel``, Megatron-style, as it is built.

Each rank builds only its share (``ShardPlan``), on the float32 path and on the
GGUF-block path alike, from the checkpoint's tensors cut before any module is
made of them:

- column-parallel Q, K, V, gate and up: the output rows of the rank's query
  heads, KV heads and intermediate share (rows move whole, so a quantized
  matrix's blocks are untouched); no communication;
- row-parallel O and down: the matching input columns, cut along whole blocks
  (a split that would cut a block, a K-quant's super-block of 256 included, is
  refused at load naming the numbers); each rank's partial sum meets in one
  all-reduce (``ModelParts.partial_sum``); their bias is held by rank 0 alone,
  so it is added once;
- the embedding split along the vocabulary (``VocabParallelEmbedding``: each
  rank looks up the ids it holds, zeros elsewhere, one all-reduce) and the
  output head computing each rank's share of the logits (the same rows when
  tied), gathered on rank 0, which samples (``GatheredHead``);
- KV heads split across ranks, so each rank's KV pool holds its heads' share of
  every block (the model's ``config`` is the rank's share).

Mixture-of-experts layers are replicated: every rank holds every expert (and a
shared expert) and runs the routed MLP on the full, all-reduced hidden state.

``TensorParallelParts`` wraps the parts that build the modules (``ModelParts``,
or ``quant.parts.BlockParts`` over the cut GGUF tensors) and runs the layers
from Python (the native whole-stack decoder cannot meet the other ranks
mid-stack); the matmuls and attention stay on the native kernels.
"""

from __future__ import annotations

import re
from typing import Callable, Literal, Mapping

import attrs
import gguf
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ifb.parallel import ParallelContext
from ifb_plugins.common.loading.gguf import GGUFTensor, dequantize
from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.common.models.decoder import TextModel
from ifb_plugins.common.models.parts import LayerStack, ModelParts, TorchLayerStack

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
#: the float32 embedding table's name inside ``VocabParallelEmbedding``
LOOKUP = "model.embed_tokens.lookup.weight"
_PROJECTION = re.compile(r"model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.(weight|bias)")
_ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


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
    """One rank's share of ``config``: its heads, KV heads and dense intermediate size (the vocabulary whole)."""
    return attrs.evolve(config, num_heads=config.num_heads // num_ranks, num_kv_heads=config.num_kv_heads // num_ranks,
                        intermediate_size=config.intermediate_size // num_ranks)


@attrs.frozen
class Cut:
    """What a rank holds of one tensor: output ``rows`` or input ``columns`` [start, stop), or (``rank0``)
    a row-parallel bias, whole on rank 0 and zeros elsewhere."""

    axis: Literal["rows", "columns", "rank0"]
    start: int = 0
    stop: int = 0


@attrs.frozen
class ShardPlan:
    """Where rank ``rank`` of ``num_ranks`` cuts each tensor of a model configured ``full``."""

    full: TextModelConfig
    rank: int
    num_ranks: int

    @property
    def local(self) -> TextModelConfig:
        return shard_config(self.full, self.num_ranks)

    @property
    def vocab_shard(self) -> int:
        """Rows of the vocabulary each rank holds (the last rank's may be fewer)."""
        return -(-self.full.vocab_size // self.num_ranks)

    @property
    def vocab_range(self) -> tuple[int, int]:
        v = self.full.vocab_size
        return min(self.rank * self.vocab_shard, v), min((self.rank + 1) * self.vocab_shard, v)

    def cut(self, name: str) -> Cut | None:
        """This rank's cut of tensor ``name`` (state-dict name), or None: held whole (replicated)."""
        if name in (EMBED, HEAD):
            return Cut("rows", *self.vocab_range)
        match = _PROJECTION.fullmatch(name)
        if match is None:
            return None
        layer, proj, kind = int(match[1]), match[2], match[3]
        if proj.startswith("mlp.") and self.full.is_sparse_layer(layer):
            return None
        local, r = self.local, self.rank
        width = {"self_attn.q_proj": local.q_size, "self_attn.k_proj": local.kv_size, "self_attn.v_proj": local.kv_size,
                 "self_attn.o_proj": local.q_size}.get(proj, local.intermediate_size)
        if proj in _ROW_PARALLEL:
            return Cut("columns", r * width, (r + 1) * width) if kind == "weight" else Cut("rank0")
        return Cut("rows", r * width, (r + 1) * width)

    def is_row_parallel(self, name: str) -> bool:
        """Whether projection ``name`` (no ``.weight``) computes partial sums that meet in an all-reduce."""
        cut = self.cut(f"{name}.weight")
        return cut is not None and cut.axis == "columns"

    def shard_adapter(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of a LoRA pair (``A [r, in]``, ``B [out, r]``) on projection ``module``: B's
        rows of a column-parallel projection, A's columns of a row-parallel one (its partial product
        ``B (A_rank x_rank)`` is added before the all-reduce, which sums it to ``B A x``)."""
        cut = self.cut(f"{module}.weight")
        if cut is None:
            return a, b
        if cut.axis == "columns":
            return a[:, cut.start:cut.stop].contiguous(), b
        return a, b[cut.start:cut.stop].contiguous()

    # ---- the checkpoint's tensors, cut ----
    def shard_state(self, state: Mapping[str, torch.Tensor], deferred: frozenset[str] = frozenset()
                    ) -> dict[str, torch.Tensor]:
        """This rank's float32 state dict (a deferred tensor stays uninitialised, only of its new shape)."""
        out = {}
        for name, t in state.items():
            cut = self.cut(name)
            if cut is None:
                out[name] = t
            elif cut.axis == "rank0":
                out[name] = t if self.rank == 0 else torch.zeros_like(t)
            else:
                piece = t[cut.start:cut.stop] if cut.axis == "rows" else t[:, cut.start:cut.stop]
                out[name] = torch.empty(piece.shape, dtype=t.dtype) if name in deferred else piece.contiguous()
        return out

    def shard_gguf(self, tensors: Mapping[str, GGUFTensor]) -> dict[str, GGUFTensor]:
        """This rank's GGUF tensors as stored: rows whole, columns along whole blocks (refused otherwise)."""
        out = {}
        for name, t in tensors.items():
            cut = self.cut(name)
            if cut is None:
                out[name] = t
                continue
            if cut.axis == "rank0":
                data = t.data if self.rank == 0 else np.zeros_like(t.data)
                out[name] = attrs.evolve(t, data=data)
                continue
            n = t.shape[0]
            rows = np.asarray(t.data).reshape(n, -1)
            if cut.axis == "rows":
                out[name] = attrs.evolve(t, shape=(cut.stop - cut.start, *t.shape[1:]), data=rows[cut.start:cut.stop])
                continue
            per, size = gguf.GGML_QUANT_SIZES[t.ggml_type]
            share = cut.stop - cut.start
            if cut.start % per or share % per:
                raise ValueError(
                    f"tensor parallelism over {self.num_ranks} ranks splits {name} ({t.ggml_type.name}, "
                    f"{t.shape[1]} input features) into shares of {share} input features, which would cut its "
                    f"blocks of {per} weights: a row-parallel split falls on whole blocks (a share a multiple of "
                    f"{per}); serve it on {_whole_block_ranks(t.shape[1], per)} or requantize the matrix")
            data = np.ascontiguousarray(rows[:, cut.start // per * size:cut.stop // per * size])
            out[name] = attrs.evolve(t, shape=(n, share), data=data)
        return out


def _whole_block_ranks(features: int, per: int) -> str:
    """The rank counts up to 8 (beyond one) that split ``features`` along whole blocks of ``per``."""
    counts = [str(n) for n in range(2, 9) if features % n == 0 and (features // n) % per == 0]
    return f"{' or '.join(counts)} ranks" if counts else "one rank"


class AllReduce:
    """Sums a partial result over the ranks, in place (what a row-parallel projection's output goes through)."""

    def __init__(self, group) -> None:
        self.group = group

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(partial, group=self.group)
        return partial


class VocabParallelEmbedding(nn.Module):
    """Rows ``start:stop`` of the vocabulary (``lookup``: any embedding over them); the ids outside are
    zeros here, looked up on their rank, and one all-reduce sums the one nonzero addend per token (exact)."""

    def __init__(self, lookup: nn.Module, start: int, stop: int, group) -> None:
        super().__init__()
        self.lookup = lookup
        self.start, self.stop = start, stop
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        held = (ids >= self.start) & (ids < self.stop)
        out = self.lookup((ids - self.start).clamp(0, self.stop - self.start - 1)).float()
        out = out * held.unsqueeze(-1).to(out.dtype)
        dist.all_reduce(out, group=self.group)
        return out


class GatheredHead(nn.Module):
    """Each rank's vocabulary share of the logits, gathered on rank 0 (the others get their share only).

    ``shard`` computes them (a block matmul, built), or, None, the float32 matmul over the ``.weight``
    of ``weight_of`` (the rank's ``lm_head`` or, tied, its embedding rows), read at each call."""

    def __init__(self, shard: nn.Module | None, weight_of: nn.Module | None, vocab_size: int, vocab_shard: int,
                 ctx: ParallelContext) -> None:
        super().__init__()
        self.shard = shard
        self._weight_of = (weight_of,)  # a plain reference: the module stays where the model holds it
        self.vocab_size, self.vocab_shard, self.ctx = vocab_size, vocab_shard, ctx

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.shard is not None:
            logits = self.shard(hidden).float()
        else:
            logits = F.linear(hidden, self._weight_of[0].weight).float()
        if logits.shape[1] < self.vocab_shard:  # gather needs equal shapes: pad the last rank's share
            logits = F.pad(logits, (0, self.vocab_shard - logits.shape[1]))
        logits = logits.contiguous()
        if self.ctx.rank != 0:
            dist.gather(logits, None, dst=0, group=self.ctx.group)
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.ctx.world_size)]
        dist.gather(logits, parts, dst=0, group=self.ctx.group)
        return torch.cat(parts, dim=1)[:, : self.vocab_size]


class TensorParallelParts(ModelParts):
    """``models.parts.ModelParts`` for one rank: ``inner`` builds each module over the cut tensors (its
    shapes the rank's, ``plan.local``), these parts add the collectives around them."""

    def __init__(self, inner: ModelParts, plan: ShardPlan, ctx: ParallelContext) -> None:  # noqa: D107
        # no ModelParts.__init__: ``consumed`` is the inner parts', seen through the embedding's rename
        self.inner, self.plan, self.ctx = inner, plan, ctx
        v0, v1 = plan.vocab_range
        #: the config ``inner`` builds the embedding and head with: the rank's rows of the vocabulary
        self.vocab_config = attrs.evolve(plan.local, vocab_size=v1 - v0)

    @property
    def consumed(self) -> set[str]:  # type: ignore[override]
        return {LOOKUP if n == EMBED else n for n in self.inner.consumed}

    def fused(self, name, parts, in_features, bias):
        return self.inner.fused(name, parts, in_features, bias)

    def linear(self, name, in_features, out_features, bias):
        return self.inner.linear(name, in_features, out_features, bias)

    def partial_sum(self, name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return AllReduce(self.ctx.group) if self.plan.is_row_parallel(name) else None

    def attention(self, name):
        return self.inner.attention(name)

    def experts(self, name, config):
        return self.inner.experts(name, config)

    def embedding(self, config: TextModelConfig) -> nn.Module:
        return VocabParallelEmbedding(self.inner.embedding(self.vocab_config), *self.plan.vocab_range, self.ctx.group)

    def lm_head(self, config: TextModelConfig) -> nn.Module | None:
        return self.inner.lm_head(self.vocab_config)

    def head(self, config: TextModelConfig, embedding: nn.Module, lm_head: nn.Module | None) -> nn.Module:
        shard = self.inner.head(self.vocab_config, embedding.lookup, lm_head)
        weight_of = None if shard is not None else lm_head if lm_head is not None else embedding.lookup
        return GatheredHead(shard, weight_of, self.plan.full.vocab_size, self.plan.vocab_shard, self.ctx)

    def layer_stack(self, layers: nn.ModuleList, config: TextModelConfig) -> LayerStack:
        return TorchLayerStack(layers)


def build_sharded_model(config: TextModelConfig, state: Mapping[str, torch.Tensor], tensors: Mapping[str, GGUFTensor],
                        ctx: ParallelContext, make_parts: Callable[[ShardPlan, dict, dict], ModelParts], *,
                        deferred: frozenset[str] = frozenset()) -> tuple[TextModel, ModelParts]:
    """Rank ``ctx.rank``'s share of the model ``config``: ``state`` (float32) and ``tensors`` (a GGUF's, as
    stored; empty for a checkpoint directory) cut by the ``ShardPlan``, the modules built by
    ``make_parts(plan, cut tensors, cut state)``; the deferred matrices still needed in float32 are then
    dequantized from the cut tensors. Returns the model and the inner parts (for the load report)."""
    from ifb_plugins.common.loading.checkpoint import load_weights

    check_shardable(config, ctx.world_size)
    plan = ShardPlan(config, ctx.rank, ctx.world_size)
    cut_tensors = plan.shard_gguf(tensors)  # refuses a split that would cut a block, before anything is built
    cut_state = plan.shard_state(state, deferred)
    inner = make_parts(plan, cut_tensors, cut_state)
    parts = TensorParallelParts(inner, plan, ctx)
    load_state = {LOOKUP if n == EMBED else n: t for n, t in cut_state.items()}
    model = load_weights(plan.local, load_state, lambda: TextModel(plan.local, parts), parts)
    held = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name in sorted(deferred - inner.consumed):
            target = held.get(LOOKUP if name == EMBED else name)
            if target is not None:
                target.copy_(dequantize(cut_tensors[name]))
    return model, inner
