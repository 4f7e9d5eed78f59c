"""Per-sequence sampling for one batch of logits.

The text runtime calls :func:`sample` after each forward with one row of logits per
sequence that samples this step. Every row carries its own :class:`SamplingParams`, so
the work is organised as:

1. penalties (repetition / presence / frequency), per row with scatter ops;
2. greedy rows (temperature 0): argmax;
3. sampled rows: temperature, top-k, top-p, min-p as batched *row-wise* ops (``filters``:
   each cut found among a row's largest logits, not by sorting the vocabulary), then a draw
   by inverse transform: one uniform per row against the row's cumulative probabilities,
   a seeded row's uniform a pure function of (seed, output index);
4. logprobs, from the raw logits.

Batch invariance: a row's result must not depend on its batch mates or position. Every
batched op used here (elementwise maths, softmax / sort / cumsum / argmax along the vocab
axis) reduces within a row only, so batching changes no row's numerics; and randomness
for seeded rows is counter-based (a hash of seed and output index), never a shared stream
whose offset depends on how many rows came before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import attrs
import torch

from ifb.params import SamplingParams
from ifb.runtime import ScheduledSeq, Seat, SeqOutput, StepOutput
from ifb_plugins.common.decoding.filters import filter_logits

if TYPE_CHECKING:
    from ifb_plugins.common.decoding.guided import GuidedDecoder

__all__ = ["SeqSample", "sample", "sample_step"]

_MASK64 = (1 << 64) - 1
#: the largest uniform a draw uses (see ``_draw``)
_U_MAX = 1.0 - 2.0 ** -52


@attrs.frozen
class SeqSample:
    """The sampled token of one row.

    ``logprob`` is ``None`` unless the row asked for logprobs; ``top_logprobs`` then holds
    ``params.logprobs`` ``(token_id, logprob)`` pairs, most likely first.
    """

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _seed_for_step(seed: int, step: int) -> int:
    """Mix a request seed and its output-token index into one 64-bit generator seed.

    A plain ``seed + step`` would make request (s, k+1) replay request (s+1, k); the
    splitmix64 finaliser spreads neighbouring inputs over the whole 64-bit range.
    """
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _apply_penalties(
    row: torch.Tensor,
    params: SamplingParams,
    history: Sequence[int],
    num_prompt: int,
) -> None:
    """Apply one row's penalties to ``row`` (a 1-D view of the working logits) in place.

    Order follows vLLM: repetition first, then frequency and presence.
    """
    vocab = row.shape[0]
    device = row.device

    if params.repetition_penalty != 1.0:
        # HF/vLLM: every token seen in prompt or output. Dedupe in Python (cheap) and drop
        # ids outside the logits (tokenizer-added tokens beyond a model's padded vocab) so
        # the gather/scatter below cannot index out of range.
        seen = [t for t in set(history) if 0 <= t < vocab]
        if seen:
            ids = torch.tensor(seen, dtype=torch.long, device=device)
            vals = row.index_select(0, ids)
            # Dividing a negative logit would *raise* it, so negatives are multiplied.
            vals = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
            row.index_copy_(0, ids, vals)

    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        # OpenAI: only generated tokens count, never the prompt.
        out = [t for t in history[num_prompt:] if 0 <= t < vocab]
        if out:
            ids = torch.tensor(out, dtype=torch.long, device=device)
            # index_add_ rather than bincount: bincount's output size depends on the data,
            # which forces a device sync on GPU. Integer counts are exact in float32.
            counts = torch.zeros(vocab, dtype=row.dtype, device=device)
            counts.index_add_(0, ids, torch.ones_like(ids, dtype=row.dtype))
            row.sub_(counts * params.frequency_penalty + (counts > 0).to(row.dtype) * params.presence_penalty)


def _filter(
    x: torch.Tensor,
    top_k: list[int],
    top_p: list[float],
    min_p: list[float],
) -> torch.Tensor:
    """Mask (to -inf) the tokens that top-k, then top-p, then min-p exclude, per row of ``x`` [S, V]
    (temperature-scaled logits); ``filters.filter_logits``, which finds the cuts without sorting whole rows."""
    return filter_logits(x, top_k, top_p, min_p)


def _uniform_for_step(seed: int, step: int) -> float:
    """A seeded row's uniform in [0, 1) at output index ``step``: the top 53 bits of its mixed seed.

    Counter-based: the value is a pure function of (seed, step), so no generator is created
    or advanced and nothing about the batch can shift it.
    """
    return (_seed_for_step(seed, step) >> 11) * 2.0 ** -53


def _draw(
    probs: torch.Tensor,
    params: Sequence[SamplingParams],
    steps: Sequence[int],
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Draw one token per row of ``probs`` [S, V] (non-negative weights, unnormalised allowed); returns [S] ids.

    Inverse transform: one uniform ``u`` per row picks the first token whose cumulative
    weight exceeds ``u`` times the row's total, which selects token ``i`` with probability
    ``p_i / sum(p)`` and never a token of weight 0. A seeded row's ``u`` comes from
    (seed, output index) alone (:func:`_uniform_for_step`), so its draw is independent of
    batch mates and position; unseeded rows share one batched draw from ``generator`` (or
    torch's default). One uniform a row, rather than one random number per vocabulary entry,
    keeps the draw a few batched ops whatever the vocabulary size.
    """
    num_rows = probs.shape[0]
    device = probs.device
    u = [0.0] * num_rows
    unseeded = [i for i, p in enumerate(params) if p.seed is None]
    for i, p in enumerate(params):
        if p.seed is not None:
            u[i] = _uniform_for_step(p.seed, steps[i])
    if unseeded:
        drawn = torch.rand(len(unseeded), dtype=torch.float64, generator=generator, device=device).tolist()
        for i, value in zip(unseeded, drawn):
            u[i] = value
    return _pick(probs, u)


