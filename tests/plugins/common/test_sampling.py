"""Tests for ifb_plugins.common.decoding.sampling.sample."""

from __future__ import annotations

import math

import pytest
import torch

from ifb.params import SamplingParams
from ifb_plugins.common.decoding.sampling import _U_MAX, SeqSample, _pick, _seed_for_step, _uniform_for_step, sample

GREEDY = SamplingParams(temperature=0.0)


def _run(logits: torch.Tensor, params, histories=None, prompts=None, **kw) -> list[SeqSample]:
    """Call sample() with default histories: a one-token prompt (id 0 is avoided by default)."""
    b = logits.shape[0]
    if isinstance(params, SamplingParams):
        params = [params] * b
    histories = histories if histories is not None else [()] * b
    prompts = prompts if prompts is not None else [0] * b
    return sample(logits, list(params), list(histories), list(prompts), **kw)


def _support(logits_row: torch.Tensor, params: SamplingParams, draws: int = 4000, seed: int = 0) -> set[int]:
    """Tokens that appear over many unseeded draws of the same row (global generator seeded)."""
    g = torch.Generator().manual_seed(seed)
    batch = logits_row.unsqueeze(0).expand(draws, -1).contiguous()
    return {s.token_id for s in _run(batch, params, generator=g)}


# --- greedy ---------------------------------------------------------------------------


def test_greedy_equals_argmax() -> None:
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(1))
    out = _run(logits, GREEDY)
    assert [s.token_id for s in out] == logits.argmax(dim=-1).tolist()
    assert all(s.logprob is None and s.top_logprobs == () for s in out)


def test_greedy_ties_pick_lowest_id() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0]])
    assert _run(logits, GREEDY)[0].token_id == 1


def test_an_all_greedy_batch_takes_its_picks_from_the_given_argmax() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    seen = []

    def argmax(x: torch.Tensor) -> list[int]:
        seen.append(x)
        return [7, 8, 9]

    assert [s.token_id for s in sample(logits, [GREEDY] * 3, [[1]] * 3, [1] * 3, argmax=argmax)] == [7, 8, 9]
    assert len(seen) == 1 and seen[0] is logits
    # a batch with a sampled row, or a greedy row that wants logprobs, keeps the general path
    sampled = SamplingParams(temperature=1.0, max_tokens=4, seed=1)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1)
    for params in ([GREEDY, sampled, GREEDY], [GREEDY, with_logprobs, GREEDY]):
        out = sample(logits, params, [[1]] * 3, [1] * 3, argmax=argmax)
        assert [out[0].token_id, out[2].token_id] == logits[[0, 2]].argmax(dim=-1).tolist()
    assert len(seen) == 1


def test_greedy_hot_path_accepts_bf16() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2)).bfloat16()
    out = _run(logits, GREEDY)
    assert [s.token_id for s in out] == logits.float().argmax(dim=-1).tolist()


def test_empty_batch_and_bad_shapes() -> None:
    assert sample(torch.empty(0, 10), [], [], []) == []
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 10), [GREEDY], [(), ()], [0, 0])
    with pytest.raises(ValueError):
        sample(torch.zeros(10), [GREEDY], [()], [0])


# --- support restriction ----------------------------------------------------------------


PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
LOGITS = PROBS.log()


def test_plain_sampling_reaches_every_token() -> None:
    # Sanity check for the restriction tests below: with no filter, all tokens do appear.
    assert _support(LOGITS, SamplingParams()) == set(range(6))


@pytest.mark.parametrize("k, allowed", [(1, {0}), (3, {0, 1, 2}), (100, set(range(6))), (-1, set(range(6)))])
def test_top_k_restricts_support(k: int, allowed: set[int]) -> None:
    assert _support(LOGITS, SamplingParams(top_k=k)) == allowed


@pytest.mark.parametrize(
    "p, allowed",
    [(0.3, {0}), (0.5, {0, 1}), (0.7, {0, 1, 2}), (0.85, {0, 1, 2, 3}), (0.95, {0, 1, 2, 3, 4})],
)
def test_top_p_restricts_support(p: float, allowed: set[int]) -> None:
    assert _support(LOGITS, SamplingParams(top_p=p)) == allowed


