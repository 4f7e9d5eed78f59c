"""Gemma 4's assistant drafter (``Gemma4AssistantForCausalLM``), reading its target's paged KV cache.

The assistant is a small Gemma 4 decoder with no KV of its own: every layer is
KV-shared with the *target*. A layer of each type attends to the cache of the
target's last KV-computing layer of that type (transformers' ``store``
layer). One drafting step takes the last known token's embedding in the
target's table (scaled as the target scales it) beside the target's last
hidden state (the one that predicted that token), projects the pair to the
assistant's width, runs the layers as a single query at the last known token's
position over the target's context before it (full layers: all of it; sliding
layers: its last ``sliding_window + 1`` positions, as transformers' mask has it), and gives the next token's
logits and a hidden state projected back to the target's width, which feeds
the next drafting step at the same position. Logits come from the tied head,
or (``use_ordered_embeddings``) only over the tokens of the top centroids.

Shape letters: N seats drafting, H the assistant's hidden, B the target's hidden, V vocabulary.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from ifb_plugins.common.layers.attention import AttnMetadata
from ifb_plugins.common.models.gemma4 import (DecoderLayer, Gemma4Config, Gemma4ConfigError, Norm, inv_freq,
                                              read_gemma4_config)

#: a layer's ``kv_source`` when its KV is the target's (the assistant computes none)
TARGET_KV = -1


@attrs.frozen
class Gemma4AssistantConfig:
    text: Gemma4Config
    #: the target's hidden width (what the target's embedding and hidden state have)
    backbone_hidden_size: int
    use_ordered_embeddings: bool
    num_centroids: int
    centroid_intermediate_top_k: int

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> Gemma4AssistantConfig:
        if cfg.get("model_type") != "gemma4_assistant":
            raise Gemma4ConfigError(f"model_type {cfg.get('model_type')!r} is not gemma4_assistant")
        text_cfg = dict(cfg.get("text_config") or {})
        num_layers = int(text_cfg.get("num_hidden_layers", 0))
        if int(text_cfg.get("num_kv_shared_layers") or num_layers) != num_layers:
            raise Gemma4ConfigError("config.json: every layer of a Gemma 4 assistant reads its target's KV "
                                    "(text_config.num_kv_shared_layers must equal num_hidden_layers)")
        for name in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
            if text_cfg.get(name):
                raise Gemma4ConfigError(f"config.json: text_config.{name} must be 0 for an assistant")
        # read as a decoder computing its own KV, then point every layer at the target's
        text = read_gemma4_config({**text_cfg, "num_kv_shared_layers": 0, "vocab_size_per_layer_input": 0})
        # a sliding layer's single query sees the last ``sliding_window + 1`` positions of the context before
        # it: transformers' bidirectional window mask (``|q - k| <= window``) from the query's own position
        text = attrs.evolve(text, sliding_window=text.sliding_window + 1,
                            layers=tuple(attrs.evolve(s, kv_source=TARGET_KV, values_are_keys=False)
                                         for s in text.layers))
        return cls(text=text, backbone_hidden_size=int(cfg.get("backbone_hidden_size", 1536)),
                   use_ordered_embeddings=bool(cfg.get("use_ordered_embeddings", False)),
                   num_centroids=int(cfg.get("num_centroids", 2048)),
                   centroid_intermediate_top_k=int(cfg.get("centroid_intermediate_top_k", 32)))


def target_kv_layers(target: Gemma4Config) -> dict[str, int]:
    """Per layer type, the target's layer whose KV the assistant reads: the last that computes KV."""
    return {s.kind: i for i, s in enumerate(target.layers) if s.kv_source == i}


