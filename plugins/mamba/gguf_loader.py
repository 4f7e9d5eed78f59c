"""Load a Nemotron-H or Granite 4.0 hybrid GGUF file, in the layout llama.cpp's converter writes
(Qwen3.5's ``qwen35`` / ``qwen35moe``: ``gguf_qwen3_5``).

llama.cpp names the architectures ``nemotron_h`` and ``granitehybrid``; its converter
writes ``nemotron_h_moe`` for any Nemotron-H whose config has MoE fields (transformers 5
saves them for every Nemotron-H), read here as ``nemotron_h``, its expert layers (Nemotron 3:
``ffn_gate_inp``, ``exp_probs_b``, ``ffn_{up,down}_exps``, ``ffn_{up,down}_shexp``) onto
``NemotronMoE``. Its
converter stores ``A = -exp(A_log)`` as ``ssm_a [H, 1]``, ``D`` as ``[H, 1]``,
the conv kernel squeezed to ``[C, K]``, ``dt_bias`` as ``ssm_dt.bias``, the
gated norm as ``[groups, inner / groups]``, Q/K rows in its interleaved RoPE
order (for both families), and Granite's fused ``input_linear`` matrices split
into gate and up (``ffn_{gate,up}_exps`` for the experts, ``ffn_{gate,up}_shexp``
for the shared MLP when there are experts). Which layer is which comes from
the per-layer ``attention.head_count_kv`` (attention where it is not 0) and,
for Nemotron-H, ``feed_forward_length`` (an MLP where it is not 0) in llama.cpp's reading; here
it comes from the tensors each layer holds (``_pattern`` says why). Every
tensor is dequantized to float32 and renamed onto ``HybridModel``'s names.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from ifb_plugins.common.loading.gguf import read_metadata
from ifb_plugins.mamba.gguf_qwen3_5 import ARCHS as QWEN3_5_ARCHS
from ifb_plugins.mamba.gguf_qwen3_5 import load_qwen3_5_gguf
from ifb_plugins.mamba.config import (ATTENTION, FFN_GRANITE, FFN_NONE, MAMBA, MLP, MOE, ConfigError,
                                      HybridConfig)

ARCHS = {"nemotron_h": "nemotron_h", "nemotron_h_moe": "nemotron_h", "granitehybrid": "granitemoehybrid"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)(?:\.(weight|bias))?")  # ssm_a, ssm_d: no suffix
_MIXER = {"ssm_in": "mixer.in_proj", "ssm_conv1d": "mixer.conv1d", "ssm_out": "mixer.out_proj",
          "attn_q": "mixer.q_proj", "attn_k": "mixer.k_proj", "attn_v": "mixer.v_proj",
          "attn_output": "mixer.o_proj", "attn_norm": "norm", "ffn_norm": "ffn_norm",
          "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj",  # Nemotron-H MLP layers
          "ffn_gate_inp": "ffn.moe.router", "ffn_down_exps": "ffn.moe.down_proj",
          "ffn_down_shexp": "ffn.shared.output_linear"}


def _per_layer(value: Any, num_layers: int, key: str) -> list[int]:
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value] * num_layers
    if len(values) != num_layers:
        raise ConfigError(f"GGUF {key} lists {len(values)} layers; the file has {num_layers}")
    return [int(v) for v in values]


def _pattern(tensors: dict[str, np.ndarray], num_layers: int, family: str) -> str:
    """Which layer is which, from the tensors each layer holds: a Mamba-2 mixer (``ssm_in``), attention
    (``attn_q``), else (Nemotron-H) an MLP. The converter's per-layer metadata is not trusted for this:
    given a config as transformers 5 saves it, llama.cpp's converter writes a Nemotron-H's MLP layers
    with ``feed_forward_length`` 0 (it takes them for MoE layers) and a Granite hybrid's attention
    layers with ``head_count_kv`` 0 (it looks for the layer type ``attention``, not ``full_attention``),
    while the tensors it writes are right."""
    kinds = []
    for i in range(num_layers):
        if f"blk.{i}.ssm_in.weight" in tensors:
            kinds.append(MAMBA)
        elif f"blk.{i}.attn_q.weight" in tensors:
            kinds.append(ATTENTION)
        elif family == "nemotron_h" and f"blk.{i}.ffn_up.weight" in tensors:
            kinds.append(MLP)
        elif family == "nemotron_h" and f"blk.{i}.ffn_up_exps.weight" in tensors:
            kinds.append(MOE)  # Nemotron 3's mixture-of-experts layers
        else:
            raise ConfigError(f"GGUF layer {i} holds no mixer this plugin knows (ssm_in, attn_q or ffn_up)")
    return "".join(kinds)


def _nemotron_moe_fields(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """Nemotron 3's MoE fields as llama.cpp's converter writes them (``nemotron_h_moe.expert_*``)."""
    def key(name: str) -> Any:
        value = meta.get(f"{arch}.{name}")
        if value is None:
            raise ConfigError(f"GGUF metadata {arch}.{name} is missing")
        return value

    if int(meta.get(f"{arch}.expert_shared_count", 1)) != 1:
        raise ConfigError(f"GGUF metadata {arch}.expert_shared_count must be 1")
    if meta.get(f"{arch}.moe_latent_size"):
        raise ConfigError(f"GGUF metadata {arch}.moe_latent_size: experts in a latent are not read from GGUF")
    return dict(
        num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
        moe_intermediate_size=int(key("expert_feed_forward_length")),
        shared_intermediate_size=int(key("expert_shared_feed_forward_length")),
        num_expert_groups=int(meta.get(f"{arch}.expert_group_count") or 1),
        topk_groups=int(meta.get(f"{arch}.expert_group_used_count") or 1),
        norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)),
        routed_scaling_factor=float(meta.get(f"{arch}.expert_weights_scale") or 1.0))


#: Nemotron 3 MoE layer tensors -> ``NemotronMoE``'s names
_MOE = {"ffn_gate_inp": "mixer.gate.weight", "exp_probs_b": "mixer.gate.e_score_correction_bias",
        "ffn_up_exps": "mixer.experts.up_proj", "ffn_down_exps": "mixer.experts.down_proj",
        "ffn_up_shexp": "mixer.shared_experts.up_proj.weight",
        "ffn_down_shexp": "mixer.shared_experts.down_proj.weight"}


def config_from_metadata(meta: dict[str, Any], tensors: dict[str, np.ndarray]) -> HybridConfig:
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise ConfigError(f"GGUF architecture {arch!r} is not a hybrid this plugin loads "
                          f"(supported: {', '.join([*ARCHS, *QWEN3_5_ARCHS])})")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ConfigError(f"GGUF metadata {arch}.{name} is missing")
        return value

    num_layers = int(key("block_count"))
    kv_heads = _per_layer(key("attention.head_count_kv"), num_layers, "attention.head_count_kv")
    ff = _per_layer(key("feed_forward_length", 0), num_layers, "feed_forward_length")
    pattern = _pattern(tensors, num_layers, ARCHS[arch])
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    attention = [i for i, kind in enumerate(pattern) if kind == ATTENTION]
    mlps = [i for i, kind in enumerate(pattern) if kind == MLP]
    if attention:  # the K rows, not the metadata (see _pattern)
        kv_heads = [tensors[f"blk.{attention[0]}.attn_k.weight"].shape[0] // head_dim]
    if mlps:
        ff = [tensors[f"blk.{mlps[0]}.ffn_up.weight"].shape[0]]
    inner, mamba_heads = int(key("ssm.inner_size")), int(key("ssm.time_step_rank"))
    fields: dict[str, Any] = dict(
        family=ARCHS[arch], pattern=pattern, vocab_size=int(tensors["token_embd.weight"].shape[0]),
        hidden_size=hidden, num_heads=heads, num_kv_heads=max(kv_heads) or heads,
        head_dim=head_dim,
        intermediate_size=max(ff), mamba_num_heads=mamba_heads, mamba_head_dim=inner // mamba_heads,
        ssm_state_size=int(key("ssm.state_size")), n_groups=int(key("ssm.group_count")),
        conv_kernel=int(key("ssm.conv_kernel")), layer_norm_epsilon=float(key("attention.layer_norm_rms_epsilon", meta.get(f"{arch}.attention.layer_norm_epsilon"))),
        tie_word_embeddings="output.weight" not in tensors,
        use_conv_bias=any(n.endswith("ssm_conv1d.bias") for n in tensors) or MAMBA not in pattern,
        mamba_proj_bias=any(n.endswith("ssm_in.bias") for n in tensors),
        attention_bias=any(n.endswith("attn_q.bias") for n in tensors),
        max_position_embeddings=int(key("context_length")),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(int(e) for e in [meta.get("tokenizer.ggml.eos_token_id")] if e is not None),
        ffn=FFN_NONE,
    )
    if MOE in pattern:
        fields.update(_nemotron_moe_fields(meta, arch))
    if arch == "granitehybrid":
        num_experts = int(meta.get(f"{arch}.expert_count", 0))
        fields.update(
            ffn=FFN_GRANITE, num_experts=num_experts,
            num_experts_per_tok=int(meta.get(f"{arch}.expert_used_count", 0)) if num_experts else 0,
            shared_intermediate_size=int(meta.get(f"{arch}.expert_shared_feed_forward_length") or max(ff)),
            # absent (or 0, as llama.cpp reads it): 1/sqrt(head_dim), as for Bamba, whose config has no multiplier
            attention_scale=float(meta[f"{arch}.attention.scale"]) if meta.get(f"{arch}.attention.scale") else None,
            embedding_multiplier=float(meta.get(f"{arch}.embedding_scale") or 1.0),
            residual_multiplier=float(meta.get(f"{arch}.residual_scale") or 1.0),
            logits_scaling=float(meta.get(f"{arch}.logit_scale") or 1.0))
        if meta.get(f"{arch}.rope.scaling.finetuned"):  # llama.cpp's switch for RoPE in this architecture
            head_dim = fields["head_dim"]
            fields.update(rotary_dim=int(meta.get(f"{arch}.rope.dimension_count") or head_dim),
                          rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)))
    return HybridConfig(**fields)


def _unpermute(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: within each head, rows ``(pair, half)`` -> ``(half, pair)``."""
    return rows.reshape(n_head, rows.shape[0] // n_head // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _our_tensors(raw: dict[str, torch.Tensor], config: HybridConfig) -> dict[str, torch.Tensor]:
    out = {"backbone.embeddings.weight": raw.pop("token_embd.weight"),
           "backbone.norm_f.weight": raw.pop("output_norm.weight")}
    if "output.weight" in raw:
        out["lm_head.weight"] = raw.pop("output.weight")
    gate_up: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in raw.items():
        m = _BLOCK.fullmatch(name)
        if m is None:
            raise ConfigError(f"unexpected tensor {name!r} in the GGUF file")
        layer, kind, part = int(m.group(1)), m.group(2), m.group(3)
        p = f"backbone.layers.{layer}."
        if config.pattern[layer] == MOE and kind in _MOE:
            out[p + _MOE[kind]] = t
        elif kind == "ssm_a":
            out[p + "mixer.A"] = t.reshape(-1)
        elif kind == "ssm_d":
            out[p + "mixer.D"] = t.reshape(-1)
        elif kind == "ssm_dt":
            out[p + "mixer.dt_bias"] = t.reshape(-1)
        elif kind == "ssm_norm":
            out[p + "mixer.norm.weight"] = t.reshape(-1)
        elif kind == "ssm_conv1d" and part == "weight":
            out[p + "mixer.conv1d.weight"] = t[:, None, :]
        elif kind in ("attn_q", "attn_k") and part == "weight":
            out[p + _MIXER[kind] + ".weight"] = _unpermute(t, config.num_heads if kind == "attn_q"
                                                           else config.num_kv_heads)
        elif kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_shexp", "ffn_up_shexp", "ffn_gate") or (
                kind == "ffn_up" and config.ffn == FFN_GRANITE):
            which = "moe" if kind.endswith("exps") else "shared"
            gate_up.setdefault((layer, which), {})["gate" if "gate" in kind else "up"] = t
        elif kind == "ffn_down" and config.ffn == FFN_GRANITE:  # a dense Granite (no experts)
            out[p + "ffn.shared.output_linear.weight"] = t
        elif kind in _MIXER:
            target = _MIXER[kind]
            out[p + target + ("" if target.endswith("_proj") and "moe" in target else f".{part}")] = t
        else:
            raise ConfigError(f"unexpected tensor {name!r} in the GGUF file")
    for (layer, which), halves in gate_up.items():
        fused = torch.cat([halves["gate"], halves["up"]], dim=-2)  # transformers' [gate | up] rows
        name = "ffn.moe.gate_up_proj" if which == "moe" else "ffn.shared.input_linear.weight"
        out[f"backbone.layers.{layer}.{name}"] = fused
    return out


def load_hybrid_gguf(path: str | Path) -> tuple[HybridConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """``(config, float32 state dict under HybridModel's names, metadata)`` of a hybrid GGUF file."""
    reader = gguf.GGUFReader(str(path))
    meta = read_metadata(reader)
    raw = {}
    for t in reader.tensors:
        values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        raw[t.name] = torch.from_numpy(values.copy().reshape([int(d) for d in reversed(t.shape)]))
    if meta.get("general.architecture") in QWEN3_5_ARCHS:
        return (*load_qwen3_5_gguf(meta, raw), meta)
    config = config_from_metadata(meta, raw)
    return config, _our_tensors(raw, config), meta
