"""Helpers shared by the engine tests."""

from __future__ import annotations

import time
from typing import Any

import attrs

from ifb.params import RequestSpec, SamplingParams
from ifb.runtime import NewSeq, Prepared, ScheduledSeq, ScheduledStep, Seat


def submit_staggered(engine, specs, gap_steps: int = 2, timeout: float = 30.0, min_joined: int = 1):
    """Submit ``specs`` one by one, each after the previous one ran ``gap_steps`` engine steps.

    Later requests therefore arrive while earlier ones are generating and must
    join mid-flight: at least ``min_joined`` of them must have (the engine's
    ``admitted_mid_flight`` counter), or the test fails, since a run in which
    nobody joined proves nothing about batching. Returns the finished results in
    submission order.
    """
    joined_before = engine.counters.admitted_mid_flight
    handles = []
    for spec in specs:
        handle = engine.submit(spec, wait=True)
        handles.append(handle)
        deadline = time.monotonic() + timeout
        while handle.request_id not in engine.scheduler.requests and not handle.done.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError("the engine never took the request")
            time.sleep(0.0005)
        target = engine.scheduler.num_steps + gap_steps
        while engine.scheduler.num_steps < target and not handle.done.is_set() and time.monotonic() < deadline:
            time.sleep(0.0005)
    results = [h.result() for h in handles]
    joined = engine.counters.admitted_mid_flight - joined_before
    assert joined >= min_joined, f"{joined} of {len(specs)} staggered requests joined mid-flight, wanted {min_joined}"
    return results


@attrs.frozen
class Seq:
    """A sequence's whole share of a hand-built step, as a test describes it (``StepBuilder`` sends the diff)."""

    request_id: str
    seat: int
    token_ids: tuple[int, ...]
    start_pos: int
    block_ids: tuple[int, ...]
    is_sampling: bool
    params: SamplingParams
    num_prompt_tokens: int
    all_token_ids: tuple[int, ...]
    state: Any = None


class StepBuilder:
    """Hand-built steps as the scheduler sends them: a request the runtime has not seen (or one in a seat
    named in ``reset_seats``) arrives as a ``NewSeq``, and each step carries only the blocks not sent yet."""

    def __init__(self) -> None:
        self.num_sent_blocks: dict[str, int] = {}

    def step(self, step_id: int, seqs: tuple[Seq, ...] | list[Seq], reset_seats: tuple[int, ...] = ()) -> ScheduledStep:
        new, scheduled = [], []
        for s in seqs:
            if s.request_id not in self.num_sent_blocks or s.seat in reset_seats:
                self.num_sent_blocks[s.request_id] = 0
                new.append(NewSeq(request_id=s.request_id, seat=s.seat, token_ids=tuple(s.all_token_ids),
                                  num_prompt_tokens=s.num_prompt_tokens, params=s.params, state=s.state))
            sent = self.num_sent_blocks[s.request_id]
            self.num_sent_blocks[s.request_id] = len(s.block_ids)
            scheduled.append(ScheduledSeq(request_id=s.request_id, seat=s.seat, token_ids=tuple(s.token_ids),
                                          start_pos=s.start_pos, new_block_ids=tuple(s.block_ids[sent:]),
                                          is_sampling=s.is_sampling))
        return ScheduledStep(step_id=step_id, seqs=tuple(scheduled), new_seqs=tuple(new))


def prefill_step(prepared: Prepared, block_ids: tuple[int, ...], params: SamplingParams,
                 request_id: str = "r", step_id: int = 1) -> ScheduledStep:
    """One step that prefills a prepared prompt whole into ``block_ids`` and samples its next token."""
    ids = tuple(prepared.prompt_token_ids)
    return StepBuilder().step(step_id, [Seq(request_id, 0, ids, 0, tuple(block_ids), True, params, len(ids), ids,
                                            prepared.state)])


def one_seat_step(prepared: Prepared, block_ids: tuple[int, ...], params: SamplingParams,
                  request_id: str = "r") -> tuple[ScheduledStep, list[Seat]]:
    """A one-sequence prefill step of a prepared prompt and the runtime's record of its seat, for calling a
    runtime's step parts (``step_positions``, ``step_embeddings``) directly."""
    ids = tuple(prepared.prompt_token_ids)
    seat = Seat(request_id, 0, params, len(ids), list(ids), list(block_ids), prepared.state)
    seq = ScheduledSeq(request_id=request_id, seat=0, token_ids=ids, start_pos=0, new_block_ids=tuple(block_ids),
                       is_sampling=True)
    return ScheduledStep(step_id=0, seqs=(seq,)), [seat]


def alone_and_staggered(model_dir, plugin: str, prompts, key, max_tokens: int = 32, **settings: Any):
    """Each prompt's greedy result (``key`` of it) served alone on the blocking path, and staggered under
    in-flight batching at 4 seats with small prefill chunks; that requests joined mid-flight is asserted.
    ``settings``: more deployment settings for both (``quantization``...)."""
    from ifb import LLM

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    specs = [RequestSpec(prompt_token_ids=tuple(ids), params=params) for ids in prompts]
    with LLM(model=str(model_dir), plugin=plugin, **settings) as llm:
        alone = [key(llm.engine.submit(spec).result()) for spec in specs]
    with LLM(model=str(model_dir), plugin=plugin, enable_in_flight_batching=True, max_batch_size=4,
             max_num_batched_tokens=8, **settings) as llm:
        batched = [key(r) for r in submit_staggered(llm.engine, specs, gap_steps=2)]
        assert llm.health()["scheduling"]["admitted_mid_flight"] > 0
    return alone, batched


def plain_and_reused(model_dir, plugin: str, key, **reuse_settings):
    """Four requests sharing a 70-token system prompt, served under in-flight batching without and then with
    the context cache (``reuse_settings`` added); returns (plain, reused, the second /health, its prefix
    matcher's stats)."""
    from ifb import LLM

    system = list(range(40, 110))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)
    specs = [RequestSpec(prompt_token_ids=tuple(system + tail), params=params)
             for tail in ([3, 9], [250, 7, 7, 1], [12], [99, 98, 97])]
    settings = dict(plugin=plugin, enable_in_flight_batching=True, max_batch_size=3, max_num_batched_tokens=24)
    with LLM(model=str(model_dir), **settings) as llm:
        plain = [key(llm.engine.submit(spec).result()) for spec in specs]
    with LLM(model=str(model_dir), enable_context_reuse=True, **settings, **reuse_settings) as llm:
        reused = [key(llm.engine.submit(spec).result()) for spec in specs]
        return plain, reused, llm.health(), llm.engine.prefix.stats()
