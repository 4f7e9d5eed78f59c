"""Sliding-window layers keep only their window of KV (``ifb.kv``'s window groups), on the tiny random
Gemma 4 and gpt-oss models transformers builds (16-token windows, 16-token blocks).

Contexts here run to several windows: the sliding layers' blocks are freed as the window passes and reused
by other positions and requests, so any read of a freed block would show in the tokens.
"""

from __future__ import annotations

import collections
import math
from pathlib import Path

import pytest
import torch

from ifb import LLM
from ifb.kv import BlockManager, WindowGroup, WindowTable
from ifb.params import RequestSpec, SamplingParams
from ifb_plugins.common.layers.attention import GroupedAttn, build_attn_metadata
from ifb_plugins.context_cache.cache import chain_hash
from ifb_plugins.text.families import build_family_model
from tests.helpers import submit_staggered
from tests.models.gemma4 import save_tiny_gemma4
from tests.models.gpt_oss import save_tiny_gpt_oss
from tests.models.hybrid import hf_greedy, hf_reference

WINDOW = BLOCK = 16
CHUNK = 8  # the token budget: prefill chunks of 8, so a sequence holds ceil((16 - 1 + 8) / 16) + 1 = 3 blocks
MAX_WINDOW_BLOCKS = 3
NUM_TOKENS = 48
PROMPTS = [
    [(7 * i) % 290 + 5 for i in range(70)],  # with its 48 tokens, 118 positions: over seven windows
    [(11 * i) % 280 + 9 for i in range(37)],
    [17, 4, 260],
    [200, 3, 150, 75, 12, 8, 290, 31, 44],
]
SAVERS = {"gemma4": save_tiny_gemma4, "gpt_oss": save_tiny_gpt_oss}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=sorted(SAVERS))
def model_dir(request, tmp_path_factory) -> Path:
    return SAVERS[request.param](tmp_path_factory.mktemp(request.param), seed=2)


@pytest.fixture(scope="module")
def reference(model_dir):
    return hf_reference(model_dir)


def count_blocks(llm, monkeypatch) -> dict[str, list[tuple[int, int]]]:
    """Per request, at each step it is in: its blocks in the full pool and in the window group (the engine's
    own tables, as the step was granted them)."""
    runtime, scheduler = llm.deployment.runtime, llm.engine.scheduler
    seen: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    execute = runtime.execute

    def recording(step):
        for seq in step.seqs:
            r = scheduler.requests[seq.request_id]
            seen[r.request_id].append((len(r.block_ids), len(r.window_tables[0].block_ids)))
        return execute(step)

    monkeypatch.setattr(runtime, "execute", recording)
    return seen


def test_chunked_prefill_over_a_sliding_pool_matches_transformers(model_dir, reference):
    """The model alone, fed in chunks of 7 with the engine's own window group: the sliding layers' pool has
    just the 3 blocks a sequence can hold and the null block, so every block is rewritten with later
    positions after the window passes; every chunk's logits equal transformers' (1e-4)."""
    model, _ = build_family_model(model_dir)
    ids = PROMPTS[0]
    group = WindowGroup(WINDOW, BlockManager(MAX_WINDOW_BLOCKS, BLOCK))
    chunk = CHUNK - 1  # chunks that straddle blocks: a sequence then holds all 3
    assert group.max_blocks_per_seq(chunk) == MAX_WINDOW_BLOCKS
    caches = model.allocate_kv_caches(8, BLOCK, torch.float32, "cpu", num_window_blocks=MAX_WINDOW_BLOCKS)
    full, table, null = list(range(8)), WindowTable(), MAX_WINDOW_BLOCKS
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0]
        for start in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - start)
            group.slide(table, start)
            group.grow(table, math.ceil((start + n) / BLOCK) - table.num_entries)
            window_table = [null] * table.num_freed + table.block_ids
            attn = GroupedAttn(build_attn_metadata([(start, n, full)], BLOCK),
                               ((WINDOW, build_attn_metadata([(start, n, window_table)], BLOCK)),))
            hidden = model(torch.tensor(ids[start:start + n]), torch.arange(start, start + n), attn, caches)
            torch.testing.assert_close(model.compute_logits(hidden), ref[start:start + n], atol=1e-4, rtol=0)
    assert table.num_freed == 3 and len(table.block_ids) == 2  # 70 positions: blocks 3 and 4 are in the window
    assert len(group.blocks.ref_counts) == 3  # 5 blocks of context went through a pool of 3
    assert group.blocks.max_num_in_use == MAX_WINDOW_BLOCKS


