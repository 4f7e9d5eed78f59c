"""Qwen3-TTS's talker and code predictor: text (and a speaker or a voice description) -> codec frames.

As Qwen's reference (``Qwen3TTSForConditionalGeneration.generate`` in the
``qwen-tts`` package, non-streaming text input, its default) defines it:

1. The prompt is a sequence of embeddings ``[L, H]``: the instruction's
   tokens (if any), ``<|im_start|>assistant\\n``, then codec control ids
   (think / language / speaker / pad) over TTS pad text, then every text token
   over a codec pad, the text-end marker, and the codec BOS.
   Text enters through ``text_projection(text_embedding(ids))``.
2. The **talker** (a Qwen3 decoder) predicts each frame's first code. Before a
   code is fed back, the **code predictor** (a smaller Qwen3 decoder, one
   head per codebook) completes the frame from the talker's last hidden state
   and that code: codes 1 .. G-1, one at a time. The frame's G codes are
   embedded and summed (plus the TTS pad text embedding) as the talker's next
   input. Generation ends at the codec EOS or after ``max_new_tokens`` codes.

Both decoders are ``ifb_plugins.common.models.decoder.DecoderLayer`` stacks over a
small paged KV cache of their own (one utterance). Parameter names follow the
reference (``talker.model.layers.N...``, ``talker.code_predictor...``).
Shapes: L prompt length, H talker hidden, Hp predictor hidden, G codebooks.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from ifb_plugins.common.layers.attention import build_attn_metadata
from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.common.models.decoder import DecoderLayer, RMSNorm, allocate_kv_cache, rope_inv_freq, rope_table
from ifb_plugins.speech.tts_config import TalkerConfig, TtsConfig

KV_BLOCK = 16
#: the reference suppresses the top 1024 ids of the talker's vocabulary (its control ids), EOS excepted
NUM_CONTROL_IDS = 1024
#: the reference's ``min_new_tokens``: EOS is masked for the first two codes
MIN_NEW_CODES = 2
#: ``<|im_start|>assistant\\n`` opens the text, ``<|im_end|>\\n<|im_start|>assistant\\n`` closes it
NUM_ROLE_TOKENS, NUM_TAIL_TOKENS = 3, 5


@attrs.frozen
class Sampling:
    """How one codebook's code is chosen: greedy, or sampled after temperature, top-k and top-p."""

    do_sample: bool
    top_k: int = 50
    top_p: float = 1.0
    temperature: float = 1.0


