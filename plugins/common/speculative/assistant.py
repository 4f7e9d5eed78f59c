"""A drafter fed with the target's last hidden state: Gemma 4's assistant (``Gemma4AssistantModel``).

Each seat drafts from the target's hidden state that predicted its last known
token (``DraftRequest.hidden``) and that token's embedding; every drafting step
stays at the last known token's position and reads the target's KV of the
context before it, so the drafter keeps no cache or per-seat state of its own:
a joiner drafts as soon as its prefill sampled a token, a leaver or a
preempted seat leaves nothing behind. Seats drafting in the same step share
each of the ``k`` forwards. Drafts are the assistant's greedy tokens.

Other heads of this kind (EAGLE-style, built-in MTP layers) fit the same
``Drafter`` protocol: ``needs_hidden_states`` and a forward from
``(token embedding, hidden)`` to ``(logits, next hidden)``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ifb_plugins.common.layers.attention import GroupedAttn, build_attn_metadata
from ifb_plugins.common.models.gemma4_assistant import Gemma4AssistantModel
from ifb_plugins.common.speculative.drafter import DraftRequest


class AssistantDrafter:
    """``Drafter`` running ``assistant`` over the target's caches (``kv_by_kind``: per layer type, the
    target layer's ``(k, v)``), with ``embed`` the target's scaled input embedding."""

    needs_hidden_states = True
    #: it reads the target's KV cache: where the target's sliding layers keep only their window, it reads
    #: ``text.WINDOW_DRAFTER_REACH`` positions before it
    reads_target_kv = True

    def __init__(self, assistant: Gemma4AssistantModel, embed: Callable[[torch.Tensor], torch.Tensor],
                 kv_by_kind: dict[str, tuple[torch.Tensor, torch.Tensor]], block_size: int, *,
                 description: str) -> None:
        self.assistant = assistant
        self.embed = embed
        self.kv_by_kind = kv_by_kind
        self.block_size = block_size
        self.description = description
        self.device = next(assistant.parameters()).device

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> list[Sequence[int] | Exception]:
        drafts: list[list[int]] = [[] for _ in requests]
        # a seat drafts once its target hidden state is known (after its prefill sampled) and it has context
        live = [i for i, r in enumerate(requests) if r.hidden is not None and r.num_drafts > 0
                and len(r.token_ids) > 1]
        if not live:
            return drafts
        try:
            # the query sits at the last known token's position, over the context before it
            attn = build_attn_metadata([(len(requests[i].token_ids) - 2, 1, requests[i].block_ids) for i in live],
                                       self.block_size, self.device)
            windows = requests[live[0]].window_block_ids
            if windows:  # the target's sliding layers have a KV cache group (one window) of their own
                (target_window,) = windows
                sliding = build_attn_metadata([(len(requests[i].token_ids) - 2, 1,
                                                requests[i].window_block_ids[target_window]) for i in live],
                                              self.block_size, self.device)
                # the assistant's sliding layers (a window one wider) read that group's table
                attn = GroupedAttn(attn, ((self.assistant.config.text.sliding_window, sliding),))
            positions = torch.tensor([len(requests[i].token_ids) - 1 for i in live], device=self.device)
            tokens = torch.tensor([requests[i].token_ids[-1] for i in live], device=self.device)
            hidden = torch.stack([requests[i].hidden for i in live]).to(self.device)
            for step in range(max(requests[i].num_drafts for i in live)):
                logits, hidden = self.assistant(self.embed(tokens), hidden, positions, attn, self.kv_by_kind)
                tokens = logits.argmax(dim=-1)
                for i, token in zip(live, tokens.tolist()):
                    if step < requests[i].num_drafts:
                        drafts[i].append(token)
        except Exception as exc:  # noqa: BLE001 - the drafting seats go on without drafts; the step goes on
            return [exc] * len(requests)
        return drafts

    def accepted(self, request_id: str, num_valid_tokens: int) -> None:
        """Nothing to roll back: every step drafts from the target's own state."""

    def release(self, request_id: str) -> None:
        """Nothing is kept per seat."""
