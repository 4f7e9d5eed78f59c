"""The media encoders and projectors of a LLaVA-style deployment.

Parameter names follow the Hugging Face layouts (SigLIP's ``vision_model.*``,
Whisper's encoder, LLaVA's ``linear_1``/``linear_2`` projector), so the
checkpoint's ``vision_tower.``, ``audio_tower.``, ``multi_modal_projector.``
and ``audio_projector.`` tensors load as they are into ``MediaModel``.

Shape letters: N media tokens (patches or audio frames), D encoder width,
H the text model's hidden size, F mel frames, M mel bins.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ifb_plugins.vlm.config import AudioConfig, VisionConfig, VlmConfig

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


class SelfAttention(nn.Module):
    """Bidirectional multi-head self-attention over one media item ``[N, D]``."""

    def __init__(self, dim: int, num_heads: int, k_bias: bool = True) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"encoder width {dim} is not a multiple of its {num_heads} heads")
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=k_bias)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        n, dim = t.shape
        return t.view(n, self.num_heads, dim // self.num_heads).transpose(0, 1)

    def forward(self, x: torch.Tensor, need_scores: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the output ``[N, D]`` and, if asked, the attention each token receives ``[N]``."""
        n, dim = x.shape
        q, k, v = (self._split(proj(x)) for proj in (self.q_proj, self.k_proj, self.v_proj))  # [heads, N, d]
        received = None
        if need_scores:
            probs = torch.softmax((q @ k.transpose(1, 2)) / math.sqrt(q.shape[-1]), dim=-1)  # [heads, N, N]
            out = probs @ v
            received = probs.mean(dim=(0, 1))  # averaged over heads and query tokens
        else:
            out = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
        return self.out_proj(out.transpose(0, 1).reshape(n, dim)), received


class _MLP(nn.Module):
    def __init__(self, dim: int, inner: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, inner)
        self.fc2 = nn.Linear(inner, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    """SigLIP's pre-norm encoder layer."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = SelfAttention(cfg.hidden_size, cfg.num_heads)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = _MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor, need_scores: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn, received = self.self_attn(self.layer_norm1(x), need_scores)
        x = x + attn
        return x + self.mlp(self.layer_norm2(x)), received


class VisionEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.num_patches, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels[None])[0]  # [D, S/P, S/P]
        x = patches.flatten(1).transpose(0, 1)  # [N, D], row-major over the patch grid
        return x + self.position_embedding.weight


class _VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(cfg) for _ in range(cfg.num_layers))


class VisionModel(nn.Module):
    """``vision_model.*``: embeddings, encoder layers, post-layernorm."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(cfg)
        self.encoder = _VisionEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision_model = VisionModel(cfg)

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Features ``[N, D]`` of one normalized image ``[C, S, S]``, and each patch's importance ``[N]``.

        The importance is the attention a patch receives in the last layer (see ``MediaModel.encode_image``).
        """
        vm = self.vision_model
        x = vm.embeddings(pixels)
        received = torch.zeros(x.shape[0], device=x.device)
        last = len(vm.encoder.layers) - 1
        for i, layer in enumerate(vm.encoder.layers):
            x, scores = layer(x, need_scores=i == last)
            if scores is not None:
                received = scores
        return vm.post_layernorm(x), received


class AudioLayer(nn.Module):
    """Whisper's pre-norm encoder layer (no bias on k_proj)."""

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg.hidden_size, cfg.num_heads, k_bias=False)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))[0]
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class AudioTower(nn.Module):
    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, d)
        self.layers = nn.ModuleList(AudioLayer(cfg) for _ in range(cfg.num_layers))
        self.layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.act = activation(cfg.hidden_act)

    @staticmethod
    def num_outputs(num_frames: int) -> int:
        """Encoder outputs for ``num_frames`` mel frames (the second conv has stride 2)."""
        return (num_frames - 1) // 2 + 1

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """Features ``[ceil(F/2), D]`` of one log-mel spectrogram ``[M, F]``."""
        x = self.act(self.conv1(mel[None]))
        x = self.act(self.conv2(x))[0].transpose(0, 1)  # [N, D]
        if x.shape[0] > self.config.max_source_positions:
            raise ValueError(f"{x.shape[0]} audio positions exceed the encoder's {self.config.max_source_positions}")
        x = x + self.embed_positions.weight[: x.shape[0]]
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class Projector(nn.Module):
    """LLaVA's two-layer MLP from encoder width into the text model's embedding space."""

    def __init__(self, in_dim: int, out_dim: int, act: str) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, out_dim)
        self.linear_2 = nn.Linear(out_dim, out_dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def num_kept(num_tokens: int, ratio: float | None) -> int:
    """Visual tokens kept out of ``num_tokens`` under a pruner keeping ``ratio`` (at least one)."""
    if ratio is None or ratio >= 1.0:
        return num_tokens
    # The epsilon keeps float noise (0.3 * 10 = 3.0000000000000004) from rounding up a whole token.
    return max(1, min(num_tokens, math.ceil(ratio * num_tokens - 1e-9)))


class MediaModel(nn.Module):
    """Everything of the checkpoint but the language model; runs at admission."""

    def __init__(self, cfg: VlmConfig) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.text.hidden_size
        if cfg.vision is not None:
            self.vision_tower = VisionTower(cfg.vision)
            self.multi_modal_projector = Projector(cfg.vision.hidden_size, h, cfg.projector_hidden_act)
        if cfg.audio is not None:
            self.audio_tower = AudioTower(cfg.audio)
            self.audio_projector = Projector(cfg.audio.hidden_size, h, cfg.projector_hidden_act)

    @torch.inference_mode()
    def encode_image(self, pixels: torch.Tensor, keep_ratio: float | None = None) -> torch.Tensor:
        """Embeddings ``[N', H]`` of one normalized image ``[C, S, S]``.

        With ``keep_ratio`` only the most informative patches are kept, in
        their original (raster) order. A patch's information is the attention
        it receives in the last encoder layer, averaged over heads and
        queries. SigLIP-style towers have no CLS token whose attention could
        rank patches; the attention every patch pays the others is the
        encoder's own judgement of where the image's content is, whereas a raw
        feature norm is dominated by a few high-norm artifact tokens.
        """
        features, received = self.vision_tower(pixels)  # [N, D], [N]
        embeds = self.multi_modal_projector(features)  # [N, H]
        keep = num_kept(embeds.shape[0], keep_ratio)
        if keep == embeds.shape[0]:
            return embeds
        top = torch.argsort(received, descending=True, stable=True)[:keep]
        return embeds[torch.sort(top).values]

    @torch.inference_mode()
    def encode_audio(self, mel: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[ceil(F/2), H]`` of one log-mel spectrogram ``[M, F]``."""
        return self.audio_projector(self.audio_tower(mel))