def test_top_p_applies_to_top_k_survivors() -> None:
    # After top-k=2 the renormalised probs are 0.615 / 0.385: top_p=0.6 keeps only token 0.
    assert _support(LOGITS, SamplingParams(top_k=2, top_p=0.6)) == {0}


@pytest.mark.parametrize("min_p, allowed", [(0.3, {0, 1, 2}), (0.5, {0, 1}), (1.0, {0}), (0.12, set(range(5)))])
def test_min_p_restricts_support(min_p: float, allowed: set[int]) -> None:
    # thresholds: 0.3 * 0.4 = 0.12 keeps {0.40, 0.25, 0.15}; 0.5 -> 0.2 keeps {0.40, 0.25}
    assert _support(LOGITS, SamplingParams(min_p=min_p)) == allowed


def test_temperature_shapes_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0])
    draws = 4000
    for temp in (0.5, 1.0, 2.0):
        g = torch.Generator().manual_seed(3)
        out = _run(logits.expand(draws, -1).contiguous(), SamplingParams(temperature=temp), generator=g)
        freq = torch.bincount(torch.tensor([s.token_id for s in out]), minlength=3).float() / draws
        expected = (logits / temp).softmax(-1)
        assert torch.allclose(freq, expected, atol=0.03), (temp, freq, expected)


def test_tiny_temperature_is_nearly_greedy() -> None:
    logits = torch.tensor([1.0, 1.5, 0.2, 1.4])
    assert _support(logits, SamplingParams(temperature=0.005), draws=500) == {1}


# --- penalties ---------------------------------------------------------------------------


def test_repetition_penalty_positive_and_negative_logits() -> None:
    # Token 0 is the argmax; seen in the prompt, 2.0 / 1.2 = 1.67 < 1.9 flips it.
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    assert _run(torch.tensor([[2.0, 1.9, 0.0]]), params, [(0, 2)], [2])[0].token_id == 1
    # Negative logits are multiplied (pushed down), not divided: -1.0 * 1.2 = -1.2 < -1.1.
    assert _run(torch.tensor([[-1.0, -1.1, -5.0]]), params, [(0,)], [1])[0].token_id == 1
    # Output tokens count too.
    assert _run(torch.tensor([[2.0, 1.9, 0.0]]), params, [(2, 0)], [1])[0].token_id == 1
    # Unseen tokens are untouched.
    assert _run(torch.tensor([[2.0, 1.9, 0.0]]), params, [(2,)], [1])[0].token_id == 0


def test_presence_penalty_counts_output_only() -> None:
    params = SamplingParams(temperature=0.0, presence_penalty=0.5)
    logits = torch.tensor([[2.0, 1.8, 0.0]])
    # Token 0 in the prompt only: no effect.
    assert _run(logits, params, [(0, 0, 2)], [3])[0].token_id == 0
    # Token 0 generated (any count): 2.0 - 0.5 < 1.8.
    assert _run(logits, params, [(2, 0)], [1])[0].token_id == 1
    # Negative presence penalty encourages repeats.
    enc = SamplingParams(temperature=0.0, presence_penalty=-0.5)
    assert _run(torch.tensor([[1.8, 2.0, 0.0]]), enc, [(2, 0)], [1])[0].token_id == 0


def test_frequency_penalty_scales_with_count() -> None:
    params = SamplingParams(temperature=0.0, frequency_penalty=0.1)
    logits = torch.tensor([[2.0, 1.75, 0.0]])
    # Two occurrences: 2.0 - 0.2 = 1.8 > 1.75, still token 0.
    assert _run(logits, params, [(2, 0, 0)], [1])[0].token_id == 0
    # Three occurrences: 2.0 - 0.3 = 1.7 < 1.75.
    assert _run(logits, params, [(2, 0, 0, 0)], [1])[0].token_id == 1
    # Occurrences in the prompt do not count.
    assert _run(logits, params, [(0, 0, 0, 2)], [3])[0].token_id == 0


