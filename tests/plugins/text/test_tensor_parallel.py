"""Tensor parallelism on two gloo ranks (``LLM(tensor_parallel_size=2)``): the sharded model's logits
and greedy output are the one-rank model's, under in-flight batching (staggered arrivals, mid-flight
joins, preemption, the context cache across ranks) and on the blocking path."""

from __future__ import annotations

import gguf
import pytest
import torch

from ifb import LLM, SamplingParams
from ifb.params import RequestSpec
from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.common.quant.linear import BlockLinear
from ifb_plugins.common.models.tensor_parallel import check_shardable
from tests.models.moe import save_tiny_moe
from tests.models.text import save_tiny_gguf, save_tiny_llama
from tests.native import needs_kernels
from tests.plugins.common.test_kquants import quantize_k

Q = gguf.GGMLQuantizationType

PROMPTS = [list(range(5 + 3 * i, 5 + 3 * i + n)) for i, n in enumerate([9, 14, 6, 11])]
PARAMS = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)
#: a pool too small for the four answers: the youngest residents are preempted and recomputed
TIGHT = dict(enable_in_flight_batching=True, max_batch_size=4, max_num_batched_tokens=16, max_kv_cache_capacity=80)
#: room for every answer: the later two join while the first two decode
ROOMY = dict(TIGHT, max_kv_cache_capacity=256)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # biases on every projection: the row-parallel layers add theirs once, after the all-reduce
    return save_tiny_llama(tmp_path_factory.mktemp("llama"), seed=3, bias=True)


def staggered(llm: LLM, prompts=PROMPTS) -> list:
    """The prompts submitted two at a time, the later two once the first answer is streaming."""
    handles = [llm.engine.submit(RequestSpec(prompt_token_ids=tuple(p), params=PARAMS)) for p in prompts[:2]]
    first = iter(handles[0])
    head = [next(first)]
    handles += [llm.engine.submit(RequestSpec(prompt_token_ids=tuple(p), params=PARAMS)) for p in prompts[2:]]
    results = [head + list(first)] + [list(h) for h in handles[1:]]
    return [([t for o in outs for t in o.token_ids], [lp.logprob for o in outs for lp in o.logprobs])
            for outs in results]


@pytest.fixture(scope="module")
def one_rank(checkpoint, adapters):
    with LLM(str(checkpoint), lora_adapters=adapters, **TIGHT) as llm:
        tokens = staggered(llm)
        counts = llm.health()["scheduling"]
        return tokens, counts, adapters_and_n(llm)


def test_two_ranks_serve_the_one_rank_tokens_under_in_flight_batching(checkpoint, adapters, one_rank):
    """Joins, preemption, the context cache, three LoRA adapters and the base in one batch, and n = 2:
    one group of two ranks serves them all as one rank does."""
    want, want_counts, want_lora = one_rank
    with LLM(str(checkpoint), tensor_parallel_size=2, enable_context_reuse=True, lora_adapters=adapters,
             **TIGHT) as llm:
        assert llm.deployment.caps.num_ranks == 2 and llm.engine.is_in_flight
        got = staggered(llm)
        # the same prompt again: its full blocks come from the context cache, each rank's KV share with them
        again = staggered(llm, PROMPTS[:1])
        got_lora = adapters_and_n(llm)
        health = llm.health()
        # an adapter loaded while serving would reach rank 0 only
        with pytest.raises(ValueError, match="loaded on every rank at start-up"):
            llm.deployment.runtime.lora.load("late", adapters["qv"])
    counts = health["scheduling"]
    assert counts["admitted_mid_flight"] > 0 and counts["preempted"] > 0 and want_counts["preempted"] > 0
    assert counts["completed"] == len(PROMPTS) + 1 + 5 and counts["failed"] == 0
    assert health["prefix_cache"]["hits"] > 0
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    assert again[0][0] == want[0][0]
    for (_, lp), (_, want_lp) in zip(got, want):
        assert lp == pytest.approx(want_lp, abs=1e-5)
    # every adapter's rows (O and down row-parallel among them) and both sampled sequences of the n = 2 request
    assert got_lora == want_lora
    assert want_lora[(4, 0)] != want_lora[(4, 1)]
    # each adapter changes its prompt's answer; the base row in the same batch is the base answer
    assert [want_lora[(i, 0)] == want[i][0][:12] for i in range(4)] == [False, False, True, False]


