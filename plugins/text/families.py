"""Load the text families that are model modules of their own (Gemma 4 text, gpt-oss) into a ``TextRuntime``.

Their layers differ from the Llama-family ``TextModel`` (per-layer KV shapes,
KV sharing, attention sinks, sliding windows), so each is a shared-layer
module (``ifb_plugins.common.models.gemma4``, ``...gpt_oss``) with the same
step interface, laying out its own KV caches; paging, prefix reuse, sampling
and chat are the text runtime's. Hugging Face directories, and gpt-oss GGUF files as
llama.cpp's converter writes them (dequantized to float32); float32 throughout.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import attrs
import torch
from torch import nn

from ifb.capabilities import DeployConfig, DeploymentCaps
from ifb_plugins.common.chat.tokenizer import TextTokenizer
from ifb_plugins.common.loading.hf import load_hf_state_dict
from ifb_plugins.common.models.gemma4 import Gemma4Config, Gemma4Model
from ifb_plugins.common.models.gpt_oss import GptOssConfig, GptOssModel
from ifb_plugins.common.models.gpt_oss_gguf import read_gpt_oss_gguf
from ifb_plugins.common.runtime.placement import device_of, weights_dtype
from ifb_plugins.common.runtime.text import TextRuntime
from ifb_plugins.text.build import _ACTIVATIONS, quantization_mode

log = logging.getLogger("ifb.text")

#: model_type -> (config class, model class)
FAMILIES = {"gemma4_text": (Gemma4Config, Gemma4Model), "gpt_oss": (GptOssConfig, GptOssModel)}
#: model types of these families that are not served here, and why
_REFUSED = {
    "gemma4": "Gemma4ForConditionalGeneration, the image-text model: serve it with the vlm plugin",
    "gemma4_assistant": "a Gemma 4 assistant drafts for its Gemma 4 target: serve the target with "
                        "--speculative-model pointing at the assistant",
}


def family_of_dir(path: Path) -> str | None:
    """The ``model_type`` of a Hugging Face directory when it is one of these families (or refused)."""
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return model_type if model_type in FAMILIES or model_type in _REFUSED else None


def is_gpt_oss_gguf(path: Path) -> bool:
    """A ``.gguf`` file whose ``general.architecture`` is ``gpt-oss``."""
    if not (path.is_file() and path.suffix == ".gguf"):
        return False
    import gguf

    field = gguf.GGUFReader(str(path)).fields.get("general.architecture")
    return field is not None and bytes(field.parts[-1]).decode() == "gpt-oss"


def attention_backend(device, dtype: torch.dtype) -> str:
    """What computes a family model's attention, chosen as it is built: the Triton kernel on a CUDA
    device, the native kernel (window and sinks in C, float32) on a CPU that can build it, else torch."""
    if torch.device(device).type == "cuda":
        return "triton"
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        from ifb_plugins.common.quant import kernels

        if kernels.load() is not None:
            return "native"
        log.info("attention runs on torch: the native kernels are unavailable (see the warning above)")
    return "torch"


def load_module(model_cls, config, state: dict[str, torch.Tensor], path: Path, device,
                dtype: torch.dtype = torch.float32, **modules: object) -> nn.Module:
    """``model_cls(config, **modules)`` with ``state`` loaded strictly (a tied head's copy dropped), in
    ``dtype`` on ``device``; ``modules`` are parts built already (a GGUF's experts on blocks), whose own
    tensors are theirs."""
    if getattr(config, "tie_word_embeddings", True):
        state.pop("lm_head.weight", None)
    if "attention_backend" in attrs.fields_dict(type(config)):
        config = attrs.evolve(config, attention_backend=attention_backend(device, dtype))
    with torch.device("meta"):
        model = model_cls(config, **modules)
    built = {name: t for name, t in model.state_dict().items() if not t.is_meta}  # the parts' own tensors
    try:
        model.load_state_dict({**built, **state}, strict=True, assign=True)
    except RuntimeError as exc:
        raise ValueError(f"{path}: the weights do not match the config: {exc}") from None
    return model.to(device=device, dtype=dtype).eval()


def build_family_model(path: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                       quantization: str = "auto") -> tuple[nn.Module, TextTokenizer]:
    """The model (in ``dtype``, weights loaded strictly) and tokenizer of a Gemma 4 text or gpt-oss directory,
    or of a gpt-oss GGUF file: its block-typed experts on the native kernels with the activations of
    ``quantization`` (``build.QUANTIZATION_MODES``) on the CPU in float32, else dequantized."""
    if is_gpt_oss_gguf(path):
        on_blocks = torch.device(device).type == "cpu" and dtype == torch.float32 and quantization != "none"
        read = read_gpt_oss_gguf(path, _ACTIVATIONS[quantization] if on_blocks else None)
        modules = {} if read.experts is None else {"experts": read.experts}
        model = load_module(GptOssModel, read.config, read.state, path, device, dtype, **modules)
        return model, TextTokenizer.from_gguf_metadata(read.metadata, extra_eos_ids=read.config.eos_token_ids)
    raw = json.loads((path / "config.json").read_text())
    model_type = raw.get("model_type")
    if model_type in _REFUSED:
        raise ValueError(f"model_type {model_type!r} is not served by the text plugin ({_REFUSED[model_type]})")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not one of {', '.join(FAMILIES)}")
    config_cls, model_cls = FAMILIES[model_type]
    config = config_cls.from_hf_config(raw)
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
    tokenizer = TextTokenizer.from_hf_dir(path, extra_eos_ids=config.eos_token_ids)
    return load_module(model_cls, config, load_hf_state_dict(path), path, device, dtype), tokenizer


def load_family_runtime(config: DeployConfig, caps: DeploymentCaps) -> TextRuntime:
    path = Path(config.model)
    dtype = weights_dtype(config)
    model, tokenizer = build_family_model(path, device_of(config), dtype, quantization_mode(config))
    name = config.options.get("served_model_name") or (path.stem if path.is_file() else path.name)
    log.info("loaded %s (%s, %d layers, hidden %d; %s)", name, type(model).__name__, model.config.num_layers,
             model.config.hidden_size, str(dtype).removeprefix("torch."))
    runtime = TextRuntime(model=model, tokenizer=tokenizer, caps=caps, config=config, model_name=name)
    if caps.speculation is not None:
        from ifb_plugins.text.drafting import build_drafter

        runtime.drafter, speculation = build_drafter(config, caps.speculation, runtime)
        runtime.caps = attrs.evolve(caps, speculation=speculation)
    return runtime
