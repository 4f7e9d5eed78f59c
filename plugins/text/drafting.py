"""The text runtime's drafter, built from the configured speculative decoding (``speculation``)."""

from __future__ import annotations

import json
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


def streamed_bytes(model: torch.nn.Module) -> int:
    """The weight bytes a decode step reads: every parameter and buffer but the embedding table (a step
    gathers a few of its rows), unless the output head is that table."""
    def tensors(module) -> dict[int, torch.Tensor]:
        return {id(t): t for t in (*module.parameters(), *module.buffers()) if t.device.type != "meta"}

    every, embed = tensors(model), tensors(model.model.embed_tokens)
    own_head = getattr(model, "head", None)
    head = tensors(own_head) if own_head is not None else {}
    if not (getattr(model.config, "tie_word_embeddings", True) and own_head is None):
        every = {i: t for i, t in every.items() if i not in embed or i in head}
    return sum(t.numel() * t.element_size() for t in every.values())


def is_assistant_dir(path: Path) -> bool:
    """A Hugging Face directory of a drafter fed with its target's hidden state (Gemma 4's assistant)."""
    try:
        return json.loads((path / "config.json").read_text()).get("model_type") == "gemma4_assistant"
    except (OSError, ValueError, AttributeError):
        return False


def _assistant_drafter(path: Path, caps: SpeculationCaps, config: DeployConfig,
                       runtime: TextRuntime) -> tuple[Drafter, SpeculationCaps]:
    """Gemma 4's assistant drafting for its Gemma 4 target, over the target's own KV caches."""
    from ifb_plugins.common.loading.hf import load_hf_state_dict
    from ifb_plugins.common.models.gemma4 import Gemma4Model
    from ifb_plugins.common.models.gemma4_assistant import (Gemma4AssistantConfig, Gemma4AssistantModel,
                                                            check_fits, target_kv_layers)
    from ifb_plugins.common.speculative.assistant import AssistantDrafter
    from ifb_plugins.text.families import load_module

    target = runtime.model
    if not isinstance(target, Gemma4Model):
        raise ValueError(f"{path.name} is a Gemma 4 assistant: it drafts for a Gemma 4 target, not for "
                         f"{type(target).__name__}")
    assistant_config = Gemma4AssistantConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    if assistant_config.vocab_size != runtime.vocab_size:
        raise VocabularyMismatch(
            f"the draft model {path.name} has a vocabulary of {assistant_config.vocab_size} tokens, the target "
            f"{runtime.model_name} one of {runtime.vocab_size}: a draft model must share the target's vocabulary")
    check_fits(assistant_config, target.config)
    state = load_hf_state_dict(path, keeps_integers=True)  # its token ordering is an index
    assistant = load_module(Gemma4AssistantModel, assistant_config, state, path, runtime.device)
    table, scale = target.model.embed_tokens, target.config.hidden_size ** 0.5

    def embed(ids: torch.Tensor) -> torch.Tensor:  # as the target scales its input embedding
        e = table(ids)
        return e * torch.tensor(scale, dtype=e.dtype)

    kv = {kind: runtime.kv_caches[i] for kind, i in target_kv_layers(target.config).items()}
    description = f"Gemma 4 assistant {path.name} ({assistant_config.text.num_layers} layers)"
    drafter = AssistantDrafter(assistant, embed, kv, runtime.kv_block_size, description=description)
    cost = streamed_bytes(assistant) / max(1, streamed_bytes(target))
    log.info("speculative decoding: %s; a draft token costs ~%.2f of a target step", description, cost)
    return drafter, with_draft_cost(caps, config, cost, description)


def build_drafter(config: DeployConfig, caps: SpeculationCaps, runtime: TextRuntime) -> tuple[Drafter, SpeculationCaps]:
    """The drafter ``caps`` names for ``runtime``, and ``caps`` with what loading it measured."""
    if caps.method == "ngram":
        low, high = ngram_range(config)
        return NgramDrafter(low, high), caps
    from ifb_plugins.text.build import build_text_model, kv_cache_dtype, model_name_for
    from ifb_plugins.text.default_model import resolve_model

    name = config.options["speculative_model"]
    path = Path(resolve_model(name))
    if is_assistant_dir(path):
        return _assistant_drafter(path, caps, config, runtime)
    mode = config.options.get("speculative_quantization") or "int8"
    loaded = load_checkpoint(path, defer_quantized=mode != "none")
    if loaded.config.vocab_size != runtime.vocab_size:
        raise VocabularyMismatch(
            f"the draft model {name} has a vocabulary of {loaded.config.vocab_size} tokens, the target "
            f"{runtime.model_name} one of {runtime.vocab_size}: a draft model must share the target's vocabulary")
    model, prepared = build_text_model(loaded, mode, has_lora=False)
    model = model.to(runtime.device)
    kv_dtype = kv_cache_dtype(DeployConfig(), mode, prepared)
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
