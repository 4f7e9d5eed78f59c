"""Gemma 4's vision encoder (``Gemma4VisionModel``) and image preprocessing (``Gemma4ImageProcessor``).

Preprocessing: an image is resized, keeping its aspect ratio, to the largest
size whose sides are multiples of ``pooling_kernel_size * patch_size`` pixels
and that holds at most ``max_soft_tokens * pooling_kernel_size^2`` patches;
rescaled to [0, 1] (normalizing is off by default) and cut into
``patch_size`` squares in raster order, each with its ``(x, y)`` patch
position. transformers pads the patches to the budget; padding is masked out
of attention and dropped from the output, so here only the real patches run.

The encoder: patches are projected (``2 * (pixels - 0.5)``) and get learned x
and y position embeddings; each layer is bidirectional attention with q / k
RMSNorms, a scale-free v norm, scaling 1 and 2D rotary positions (the first
half of each head rotates by x, the second by y), then a gated MLP, each
wrapped in a pre- and a post-norm. Linear layers may clip their inputs and
outputs to bounds from the checkpoint (``use_clipped_linears``). The last
hidden states are average-pooled over ``k x k`` patch blocks, scaled by
``sqrt(hidden)`` and, with ``standardize``, shifted and scaled per channel: one
soft token per block, in raster order.

Parameter names follow the checkpoint's ``vision_tower.*`` tensors.

Shape letters: N patches, D tower width, d head dim, M = N / k^2 soft tokens.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from ifb_plugins.common.media.image_ops import pixel_settings, resample_filter, resize, to_array, to_float, to_rgb
from ifb_plugins.common.media.vision import activation

#: the soft-token budgets transformers' processor accepts
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)


@attrs.frozen
class Gemma4VisionConfig:
    """``vision_config`` of a ``Gemma4Config``."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10 * 1024
    use_clipped_linears: bool = False
    standardize: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100.0
    hidden_activation: str = "gelu_pytorch_tanh"

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> Gemma4VisionConfig:
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config.rope_parameters.rope_type {rope['rope_type']!r} is not axial")
        heads = int(cfg.get("num_attention_heads", 12))
        config = cls(
            hidden_size=int(cfg.get("hidden_size", 768)), intermediate_size=int(cfg.get("intermediate_size", 3072)),
            num_layers=int(cfg.get("num_hidden_layers", 16)), num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)), head_dim=int(cfg.get("head_dim", 64)),
            patch_size=int(cfg.get("patch_size", 16)), pooling_kernel_size=int(cfg.get("pooling_kernel_size", 3)),
            position_embedding_size=int(cfg.get("position_embedding_size", 10 * 1024)),
            use_clipped_linears=bool(cfg.get("use_clipped_linears", False)),
            standardize=bool(cfg.get("standardize", False)), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", 100.0)),
            hidden_activation=str(cfg.get("hidden_activation", "gelu_pytorch_tanh")))
        if config.head_dim % 4 or config.num_heads % config.num_kv_heads:
            raise ValueError("vision_config: head_dim must divide by 4 (2D rotary) and the heads by the KV heads")
        return config


