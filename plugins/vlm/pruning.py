"""The visual-token pruner: keep the most important fraction of an image's embedding rows.

Any family's ``EncodedMedia`` can be pruned: the kept rows stay in their
original order, the dropped rows' tokens leave the prompt (wrapper tokens stay),
and per-token position ids, when a family has them, are cut the same way.
"""

from __future__ import annotations

import math

import attrs
import torch

from ifb_plugins.vlm.interface import EncodedMedia


def num_kept(num_tokens: int, ratio: float | None) -> int:
    """Visual tokens kept out of ``num_tokens`` under a pruner keeping ``ratio`` (at least one)."""
    if ratio is None or ratio >= 1.0:
        return num_tokens
    # The epsilon keeps float noise (0.3 * 10 = 3.0000000000000004) from rounding up a whole token.
    return max(1, min(num_tokens, math.ceil(ratio * num_tokens - 1e-9)))


def prune(encoded: EncodedMedia, ratio: float) -> EncodedMedia:
    """Keep ``num_kept`` rows of ``encoded``, ranked by ``importance`` (ties: the earlier row)."""
    n = encoded.embeds.shape[0]
    keep = num_kept(n, ratio)
    if keep == n:
        return encoded
    if encoded.importance is None:
        raise ValueError("this encoder gives no importance to prune its rows by")
    top = torch.argsort(encoded.importance, descending=True, stable=True)[:keep]
    kept = torch.sort(top).values
    kept_set = set(kept.tolist())
    columns, row = [], 0
    for j, token in enumerate(encoded.token_ids):
        if token == encoded.embed_token_id:
            if row in kept_set:
                columns.append(j)
            row += 1
        else:
            columns.append(j)
    positions = encoded.position_ids
    return attrs.evolve(
        encoded, token_ids=tuple(encoded.token_ids[j] for j in columns), embeds=encoded.embeds[kept],
        importance=encoded.importance[kept],
        position_ids=positions[:, torch.tensor(columns, dtype=torch.long)] if positions is not None else None)