def check_fits(assistant: Gemma4AssistantConfig, target: Gemma4Config) -> None:
    """ValueError naming the field where ``assistant`` cannot read ``target``'s hidden states and KV."""
    if assistant.backbone_hidden_size != target.hidden_size:
        raise ValueError(f"the assistant expects a target of hidden size {assistant.backbone_hidden_size}, the "
                         f"target has {target.hidden_size}")
    if assistant.vocab_size != target.vocab_size:
        raise ValueError(f"the assistant has a vocabulary of {assistant.vocab_size} tokens, the target one of "
                         f"{target.vocab_size}: a draft model must share the target's vocabulary")
    sources = target_kv_layers(target)
    for i, s in enumerate(assistant.text.layers):
        if s.kind not in sources:
            raise ValueError(f"assistant layer {i} ({s.kind}) has no {s.kind} layer of the target to read")
        t = target.layers[sources[s.kind]]
        if (s.num_kv_heads, s.head_dim) != (t.num_kv_heads, t.head_dim):
            raise ValueError(f"assistant layer {i} ({s.kind}) reads {s.num_kv_heads} KV heads of {s.head_dim}, the "
                             f"target's layer {sources[s.kind]} holds {t.num_kv_heads} of {t.head_dim}")
    if assistant.text.sliding_window - 1 != target.sliding_window:
        raise ValueError(f"the assistant's sliding window ({assistant.text.sliding_window - 1}) is not the target's "
                         f"({target.sliding_window})")


class MaskedEmbedder(nn.Module):
    """Logits over the tokens of the ``top_k`` best centroids only (the rest below every one of them)."""

    def __init__(self, config: Gemma4AssistantConfig) -> None:
        super().__init__()
        self.top_k = config.centroid_intermediate_top_k
        self.num_centroids = config.num_centroids
        self.centroids = nn.Linear(config.text.hidden_size, config.num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.zeros(config.vocab_size, dtype=torch.long))

    def forward(self, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        n, vocab = hidden.shape[0], head.shape[0]
        top = self.centroids(hidden).topk(self.top_k, dim=-1).indices  # [N, top_k]
        tokens = self.token_ordering.view(self.num_centroids, -1)[top].reshape(n, -1)  # [N, top_k * V/C]
        selected = torch.einsum("nh,nkh->nk", hidden, head[tokens])
        floor = selected.min() - 1.0  # as the reference: one below the batch's lowest selected logit
        return torch.full((n, vocab), floor.item(), dtype=hidden.dtype, device=hidden.device).scatter_(
            -1, tokens, selected)


class AssistantDecoder(nn.Module):
    """The ``model.`` prefix of the checkpoint: the token table (the tied head), layers and final norm."""

    def __init__(self, config: Gemma4Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = Norm(config.hidden_size, config.rms_norm_eps)


class Gemma4AssistantModel(nn.Module):
    """One drafting step for N seats over the target's KV caches (``forward``)."""

    def __init__(self, config: Gemma4AssistantConfig) -> None:
        super().__init__()
        self.config = config
        h, b = config.text.hidden_size, config.backbone_hidden_size
        self.model = AssistantDecoder(config.text)
        self.pre_projection = nn.Linear(2 * b, h, bias=False)
        self.post_projection = nn.Linear(h, b, bias=False)
        self.masked_embedding = MaskedEmbedder(config) if config.use_ordered_embeddings else None

    def _cos_sin(self, layer: int, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[:, None].float() * inv_freq(self.config.text.layers[layer]).to(positions.device)[None, :]
        emb = torch.cat((angles, angles), dim=-1)[:, None, :]  # [N, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, token_embeds: torch.Tensor, target_hidden: torch.Tensor, positions: torch.Tensor,
                attn: AttnMetadata, kv_by_kind: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``token_embeds [N, B]`` (the target's scaled embedding of each seat's last token) and
        ``target_hidden [N, B]``, at ``positions [N]``; ``attn`` has one query per seat over the context
        before it. Returns ``(logits [N, V] float32, the next step's hidden [N, B])``."""
        x = self.pre_projection(torch.cat([token_embeds, target_hidden], dim=-1))  # [N, H]
        tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(self.model.layers):
            s = self.config.text.layers[i]
            key = (s.head_dim, s.rope_theta, s.rotary_fraction)
            if key not in tables:
                tables[key] = self._cos_sin(i, positions, x.dtype)
            x = layer(x, None, *tables[key], attn, kv_by_kind[s.kind])
        x = self.model.norm(x)
        head = self.model.embed_tokens.weight
        if self.masked_embedding is not None:
            logits = self.masked_embedding(x, head)
        else:
            logits = F.linear(x, head)
        return logits.float(), self.post_projection(x)
