"""The Qwen3-VL vision tower: patch embedding plus learned positions, a 2D rotary ViT, patch mergers.

Unlike Qwen2.5-VL's tower it attends over the whole image in every block (no
windows), adds a square table of learned positions resized (bilinear, corners
aligned) to each image's patch grid, uses LayerNorm and a plain MLP, and has
DeepStack mergers: the hidden states after ``deepstack_visual_indexes`` blocks
are merged too, and the decoder adds them to the image tokens' hidden states
after its first layers. Parameter names follow the checkpoint's ``visual.*``.

Shape letters: N patches, D tower width, M = N / merge^2 merged tokens, H the
text model's hidden size, K DeepStack layers.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Mapping

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from ifb_plugins.common.media.qwen2_5_vl_vision import VisionBlock, check_grid, patch_positions, rotary_2d, tower_fields
from ifb_plugins.common.media.vision import activation

NORM_EPS = 1e-6


@attrs.frozen
class Qwen3VisionConfig:
    """``vision_config`` of a ``Qwen3VLConfig``."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> Qwen3VisionConfig:
        base, fields = tower_fields(cls, cfg)
        config = cls(
            **fields, num_position_embeddings=int(cfg.get("num_position_embeddings", base.num_position_embeddings)),
            deepstack_visual_indexes=tuple(int(i) for i in cfg.get("deepstack_visual_indexes",
                                                                   base.deepstack_visual_indexes)),
        )
        hidden, heads = config.hidden_size, config.num_heads
        if hidden % heads or config.head_dim % 4:
            raise ValueError(f"vision hidden_size {hidden} over {heads} heads must give a head dim divisible by 4")
        if math.isqrt(config.num_position_embeddings) ** 2 != config.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {config.num_position_embeddings} is not a square grid")
        return config


class VisionMLP(nn.Module):
    def __init__(self, cfg: Qwen3VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class PatchMerger(nn.Module):
    """Each 2x2 block of patches concatenated, through an MLP; the norm runs before (main) or after the
    concatenation (``postshuffle``: the DeepStack mergers)."""

    def __init__(self, cfg: Qwen3VisionConfig, postshuffle: bool) -> None:
        super().__init__()
        inner = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(inner if postshuffle else cfg.hidden_size, eps=NORM_EPS)
        self.linear_fc1 = nn.Linear(inner, inner)
        self.linear_fc2 = nn.Linear(inner, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.linear_fc1.in_features
        x = self.norm(x.view(-1, inner)) if self.postshuffle else self.norm(x).view(-1, inner)  # [M, 4D]
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))  # [M, H]


class PatchEmbed(nn.Module):
    def __init__(self, cfg: Qwen3VisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, stride=kernel, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight  # a kernel as large as its stride: a matmul with the flattened kernel
        return F.linear(pixel_values.to(weight.dtype), weight.view(weight.shape[0], -1), self.proj.bias)  # [N, D]


class Qwen3VisionTower(nn.Module):
    """``visual.*``: ``pixel_values`` of one image to its merged embeddings and DeepStack features."""

    def __init__(self, cfg: Qwen3VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        norm = partial(nn.LayerNorm, eps=NORM_EPS)
        self.blocks = nn.ModuleList(VisionBlock(cfg, norm=norm, mlp=VisionMLP) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, postshuffle=True) for _ in cfg.deepstack_visual_indexes)

    def positions(self, grid: tuple[int, int, int]) -> torch.Tensor:
        """The learned ``side x side`` positions resized to the ``h x w`` grid, in patch order: ``[N, D]``."""
        t, h, w = grid
        side = math.isqrt(self.config.num_position_embeddings)
        table = self.pos_embed.weight.view(side, side, -1).permute(2, 0, 1)[None]  # [1, D, side, side]
        resized = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # [D, h, w]
        pos = patch_positions(t, h, w, self.config.spatial_merge_size).to(table.device)  # [N, 2]
        return resized[:, pos[:, 0], pos[:, 1]].transpose(0, 1)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor,
                grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Embeddings ``[M, H]``, DeepStack features ``[K, M, H]`` and importance ``[M]`` of one image.

        The importance is the attention a merged token's patches receive in the last block.
        """
        cfg = self.config
        unit = cfg.spatial_merge_size ** 2
        t, h, w = grid
        check_grid(pixel_values.shape[0], grid, cfg.spatial_merge_size)
        bounds = [0] + [h * w * (i + 1) for i in range(t)]  # attention within each frame
        x = self.patch_embed(pixel_values) + self.positions(grid)  # [N, D]
        cos, sin = rotary_2d(cfg, grid, pixel_values.device)  # the 2D rotary of Qwen2.5-VL
        deepstack, received = [], None
        for i, block in enumerate(self.blocks):
            x, received = block(x, cos, sin, bounds, need_received=i == len(self.blocks) - 1)
            if i in cfg.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[cfg.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(x))
        merged = self.merger(x)  # [M, H]
        features = torch.stack(deepstack) if deepstack else merged.new_zeros(0, *merged.shape)
        importance = received.view(-1, unit).mean(-1) if received is not None else merged.new_zeros(merged.shape[0])
        return merged, features, importance
