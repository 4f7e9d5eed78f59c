"""Reading a multimodal checkpoint directory: its configs, its weights under either layout, its tokenizer.

transformers 5 saves the decoder as ``language_model.model.*`` and the towers
without their old ``vision_model.`` level; the hub's older checkpoints nest the
tower (``vision_tower.vision_model.*``); an in-memory state dict says
``model.language_model.*``. ``split_state`` maps every spelling of a part to the
same names and refuses weights that belong to no part. The processor's settings come from the
shared reader (``ProcessorFiles``, either file, as transformers reads them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import attrs
import torch
from torch import nn

from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.common.loading.hf import load_hf_state_dict
from ifb_plugins.common.loading.checkpoint import LoadedCheckpoint, build_model
from ifb_plugins.common.models.decoder import TextModel
from ifb_plugins.common.chat.tokenizer import TextTokenizer
from ifb_plugins.common.loading.processor import ProcessorFiles  # noqa: F401 (the loaders here take it from this module)

#: the decoder's weight prefixes, each with what it becomes in ``TextModel``'s names
TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                 ("model.language_model.", "model."), ("language_model.", "model."), ("lm_head.", "lm_head."))
#: Idefics3's and SmolVLM's decoder
TEXT_MODEL_PREFIXES = (("model.text_model.", "model."), ("lm_head.", "lm_head."))


_LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6}
#: what transformers' config classes assume for the keys a hub ``text_config`` leaves out (llava-1.5's lists
#: little more than its model_type and vocabulary)
TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA_DEFAULTS,
    "mistral": {**_LLAMA_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": {**_LLAMA_DEFAULTS, "vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768},
}


def with_text_defaults(text_config: Mapping[str, Any]) -> dict[str, Any]:
    """``text_config`` completed with its model type's defaults (llama when it names none)."""
    model_type = text_config.get("model_type", "llama")
    return {"model_type": model_type, **TEXT_DEFAULTS.get(model_type, {}), **text_config}


def read_json(path: Path, name: str) -> dict[str, Any]:
    file = path / name
    return json.loads(file.read_text()) if file.exists() else {}


def split_state(state: Mapping[str, torch.Tensor], parts: Mapping[str, Sequence[str]], where: str = "checkpoint",
                text_prefixes: Sequence[tuple[str, str]] = TEXT_PREFIXES) -> dict[str, dict[str, torch.Tensor]]:
    """Group the weights by part: ``parts`` maps a part to its prefixes (any layout), which are stripped.

    The decoder is the part ``"text"`` (``text_prefixes``, renamed to ``TextModel``'s names). A weight
    in no part is an error. Longer prefixes go first in ``parts`` (``vision_tower.vision_model.``
    before ``vision_tower.``).
    """
    out: dict[str, dict[str, torch.Tensor]] = {"text": {}, **{p: {} for p in parts}}
    stray = []
    for name, tensor in state.items():
        for prefix, renamed in text_prefixes:
            if name.startswith(prefix):
                out["text"][renamed + name[len(prefix):]] = tensor
                break
        else:
            for part, prefixes in parts.items():
                prefix = next((p for p in prefixes if name.startswith(p)), None)
                if prefix is not None:
                    out[part][name[len(prefix):]] = tensor
                    break
            else:
                stray.append(name)
    if stray:
        raise ValueError(f"{where}: unexpected weights outside the model's parts: {', '.join(sorted(stray)[:5])}")
    return out


def load_module(module: nn.Module, state: Mapping[str, torch.Tensor], where: str,
                device: torch.device) -> nn.Module:
    """Load ``state`` into a module built on the meta device, strictly; float32, eval mode."""
    expected = set(module.state_dict())
    missing, extra = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or extra:
        detail = "; ".join(x for x in (f"missing {', '.join(missing[:5])}" if missing else "",
                                       f"unexpected {', '.join(extra[:5])}" if extra else "") if x)
        raise ValueError(f"{where}: the weights do not match the config: {detail}")
    module.load_state_dict(dict(state), strict=True, assign=True)
    return module.float().eval().to(device)


def load_text_model(text_config: Mapping[str, Any], state: dict[str, torch.Tensor], tokenizer: TextTokenizer,
                    path: Path, device: torch.device, *, tie_word_embeddings: bool = False) -> TextModel:
    """The decoder, built by the shared layer; ``tie_word_embeddings`` is the outer config's flag."""
    if not state:
        raise ValueError(f"{path}: no language model weights (language_model.*)")
    config = TextModelConfig.from_hf_config(with_text_defaults(text_config))
    if tie_word_embeddings and "lm_head.weight" not in state and not config.tie_word_embeddings:
        config = attrs.evolve(config, tie_word_embeddings=True)
    return build_model(LoadedCheckpoint(config, state, tokenizer, "hf", path), device=device)


def load_state(path: Path) -> dict[str, torch.Tensor]:
    return load_hf_state_dict(path)


def load_tokenizer(path: Path, text_config: Mapping[str, Any], processor: Mapping[str, Any]) -> TextTokenizer:
    """The checkpoint's tokenizer, with the processor's chat template where it has one (it renders media)."""
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
    eos = text_config.get("eos_token_id")
    eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
    tokenizer = TextTokenizer.from_hf_dir(path, extra_eos_ids=eos_ids)
    template = processor.get("chat_template") or read_json(path, "chat_template.json").get("chat_template")
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def special_token_id(tokenizer: TextTokenizer, token: str | int, what: str) -> int:
    """The id of a placeholder token: an added token that encodes as itself alone, so that rendered
    prompts split around it and plain text never turns into it."""
    added = tokenizer.tokenizer.get_added_tokens_decoder()
    token_id = tokenizer.tokenizer.token_to_id(token) if isinstance(token, str) else int(token)
    text = tokenizer.id_to_token(token_id) if token_id is not None else None
    if token_id not in added or text is None or tokenizer.encode(text, add_special_tokens=False) != [token_id]:
        raise ValueError(f"{what} {token!r} is not a special token of the tokenizer")
    return token_id
