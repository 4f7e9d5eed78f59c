"""pi0 under in-flight batching: prefixes prefilled together, Euler steps batched, requests joining
mid-flight; every plan the same as the request's alone and within 1e-4 of transformers' ``sample_actions``."""

from __future__ import annotations

import attrs
import torch

from ifb import LLM
from ifb.params import RequestSpec, Trajectory

from tests.helpers import submit_staggered
from tests.plugins.action.conftest import Pi0Fixture

#: batched against alone, float32: the padded forwards may round differently from a batch of one
ALONE_BOUND = 1e-5


def _specs(pi0: Pi0Fixture) -> list[RequestSpec]:
    return [RequestSpec(messages=({"role": "user", "content": case.content()[:-1]},),
                        past_trajectory=Trajectory.of([list(case.state)], case.noise_seed)) for case in pi0.cases]


def _plan(result) -> torch.Tensor:
    assert result.finish_reason == "stop" and result.output_trajectory is not None
    return torch.tensor(result.output_trajectory)


def _check(plans: list[torch.Tensor], alone: list[torch.Tensor], pi0: Pi0Fixture) -> None:
    for plan, single, ref in zip(plans, alone, pi0.reference, strict=True):
        assert (plan - single).abs().max() <= ALONE_BOUND
        assert (plan - ref["actions"]).abs().max() <= 1e-4


def test_staggered_requests_plan_what_each_plans_alone(pi0: Pi0Fixture):
    specs = _specs(pi0)
    with LLM(str(pi0.path), plugin="action") as llm:
        alone = [_plan(llm.engine.submit(spec).result()) for spec in specs]
    # small prefill chunks: a prefix arrives over several steps while the others denoise
    with LLM(str(pi0.path), plugin="action", enable_in_flight_batching=True, max_batch_size=4,
             max_num_batched_tokens=16) as llm:
        results = submit_staggered(llm.engine, specs, gap_steps=3, min_joined=len(specs) - 1)
        planner = llm.deployment.runtime.planner
        assert max(planner.denoise_batch_sizes) >= 3  # Euler steps of several requests in one forward
        assert not planner.plans and not planner.residents  # nothing left behind
    _check([_plan(r) for r in results], alone, pi0)


def test_requests_seated_together_prefill_in_one_forward(pi0: Pi0Fixture):
    from ifb.capabilities import DeployConfig
    from ifb.params import SamplingParams
    from ifb_plugins.action import load

    from tests.helpers import Seq, StepBuilder

    specs = _specs(pi0)
    with LLM(str(pi0.path), plugin="action") as llm:
        alone = [_plan(llm.engine.submit(spec).result()) for spec in specs]
    runtime = load(DeployConfig(model=str(pi0.path), plugin="action", enable_in_flight_batching=True,
                                max_batch_size=4))
    builder, params, seqs, first_block = StepBuilder(), SamplingParams(), [], 0
    for seat, spec in enumerate(specs):  # four whole prompts in one step, each in blocks of its own
        prepared = runtime.prepare(spec)
        ids = prepared.prompt_token_ids
        blocks = tuple(range(first_block, first_block + -(-len(ids) // runtime.kv_block_size)))
        first_block += len(blocks)
        seqs.append(Seq(f"r{seat}", seat, ids, 0, blocks, True, params, len(ids), ids, prepared.state))
    end = runtime.tokenizer.eos_token_ids[0]
    for step_id in range(10):
        outs = runtime.execute(builder.step(step_id, seqs)).seqs
        assert [o.token_id for o in outs] == [end if step_id == 9 else None] * 4
        seqs = [attrs.evolve(s, token_ids=s.all_token_ids[-1:], start_pos=len(s.all_token_ids) - 1) for s in seqs]
    planner = runtime.planner
    assert planner.prefill_batch_sizes == [4] and planner.denoise_batch_sizes == [4] * 10
    _check([planner.take_plan(f"r{i}") for i in range(4)], alone, pi0)


def test_a_preempted_request_starts_over_in_other_blocks_and_plans_the_same(pi0: Pi0Fixture):
    from ifb.capabilities import DeployConfig
    from ifb.params import SamplingParams
    from ifb_plugins.action import load

    from tests.helpers import Seq, StepBuilder

    runtime = load(DeployConfig(model=str(pi0.path), plugin="action"))
    spec = _specs(pi0)[1]
    prepared = runtime.prepare(spec)
    ids = prepared.prompt_token_ids
    num_blocks = -(-len(ids) // runtime.kv_block_size)
    params, builder, end = SamplingParams(), StepBuilder(), runtime.tokenizer.eos_token_ids[0]

    def run(blocks: tuple[int, ...], num_steps: int, first_id: int, reset: bool) -> list:
        outs = []
        for i in range(num_steps):
            tokens, start = (ids, 0) if i == 0 else (ids[-1:], len(ids) - 1)
            step = builder.step(first_id + i, [Seq("r", 0, tokens, start, blocks, True, params, len(ids), ids,
                                                   prepared.state)], reset_seats=(0,) if reset and i == 0 else ())
            outs.append(runtime.execute(step).seqs[0].token_id)
        return outs

    # scattered blocks, three Euler steps, then preempted; seated again in other blocks, it runs to the end
    assert run(tuple(range(200, 200 - 3 * num_blocks, -3)), 3, 0, reset=False) == [None] * 3
    runtime.release("r", 0)
    outs = run(tuple(range(50, 50 + 2 * num_blocks, 2)), 10, 3, reset=True)
    assert outs == [None] * 9 + [end]
    plan = runtime.planner.take_plan("r")
    assert (plan - pi0.reference[1]["actions"]).abs().max() <= 1e-4
    with LLM(str(pi0.path), plugin="action") as llm:
        alone = _plan(llm.engine.submit(spec).result())
    assert torch.equal(plan, alone)  # one request alone, whatever its blocks: bit for bit
