"""Load a hybrid checkpoint directory (config.json, safetensors, tokenizer.json) as transformers saves it.

Nemotron-H names its tensors as ``HybridModel`` does (``backbone.*``); Bamba
and Granite 4.0 hybrid use transformers' ``model.*`` names, which are
renamed onto ours. Granite's experts are read in both spellings transformers
uses: the saved ``block_sparse_moe.input_linear`` / ``output_linear`` /
``router.layer`` and the in-memory ``experts.gate_up_proj`` / ``down_proj`` /
``router``.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import attrs
import torch

from ifb_plugins.mamba.config import DELTANET, ConfigError, HybridConfig
from ifb_plugins.mamba.model import HybridModel
from ifb_plugins.common.layers.moe import fuse_expert_state
from ifb_plugins.common.loading.hf import load_hf_state_dict
from ifb_plugins.common.chat.tokenizer import TextTokenizer

log = logging.getLogger("ifb.mamba")


@attrs.frozen
class LoadedHybrid:
    config: HybridConfig
    state_dict: dict[str, torch.Tensor] = attrs.field(eq=False, repr=False)
    tokenizer: TextTokenizer = attrs.field(eq=False, repr=False)
    path: Path
    #: an image-text checkpoint's vision tower (``model.visual.*``, prefix stripped); None for a text model
    vision_state: dict[str, torch.Tensor] | None = attrs.field(default=None, eq=False, repr=False)
    #: that checkpoint's parsed config.json (its ``vision_config`` and image token ids)
    raw_config: dict | None = attrs.field(default=None, eq=False, repr=False)


#: an image-text checkpoint's parts as transformers 5 saves them (and as the model's modules name them)
_TEXT_PREFIX, _VISION_PREFIXES = "model.language_model.", ("model.visual.", "visual.")


def split_image_text(state: dict[str, torch.Tensor], where: Path) -> tuple[dict, dict]:
    """``(decoder, vision tower)`` weights: the decoder's under the text model's names (``model.*``,
    ``lm_head.*``), the tower's without their prefix. A weight in neither part is an error."""
    text, vision, stray = {}, {}, []
    for name, tensor in state.items():
        prefix = next((p for p in _VISION_PREFIXES if name.startswith(p)), None)
        if prefix is not None:
            vision[name[len(prefix):]] = tensor
        elif name.startswith(_TEXT_PREFIX):
            text["model." + name[len(_TEXT_PREFIX):]] = tensor
        elif name.startswith("lm_head."):
            text[name] = tensor
        else:
            stray.append(name)
    if stray or not vision:
        detail = f"unexpected weights {', '.join(sorted(stray)[:5])}" if stray else "no model.visual.* weights"
        raise ValueError(f"{where}: not an image-text checkpoint as transformers saves it: {detail}")
    return text, vision


def load_hybrid_dir(path: str | Path | None) -> LoadedHybrid:
    """Read a Hugging Face hybrid directory (or a llama.cpp GGUF file) into config, float32 weights and
    tokenizer."""
    if path is None:
        raise ValueError("the mamba plugin needs a local checkpoint directory (config.json, "
                         "model.safetensors, tokenizer.json) or a .gguf file; pass its path as the model")
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        from ifb_plugins.mamba.gguf_loader import load_hybrid_gguf

        config, state, meta = load_hybrid_gguf(path)
        return LoadedHybrid(config, state, TextTokenizer.from_gguf_metadata(meta), path)
    if not path.is_dir():
        raise FileNotFoundError(f"no such checkpoint directory: {path}")
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint: config.json is missing")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{config_file} is not valid JSON: {exc}") from None
    config = HybridConfig.from_hf_config(raw)
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
    tokenizer = TextTokenizer.from_hf_dir(path, extra_eos_ids=config.eos_token_ids)
    state = load_hf_state_dict(path)
    if "vision_config" not in raw:
        return LoadedHybrid(config, state, tokenizer, path)
    text, vision = split_image_text(state, path)
    return LoadedHybrid(config, text, tokenizer, path, vision_state=vision, raw_config=raw)


