"""n > 1 under in-flight batching: one prefill, n sequences sharing the prompt's blocks, each its own stream."""

from __future__ import annotations

import time

import pytest

from ifb import LLM, SamplingParams
from ifb.params import InvalidRequest, RequestSpec
from tests.models.text import save_tiny_checkpoint

PROMPT = tuple(range(3, 43))  # 40 tokens: the shared 39 fill two blocks of 16 and part of a third
SEEDED = SamplingParams(temperature=1.0, top_k=40, seed=11, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("n"), "llama", seed=5)


def singles(llm, params=SEEDED, n=4):
    """Sequence i of an n > 1 request is the single request seeded seed + i."""
    return [llm.engine.submit(RequestSpec(prompt_token_ids=PROMPT, params=SamplingParams(
        **{**_fields(params), "seed": params.seed + i})), wait=True).result().token_ids for i in range(n)]


def _fields(params):
    import attrs

    return attrs.asdict(params, recurse=False)


def sequences(outputs, n=4):
    """Each choice's tokens, from a stream of outputs tagged with their index."""
    out = {i: () for i in range(n)}
    for o in outputs:
        out[o.index] += tuple(o.token_ids)
    return [out[i] for i in range(n)]


def recorded(llm, monkeypatch):
    runtime, blocks = llm.deployment.runtime, llm.engine.blocks
    log = []
    execute = runtime.execute

    def recording(step):
        log.append((step, [blocks.ref_counts[b] for b in range(blocks.num_blocks)]))
        return execute(step)

    monkeypatch.setattr(runtime, "execute", recording)
    return log


def test_n_shares_one_prefill_and_equals_n_seeded_singles(checkpoint, monkeypatch):
    with LLM(str(checkpoint), enable_in_flight_batching=True, max_batch_size=6, max_num_batched_tokens=16) as llm:
        expected = singles(llm)
        assert len(set(expected)) == 4  # four different streams
        log = recorded(llm, monkeypatch)
        before = llm.engine.counters.computed_prompt_tokens
        outs = list(llm.engine.submit(RequestSpec(prompt_token_ids=PROMPT, params=attrs_n(SEEDED, 4)), wait=True))
        assert sequences(outs) == expected
        assert outs[-1].finished and sum(o.finished for o in outs) == 1
        assert {o.index for o in outs if o.finish_reason} == {0, 1, 2, 3}
        # one prefill: the leader computes the shared 39 tokens, then each of the four the last one
        assert llm.engine.counters.computed_prompt_tokens - before == 39 + 4
        forks = [(step, refs) for step, refs in log if step.block_copies]
        assert len(forks) == 1 and len(forks[0][0].block_copies) == 3  # copy on write of the partial block
        step, refs = forks[0]
        leader = next(s for s in step.seqs if s.request_id.endswith("-0"))
        followers = [s for s in step.seqs if not s.request_id.endswith("-0")]
        assert len(followers) == 3
        for follower in followers:
            # the two full blocks are the leader's, counted once and referenced four times
            shared = follower.new_block_ids[:2]
            assert all(refs[b] == 4 for b in shared)
            assert follower.new_block_ids[2] in {dst for _, dst in step.block_copies}
        assert leader.start_pos == 39
        llm.engine.blocks.check_no_leaks()


def staggered(llm, specs, gap_steps=1):
    """Submit each spec once the previous one has run ``gap_steps`` steps; the handles, in order."""
    handles = []
    for spec in specs:
        handles.append(llm.engine.submit(spec, wait=True))
        target = llm.engine.scheduler.num_steps + gap_steps
        deadline = time.monotonic() + 30
        while llm.engine.scheduler.num_steps < target and not handles[-1].done.is_set() and time.monotonic() < deadline:
            time.sleep(0.0005)
    return handles


def attrs_n(params, n):
    import attrs

    return attrs.evolve(params, n=n)


def test_n_in_a_busy_batch_with_context_cache_and_greedy(checkpoint):
    with LLM(str(checkpoint), enable_in_flight_batching=True, max_batch_size=8, max_num_batched_tokens=16,
             enable_context_reuse=True) as llm:
        expected = singles(llm)
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        mates = [RequestSpec(prompt_token_ids=tuple(range(50 + i, 70 + i)), params=greedy) for i in range(3)]
        mates_alone = [llm.engine.submit(m, wait=True).result().token_ids for m in mates]
        target = RequestSpec(prompt_token_ids=PROMPT, params=attrs_n(SEEDED, 4))
        hits = llm.engine.counters.prefix_cache_hits
        handles = staggered(llm, (mates[0], target, mates[1], mates[2]))
        outs = list(handles[1])
        assert sequences(outs) == expected
        assert [handles[i].result().token_ids for i in (0, 2, 3)] == mates_alone
        assert llm.engine.counters.prefix_cache_hits > hits  # the leader leased the prompt's published blocks
        assert llm.health()["scheduling"]["admitted_mid_flight"] >= 3


