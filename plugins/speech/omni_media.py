"""Qwen3-Omni's media prompts: the Thinker's audio and image input, encoded at admission and spliced in per step.

``prepare_media`` decodes the request's content parts, renders the chat with
the checkpoint's template (one ``<|audio_pad|>`` between ``<|audio_start|>``
and ``<|audio_end|>`` per clip, one ``<|image_pad|>`` between
``<|vision_start|>`` and ``<|vision_end|>`` per image), runs the encoders and
expands each placeholder to the item's token count, as Qwen3-Omni's processor
does. The embeddings travel in the prepared state (``TextRequestState.media``); ``media.prompt.splice_embeddings``
puts them over their rows in whatever prefill chunk a step carries, so the step
loop never runs an encoder and a media request joins a running batch.

Positions (``get_rope_index``): an audio span's M-RoPE ids are consecutive in
all three rows (``arange(audio_len) + start``), an image's are its merged
grid's after the text before it, and the text after continues from the
largest id + 1 (``common.mrope.prompt_positions``); a prompt without images has
its token indices.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F

from ifb.params import InvalidRequest, RequestSpec
from ifb.runtime import Prepared
from ifb_plugins.common.media.parts import MediaItem, parse_messages
from ifb_plugins.common.media.prompt import MediaSpan, expand_media
from ifb_plugins.common.runtime.syscache import common_prefix_length, system_messages


def render(tokenizer: Any, messages: list[dict], template_kwargs: dict | None = None, *,
           add_generation_prompt: bool = True) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             **(template_kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - the template's own error is the message
        raise InvalidRequest(f"the chat template rejected these messages: {exc}") from exc


def prepare_media(runtime: Any, spec: RequestSpec, prepare_text) -> Prepared:
    """The request's prompt with each clip's and image's placeholder expanded, their embeddings in its state.

    ``runtime`` has ``tokenizer``, ``audio_encoder``, ``audio_features``, ``image_encoder``,
    ``audio_token_id``, ``image_token_id``, ``model``, ``max_model_len`` and ``device``;
    ``prepare_text(spec)`` is the text runtime's own ``prepare``.
    """
    if spec.messages is None:
        raise InvalidRequest("audio and images are sent as input_audio / image_url content parts of chat messages")
    parsed = parse_messages(spec.messages, modalities={"audio", "image"},
                            sampling_rate=runtime.audio_features.sampling_rate)
    ids = runtime.tokenizer.encode(render(runtime.tokenizer, list(parsed.messages), spec.chat_template_kwargs),
                                  add_special_tokens=False)
    prepared = prepare_text(attrs.evolve(spec, messages=None, prompt=None, prompt_token_ids=tuple(ids)))
    system = system_messages(parsed.messages)
    pinned = 0
    if spec.extras.get("save_system_prompt_kv_cache") and system:
        # the capture keeps the system messages rendered alone, as far as they agree with the whole prompt
        system_ids = runtime.tokenizer.encode(render(runtime.tokenizer, system, spec.chat_template_kwargs,
                                                     add_generation_prompt=False), add_special_tokens=False)
        pinned = common_prefix_length(system_ids, ids)
    prepared = attrs.evolve(prepared, num_pinned_tokens=pinned)
    ids = list(prepared.prompt_token_ids)
    kinds = {runtime.audio_token_id: "audio", runtime.image_token_id: "image"}
    found = [(i, kinds[t]) for i, t in enumerate(ids) if t in kinds]
    if [kind for _, kind in found] != [m.kind for m in parsed.media]:
        tokens = ", ".join(repr(runtime.tokenizer.id_to_token(t)) for t in kinds)
        raise InvalidRequest(f"the prompt has {len(found)} media placeholders for {len(parsed.media)} media parts: "
                             f"remove {tokens} from the message text")
    embed = runtime.model.model.embed_tokens
    width = embed.weight.shape[1] + getattr(embed, "extra", 0)

    def span(item: MediaItem) -> MediaSpan:
        position_ids = None
        if item.kind == "audio":
            features = torch.from_numpy(runtime.audio_features.features(item.data))  # [M, F]
            rows = runtime.audio_encoder(features.to(runtime.device))  # [N, H]
        else:
            image = runtime.image_encoder.encode(item.data, runtime.device)
            rows, position_ids = image.rows, image.position_ids  # [N, (K + 1) H]
        rows = F.pad(rows, (0, width - rows.shape[1]))  # audio rows carry no DeepStack features
        token_id = runtime.audio_token_id if item.kind == "audio" else runtime.image_token_id
        return MediaSpan([token_id] * rows.shape[0], torch.arange(rows.shape[0]), rows, position_ids)

    return expand_media(prepared, found, parsed.media, span, max_model_len=runtime.max_model_len,
                        device=runtime.device, dtype=embed.weight.dtype)
