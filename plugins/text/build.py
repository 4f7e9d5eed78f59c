"""Build a TextRuntime from a deploy configuration."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ifb.capabilities import DeployConfig, DeploymentCaps
from ifb_plugins.text.loader import build_model, load_checkpoint
from ifb_plugins.text.lora import LoraSet
from ifb_plugins.text.runtime import TextRuntime

log = logging.getLogger("ifb.text")


def model_name_for(path: Path) -> str:
    return path.stem if path.is_file() else path.name


def load_text_runtime(config: DeployConfig, caps: DeploymentCaps) -> TextRuntime:
    path = Path(config.model)
    loaded = load_checkpoint(path)
    model = build_model(loaded, dtype=torch.float32)
    name = config.options.get("served_model_name") or model_name_for(path)
    lora = LoraSet(model, dict(config.options.get("lora_adapters") or {}))
    log.info("loaded %s (%s, %d layers, hidden %d)", name, loaded.source, loaded.config.num_layers,
             loaded.config.hidden_size)
    return TextRuntime(model=model, tokenizer=loaded.tokenizer, caps=caps, config=config, model_name=name, lora=lora)