def _pick(weights: torch.Tensor, u: Sequence[float]) -> torch.Tensor:
    """Per row of ``weights`` [S, V], the first token whose cumulative weight exceeds ``u[row]`` times the row's total."""
    # float64 so the cumulative sums resolve a 1e-9 tail token next to a total near 1 (each row's
    # sum runs along its own row, so a row's ids do not depend on the rows beside it)
    cdf = weights.to(torch.float64).cumsum(dim=-1)
    # u * total rounds to below the total for u <= 1 - 2**-52 (its product is at least one ulp under
    # it), so the search always lands inside the row, on a token of positive weight
    targets = torch.tensor([min(x, _U_MAX) for x in u], dtype=torch.float64, device=weights.device) * cdf[:, -1]
    return torch.searchsorted(cdf, targets.unsqueeze(1), right=True).squeeze(1)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_histories: Sequence[Sequence[int]],
    num_prompt_tokens: Sequence[int],
    *,
    generator: torch.Generator | None = None,
    argmax: Callable[[torch.Tensor], list[int]] | None = None,
) -> list[SeqSample]:
    """Sample one token for each row of ``logits``.

    Args:
        logits: [B, V] logits, one row per sequence that samples this step (cast to float32).
        params: one :class:`SamplingParams` per row.
        token_histories: per row, prompt + generated token ids (for penalties; the
            generated count also indexes the seeded draw).
        num_prompt_tokens: per row, how many leading ids of the history are the prompt.
        generator: the random source for unseeded rows; ``None`` uses torch's default
            generator for ``logits.device``.
        argmax: picks a batch of greedy rows' tokens (the first index of each row's maximum)
            when every row is greedy; ``None``: torch's ``max(dim=-1)``.

    Returns:
        One :class:`SeqSample` per row, in row order.

    Logprobs are the log-softmax of the *raw* logits (before penalties, temperature and
    filters), as vLLM returns by default: they describe the model, not the sampler, and
    stay finite for tokens the filters removed.
    """
    batch = logits.shape[0] if logits.dim() == 2 else -1
    if logits.dim() != 2 or not (batch == len(params) == len(token_histories) == len(num_prompt_tokens)):
        raise ValueError(
            f"sample: logits {tuple(logits.shape)} must be [B, V] with B == len(params) "
            f"({len(params)}) == len(token_histories) ({len(token_histories)}) "
            f"== len(num_prompt_tokens) ({len(num_prompt_tokens)})"
        )
    if batch == 0:
        return []
    want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
    penalised = [i for i, p in enumerate(params) if _has_penalty(p)]
    greedy = [i for i, p in enumerate(params) if p.is_greedy]

    # Hot path: pure greedy decoding is one argmax and one host transfer for the batch.
    if len(greedy) == batch and not penalised and not want_logprobs:
        # (No float32 cast first: casting is exact, so argmax over bf16/fp16 is the same.) max(dim)
        # picks the same first index of the maximum as argmax, at a third of its cost on CPUs.
        ids = argmax(logits) if argmax is not None else logits.max(dim=-1).indices.tolist()
        return [SeqSample(token_id=t) for t in ids]

    logits = logits.float()

    work = logits
    if penalised:
        work = logits.clone()  # the raw logits stay intact for logprobs
        for i in penalised:
            _apply_penalties(work[i], params[i], token_histories[i], num_prompt_tokens[i])

    if len(greedy) == batch:
        chosen = work.argmax(dim=-1)
    else:
        chosen = torch.empty(batch, dtype=torch.long, device=logits.device)
        sampled = [i for i in range(batch) if not params[i].is_greedy]
        if greedy:
            g_idx = torch.tensor(greedy, device=logits.device)
            chosen[g_idx] = work.index_select(0, g_idx).argmax(dim=-1)
        s_idx = torch.tensor(sampled, device=logits.device)
        s_params = [params[i] for i in sampled]
        temps = torch.tensor([p.temperature for p in s_params], device=logits.device)
        x = work.index_select(0, s_idx) / temps.unsqueeze(1)
        x = _filter(x, [p.top_k for p in s_params], [p.top_p for p in s_params], [p.min_p for p in s_params])
        steps = [len(token_histories[i]) - num_prompt_tokens[i] for i in sampled]
        chosen[s_idx] = _draw(x.softmax(dim=-1), s_params, steps, generator)

    token_ids: list[int] = chosen.tolist()
    results = [SeqSample(token_id=t) for t in token_ids]

    if want_logprobs:
        lp_idx = torch.tensor(want_logprobs, device=logits.device)
        lps = logits.index_select(0, lp_idx).log_softmax(dim=-1)
        chosen_lp = lps.gather(1, chosen.index_select(0, lp_idx).unsqueeze(1)).squeeze(1).tolist()
        n_top = max(params[i].logprobs for i in want_logprobs)  # type: ignore[type-var]
        n_top = min(n_top, lps.shape[1])
        # A stable descending sort (rather than topk, whose order among equal values is
        # unspecified) lists ties by ascending id, so a row's top-n list is a fixed
        # prefix of its ranking whatever the batch mates' N; bf16-born logits tie often.
        if n_top > 0:
            top_vals, top_ids = lps.sort(dim=-1, descending=True, stable=True)
            top_vals_l, top_ids_l = top_vals[:, :n_top].tolist(), top_ids[:, :n_top].tolist()
        else:
            top_vals_l = top_ids_l = [[] for _ in want_logprobs]
        for j, i in enumerate(want_logprobs):
            n = params[i].logprobs
            results[i] = SeqSample(
                token_id=token_ids[i],
                logprob=chosen_lp[j],
                top_logprobs=tuple(zip(top_ids_l[j][:n], top_vals_l[j][:n])),
            )
    return results


