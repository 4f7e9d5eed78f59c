"""The Qwen2.5-VL vision tower: patch embedding, 2D rotary ViT with window attention, patch merger.

One image at a time: ``pixel_values [N, C * T * P * P]`` (``qwen2_5_vl_image``)
and its patch grid ``(t, h, w)`` give ``N / merge^2`` embeddings in the text
model's space, in the raster order of the merged ``(h / merge) x (w / merge)``
grid that the prompt's placeholders follow. Parameter names follow the
checkpoint's ``visual.*`` tensors, so they load as they are.

Shape letters: N patches, D tower width, d head dim, M = N / merge^2 merged
tokens, H the text model's hidden size, W windows.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from ifb.params import InvalidRequest
from ifb_plugins.common.models.decoder import RMSNorm
from ifb_plugins.common.layers.mrope import grid_ids
from ifb_plugins.common.media.vision import activation

#: the tower's RMSNorms, fixed in the reference implementation (not in the config)
NORM_EPS = 1e-6


def tower_fields(cls: type, cfg: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``cls``'s defaults and the fields of a Qwen vision config that Qwen2.5-VL's and Qwen3-VL's read alike
    from a ``vision_config``: the sizes (required), the patching, the activation and the rotary base."""
    base = cls(depth=0, hidden_size=0, intermediate_size=0, num_heads=0, out_hidden_size=0)
    try:
        depth, hidden = int(cfg["depth"]), int(cfg["hidden_size"])
        inter, heads, out = int(cfg["intermediate_size"]), int(cfg["num_heads"]), int(cfg["out_hidden_size"])
    except KeyError as exc:
        raise ValueError(f"vision_config is missing {exc.args[0]!r}") from None
    rope = cfg.get("rope_parameters") or {}
    return base, dict(
        depth=depth, hidden_size=hidden, intermediate_size=inter, num_heads=heads, out_hidden_size=out,
        patch_size=int(cfg.get("patch_size", base.patch_size)),
        temporal_patch_size=int(cfg.get("temporal_patch_size", base.temporal_patch_size)),
        spatial_merge_size=int(cfg.get("spatial_merge_size", base.spatial_merge_size)),
        in_channels=int(cfg.get("in_channels", base.in_channels)),
        hidden_act=str(cfg.get("hidden_act", base.hidden_act)),
        rope_theta=float(rope.get("rope_theta", base.rope_theta)),
    )


