"""Qwen3-Omni's media prompts: the Thinker's audio input, encoded at admission and spliced in at each step.

``prepare_media`` decodes the request's content parts, renders the chat with
the checkpoint's template (one ``<|audio_pad|>`` between ``<|audio_start|>``
and ``<|audio_end|>`` per clip), runs the audio encoder and expands each
placeholder to the clip's token count, as Qwen3-Omni's processor does. The
embeddings travel in ``Prepared.extras``; ``splice_embeddings`` puts them over
their rows in whatever prefill chunk a step carries, so the step loop never
runs an encoder and an audio request joins a running batch.

Positions: an audio span's M-RoPE ids are consecutive in all three rows
(``get_rope_index``: ``arange(audio_len) + start``), so a prompt of text and
audio has the plain positions of its tokens; no ``[3, T]`` ids are needed.
"""

from __future__ import annotations

import hashlib
from typing import Any

import attrs
import torch

from ifb.params import InvalidRequest, RequestSpec
from ifb.runtime import Prepared, ScheduledStep
from ifb_plugins.common.media import parse_messages

#: ``Prepared.extras`` keys: ``[(prompt rows [N], embeddings [N, H])]`` in prompt order, the KV salt (a digest
#: of the media bytes: the context cache never hands one clip's KV to another) and a media marker
MEDIA_EMBEDS, KV_SALT, MEDIA = "media_embeds", "kv_salt", "media"


def has_media(spec: RequestSpec) -> bool:
    """Whether the request's messages hold a content part other than text."""
    for message in spec.messages or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, (list, tuple)) and any(
                not isinstance(part, dict) or part.get("type") != "text" for part in content):
            return True
    return False


def render(tokenizer: Any, messages: list[dict]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - the template's own error is the message
        raise InvalidRequest(f"the chat template rejected these messages: {exc}") from exc


def prepare_media(runtime: Any, spec: RequestSpec, prepare_text) -> Prepared:
    """The request's prompt with each clip's placeholder expanded, and its embeddings in the extras.

    ``runtime`` has ``tokenizer``, ``audio_encoder``, ``audio_features``, ``audio_token_id``,
    ``max_model_len`` and ``device``; ``prepare_text(spec)`` is the text runtime's own ``prepare``.
    """
    if spec.messages is None:
        raise InvalidRequest("audio input is sent as input_audio content parts of chat messages")
    for message in spec.messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, (list, tuple)) and any(isinstance(p, dict) and p.get("type") == "image_url"
                                                      for p in content):
            raise InvalidRequest("image input to Qwen3-Omni is not built (its vision encoder is not loaded); "
                                 "audio input (input_audio) is")
    parsed = parse_messages(spec.messages, modalities={"audio"}, sampling_rate=runtime.audio_features.sampling_rate)
    ids = runtime.tokenizer.encode(render(runtime.tokenizer, list(parsed.messages)), add_special_tokens=False)
    prepared = prepare_text(attrs.evolve(spec, messages=None, prompt=None, prompt_token_ids=tuple(ids)))
    ids = list(prepared.prompt_token_ids)
    pad = runtime.audio_token_id
    found = [i for i, t in enumerate(ids) if t == pad]
    if len(found) != len(parsed.media):
        token = runtime.tokenizer.id_to_token(pad)
        raise InvalidRequest(f"the prompt has {len(found)} audio placeholders for {len(parsed.media)} audio parts: "
                             f"remove {token!r} from the message text")
    expanded: list[int] = []
    spans: list[tuple[torch.Tensor, torch.Tensor]] = []
    salt = hashlib.blake2b(digest_size=16)
    at = 0
    dtype = runtime.model.model.embed_tokens.weight.dtype
    for index, item in zip(found, parsed.media, strict=True):
        expanded += ids[at:index]
        features = torch.from_numpy(runtime.audio_features.features(item.data))  # [M, F]
        embeds = runtime.audio_encoder(features.to(runtime.device))  # [N, H]
        start = len(expanded)
        spans.append((torch.arange(start, start + embeds.shape[0]), embeds.to(runtime.device, dtype)))
        expanded += [pad] * embeds.shape[0]
        at = index + 1
        salt.update(b"audio" + item.digest)
    expanded += ids[at:]
    if len(expanded) > runtime.max_model_len:
        raise InvalidRequest(f"the prompt with its audio is {len(expanded)} tokens; this deployment's context "
                             f"is {runtime.max_model_len}")
    return Prepared(tuple(expanded), {**prepared.extras, MEDIA_EMBEDS: spans, KV_SALT: salt.hexdigest(), MEDIA: True})


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