def test_penalties_apply_before_sampling_filters() -> None:
    # top_k=1 on a sampled row: the penalised argmax is the only survivor.
    params = SamplingParams(top_k=1, presence_penalty=1.0)
    out = _run(torch.tensor([[2.0, 1.5, 0.0]]).expand(50, -1).contiguous(), params, [(0,)] * 50, [0] * 50)
    assert {s.token_id for s in out} == {1}


def test_penalties_leave_input_logits_and_other_rows_alone() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0], [2.0, 1.9, 0.0]])
    before = logits.clone()
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5), GREEDY]
    out = _run(logits, params, [(0,), (0,)], [1, 1])
    assert [s.token_id for s in out] == [1, 0]
    assert torch.equal(logits, before)


# --- seeded sampling ----------------------------------------------------------------------


def _seeded_tokens(seed: int, history: tuple[int, ...], vocab: int = 1000) -> int:
    logits = torch.zeros(1, vocab)  # uniform: every token equally likely, collisions rare
    return _run(logits, SamplingParams(seed=seed), [history], [1])[0].token_id


def test_seeded_sampling_reproducible_and_ignores_global_rng() -> None:
    hist = (5, 6, 7)
    torch.manual_seed(0)
    a = _seeded_tokens(42, hist)
    torch.manual_seed(123)
    torch.rand(1000)
    assert _seeded_tokens(42, hist) == a


def test_seeded_sampling_varies_with_step_and_seed() -> None:
    by_step = [_seeded_tokens(42, (1,) + (9,) * k) for k in range(8)]
    by_seed = [_seeded_tokens(s, (1, 2)) for s in range(8)]
    assert len(set(by_step)) > 4
    assert len(set(by_seed)) > 4
    # The draw depends on the output count only, not on the token values in the history.
    assert _seeded_tokens(42, (1, 2, 3)) == _seeded_tokens(42, (7, 8, 9))


def test_seeded_row_independent_of_batch_mates_and_position() -> None:
    vocab = 500
    gen = torch.Generator().manual_seed(7)
    row = torch.randn(vocab, generator=gen)
    seeded = SamplingParams(seed=1234, top_p=0.9, temperature=0.8)
    hist = (3, 4, 5, 6)

    alone = sample(row.unsqueeze(0), [seeded], [hist], [2])[0].token_id
    for position in (0, 2, 5):
        others = torch.randn(6, vocab, generator=gen)
        others[position] = row
        params = [SamplingParams(top_k=5), GREEDY, SamplingParams(seed=9), SamplingParams(min_p=0.2),
                  SamplingParams(temperature=1.5), SamplingParams(seed=1234)]
        params[position] = seeded
        hists = [(1, 2, 3)] * 6
        hists[position] = hist
        prompts = [1] * 6
        prompts[position] = 2
        out = sample(others, params, hists, prompts)
        assert out[position].token_id == alone


def test_seed_mix_spreads_neighbours() -> None:
    assert _seed_for_step(1, 0) != _seed_for_step(0, 1)
    assert 0 <= _seed_for_step(-5, 3) < 2**64



def test_seeded_draws_follow_the_distribution() -> None:
    # one draw per seed: the seeded uniforms must spread like independent ones
    draws = 4000
    batch = LOGITS.expand(draws, -1).contiguous()
    out = sample(batch, [SamplingParams(seed=s) for s in range(draws)], [()] * draws, [0] * draws)
    freq = torch.bincount(torch.tensor([o.token_id for o in out]), minlength=6).float() / draws
    assert torch.allclose(freq, PROBS, atol=0.03), freq


