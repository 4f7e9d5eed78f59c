"""The model families the vlm plugin serves, chosen from a checkpoint's ``config.json``.

A family turns one checkpoint directory into a ``LoadedVlm``: the shared text
decoder (``ifb_plugins.common``'s ``TextModel``, built with ``build_model``),
the tokenizer (with the processor's chat template), and one ``MediaEncoder`` per
modality it takes ("image", "audio").

The interface a family implements:

- ``Family(name, architectures, load)``: ``load(path, device) -> LoadedVlm``;
  the family is picked when ``config.json``'s ``architectures`` (or, without
  them, ``model_type``) names one of its ``architectures`` / ``model_types``.
- ``MediaEncoder.encode(item) -> EncodedMedia`` runs the model's own processor
  on one decoded media item (resizing, rescaling, normalizing, tiling, log-mel
  features) and its encoder and projector on the result. The chat template
  renders one placeholder token (``MediaEncoder.placeholder_id``) per media
  item; ``EncodedMedia.token_ids`` is what the processor expands that one
  token into, wrapper tokens included, and ``EncodedMedia.embeds [N, H]``
  replaces the rows whose id is ``EncodedMedia.embed_token_id`` (N of them, in
  order), as the model's ``masked_scatter`` does.
- ``EncodedMedia.importance [N]``: how much each embedding row matters, for
  the visual-token pruner (None: the rows cannot be pruned, e.g. audio).
- ``EncodedMedia.position_ids``: None for every family here (the decoder's
  positions are the prompt positions). A family with multi-axis rotary
  positions (M-RoPE) returns ``[3, len(token_ids)]`` ids, the positions of its
  tokens relative to the span's first one; the runtime keeps them in
  the prepared state's ``MediaState.positions`` (from ``[(first prompt index, ids)]``
  after pruning, which cuts their columns with the tokens) for the decoder.

Register a family by adding its ``FAMILY`` to ``FAMILIES`` below; the
runtime (``runtime.VlmRuntime``) needs nothing else from it.

An architecture no family knows is refused at load, naming the supported ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch

from ifb_plugins.vlm import gemma4, idefics3, llava, qwen2_5_vl, qwen2_audio, qwen3_asr, qwen3_vl
from ifb_plugins.vlm.interface import EncodedMedia, Family, LoadedVlm, MediaEncoder

__all__ = ["FAMILIES", "EncodedMedia", "Family", "LoadedVlm", "MediaEncoder", "family_for", "load_vlm"]

#: every family the plugin serves
FAMILIES: tuple[Family, ...] = (llava.FAMILY, idefics3.FAMILY, qwen2_5_vl.FAMILY, qwen3_vl.FAMILY,
                                qwen2_audio.FAMILY, qwen3_asr.FAMILY, gemma4.FAMILY)


def family_for(config: Mapping, families: tuple[Family, ...] = FAMILIES) -> Family:
    """The family that serves a parsed ``config.json`` (ValueError naming the supported ones otherwise)."""
    archs = list(config.get("architectures") or [])
    for family in families:
        if any(a in family.architectures for a in archs):
            return family
    if not archs:
        model_type = config.get("model_type")
        for family in families:
            if model_type in family.model_types:
                return family
    named = ", ".join(archs) or f"model_type {config.get('model_type')!r}"
    supported = ", ".join(a for f in families for a in f.architectures)
    raise ValueError(f"the vlm plugin does not serve {named} (supported: {supported})")


def load_vlm(path: str | Path, device: torch.device | str = "cpu") -> LoadedVlm:
    """Load a multimodal Hugging Face checkpoint directory with the family its config names."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (the vlm plugin loads Hugging Face "
                                "safetensors directories)")
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint: config.json is missing")
    family = family_for(json.loads(config_file.read_text()))
    return family.load(path, torch.device(device))
