"""Code-to-waveform decoder: codec tokens -> a 24 kHz mono waveform in [-1, 1].

Codes are embedded, mixed by a convolution, then upsampled by a stack of
transposed convolutions (each followed by a residual block), and a last
convolution plus tanh gives the samples. Each stage multiplies the length by
its rate exactly, so ``N`` codes give ``N * hop_length`` samples: the duration
is proportional to the number of codes.

Parameter names under the ``code2wav.`` prefix: ``embed``, ``pre_conv``,
``upsample.{i}``, ``resblocks.{i}.conv1`` / ``conv2`` and ``post_conv``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ifb_plugins.speech.config import Code2WavConfig


def upsampler(in_channels: int, out_channels: int, rate: int) -> nn.ConvTranspose1d:
    """A transposed convolution whose output is exactly ``rate`` times its input length.

    Kernel ``2 * rate`` overlaps neighbouring codes (smooth joins); with
    L_out = (L - 1) * r - 2p + 2r + op, choosing 2p - op = r gives L * r.
    """
    return nn.ConvTranspose1d(in_channels, out_channels, kernel_size=2 * rate, stride=rate,
                              padding=(rate + 1) // 2, output_padding=rate % 2)


class ResBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(channels, channels, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.silu(self.conv1(F.silu(x))))


class Code2Wav(nn.Module):
    def __init__(self, config: Code2WavConfig) -> None:
        super().__init__()
        self.config = config
        ch = config.channels
        self.embed = nn.Embedding(config.codebook_size, ch[0])
        self.pre_conv = nn.Conv1d(ch[0], ch[0], kernel_size=7, padding=3)
        self.upsample = nn.ModuleList(upsampler(ch[i], ch[i + 1], r) for i, r in enumerate(config.upsample_rates))
        self.resblocks = nn.ModuleList(ResBlock(c) for c in ch[1:])
        self.post_conv = nn.Conv1d(ch[-1], 1, kernel_size=7, padding=3)

    @property
    def hop_length(self) -> int:
        return self.config.hop_length

    @torch.inference_mode()
    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes [N]`` (long) -> waveform ``[N * hop_length]`` (float, in [-1, 1])."""
        weight = self.embed.weight
        if codes.numel() == 0:
            return torch.zeros(0, dtype=weight.dtype, device=weight.device)
        x = self.embed(codes.to(weight.device)).transpose(0, 1)[None]  # [1, C0, N]
        x = self.pre_conv(x)
        for up, res in zip(self.upsample, self.resblocks, strict=True):
            x = res(up(F.silu(x)))  # [1, C_i+1, N * prod(rates so far)]
        return torch.tanh(self.post_conv(F.silu(x)))[0, 0]
