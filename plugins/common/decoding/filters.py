"""Top-k, top-p and min-p over a batch of rows, without sorting whole vocabularies.

Each row's tokens are ranked by a stable descending order of its logits (ties by ascending
id). Top-k keeps the first ``k``; top-p, on the top-k survivors renormalised (as vLLM does),
keeps tokens while the probability mass strictly before them is below ``p``; min-p then drops
tokens below ``min_p`` times the row's largest probability. Each filter keeps a row's most
likely token, so no row is left empty.

The cut of a row is found among its largest logits only (``torch.topk``): a top-k row needs
its first ``k``, a nucleus is looked for among the first 64, then 512, 4096 and the whole row
for the rows whose mass has not reached ``p`` yet. A full sort of a 50k-token vocabulary per
row costs more than the rest of a sampling step together; most nuclei close within the first
64. What a row keeps is a function of that row alone: its probabilities come from a softmax
over its own row, the mass before each candidate is a prefix sum over candidates in the same
order whichever width found them, and the cut is applied as a threshold on the logits with
ties at the threshold resolved by id, as a stable sort would.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["filter_logits", "cut_sizes"]

#: the widths a nucleus is looked for among, in turn, before the whole row is sorted
NUCLEUS_WIDTHS = (64, 512, 4096)


def _largest(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``width`` largest logits of each row of ``x``, in descending order, and their ids."""
    if width >= x.shape[1]:
        return x.sort(dim=-1, descending=True)
    return x.topk(width, dim=-1)


def cut_sizes(x: torch.Tensor, ks: Sequence[int], ps: Sequence[float]) -> tuple[list[int], torch.Tensor]:
    """Per row of ``x`` [S, V], how many tokens of its stable descending order top-k then top-p keep,
    and the logit of the last kept one ([S]).

    ``ks[i]`` is in 1..V (V: no top-k), ``ps[i]`` in (0, 1] (1: no top-p).
    """
    num_rows, vocab = x.shape
    sizes = [0] * num_rows
    thresholds = torch.empty(num_rows, dtype=x.dtype, device=x.device)
    nucleus = [i for i in range(num_rows) if ps[i] < 1.0]
    probs = x.index_select(0, torch.tensor(nucleus, device=x.device)).softmax(dim=-1) if nucleus else None
    where = {i: j for j, i in enumerate(nucleus)}  # row of x -> row of probs
    # the first width holds every top-k row's cut; later ones only widen the open nuclei
    first = max([NUCLEUS_WIDTHS[0]] + [k for k in ks if k < vocab])
    widths = [first] + [w for w in NUCLEUS_WIDTHS if w > first] + [vocab]
    pending = list(range(num_rows))
    for width in dict.fromkeys(min(w, vocab) for w in widths):
        if not pending:
            break
        rows = torch.tensor(pending, device=x.device)
        values, ids = _largest(x.index_select(0, rows), width)
        counts = [min(ks[i], width) for i in pending]
        in_nucleus = [j for j, i in enumerate(pending) if i in where]
        if in_nucleus:
            sub = torch.tensor(in_nucleus, device=x.device)
            prob_rows = torch.tensor([where[pending[j]] for j in in_nucleus], device=x.device)
            # float64 prefix sums: the mass before candidate j is the sum of the j before it
            mass = probs.index_select(0, prob_rows).gather(1, ids.index_select(0, sub)).double().cumsum(dim=-1)
            k_rows = [ks[pending[j]] for j in in_nucleus]
            # top-k survivors renormalised: their total is the mass up to the k-th candidate
            totals = torch.tensor([1.0] * len(k_rows), dtype=torch.float64, device=x.device)
            capped = [n for n, k in enumerate(k_rows) if k < vocab]
            if capped:
                at = torch.tensor([k_rows[n] - 1 for n in capped], device=x.device)
                totals[capped] = mass[capped].gather(1, at.unsqueeze(1)).squeeze(1)
            limits = torch.tensor([ps[pending[j]] for j in in_nucleus], dtype=torch.float64, device=x.device)
            before = (mass[:, :-1] / totals.unsqueeze(1)) < limits.unsqueeze(1)
            for n, (j, kept) in enumerate(zip(in_nucleus, (before.sum(dim=-1) + 1).tolist())):
                counts[j] = min(k_rows[n], kept)
        still = []
        last = torch.tensor([c - 1 for c in counts], device=x.device)
        found = values.gather(1, last.unsqueeze(1)).squeeze(1)
        done = []
        for j, i in enumerate(pending):
            # a nucleus that filled every candidate may go on past them: look wider
            if counts[j] == width < vocab and ks[i] >= vocab:
                still.append(i)
            else:
                sizes[i] = counts[j]
                done.append(j)
        if done:
            thresholds[[pending[j] for j in done]] = found[done]
        pending = still
    return sizes, thresholds


def _keep_first(x: torch.Tensor, sizes: Sequence[int], thresholds: torch.Tensor) -> torch.Tensor:
    """[S, V] True for the first ``sizes[i]`` tokens of row i's stable descending order."""
    t = thresholds.unsqueeze(1)
    above = x > t
    ties = x == t
    # how many of the tokens equal to the threshold fit, by ascending id
    room = torch.tensor(sizes, device=x.device) - above.sum(dim=-1)
    if bool((ties.sum(dim=-1) > room).any()):
        ties &= ties.cumsum(dim=-1) <= room.unsqueeze(1)
    return above | ties


def filter_logits(x: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float],
                  min_p: Sequence[float]) -> torch.Tensor:
    """``x`` [S, V] (temperature-scaled logits) with the tokens that top-k, then top-p, then min-p exclude
    set to -inf, per row. ``top_k`` 0 or -1, ``top_p`` 1.0 and ``min_p`` 0.0 disable a row's filter."""
    num_rows, vocab = x.shape
    ks = [min(k, vocab) if k > 0 else vocab for k in top_k]
    cut = [i for i in range(num_rows) if ks[i] < vocab or top_p[i] < 1.0]
    if cut:
        rows = torch.tensor(cut, device=x.device)
        sub = x.index_select(0, rows)
        sizes, thresholds = cut_sizes(sub, [ks[i] for i in cut], [top_p[i] for i in cut])
        dropped = sub.masked_fill(~_keep_first(sub, sizes, thresholds), -math.inf)
        x = dropped if len(cut) == num_rows else x.index_copy(0, rows, dropped)
    if any(m > 0.0 for m in min_p):
        probs = x.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(list(min_p), device=x.device).unsqueeze(1)
        # Strict '<': the most likely token (prob == max) always survives, even at min_p=1.
        x = x.masked_fill(probs < floor, -math.inf)
    return x
