"""The text runtime under the engine, on tiny random-weight checkpoints loaded through the real loader."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from ifb import LLM, SamplingParams
from ifb.engine import RequestRejected
from ifb.params import InvalidRequest, RequestSpec
from tests.models.text import save_tiny_checkpoint

from tests.helpers import submit_staggered

PROMPTS = [list(range(3 + i, 3 + i + n)) for i, n in enumerate([5, 40, 9, 23, 2, 31, 14, 7])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=1)


@pytest.fixture(scope="module")
def llm(checkpoint):
    model = LLM(str(checkpoint), enable_in_flight_batching=True, max_batch_size=4, max_num_batched_tokens=16)
    yield model
    model.close()


def solo(llm, ids, params=GREEDY):
    return list(llm.engine.submit(RequestSpec(prompt_token_ids=tuple(ids), params=params), wait=True).result().token_ids)


def staggered(llm, specs, gap_steps=2):
    return submit_staggered(llm.engine, specs, gap_steps)


def test_batched_greedy_equals_each_prompt_alone(llm):
    alone = [solo(llm, ids) for ids in PROMPTS]
    before = llm.health()["scheduling"]["admitted_mid_flight"]
    batched = staggered(llm, [RequestSpec(prompt_token_ids=tuple(ids), params=GREEDY) for ids in PROMPTS])
    assert [list(r.token_ids) for r in batched] == alone
    assert llm.health()["scheduling"]["admitted_mid_flight"] > before


def test_seeded_sampling_is_reproducible_whatever_the_batch_mates(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    alone = solo(llm, PROMPTS[0], seeded)
    mates = [RequestSpec(prompt_token_ids=tuple(ids), params=SamplingParams(temperature=1.0, max_tokens=10))
             for ids in PROMPTS[1:4]]
    target = RequestSpec(prompt_token_ids=tuple(PROMPTS[0]), params=seeded)
    results = staggered(llm, [mates[0], mates[1], target, mates[2]], gap_steps=1)
    assert list(results[2].token_ids) == alone


def test_differing_sampling_parameters_share_a_batch(llm):
    stalls = llm.health()["scheduling"]["stalls_incompatible"]
    specs = [RequestSpec(prompt_token_ids=tuple(ids), params=SamplingParams(temperature=t, top_k=k, max_tokens=8))
             for ids, t, k in zip(PROMPTS[:4], (0.0, 0.7, 1.0, 0.3), (0, 5, 40, 0))]
    staggered(llm, specs, gap_steps=1)
    assert llm.health()["scheduling"]["stalls_incompatible"] == stalls


def test_logprobs_stop_token_ids_and_max_tokens(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
    out = llm.engine.submit(RequestSpec(prompt_token_ids=(5, 6, 7), params=params)).result()
    assert out.finish_reason == "length" and len(out.logprobs) == 6
    for lp in out.logprobs:
        assert len(lp.top_logprobs) == 3 and lp.top_logprobs[0][0] == lp.token_id  # greedy picks the top one
    stop_at = out.token_ids[2]
    stopped = llm.engine.submit(RequestSpec(prompt_token_ids=(5, 6, 7), params=SamplingParams(
        temperature=0.0, max_tokens=6, stop_token_ids=(stop_at,), ignore_eos=True))).result()
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop_at
    assert len(stopped.token_ids) == list(out.token_ids).index(stop_at) + 1


def test_requests_are_validated_at_submit(llm):
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        llm.engine.submit(RequestSpec(prompt_token_ids=(10_000,)))
    with pytest.raises(InvalidRequest, match="context"):
        llm.engine.submit(RequestSpec(prompt_token_ids=tuple([5] * 600), params=SamplingParams(max_tokens=8)))
    with pytest.raises(InvalidRequest, match="n \\(5\\) is more than the batch size \\(4\\)"):
        llm.engine.submit(RequestSpec(prompt="hi", params=SamplingParams(n=5)))
    with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'x' \\(loaded: none loaded\\)"):
        llm.engine.submit(RequestSpec(prompt="hi", extras={"lora": "x"}))
    with pytest.raises(RequestRejected, match="context cache.*--enable-context-reuse"):
        llm.engine.submit(RequestSpec(prompt="hi", extras={"save_system_prompt_kv_cache": True}))


def test_chat_streams_text(llm):
    chunks = list(llm.stream(messages=[{"role": "user", "content": "hello there"}],
                             params=SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)))
    assert chunks[-1].finished and sum(len(c.token_ids) for c in chunks) == 5


def test_threads_overlap_up_to_batch_plus_queue_then_block(checkpoint):
    llm = LLM(str(checkpoint), enable_in_flight_batching=True, max_batch_size=2, max_queued_requests=1)
    try:
        results, peak = [], []

        def call(i):
            results.append(llm.generate(f"prompt {i}", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)))

        threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            snap = llm.health()["scheduling"]
            peak.append(snap["queued"] + snap["resident"])
            time.sleep(0.002)
        assert len(results) == 6 and max(peak) <= 3
        assert llm.health()["scheduling"]["refused"] == 0
    finally:
        llm.close()


def write_lora(directory, model_dir, seed=0, rank=4):
    cfg = json.loads((model_dir / "config.json").read_text())
    h, kv = cfg["hidden_size"], cfg["num_key_value_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"])
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, out in (("q_proj", h), ("v_proj", kv)):
            stem = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, h, generator=g) * 0.5
            tensors[f"{stem}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.5
    directory.mkdir()
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"r": rank, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}))
    return directory, tensors, 8 / rank


def test_blocking_path_serves_lora_n_and_system_prompt_capture(checkpoint, tmp_path):
    adapter_dir, tensors, scale = write_lora(tmp_path / "adapter", checkpoint)
    llm = LLM(str(checkpoint), lora_adapters={"tuned": str(adapter_dir)})
    try:
        ids = tuple(PROMPTS[1])
        base = llm.engine.submit(RequestSpec(prompt_token_ids=ids, params=GREEDY)).result()
        tuned = llm.engine.submit(RequestSpec(prompt_token_ids=ids, params=GREEDY, extras={"lora": "tuned"})).result()
        assert tuned.token_ids != base.token_ids
        # the reference: the same adapter merged into the weights
        merged = LLM(str(checkpoint))
        model = merged.deployment.runtime.model
        with torch.no_grad():
            for key, a in tensors.items():
                if key.endswith("lora_A.weight"):
                    b = tensors[key.replace("lora_A", "lora_B")]
                    name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                    model.get_submodule(name).weight += scale * (b @ a)
        reference = merged.engine.submit(RequestSpec(prompt_token_ids=ids, params=GREEDY)).result()
        merged.close()
        assert tuned.token_ids == reference.token_ids
        # the adapter is gone once its request finished
        assert llm.engine.submit(RequestSpec(prompt_token_ids=ids, params=GREEDY)).result().token_ids == base.token_ids

        outs = list(llm.engine.submit(RequestSpec(prompt_token_ids=ids, params=SamplingParams(
            n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))))
        assert outs[-1].finished and {o.index for o in outs} == {0, 1, 2}
        seqs = {i: tuple(t for o in outs if o.index == i for t in o.token_ids) for i in range(3)}
        assert len(set(seqs.values())) > 1  # sequence i is seeded with seed + i

        with pytest.raises(InvalidRequest, match="unknown LoRA adapter"):
            llm.engine.submit(RequestSpec(prompt_token_ids=ids, extras={"lora": "nope"}))

        system = [{"role": "system", "content": "You are a terse assistant. " * 8}]
        first = llm.chat(system + [{"role": "user", "content": "one"}], GREEDY, save_system_prompt_kv_cache=True)
        runtime = llm.deployment.runtime
        assert llm.engine.prefix.captured
        hits = llm.engine.prefix.num_hit_tokens
        again = llm.chat(system + [{"role": "user", "content": "one"}], GREEDY)
        assert llm.engine.prefix.num_hit_tokens > hits  # reused, not recomputed
        assert again.token_ids == first.token_ids
        assert llm.health() == {"in_flight_batching": False, "max_num_seqs": 1}
    finally:
        llm.close()