def test_long_contexts_equal_generate_batched_equals_alone_and_the_window_pool_stays_bounded(model_dir, reference,
                                                                                             monkeypatch):
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    specs = [RequestSpec(prompt_token_ids=tuple(ids), params=params) for ids in PROMPTS]
    with LLM(model=str(model_dir), plugin="text", max_num_batched_tokens=CHUNK) as llm:
        alone_counts = count_blocks(llm, monkeypatch)
        alone = [llm.engine.submit(spec).result().token_ids for spec in specs]
    with LLM(model=str(model_dir), plugin="text", enable_in_flight_batching=True, max_batch_size=4,
             max_num_batched_tokens=CHUNK) as llm:
        engine = llm.engine
        (group,) = engine.blocks.window_groups
        assert group.window == WINDOW and group.max_blocks_per_seq(CHUNK) == MAX_WINDOW_BLOCKS
        counts = count_blocks(llm, monkeypatch)
        batched = [r.token_ids for r in submit_staggered(engine, specs, gap_steps=3, min_joined=2)]
        health = llm.health()
        engine.blocks.check_no_leaks()  # every group's blocks came back
    assert batched == alone
    for ids, tokens in zip(PROMPTS, alone):
        assert list(tokens) == hf_greedy(reference, ids, NUM_TOKENS)
    for seen in (alone_counts, counts):
        longest = max(seen.values(), key=len)
        # 118 positions: the full table grows to 8 blocks, the window table never holds more than 3
        assert max(f for f, _ in longest) == math.ceil((len(PROMPTS[0]) + NUM_TOKENS - 1) / BLOCK) == 8
        assert all(w <= MAX_WINDOW_BLOCKS for steps in seen.values() for _, w in steps)
        # a decode step's window (positions p - 15 .. p) lies in one block or two
        assert {w for _, w in longest[-NUM_TOKENS + 1:]} == {1, 2}
    kv = health["kv_cache"]
    (window_pool,) = kv["window_groups"]
    assert window_pool["window"] == WINDOW and window_pool["blocks_in_use"] == 0
    # four residents at once: the window pool held at most 3 blocks each, the full pool their whole contexts
    assert window_pool["max_blocks_in_use"] <= 4 * MAX_WINDOW_BLOCKS < kv["max_blocks_in_use"]
    assert kv["max_blocks_in_use"] >= 8 + 4


def test_the_pool_admits_a_long_context_by_the_full_layers_plus_the_window(model_dir):
    """The window pool is sized for every seat's window and one step, never for the context: with a pool of
    1024 tokens a context of 1000 needs 63 full blocks and at most 3 window blocks."""
    with LLM(model=str(model_dir), plugin="text", enable_in_flight_batching=True, max_batch_size=2,
             max_num_batched_tokens=CHUNK, max_kv_cache_capacity=1024) as llm:
        runtime, blocks = llm.engine.runtime, llm.engine.blocks
        (spec,) = runtime.kv_window_groups
        assert blocks.num_blocks == 64 and spec.num_blocks == blocks.window_groups[0].blocks.num_blocks
        assert spec.num_blocks < 16  # 2 seats x (ceil(17 / 16) + 2) + the step's block, and the watermark
        sliding = [i for i, w in enumerate(runtime.layer_windows) if w is not None and runtime.kv_caches[i]]
        assert runtime.kv_caches[sliding[0]][0].shape[0] == spec.num_blocks + 1  # and the null block
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        out = llm.engine.submit(RequestSpec(prompt_token_ids=tuple((i * 13) % 280 + 5 for i in range(1000)),
                                            params=params)).result()
        assert len(out.token_ids) == 4 and llm.health()["kv_cache"]["max_blocks_in_use"] == 63


