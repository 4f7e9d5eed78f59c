"""Test helpers: tiny random hybrid models built with transformers' own classes and saved with ``save_pretrained``.

The weights are redrawn after construction (transformers' initialisation
leaves logits near zero and the SSM nearly memoryless, which would make a
comparison prove little): fan-in scaled matrices, norms near one, and
``A``/``dt`` ranges that keep some heads remembering for tens of tokens. The
layout on disk is whatever transformers writes. The tokenizer is the shared
layer's tiny BPE.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
import torch

from tests.models.text import CHATML_TEMPLATE, SPECIAL_TOKENS, train_tiny_tokenizer

VOCAB_SIZE = 320
HIDDEN_SIZE = 64


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int, mamba_heads: int) -> None:
    gen = torch.Generator().manual_seed(seed)

    def randn(shape, scale: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * scale

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            p.copy_(torch.log(1.0 + 15.0 * torch.rand(p.shape, generator=gen)))
        elif leaf == "dt_bias":
            dt = torch.exp(torch.rand(p.shape, generator=gen) * (math.log(0.5) - math.log(0.05)) + math.log(0.05))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        elif p.dim() == 1 and "layernorm" in name or name.endswith(("q_norm.weight", "k_norm.weight",
                                                                    "model.norm.weight")):
            # Qwen3.5's zero-centered norms scale by 1 + weight; elsewhere these are plain norms near one
            zero_centered = "linear_attn" not in name and "qwen3_5" in type(model).__name__.lower()
            p.copy_((0.0 if zero_centered else 1.0) + randn(p.shape, 0.1))
        elif leaf == "D" or p.dim() == 1 and "norm" in name:
            p.copy_(1.0 + randn(p.shape, 0.1))
        elif p.dim() == 1:  # biases
            p.copy_(randn(p.shape, 0.1))
        elif "embed" in name:
            p.copy_(randn(p.shape, 1.0))
        else:
            p.copy_(randn(p.shape, 1.0 / math.sqrt(p.shape[-1])))
            if name.endswith("in_proj.weight") and mamba_heads:
                p[-mamba_heads:] *= 0.5  # keep softplus(dt + dt_bias) well inside (1e-3, 1): a live, stable state
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # Nemotron-H's MoE router: biased choice, unbiased weights
            b.copy_(torch.randn(b.shape, generator=gen) * 0.3)


def _save(model, directory: str | Path, seed: int, mamba_heads: int) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _redraw(model, seed, mamba_heads)
    model.save_pretrained(str(directory))
    tok = train_tiny_tokenizer(vocab_size=min(300, VOCAB_SIZE))
    tok.save(str(directory / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML_TEMPLATE,
        "bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[2], "pad_token": SPECIAL_TOKENS[0],
        "model_max_length": 512,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return directory


def save_tiny_nemotron_h(directory: str | Path, seed: int = 0, *, pattern: str = "M-M*-M-",
                         tie_word_embeddings: bool = False, **overrides) -> Path:
    """A tiny ``NemotronHForCausalLM`` (two SSM groups, GQA attention, short conv), saved by transformers.

    ``overrides`` are further ``NemotronHConfig`` fields (a benchmark's larger shapes)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    fields = dict(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, hybrid_override_pattern=pattern,
        intermediate_size=2 * HIDDEN_SIZE, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8,
        max_position_embeddings=2048, tie_word_embeddings=tie_word_embeddings, bos_token_id=0, eos_token_id=2,
        pad_token_id=0)
    config = NemotronHConfig(**{**fields, **overrides})
    torch.manual_seed(seed)
    return _save(NemotronHForCausalLM(config).float().eval(), directory, seed, config.mamba_num_heads)


def save_tiny_nemotron_3(directory: str | Path, seed: int = 0, *, pattern: str = "ME*EM-E",
                         moe_latent_size: int | None = None) -> Path:
    """A tiny Nemotron 3 (``NemotronHForCausalLM`` with ``E`` mixture-of-experts layers): 8 routed experts in
    4 groups, 2 groups and 2 experts per token, scaled weights, a shared expert; optionally a latent."""
    path = save_tiny_nemotron_h(
        directory, seed, pattern=pattern, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=40, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, moe_latent_size=moe_latent_size)
    return path


