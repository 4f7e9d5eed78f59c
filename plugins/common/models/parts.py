"""What a ``TextModel`` is built from: the factory that picks each module as the model is built.

``TextModel(config, parts)`` asks ``parts`` for every module whose implementation
can differ, at the place in the tree where it goes, by its state-dict name:

- each projection: ``fused`` (Q/K/V, gate/up as one matmul where the weights
  allow it, else None) and ``linear``;
- what a row-parallel projection's partial output goes through (``partial_sum``, tensor parallelism);
- each layer's ``attention`` kernel (``attention.paged_attention``'s signature);
- the token ``embedding``, the float32 ``lm_head`` (None when tied or not
  needed) and the output ``head`` when it is not that plain matmul;
- the routed ``experts`` of a mixture-of-experts layer;
- the ``layer_stack``: what runs the layers, ``(x, cos, sin, attn, kv_caches) -> x``.

``ModelParts`` (this module) gives the float32 torch modules, the reference.
``quant.parts.BlockParts`` gives GGUF-block matmuls, the native attention
and the native whole-stack decoder (``models.native_decoder``) where they apply.
Nothing is swapped into a model after it is built: what a built model runs is
what its parts chose, and ``loading.checkpoint.build_model`` loads the
weights the parts did not build themselves.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
from torch import nn

from ifb_plugins.common.layers.attention import AttnMetadata, paged_attention
from ifb_plugins.common.layers.moe import ExpertWeights
from ifb_plugins.common.models.config import TextModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


class LayerStack(Protocol):
    """Runs a model's decoder layers over one step: ``(x [T, H], cos, sin, attn, kv_caches) -> x [T, H]``."""

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnMetadata,
                 kv_caches: Sequence[KVCache]) -> torch.Tensor: ...


class TorchLayerStack:
    """The layers' own forwards, one after another (the reference ``LayerStack``).

    A plain object, not a module: the layers stay the model's ``model.layers`` (their
    state-dict names), this only runs them.
    """

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = layers

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnMetadata,
                 kv_caches: Sequence[KVCache]) -> torch.Tensor:
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, attn, kv_cache)
        return x

    def __repr__(self) -> str:
        return f"TorchLayerStack({len(self.layers)} layers)"


class ModelParts:
    """The float32 torch modules: ``nn.Linear`` per projection, torch's paged attention,
    ``nn.Embedding``, the float32 head and the layers' own forwards.

    Modules come back uninitialised (a model is built on the meta device and its
    weights loaded by name afterwards); a subclass that builds a module with its
    weights in place names the checkpoint tensors it used in ``consumed``.
    """

    def __init__(self) -> None:
        #: checkpoint names this factory's modules already hold (``build_model`` does not load them)
        self.consumed: set[str] = set()

    def fused(self, name: str, parts: Sequence[tuple[str, int]], in_features: int, bias: bool) -> nn.Module | None:
        """One matmul for the projections ``parts`` (``(name, out_features)`` each, rows stacked in
        that order) under ``name``; None: each part is its own ``linear``."""
        return None

    def linear(self, name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        """The projection ``name`` (``nn.Linear``'s call signature)."""
        return nn.Linear(in_features, out_features, bias=bias)

    def partial_sum(self, name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What the output of projection ``name`` goes through before it is used: None (it is the
        whole result), or, where the projection computes one rank's partial sum (tensor parallelism),
        the all-reduce that completes it."""
        return None

    def attention(self, name: str) -> Callable[..., torch.Tensor]:
        """The attention module ``name``'s kernel over the paged cache (``attention.paged_attention``'s signature)."""
        return paged_attention

    def embedding(self, config: TextModelConfig) -> nn.Module:
        """``model.embed_tokens``: token ids ``[T]`` to rows ``[T, H]``."""
        return nn.Embedding(config.vocab_size, config.hidden_size)

    def lm_head(self, config: TextModelConfig) -> nn.Module | None:
        """The float32 ``lm_head`` of an untied model (None when tied, or when ``head`` replaces it)."""
        return None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def head(self, config: TextModelConfig, embedding: nn.Module, lm_head: nn.Module | None) -> nn.Module | None:
        """The output head when it is not the float32 matmul over ``lm_head`` (or the tied
        ``embedding``): hidden ``[N, H]`` to float32 logits ``[N, V]``; None: that matmul."""
        return None

    def experts(self, name: str, config: TextModelConfig) -> nn.Module:
        """A sparse layer's routed experts under ``name`` (``moe.Experts``)."""
        return ExpertWeights(config.num_experts, config.hidden_size, config.moe_intermediate_size)

    def layer_stack(self, layers: nn.ModuleList, config: TextModelConfig) -> LayerStack:
        """What runs ``layers`` (all built by now) in each step."""
        return TorchLayerStack(layers)