def test_a_mixture_of_experts_on_two_ranks_on_the_blocking_path(tmp_path):
    # experts replicated on every rank, attention sharded; requests one at a time on two ranks
    directory = save_tiny_moe(tmp_path / "moe", "qwen3_moe", seed=5)
    with LLM(str(directory), enable_in_flight_batching=True) as llm:
        handles = [llm.engine.submit(RequestSpec(prompt_token_ids=tuple(p), params=PARAMS)) for p in PROMPTS[:3]]
        want = [list(h.result().token_ids) for h in handles]
    with LLM(str(directory), tensor_parallel_size=2) as llm:
        assert not llm.engine.is_in_flight and llm.deployment.caps.num_ranks == 2
        handles = [llm.engine.submit(RequestSpec(prompt_token_ids=tuple(p), params=PARAMS)) for p in PROMPTS[:3]]
        assert [list(h.result().token_ids) for h in handles] == want


def test_heads_that_do_not_divide_are_refused_naming_the_numbers():
    config = TextModelConfig(arch="llama", vocab_size=320, hidden_size=576, intermediate_size=1536, num_layers=2,
                             num_heads=9, num_kv_heads=3, head_dim=64)
    check_shardable(config, 3)
    with pytest.raises(ValueError, match="divisible by 2: this model has 9 attention heads, 3 KV heads"):
        check_shardable(config, 2)


#: a Q4_K_M-style mix (K-quants, Q8_0, Q5_0) whose row-parallel splits fall on whole blocks: O (256
#: input features, 128 a rank) in 32-weight blocks, down (512, 256 a rank) in K-quant super-blocks of 256
TP_MIX = {
    "token_embd.weight": Q.Q6_K,
    "blk.0.attn_q.weight": Q.Q4_K, "blk.0.attn_k.weight": Q.Q4_K, "blk.0.attn_v.weight": Q.Q6_K,
    "blk.0.attn_output.weight": Q.Q8_0, "blk.0.ffn_gate.weight": Q.Q4_K, "blk.0.ffn_up.weight": Q.Q4_K,
    "blk.0.ffn_down.weight": Q.Q6_K,
    "blk.1.attn_q.weight": Q.Q8_0, "blk.1.attn_k.weight": Q.Q8_0, "blk.1.attn_v.weight": Q.Q8_0,
    "blk.1.attn_output.weight": Q.Q5_0, "blk.1.ffn_gate.weight": Q.Q5_K, "blk.1.ffn_up.weight": Q.Q5_K,
    "blk.1.ffn_down.weight": Q.Q4_K,
}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-gguf")
    hf = save_tiny_llama(root / "hf", seed=11, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                         tie_word_embeddings=True)
    return save_tiny_gguf(hf, root / "mixed.gguf", tensor_types=TP_MIX, quantize=quantize_k)


@needs_kernels
def test_a_gguf_on_its_blocks_on_two_ranks_serves_the_one_rank_tokens(mixed_gguf):
    with LLM(str(mixed_gguf), **ROOMY) as llm:
        want = staggered(llm)
    with LLM(str(mixed_gguf), tensor_parallel_size=2, **ROOMY) as llm:
        first = llm.deployment.runtime.model.model.layers[0]  # rank 0's shard, on its blocks
        assert isinstance(first.self_attn.o_proj, BlockLinear) and first.self_attn.o_proj.in_features == 128
        assert first.mlp.gate_up_proj.out_features == 512 and first.self_attn.v_proj.qtype == Q.Q6_K
        got = staggered(llm)
        counts = llm.health()["scheduling"]
    assert counts["admitted_mid_flight"] > 0 and counts["failed"] == 0
    # Not bit-identical: each column-parallel output (Q, K, V, gate, up, the head) is the one-rank
    # column's bits, and each rank quantizes its row-parallel input per 32-block exactly as one rank
    # does (the split falls on whole blocks), but O's and down's sums run as two partial chains added
    # by the all-reduce instead of one chain: float32 rounding, a few units in the last place, which
    # can move a later activation code by one step. The greedy tokens are the one-rank tokens.
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, lp), (_, want_lp) in zip(got, want):
        assert lp == pytest.approx(want_lp, abs=1e-3)