class CodecLM(nn.Module):
    """A Qwen3 decoder stack over given input embeddings (no token embedding, no head)."""

    def __init__(self, config: TextModelConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def new_cache(self, num_positions: int) -> Cache:
        return Cache(self.config, num_positions)

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        """``x [T, H]`` at the cache's next positions -> normed hidden states ``[T, H]``."""
        start = cache.length
        attn = build_attn_metadata([(start, x.shape[0], cache.block_ids)], KV_BLOCK, x.device)
        cs = cache.rope[start:start + x.shape[0]]  # [T, 2, D]
        cos, sin = cs[:, 0:1], cs[:, 1:2]
        for layer, kv in zip(self.layers, cache.kv, strict=True):
            x = layer(x, cos, sin, attn, kv)
        cache.length += x.shape[0]
        return self.norm(x)


class Cache:
    """One sequence's KV blocks and RoPE table for a ``CodecLM``."""

    def __init__(self, config: TextModelConfig, num_positions: int):
        num_blocks = -(-num_positions // KV_BLOCK)
        self.kv = allocate_kv_cache(config, num_blocks, KV_BLOCK)
        self.block_ids = list(range(num_blocks))
        self.rope = rope_table(config, rope_inv_freq(config), num_blocks * KV_BLOCK)
        self.length = 0

    def reset(self) -> None:
        self.length = 0


class TextProjection(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(c_in, c_in)
        self.linear_fc2 = nn.Linear(c_in, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerModel(CodecLM):
    """``talker.model``: the decoder, plus the codec and text embeddings."""

    def __init__(self, cfg: TalkerConfig):
        super().__init__(cfg.decoder)
        self.codec_embedding = nn.Embedding(cfg.decoder.vocab_size, cfg.decoder.hidden_size)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)


class PredictorModel(CodecLM):
    """``talker.code_predictor.model``: the decoder, plus one embedding per codebook 1 .. G-1 (talker width)."""

    def __init__(self, predictor: TextModelConfig, talker_hidden: int, num_code_groups: int):
        super().__init__(predictor)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(predictor.vocab_size, talker_hidden) for _ in range(num_code_groups - 1))


class CodePredictor(nn.Module):
    """``talker.code_predictor`` (Qwen3-TTS's, and Qwen3-Omni's, which has no projection: equal widths)."""

    def __init__(self, predictor: TextModelConfig, talker_hidden: int, num_code_groups: int):
        super().__init__()
        self.model = PredictorModel(predictor, talker_hidden, num_code_groups)
        self.lm_head = nn.ModuleList(nn.Linear(predictor.hidden_size, predictor.vocab_size, bias=False)
                                     for _ in range(num_code_groups - 1))
        if predictor.hidden_size != talker_hidden:
            self.small_to_mtp_projection = nn.Linear(talker_hidden, predictor.hidden_size)
        else:
            self.small_to_mtp_projection = nn.Identity()

    def complete_frame(self, talker_hidden: torch.Tensor, first: torch.Tensor, first_embed: torch.Tensor,
                       cache: Cache, sampling: Sampling, gen: torch.Generator | None) -> list[torch.Tensor]:
        """Codes 1 .. G-1 of a frame from the talker's hidden state ``[H]`` and code 0's embedding ``[H]``."""
        cache.reset()
        x = torch.stack([talker_hidden, first_embed])  # [2, H]
        codes = [first]
        for i, head in enumerate(self.lm_head):
            h = self.model(self.small_to_mtp_projection(x), cache)[-1]  # [Hp]
            code = choose(head(h).float(), sampling, gen)
            codes.append(code)
            if i + 1 < len(self.lm_head):
                x = self.model.codec_embedding[i](code)[None]  # [1, H]
        return codes


class Talker(nn.Module):
    """``talker``: the first-codebook decoder, its head, the text projection and the code predictor."""

    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        self.cfg = cfg
        self.model = TalkerModel(cfg)
        self.text_projection = TextProjection(cfg.text_hidden_size, cfg.decoder.hidden_size)
        self.codec_head = nn.Linear(cfg.decoder.hidden_size, cfg.decoder.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg.predictor, cfg.decoder.hidden_size, cfg.num_code_groups)

    def text(self, ids: Sequence[int]) -> torch.Tensor:
        """Text token ids -> talker inputs ``[n, H]``."""
        return self.text_projection(self.model.text_embedding(torch.tensor(list(ids), dtype=torch.long)))

    def codec(self, ids: Sequence[int]) -> torch.Tensor:
        return self.model.codec_embedding(torch.tensor(list(ids), dtype=torch.long))  # [n, H]


class TtsModel(nn.Module):
    """The whole checkpoint's ``model.safetensors``: ``talker.*`` (the speaker encoder of Base models is not built)."""

    def __init__(self, config: TtsConfig):
        super().__init__()
        self.config = config
        self.talker = Talker(config.talker)

    def prompt(self, text_ids: Sequence[int], instruct_ids: Sequence[int] | None, speaker: str | None,
               language: str) -> torch.Tensor:
        """The talker's prompt ``[L, H]`` (``text_ids`` is the whole templated assistant turn)."""
        c, t = self.config, self.talker
        tc = c.talker
        bos, eos, pad = t.text([c.tts_bos_id, c.tts_eos_id, c.tts_pad_id])  # [H] each
        language_id = None if language == "auto" else tc.language_ids[language]
        if speaker is not None and language in ("chinese", "auto") and speaker in tc.speaker_dialects:
            language_id = tc.language_ids[tc.speaker_dialects[speaker]]
        control = ([tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id] if language_id is None
                   else [tc.codec_think_id, tc.codec_think_bos_id, language_id, tc.codec_think_eos_id])
        if speaker is not None:
            control.append(tc.speaker_ids[speaker])
        codec = t.codec([*control, tc.codec_pad_id, tc.codec_bos_id])  # [C, H]
        body = list(text_ids[NUM_ROLE_TOKENS:len(text_ids) - NUM_TAIL_TOKENS])
        parts = [] if not instruct_ids else [t.text(instruct_ids)]
        parts += [
            t.text(text_ids[:NUM_ROLE_TOKENS]),  # <|im_start|>assistant\n
            torch.cat([pad.expand(codec.shape[0] - 2, -1), bos[None]]) + codec[:-1],  # control ids over text pad
            torch.cat([t.text(body), eos[None]]) + t.codec([tc.codec_pad_id]),  # the text over codec pad
            (pad + codec[-1])[None],  # codec BOS over text pad
        ]
        return torch.cat(parts)

    @torch.inference_mode()
    def generate(self, prompt: torch.Tensor, *, max_new_tokens: int, sampling: Sampling, sub_sampling: Sampling,
                 repetition_penalty: float, seed: int | None = None) -> Iterator[torch.Tensor]:
        """Yield each frame's ``G`` codes ``[G]`` as soon as it is complete."""
        t, tc = self.talker, self.config.talker
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        cache = t.model.new_cache(prompt.shape[0] + max_new_tokens)
        predictor_cache = t.code_predictor.model.new_cache(tc.num_code_groups + 1)
        pad_text = t.text([self.config.tts_pad_id])[0]  # [H]
        vocab = tc.decoder.vocab_size
        suppressed = torch.zeros(vocab, dtype=torch.bool)
        suppressed[max(0, vocab - NUM_CONTROL_IDS):] = True
        suppressed[tc.codec_eos_id] = False
        hidden = t.model(prompt, cache)[-1]  # [H]
        firsts: list[int] = []
        while True:
            logits = t.codec_head(hidden).float()  # [V]
            logits = penalize(logits, firsts, repetition_penalty).masked_fill(suppressed, float("-inf"))
            if len(firsts) < MIN_NEW_CODES:
                logits[tc.codec_eos_id] = float("-inf")
            first = choose(logits, sampling, gen)
            firsts.append(int(first))
            if int(first) == tc.codec_eos_id or len(firsts) >= max_new_tokens:
                return
            first_embed = t.model.codec_embedding(first)  # [H]
            codes = t.code_predictor.complete_frame(hidden, first, first_embed, predictor_cache, sub_sampling, gen)
            yield torch.stack(codes)
            rest = [emb(code) for emb, code in zip(t.code_predictor.model.codec_embedding, codes[1:])]
            x = first_embed + torch.stack(rest).sum(0) + pad_text  # [H]
            hidden = t.model(x[None], cache)[-1]


def penalize(logits: torch.Tensor, previous: Sequence[int], penalty: float) -> torch.Tensor:
    """HF's repetition penalty over the codes chosen so far: positive logits divided, negative multiplied."""
    if penalty == 1.0 or not previous:
        return logits
    ids = torch.tensor(sorted(set(previous)), dtype=torch.long)
    score = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(score < 0, score * penalty, score / penalty)
    return logits


def choose(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    """Greedy (``argmax``), or HF's temperature -> top-k -> top-p -> multinomial; a 0-d long tensor."""
    if torch.isnan(logits).any():
        raise FloatingPointError("the model's codec logits are NaN: its weights or activations are not finite")
    if not sampling.do_sample:
        return logits.argmax()
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - sampling.top_p
        drop[-1] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=gen)[0]
