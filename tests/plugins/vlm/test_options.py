"""Request options in a running batch on a multimodal model: n > 1 over an image prompt, LoRA adapters on the
decoder (against PEFT's PeftModel over transformers' LLaVA), and the system-prompt capture through the context
cache, each with mid-flight joins."""

from __future__ import annotations

import time

import attrs
import pytest
import torch
import transformers

from ifb import LLM, SamplingParams
from ifb.params import RequestSpec
from ifb_plugins.common.runtime.lora import AdapterError
from tests.helpers import submit_staggered
from tests.models.media import image_part, png_bytes
from tests.plugins.vlm.compare import (
    GREEDY, alone, hf_content, openai_content, pil, reference_greedy, reference_inputs, trace,
)

SEEDED = SamplingParams(temperature=1.0, top_k=40, seed=7, max_tokens=8, ignore_eos=True)
#: adapters on the language model only (the tower's projections share their names), made by PEFT on LLaVA
ADAPTERS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)"),
    "mlp": dict(r=2, lora_alpha=4, target_modules=r".*language_model.*\.(gate_proj|up_proj|down_proj)"),
}
SYSTEM = {"role": "system", "content": "You look at pictures and answer in one short sentence only. " * 3}


def image_chat(seed: int, text: str = "What is in this picture?", params=GREEDY, system=None, **extras) -> RequestSpec:
    user = {"role": "user", "content": [{"type": "text", "text": text}, image_part(png_bytes(seed))]}
    return RequestSpec(messages=(*([system] if system else []), user), params=params, extras=extras)


def text_chat(text: str, params=GREEDY, **extras) -> RequestSpec:
    return RequestSpec(messages=({"role": "user", "content": [{"type": "text", "text": text}]},), params=params,
                       extras=extras)


def hf_llava(checkpoint):
    return transformers.LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(vlm_checkpoint, tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("vlm-adapters")
    out = {}
    for i, (name, cfg) in enumerate({**ADAPTERS, "tower": dict(r=2, target_modules=r".*vision_tower.*\.q_proj")}.items()):
        model = get_peft_model(hf_llava(vlm_checkpoint), LoraConfig(**cfg))
        g = torch.Generator().manual_seed(200 + i)
        with torch.no_grad():
            for key, param in model.named_parameters():
                if "lora_A" in key or "lora_B" in key:  # PEFT starts B at zero: every adapter must change the output
                    param.copy_(torch.randn(param.shape, generator=g) * 0.3)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def llm(vlm_checkpoint, adapters):
    # a 16-token budget spreads every image over prefill chunks
    model = LLM(str(vlm_checkpoint), plugin="vlm", enable_in_flight_batching=True, max_batch_size=8,
                max_num_batched_tokens=16, lora_adapters={n: str(adapters[n]) for n in ADAPTERS})
    yield model
    model.close()


def choices(outputs, n):
    out = {i: () for i in range(n)}
    for o in outputs:
        out[o.index] += tuple(o.token_ids)
    return [out[i] for i in range(n)]


def test_n_over_an_image_prompt_shares_its_prefill_and_equals_seeded_singles(llm):
    runtime, engine = llm.deployment.runtime, llm.engine
    expected = [alone(llm, image_chat(1, params=attrs.evolve(SEEDED, seed=SEEDED.seed + i))).token_ids
                for i in range(3)]
    assert len(set(expected)) == 3
    target = image_chat(1, params=attrs.evolve(SEEDED, n=3))
    mates = [text_chat("Tell me a long story about a paged KV cache.",
                       SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)), image_chat(2)]
    mates_alone = [alone(llm, m).token_ids for m in mates]
    num_prompt = [len(runtime.prepare(s).prompt_token_ids) for s in (target, *mates)]
    before = engine.counters.snapshot()
    computed = engine.counters.computed_prompt_tokens
    handles = []
    for spec in (mates[0], target, mates[1]):  # each arrives while the one before it decodes
        handles.append(engine.submit(spec, wait=True))
        goal, deadline = engine.scheduler.num_steps + 3, time.monotonic() + 30
        while engine.scheduler.num_steps < goal and not handles[-1].done.is_set() and time.monotonic() < deadline:
            time.sleep(0.0005)
    assert choices(list(handles[1]), 3) == expected
    assert [handles[i].result().token_ids for i in (0, 2)] == mates_alone
    after = engine.counters.snapshot()
    assert after["admitted_mid_flight"] - before["admitted_mid_flight"] >= 1  # the n = 3 request joined the founder's
    # the image prompt is computed once: the leader all but its last token, then each sequence that one
    assert engine.counters.computed_prompt_tokens - computed == num_prompt[0] - 1 + 3 + sum(num_prompt[1:])
    engine.blocks.check_no_leaks()


