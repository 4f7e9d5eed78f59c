"""Media in a stepped runtime's prompt: placeholders expanded at admission, embeddings spliced in per step.

``expand_media`` replaces each media placeholder of a prepared prompt with the
item's token ids and keeps its embeddings, the KV salt and the M-RoPE
positions in ``Prepared.extras``; ``splice_embeddings`` and
``media_step_positions`` read them back for whatever prefill chunk a step
carries, so the step loop never runs an encoder and a media request joins a
running batch like any other.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Sequence

import attrs
import torch

from ifb.params import InvalidRequest
from ifb.runtime import Prepared, ScheduledStep
from ifb_plugins.common.media.parts import MediaItem
from ifb_plugins.common.layers.mrope import prompt_positions, step_positions

#: ``Prepared.extras`` keys: ``[(prompt rows [N], embeddings [N, H])]`` in prompt order; the KV salt (a
#: digest of the media bytes: the context cache never hands one item's KV to another); a marker that the
#: request carries media; and the prompt's ``mrope.MropePositions`` for multi-axis positions (M-RoPE).
MEDIA_EMBEDS, KV_SALT, MEDIA, MEDIA_POSITIONS = "media_embeds", "kv_salt", "media", "media_positions"


@attrs.frozen
class MediaSpan:
    """One media item as its placeholder expands: the ids replacing it and the rows its embeddings replace."""

    token_ids: Sequence[int]
    rows: torch.Tensor = attrs.field(eq=False, repr=False)  # [N] long, indices into token_ids
    embeds: torch.Tensor = attrs.field(eq=False, repr=False)  # [N, H]
    position_ids: torch.Tensor | None = attrs.field(default=None, eq=False, repr=False)  # [3, len(token_ids)]


def expand_media(prepared: Prepared, found: Sequence[tuple[int, str]], media: Sequence[MediaItem],
                 encode: Callable[[MediaItem], MediaSpan], *, max_model_len: int, device: torch.device,
                 dtype: torch.dtype) -> Prepared:
    """``prepared`` with the placeholder at each ``found`` index (one per item of ``media``, in order)
    replaced by ``encode(item)``'s ids; the embeddings (as ``dtype`` on ``device``), salt and positions
    go in the extras. A prompt longer than ``max_model_len`` once expanded is refused."""
    ids = list(prepared.prompt_token_ids)
    expanded: list[int] = []
    spans: list[tuple[torch.Tensor, torch.Tensor]] = []
    positions: list[tuple[int, torch.Tensor]] = []
    salt = hashlib.blake2b(digest_size=16)
    at = 0
    for (index, kind), item in zip(found, media, strict=True):
        expanded += ids[at:index]
        span = encode(item)
        start = len(expanded)
        spans.append((span.rows + start, span.embeds.to(device, dtype)))
        if span.position_ids is not None:
            positions.append((start, span.position_ids))
        expanded += span.token_ids
        at = index + 1
        salt.update(kind.encode() + item.digest)
    expanded += ids[at:]
    if len(expanded) > max_model_len:
        raise InvalidRequest(f"the prompt with its media is {len(expanded)} tokens; this deployment's context "
                             f"is {max_model_len}")
    extras = {**prepared.extras, MEDIA_EMBEDS: spans, KV_SALT: salt.hexdigest(), MEDIA: True}
    if positions:
        extras[MEDIA_POSITIONS] = prompt_positions(len(expanded), positions)
    return Prepared(tuple(expanded), extras)


def media_step_positions(step: ScheduledStep) -> torch.Tensor:
    """M-RoPE ids ``[3, T]`` for a step: a media prompt's from its positions, every other sequence's its
    token indices."""
    spans = [(s.extras.get(MEDIA_POSITIONS), s.start_pos, len(s.token_ids)) for s in step.seqs]
    return step_positions(spans)


def splice_embeddings(step: ScheduledStep, input_ids: torch.Tensor, embed_tokens: Any) -> torch.Tensor | None:
    """Token embeddings ``[T, H]`` with each chunk's media rows replaced, or None for a step of text alone.

    A prefill chunk covers prompt positions ``start_pos .. start_pos + n``; it
    may hold only part of an item's rows, so each is clipped to it.
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
        return None  # text only: the model embeds the ids itself
    embeds = embed_tokens(input_ids)  # [T, H]
    for rows, values in patches:
        embeds[rows.to(embeds.device)] = values
    return embeds
