"""One entry point for checkpoints: a ``.gguf`` file or a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import attrs
import torch

from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.common.loading.gguf import read_gguf
from ifb_plugins.common.loading.hf import load_hf_dir
from ifb_plugins.common.models.decoder import TextModel, rope_inv_freq
from ifb_plugins.common.chat.tokenizer import TextTokenizer


@attrs.frozen
class LoadedCheckpoint:
    """What a checkpoint holds, format-independent: build the model from it with ``build_model``."""

    config: TextModelConfig
    state_dict: dict[str, torch.Tensor] = attrs.field(eq=False, repr=False)
    tokenizer: TextTokenizer = attrs.field(eq=False, repr=False)
    source: Literal["gguf", "hf"]
    path: Path
    #: state-dict names left unread (``load_gguf(defer_quantized=True)``): fill what the model still
    #: needs with ``gguf_loader.materialize`` once the quantized matrices are on blocks
    deferred: frozenset[str] = frozenset()


def load_checkpoint(path: str | Path, *, defer_quantized: bool = False) -> LoadedCheckpoint:
    """Read a ``.gguf`` file or a HF safetensors directory into a ``LoadedCheckpoint``.

    ``defer_quantized`` (GGUF only): see ``gguf_loader.load_gguf``."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        config, state_dict, meta, deferred = read_gguf(path, defer_quantized=defer_quantized)
        return LoadedCheckpoint(config, state_dict, TextTokenizer.from_gguf_metadata(meta), "gguf", path, deferred)
    if path.is_dir():
        config, state_dict, tokenizer = load_hf_dir(path)
        return LoadedCheckpoint(config, state_dict, tokenizer, "hf", path)
    if not path.exists():
        raise FileNotFoundError(f"no such model file or directory: {path}")
    raise ValueError(f"{path} is neither a .gguf file nor a Hugging Face checkpoint directory")


def build_model(
    loaded: LoadedCheckpoint,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> TextModel:
    """Instantiate ``TextModel`` and load the weights strictly (missing or extra names raise)."""
    state = dict(loaded.state_dict)
    if loaded.config.tie_word_embeddings:
        # Some tied checkpoints still store a copy of the embedding as lm_head.
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = TextModel(loaded.config)
    # assign=True adopts the loaded tensors instead of copying into meta placeholders.
    model.load_state_dict(state, strict=True, assign=True)
    # The RoPE buffer is not in the state dict (it was built on meta); it must also
    # stay float32 whatever the model dtype, so it is set after the cast.
    model.inv_freq = torch.empty(0)
    model = model.to(device=device, dtype=dtype)
    model.inv_freq = rope_inv_freq(loaded.config).to(device)
    return model.eval()