_LAYER = r"^model\.layers\.(\d+)\."
_SHARED_RENAMES = [
    (r"^model\.embed_tokens\.", "backbone.embeddings."),
    (_LAYER + r"input_layernorm\.", r"backbone.layers.\1.norm."),
    (_LAYER + r"(?:mamba|self_attn)\.", r"backbone.layers.\1.mixer."),
]
_RENAMES = {
    # transformers 5 renames ``backbone.`` to ``model.`` in memory; accept checkpoints saved that way.
    "nemotron_h": [(r"^model\.", "backbone.")],
    "bamba": _SHARED_RENAMES + [
        (r"^model\.final_layernorm\.", "backbone.norm_f."),
        (_LAYER + r"pre_ff_layernorm\.", r"backbone.layers.\1.ffn_norm."),
        (_LAYER + r"feed_forward\.", r"backbone.layers.\1.ffn."),
    ],
    "qwen3_5": [
        (r"^model\.embed_tokens\.", "backbone.embeddings."),
        (r"^model\.norm\.", "backbone.norm_f."),
        (_LAYER + r"input_layernorm\.", r"backbone.layers.\1.norm."),
        (_LAYER + r"(?:linear_attn|self_attn)\.", r"backbone.layers.\1.mixer."),
        (_LAYER + r"post_attention_layernorm\.", r"backbone.layers.\1.ffn_norm."),
        (_LAYER + r"mlp\.", r"backbone.layers.\1.ffn."),
    ],
    "granitemoehybrid": _SHARED_RENAMES + [
        (r"^model\.norm\.", "backbone.norm_f."),
        (_LAYER + r"post_attention_layernorm\.", r"backbone.layers.\1.ffn_norm."),
        (_LAYER + r"shared_mlp\.", r"backbone.layers.\1.ffn.shared."),
        (_LAYER + r"block_sparse_moe\.router\.(?:layer\.)?weight$", r"backbone.layers.\1.ffn.moe.router.weight"),
        (_LAYER + r"block_sparse_moe\.(?:input_linear\.weight|experts\.gate_up_proj)$",
         r"backbone.layers.\1.ffn.moe.gate_up_proj"),
        (_LAYER + r"block_sparse_moe\.(?:output_linear\.weight|experts\.down_proj)$",
         r"backbone.layers.\1.ffn.moe.down_proj"),
    ],
}


#: Nemotron-H MoE experts as transformers saves them (one tensor per expert and projection)
_PER_EXPERT = re.compile(r"(.*\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight")


def stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``mixer.experts.N.{up,down}_proj.weight`` stacked into ``mixer.experts.{up,down}_proj [E, ...]``
    (the layout transformers 5 holds in memory, which passes through)."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        if m := _PER_EXPERT.fullmatch(name):
            parts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = tensor
        else:
            out[name] = tensor
    for (prefix, part), experts in parts.items():
        if sorted(experts) != list(range(len(experts))):
            raise ValueError(f"{prefix}: expert {part} tensors are numbered {sorted(experts)}, not 0..N-1")
        out[f"{prefix}.{part}"] = torch.stack([experts[e] for e in range(len(experts))])
    return out


#: Qwen3.5's zero-centered RMSNorms (``x * (1 + weight)``): held as ``1 + weight``; the DeltaNet's gated
#: norm (``linear_attn.norm``) is a plain one
_ZERO_CENTERED = re.compile(r".*(?:input_layernorm|post_attention_layernorm|self_attn\.[qk]_norm)\.weight|"
                            r"model\.norm\.weight")


def our_names(family: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under ``HybridModel``'s parameter names (``A_log`` as ``A``)."""
    if family == "nemotron_h":
        state = stack_experts(state)
    if family == "qwen3_5":
        state = fuse_expert_state(state)  # Qwen3.5-MoE's per-expert tensors, stacked as SparseMoE's
        # transformers computes 1 + weight in float32 each call; once here gives the same bits
        state = {k: 1.0 + v.float() if _ZERO_CENTERED.fullmatch(k) else v for k, v in state.items()}
    rules = [(re.compile(pattern), repl) for pattern, repl in _RENAMES[family]]
    out = {}
    for name, tensor in state.items():
        for pattern, repl in rules:
            renamed = pattern.sub(repl, name, count=1)
            if renamed != name:
                name = renamed
                break
        if name.endswith(".mixer.A_log"):  # the model holds A = -exp(A_log), as GGUF files store it
            name, tensor = name[:-len("_log")], -torch.exp(tensor.float())
        out[name] = tensor
    return out


def build_hybrid_model(loaded: LoadedHybrid, device: torch.device | str = "cpu") -> HybridModel:
    """Instantiate ``HybridModel`` and load the weights strictly (missing or extra names raise)."""
    state = our_names(loaded.config.family, loaded.state_dict)
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
    # Tensors read in place sit at their file's offsets, and some CPU kernels' sums depend on a
    # tensor's alignment: each gets memory of its own (the allocator aligns it), so the same weights
    # give the same bits whichever file (safetensors, GGUF) they came from.
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.clone()
    # Per-token matmuls make CPU results independent of the batch; on CUDA the plain GEMMs run.
    model.set_row_invariant(torch.device(device).type == "cpu")
    if DELTANET in loaded.config.pattern:
        # The native whole-stack decoder runs layer stacks whose every projection is on GGUF blocks;
        # this plugin's weights are float32 tensors (its GGUF files are dequantized as they load), so
        # the float32 projections, not the recurrence's few tensor operations, bound a step.
        log.info("Gated DeltaNet layers run on the torch path: the hybrid plugin's weights are float32, "
                 "not GGUF blocks, so the native whole-stack decoder does not take them")
    return model.eval()