def fitted_size(height: int, width: int, patch: int, max_patches: int, pooling: int) -> tuple[int, int]:
    """The resized ``(height, width)``: aspect kept, sides multiples of ``pooling * patch``, at most
    ``max_patches`` patches (transformers' ``get_aspect_ratio_preserving_size``)."""
    factor = math.sqrt(max_patches * patch ** 2 / (height * width))
    side = pooling * patch
    target_h = int(math.floor(factor * height / side)) * side
    target_w = int(math.floor(factor * width / side)) * side
    if target_h == 0 and target_w == 0:
        raise ValueError(f"an image of {height}x{width} resizes to nothing")
    longest = (max_patches // pooling ** 2) * side
    if target_h == 0:
        target_h, target_w = side, min(int(math.floor(width / height)) * side, longest)
    elif target_w == 0:
        target_w, target_h = side, min(int(math.floor(height / width)) * side, longest)
    return target_h, target_w


@attrs.frozen
class Gemma4ImageProcessing:
    """The settings of the processor's ``image_processor`` (the ``Gemma4ImageProcessor`` class defaults)."""

    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    resample: Image.Resampling = Image.Resampling.BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = False
    image_mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    image_std: tuple[float, ...] = (1.0, 1.0, 1.0)
    do_convert_rgb: bool = True

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> Gemma4ImageProcessing:
        base = cls()
        settings = cls(
            patch_size=int(cfg.get("patch_size", base.patch_size)),
            max_soft_tokens=int(cfg.get("max_soft_tokens", base.max_soft_tokens)),
            pooling_kernel_size=int(cfg.get("pooling_kernel_size", base.pooling_kernel_size)),
            resample=resample_filter(cfg.get("resample", base.resample)),
            do_resize=bool(cfg.get("do_resize", base.do_resize)), **pixel_settings(cfg, base))
        if settings.max_soft_tokens not in SOFT_TOKEN_BUDGETS:
            raise ValueError(f"max_soft_tokens must be one of {SOFT_TOKEN_BUDGETS}, got {settings.max_soft_tokens}")
        return settings

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, np.ndarray]:
        """Patches ``[N, P * P * C]`` float32 and their ``(x, y)`` positions ``[N, 2]``, in raster order."""
        pixels = to_array(to_rgb(image) if self.do_convert_rgb else image)  # [C, H, W] uint8
        p, k = self.patch_size, self.pooling_kernel_size
        if self.do_resize:
            size = fitted_size(*pixels.shape[1:], p, self.max_soft_tokens * k * k, k)
            if size != pixels.shape[1:]:
                pixels = resize(pixels, *size, self.resample)
        pixels = to_float(pixels, self)
        c, height, width = pixels.shape
        if height % (p * k) or width % (p * k):
            raise ValueError(f"an image of {height}x{width} is not a multiple of {p * k} pixels; "
                             "resizing is off in the image processor config")
        ph, pw = height // p, width // p
        patches = pixels.reshape(c, ph, p, pw, p).transpose(1, 3, 2, 4, 0).reshape(ph * pw, -1)
        xs, ys = np.meshgrid(np.arange(pw), np.arange(ph), indexing="xy")
        return np.ascontiguousarray(patches), np.stack([xs, ys], axis=-1).reshape(-1, 2)


