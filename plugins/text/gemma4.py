"""Load a Gemma 4 text checkpoint (``Gemma4ForCausalLM``, as transformers saves it) into a ``TextRuntime``.

The model is the shared layer's family module (``ifb_plugins.common.models.gemma4``);
everything else (paging, prefix reuse, sampling, chat) is the text runtime's.
The weights run in float32; GGUF files of Gemma 4 are not read.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ifb.capabilities import DeployConfig, DeploymentCaps
from ifb_plugins.common.chat.tokenizer import TextTokenizer
from ifb_plugins.common.loading.hf import load_hf_state_dict
from ifb_plugins.common.models.gemma4 import Gemma4Config, Gemma4Model
from ifb_plugins.common.runtime.text import TextRuntime

log = logging.getLogger("ifb.text")


def is_gemma4_dir(path: Path) -> bool:
    """A Hugging Face directory whose config.json names a Gemma 4 model."""
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(model_type, str) and model_type.startswith("gemma4")


def build_gemma4(path: Path, device: torch.device | str = "cpu") -> tuple[Gemma4Model, TextTokenizer]:
    raw = json.loads((path / "config.json").read_text())
    if raw.get("model_type") != "gemma4_text":
        raise ValueError(f"model_type {raw.get('model_type')!r} is not served by the text plugin: only "
                         "gemma4_text (Gemma4ForCausalLM); the image/audio model's towers are not built")
    config = Gemma4Config.from_hf_config(raw)
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
    tokenizer = TextTokenizer.from_hf_dir(path, extra_eos_ids=config.eos_token_ids)
    state = {k.removeprefix("model.language_model.").removeprefix("model."): v
             for k, v in load_hf_state_dict(path).items()}
    state = {("lm_head." + k[len("lm_head."):]) if k.startswith("lm_head.") else "model." + k: v
             for k, v in state.items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = Gemma4Model(config)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise ValueError(f"{path}: the weights do not match the config: {exc}") from None
    return model.to(device=device, dtype=torch.float32).eval(), tokenizer


def load_gemma4_runtime(config: DeployConfig, caps: DeploymentCaps) -> TextRuntime:
    path = Path(config.model)
    model, tokenizer = build_gemma4(path, str(config.options.get("device") or "cpu"))
    name = config.options.get("served_model_name") or path.name
    log.info("loaded %s (Gemma 4, %d layers, hidden %d; float32)", name, model.config.num_layers,
             model.config.hidden_size)
    return TextRuntime(model=model, tokenizer=tokenizer, caps=caps, config=config, model_name=name)
