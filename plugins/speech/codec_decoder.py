"""Codec decoder: multi-codebook codec frames -> a 24 kHz mono waveform in [-1, 1].

Two checkpoints use this network, and differ only at its two ends:

- Qwen3-Omni's ``code2wav`` (transformers' ``Qwen3OmniMoeCode2Wav``): each
  frame's ``Q`` codes are embedded from one table (codebook ``q`` offset by
  ``q * codebook_size``) and averaged; transposed convolutions trim
  ``kernel - stride`` samples on *both* sides.
- Qwen3-TTS's 12 Hz speech tokenizer ``decoder`` (``Qwen3TTSTokenizerV2Decoder``
  in the ``qwen-tts`` package): the codes are looked up in a split residual
  vector quantizer (one semantic codebook + the acoustic rest, each projected
  by a 1x1 convolution), then a causal convolution widens them to
  ``latent_dim``; the transformer has input / output projections; transposed
  convolutions trim ``kernel - stride`` samples on the right only.

Between the ends: a causal sliding-window transformer over frames, ConvNeXt
upsampling blocks, then a stack of SnakeBeta + causal transposed-convolution
blocks (each with three dilated residual units) down to one channel.
Parameter names follow the reference modules, so a checkpoint's state dict
loads as is. Shapes: B batch, Q codebooks, T frames, C channels, S samples.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from ifb_plugins.common.models.decoder import RMSNorm, apply_rope

#: both references decode long code sequences in chunks of this many frames ...
DECODE_CHUNK_FRAMES = 300
#: ... each preceded by this many frames of left context, whose samples are dropped
DECODE_LEFT_CONTEXT = 25


@attrs.frozen
class CodecDecoderConfig:
    """The shapes of one codec decoder, from ``code2wav_config`` or the speech tokenizer's ``decoder_config``."""

    kind: str  # "omni" (Qwen3-Omni code2wav) or "tts12hz" (Qwen3-TTS 12 Hz tokenizer decoder)
    codebook_size: int
    num_quantizers: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    attention_bias: bool
    sliding_window: int
    rope_theta: float
    rms_norm_eps: float
    upsampling_ratios: tuple[int, ...]
    upsample_rates: tuple[int, ...]
    decoder_dim: int
    #: the ConvNeXt stages' width: hidden_size for Omni, the tokenizer's latent_dim for TTS
    latent_dim: int
    #: the quantizer's width (TTS only)
    codebook_dim: int = 0
    sample_rate: int = 24000

    @property
    def samples_per_frame(self) -> int:
        """Upsampling factor from frames to samples (``total_upsample`` in the references)."""
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], kind: str, sample_rate: int = 24000) -> CodecDecoderConfig:
        if kind not in ("omni", "tts12hz"):
            raise ValueError(f"unknown codec decoder kind {kind!r}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"codec decoder: hidden_act {raw['hidden_act']!r} is not supported (silu)")
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or raw.get("rope_scaling"):
            raise ValueError("codec decoder: only plain RoPE is supported")
        hidden = int(raw.get("hidden_size", 1024))
        heads = int(raw.get("num_attention_heads", 16))
        return cls(
            kind=kind, codebook_size=int(raw.get("codebook_size", 2048)),
            num_quantizers=int(raw.get("num_quantizers", 16)), hidden_size=hidden,
            num_layers=int(raw.get("num_hidden_layers", 8)), num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw.get("intermediate_size", 3072)),
            attention_bias=bool(raw.get("attention_bias", False)),
            sliding_window=int(raw.get("sliding_window", 72)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            upsampling_ratios=tuple(int(r) for r in raw.get("upsampling_ratios", (2, 2))),
            upsample_rates=tuple(int(r) for r in raw.get("upsample_rates", (8, 5, 4, 3))),
            decoder_dim=int(raw.get("decoder_dim", 1536)),
            latent_dim=hidden if kind == "omni" else int(raw.get("latent_dim", 1024)),
            codebook_dim=0 if kind == "omni" else int(raw.get("codebook_dim", 512)),
            sample_rate=sample_rate,
        )


class CausalConv(nn.Module):
    """A 1-D convolution padded on the left (and up to a whole stride on the right)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, dilation: int = 1, stride: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride=stride, dilation=dilation, groups=groups)
        self.stride = stride
        self.span = (kernel - 1) * dilation + 1
        self.left = self.span - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, S] -> [B, C', ceil(S / stride)]
        n_frames = (x.shape[-1] - self.span + self.left) / self.stride + 1
        right = (math.ceil(n_frames) - 1) * self.stride + (self.span - self.left) - x.shape[-1]
        return self.conv(F.pad(x, (self.left, right)))


class CausalTransConv(nn.Module):
    """A transposed convolution with ``kernel - stride`` samples trimmed (both sides for Omni, right for TTS)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, trim_both: bool):
        super().__init__()
        self.conv = nn.ConvTranspose1d(c_in, c_out, kernel, stride=stride)
        pad = kernel - stride
        self.left, self.right = (pad, pad) if trim_both else (0, pad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, S] -> [B, C', ~S * stride]
        x = self.conv(x)
        return x[..., self.left: x.shape[-1] - self.right]


class SnakeBeta(nn.Module):
    """``x + sin^2(x * e^alpha) / e^beta``, per channel."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, S]
        alpha = self.alpha.exp()[None, :, None]
        beta = self.beta.exp()[None, :, None]
        return x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, S]
        h = self.norm(self.dwconv(x).transpose(1, 2))  # [B, S, C]
        h = self.gamma * self.pwconv2(F.gelu(self.pwconv1(h)))
        return x + h.transpose(1, 2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, S]
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nn.Module):
    """SnakeBeta, a transposed convolution by ``rate`` halving the width, three dilated residual units."""

    def __init__(self, c_in: int, c_out: int, rate: int, trim_both: bool):
        super().__init__()
        self.block = nn.ModuleList([SnakeBeta(c_in), CausalTransConv(c_in, c_out, 2 * rate, rate, trim_both),
                                    *(ResidualUnit(c_out, d) for d in (1, 3, 9))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.block:
            x = layer(x)
        return x


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), 0.01))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class Attention(nn.Module):
    """Causal self-attention over frames, each frame seeing the last ``sliding_window`` frames (itself included)."""

    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, q, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv, bias=bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(b * t, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(b * t, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        q = apply_rope(q, cos, sin).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)  # [B, Hq, T, D]
        k = apply_rope(k, cos, sin).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             enable_gqa=c.num_heads != c.num_kv_heads)  # [B, Hq, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Transformer(nn.Module):
    """``pre_transformer``: frames ``[B, T, latent]`` -> ``[B, T, latent]`` (projections for TTS only)."""

    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.kind == "tts12hz":
            self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
            self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if self.cfg.kind == "tts12hz":
            x = self.input_proj(x)  # [B, T, H]
        d = self.cfg.head_dim
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, d, 2, device=x.device).float() / d))
        freqs = torch.arange(t, device=x.device).float()[:, None] * inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos, sin = emb.cos().repeat(x.shape[0], 1), emb.sin().repeat(x.shape[0], 1)  # [B*T, D]
        pos = torch.arange(t, device=x.device)
        gap = pos[:, None] - pos[None, :]
        mask = (gap >= 0) & (gap < self.cfg.sliding_window)  # [T, T]: causal, within the window
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        x = self.norm(x)
        return self.output_proj(x) if self.cfg.kind == "tts12hz" else x


class Codebook(nn.Module):
    """One quantizer's codebook, stored as running sums: a code's vector is ``embedding_sum / cluster_usage``."""

    def __init__(self, dim: int, size: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, dim]
        return F.embedding(codes, self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None])


class _VQ(nn.Module):
    def __init__(self, dim: int, size: int):
        super().__init__()
        self._codebook = Codebook(dim, size)


class _Layers(nn.Module):
    def __init__(self, num: int, dim: int, size: int):
        super().__init__()
        self.layers = nn.ModuleList(_VQ(dim, size) for _ in range(num))


class ResidualQuantizer(nn.Module):
    """Sum of its codebooks' vectors, then a 1x1 projection: codes ``[B, q, T]`` -> ``[B, out, T]``."""

    def __init__(self, num: int, dim: int, size: int, width: int):
        super().__init__()
        self.vq = _Layers(num, dim, size)
        # only decoding is served: input_proj is the encoder's, kept so the checkpoint loads strictly
        self.input_proj = nn.Conv1d(width, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, width, 1, bias=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        total = sum(layer._codebook(codes[:, i]) for i, layer in enumerate(self.vq.layers))  # [B, T, dim]
        return self.output_proj(total.transpose(1, 2))


class SplitQuantizer(nn.Module):
    """The 12 Hz tokenizer's quantizer: codebook 0 (semantic) and codebooks 1.. (acoustic), projected apart."""

    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        dim = cfg.codebook_dim // 2
        self.rvq_first = ResidualQuantizer(1, dim, cfg.codebook_size, cfg.codebook_dim)
        self.rvq_rest = ResidualQuantizer(cfg.num_quantizers - 1, dim, cfg.codebook_size, cfg.codebook_dim)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:  # [B, Q, T] -> [B, codebook_dim, T]
        return self.rvq_first(codes[:, :1]) + self.rvq_rest(codes[:, 1:])


class CodecDecoder(nn.Module):
    """Codes ``[B, Q, T]`` -> waveform ``[B, 1, S]`` in [-1, 1] (see the module docstring)."""

    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.cfg = cfg
        omni = cfg.kind == "omni"
        if omni:
            self.code_embedding = nn.Embedding(cfg.codebook_size * cfg.num_quantizers, cfg.hidden_size)
        else:
            self.quantizer = SplitQuantizer(cfg)
            self.pre_conv = CausalConv(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = Transformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConv(cfg.latent_dim, cfg.latent_dim, r, r, omni), ConvNeXtBlock(cfg.latent_dim)])
            for r in cfg.upsampling_ratios)
        widths = [cfg.decoder_dim // 2 ** i for i in range(len(cfg.upsample_rates) + 1)]
        self.decoder = nn.ModuleList([
            CausalConv(cfg.latent_dim, cfg.decoder_dim, 7),
            *(DecoderBlock(widths[i], widths[i + 1], r, omni) for i, r in enumerate(cfg.upsample_rates)),
            SnakeBeta(widths[-1]),
            CausalConv(widths[-1], 1, 7),
        ])

    def forward(self, codes: torch.Tensor, speed: float = 1.0) -> torch.Tensor:
        """``speed`` != 1 resamples the transformer's frame latents to ``round(T / speed)`` frames before
        upsampling: the duration scales while each frame is still rendered at the codec's rate (pitch kept)."""
        c = self.cfg
        if codes.shape[1] != c.num_quantizers:
            raise ValueError(f"expected {c.num_quantizers} codebooks per frame, got {codes.shape[1]}")
        if c.kind == "omni":
            offsets = torch.arange(c.num_quantizers, device=codes.device)[None, :, None] * c.codebook_size
            frames = self.code_embedding(codes + offsets).mean(1)  # [B, T, H]
        else:
            frames = self.pre_conv(self.quantizer(codes)).transpose(1, 2)  # [B, T, latent]
        x = self.pre_transformer(frames).transpose(1, 2)  # [B, latent, T]
        if speed != 1.0:
            x = F.interpolate(x, size=max(1, round(x.shape[-1] / speed)), mode="linear", align_corners=True)
        for trans_conv, convnext in self.upsample:
            x = convnext(trans_conv(x))  # [B, latent, T * prod(ratios)]
        for layer in self.decoder:
            x = layer(x)  # ... -> [B, 1, S]
        return x.clamp(-1.0, 1.0)

    @torch.inference_mode()
    def chunked_decode(self, codes: torch.Tensor, chunk_size: int = DECODE_CHUNK_FRAMES,
                       left_context: int = DECODE_LEFT_CONTEXT, speed: float = 1.0) -> torch.Tensor:
        """Decode ``[B, Q, T]`` in chunks as the references do: each chunk re-decodes up to ``left_context``
        earlier frames and drops their samples. Returns ``[B, 1, S]``."""
        return self.decode_range(codes, 0, codes.shape[-1], chunk_size, left_context, speed)

    @torch.inference_mode()
    def decode_range(self, codes: torch.Tensor, start: int, end: int, chunk_size: int = DECODE_CHUNK_FRAMES,
                     left_context: int = DECODE_LEFT_CONTEXT, speed: float = 1.0) -> torch.Tensor:
        """The samples of frames ``start:end`` as ``chunked_decode`` has them, without frames after ``end``.

        Each piece is decoded from the start of its reference chunk (less its
        left context) to ``end``. For a causal decoder (the TTS tokenizer's:
        causal convolutions and attention, right-trimmed transposed
        convolutions) samples never depend on later frames, so a stream of
        ranges gives the same samples as the whole ``chunked_decode``; Omni's
        transposed convolutions look one frame ahead, so there the last frame
        of a range may differ.
        """
        pieces = []
        while start < end:
            chunk = start // chunk_size * chunk_size
            stop = min(end, chunk + chunk_size)
            context = left_context if chunk - left_context > 0 else chunk
            wav = self(codes[..., chunk - context:stop], speed)
            pieces.append(wav[..., round((start - chunk + context) / speed) * self.cfg.samples_per_frame:])
            start = stop
        return torch.cat(pieces, dim=-1)