def sampled_rows(seqs: Sequence[ScheduledSeq]) -> list[tuple[int, int]]:
    """``(index in seqs, row of the step's tokens)`` of each sampling sequence's last token."""
    rows, last = [], -1
    for i, s in enumerate(seqs):
        last += len(s.token_ids)
        if s.is_sampling:
            rows.append((i, last))
    return rows


def sample_step(
    seqs: Sequence[ScheduledSeq],
    seats: Sequence[Seat],
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    *,
    argmax: Callable[[torch.Tensor], list[int]] | None = None,
    guided: GuidedDecoder | None = None,
) -> StepOutput:
    """A stepped runtime's output for ``seqs`` (each with its ``seats`` record), from the step's hidden states ``[T, H]``.

    The hidden state of each sampling sequence's last token (the step's tokens are
    concatenated in ``seqs`` order) goes through ``compute_logits`` and :func:`sample`;
    the other sequences (prefill chunks that do not end their prompt) get no token.
    With ``guided``, rows whose sequence carries a grammar are masked before sampling
    and their grammars advanced after.
    """
    rows = sampled_rows(seqs)
    results: dict[int, SeqOutput] = {}
    if rows:
        logits = compute_logits(hidden[[t for _, t in rows]])  # [N, V]
        picked = [seats[i] for i, _ in rows]
        constrained = [] if guided is None else [(j, s) for j, s in enumerate(picked) if guided.applies_to(s)]
        if constrained:
            guided.mask_logits(logits, constrained)
        samples = sample(logits, [s.params for s in picked], [s.all_token_ids for s in picked],
                         [s.num_prompt_tokens for s in picked], argmax=argmax)
        if constrained:
            guided.advance([(s, samples[j].token_id) for j, s in constrained])
        for (i, _), s, r in zip(rows, picked, samples):
            results[i] = SeqOutput(s.request_id, r.token_id, r.logprob, r.top_logprobs)
    return StepOutput(tuple(results.get(i) or SeqOutput(s.request_id, None) for i, s in enumerate(seqs)))
