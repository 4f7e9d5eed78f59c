"""Per-seat recurrent state: chunked prefill continues exactly, new seats start clean, released seats are cleared."""

from __future__ import annotations

import pytest
import torch

from ifb.capabilities import DeployConfig
from ifb.params import SamplingParams
from tests.helpers import Seq, StepBuilder
from ifb_plugins.mamba import load

GREEDY = SamplingParams(temperature=0.0)
PROMPT = tuple((7 * i + 3) % 300 + 3 for i in range(31))
#: steps as the scheduler sends them: a request in a reset seat arrives new
STEPS = StepBuilder()
BLOCKS = {0: (0, 1, 2), 1: (3, 4, 5), 2: (6, 7, 8), 3: (9, 10, 11)}  # per seat: its own KV blocks


@pytest.fixture(scope="module")
def runtime(hybrid_dir):
    return load(DeployConfig(model=str(hybrid_dir), plugin="mamba", max_batch_size=4))


def seq(seat: int, prompt: tuple[int, ...], start: int, n: int, rid: str | None = None) -> Seq:
    return Seq(request_id=rid or f"seat{seat}", seat=seat, token_ids=prompt[start:start + n],
                        start_pos=start, block_ids=BLOCKS[seat], is_sampling=start + n == len(prompt),
                        params=GREEDY, num_prompt_tokens=len(prompt), all_token_ids=prompt)


def prefill(runtime, seat: int, chunks: list[int], mate: int | None = None) -> int:
    """Prefill PROMPT on ``seat`` in ``chunks``; a batch mate on seat ``mate`` prefills its own prompt
    alongside, a different split. Returns the sampled first token."""
    other = tuple(reversed(PROMPT))
    start, other_start, token = 0, 0, None
    for i, n in enumerate(chunks):
        seqs = [seq(seat, PROMPT, start, n)]
        if mate is not None and other_start < len(other):
            m = min(3, len(other) - other_start)
            seqs.insert(0, seq(mate, other, other_start, m))
            other_start += m
        resets = tuple(s.seat for s in seqs if s.start_pos == 0)
        out = runtime.execute(STEPS.step(i, tuple(seqs), reset_seats=resets))
        start += n
        token = next(o.token_id for o in out.seqs if o.request_id == f"seat{seat}")
    assert start == len(PROMPT)
    return token


def test_chunked_prefill_leaves_the_same_state_as_one_shot(runtime):
    one_token = prefill(runtime, 0, [len(PROMPT)])
    one_conv, one_ssm = runtime.seat_state(0)
    for seat, chunks, mate in [(1, [5, 1, 8, 3, 14], None), (2, [8, 8, 8, 7], 3), (3, [1] * len(PROMPT), 1)]:
        token = prefill(runtime, seat, chunks, mate)
        conv, ssm = runtime.seat_state(seat)
        assert token == one_token
        for a, b in zip(conv + ssm, one_conv + one_ssm, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
            # The chunk scan is the decode step applied token by token, so it is exact, not just close.
            assert torch.equal(a, b), f"chunking changed the state by {(a - b).abs().max().item():.3g}"
    assert any(t.abs().max() > 0.1 for t in one_ssm)  # the state is not trivially zero


def test_a_reset_seat_starts_clean_and_the_state_matters(runtime):
    clean = prefill(runtime, 1, [len(PROMPT)])
    clean_conv, clean_ssm = runtime.seat_state(1)
    # Seat 1 now holds a finished prompt's state; running the prompt again without a reset leaks it.
    runtime.execute(STEPS.step(99, (seq(1, PROMPT, 0, len(PROMPT)),)))
    _, leaked_ssm = runtime.seat_state(1)
    assert not any(torch.equal(a, b) for a, b in zip(leaked_ssm, clean_ssm))
    # With the seat named in reset_seats the dirty state is zeroed first.
    out = runtime.execute(STEPS.step(100, (seq(1, PROMPT, 0, len(PROMPT)),), reset_seats=(1,)))
    conv, ssm = runtime.seat_state(1)
    assert out.seqs[0].token_id == clean
    assert all(torch.equal(a, b) for a, b in zip(conv + ssm, clean_conv + clean_ssm))


def test_release_clears_only_that_seat(runtime):
    prefill(runtime, 0, [len(PROMPT)])
    prefill(runtime, 2, [len(PROMPT)])
    before = runtime.seat_state(2)
    runtime.release("seat0", 0)
    conv, ssm = runtime.seat_state(0)
    assert all(not t.any() for t in conv + ssm)
    assert all(torch.equal(a, b) for a, b in zip(runtime.seat_state(2)[1], before[1]))


def test_a_seat_outside_the_state_is_refused(runtime):
    with pytest.raises(ValueError, match="outside the 4 seats"):
        runtime.execute(STEPS.step(1, (
            Seq("x", 4, PROMPT[:3], 0, BLOCKS[0], True, GREEDY, 3, PROMPT[:3]),)))
