"""Verifying drafts keeps each request's own distribution: chi-square over many draws of a batch whose
requests differ in temperature, top-k, top-p and penalties; and n-gram prompt lookup."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from ifb.params import SamplingParams
from ifb.runtime import ScheduledSeq, Seat
from ifb_plugins.common.decoding.sampling import _apply_penalties, _filter
from ifb_plugins.common.decoding.speculative import verify_step
from ifb_plugins.common.speculative.ngram import lookup

VOCAB = 12
PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8, presence_penalty=0.8, repetition_penalty=1.3),
]
HISTORY = [1, 2, 3, 4, 5]


def target_probs(logits: torch.Tensor, params: SamplingParams, history: list[int]) -> np.ndarray:
    """The request's own next-token distribution, as plain sampling computes it."""
    row = logits.clone()
    _apply_penalties(row, params, history, num_prompt=2)
    x = _filter((row / params.temperature)[None], [params.top_k], [params.top_p], [params.min_p])
    return x.softmax(dim=-1)[0].double().numpy()


def test_sampled_tokens_with_drafts_follow_each_requests_distribution():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, VOCAB, generator=gen) * 1.5  # three rows (two drafts and the bonus) per request
    # each request's first draft its likeliest token (often accepted, so the second row is tested too), the
    # second one a token that is not
    DRAFTS = [(int(hidden[3 * i].argmax()), int(hidden[3 * i + 1].argmin())) for i in range(3)]
    seqs = [ScheduledSeq(f"r{i}", i, (HISTORY[-1],), len(HISTORY) - 1, (), True, num_draft_tokens=2)
            for i in range(3)]
    seats = [Seat(f"r{i}", i, p, 2, list(HISTORY)) for i, p in enumerate(PARAMS)]
    num_draws = 4000
    first = np.zeros((3, VOCAB))
    second = np.zeros((3, VOCAB))  # given the first draft was accepted
    torch.manual_seed(1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # rows of 12 logits: threads only add their wake-up cost
    try:
        draws = [verify_step(seqs, seats, DRAFTS, hidden, lambda h: h.clone()) for _ in range(num_draws)]
    finally:
        torch.set_num_threads(threads)
    for out in draws:
        for i, o in enumerate(out.seqs):
            tokens = [t.token_id for t in o.accepted] + [o.token_id]
            first[i, tokens[0]] += 1
            if tokens[0] == DRAFTS[i][0]:
                second[i, tokens[1]] += 1
            assert o.num_drafted == 2 and len(tokens) == len(o.accepted) + 1 <= 3
    row = 0
    for i, (params, d) in enumerate(zip(PARAMS, DRAFTS)):
        for counts, history, j in ((first[i], HISTORY, 0), (second[i], HISTORY + [d[0]], 1)):
            p = target_probs(hidden[row + j], params, history)
            keep = p * counts.sum() >= 5  # chi-square needs expected counts of 5 or more
            assert counts[~keep].sum() <= max(5.0, 3 * (p[~keep] * counts.sum()).sum() + 5)
            observed = np.append(counts[keep], counts[~keep].sum())
            expected = np.append(p[keep], p[~keep].sum()) * counts.sum()
            observed, expected = observed[expected > 0], expected[expected > 0]
            expected *= observed.sum() / expected.sum()  # float rounding of p's sum
            assert chisquare(observed, expected).pvalue > 1e-3, (i, j, observed, expected)
        row += len(d) + 1
    # the filters are each request's own: top-k 5 never yields a token outside its top 5
    assert (first[1] > 0).sum() <= 5


def test_greedy_verification_accepts_the_agreeing_prefix_and_adds_the_targets_token():
    logits = torch.full((4, VOCAB), -5.0)
    for j, t in enumerate([7, 8, 2, 9]):
        logits[j, t] = 5.0
    seq = ScheduledSeq("g", 0, (1,), 4, (), True, num_draft_tokens=3)
    seat = Seat("g", 0, SamplingParams(temperature=0.0, logprobs=1), 2, [1, 2, 3, 4, 1])
    out = verify_step([seq], [seat], [(7, 8, 3)], logits, lambda h: h).seqs[0]
    assert [t.token_id for t in out.accepted] == [7, 8] and out.token_id == 2 and out.num_drafted == 3
    assert out.logprob == pytest.approx(float(logits[2].log_softmax(-1)[2]))
    assert out.accepted[0].top_logprobs[0][0] == 7


@pytest.mark.parametrize(("tokens", "k", "want"), [
    ([1, 2, 3, 4, 9, 9, 1, 2, 3], 3, [4, 9, 9]),  # the 3-gram 1 2 3 occurred: what followed it
    ([5, 1, 2, 7, 1, 2], 2, [7, 1]),  # the 2-gram 1 2
    ([1, 2, 3, 4], 3, []),  # nothing repeats
    ([4, 4, 4, 4, 4], 3, [4, 4]),  # no match that 3 tokens follow: the earliest, the longest continuation
])
def test_ngram_lookup(tokens, k, want):
    assert lookup(np.array(tokens), 2, 3, k) == want
