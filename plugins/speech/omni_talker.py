"""Qwen3-Omni's Talker: the Thinker's states of a conversation -> codec frames (``talker.*`` weights).

As transformers defines it (``Qwen3OmniMoeForConditionalGeneration.generate``
and ``Qwen3OmniMoeTalkerForConditionalGeneration``), for one conversation:

1. The Talker's prompt ``[L, H]``: every *user* token of the prompt, as
   ``text_projection(thinker embedding)`` (text) or ``hidden_projection(thinker
   hidden state at accept_hidden_layer)`` (audio / image / video tokens); then
   the last assistant turn's first three tokens (``<|im_start|>assistant\\n``),
   four TTS pads, the TTS BOS and the reply's first token, over
   ``[0, 0, 0, nothink, think_bos, think_eos, speaker, codec_pad, codec_bos]``.
2. The Talker (a Qwen3-MoE decoder: ``moe.SparseMoE`` with a gated shared
   expert) predicts each frame's first code; the code predictor (a Qwen3
   decoder) completes the frame. The summed frame embedding plus the next reply
   token's text projection (then the TTS EOS, then TTS pads) is the next input.
   Generation ends at the codec EOS or after ``max_new_tokens`` codes; the top
   1024 ids but EOS are never chosen, and a repetition penalty applies.

Only text positions are built (sequential RoPE positions, where M-RoPE equals
RoPE); the 3-D positions of audio / image / video prompts are not.
Shapes: L prompt length, Ht Thinker hidden, H Talker hidden, G codebooks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import attrs
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.common.loading.hf import safetensors_files
from ifb_plugins.common.layers.moe import fuse_expert_state
from ifb_plugins.speech.omni import read_omni_config
from ifb_plugins.speech.tts_model import NUM_CONTROL_IDS, CodecLM, CodePredictor, Sampling, choose, penalize
from ifb_plugins.speech.weights import adopt, load_prefixed

NUM_ROLE_TOKENS = 3  # <|im_start|>assistant\n


def _decoder(raw: Mapping[str, Any], moe: bool) -> TextModelConfig:
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    rope = raw.get("rope_parameters") or {}
    fields: dict[str, Any] = {}
    if moe:
        fields = dict(num_experts=int(raw.get("num_experts") or raw["num_local_experts"]), num_experts_per_tok=int(raw["num_experts_per_tok"]),
                      moe_intermediate_size=int(raw["moe_intermediate_size"]),
                      norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                      shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
                      decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
                      mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()))
    return TextModelConfig(
        arch="qwen3_moe" if moe else "qwen3", vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]), num_layers=int(raw["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads), head_dim=int(raw.get("head_dim") or hidden // heads),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), attention_bias=bool(raw.get("attention_bias", False)),
        attention_out_bias=bool(raw.get("attention_bias", False)), qk_norm=True,
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)), **fields)


@attrs.frozen
class OmniTalkerConfig:
    decoder: TextModelConfig
    predictor: TextModelConfig
    num_code_groups: int
    thinker_hidden_size: int
    accept_hidden_layer: int
    codec_eos_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    codec_pad_id: int
    codec_bos_id: int
    speaker_ids: Mapping[str, int]
    #: the Thinker's ids of the tokens the Talker reads specially
    im_start_id: int
    assistant_id: int
    user_id: int
    tts_bos_id: int
    tts_eos_id: int
    tts_pad_id: int
    media_token_ids: tuple[int, ...]  # audio, image, video

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> OmniTalkerConfig:
        t, thinker = raw["talker_config"], raw["thinker_config"]
        decoder = _decoder(t["text_config"], moe=True)
        predictor = _decoder(t["code_predictor_config"], moe=False)
        if predictor.hidden_size != decoder.hidden_size:
            raise ValueError("config.json: the Talker and its code predictor must have the same hidden_size")
        return cls(
            decoder=decoder, predictor=predictor, num_code_groups=int(t["num_code_groups"]),
            thinker_hidden_size=int(t["thinker_hidden_size"]), accept_hidden_layer=int(t["accept_hidden_layer"]),
            codec_eos_id=int(t["codec_eos_token_id"]), codec_nothink_id=int(t["codec_nothink_id"]),
            codec_think_bos_id=int(t["codec_think_bos_id"]), codec_think_eos_id=int(t["codec_think_eos_id"]),
            codec_pad_id=int(t["codec_pad_id"]), codec_bos_id=int(t["codec_bos_id"]),
            speaker_ids={k.lower(): int(v) for k, v in (t.get("speaker_id") or {}).items()},
            im_start_id=int(raw["im_start_token_id"]), assistant_id=int(raw["assistant_token_id"]),
            user_id=int(raw["user_token_id"]), tts_bos_id=int(raw["tts_bos_token_id"]),
            tts_eos_id=int(raw["tts_eos_token_id"]), tts_pad_id=int(raw["tts_pad_token_id"]),
            media_token_ids=(int(thinker["audio_token_id"]), int(thinker["image_token_id"]),
                             int(thinker["video_token_id"])))


class ResizeMLP(nn.Module):
    def __init__(self, c_in: int, c_mid: int, c_out: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(c_in, c_mid)
        self.linear_fc2 = nn.Linear(c_mid, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerModel(CodecLM):
    def __init__(self, cfg: OmniTalkerConfig):
        super().__init__(cfg.decoder)
        self.codec_embedding = nn.Embedding(cfg.decoder.vocab_size, cfg.decoder.hidden_size)


@attrs.frozen
class ThinkerStates:
    """What the Talker reads of the Thinker's run over one conversation.

    ``prompt_ids`` are the prompt's token ids; ``sequence_ids`` the prompt and
    the reply; ``embeds`` and ``hidden`` ``[len(sequence_ids) - 1, Ht]`` the
    Thinker's input embeddings and its hidden states at ``accept_hidden_layer``
    for every token it read (the last reply token is never read);
    ``special_embeds`` ``[3, Ht]`` its embeddings of TTS BOS, EOS and pad.
    """

    prompt_ids: tuple[int, ...]
    sequence_ids: tuple[int, ...]
    embeds: torch.Tensor
    hidden: torch.Tensor
    special_embeds: torch.Tensor


class OmniTalker(nn.Module):
    """``talker``: the MoE decoder, its codec head, the two projections and the code predictor."""

    def __init__(self, cfg: OmniTalkerConfig):
        super().__init__()
        self.cfg = cfg
        h, ht = cfg.decoder.hidden_size, cfg.thinker_hidden_size
        self.model = TalkerModel(cfg)
        self.text_projection = ResizeMLP(ht, cfg.decoder.intermediate_size, h)
        self.hidden_projection = ResizeMLP(ht, cfg.decoder.intermediate_size, h)
        self.codec_head = nn.Linear(h, cfg.decoder.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg.predictor, h, cfg.num_code_groups)

    def codec(self, ids: Sequence[int]) -> torch.Tensor:
        return self.model.codec_embedding(torch.tensor(list(ids), dtype=torch.long))  # [n, H]

    def prompt(self, states: ThinkerStates, speaker: str,
               thinker_eos_ids: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(prompt [L, H], trailing text [R, H], tts pad [H])`` for one conversation."""
        c = self.cfg
        prompt, seq = list(states.prompt_ids), list(states.sequence_ids)
        bos, eos, pad = self.text_projection(states.special_embeds)  # [H] each
        # user tokens: those whose turn (the token after the last <|im_start|> so far) is the user's
        last, user = -1, []
        for i, token in enumerate(prompt):
            if token == c.im_start_id:
                last = i
            user.append(prompt[min(max(last, 0) + 1, len(prompt) - 1)] == c.user_id)
        parts = []
        for i, is_user in enumerate(user):
            if is_user:
                media = seq[i] in c.media_token_ids
                parts.append(self.hidden_projection(states.hidden[i]) if media
                             else self.text_projection(states.embeds[i]))
        starts = [i for i in range(len(prompt) - 1) if prompt[i] == c.im_start_id and prompt[i + 1] == c.assistant_id]
        if not starts:
            raise ValueError("the prompt has no assistant turn to speak")
        reply = self.text_projection(states.embeds[starts[-1]:])  # [n, H]
        text = torch.cat([reply[:NUM_ROLE_TOKENS], pad.expand(4, -1), bos[None], reply[NUM_ROLE_TOKENS:NUM_ROLE_TOKENS + 1]])
        codec = torch.cat([torch.zeros(NUM_ROLE_TOKENS, reply.shape[-1]), self.codec(
            [c.codec_nothink_id, c.codec_think_bos_id, c.codec_think_eos_id, c.speaker_ids[speaker.lower()],
             c.codec_pad_id, c.codec_bos_id])])
        trailing = torch.cat([reply[NUM_ROLE_TOKENS + 1:], eos[None]])  # [R, H]
        generated = seq[len(prompt):]
        first_eos = next((j for j, t in enumerate(generated) if t in set(thinker_eos_ids)), len(generated))
        if thinker_eos_ids:  # the text ends at the Thinker's EOS: its marker there, pads after it
            rows = torch.arange(trailing.shape[0])[:, None]
            trailing = torch.where(rows > first_eos, pad, torch.where(rows == first_eos, eos, trailing))
        user_part = torch.stack(parts) if parts else text[:0]
        return torch.cat([user_part, text + codec]), trailing, pad

    @torch.inference_mode()
    def generate(self, states: ThinkerStates, speaker: str, *, max_new_tokens: int, sampling: Sampling,
                 sub_sampling: Sampling, repetition_penalty: float, thinker_eos_ids: Sequence[int] = (),
                 seed: int | None = None) -> Iterator[torch.Tensor]:
        """Yield each frame's ``G`` codes ``[G]`` as soon as it is complete."""
        c = self.cfg
        prompt, trailing, pad = self.prompt(states, speaker, thinker_eos_ids)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        cache = self.model.new_cache(prompt.shape[0] + max_new_tokens)
        predictor_cache = self.code_predictor.model.new_cache(c.num_code_groups + 1)
        vocab = c.decoder.vocab_size
        suppressed = torch.zeros(vocab, dtype=torch.bool)
        suppressed[max(0, vocab - NUM_CONTROL_IDS):] = True
        suppressed[c.codec_eos_id] = False
        hidden = self.model(prompt, cache)[-1]  # [H]
        firsts: list[int] = []
        while True:
            logits = self.codec_head(hidden).float()
            logits = penalize(logits, firsts, repetition_penalty).masked_fill(suppressed, float("-inf"))
            first = choose(logits, sampling, gen)
            firsts.append(int(first))
            if int(first) == c.codec_eos_id or len(firsts) >= max_new_tokens:
                return
            first_embed = self.model.codec_embedding(first)
            codes = self.code_predictor.complete_frame(hidden, first, first_embed, predictor_cache, sub_sampling, gen)
            yield torch.stack(codes)
            rest = [emb(code) for emb, code in zip(self.code_predictor.model.codec_embedding, codes[1:])]
            step = len(firsts) - 1
            x = first_embed + torch.stack(rest).sum(0) + (trailing[step] if step < trailing.shape[0] else pad)
            hidden = self.model(x[None], cache)[-1]


def load_talker(path: str | Path) -> tuple[OmniTalker, torch.Tensor]:
    """The checkpoint's Talker, and the Thinker's embeddings ``[3, Ht]`` of TTS BOS, EOS and pad (read alone)."""
    cfg = OmniTalkerConfig.from_dict(read_omni_config(path))
    talker = adopt(lambda: OmniTalker(cfg), fuse_expert_state(load_prefixed(path, "talker.")), "talker")
    name = "thinker.model.embed_tokens.weight"
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            if name in f.keys():
                table = f.get_slice(name)
                rows = [table[r:r + 1][0] for r in (cfg.tts_bos_id, cfg.tts_eos_id, cfg.tts_pad_id)]
                return talker, torch.stack(rows).float()
    raise ValueError(f"{path} holds no {name}")
