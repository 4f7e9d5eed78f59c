"""CLIP and SigLIP vision transformers, as LLaVA and Idefics3 use them.

Parameter names follow ``CLIPVisionModel`` / ``SiglipVisionTransformer``
(``embeddings.*``, ``pre_layrnorm.*``, ``encoder.layers.N.*``), so a tower's
weights load once its checkpoint prefix is stripped. The tower returns every
hidden state (the embeddings, then each layer's output) up to the deepest one
asked for: LLaVA selects layers by index and applies no final norm; SigLIP's
``post_layernorm`` is applied by the families that use it (Idefics3).

Shape letters: N tokens (patches, plus CLIP's class token), D tower width,
P patch side, G the patch grid side.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import attrs
import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "silu": F.silu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


#: ``model_type`` of the vision configs this module builds (Idefics3's and SmolVLM's towers are SigLIP's)
VISION_TYPES = ("clip_vision_model", "siglip_vision_model", "idefics3_vision", "smolvlm_vision")


@attrs.frozen
class VisionConfig:
    """A ViT encoder: CLIP (class token, pre-norm, bias-free patch conv) or SigLIP (neither)."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @property
    def is_clip(self) -> bool:
        return self.model_type == "clip_vision_model"

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], default_type: str = "clip_vision_model") -> VisionConfig:
        """Read a ``vision_config``; a missing ``model_type`` is ``default_type`` (as transformers assumes)."""
        model_type = str(cfg.get("model_type", default_type))
        if model_type not in VISION_TYPES:
            raise ValueError(f"vision tower {model_type!r} is not supported (supported: {', '.join(VISION_TYPES)})")
        clip = model_type == "clip_vision_model"
        model_type = model_type if clip else "siglip_vision_model"
        # transformers' defaults, for configs that leave them out
        return cls(
            model_type=model_type,
            hidden_size=int(cfg.get("hidden_size", 768)),
            intermediate_size=int(cfg.get("intermediate_size", 3072)),
            num_layers=int(cfg.get("num_hidden_layers", 12)),
            num_heads=int(cfg.get("num_attention_heads", 12)),
            image_size=int(cfg.get("image_size", 224)),
            patch_size=int(cfg.get("patch_size", 32 if clip else 16)),
            num_channels=int(cfg.get("num_channels", 3)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5 if clip else 1e-6)),
            hidden_act=str(cfg.get("hidden_act", "quick_gelu" if clip else "gelu_pytorch_tanh")),
        )


class Attention(nn.Module):
    """Bidirectional multi-head self-attention over one image's tokens ``[B, N, D]``."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"tower width {dim} is not a multiple of its {num_heads} heads")
        self.num_heads = num_heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                need_scores: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output ``[B, N, D]`` and, if asked, the attention each token receives ``[B, N]``.

        ``mask [B, N]`` (True: a real token) hides padded keys.
        """
        b, n, dim = x.shape
        q, k, v = (p(x).view(b, n, self.num_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        bias = None
        if mask is not None:
            bias = torch.zeros(b, 1, 1, n, dtype=x.dtype, device=x.device).masked_fill(
                ~mask[:, None, None, :], torch.finfo(x.dtype).min)
        received = None
        if need_scores:
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # [B, heads, N, N]
            probs = torch.softmax(scores if bias is None else scores + bias, dim=-1)
            out = probs @ v
            received = probs.mean(dim=(1, 2))  # averaged over heads and queries
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, dim)), received


class MLP(nn.Module):
    def __init__(self, dim: int, inner: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, inner), nn.Linear(inner, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    """The pre-norm layer CLIP and SigLIP share."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_heads)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                need_scores: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn, received = self.self_attn(self.layer_norm1(x), mask, need_scores)
        x = x + attn
        return x + self.mlp(self.layer_norm2(x)), received


class Embeddings(nn.Module):
    """Patch conv plus learned positions (and CLIP's class token, first)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        if cfg.is_clip:
            self.class_embedding = nn.Parameter(torch.empty(cfg.hidden_size))
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size,
                                         bias=not cfg.is_clip)
        self.position_embedding = nn.Embedding(cfg.grid ** 2 + int(cfg.is_clip), cfg.hidden_size)

    def forward(self, pixels: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``pixels [B, C, S, S]`` -> ``[B, N, D]``; without ``position_ids [B, N]``, S must be the image size."""
        cfg = self.config
        if position_ids is not None:  # Idefics3: any size, positions bucketed onto the learned grid
            return self.patch_embedding(pixels).flatten(2).transpose(1, 2) + self.position_embedding(position_ids)
        if pixels.shape[-2:] != (cfg.image_size, cfg.image_size):
            raise ValueError(f"the vision tower takes {cfg.image_size}x{cfg.image_size} images, "
                             f"got {tuple(pixels.shape[-2:])}")
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [B, G*G, D], row-major over the grid
        if cfg.is_clip:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, x: torch.Tensor, num_layers: int, mask: torch.Tensor | None = None
                ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Hidden states ``[x, layer 1, ..., layer num_layers]`` and the attention received in the last layer run."""
        states, received = [x], None
        for i, layer in enumerate(self.layers[:num_layers]):
            x, received = layer(x, mask, need_scores=i == num_layers - 1)
            states.append(x)
        return states, received


class VisionTower(nn.Module):
    """``CLIPVisionModel`` / ``SiglipVisionTransformer`` without their pooling heads."""

    def __init__(self, cfg: VisionConfig, *, post_layernorm: bool = True) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        if cfg.is_clip:
            self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.encoder = Encoder(cfg)
        if post_layernorm:
            self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def hidden_states(self, pixels: torch.Tensor, num_layers: int, position_ids: torch.Tensor | None = None
                      ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``num_layers + 1`` hidden states ``[B, N, D]`` (no final norm) and the importance of each token ``[B, N]``.

        A token's importance is the attention it receives in the last layer run, averaged over heads and
        queries: the tower's own judgement of where the image's content is (the visual-token pruner's rank).
        """
        x = self.embeddings(pixels, position_ids)
        if self.config.is_clip:
            x = self.pre_layrnorm(x)
        states, received = self.encoder(x, num_layers)
        if received is None:  # no layer ran: every token counts the same
            received = torch.full(x.shape[:2], 1.0 / x.shape[1], device=x.device)
        return states, received