def test_prefix_reuse_is_limited_to_what_every_group_still_holds(model_dir):
    """A long first request cycles the small window pool, whose freed prefix blocks are evicted for later
    positions: the second request's prefix is all in the full pool's cache but not in the window group's, so
    it hits nothing; the third, after the second recomputed and published it, hits the 64 tokens."""
    prefix = [(5 * i) % 270 + 11 for i in range(70)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = RequestSpec(prompt_token_ids=tuple(prefix + [1]), params=SamplingParams(
        max_tokens=120, temperature=0.0, ignore_eos=True))
    later = [RequestSpec(prompt_token_ids=tuple(prefix + tail), params=params) for tail in ([7, 3], [250])]
    settings = dict(plugin="text", enable_in_flight_batching=True, max_batch_size=1, max_num_batched_tokens=CHUNK,
                    max_kv_cache_capacity=320)
    with LLM(model=str(model_dir), **settings) as llm:
        plain = [llm.engine.submit(spec).result().token_ids for spec in [first, *later]]
    with LLM(model=str(model_dir), enable_context_reuse=True, **settings) as llm:
        engine = llm.engine
        (group,) = engine.blocks.window_groups
        assert group.blocks.num_blocks < 12  # the first request's 12 blocks cannot all stay
        reused = [engine.submit(first).result().token_ids]
        hits = [engine.counters.prefix_cache_hits]
        keys, parent = [], b""
        for i in range(4):
            parent = chain_hash(parent, tuple(prefix[i * BLOCK:(i + 1) * BLOCK]), b"")
            keys.append(parent)
        (window_blocks,) = engine.prefix.windows
        # the full pool still has the prefix's four blocks; the window group has lost them to later positions
        assert all(k in engine.prefix.table for k in keys) and not any(k in window_blocks.table for k in keys)
        for spec in later:
            reused.append(engine.submit(spec).result().token_ids)
            hits.append(engine.counters.prefix_cache_hits)
    assert reused == plain
    assert hits == [0, 0, 64]


def test_n_sequences_fork_their_window_tables(model_dir, reference, monkeypatch):
    """n > 1 under in-flight batching: the followers lease the leader's window table (its first block already
    freed) and copy its partial block in the window group too; greedy, every sequence is the reference's."""
    ids = PROMPTS[1]  # 36 shared tokens, computed in chunks of 8: the fork comes with one block freed
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, n=3)
    with LLM(model=str(model_dir), plugin="text", enable_in_flight_batching=True, max_batch_size=4,
             max_num_batched_tokens=CHUNK) as llm:
        runtime, steps = llm.deployment.runtime, []
        execute = runtime.execute

        def recording(step):
            steps.append(step)
            return execute(step)

        monkeypatch.setattr(runtime, "execute", recording)
        outputs = list(llm.engine.submit(RequestSpec(prompt_token_ids=tuple(ids), params=params), wait=True))
        llm.engine.blocks.check_no_leaks()
    (fork,) = [s for s in steps if s.block_copies]
    (window_copies,) = fork.window_block_copies
    assert len(fork.block_copies) == len(window_copies) == 2
    followers = [s for s in fork.seqs if not s.request_id.endswith("-0")]
    assert [f.window_blocks[0].num_freed for f in followers] == [1, 1]
    assert all(f.window_blocks[0].new_block_ids[-1] in {dst for _, dst in window_copies} for f in followers)
    tokens = collections.defaultdict(list)
    for o in outputs:
        tokens[o.index] += list(o.token_ids)
    want = hf_greedy(reference, ids, 24)
    assert sorted(tokens) == [0, 1, 2] and all(tokens[i] == want for i in range(3))


def test_preemption_under_a_small_pool_recomputes_the_same_tokens(model_dir, reference):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    specs = [RequestSpec(prompt_token_ids=tuple(ids), params=params) for ids in PROMPTS[:3]]
    with LLM(model=str(model_dir), plugin="text", enable_in_flight_batching=True, max_batch_size=3,
             max_num_batched_tokens=CHUNK, max_kv_cache_capacity=160) as llm:
        results = [r.token_ids for r in submit_staggered(llm.engine, specs, gap_steps=2)]
        assert llm.health()["scheduling"]["preempted"] > 0
        llm.engine.blocks.check_no_leaks()
    for ids, tokens in zip(PROMPTS, results):
        assert list(tokens) == hf_greedy(reference, ids, 40)


def test_a_uniform_sliding_window_caps_the_context_at_the_window(tmp_path):
    """A Llama-family checkpoint with one ``sliding_window`` for every layer (Mistral 7B v0.1's) attends over
    the whole context, which equals its windowed attention up to the window: its context stops there, and
    its KV is one group, nothing freed. Within the window its tokens are transformers'."""
    import transformers

    from tests.models.text import save_tiny_tokenizer

    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=WINDOW, max_position_embeddings=512, bos_token_id=0,
        eos_token_id=2)).float().eval()
    hf.save_pretrained(str(tmp_path))
    save_tiny_tokenizer(tmp_path)
    ids = [17, 4, 260, 101, 102, 9]
    with LLM(model=str(tmp_path), plugin="text", enable_in_flight_batching=True, max_batch_size=2) as llm:
        assert llm.engine.runtime.max_model_len == WINDOW and llm.engine.blocks.window_groups == ()
        out = llm.engine.submit(RequestSpec(prompt_token_ids=tuple(ids), params=SamplingParams(
            max_tokens=WINDOW - len(ids), temperature=0.0, ignore_eos=True))).result()
    assert list(out.token_ids) == hf_greedy(hf, ids, WINDOW - len(ids))


def test_a_large_full_pool_s_watermark_does_not_stall_joins_on_the_window_pool(model_dir):
    """The admission watermark is 1 % of the full pool (62 blocks of 6250 here), more than the whole window
    pool: the window group keeps a reserve of its own size, so requests still join mid-flight."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    specs = [RequestSpec(prompt_token_ids=tuple(ids), params=params) for ids in PROMPTS[1:]]
    with LLM(model=str(model_dir), plugin="text", enable_in_flight_batching=True, max_batch_size=2,
             max_num_batched_tokens=CHUNK, max_kv_cache_capacity=100_000) as llm:
        assert llm.engine.scheduler.watermark == 62 > llm.engine.blocks.window_groups[0].blocks.num_blocks
        results = submit_staggered(llm.engine, specs, gap_steps=2, min_joined=1)
    assert all(len(r.token_ids) == 12 for r in results)