@attrs.frozen
class Qwen2_5VisionConfig:
    """``vision_config`` of a ``Qwen2_5_VLConfig``."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    in_channels: int = 3
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> Qwen2_5VisionConfig:
        base, fields = tower_fields(cls, cfg)
        config = cls(
            **fields, window_size=int(cfg.get("window_size", base.window_size)),
            fullatt_block_indexes=tuple(int(i) for i in cfg.get("fullatt_block_indexes", base.fullatt_block_indexes)),
        )
        hidden, heads = config.hidden_size, config.num_heads
        if hidden % heads or config.head_dim % 4:
            raise ValueError(f"vision hidden_size {hidden} over {heads} heads must give a head dim divisible by 4 "
                             "(2D rotary over height and width)")
        return config


def patch_positions(grid_t: int, grid_h: int, grid_w: int, merge: int) -> torch.Tensor:
    """``(row, column)`` of every patch ``[N, 2]``, in the processor's order (merge blocks contiguous)."""
    rows = torch.arange(grid_h)[:, None].expand(grid_h, grid_w)
    cols = torch.arange(grid_w)[None, :].expand(grid_h, grid_w)
    blocks = (grid_h // merge, merge, grid_w // merge, merge)
    rows, cols = (x.reshape(blocks).transpose(1, 2).flatten() for x in (rows, cols))
    return torch.stack((rows, cols), dim=-1).repeat(grid_t, 1)


def rotary_2d(cfg: Any, grid: tuple[int, int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` ``[N, d]`` of a tower with ``head_dim``, ``rope_theta`` and ``spatial_merge_size``:
    the first half of each head rotates by row, the second by column."""
    half = cfg.head_dim // 2  # rows and columns each rotate half of the head dim
    # float32 from the config, never a cast buffer (the tower may be built on the meta device)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float, device=device) / half))
    pos = patch_positions(*grid, cfg.spatial_merge_size).to(device)  # [N, 2]
    freqs = pos[..., None].float() * inv_freq  # [N, 2, d/4]
    emb = freqs.flatten(1)  # [N, d/2]: row frequencies, then column frequencies
    emb = torch.cat((emb, emb), dim=-1)  # [N, d]
    return emb.cos(), emb.sin()


def check_grid(num_patches: int, grid: tuple[int, int, int], merge: int) -> None:
    """Refuse ``num_patches`` that do not tile the ``(t, h, w)`` grid in ``merge x merge`` blocks."""
    t, h, w = grid
    if num_patches != t * h * w or h % merge or w % merge:
        raise ValueError(f"{num_patches} patches do not form a {t}x{h}x{w} grid of {merge}x{merge} blocks")


def window_order(grid_t: int, grid_h: int, grid_w: int, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Merged tokens reordered window by window ``[M]``, and the windows' bounds in patches ``[W + 1]``.

    The merged grid is cut into ``window x window`` squares from the top-left
    (the last row and column of squares may be partial); attention outside the
    full-attention blocks stays within a square.
    """
    gh, gw = grid_h // merge, grid_w // merge
    index = torch.arange(grid_t * gh * gw).reshape(grid_t, gh, gw)
    pad_h, pad_w = -gh % window, -gw % window
    num_h, num_w = (gh + pad_h) // window, (gw + pad_w) // window
    padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
    padded = padded.reshape(grid_t, num_h, window, num_w, window).permute(0, 1, 3, 2, 4)
    padded = padded.reshape(grid_t * num_h * num_w, window * window)  # one row per window
    order = padded[padded >= 0]
    bounds = [0]
    for n in (padded >= 0).sum(-1).tolist():
        if n:  # a window that falls wholly in the padding holds nothing
            bounds.append(bounds[-1] + n * merge * merge)
    return order, bounds


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    """Bidirectional attention within spans of the (window-ordered) patch sequence."""

    def __init__(self, cfg: Qwen2_5VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int],
                need_received: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output ``[N, D]`` and, if asked, the attention each patch receives in its span ``[N]``."""
        n, dim = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # [N, heads, d] each
        # rotated in float32 whatever the tower's dtype, as the reference does
        cos, sin = cos[:, None].float(), sin[:, None].float()
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        out = torch.empty_like(q)
        received = torch.empty(n, device=x.device) if need_received else None
        # spans of equal length run as one batched call
        by_length: dict[int, list[int]] = {}
        for start, end in zip(bounds[:-1], bounds[1:]):
            by_length.setdefault(end - start, []).append(start)
        for length, starts in by_length.items():
            rows = (torch.tensor(starts)[:, None] + torch.arange(length)).flatten().to(x.device)  # [S * length]
            qs, ks, vs = (t.index_select(0, rows).view(len(starts), length, *t.shape[1:]).transpose(1, 2)
                          for t in (q, k, v))  # [S, heads, length, d]
            o = F.scaled_dot_product_attention(qs, ks, vs)
            out.index_copy_(0, rows, o.transpose(1, 2).reshape(-1, *q.shape[1:]))
            if received is not None:
                received.index_copy_(0, rows, _received(qs, ks).flatten())
        return self.proj(out.reshape(n, dim)), received  # [N, D]


def _received(q: torch.Tensor, k: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Attention each key receives ``[S, L]``, averaged over heads and queries, from ``q, k [S, heads, L, d]``.

    Queries go ``chunk`` at a time, so a full-attention span never holds its whole ``L x L`` matrix.
    """
    s, heads, length, d = q.shape
    total = torch.zeros(s, length, device=q.device)
    for i in range(0, length, chunk):
        probs = torch.softmax((q[:, :, i:i + chunk] @ k.transpose(-1, -2)).float() / d ** 0.5, dim=-1)
        total += probs.sum(dim=(1, 2))  # [S, L]
    return total / (heads * length)


class VisionMLP(nn.Module):
    """Gated feed-forward with biases: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, cfg: Qwen2_5VisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def rms_norm(dim: int) -> nn.Module:
    return RMSNorm(dim, NORM_EPS)


class VisionBlock(nn.Module):
    """Pre-norm attention then MLP, each residual; ``norm(dim)`` and ``mlp(cfg)`` make the tower's own
    (Qwen2.5-VL's: RMSNorm and the gated MLP; Qwen3-VL's: LayerNorm and a plain one)."""

    def __init__(self, cfg: Any, norm: Callable[[int], nn.Module] = rms_norm,
                 mlp: Callable[[Any], nn.Module] = VisionMLP) -> None:
        super().__init__()
        self.norm1 = norm(cfg.hidden_size)
        self.norm2 = norm(cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        self.mlp = mlp(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int],
                need_received: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn, received = self.attn(self.norm1(x), cos, sin, bounds, need_received)
        x = x + attn
        return x + self.mlp(self.norm2(x)), received


class PatchMerger(nn.Module):
    """Each ``merge x merge`` block of patches, concatenated, through an MLP into the text model's space."""

    def __init__(self, cfg: Qwen2_5VisionConfig) -> None:
        super().__init__()
        inner = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.ln_q = RMSNorm(cfg.hidden_size, NORM_EPS)
        self.mlp = nn.Sequential(nn.Linear(inner, inner), nn.GELU(), nn.Linear(inner, cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.mlp[0].in_features
        return self.mlp(self.ln_q(x).view(-1, inner))  # [N, D] -> [M, 4D] -> [M, H]


class PatchEmbed(nn.Module):
    def __init__(self, cfg: Qwen2_5VisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, stride=kernel, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # a kernel as large as its stride over one patch each: a matmul with the flattened kernel
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.view(weight.shape[0], -1))  # [N, D]


class Qwen2_5VisionTower(nn.Module):
    """``visual.*``: ``pixel_values`` of one image to its merged embeddings ``[M, H]``."""

    def __init__(self, cfg: Qwen2_5VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings ``[M, H]`` of one image and each one's importance ``[M]``.

        ``pixel_values [N, C*T*P*P]``, ``grid`` its ``(t, h, w)`` patches. A merged
        token's importance is the attention its patches receive in the last block
        (averaged over heads, queries and its patches): the tower's own judgement of
        where the content is, for the visual-token pruner.
        """
        cfg = self.config
        unit = cfg.spatial_merge_size ** 2
        t, h, w = grid
        check_grid(pixel_values.shape[0], grid, cfg.spatial_merge_size)
        window = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
        order, window_bounds = window_order(t, h, w, cfg.spatial_merge_size, window)
        order = order.to(pixel_values.device)
        n = pixel_values.shape[0]
        full_bounds = [0] + [h * w * (i + 1) for i in range(t)]  # full attention spans one frame

        def by_window(x: torch.Tensor) -> torch.Tensor:  # [N, ...] with merge blocks in window order
            return x.reshape(n // unit, unit, -1).index_select(0, order).reshape(n, -1)

        x = by_window(self.patch_embed(pixel_values))  # [N, D]
        cos, sin = (by_window(c) for c in rotary_2d(cfg, grid, pixel_values.device))  # [N, d]
        received = None
        for i, block in enumerate(self.blocks):
            bounds = full_bounds if i in cfg.fullatt_block_indexes else window_bounds
            x, received = block(x, cos, sin, bounds, need_received=i == len(self.blocks) - 1)
        merged = self.merger(x)  # [M, H], window order
        importance = received.view(-1, unit).mean(-1) if received is not None else torch.zeros(n // unit)
        raster = torch.argsort(order)
        return merged.index_select(0, raster), importance.index_select(0, raster.to(importance.device))


@torch.inference_mode()
def encode_image(tower: nn.Module, processing: Any, image: Any, device: torch.device) -> tuple[tuple, torch.Tensor]:
    """One image through a Qwen-VL processor (``QwenVLImageProcessing``) and tower (this one or Qwen3-VL's):
    the tower's outputs and the merged tokens' M-RoPE relative ids ``[3, M]``."""
    try:
        pixels, grid = processing(image)
    except ValueError as exc:  # an aspect ratio the processor refuses
        raise InvalidRequest(f"this image cannot be processed: {exc}") from None
    outputs = tower(torch.from_numpy(pixels).to(device), grid)
    merge = tower.config.spatial_merge_size
    return outputs, grid_ids(grid[0], grid[1] // merge, grid[2] // merge)
