"""A draft model: a smaller (or cheaper-kernel) checkpoint sharing the target's vocabulary.

Its KV lives in its own paged cache, indexed by the target's block tables: a
seat's draft KV occupies the same block ids as its target KV, so it is seated,
grown, freed and dropped by preemption with the target's blocks and needs no
bookkeeping of its own beyond how far each seat's draft KV is computed. It
catches up lazily: when a seat next drafts, one forward feeds it every token it
has not seen (the whole prompt for a joiner, then the tokens accepted since),
and ``k - 1`` more one-token forwards draft the rest; seats that draft in the
same step share each forward. Drafts are the draft model's greedy tokens.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ifb_plugins.common.layers.attention import build_attn_metadata
from ifb_plugins.common.models.decoder import TextModel
from ifb_plugins.common.speculative.drafter import DraftRequest


class DraftModelDrafter:
    """``Drafter`` running ``model`` over ``kv_caches`` (the target's block count and size)."""

    needs_hidden_states = False

    def __init__(self, model: TextModel, kv_caches: list, block_size: int, *, description: str,
                 argmax: Callable[[torch.Tensor], list[int]] | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.description = description
        self.argmax = argmax
        self.device = next(model.parameters()).device
        self.max_len = model.config.max_position_embeddings
        #: per seat, how many leading positions of its draft KV are computed and right
        self.num_computed: dict[str, int] = {}

    def _greedy(self, hidden: torch.Tensor) -> list[int]:
        logits = self.model.compute_logits(hidden)
        return self.argmax(logits) if self.argmax is not None else logits.max(dim=-1).indices.tolist()

    def _forward(self, chunks: list[tuple[DraftRequest, int, Sequence[int]]]) -> list[int]:
        """One forward over ``(request, start position, tokens)`` per seat; each seat's greedy next token."""
        attn = build_attn_metadata([(start, len(ids), r.block_ids) for r, start, ids in chunks], self.block_size,
                                   self.device)
        ids = torch.tensor([t for _, _, c in chunks for t in c], dtype=torch.long, device=self.device)
        pos = torch.tensor([p for _, s, c in chunks for p in range(s, s + len(c))], dtype=torch.long,
                           device=self.device)
        hidden = self.model(ids, pos, attn, self.kv_caches)
        last = torch.tensor(attn.query_start_loc.tolist()[1:], device=self.device) - 1
        return self._greedy(hidden.index_select(0, last))

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> list[Sequence[int] | Exception]:
        drafts: list[list[int]] = [[] for _ in requests]
        # a draft at position p needs the draft model's context to reach p
        wanted = [min(r.num_drafts, self.max_len - len(r.token_ids)) for r in requests]
        live = [i for i, n in enumerate(wanted) if n > 0]
        try:
            chunks = []
            for i in live:
                r = requests[i]
                start = min(self.num_computed.get(r.request_id, 0), len(r.token_ids) - 1)
                chunks.append((r, start, r.token_ids[start:]))
            while live:
                for i, token in zip(live, self._forward(chunks)):
                    drafts[i].append(token)
                for r, start, ids in chunks:
                    self.num_computed[r.request_id] = start + len(ids)
                live = [i for i in live if len(drafts[i]) < wanted[i]]
                chunks = [(requests[i], len(requests[i].token_ids) + len(drafts[i]) - 1, drafts[i][-1:])
                          for i in live]
        except Exception as exc:  # noqa: BLE001 - the drafting seats go on without drafts; the step goes on
            for r in requests:
                self.num_computed.pop(r.request_id, None)  # its draft KV may be half written: recompute it
            return [exc] * len(requests)
        return drafts

    def accepted(self, request_id: str, num_valid_tokens: int) -> None:
        if request_id in self.num_computed:
            self.num_computed[request_id] = min(self.num_computed[request_id], num_valid_tokens)

    def release(self, request_id: str) -> None:
        self.num_computed.pop(request_id, None)
