"""Media in a stepped runtime's prompt: placeholders expanded at admission, embeddings spliced in per step.

``expand_media`` replaces each media placeholder of a prepared prompt with the
item's token ids and keeps its embeddings and M-RoPE positions in the prepared
state (``MediaState``) and a KV salt of the media's bytes in ``Prepared.kv_salt``;
``splice_embeddings`` and ``media_step_positions`` read them back from each
seat for whatever prefill chunk a step carries, so the step loop never runs an
encoder and a media request joins a running batch like any other.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Sequence

import attrs
import torch

from ifb.params import InvalidRequest
from ifb.runtime import Prepared, ScheduledStep, Seat
from ifb_plugins.common.layers.mrope import prompt_positions, step_positions
from ifb_plugins.common.media.parts import MediaItem
from ifb_plugins.common.runtime.text import MediaState, TextRequestState


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
    go in the prepared state (``TextRequestState.media``); the KV salt, a digest of the media bytes, keeps
    the context cache from handing one item's KV to another from the first item on (the text before it is
    keyed by its tokens, or by an adapter's salt where the prompt had one). A system-prompt capture
    (``num_pinned_tokens``) keeps only what lies before the first item. A prompt longer than
    ``max_model_len`` once expanded is refused."""
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
    if prepared.kv_salt:
        salt.update(prepared.kv_salt.encode())
    media_state = MediaState(tuple(spans), prompt_positions(len(expanded), positions) if positions else None)
    state = attrs.evolve(prepared.state or TextRequestState(), media=media_state)
    # causal attention: the KV before the first item is the text's alone, whatever the media
    first = found[0][0] if found else len(expanded)
    return attrs.evolve(prepared, prompt_token_ids=tuple(expanded), state=state, kv_salt=salt.hexdigest(),
                        num_unsalted_tokens=0 if prepared.kv_salt else first,
                        num_pinned_tokens=min(prepared.num_pinned_tokens, first))


def media_of(seat: Seat) -> MediaState | None:
    """The media a seated request carries, if any."""
    return getattr(seat.state, "media", None)


def media_step_positions(step: ScheduledStep, seats: Sequence[Seat]) -> torch.Tensor:
    """M-RoPE ids ``[3, T]`` for a step: a media prompt's from its positions, every other sequence's its
    token indices."""
    spans = []
    for s, seat in zip(step.seqs, seats, strict=True):
        media = media_of(seat)
        spans.append((media.positions if media is not None else None, s.start_pos, len(s.token_ids)))
    return step_positions(spans)


def splice_embeddings(step: ScheduledStep, seats: Sequence[Seat], input_ids: torch.Tensor,
                      embed_tokens: Any) -> torch.Tensor | None:
    """Token embeddings ``[T, H]`` with each chunk's media rows replaced, or None for a step of text alone.

    A prefill chunk covers prompt positions ``start_pos .. start_pos + n``; it
    may hold only part of an item's rows, so each is clipped to it.
    """
    patches: list[tuple[torch.Tensor, torch.Tensor]] = []
    offset = 0
    for seq, seat in zip(step.seqs, seats, strict=True):
        n = len(seq.token_ids)
        media = media_of(seat)
        for rows, embeds in media.embeds if media is not None else ():
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