def test_n_under_preemption_gives_the_same_sequences(checkpoint):
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with LLM(str(checkpoint), enable_in_flight_batching=True, max_batch_size=6, max_num_batched_tokens=32,
             max_kv_cache_capacity=16 * 14) as llm:
        expected = singles(llm, SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True))
        other = RequestSpec(prompt_token_ids=tuple(range(100, 140)), params=greedy)
        other_alone = llm.engine.submit(other, wait=True).result().token_ids
        target = RequestSpec(prompt_token_ids=PROMPT, params=SamplingParams(
            temperature=1.0, seed=3, max_tokens=40, ignore_eos=True, n=4))
        handles = staggered(llm, (other, target), gap_steps=2)
        assert sequences(list(handles[1])) == expected
        assert handles[0].result().token_ids == other_alone
        assert llm.health()["scheduling"]["preempted"] > 0
        llm.engine.blocks.check_no_leaks()


def test_n_past_the_batch_size_is_refused(checkpoint):
    with LLM(str(checkpoint), enable_in_flight_batching=True, max_batch_size=2) as llm:
        with pytest.raises(InvalidRequest, match=r"n \(3\) is more than the batch size \(2\)") as info:
            llm.engine.submit(RequestSpec(prompt_token_ids=PROMPT, params=SamplingParams(n=3)))
        assert info.value.param == "n"


def scored_singles(llm, params, k):
    """Candidate i of a best_of request is the single request seeded seed + i: its tokens and cumulative logprob."""
    outs = [llm.engine.submit(RequestSpec(prompt_token_ids=PROMPT, params=SamplingParams(
        **{**_fields(params), "seed": params.seed + i, "n": 1, "best_of": None, "logprobs": 0})), wait=True).result()
        for i in range(k)]
    return [(o.token_ids, sum(lp.logprob for lp in o.logprobs)) for o in outs]


def top(scored, n):
    return [scored[i][0] for i in sorted(range(len(scored)), key=lambda i: (-scored[i][1], i))[:n]]


@pytest.mark.parametrize("in_flight", [True, False])
def test_best_of_returns_the_n_most_likely_of_its_seeded_candidates(checkpoint, in_flight):
    params = SamplingParams(temperature=1.0, seed=21, max_tokens=8, n=2, best_of=5)
    with LLM(str(checkpoint), enable_in_flight_batching=in_flight, max_batch_size=6,
             max_num_batched_tokens=16) as llm:
        scored = scored_singles(llm, params, 5)
        assert len({s for _, s in scored}) == 5  # five different candidates: the choice is a real one
        expected = top(scored, 2)
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        mate = RequestSpec(prompt_token_ids=tuple(range(50, 70)), params=greedy)
        mate_alone = llm.engine.submit(mate, wait=True).result().token_ids
        before = llm.engine.counters.snapshot()
        handles = staggered(llm, (mate, RequestSpec(prompt_token_ids=PROMPT, params=params)))
        outs = list(handles[1])
        # held until every candidate is done: the two choices, best first, each in one output
        assert [o.index for o in outs] == [0, 1] and [o.finished for o in outs] == [False, True]
        assert [o.token_ids for o in outs] == expected
        assert all(o.logprobs == () for o in outs)  # not asked for: the candidates' own are not sent
        assert handles[0].result().token_ids == mate_alone
        after = llm.engine.counters.snapshot()
        assert after["completed"] - before["completed"] == 2  # the best_of request counts as one
        if in_flight:
            assert after["admitted_mid_flight"] > before["admitted_mid_flight"]
        llm.engine.blocks.check_no_leaks()


def test_best_of_with_logprobs_keeps_them_and_is_bounded_by_the_batch(checkpoint):
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=6, n=1, best_of=3, logprobs=2)
    with LLM(str(checkpoint), enable_in_flight_batching=True, max_batch_size=3) as llm:
        scored = scored_singles(llm, params, 3)
        (out,) = list(llm.engine.submit(RequestSpec(prompt_token_ids=PROMPT, params=params), wait=True))
        assert out.token_ids == top(scored, 1)[0]
        assert len(out.logprobs) == 6 and all(len(lp.top_logprobs) == 2 for lp in out.logprobs)
        assert sum(lp.logprob for lp in out.logprobs) == pytest.approx(max(s for _, s in scored))
        with pytest.raises(InvalidRequest, match=r"best_of \(4\) is more than the batch size \(3\)") as info:
            llm.engine.submit(RequestSpec(prompt_token_ids=PROMPT, params=SamplingParams(best_of=4)))
        assert info.value.param == "best_of"
        with pytest.raises(InvalidRequest, match=r"best_of \(1\) must be between n \(2\) and 16"):
            llm.engine.submit(RequestSpec(prompt_token_ids=PROMPT, params=SamplingParams(n=2, best_of=1)))
