"""What a draft source is to the runtime that verifies its drafts.

At the start of a step the runtime asks its ``Drafter`` for up to
``num_drafts`` tokens after each speculating seat's history (the engine gave
those positions their KV blocks); the same forward then verifies them. After
verification the runtime tells the drafter how many positions of each seat are
right (``accepted``), and ``release`` when the seat empties (finished,
cancelled, failed or preempted), so a drafter's own per-seat state (a draft
model's KV, say) is seated and released with the target's.

A head fed the target's hidden state (an assistant / MTP / EAGLE-style drafter)
sets ``needs_hidden_states``: each request then carries the target's last
hidden state, the one that predicted the seat's last known token.
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence

import attrs
import torch


@attrs.frozen
class DraftRequest:
    """One seat's drafting job in a step."""

    request_id: str
    #: the seat's prompt and output so far, its last known token included (the drafts follow it)
    token_ids: Sequence[int] = attrs.field(eq=False)
    #: the most drafts wanted
    num_drafts: int
    #: the seat's block table: it covers every position up to the last draft's
    block_ids: Sequence[int] = attrs.field(eq=False)
    #: the target's last-layer hidden state ``[H]`` at the position that predicted the last known token,
    #: where the drafter ``needs_hidden_states`` (else None)
    hidden: torch.Tensor | None = attrs.field(default=None, eq=False, repr=False)
    #: per sliding window, the seat's table in that KV cache group (the target's sliding layers' blocks)
    window_block_ids: Mapping[int, Sequence[int]] = attrs.field(factory=dict, eq=False)


class Drafter(Protocol):
    """A draft source (``ngram.NgramDrafter``, ``draft_model.DraftModelDrafter``)."""

    #: requests carry the target's last hidden state
    needs_hidden_states: bool
    #: the drafter's description (``/health``, logs)
    description: str

    def propose(self, requests: Sequence[DraftRequest]) -> list[Sequence[int] | Exception]:
        """Per request, at most ``num_drafts`` drafted tokens (maybe none), or the error that stopped it."""

    def accepted(self, request_id: str, num_valid_tokens: int) -> None:
        """The verification confirmed the seat's first ``num_valid_tokens`` tokens (the rest are rejected)."""

    def release(self, request_id: str) -> None:
        """The request left its seat."""