def test_a_row_parallel_split_that_would_cut_a_super_block_is_refused_naming_the_numbers(mixed_gguf, tmp_path):
    from ifb_plugins.common.loading.gguf import read_gguf_tensors
    from ifb_plugins.common.loading.checkpoint import load_checkpoint
    from ifb_plugins.common.models.tensor_parallel import ShardPlan

    hf = mixed_gguf.parent / "hf"
    path = save_tiny_gguf(hf, tmp_path / "cut.gguf", tensor_types={**TP_MIX, "blk.0.attn_output.weight": Q.Q4_K},
                          quantize=quantize_k)
    config, tensors = load_checkpoint(mixed_gguf).config, read_gguf_tensors(path)
    plan = ShardPlan(config, 1, 2)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight \(Q4_K, 256 input features\) "
                                         r"into shares of 128 input features, which would cut its blocks of 256"):
        plan.shard_gguf(tensors)
    cut = ShardPlan(config, 1, 2).shard_gguf(read_gguf_tensors(mixed_gguf))
    down = cut["model.layers.0.mlp.down_proj.weight"]  # Q6_K: one super-block of 256 of each row's 512
    assert down.shape == (256, 256) and down.data.shape[1] == gguf.GGML_QUANT_SIZES[Q.Q6_K][1]


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """Three adapters made and saved by ``peft`` on the biased checkpoint (random ``lora_B``, so each changes
    the output): on column-parallel Q/V, on every attention projection (O row-parallel), on the MLP (down)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tp-adapters")
    made = {}
    for i, (name, targets) in enumerate({"qv": ["q_proj", "v_proj"], "attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
                                         "mlp": ["gate_proj", "up_proj", "down_proj"]}.items()):
        base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        g = torch.Generator().manual_seed(200 + i)
        with torch.no_grad():
            for key, param in model.named_parameters():
                if "lora_" in key:
                    param.copy_(torch.randn(param.shape, generator=g) * 0.3)
        model.save_pretrained(root / name)
        made[name] = str(root / name)
    return made


def adapters_and_n(llm: LLM) -> dict:
    """Three adapters and the base in one batch, and an n = 2 sampled request, staggered: each output by
    request and sequence index."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    specs = [RequestSpec(prompt_token_ids=tuple(p), params=greedy, extras={"lora": name} if name else {})
             for p, name in zip(PROMPTS, ["qv", "attn", None, "mlp"])]
    specs.append(RequestSpec(prompt_token_ids=tuple(range(40, 61)),
                             params=SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=12, ignore_eos=True)))
    handles = [llm.engine.submit(s) for s in specs[:2]]
    first = iter(handles[0])
    head = [next(first)]
    handles += [llm.engine.submit(s) for s in specs[2:]]
    out: dict = {}
    for i, outputs in enumerate([[*head, *first]] + [list(h) for h in handles[1:]]):
        for o in outputs:
            out.setdefault((i, o.index), []).extend(o.token_ids)
    return out



def test_a_model_whose_heads_do_not_divide_is_refused_at_load_naming_the_numbers(tmp_path):
    from ifb.parallel import ParallelContext
    from ifb_plugins.common.loading.checkpoint import load_checkpoint
    from ifb_plugins.common.models.parts import ModelParts
    from ifb_plugins.common.models.tensor_parallel import build_sharded_model

    # refused before any weight is cut or any rank is met
    loaded = load_checkpoint(save_tiny_llama(tmp_path / "odd", num_heads=3, num_kv_heads=3, hidden_size=48))
    with pytest.raises(ValueError, match="divisible by 2: this model has 3 attention heads, 3 KV heads"):
        build_sharded_model(loaded.config, loaded.state_dict, {}, ParallelContext(rank=1, world_size=2),
                            lambda *_: ModelParts())
