"""Load a Nemotron-H checkpoint directory (config.json, safetensors, tokenizer.json)."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import torch

from ifb_plugins.mamba.config import HybridConfig
from ifb_plugins.mamba.model import HybridModel
from ifb_plugins.common.hf_loader import load_hf_state_dict
from ifb_plugins.common.tokenizer import TextTokenizer


@attrs.frozen
class LoadedHybrid:
    config: HybridConfig
    state_dict: dict[str, torch.Tensor] = attrs.field(eq=False, repr=False)
    tokenizer: TextTokenizer = attrs.field(eq=False, repr=False)
    path: Path


def load_hybrid_dir(path: str | Path | None) -> LoadedHybrid:
    """Read a Hugging Face Nemotron-H directory into config, float32 weights and tokenizer."""
    if path is None:
        raise ValueError("the mamba plugin needs a local checkpoint directory (config.json, "
                         "model.safetensors, tokenizer.json); pass its path as the model")
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no such checkpoint directory: {path}")
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint: config.json is missing")
    config = HybridConfig.from_hf_config(json.loads(config_file.read_text()))
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
    tokenizer = TextTokenizer.from_hf_dir(path, extra_eos_ids=config.eos_token_ids)
    return LoadedHybrid(config, load_hf_state_dict(path), tokenizer, path)


def _our_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # transformers 5 renames ``backbone.`` to ``model.`` in memory; accept checkpoints saved that way.
    out = {}
    for name, tensor in state.items():
        if name.startswith("model."):
            name = "backbone." + name[len("model."):]
        out[name] = tensor
    return out


def build_hybrid_model(loaded: LoadedHybrid, device: torch.device | str = "cpu") -> HybridModel:
    """Instantiate ``HybridModel`` and load the weights strictly (missing or extra names raise)."""
    state = _our_names(loaded.state_dict)
    if loaded.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = HybridModel(loaded.config)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise ValueError(f"{loaded.path}: the weights do not match the config's layer pattern "
                         f"{loaded.config.pattern!r}: {exc}") from None
    model = model.to(device=device, dtype=torch.float32)
    # Per-token matmuls make CPU results independent of the batch; on CUDA the plain GEMMs run.
    model.set_row_invariant(torch.device(device).type == "cpu")
    return model.eval()
