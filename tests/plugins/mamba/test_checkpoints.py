"""Recurrent-state checkpoints: captured exactly at their positions, restored exactly, sized against the capacity."""

from __future__ import annotations

import attrs
import pytest
import torch

from ifb.capabilities import DeployConfig
from ifb.params import SamplingParams
from tests.helpers import Seq, StepBuilder
from ifb_plugins.mamba import load
from ifb_plugins.mamba.checkpoints import StateCheckpoints, plan_capacity, state_bytes
from ifb_plugins.mamba.config import HybridConfig

GREEDY = SamplingParams(temperature=0.0)
#: steps as the scheduler sends them: a request in a reset seat arrives new
STEPS = StepBuilder()
PROMPT = tuple((11 * i + 5) % 290 + 3 for i in range(45))


@pytest.fixture(scope="module")
def runtime(hybrid_dir):
    return load(DeployConfig(model=str(hybrid_dir), plugin="mamba", max_batch_size=2, enable_in_flight_batching=True,
                             enable_context_reuse=True, options={"hybrid_checkpoint_interval": 16}))


def seq(rid: str, seat: int, start: int, n: int, blocks=(0, 1, 2)) -> Seq:
    return Seq(request_id=rid, seat=seat, token_ids=PROMPT[start:start + n], start_pos=start,
                        block_ids=blocks, is_sampling=start + n == len(PROMPT), params=GREEDY,
                        num_prompt_tokens=len(PROMPT), all_token_ids=PROMPT)


def test_a_chunk_captures_the_state_it_had_at_each_checkpoint_inside_it(runtime):
    store = runtime.state_checkpoints
    assert store.checkpoint_positions(seq("a", 0, 0, 45), len(PROMPT)) == [16, 32]  # the interval; the prompt end is 32 too
    runtime.execute(STEPS.step(1, (seq("a", 0, 0, 45),), reset_seats=(0,)))
    assert store.has_capture("a", 16) and store.has_capture("a", 32) and not store.has_capture("a", 45)
    store.save("a", 16, 0)
    store.save("a", 32, 1)
    for slot, n in ((0, 16), (1, 32)):  # the same prompt prefilled to exactly n tokens on the other seat
        runtime.execute(STEPS.step(2, (seq("b", 1, 0, n, blocks=(3, 4, 5)),), reset_seats=(1,)))
        conv, ssm = runtime.seat_state(1)
        for layer in range(len(conv)):
            assert torch.equal(store.conv[layer][slot], conv[layer])
            assert torch.equal(store.ssm[layer][slot], ssm[layer])


def test_a_prompt_that_fills_its_last_block_keeps_the_boundary_before_it_too(runtime):
    full = Seq(request_id="r", seat=0, token_ids=PROMPT[:40] + (7,) * 8, start_pos=0, block_ids=(0, 1, 2),
                        is_sampling=True, params=GREEDY, num_prompt_tokens=48, all_token_ids=PROMPT[:40] + (7,) * 8)
    store = StateCheckpoints(runtime.model.config, num_slots=1, interval=64, block_size=16)
    # 48: prompts that extend this one; 32: this prompt again (a match leaves its last token to compute)
    assert store.checkpoint_positions(full, full.num_prompt_tokens) == [32, 48]
    assert store.checkpoint_positions(full, 45) == [32]


def test_a_restored_seat_continues_exactly_as_if_it_had_computed_the_prefix(runtime):
    store = runtime.state_checkpoints
    full = runtime.execute(STEPS.step(3, (seq("a", 0, 0, 45),), reset_seats=(0,)))
    store.save("a", 32, 1)
    # seat 1 starts at token 32 from the checkpoint, over the first request's KV blocks 0 and 1
    store.stage_restore("b", 32, 1)
    resumed = runtime.execute(STEPS.step(4, (seq("b", 1, 32, 13, blocks=(0, 1, 6)),), reset_seats=(1,)))
    assert not store.pending_restores
    assert resumed.seqs[0].token_id == full.seqs[0].token_id
    assert all(torch.equal(a, b) for a, b in zip(runtime.seat_state(0)[1], runtime.seat_state(1)[1]))
    with pytest.raises(ValueError, match="resumes at token 30, but its state checkpoint is at token 32"):
        store.stage_restore("c", 32, 1)
        runtime.execute(STEPS.step(5, (seq("c", 1, 30, 15, blocks=(0, 1, 6)),), reset_seats=(1,)))


def test_slots_come_out_of_the_capacity():
    tiny = HybridConfig.from_hf_config({"model_type": "nemotron_h", "vocab_size": 100, "hidden_size": 64,
                                        "hybrid_override_pattern": "M*M-", "num_attention_heads": 4,
                                        "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 8,
                                        "mamba_head_dim": 8, "ssm_state_size": 16, "n_groups": 2})
    plan = plan_capacity(tiny, 4096, 16, 256, num_seats=4)
    assert plan.num_kv_blocks + plan.num_state_slots * plan.blocks_per_slot == 4096 // 16
    assert plan.num_state_slots == 4096 // 256 + 4
    assert plan.blocks_per_slot * 16 * 2 * 2 * 16 * 4 >= state_bytes(tiny)
    # Nemotron-H sized (transformers' defaults: 128 SSM heads of 64 x 128; 12 Mamba layers here): ~52 MB a checkpoint,
    # 99 KV blocks' worth; half of 1024 tokens (64 blocks) holds none, 8192 tokens hold two.
    real = HybridConfig.from_hf_config({"model_type": "nemotron_h", "vocab_size": 131072, "hidden_size": 4096,
                                        "hybrid_override_pattern": "M-M-M*-" * 4})
    with pytest.raises(ValueError, match="cannot hold a recurrent-state checkpoint"):
        plan_capacity(real, 1024, 16, 256, num_seats=4)
    assert plan_capacity(real, 8192, 16, 256, num_seats=4).num_state_slots == 2
    grown = plan_capacity(real, 1024, 16, 256, num_seats=4, may_grow=True)
    assert grown.blocks_per_slot == 99 and grown.num_state_slots == 5 and grown.num_kv_blocks >= 1024 // 16