def test_seeded_uniform_is_a_function_of_seed_and_index_only() -> None:
    values = [_uniform_for_step(s, k) for s in range(50) for k in range(50)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert len(set(values)) == len(values)
    assert _uniform_for_step(7, 3) == _uniform_for_step(7, 3)
    assert abs(sum(values) / len(values) - 0.5) < 0.02


def test_the_pick_never_lands_on_a_zero_weight_token() -> None:
    # zeros at both ends and inside, unnormalised (as speculative verification's residuals are)
    weights = torch.tensor([[0.0, 3.0, 0.0, 0.0, 7.0, 0.0, 0.0]] * 5)
    ends = [0.0, 0.3 - 1e-12, 0.3, 1.0 - 2.0 ** -53, 1.0]
    assert _pick(weights, ends).tolist() == [1, 1, 4, 4, 4]
    # totals whose u * total would round up to the total: still the last positive token
    for total in (1.0, 3.0, 2.0 ** 40, 1e-30):
        row = torch.tensor([[0.0, total / 2, total / 2, 0.0]], dtype=torch.float64)
        assert _pick(row, [_U_MAX]).tolist() == [2]
        assert _pick(row, [1.0 - 2.0 ** -53]).tolist() == [2]
    # a tail token a billionth of the mass keeps its own interval
    tail = torch.tensor([[1.0, 1e-9]])
    assert _pick(tail, [1.0 - 5e-10]).tolist() == [1]
    assert _pick(tail, [1.0 - 2e-9]).tolist() == [0]


# --- logprobs -----------------------------------------------------------------------------


def test_logprobs_from_raw_logits_sorted_and_normalised() -> None:
    vocab = 20
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(11))
    params = [
        SamplingParams(logprobs=vocab, temperature=0.7, top_k=3, presence_penalty=1.0),
        SamplingParams(logprobs=5, temperature=0.0),
        SamplingParams(logprobs=0),
    ]
    out = _run(logits, params, [(1, 2, 3)] * 3, [1] * 3)
    raw = logits.log_softmax(-1)

    full = out[0].top_logprobs
    assert len(full) == vocab
    assert math.isclose(sum(math.exp(lp) for _, lp in full), 1.0, rel_tol=1e-5)
    for s, r in zip(out, raw):
        assert s.logprob == pytest.approx(r[s.token_id].item(), abs=1e-6)
        vals = [lp for _, lp in s.top_logprobs]
        assert vals == sorted(vals, reverse=True)
        for tok, lp in s.top_logprobs:
            assert lp == pytest.approx(r[tok].item(), abs=1e-6)
    # The chosen token's logprob matches its entry in the full list.
    assert dict(full)[out[0].token_id] == pytest.approx(out[0].logprob)
    assert [t for t, _ in out[1].top_logprobs] == raw[1].topk(5).indices.tolist()
    assert out[1].token_id == logits[1].argmax().item()
    assert out[2].top_logprobs == () and out[2].logprob is not None


def test_logprobs_ties_listed_by_id() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]])
    out = _run(logits, SamplingParams(temperature=0.0, logprobs=2))
    assert [t for t, _ in out[0].top_logprobs] == [1, 2]


def test_no_logprobs_when_not_requested_in_mixed_batch() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(5))
    out = _run(logits, [SamplingParams(logprobs=2), SamplingParams()])
    assert out[0].logprob is not None and len(out[0].top_logprobs) == 2
    assert out[1].logprob is None and out[1].top_logprobs == ()


# --- mixed batches -----------------------------------------------------------------------


def test_mixed_greedy_and_sampled_batch() -> None:
    vocab = 64
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(13))
    params = [
        GREEDY,
        SamplingParams(seed=3),
        SamplingParams(temperature=0.0, frequency_penalty=0.0),
        SamplingParams(top_k=1),  # sampled but forced to the argmax
        SamplingParams(temperature=0.9, top_p=0.5, seed=8),
        GREEDY,
    ]
    hists = [(1,)] * 6
    out = _run(logits, params, hists, [1] * 6)
    argmax = logits.argmax(-1).tolist()
    for i in (0, 2, 3, 5):
        assert out[i].token_id == argmax[i]
    # Seeded sampled rows match their solo result.
    for i in (1, 4):
        assert out[i].token_id == sample(logits[i : i + 1], [params[i]], [hists[i]], [1])[0].token_id
    assert all(0 <= s.token_id < vocab for s in out)
