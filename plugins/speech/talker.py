"""The Talker: a decoder-only transformer that speaks text as audio codec tokens.

It is the text plugin's Llama-family ``TextModel`` over a codec vocabulary
(``codebook_size`` codes, then a BOS and an EOS control token), plus what
conditions it:

- ``speaker_embed`` — one row per voice, the first position of the context;
- ``text_embed`` — one row per text token to speak (the Thinker's vocabulary);
- ``thinker_proj`` (Omni bundle only) — the Thinker's hidden state of each of
  those tokens, projected to the Talker's width and added to its text row.

Context layout: ``[speaker, text_1 .. text_n, BOS, code_1, code_2, ...]``.
Codes are sampled until EOS; EOS is masked until ``min_codes_per_token * n``
codes exist and generation stops at ``max_codes_per_token * n``, so the audio's
length follows the text. Long text is spoken in segments that each fit the
Talker's context; their codes are concatenated.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ifb_plugins.speech.config import TalkerConfig
from ifb_plugins.common.attention import build_attn_metadata
from ifb_plugins.common.model import TextModel, allocate_kv_cache

#: tokens per block of the Talker's private KV cache (allocated per segment, freed after)
TALKER_BLOCK_SIZE = 16


class Talker(TextModel):
    """Parameter names under the ``talker.`` prefix: ``model.*`` and ``lm_head`` (as a text model),
    ``text_embed``, ``speaker_embed`` and, in an Omni bundle, ``thinker_proj``."""

    def __init__(self, config: TalkerConfig) -> None:
        super().__init__(config.decoder_config())
        self.talker_config = config
        self.text_embed = nn.Embedding(config.text_vocab_size, config.hidden_size)
        self.speaker_embed = nn.Embedding(len(config.voices), config.hidden_size)
        self.thinker_proj: nn.Linear | None = None
        if config.thinker_hidden_size:
            self.thinker_proj = nn.Linear(config.thinker_hidden_size, config.hidden_size)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def condition(self, text_ids: Sequence[int], voice: int,
                  thinker_hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The context's prefix embeddings ``[n + 2, H]``: speaker, text rows, codec BOS."""
        cfg, device = self.talker_config, self.device
        text = self.text_embed(torch.tensor(list(text_ids), dtype=torch.long, device=device))  # [n, H]
        if self.thinker_proj is not None:
            if thinker_hidden is None or thinker_hidden.shape[0] != len(text_ids):
                raise ValueError("this Talker needs the Thinker's hidden state of every text token")
            text = text + self.thinker_proj(thinker_hidden.to(device=device, dtype=text.dtype))
        speaker = self.speaker_embed(torch.tensor([voice], device=device))  # [1, H]
        bos = self.model.embed_tokens(torch.tensor([cfg.codec_bos_id], device=device))  # [1, H]
        return torch.cat([speaker, text, bos])

    @torch.inference_mode()
    def generate_codes(self, text_ids: Sequence[int], voice: int, *, thinker_hidden: torch.Tensor | None = None,
                       seed: int = 0) -> list[int]:
        """Speak ``text_ids`` with voice number ``voice``; returns the codec tokens (no control tokens).

        Sampling uses the config's temperature and top-k with a generator seeded
        by ``seed``, so the same request gives the same audio.
        """
        cfg = self.talker_config
        generator = torch.Generator().manual_seed(seed)
        step = cfg.max_text_tokens_per_segment
        codes: list[int] = []
        for start in range(0, len(text_ids), step):
            hidden = None if thinker_hidden is None else thinker_hidden[start:start + step]
            codes += self._segment(list(text_ids[start:start + step]), voice, hidden, generator)
        return codes

    def _segment(self, text_ids: list[int], voice: int, thinker_hidden: torch.Tensor | None,
                 generator: torch.Generator) -> list[int]:
        cfg, device = self.talker_config, self.device
        prefix = self.condition(text_ids, voice, thinker_hidden)  # [P, H]
        num_prefix = prefix.shape[0]
        min_codes = cfg.min_codes_per_token * len(text_ids)
        max_codes = cfg.max_codes_per_token * len(text_ids)
        num_blocks = -(-(num_prefix + max_codes) // TALKER_BLOCK_SIZE)
        kv = allocate_kv_cache(self.config, num_blocks, TALKER_BLOCK_SIZE, dtype=prefix.dtype, device=device)
        blocks = list(range(num_blocks))

        def forward(ids: torch.Tensor, start: int, embeds: torch.Tensor | None = None) -> torch.Tensor:
            attn = build_attn_metadata([(start, ids.shape[0], blocks)], TALKER_BLOCK_SIZE, device)
            positions = torch.arange(start, start + ids.shape[0], device=device)
            return self(ids, positions, attn, kv, embeds)[-1:]  # the last row predicts the next code

        # The prefix enters as embeddings; the ids are placeholders the forward does not read.
        last = forward(torch.zeros(num_prefix, dtype=torch.long, device=device), 0, prefix)
        codes: list[int] = []
        while len(codes) < max_codes:
            logits = self.compute_logits(last)[0]  # [V]
            logits[cfg.codec_bos_id] = float("-inf")
            if len(codes) < min_codes:
                logits[cfg.codec_eos_id] = float("-inf")
            code = self._sample(logits, generator)
            if code == cfg.codec_eos_id:
                break
            codes.append(code)
            if len(codes) < max_codes:
                last = forward(torch.tensor([code], device=device), num_prefix + len(codes) - 1)
        return codes

    def _sample(self, logits: torch.Tensor, generator: torch.Generator) -> int:
        cfg = self.talker_config
        logits = logits.float().cpu()
        if cfg.temperature <= 0:
            return int(logits.argmax())
        if 0 < cfg.top_k < logits.shape[0]:
            kth = torch.topk(logits, cfg.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits / cfg.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))