class RMSNorm(nn.Module):
    """Gemma 4's RMSNorm in float32: ``x / sqrt(mean(x^2) + eps)``, times ``weight`` where it has one."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        if with_scale:
            self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if hasattr(self, "weight"):
            h = h * self.weight.float()
        return h.type_as(x)


class ClippableLinear(nn.Module):
    """A bias-free linear layer (``linear.weight``), its input and output clamped to the checkpoint's bounds."""

    def __init__(self, in_features: int, out_features: int, clipped: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        if clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                self.register_buffer(name, torch.tensor(math.inf if name.endswith("max") else -math.inf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "input_min"):
            return self.linear(x)
        return torch.clamp(self.linear(torch.clamp(x, self.input_min, self.input_max)), self.output_min,
                           self.output_max)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rotary_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [N, heads, d]``: the first half of each head rotated by the x positions, the second by y."""
    half = x.shape[-1] // 2
    return torch.cat([_rotate(x[..., i * half:(i + 1) * half], cos[:, i, None], sin[:, i, None]) for i in (0, 1)],
                     dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        d, clip = cfg.head_dim, cfg.use_clipped_linears
        self.config = cfg
        self.q_proj = ClippableLinear(cfg.hidden_size, cfg.num_heads * d, clip)
        self.k_proj = ClippableLinear(cfg.hidden_size, cfg.num_kv_heads * d, clip)
        self.v_proj = ClippableLinear(cfg.hidden_size, cfg.num_kv_heads * d, clip)
        self.o_proj = ClippableLinear(cfg.num_heads * d, cfg.hidden_size, clip)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.v_norm = RMSNorm(d, cfg.rms_norm_eps, with_scale=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                need_received: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output ``[N, D]`` and, if asked, the attention each patch receives ``[N]`` (averaged over
        heads and queries)."""
        n, c = x.shape[0], self.config
        q = rotary_2d(self.q_norm(self.q_proj(x).view(n, c.num_heads, -1)), cos, sin).transpose(0, 1)
        k = rotary_2d(self.k_norm(self.k_proj(x).view(n, c.num_kv_heads, -1)), cos, sin).transpose(0, 1)
        v = self.v_norm(self.v_proj(x).view(n, c.num_kv_heads, -1)).transpose(0, 1)
        group = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # [heads, N, d]
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0)
        received = torch.softmax((q @ k.transpose(-1, -2)).float(), dim=-1).mean(dim=(0, 1)) if need_received else None
        return self.o_proj(out.transpose(0, 1).reshape(n, -1)), received


class VisionMLP(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        h, i, clip = cfg.hidden_size, cfg.intermediate_size, cfg.use_clipped_linears
        self.gate_proj, self.up_proj = ClippableLinear(h, i, clip), ClippableLinear(h, i, clip)
        self.down_proj = ClippableLinear(i, h, clip)
        self.act = activation(cfg.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn, self.mlp = VisionAttention(cfg), VisionMLP(cfg)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                need_received: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn, received = self.self_attn(self.input_layernorm(x), cos, sin, need_received)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), received


class PatchEmbedder(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.input_proj = nn.Linear(3 * cfg.patch_size ** 2, cfg.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(torch.ones(2, cfg.position_embedding_size, cfg.hidden_size))

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        table = self.position_embedding_table
        x = self.input_proj((2 * (patches - 0.5)).to(self.input_proj.weight.dtype))
        return x + (F.embedding(positions[:, 0], table[0]) + F.embedding(positions[:, 1], table[1]))


class Encoder(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))


class Gemma4VisionTower(nn.Module):
    """``vision_tower.*``: one image's patches and positions to its soft tokens ``[M, D]``."""

    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embedder = PatchEmbedder(cfg)
        self.encoder = Encoder(cfg)
        if cfg.standardize:
            self.register_buffer("std_bias", torch.zeros(cfg.hidden_size))
            self.register_buffer("std_scale", torch.ones(cfg.hidden_size))

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[N, 2, d/2]``: per patch, the angles of its x and of its y position."""
        quarter = self.config.head_dim // 2
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float,
                                                                  device=positions.device) / quarter))
        angles = positions[..., None].float() * inv_freq  # [N, 2, d/4]
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos(), emb.sin()

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``patches [N, P * P * C]`` and their ``(x, y)`` ``positions [N, 2]`` (raster order) to soft tokens
        ``[M, D]`` and each one's importance ``[M]``: the attention its patches receive in the last layer
        (for the visual-token pruner)."""
        cfg = self.config
        k = cfg.pooling_kernel_size
        x = self.patch_embedder(patches, positions)
        cos, sin = self.rotary(positions)
        received = torch.full((x.shape[0],), 1.0 / x.shape[0], device=x.device)
        for i, layer in enumerate(self.encoder.layers):
            x, last = layer(x, cos, sin, need_received=i == len(self.encoder.layers) - 1)
            received = last if last is not None else received
        # average over each k x k block of patches: one soft token per block, in raster order
        width = int(positions[:, 0].max()) + 1
        blocks = torch.div(positions[:, 0], k, rounding_mode="floor") + (width // k) * torch.div(
            positions[:, 1], k, rounding_mode="floor")
        weights = F.one_hot(blocks, x.shape[0] // (k * k)).float() / (k * k)  # [N, M]
        pooled = (weights.T @ x.float()) * cfg.hidden_size ** 0.5
        if cfg.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled.to(x.dtype), weights.T @ received
