"""Gemma 4's audio encoder (``Gemma4AudioModel``, a conformer) and its log-mel front end
(``Gemma4AudioFeatureExtractor``), for one clip at a time.

Front end: the waveform is zero-padded to a multiple of 128 samples, prepended
with half a frame of zeros, cut into 20 ms frames every 10 ms, Hann-windowed,
FFT'd; the magnitude goes through HTK mel filters (no area norm) and
``log(mel + mel_floor)``. A frame is valid when its window ends on real audio;
invalid frames are zeroed.

Encoder: two stride-2 3x3 convolutions (LayerNorm over channels, ReLU, the
frame mask applied before each) quarter time and frequency, a linear layer
projects each step; then conformer layers: a half-step feed-forward, chunked
local self-attention (each chunk of ``attention_chunk_size`` steps sees its
own steps and ``attention_context_left - 1`` before; Transformer-XL relative
positions, soft-capped logits, a learned per-dimension query scale), a
lightweight causal depthwise convolution, another half-step feed-forward, a
final norm. An output projection, and only the valid steps (the mask halved
twice) become soft tokens. Linear layers may clip to checkpoint bounds.

Parameter names follow the checkpoint's ``audio_tower.*`` tensors.

Shape letters: T steps after subsampling, D width, H heads, d head dim, B blocks, C chunk, K context.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ifb_plugins.common.media.gemma4_vision import ClippableLinear, RMSNorm
from ifb_plugins.common.media.vision import activation


@attrs.frozen
class Gemma4AudioConfig:
    """``audio_config`` of a ``Gemma4Config``."""

    hidden_size: int = 1024
    num_layers: int = 12
    num_heads: int = 8
    hidden_act: str = "silu"
    subsampling_conv_channels: tuple[int, int] = (128, 32)
    conv_kernel_size: int = 5
    residual_weight: float = 0.5
    attention_chunk_size: int = 12
    attention_context_left: int = 13
    attention_context_right: int = 0
    attention_logit_cap: float = 50.0
    attention_invalid_logits_value: float = -1.0e9
    use_clipped_linears: bool = True
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    output_proj_dims: int = 1536

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> Gemma4AudioConfig:
        base = cls()
        fields = {f.name: type(getattr(base, f.name))(cfg[f.name]) for f in attrs.fields(cls)
                  if f.name not in ("num_layers", "num_heads", "subsampling_conv_channels") and f.name in cfg}
        return cls(**fields, num_layers=int(cfg.get("num_hidden_layers", base.num_layers)),
                   num_heads=int(cfg.get("num_attention_heads", base.num_heads)),
                   subsampling_conv_channels=tuple(int(c) for c in cfg.get("subsampling_conv_channels",
                                                                           base.subsampling_conv_channels)))


@attrs.frozen
class Gemma4AudioFeatures:
    """The feature extractor's settings (``Gemma4AudioFeatureExtractor``'s defaults)."""

    feature_size: int = 128
    sampling_rate: int = 16000
    frame_length: int = 320
    hop_length: int = 160
    min_frequency: float = 0.0
    max_frequency: float = 8000.0
    mel_floor: float = 1e-3
    input_scale_factor: float = 1.0
    pad_to_multiple_of: int = 128
    fft_overdrive: bool = False

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> Gemma4AudioFeatures:
        base = cls()
        for name, default in (("preemphasis", 0.0), ("dither", 0.0), ("per_bin_mean", None), ("per_bin_stddev", None)):
            if cfg.get(name, default) != default:
                raise ValueError(f"feature extractor setting {name}={cfg[name]!r} is not supported")
        return cls(**{f.name: type(getattr(base, f.name))(cfg[f.name]) for f in attrs.fields(cls) if f.name in cfg})

    @property
    def fft_length(self) -> int:
        return 2 ** math.ceil(math.log2(self.frame_length)) * (2 if self.fft_overdrive else 1)

    def mel_filters(self) -> np.ndarray:
        """HTK-scale triangular filters ``[fft_length / 2 + 1, feature_size]`` (transformers' ``mel_filter_bank``)."""
        def mel(f):
            return 2595.0 * np.log10(1.0 + np.asarray(f, dtype=np.float64) / 700.0)

        mels = np.linspace(mel(self.min_frequency), mel(self.max_frequency), self.feature_size + 2)
        edges = 700.0 * (10.0 ** (mels / 2595.0) - 1.0)
        bins = np.linspace(0, self.sampling_rate // 2, self.fft_length // 2 + 1)
        slopes = edges[None, :] - bins[:, None]
        diff = np.diff(edges)
        return np.maximum(0.0, np.minimum(-slopes[:, :-2] / diff[:-1], slopes[:, 2:] / diff[1:]))

    def __call__(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Log-mel features ``[F, feature_size]`` float32 (invalid frames zero) and the frames' validity ``[F]``."""
        wave = np.asarray(samples, dtype=np.float32) * self.input_scale_factor
        n = len(wave)
        padded = -(-n // self.pad_to_multiple_of) * self.pad_to_multiple_of
        valid = np.zeros(padded + self.frame_length // 2, dtype=bool)
        valid[self.frame_length // 2:self.frame_length // 2 + n] = True
        wave = np.pad(wave, (self.frame_length // 2, padded - n))
        size = self.frame_length + 1
        num_frames = (len(wave) - size) // self.hop_length + 1
        if num_frames <= 0:
            raise ValueError("the clip is shorter than one frame")
        starts = np.arange(num_frames) * self.hop_length
        frames = wave[starts[:, None] + np.arange(self.frame_length)[None, :]]
        window = np.hanning(self.frame_length + 1)[:-1].astype(np.float32)
        spectrum = np.abs(np.fft.rfft(frames * window, n=self.fft_length, axis=-1))
        features = np.log(spectrum @ self.mel_filters() + np.float64(self.mel_floor)).astype(np.float32)
        mask = valid[starts + size - 1]
        return features * mask[:, None], mask


class SubsampleLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, eps: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, (3, 3), stride=(2, 2), padding=1, bias=False)
        self.norm = nn.LayerNorm(out_channels, eps=eps, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.conv(x * mask[None, None, :, None])  # [1, C, T, F]
        return F.relu(self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)), mask[::2]


class SubsampleProjection(nn.Module):
    def __init__(self, cfg: Gemma4AudioConfig) -> None:
        super().__init__()
        c0, c1 = cfg.subsampling_conv_channels
        self.layer0 = SubsampleLayer(1, c0, cfg.rms_norm_eps)
        self.layer1 = SubsampleLayer(c0, c1, cfg.rms_norm_eps)
        self.input_proj_linear = nn.Linear((c0 // 4) * c1, cfg.hidden_size, bias=False)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, mask = self.layer0(features[None, None], mask)
        x, mask = self.layer1(x, mask)
        return self.input_proj_linear(x[0].permute(1, 2, 0).reshape(x.shape[2], -1)), mask  # [T, D], [T]


class FeedForward(nn.Module):
    def __init__(self, cfg: Gemma4AudioConfig) -> None:
        super().__init__()
        h, clip = cfg.hidden_size, cfg.use_clipped_linears
        self.cfg = cfg
        self.ffw_layer_1, self.ffw_layer_2 = ClippableLinear(h, 4 * h, clip), ClippableLinear(4 * h, h, clip)
        self.pre_layer_norm, self.post_layer_norm = RMSNorm(h, 1e-6), RMSNorm(h, 1e-6)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clip = min(self.cfg.gradient_clipping, torch.finfo(x.dtype).max)
        h = self.ffw_layer_2(self.act(self.ffw_layer_1(self.pre_layer_norm(torch.clamp(x, -clip, clip)))))
        return self.post_layer_norm(torch.clamp(h, -clip, clip)) * self.cfg.residual_weight + x


class ChunkedAttention(nn.Module):
    """Local attention within chunks and their left context, with relative position logits."""

    def __init__(self, cfg: Gemma4AudioConfig) -> None:
        super().__init__()
        h, clip = cfg.hidden_size, cfg.use_clipped_linears
        self.cfg = cfg
        self.head_dim = h // cfg.num_heads
        self.past = cfg.attention_context_left - 1
        self.context = cfg.attention_chunk_size + self.past + cfg.attention_context_right
        self.q_proj, self.k_proj = ClippableLinear(h, h, clip), ClippableLinear(h, h, clip)
        self.v_proj, self.post = ClippableLinear(h, h, clip), ClippableLinear(h, h, clip)
        self.relative_k_proj = nn.Linear(h, h, bias=False)
        self.per_dim_scale = nn.Parameter(torch.zeros(self.head_dim))

    def _context(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H, d]`` to each block's keys ``[B, K, H, d]`` (zero beyond the clip)."""
        x = F.pad(x, (0, 0, 0, 0, self.past, self.cfg.attention_context_right + self.cfg.attention_chunk_size - 1))
        return torch.movedim(x.unfold(0, self.context, self.cfg.attention_chunk_size), -1, 1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """``x [T, D]``, relative position embeddings ``positions [P, D]``, ``allowed [B, C, K]``."""
        cfg, t, d = self.cfg, x.shape[0], self.head_dim
        chunk, heads = cfg.attention_chunk_size, cfg.num_heads
        q = self.q_proj(x).float().view(t, heads, d) * ((d ** -0.5) / math.log(2)) * F.softplus(self.per_dim_scale)
        k = self.k_proj(x).float().view(t, heads, d) * (math.log(1 + math.e) / math.log(2))
        v = self.v_proj(x).float().view(t, heads, d)
        blocks = -(-t // chunk)
        q = F.pad(q, (0, 0, 0, 0, 0, blocks * chunk - t)).view(blocks, chunk, heads, d).permute(2, 0, 1, 3)
        k, v = self._context(k).permute(2, 0, 3, 1), self._context(v).permute(2, 0, 1, 3)  # [H,B,d,K], [H,B,K,d]
        ac = q @ k  # [H, B, C, K]
        rel = self.relative_k_proj(positions).view(-1, heads, d).float()  # [P, H, d]
        bd = (q.reshape(heads, -1, d) @ rel.permute(1, 2, 0)).view(heads, blocks, chunk, -1)
        bd = F.pad(bd, (0, self.context + 1 - bd.shape[-1])).view(heads, blocks, chunk * (self.context + 1))
        bd = bd[..., :chunk * self.context].view(heads, blocks, chunk, self.context)  # the relative shift
        logits = torch.tanh((ac + bd) / cfg.attention_logit_cap) * cfg.attention_logit_cap
        logits = logits.masked_fill(~allowed, cfg.attention_invalid_logits_value)
        out = torch.softmax(logits, dim=-1) @ v  # [H, B, C, d]
        out = out.permute(1, 2, 0, 3).reshape(blocks * chunk, -1)[:t]
        return self.post(out.to(x.dtype))


class LightConv(nn.Module):
    def __init__(self, cfg: Gemma4AudioConfig) -> None:
        super().__init__()
        h, clip = cfg.hidden_size, cfg.use_clipped_linears
        self.cfg = cfg
        self.linear_start, self.linear_end = ClippableLinear(h, 2 * h, clip), ClippableLinear(h, h, clip)
        self.depthwise_conv1d = nn.Conv1d(h, h, cfg.conv_kernel_size, groups=h, bias=False)
        self.pre_layer_norm, self.conv_norm = RMSNorm(h, cfg.rms_norm_eps), RMSNorm(h, cfg.rms_norm_eps)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1)  # [T, D]
        h = self.depthwise_conv1d(F.pad(h.T[None], (self.cfg.conv_kernel_size - 1, 0)))[0].T  # causal
        clip = min(self.cfg.gradient_clipping, torch.finfo(h.dtype).max)
        return self.linear_end(self.act(self.conv_norm(torch.clamp(h, -clip, clip)))) + x


class ConformerLayer(nn.Module):
    def __init__(self, cfg: Gemma4AudioConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.feed_forward1, self.feed_forward2 = FeedForward(cfg), FeedForward(cfg)
        self.self_attn, self.lconv1d = ChunkedAttention(cfg), LightConv(cfg)
        self.norm_pre_attn, self.norm_post_attn, self.norm_out = RMSNorm(h, 1e-6), RMSNorm(h, 1e-6), RMSNorm(h, 1e-6)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        clip = min(self.cfg.gradient_clipping, torch.finfo(x.dtype).max)
        x = self.feed_forward1(x)
        h = self.self_attn(self.norm_pre_attn(torch.clamp(x, -clip, clip)), positions, allowed)
        x = self.norm_post_attn(torch.clamp(h, -clip, clip)) + x
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(torch.clamp(x, -clip, clip))


class Gemma4AudioTower(nn.Module):
    """``audio_tower.*``: one clip's log-mel features to its soft tokens ``[N, output_proj_dims]``."""

    def __init__(self, cfg: Gemma4AudioConfig) -> None:
        super().__init__()
        self.config = cfg
        self.subsample_conv_projection = SubsampleProjection(cfg)
        self.layers = nn.ModuleList(ConformerLayer(cfg) for _ in range(cfg.num_layers))
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.output_proj_dims)

    def relative_positions(self, device: torch.device) -> torch.Tensor:
        """Sinusoids ``[P, D]`` (sines, then cosines) of the distances ``K / 2 .. 0``."""
        cfg = self.config
        context = cfg.attention_chunk_size + cfg.attention_context_left - 1 + cfg.attention_context_right
        half = cfg.hidden_size // 2
        inv = torch.exp(torch.arange(half, device=device) * -(math.log(10000.0) / max(half - 1, 1)))
        scaled = torch.arange(context // 2, -1, -1, device=device)[:, None] * inv[None, :]
        return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=-1)

    def allowed(self, mask: torch.Tensor) -> torch.Tensor:
        """Which context key each query of each block may see ``[B, C, K]``: a valid step inside the window."""
        cfg = self.config
        t, chunk, past = mask.shape[0], cfg.attention_chunk_size, cfg.attention_context_left - 1
        blocks = -(-t // chunk)
        q = torch.arange(blocks * chunk, device=mask.device).view(blocks, chunk, 1)
        kv = (torch.arange(blocks, device=mask.device) * chunk - past)[:, None, None] + torch.arange(
            chunk + past + cfg.attention_context_right, device=mask.device)[None, None, :]
        dist = q - kv
        window = ((dist >= 0) & (dist < past)) | ((dist < 0) & (-dist < cfg.attention_context_right))
        inside = (kv >= 0) & (kv < t) & (q < t)
        return window & inside & mask[kv.clamp(0, t - 1)]

    @torch.inference_mode()
    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``features [F, mel]``, ``mask [F]`` (valid frames) to the valid steps' outputs ``[N, output_proj_dims]``."""
        x, mask = self.subsample_conv_projection(features, mask.to(features.dtype))
        mask = mask.bool()
        positions, allowed = self.relative_positions(x.device).to(x.dtype), self.allowed(mask)
        for layer in self.layers:
            x = layer(x, positions, allowed)
        return self.output_proj(x)[mask]
