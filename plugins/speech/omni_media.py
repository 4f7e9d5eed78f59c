"""Qwen3-Omni's media prompts: the Thinker's audio and image input, encoded at admission and spliced in per step.

``prepare_media`` decodes the request's content parts, renders the chat with
the checkpoint's template (one ``<|audio_pad|>`` between ``<|audio_start|>``
and ``<|audio_end|>`` per clip, one ``<|image_pad|>`` between
``<|vision_start|>`` and ``<|vision_end|>`` per image), runs the encoders and
expands each placeholder to the item's token count, as Qwen3-Omni's processor
does. The embeddings travel in ``Prepared.extras``; ``splice_embeddings`` puts
them over their rows in whatever prefill chunk a step carries, so the step
loop never runs an encoder and a media request joins a running batch.

Positions (``get_rope_index``): an audio span's M-RoPE ids are consecutive in
all three rows (``arange(audio_len) + start``), an image's are its merged
grid's after the text before it, and the text after continues from the
largest id + 1 (``common.mrope.prompt_positions``); a prompt without images has
its token indices.
"""

from __future__ import annotations

import hashlib
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from ifb.params import InvalidRequest, RequestSpec
from ifb.runtime import Prepared, ScheduledStep
from ifb_plugins.common.media import parse_messages
from ifb_plugins.common.mrope import prompt_positions

#: ``Prepared.extras`` keys: ``[(prompt rows [N], embeddings [N, W])]`` in prompt order, the KV salt (a digest
#: of the media bytes: the context cache never hands one item's KV to another), a media marker and the
#: prompt's ``mrope.MropePositions`` when it holds an image
MEDIA_EMBEDS, KV_SALT, MEDIA, MEDIA_POSITIONS = "media_embeds", "kv_salt", "media", "media_positions"


def render(tokenizer: Any, messages: list[dict]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - the template's own error is the message
        raise InvalidRequest(f"the chat template rejected these messages: {exc}") from exc


def prepare_media(runtime: Any, spec: RequestSpec, prepare_text) -> Prepared:
    """The request's prompt with each clip's and image's placeholder expanded, their embeddings in the extras.

    ``runtime`` has ``tokenizer``, ``audio_encoder``, ``audio_features``, ``image_encoder``,
    ``audio_token_id``, ``image_token_id``, ``model``, ``max_model_len`` and ``device``;
    ``prepare_text(spec)`` is the text runtime's own ``prepare``.
    """
    if spec.messages is None:
        raise InvalidRequest("audio and images are sent as input_audio / image_url content parts of chat messages")
    parsed = parse_messages(spec.messages, modalities={"audio", "image"},
                            sampling_rate=runtime.audio_features.sampling_rate)
    ids = runtime.tokenizer.encode(render(runtime.tokenizer, list(parsed.messages)), add_special_tokens=False)
    prepared = prepare_text(attrs.evolve(spec, messages=None, prompt=None, prompt_token_ids=tuple(ids)))
    ids = list(prepared.prompt_token_ids)
    kinds = {runtime.audio_token_id: "audio", runtime.image_token_id: "image"}
    found = [(i, kinds[t]) for i, t in enumerate(ids) if t in kinds]
    if [kind for _, kind in found] != [m.kind for m in parsed.media]:
        tokens = ", ".join(repr(runtime.tokenizer.id_to_token(t)) for t in kinds)
        raise InvalidRequest(f"the prompt has {len(found)} media placeholders for {len(parsed.media)} media parts: "
                             f"remove {tokens} from the message text")
    expanded: list[int] = []
    spans: list[tuple[torch.Tensor, torch.Tensor]] = []
    positions: list[tuple[int, torch.Tensor]] = []
    salt = hashlib.blake2b(digest_size=16)
    at = 0
    embed = runtime.model.model.embed_tokens
    dtype, width = embed.weight.dtype, embed.weight.shape[1] + getattr(embed, "extra", 0)
    for (index, kind), item in zip(found, parsed.media, strict=True):
        expanded += ids[at:index]
        start = len(expanded)
        if kind == "audio":
            features = torch.from_numpy(runtime.audio_features.features(item.data))  # [M, F]
            rows = runtime.audio_encoder(features.to(runtime.device))  # [N, H]
        else:
            image = runtime.image_encoder.encode(item.data, runtime.device)
            rows = image.rows  # [N, (K + 1) H]
            positions.append((start, image.position_ids))
        rows = F.pad(rows, (0, width - rows.shape[1]))  # audio rows carry no DeepStack features
        spans.append((torch.arange(start, start + rows.shape[0]), rows.to(runtime.device, dtype)))
        expanded += [ids[index]] * rows.shape[0]
        at = index + 1
        salt.update(kind.encode() + item.digest)
    expanded += ids[at:]
    if len(expanded) > runtime.max_model_len:
        raise InvalidRequest(f"the prompt with its media is {len(expanded)} tokens; this deployment's context "
                             f"is {runtime.max_model_len}")
    extras = {**prepared.extras, MEDIA_EMBEDS: spans, KV_SALT: salt.hexdigest(), MEDIA: True}
    if positions:
        extras[MEDIA_POSITIONS] = prompt_positions(len(expanded), positions)
    return Prepared(tuple(expanded), extras)


def splice_embeddings(step: ScheduledStep, input_ids: torch.Tensor, embed_tokens: Any) -> torch.Tensor | None:
    """Token embeddings ``[T, H]`` with each chunk's media rows replaced, or None for a step of text alone.

    A prefill chunk covers prompt positions ``start_pos .. start_pos + n``; it
    may hold only part of a clip's rows, so each is clipped to it.
    """
    patches: list[tuple[torch.Tensor, torch.Tensor]] = []
    offset = 0
    for seq in step.seqs:
        n = len(seq.token_ids)
        for rows, embeds in seq.extras.get(MEDIA_EMBEDS, ()):
            inside = (rows >= seq.start_pos) & (rows < seq.start_pos + n)
            if bool(inside.any()):
                patches.append((rows[inside] - seq.start_pos + offset, embeds[inside.to(embeds.device)]))
        offset += n
    if not patches:
        return None
    embeds = embed_tokens(input_ids)  # [T, H]
    for rows, values in patches:
        embeds[rows.to(embeds.device)] = values
    return embeds