def save_tiny_bamba(directory: str | Path, seed: int = 0, *, num_layers: int = 3,
                    attn_layer_indices: tuple[int, ...] = (1,)) -> Path:
    """A tiny ``BambaForCausalLM`` (Mamba-2 and RoPE attention layers, each followed by SwiGLU)."""
    from transformers import BambaConfig, BambaForCausalLM

    config = BambaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, num_hidden_layers=num_layers,
        attn_layer_indices=list(attn_layer_indices), intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, mamba_expand=1,
        mamba_chunk_size=8, max_position_embeddings=2048, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    return _save(BambaForCausalLM(config).float().eval(), directory, seed, config.mamba_n_heads)


def save_tiny_granite_hybrid(directory: str | Path, seed: int = 0, *,
                             layer_types: tuple[str, ...] = ("mamba", "attention", "mamba"),
                             num_local_experts: int = 4, position_embedding_type: str | None = "rope",
                             tie_word_embeddings: bool = False) -> Path:
    """A tiny ``GraniteMoeHybridForCausalLM`` with Granite's multipliers, a shared MLP and routed experts."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, num_hidden_layers=len(layer_types),
        layer_types=list(layer_types), num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
        shared_intermediate_size=48, num_local_experts=num_local_experts, num_experts_per_tok=2,
        mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, mamba_expand=1, mamba_chunk_size=8,
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0,
        position_embedding_type=position_embedding_type, max_position_embeddings=2048,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    return _save(GraniteMoeHybridForCausalLM(config).float().eval(), directory, seed, config.mamba_n_heads)


def save_tiny_qwen3_5(directory: str | Path, seed: int = 0, *, moe: bool = False,
                      layer_types: tuple[str, ...] = ("linear_attention", "linear_attention", "full_attention",
                                                      "linear_attention")) -> Path:
    """A tiny ``Qwen3_5ForCausalLM`` (or ``Qwen3_5MoeForCausalLM``): Gated DeltaNet layers with 2 key and 4
    value heads beside gated attention with partial RoPE."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    fields = dict(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, num_hidden_layers=len(layer_types),
        layer_types=list(layer_types), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, max_position_embeddings=2048, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    if moe:
        config = Qwen3_5MoeTextConfig(**fields, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                                      shared_expert_intermediate_size=40)
        model = Qwen3_5MoeForCausalLM(config)
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**fields, intermediate_size=96))
    torch.manual_seed(seed)
    return _save(model.float().eval(), directory, seed, mamba_heads=0)


#: family name -> the saver of its tiny reference model
SAVERS = {"nemotron_h": save_tiny_nemotron_h, "bamba": save_tiny_bamba, "granitemoehybrid": save_tiny_granite_hybrid}


