"""The text runtime's drafter, built from the configured speculative decoding (``speculation``)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ifb.capabilities import DeployConfig
from ifb.speculative import SpeculationCaps
from ifb_plugins.common.loading.checkpoint import load_checkpoint
from ifb_plugins.common.models.decoder import TextModel, allocate_kv_cache
from ifb_plugins.common.runtime.text import TextRuntime
from ifb_plugins.common.speculative.draft_model import DraftModelDrafter
from ifb_plugins.common.speculative.drafter import Drafter
from ifb_plugins.common.speculative.ngram import NgramDrafter
from ifb_plugins.text.speculation import ngram_range, with_draft_cost

log = logging.getLogger("ifb.text")


class VocabularyMismatch(ValueError):
    """A draft model whose vocabulary is not the target's: its tokens would mean other things."""


def streamed_bytes(model: TextModel) -> int:
    """The weight bytes a decode step reads: every parameter and buffer but the embedding table (a step
    gathers a few of its rows), unless the output head is that table."""
    def tensors(module) -> dict[int, torch.Tensor]:
        return {id(t): t for t in (*module.parameters(), *module.buffers()) if t.device.type != "meta"}

    every, embed = tensors(model), tensors(model.model.embed_tokens)
    head = tensors(model.head) if model.head is not None else {}
    if not (model.config.tie_word_embeddings and model.head is None):
        every = {i: t for i, t in every.items() if i not in embed or i in head}
    return sum(t.numel() * t.element_size() for t in every.values())


def build_drafter(config: DeployConfig, caps: SpeculationCaps, runtime: TextRuntime) -> tuple[Drafter, SpeculationCaps]:
    """The drafter ``caps`` names for ``runtime``, and ``caps`` with what loading it measured."""
    if caps.method == "ngram":
        low, high = ngram_range(config)
        return NgramDrafter(low, high), caps
    from ifb_plugins.common.runtime.placement import weights_dtype
    from ifb_plugins.text.build import build_text_model, kv_cache_dtype, model_name_for
    from ifb_plugins.text.default_model import resolve_model

    name = config.options["speculative_model"]
    path = Path(resolve_model(name))
    mode = config.options.get("speculative_quantization") or "int8"
    loaded = load_checkpoint(path, defer_quantized=mode != "none")
    if loaded.config.vocab_size != runtime.vocab_size:
        raise VocabularyMismatch(
            f"the draft model {name} has a vocabulary of {loaded.config.vocab_size} tokens, the target "
            f"{runtime.model_name} one of {runtime.vocab_size}: a draft model must share the target's vocabulary")
    # the draft runs where the target runs, in the target's dtype (a CUDA device: the Triton kernels)
    dtype = weights_dtype(config)
    model, prepared = build_text_model(loaded, mode, has_lora=False, device=runtime.device, dtype=dtype)
    model = model.to(runtime.device)
    kv_dtype = kv_cache_dtype(DeployConfig(), mode, prepared, dtype)
    # the draft's KV sits in the same block ids as the target's: same count, same size
    caches = allocate_kv_cache(model.config, runtime.num_kv_blocks, runtime.kv_block_size, dtype=kv_dtype,
                               device=runtime.device)
    description = f"draft model {model_name_for(path)} ({prepared.description})"
    drafter = DraftModelDrafter(model, caches, runtime.kv_block_size, description=description,
                                argmax=prepared.argmax)
    # a decode step on a CPU streams its weights: a drafted token costs about their ratio of a target step
    cost = streamed_bytes(model) / max(1, streamed_bytes(runtime.model))
    log.info("speculative decoding: %s, %d layers; a draft token costs ~%.2f of a target step", description,
             model.config.num_layers, cost)
    return drafter, with_draft_cost(caps, config, cost, description)