@torch.no_grad()
def peft_greedy(checkpoint, adapter_dir, spec_parts, images):
    from peft import PeftModel

    model = PeftModel.from_pretrained(hf_llava(checkpoint), adapter_dir).eval()
    processor = transformers.AutoProcessor.from_pretrained(checkpoint)
    inputs = reference_inputs(processor, [{"role": "user", "content": hf_content(spec_parts)}], images=images or None)
    return reference_greedy(model, inputs, GREEDY.max_tokens)


def test_adapters_and_base_rows_with_images_in_one_batch_equal_each_alone_and_peft(llm, vlm_checkpoint, adapters):
    picture = [("text", "What is in this picture?"), ("image", png_bytes(1))]
    words = [("text", "Say something about caches.")]
    cases = [("attn", picture), ("mlp", words), (None, picture), ("mlp", picture), (None, words), ("attn", words)]
    specs = [RequestSpec(messages=({"role": "user", "content": openai_content(parts)},), params=GREEDY,
                         extras={"lora": name} if name else {}) for name, parts in cases]
    # a long founder under an adapter: the others join it while it decodes, however slow the machine
    founder = text_chat("Tell me a long story about a paged KV cache.",
                        SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=1), lora="mlp")
    specs = [founder, *specs]
    solo = [trace(alone(llm, s)) for s in specs]
    steps = []
    runtime = llm.deployment.runtime
    execute = runtime.execute

    def recording(step):
        steps.append(len(step.seqs))
        return execute(step)

    runtime.execute = recording
    try:
        batched = submit_staggered(llm.engine, specs, gap_steps=1, min_joined=3)
    finally:
        del runtime.execute
    assert max(steps) >= 4, "the adapters never shared a step"
    assert [trace(r) for r in batched] == solo  # bit-identical greedy tokens, logprobs within 1e-4
    solo = solo[1:]
    assert len({s.token_ids for s in solo[:3]}) == 3 and solo[1].token_ids != solo[4].token_ids
    for i in (0, 1):  # an image prompt and a text prompt, each under its adapter
        name, parts = cases[i]
        images = [pil(v) for kind, v in parts if kind == "image"]
        assert list(solo[i].token_ids) == peft_greedy(vlm_checkpoint, adapters[name], parts, images), name


def test_an_adapter_on_the_vision_tower_is_refused_naming_the_module(llm, adapters):
    with pytest.raises(AdapterError, match=r"targets model\.vision_tower\..*q_proj, outside the language model"):
        llm.deployment.runtime.lora.load("tower", adapters["tower"])


def test_a_captured_system_prompt_serves_later_image_requests(vlm_checkpoint):
    with LLM(str(vlm_checkpoint), plugin="vlm", enable_in_flight_batching=True, max_batch_size=4,
             max_num_batched_tokens=16, enable_context_reuse=True, max_kv_cache_capacity=16 * 24) as llm:
        engine, runtime = llm.engine, llm.deployment.runtime
        first = image_chat(3, system=SYSTEM, save_system_prompt_kv_cache=True)
        prepared = runtime.prepare(first)
        image_row = int(prepared.state.media.embeds[0][0][0])
        assert 32 <= prepared.num_pinned_tokens < image_row  # the system prompt, before the image
        pinned = prepared.num_pinned_tokens - prepared.num_pinned_tokens % 16
        long_text = text_chat("Tell me a long story.", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        submit_staggered(engine, [long_text, first], gap_steps=2)  # the capture joins a running batch
        assert len(engine.prefix.pinned) == pinned // 16
        for i in range(6):  # other prompts fill the cache and push everything unpinned out
            alone(llm, RequestSpec(prompt_token_ids=tuple(range(40 + i, 100 + i)), params=GREEDY))
        assert engine.counters.prefix_cache_evictions > 0
        second = image_chat(4, "Describe it.", system=SYSTEM)  # another image after the same system prompt
        num_prompt = len(runtime.prepare(second).prompt_token_ids)
        computed = engine.counters.computed_prompt_tokens
        out = alone(llm, second)
        # it computes only its own tokens past the captured blocks
        assert engine.counters.computed_prompt_tokens - computed == num_prompt - pinned
    with LLM(str(vlm_checkpoint), plugin="vlm") as reference:
        assert trace(out) == trace(alone(reference, second))
