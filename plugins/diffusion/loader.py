"""Load a DiffusionGemma checkpoint directory as transformers' ``save_pretrained`` writes it.

The directory holds ``config.json``, ``model.safetensors`` (or shards),
``generation_config.json`` and the tokenizer's files. The encoder and the
denoiser are tied weight for weight, so the weights are stored once (under
``model.decoder.``); only each side's ``layer_scalar`` buffers are their own.
The vision tower is not loaded: this backbone reads text.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

import attrs
import torch

from ifb_plugins.common.loading.hf import load_hf_state_dict
from ifb_plugins.common.chat.tokenizer import TextTokenizer
from ifb_plugins.diffusion.config import DiffusionGemmaConfig, SamplerSettings
from ifb_plugins.diffusion.model import DiffusionGemmaModel

_DECODER = "model.decoder."
_ENCODER = "model.encoder.language_model."
_ENCODER_SCALAR = re.compile(r"model\.encoder\.language_model\.layers\.(\d+)\.layer_scalar")
#: the multimodal parts a text backbone leaves out
_SKIPPED = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")


@attrs.frozen
class LoadedDiffusion:
    config: DiffusionGemmaConfig
    settings: SamplerSettings
    model: DiffusionGemmaModel
    tokenizer: TextTokenizer


def backbone_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under ``DiffusionGemmaModel``'s names (ValueError on an untied encoder)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.startswith(_SKIPPED):
            continue
        if (m := _ENCODER_SCALAR.fullmatch(name)) is not None:
            out[f"layers.{m.group(1)}.encoder_layer_scalar"] = tensor
        elif name.startswith(_DECODER):
            out[name[len(_DECODER):]] = tensor
        elif name == "lm_head.weight":
            out[name] = tensor
        elif name.startswith(_ENCODER):
            twin = _DECODER + name[len(_ENCODER):]
            if twin in state and not torch.equal(state[twin], tensor):
                raise ValueError(f"{name} differs from {twin}: an untied encoder is not built")
            out.setdefault(name[len(_ENCODER):], tensor)
        else:
            raise ValueError(f"unexpected tensor {name} in a DiffusionGemma checkpoint")
    head = out.get("lm_head.weight")
    if head is not None and torch.equal(head, out.get("embed_tokens.weight", head[:0])):
        del out["lm_head.weight"]  # tied after all
    return out


def build_model(config: DiffusionGemmaConfig, state: Mapping[str, torch.Tensor]) -> DiffusionGemmaModel:
    model = DiffusionGemmaModel(config)
    mapped = backbone_state(state)
    if "lm_head.weight" in mapped:
        model.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    for i in range(config.num_layers):  # a checkpoint without the encoder's scalars uses the denoiser's
        mapped.setdefault(f"layers.{i}.encoder_layer_scalar", mapped.get(f"layers.{i}.layer_scalar", torch.ones(1)))
    missing, unexpected = model.load_state_dict(mapped, strict=False)
    if missing or unexpected:
        raise ValueError(f"the checkpoint does not fit DiffusionGemma: missing {sorted(missing)[:6]}, "
                         f"unexpected {sorted(unexpected)[:6]}")
    return model.eval()


def load_diffusion_dir(path: str | Path, sampler_overrides: Mapping[str, Any] | None = None) -> LoadedDiffusion:
    """Read a checkpoint directory into the backbone, its sampler settings and its tokenizer."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint: config.json is missing")
    config = DiffusionGemmaConfig.from_hf(json.loads((path / "config.json").read_text()))
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
    settings = SamplerSettings.from_dir(path, sampler_overrides)
    tokenizer = TextTokenizer.from_hf_dir(path, extra_eos_ids=settings.eos_token_ids or config.eos_token_ids)
    model = build_model(config, load_hf_state_dict(path))
    return LoadedDiffusion(config, settings, model, tokenizer)
