"""Test and benchmark helpers for mixture-of-experts checkpoints.

``save_tiny_moe`` builds a random-weight Qwen3-MoE, Qwen2-MoE or Mixtral with
transformers' own classes and writes it with ``save_pretrained``;
``write_moe_gguf`` converts such a directory to GGUF with the ``gguf``
package's ``GGUFWriter``, with the tensor names and metadata llama.cpp's
``convert_hf_to_gguf.py`` writes: experts stacked per layer into
``blk.N.ffn_{gate,up,down}_exps`` (``[E, I, H]`` / ``[E, H, I]``), the router
as ``ffn_gate_inp`` and Qwen2-MoE's shared expert as ``ffn_*_shexp`` with its
gate ``ffn_gate_inp_shexp`` squeezed to ``[H]``, the router and the norms in
float32, Mixtral as arch ``llama`` with its Q/K rows permuted.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from ifb_plugins.common.layers.moe import fuse_expert_state
from tests.models.text import saved_chat_template, save_tiny_tokenizer

MoeArch = Literal["qwen3_moe", "qwen2_moe", "mixtral"]
_GGUF_ARCH = {"qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
              "mixtral": gguf.MODEL_ARCH.LLAMA, "qwen3": gguf.MODEL_ARCH.QWEN3}  # qwen3: a dense twin
Q = gguf.GGMLQuantizationType


def hf_moe_config(arch: MoeArch, *, vocab_size: int = 320, hidden_size: int = 64, num_layers: int = 2,
                  num_heads: int = 4, num_kv_heads: int = 2, num_experts: int = 8, top_k: int = 2,
                  moe_intermediate_size: int = 32, intermediate_size: int = 96, shared_intermediate_size: int = 64,
                  norm_topk_prob: bool | None = None, **extra: Any) -> Any:
    """A transformers config object for ``arch`` (norm_topk_prob defaults as the released models set it)."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
                  num_experts_per_tok=top_k, max_position_embeddings=512, rms_norm_eps=1e-6,
                  bos_token_id=0, eos_token_id=2, tie_word_embeddings=False, **extra)
    if arch == "mixtral":
        return MixtralConfig(num_local_experts=num_experts, **common)
    moe = dict(num_experts=num_experts, moe_intermediate_size=moe_intermediate_size,
               norm_topk_prob=arch == "qwen3_moe" if norm_topk_prob is None else norm_topk_prob)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(shared_expert_intermediate_size=shared_intermediate_size, **moe, **common)
    return Qwen3MoeConfig(**moe, **common)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Fan-in scaled random weights (norms near one): logits and routing that are far from flat,
    so greedy output and expert choice vary from token to token."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif p.dim() == 1:
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def save_tokenizer_files(directory: Path) -> None:
    """The tiny byte-level BPE tokenizer and a ChatML template, saved by transformers' tokenizer class."""
    save_tiny_tokenizer(directory)


def save_tiny_moe(directory: str | Path, arch: MoeArch, seed: int = 0, *, fused: bool = False,
                  **sizes: Any) -> Path:
    """Build a random ``arch`` model with transformers, ``save_pretrained`` it into ``directory``.

    ``fused``: the transformers 5 in-memory layout (``save_original_format=False``) instead of
    the per-expert tensors ``save_pretrained`` writes by default.
    """
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_moe_config(arch, **sizes), dtype=torch.float32)
    randomize(model, seed)
    model.save_pretrained(directory, save_original_format=not fused)
    save_tokenizer_files(directory)
    return directory


def _add_tokenizer(w: gguf.GGUFWriter, hf_dir: Path, vocab_size: int, bos: int, eos: int) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    vocab.update({t["content"]: t["id"] for t in tok["added_tokens"]})
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]  # the model's vocab is padded past the tokenizer's
    for t, i in vocab.items():
        tokens[i] = t
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 5 if t.startswith("[PAD") else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    w.add_chat_template(saved_chat_template(hf_dir))


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of Q/K rows (rotate-half pairs to interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_names(state: dict[str, torch.Tensor], arch: MoeArch) -> dict[str, torch.Tensor]:
    """Stacked experts under the names llama.cpp's converter maps (``mlp.experts.gate_proj`` ...)."""
    out = {}
    for name, t in fuse_expert_state(state).items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            stem = name.removesuffix(".gate_up_proj")
            gate, up = t.chunk(2, dim=1)
            out[f"{stem}.gate_proj.weight"], out[f"{stem}.up_proj.weight"] = gate, up
        elif name.endswith(".mlp.experts.down_proj"):
            out[f"{name}.weight"] = t
        else:
            out[name] = t
    return out


def write_moe_gguf(hf_dir: str | Path, path: str | Path, weight_type: gguf.GGMLQuantizationType = Q.F32,
                   *, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Convert a MoE checkpoint directory (or a dense Qwen3 one) to GGUF as llama.cpp does;
    matrices in ``weight_type``.

    ``state`` replaces the directory's weights (a benchmark's random tensors); the
    directory still gives config.json and the tokenizer.
    """
    hf_dir, path = Path(hf_dir), Path(path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch: MoeArch = cfg["model_type"]
    if arch not in _GGUF_ARCH:
        raise ValueError(f"write_moe_gguf writes {', '.join(_GGUF_ARCH)}, not {arch!r}")
    if state is None:
        state = load_file(str(hf_dir / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    num_layers = cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[_GGUF_ARCH[arch]])
    w.add_block_count(num_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if arch != "qwen3":
        w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch in ("qwen2_moe", "qwen3_moe"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    _add_tokenizer(w, hf_dir, cfg["vocab_size"], cfg.get("bos_token_id") or 0, cfg.get("eos_token_id") or 2)

    names = gguf.get_tensor_name_map(_GGUF_ARCH[arch], num_layers)
    for name, tensor in _hf_names(state, arch).items():
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise ValueError(f"llama.cpp has no GGUF name for {name!r} in {arch}")
        data = tensor.float().numpy()
        if arch == "mixtral" and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = _permute(data, heads if "q_proj" in name else kv_heads)
        if gname.endswith("ffn_gate_inp_shexp.weight"):
            data = data.reshape(-1)  # the converter squeezes [1, H] to [H]
        # llama.cpp keeps 1-D tensors and the routers in float32
        keep = data.ndim == 1 or gname.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))
        if keep or weight_type == Q.F32:
            w.add_tensor(gname, np.ascontiguousarray(data, dtype=np.float32))
        else:
            w.add_tensor(gname, gguf.quants.quantize(data, weight_type), raw_dtype=weight_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
