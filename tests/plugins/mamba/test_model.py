"""The Nemotron-H model against the equations in float64, and what the loader refuses.

transformers' own models are the reference in ``test_families``."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from ifb_plugins.mamba.config import HybridConfig
from ifb_plugins.mamba.layout import build_layout
from ifb_plugins.mamba.loader import build_hybrid_model, load_hybrid_dir
from ifb_plugins.mamba.model import allocate_cache
from tests.models.hybrid import save_tiny_nemotron_h
from ifb_plugins.common.loading.hf import load_hf_state_dict

PROMPT = [5, 77, 13, 250, 9, 31, 31, 180, 4, 66, 120, 7, 299, 42, 3, 88, 15, 201, 19, 140, 23, 60, 11, 97, 300]


@torch.no_grad()
def our_logits(model, ids: list[int]) -> torch.Tensor:
    """Every position's logits from one prefill step through the stepped model."""
    cache = allocate_cache(model.config, num_seats=1, num_blocks=4, block_size=16)
    layout = build_layout([(0, 0, len(ids), [0, 1, 2, 3])], 16)
    return model.compute_logits(model(torch.tensor(ids), layout, cache))


# ---- an independent reference from the equations (full sequence, float64, no state, no paging) ----

def _rms(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _mamba(h, sd, p, c: HybridConfig):
    L, H, P, N, G = h.shape[0], c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size, c.n_groups
    inner = H * P
    z, xbc, dt = (h @ sd[p + "in_proj.weight"].T).split([inner, c.conv_dim, H], dim=-1)
    # causal depthwise conv: left-pad with K-1 zeros
    conv = F.conv1d(F.pad(xbc.T[None], (c.conv_kernel - 1, 0)), sd[p + "conv1d.weight"],
                    sd[p + "conv1d.bias"], groups=c.conv_dim)[0].T
    xbc = F.silu(conv)
    x, B, C = xbc.split([inner, G * N, G * N], dim=-1)
    x = x.view(L, H, P)
    B = B.view(L, G, N).repeat_interleave(H // G, dim=1)  # [L, H, N]
    C = C.view(L, G, N).repeat_interleave(H // G, dim=1)
    dt = F.softplus(dt + sd[p + "dt_bias"])  # [L, H]
    A = -torch.exp(sd[p + "A_log"])
    # The quadratic (attention-like) form of the recurrence:
    # y_t = sum_{s<=t} (C_t . B_s) exp(sum_{r=s+1..t} dt_r A) dt_s x_s + D x_t
    cum = torch.cumsum(dt * A, dim=0)  # [L, H]
    decay = torch.exp(cum[:, None, :] - cum[None, :, :])  # [t, s, H]
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    weights = torch.einsum("thn,shn->tsh", C, B) * decay * causal[:, :, None] * dt[None, :, :]
    y = torch.einsum("tsh,shp->thp", weights, x) + sd[p + "D"][None, :, None] * x
    y = y.reshape(L, inner) * F.silu(z)
    grouped = y.view(L, G, -1)
    y = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + c.layer_norm_epsilon)).view(L, inner)
    return (sd[p + "norm.weight"] * y) @ sd[p + "out_proj.weight"].T


def _attention(h, sd, p, c: HybridConfig):
    L = h.shape[0]
    q = (h @ sd[p + "q_proj.weight"].T).view(L, c.num_heads, c.head_dim).transpose(0, 1)
    k = (h @ sd[p + "k_proj.weight"].T).view(L, c.num_kv_heads, c.head_dim).transpose(0, 1)
    v = (h @ sd[p + "v_proj.weight"].T).view(L, c.num_kv_heads, c.head_dim).transpose(0, 1)
    rep = c.num_heads // c.num_kv_heads
    k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    scores = q @ k.transpose(1, 2) / math.sqrt(c.head_dim)
    scores = scores.masked_fill(~torch.tril(torch.ones(L, L, dtype=torch.bool)), -math.inf)
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(L, -1)  # no position embedding in Nemotron-H
    return out @ sd[p + "o_proj.weight"].T


def reference_logits(path, ids: list[int]) -> torch.Tensor:
    c = HybridConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    sd = {k: v.double() for k, v in load_hf_state_dict(path).items()}
    x = sd["backbone.embeddings.weight"][ids]
    for i, kind in enumerate(c.pattern):
        p = f"backbone.layers.{i}."
        h = _rms(x, sd[p + "norm.weight"], c.layer_norm_epsilon)
        if kind == "M":
            h = _mamba(h, sd, p + "mixer.", c)
        elif kind == "*":
            h = _attention(h, sd, p + "mixer.", c)
        else:
            h = torch.relu(h @ sd[p + "mixer.up_proj.weight"].T).square() @ sd[p + "mixer.down_proj.weight"].T
        x = x + h
    x = _rms(x, sd["backbone.norm_f.weight"], c.layer_norm_epsilon)
    head = sd["backbone.embeddings.weight"] if c.tie_word_embeddings else sd["lm_head.weight"]
    return x @ head.T


@pytest.mark.parametrize("pattern,tie", [("M-M*-M-", False), ("*M-MM", True)])
def test_logits_match_the_equations_in_float64(tmp_path, pattern, tie):
    path = save_tiny_nemotron_h(tmp_path, seed=3, pattern=pattern, tie_word_embeddings=tie)
    model = build_hybrid_model(load_hybrid_dir(path))
    ours = our_logits(model, PROMPT)
    ref = reference_logits(path, PROMPT)
    assert ref.abs().max() > 1.0  # the logits are not trivially small
    torch.testing.assert_close(ours.double(), ref, atol=2e-5, rtol=0)
    assert ours.argmax(-1).tolist() == ref.argmax(-1).tolist()


def test_loader_refuses_what_it_does_not_implement(tmp_path):
    path = save_tiny_nemotron_h(tmp_path / "mlp", pattern="M-M*-M-")
    cfg = json.loads((path / "config.json").read_text())
    assert "layers_block_type" in cfg  # transformers 5 writes the list, not the pattern string
    # MoE layers are served (test_nemotron_3); this checkpoint's weights are an MLP's, not experts'
    moe = ["mamba", "moe", "mamba", "attention", "mlp", "mamba", "mlp"]
    (path / "config.json").write_text(json.dumps({**cfg, "layers_block_type": moe}))
    with pytest.raises(ValueError, match="do not match the config's layer pattern"):
        build_hybrid_model(load_hybrid_dir(path))
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type 'llama'"):
        load_hybrid_dir(path)
    # weights for a different pattern than the config names
    other = ["mamba", "attention", "mamba", "attention", "mlp", "mamba", "mlp"]
    (path / "config.json").write_text(json.dumps({**cfg, "layers_block_type": other}))
    with pytest.raises(ValueError, match="do not match the config's layer pattern"):
        build_hybrid_model(load_hybrid_dir(path))
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hybrid_dir(path)
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_hybrid_dir(tmp_path)
    with pytest.raises(ValueError, match="needs a local checkpoint directory"):
        load_hybrid_dir(None)
