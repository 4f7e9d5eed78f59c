"""DeepStack decoders (Qwen3-VL, Qwen3-Omni's Thinker): the shared decoder plus visual features after its first layers.

The vision tower's features from some of its middle blocks are added to the
image tokens' hidden states after the decoder's first layers (one tower block
per decoder layer). They travel with the image embeddings: an image token's
row is ``[embedding | feature 1 | ... | feature K]`` (``[N, (K + 1) H]``), the
decoder's token embedding is zero-padded to that width, and
``DeepStackTextModel`` splits the columns again, so scattering and chunked
prefill treat the row as one.

Shape letters: T tokens in the step, H hidden size, K DeepStack layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ifb_plugins.common.layers.attention import AttnMetadata
from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.common.models.decoder import KVCache, TextModel
from ifb_plugins.common.models.parts import ModelParts


class PaddedEmbedding(nn.Embedding):
    """Token embeddings ``[T, H]`` zero-padded to an image row's ``(K + 1) H`` columns (no DeepStack features)."""

    def __init__(self, num_embeddings: int, dim: int, extra: int) -> None:
        super().__init__(num_embeddings, dim)
        self.extra = extra

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.pad(super().forward(ids), (0, self.extra))


class DeepStackParts(ModelParts):
    """The float32 parts with the token embedding zero-padded to an image row's width."""

    def __init__(self, num_deepstack: int) -> None:
        super().__init__()
        self.num_deepstack = num_deepstack

    def embedding(self, config: TextModelConfig) -> nn.Module:
        return PaddedEmbedding(config.vocab_size, config.hidden_size, self.num_deepstack * config.hidden_size)


class DeepStackTextModel(TextModel):
    """The shared decoder, adding DeepStack feature ``i`` to the hidden states after layer ``i``.

    Its forward runs the layers itself (the features enter between them), so it is built
    from ``DeepStackParts``, whose layer stack is the layer loop.
    """

    def __init__(self, config: TextModelConfig, num_deepstack: int) -> None:
        if num_deepstack > config.num_layers:
            raise ValueError(f"{num_deepstack} DeepStack layers for a decoder of {config.num_layers}")
        super().__init__(config, DeepStackParts(num_deepstack))
        self.num_deepstack = num_deepstack

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnMetadata,
                kv_caches: list[KVCache], input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """As ``TextModel.forward``; ``input_embeds`` rows are ``[embedding | DeepStack features]``."""
        rows = self.model.embed_tokens(input_ids) if input_embeds is None else input_embeds  # [T, (K+1) H]
        h = self.config.hidden_size
        x = rows[:, :h].contiguous()  # [T, H]
        deepstack = rows[:, h:].view(rows.shape[0], self.num_deepstack, h)  # [T, K, H], zeros on text rows
        cos, sin = self.rotary(positions, x.dtype, None)
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            x = layer(x, cos, sin, attn, kv_cache)
            if i < self.num_deepstack:
                x = x + deepstack[:, i]
        return self.model.norm(x)


def build_text_model(config: TextModelConfig, num_deepstack: int, state: dict[str, torch.Tensor],
                     device: torch.device) -> DeepStackTextModel:
    """``loading.checkpoint.build_model`` for the DeepStack decoder: strict, float32."""
    from ifb_plugins.common.loading.checkpoint import load_weights

    return load_weights(config, state, lambda: DeepStackTextModel(config, num_deepstack), device=device)
