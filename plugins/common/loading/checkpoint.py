"""One entry point for checkpoints: a ``.gguf`` file or a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Literal, TypeVar

import attrs
import torch

from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.common.loading.gguf import GGUFTensor, read_gguf_mapped
from ifb_plugins.common.loading.hf import load_hf_dir
from ifb_plugins.common.models.decoder import TextModel
from ifb_plugins.common.models.parts import ModelParts
from ifb_plugins.common.chat.tokenizer import TextTokenizer

M = TypeVar("M", bound=torch.nn.Module)


@attrs.frozen
class LoadedCheckpoint:
    """What a checkpoint holds, format-independent: build the model from it with ``build_model``."""

    config: TextModelConfig
    state_dict: dict[str, torch.Tensor] = attrs.field(eq=False, repr=False)
    tokenizer: TextTokenizer = attrs.field(eq=False, repr=False)
    source: Literal["gguf", "hf"]
    path: Path
    #: state-dict names left unread (``load_gguf(defer_quantized=True)``): fill what the model still
    #: needs with ``loading.gguf.materialize`` once it is built (its parts may have put them on blocks)
    deferred: frozenset[str] = frozenset()
    #: a GGUF's tensors as stored, over the map the state dict was read from (``read_gguf_mapped``)
    tensors: dict[str, GGUFTensor] | None = attrs.field(default=None, eq=False, repr=False)


def load_checkpoint(path: str | Path, *, defer_quantized: bool = False) -> LoadedCheckpoint:
    """Read a ``.gguf`` file or a HF safetensors directory into a ``LoadedCheckpoint``.

    ``defer_quantized`` (GGUF only): see ``gguf_loader.load_gguf``."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        config, state_dict, meta, deferred, tensors = read_gguf_mapped(path, defer_quantized=defer_quantized)
        return LoadedCheckpoint(config, state_dict, TextTokenizer.from_gguf_metadata(meta), "gguf", path, deferred,
                                tensors)
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
    parts: ModelParts | None = None,
) -> TextModel:
    """Build ``TextModel(config, parts)`` and load the weights strictly (missing or extra names raise).

    ``parts`` (``models.parts``; by default the float32 torch modules) picks every module as
    the model is built; the weights its modules already hold (``parts.consumed``) are not loaded
    again, the rest are loaded by name.
    """
    return load_weights(loaded.config, loaded.state_dict, lambda: TextModel(loaded.config, parts),
                        parts, dtype=dtype, device=device)


def load_weights(config: TextModelConfig, state_dict: dict[str, torch.Tensor], build: Callable[[], M],
                 parts: ModelParts | None = None, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> M:
    """``build()`` a model on the meta device, then adopt the checkpoint's tensors as its weights.

    The modules ``parts`` built with their weights in place (GGUF blocks) keep them; every other
    parameter and buffer takes the tensor of its name (``assign``: no copy), strictly.
    """
    state = dict(state_dict)
    if config.tie_word_embeddings:
        # Some tied checkpoints still store a copy of the embedding as lm_head.
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = build()
    consumed = parts.consumed if parts is not None else set()
    built = {name: t for name, t in model.state_dict(keep_vars=True).items() if not t.is_meta}
    # the checkpoint's floating tensors in ``dtype`` (as they are when they already are: no copy);
    # what the parts built keeps its own dtypes (GGUF blocks, int4 scales in bfloat16)
    state = {name: t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
             for name, t in state.items() if name not in consumed}
    # assign=True adopts the loaded tensors instead of copying into meta placeholders.
    model.load_state_dict({**state, **built}, strict=True, assign=True)
    return model.to(device=device).eval()