def hf_reference(path: str | Path):
    """The transformers model a tiny checkpoint was saved from, loaded back in float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _converter_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter row order for Q/K: rotate-half pairs become interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def save_hybrid_gguf(hf_dir: str | Path, path: str | Path) -> Path:
    """Convert a transformers-saved Nemotron-H or Granite 4.0 hybrid to GGUF as llama.cpp's converter does.

    The metadata, tensor names (gguf-py's own name map) and transforms are
    those of ``convert_hf_to_gguf.py``'s ``NemotronHModel`` / ``GraniteHybridModel``
    (and ``Mamba2Model``), float32 throughout. Two inputs are given as the
    converter needs them: the layer pattern (it recognises the hub's
    ``hybrid_override_pattern`` and the old ``mamba`` / ``attention`` names, not
    the ``linear_attention`` / ``full_attention`` that transformers 5 writes), and
    the tokenizer's pre-tokenizer (the tiny tokenizer's hash is not one it knows:
    ``smollm``, the shared layer's choice, whose digit split it does).
    """
    import gguf
    from safetensors.torch import load_file

    from ifb_plugins.common.loading.hf import safetensors_files
    from ifb_plugins.mamba.config import ATTENTION, MAMBA, MLP, HybridConfig

    hf_dir, path = Path(hf_dir), Path(path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    c = HybridConfig.from_hf_config(cfg)
    if c.family == "granitemoehybrid" and cfg.get("position_embedding_type") == "rope":
        raise ValueError("llama.cpp's converter writes granitehybrid without RoPE; this model uses it")
    arch = {"nemotron_h": gguf.MODEL_ARCH.NEMOTRON_H, "granitemoehybrid": gguf.MODEL_ARCH.GRANITE_HYBRID}[c.family]
    names = gguf.get_tensor_name_map(arch, c.num_layers)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    granite = c.family == "granitemoehybrid"
    w.add_block_count(c.num_layers)
    w.add_context_length(2 ** 20 if granite else c.max_position_embeddings)  # granitehybrid without RoPE: 2**20
    w.add_embedding_length(c.hidden_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv([c.num_kv_heads if k == ATTENTION else 0 for k in c.pattern])
    w.add_layer_norm_rms_eps(c.layer_norm_epsilon)
    w.add_ssm_conv_kernel(c.conv_kernel)
    w.add_ssm_state_size(c.ssm_state_size)
    w.add_ssm_group_count(c.n_groups)
    w.add_ssm_inner_size(c.mamba_intermediate)
    w.add_ssm_time_step_rank(c.mamba_num_heads)
    if granite:
        w.add_feed_forward_length(c.intermediate_size)
        w.add_attention_scale(c.softmax_scale)
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_logit_scale(c.logits_scaling)
        if c.num_experts:
            w.add_expert_count(c.num_experts)
            w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_shared_feed_forward_length(c.shared_intermediate_size)
        w.add_rope_scaling_finetuned(False)
    else:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_feed_forward_length([c.intermediate_size if k == MLP else 0 for k in c.pattern])

    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    vocab.update({t["content"]: t["id"] for t in tok["added_tokens"]})
    size = -(c.vocab_size // -8) * 8  # the converter pads hybrid vocabularies to a multiple of 8
    tokens = [f"[PAD{i}]" for i in range(size)]
    for t, i in vocab.items():
        tokens[i] = t
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 5 if t.startswith("[PAD") else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    if not granite:
        w.add_add_bos_token(True)
    w.add_chat_template(json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"])

    def split_name(kind: gguf.MODEL_TENSOR, bid: int) -> str:
        return gguf.TENSOR_NAMES[kind].format(bid=bid) + ".weight"

    state = {}
    for file in safetensors_files(hf_dir):
        state.update(load_file(str(file)))
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in state.items():
        t = t.float()
        bid = int(name.split(".")[2]) if ".layers." in name else None
        if name.endswith((".input_linear.weight")):  # Granite's fused [gate | up]: split as GraniteMoeModel does
            gate, up = t.chunk(2, dim=-2)
            if "block_sparse_moe" in name:
                kinds = (gguf.MODEL_TENSOR.FFN_GATE_EXP, gguf.MODEL_TENSOR.FFN_UP_EXP)
            elif c.num_experts:
                kinds = (gguf.MODEL_TENSOR.FFN_GATE_SHEXP, gguf.MODEL_TENSOR.FFN_UP_SHEXP)
            else:
                kinds = (gguf.MODEL_TENSOR.FFN_GATE, gguf.MODEL_TENSOR.FFN_UP)
            out += [(split_name(kinds[0], bid), gate), (split_name(kinds[1], bid), up)]
            continue
        if granite and not c.num_experts and name.endswith("shared_mlp.output_linear.weight"):
            out.append((split_name(gguf.MODEL_TENSOR.FFN_DOWN, bid), t))
            continue
        if name.endswith(".dt_bias"):
            name = name[:-len(".dt_bias")] + ".dt_proj.bias"
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ValueError(f"llama.cpp has no GGUF name for {name}")
        if bid is not None and c.pattern[bid] == MAMBA:  # Mamba2Model.modify_tensors
            if ".conv1d.weight" in name:
                t = t.squeeze()
            elif name.endswith((".A_log", ".D")):
                t = t.reshape(*t.shape, 1)
            elif name.endswith("mixer.norm.weight") or name.endswith("mamba.norm.weight"):
                t = t.reshape(c.n_groups, -1)
            if name.endswith(".A_log"):
                t = -torch.exp(t)
        elif bid is not None and c.pattern[bid] == ATTENTION:  # undo_permute, as for llama
            if name.endswith("q_proj.weight"):
                t = _converter_permute(t, c.num_heads)
            elif name.endswith("k_proj.weight"):
                t = _converter_permute(t, c.num_kv_heads)
        out.append((new, t))
    for name, t in out:
        w.add_tensor(name, t.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@torch.no_grad()
def hf_greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    """transformers' own ``generate``, greedy, for exactly ``num_tokens`` tokens: no end-of-sequence token
    stops it or is masked (the engine's ``ignore_eos``)."""
    import copy

    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.eos_token_id = None  # a None passed to generate falls back to the model's
    try:
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=num_tokens, min_new_tokens=0,
                             pad_token_id=0)
    finally:
        model.generation_config = saved
    assert out.shape[1] == len(ids) + num_tokens
    return out[0, len(ids):].tolist()
