"""Build a TextRuntime from a deploy configuration."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import attrs
import torch

from ifb.capabilities import DeployConfig, DeploymentCaps
from ifb_plugins.common.loading.checkpoint import LoadedCheckpoint, build_model, load_checkpoint
from ifb_plugins.common.runtime.lora import LoraSet
from ifb_plugins.common.models.decoder import TextModel
from ifb_plugins.common.runtime.text import TextRuntime

log = logging.getLogger("ifb.text")

#: the native kernels' activations in each mode that runs the GGUF's blocks
_ACTIVATIONS = {"auto": "int16", "int8": "int8", "weights-only": "float32"}
#: values of ``DeployConfig.options["quantization"]``: those, and ``none`` (float32 weights)
QUANTIZATION_MODES = (*_ACTIVATIONS, "none")
#: values of ``DeployConfig.options["kv_cache_dtype"]``
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16}


def model_name_for(path: Path) -> str:
    return path.stem if path.is_file() else path.name


def mode_for_activations(activations: str) -> str:
    """The quantization mode whose native kernels take ``activations``."""
    return next(mode for mode, a in _ACTIVATIONS.items() if a == activations)


def quantization_mode(config: DeployConfig) -> str:
    """How a GGUF's matrices run: ``auto`` (the default: its blocks times activations quantized
    to about 15 bits per block of 32), ``int8`` (times 8-bit activations, as llama.cpp: faster,
    coarser), ``weights-only`` (times float32 activations: the float32 model's results up to
    summation order) or ``none`` (dequantized to float32)."""
    mode = config.options.get("quantization") or "auto"
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, not {mode!r}")
    return mode


@attrs.frozen
class PreparedModel:
    """How ``prepare_model`` left the model."""

    description: str
    #: the matmuls run on the native kernels' threads (see ``TextRuntime.step_torch_threads``)
    is_native: bool = False
    #: the native kernels' greedy pick over a batch of logits (see ``sampling.sample``), or None
    argmax: Callable[[torch.Tensor], list[int]] | None = None


def prepare_model(model: TextModel, loaded: LoadedCheckpoint, mode: str, *, has_lora: bool) -> PreparedModel:
    """Move ``model``'s quantized GGUF matrices onto block matmuls (in place) when ``mode`` allows.

    LoRA adapters hook the float32 projections by name, so a deployment with
    adapters keeps the model as loaded.
    """
    if has_lora:
        return PreparedModel("float32 (LoRA adapters registered)")
    if mode != "none" and loaded.source == "gguf":
        from ifb_plugins.common.quant import kernels as qkernels, linear as quant
        from ifb_plugins.common.loading.gguf import read_gguf_tensors
        from ifb_plugins.common.models.native_decoder import use_native_decoder

        report = quant.quantize_model(model, read_gguf_tensors(loaded.path), activations=_ACTIVATIONS[mode])
        kernels = qkernels.load() if report.backend == "native" and report.num_quantized else None
        if kernels is not None:
            kernels.set_num_threads(torch.get_num_threads())
            quant.use_native_attention(model, kernels)
            if model.config.has_moe:
                # the native decoder runs dense layer stacks only: each layer's forward runs from Python,
                # its matmuls (every routed expert's included) and attention on the native kernels
                log.info("mixture-of-experts layers: the layer loop runs in Python, not the native decoder; "
                         "matmuls and attention run on the native kernels")
                return PreparedModel(report.describe() + "; mixture-of-experts layers driven from Python",
                                     is_native=True, argmax=kernels.argmax)
            if use_native_decoder(model, kernels):
                return PreparedModel(report.describe() + "; layers run natively", is_native=True,
                                     argmax=kernels.argmax)
            return PreparedModel(report.describe(), is_native=True, argmax=kernels.argmax)
        return PreparedModel(report.describe())
    return PreparedModel("float32")


def kv_cache_dtype(config: DeployConfig, mode: str, prepared: PreparedModel) -> torch.dtype:
    """The KV cache's dtype: ``kv_cache_dtype`` if set, else (``auto``) float16 where the native
    kernels run the model with integer activations, whose attention reads float16 at half the
    bytes per context token, and float32 everywhere else (the float32-exact modes included)."""
    choice = config.options.get("kv_cache_dtype") or "auto"
    if choice not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {choice!r}")
    dtype = KV_CACHE_DTYPES[choice]
    if dtype is None:
        dtype = torch.float16 if prepared.is_native and _ACTIVATIONS.get(mode) in ("int16", "int8") else torch.float32
    return dtype


def load_text_runtime(config: DeployConfig, caps: DeploymentCaps) -> TextRuntime:
    path = Path(config.model)
    from ifb_plugins.text.families import family_of_dir, load_family_runtime

    if path.is_dir() and family_of_dir(path):  # Gemma 4 text, gpt-oss: model modules of their own
        return load_family_runtime(config, caps)
    mode = quantization_mode(config)
    adapters = dict(config.options.get("lora_adapters") or {})
    # the matrices that go onto blocks are never dequantized: a deferred one still needed afterwards
    # (a type with no block path, or a float32 deployment after all) is read in float32 then
    loaded = load_checkpoint(path, defer_quantized=mode != "none" and not adapters)
    model = build_model(loaded, dtype=torch.float32)
    name = config.options.get("served_model_name") or model_name_for(path)
    prepared = prepare_model(model, loaded, mode, has_lora=bool(adapters))
    if loaded.deferred:
        from ifb_plugins.common.loading.gguf import materialize

        materialize(model, loaded.path, loaded.deferred)
    lora = LoraSet(model, adapters)
    kv_dtype = kv_cache_dtype(config, mode, prepared)
    log.info("loaded %s (%s, %d layers, hidden %d; %s; %s KV cache)", name, loaded.source, loaded.config.num_layers,
             loaded.config.hidden_size, prepared.description, str(kv_dtype).removeprefix("torch."))
    runtime = TextRuntime(model=model, tokenizer=loaded.tokenizer, caps=caps, config=config, model_name=name,
                          lora=lora, kv_dtype=kv_dtype)
    if prepared.is_native:
        runtime.step_torch_threads = 1
    runtime.greedy_argmax = prepared.argmax
    return runtime
