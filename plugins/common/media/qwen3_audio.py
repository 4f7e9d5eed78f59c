"""The Qwen3 audio encoder (AuT): Qwen3-Omni's Thinker hears with it, Qwen3-ASR transcribes with it.

As transformers defines ``Qwen3OmniMoeAudioEncoder`` and ``Qwen3ASREncoder``:
the features ``[M, F]`` are cut into chunks of ``2 * n_window`` frames (the
last one shorter), padded with zeros (to the longest chunk for Qwen3-Omni, to
a whole chunk for Qwen3-ASR, whose feature extractor pads the frames to a
multiple of the chunk) and downsampled 8x in time by three stride-2 3x3
convolutions (GELU after each); each chunk's frames are projected to
``d_model`` and get sinusoidal positions restarting at 0 in every chunk. The
valid frames of all chunks, concatenated, pass through Whisper-style pre-norm
encoder layers whose attention is bidirectional within windows of
``n_window_infer // (2 * n_window)`` chunks, then LayerNorm, ``proj1``, GELU,
``proj2`` to the decoder's hidden size (Qwen3-ASR's checkpoints name the last
two ``multi_modal_projector.linear_1`` / ``linear_2``).

The clip's token count is the processors' ``_get_feat_extract_output_lengths``
(``num_audio_tokens``).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

#: frames a full chunk of ``2 * n_window = 100`` leaves after the convolutions (transformers' constant)
TOKENS_PER_FULL_CHUNK = 13


def num_audio_tokens(num_frames: int, n_window: int) -> int:
    """Tokens of a clip of ``num_frames`` feature frames, as the processor counts them."""
    chunk = n_window * 2
    tail = num_frames % chunk
    feat = (tail - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (num_frames // chunk) * TOKENS_PER_FULL_CHUNK


def _conv_len(n: int) -> int:
    for _ in range(3):
        n = (n - 1) // 2 + 1
    return n


@attrs.frozen
class AudioEncoderConfig:
    num_mel_bins: int
    d_model: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    output_dim: int
    downsample_hidden_size: int
    n_window: int
    n_window_infer: int
    max_source_positions: int = 1500

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "AudioEncoderConfig":
        act = raw.get("activation_function", "gelu")
        if act != "gelu":
            raise ValueError(f"audio_config.activation_function {act!r} is not supported (gelu)")
        cfg = cls(int(raw.get("num_mel_bins", 128)), int(raw.get("d_model", 1280)),
                  int(raw.get("encoder_layers", 32)), int(raw.get("encoder_attention_heads", 20)),
                  int(raw.get("encoder_ffn_dim", 5120)), int(raw.get("output_dim", 3584)),
                  int(raw.get("downsample_hidden_size", 480)), int(raw.get("n_window", 50)),
                  int(raw.get("n_window_infer", 800)), int(raw.get("max_source_positions", 1500)))
        if _conv_len(2 * cfg.n_window) != TOKENS_PER_FULL_CHUNK:
            # the reference counts 13 tokens per full chunk whatever the window: other windows break it
            raise ValueError(f"audio_config.n_window {cfg.n_window} is not supported: a chunk of "
                             f"{2 * cfg.n_window} frames must give {TOKENS_PER_FULL_CHUNK} tokens (n_window 50)")
        if cfg.n_window_infer < 2 * cfg.n_window:
            raise ValueError(f"audio_config.n_window_infer {cfg.n_window_infer} is shorter than a chunk "
                             f"({2 * cfg.n_window} frames)")
        return cfg


class AudioAttention(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        d = cfg.d_model
        self.num_heads = cfg.num_heads
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, windows: list[int]) -> torch.Tensor:
        n, d = x.shape
        q, k, v = (p(x).view(n, self.num_heads, -1).transpose(0, 1) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = torch.cat([F.scaled_dot_product_attention(qq, kk, vv)  # [heads, w, hd] per window, bidirectional
                         for qq, kk, vv in zip(q.split(windows, 1), k.split(windows, 1), v.split(windows, 1))], 1)
        return self.out_proj(out.transpose(0, 1).reshape(n, d))


class AudioEncoderLayer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.self_attn = AudioAttention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor, windows: list[int]) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), windows)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's positions ``[length, channels]``: sines then cosines."""
    increment = np.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-increment * torch.arange(channels // 2).float())
    scaled = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


class AudioEncoder(nn.Module):
    """``Qwen3OmniMoeAudioEncoder``: features ``[M, F]`` of one clip -> embeddings ``[num_tokens, output_dim]``."""

    def __init__(self, cfg: AudioEncoderConfig, pad_to_whole_chunks: bool = False):
        super().__init__()
        self.config = cfg
        #: Qwen3-ASR's reference convolves every chunk at its full length (the tail zero-padded);
        #: Qwen3-Omni's pads the chunks only to the longest one (a clip under one chunk is not padded)
        self.pad_to_whole_chunks = pad_to_whole_chunks
        ch = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, ch, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv_out = nn.Linear(ch * _conv_len(cfg.num_mel_bins), cfg.d_model, bias=False)
        self.layers = nn.ModuleList([AudioEncoderLayer(cfg) for _ in range(cfg.num_layers)])
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)

    @torch.inference_mode()
    def forward(self, features: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        num_frames = features.shape[1]
        chunk = 2 * cfg.n_window
        lengths = [chunk] * (num_frames // chunk) + ([num_frames % chunk] if num_frames % chunk else [])
        # [C, 1, M, Lmax]: every chunk right-padded with zeros to the longest, as the reference batches them
        padded = nn.utils.rnn.pad_sequence(list(features.T.split(lengths)), batch_first=True).transpose(1, 2)
        if self.pad_to_whole_chunks and padded.shape[2] < chunk:
            padded = F.pad(padded, (0, chunk - padded.shape[2]))
        x = padded.unsqueeze(1).to(self.conv2d1.weight.dtype)
        for conv in (self.conv2d1, self.conv2d2, self.conv2d3):
            x = F.gelu(conv(x))
        c, ch, f, t = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(c, t, ch * f))  # [C, t, d]
        x = x + sinusoids(cfg.max_source_positions, cfg.d_model)[:t].to(x)
        valid = [_conv_len(n) if n < chunk else TOKENS_PER_FULL_CHUNK for n in lengths]
        x = torch.cat([x[i, :n] for i, n in enumerate(valid)])  # [N, d], the chunks' valid frames
        # attention windows: n_window_infer frames' worth of chunks, over the concatenated tokens
        window = max(valid) * (cfg.n_window_infer // chunk)
        total = x.shape[0]
        windows = [window] * (total // window) + ([total % window] if total % window else [])
        for layer in self.layers:
            x = layer(x, windows)
        return self.proj2(F.gelu(self.proj1(self.ln_post(x))))  # [N, output_dim]
