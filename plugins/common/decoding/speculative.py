"""Verifying drafted tokens against the target model's logits, exactly per request.

A speculating sequence brings its last known token and ``k`` drafts; the step's
forward gives ``k + 1`` rows of logits (row ``j`` predicts the token after draft
``j``). Each row is processed as that position's plain sampling would process
it: penalties over the history up to it (the drafts before it included),
temperature, top-k, top-p, min-p. Then:

- a greedy request accepts drafts while each equals its row's argmax, and adds
  the argmax of the first row that disagrees (or of the last): the tokens plain
  greedy decoding makes, bit for bit, as the rows' logits are the plain steps'
  (the kernels compute each row on its own);
- a sampled request runs rejection sampling with the drafts as point-mass
  proposals (what n-gram lookup and a greedy draft model propose): draft ``d``
  is accepted with probability ``p(d)``; at the first rejection the token is
  drawn from ``p`` with ``d`` removed, renormalised; after ``k`` acceptances the
  bonus token is drawn from the last row. Every emitted token then follows the
  request's own distribution ``p`` exactly (Leviathan et al., 2023, with q one-hot).

A guided request's rows are masked as plain guided decoding masks them, row
``j`` by its grammar after the first ``j`` drafts (``GuidedDecoder.mask_drafted``),
so a drafted token outside the grammar is never emitted.

Seeded requests draw from per-position generators (seed, output index), so a
seeded request's output depends on its drafts but never on its batch mates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch

from ifb.params import SamplingParams
from ifb.runtime import SampledToken, ScheduledSeq, Seat, SeqOutput, StepOutput
from ifb_plugins.common.decoding.sampling import (
    _apply_penalties, _draw, _filter, _has_penalty, _seed_for_step, sample,
)

if TYPE_CHECKING:
    from ifb_plugins.common.decoding.guided import GuidedDecoder

__all__ = ["verify_drafts", "verify_step"]

#: mixed into a seed for the acceptance draws, so they never replay the token draws at the same index
_ACCEPT_SALT = 0x5EC0DE5EC0DE


def _uniform(params: SamplingParams, index: int, generator: torch.Generator | None, device) -> float:
    if params.seed is None:
        return float(torch.rand((), generator=generator, device=device))
    g = torch.Generator(device=device)
    g.manual_seed(_seed_for_step(params.seed ^ _ACCEPT_SALT, index))
    return float(torch.rand((), generator=g, device=device))


def verify_drafts(
    logits: torch.Tensor,
    params: SamplingParams,
    history: Sequence[int],
    num_prompt_tokens: int,
    drafts: Sequence[int],
    *,
    generator: torch.Generator | None = None,
    argmax: Callable[[torch.Tensor], list[int]] | None = None,
) -> list[SampledToken]:
    """The tokens one sequence emits from its ``len(drafts) + 1`` rows of ``logits``: the accepted drafts, then
    the target's own next token.

    ``history`` is the sequence's prompt and output before the drafts (its last known token included).
    Logprobs, where ``params.logprobs`` asks, are the raw logits' log-softmax at each emitted position.
    """
    k = len(drafts)
    if logits.dim() != 2 or logits.shape[0] != k + 1:
        raise ValueError(f"verify_drafts: {k} drafts need {k + 1} rows of logits, not {tuple(logits.shape)}")
    tokens: list[int] = []
    if params.is_greedy and not _has_penalty(params):
        # no history is read: the rows' argmaxes against the drafts, nothing copied per row
        targets = argmax(logits) if argmax is not None else logits.max(dim=-1).indices.tolist()
        for j in range(k + 1):
            tokens.append(targets[j])
            if j == k or targets[j] != drafts[j]:
                break
    else:
        histories = [list(history) + list(drafts[:j]) for j in range(k + 1)]
        work = logits.float().clone()
        if _has_penalty(params):
            for j in range(k + 1):
                _apply_penalties(work[j], params, histories[j], num_prompt_tokens)
        if params.is_greedy:
            targets = work.argmax(dim=-1).tolist()
            for j in range(k + 1):
                tokens.append(targets[j])
                if j == k or targets[j] != drafts[j]:
                    break
        else:
            tokens = _rejection_sample(work, params, histories, num_prompt_tokens, drafts, generator)
    return _with_logprobs(logits, params, tokens)


def _rejection_sample(work: torch.Tensor, params: SamplingParams, histories: list[list[int]], num_prompt: int,
                      drafts: Sequence[int], generator: torch.Generator | None) -> list[int]:
    k = len(drafts)
    rows = work.shape[0]
    x = work / params.temperature
    x = _filter(x, [params.top_k] * rows, [params.top_p] * rows, [params.min_p] * rows)
    probs = x.softmax(dim=-1)
    tokens = []
    for j in range(k + 1):
        index = len(histories[j]) - num_prompt  # the output index this row's token takes
        if j < k:
            d = drafts[j]
            if _uniform(params, index, generator, work.device) < float(probs[j, d]):
                tokens.append(d)
                continue
            residual = probs[j:j + 1].clone()
            residual[0, d] = 0.0  # (p - q)+ with q one-hot at d; the draw renormalises by itself
            if float(residual.sum()) <= 0.0:
                tokens.append(d)  # p is all on d (rounding): nothing else could be drawn
                continue
            tokens.append(int(_draw(residual, [params], [index], generator)[0]))
            return tokens
        tokens.append(int(_draw(probs[j:j + 1], [params], [index], generator)[0]))
    return tokens


def _with_logprobs(logits: torch.Tensor, params: SamplingParams, tokens: list[int]) -> list[SampledToken]:
    if params.logprobs is None:
        return [SampledToken(t) for t in tokens]
    lps = logits[:len(tokens)].float().log_softmax(dim=-1)
    n_top = min(params.logprobs, lps.shape[1])
    out = []
    for j, t in enumerate(tokens):
        top = ()
        if n_top > 0:
            vals, ids = lps[j].sort(descending=True, stable=True)  # ties by ascending id, as ``sample``
            top = tuple(zip(ids[:n_top].tolist(), vals[:n_top].tolist()))
        lp = float(lps[j, t])
        out.append(SampledToken(t, lp, top))
    return out


def verify_step(
    seqs: Sequence[ScheduledSeq],
    seats: Sequence[Seat],
    drafts: Sequence[Sequence[int]],
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    *,
    argmax: Callable[[torch.Tensor], list[int]] | None = None,
    guided: GuidedDecoder | None = None,
) -> StepOutput:
    """``sampling.sample_step`` for a step whose sequences may carry ``drafts`` (appended to their tokens in
    ``hidden [T, H]``'s order): plain rows are sampled together, each drafting sequence is verified on its
    own ``k + 1`` rows. One ``compute_logits`` call covers every row."""
    plain, drafted, rows, last = [], [], [], -1
    for i, (s, d) in enumerate(zip(seqs, drafts)):
        last += len(s.token_ids) + len(d)
        if d:
            drafted.append((i, len(rows)))
            rows.extend(range(last - len(d), last + 1))
        elif s.is_sampling:
            plain.append((i, len(rows)))
            rows.append(last)
    results: dict[int, SeqOutput] = {}
    if rows:
        logits = compute_logits(hidden[rows])  # [N, V]
        if plain:
            picked = [seats[i] for i, _ in plain]
            plain_logits = logits[[r for _, r in plain]]
            constrained = [] if guided is None else [(j, s) for j, s in enumerate(picked) if guided.applies_to(s)]
            if constrained:
                guided.mask_logits(plain_logits, constrained)
            samples = sample(plain_logits, [s.params for s in picked], [s.all_token_ids for s in picked],
                             [s.num_prompt_tokens for s in picked], argmax=argmax)
            if constrained:
                guided.advance([(s, samples[j].token_id) for j, s in constrained])
            for (i, _), s, r in zip(plain, picked, samples):
                results[i] = SeqOutput(s.request_id, r.token_id, r.logprob, r.top_logprobs)
        for i, r in drafted:
            seat, d = seats[i], tuple(drafts[i])
            is_guided = guided is not None and guided.applies_to(seat)
            valid = d
            if is_guided:  # each row masked by its grammar state; drafts past a forbidden one are never judged
                valid = d[:guided.mask_drafted(logits[r:r + len(d) + 1], seat, d)]
            tokens = verify_drafts(logits[r:r + len(valid) + 1], seat.params, seat.all_token_ids,
                                   seat.num_prompt_tokens, valid, argmax=argmax)
            if is_guided:
                guided.advance([(seat, t.token_id) for t in tokens])
            final = tokens[-1]
            results[i] = SeqOutput(seat.request_id, final.token_id, final.logprob, final.top_logprobs,
                                   accepted=tuple(tokens[:-1]), num_drafted=len(d))
    return StepOutput(tuple(results.get(i) or SeqOutput(s.request_id, None) for i, s in enumerate(seqs)))
