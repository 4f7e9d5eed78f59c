"""Load a Hugging Face checkpoint directory (config.json, safetensors, tokenizer files)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.common.layers.moe import fuse_expert_state
from ifb_plugins.common.chat.tokenizer import TextTokenizer

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def safetensors_files(path: str | Path) -> list[Path]:
    """The weight files of a checkpoint: the shards its index names, or the single file."""
    path = Path(path)
    if (path / _INDEX).exists():
        index = json.loads((path / _INDEX).read_text())
        return [path / name for name in sorted(set(index["weight_map"].values()))]
    if (path / _SINGLE).exists():
        return [path / _SINGLE]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no safetensors weights in {path}")
    return found


def load_hf_state_dict(path: str | Path, *, keeps_integers: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint in float32 (our reference numerics); with ``keeps_integers``, integer
    ones (indices, such as a token ordering) as they are."""
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        for name, tensor in load_file(str(file)).items():
            state[name] = tensor if keeps_integers and not tensor.is_floating_point() else tensor.float()
    return state


def load_hf_dir(path: str | Path) -> tuple[TextModelConfig, dict[str, torch.Tensor], TextTokenizer]:
    """Read a HF directory: ``(config, float32 state dict, tokenizer)``.

    Mixture-of-experts weights come back in the layout ``moe.SparseMoE`` loads, whether the
    checkpoint stores one tensor per expert (as ``save_pretrained`` writes them by default)
    or transformers 5's fused ``experts.gate_up_proj`` / ``experts.down_proj``.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint: config.json is missing")
    config = TextModelConfig.from_hf_config(json.loads(config_file.read_text()))
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
    tokenizer = TextTokenizer.from_hf_dir(path, extra_eos_ids=config.eos_token_ids)
    state = load_hf_state_dict(path)
    if config.num_experts:
        state = fuse_expert_state(state)
    return config, state, tokenizer
