"""Request options in the Qwen3-Omni Thinker's running batch: n > 1 over an image prompt, LoRA adapters on its
decoder (against PEFT's PeftModel over transformers' Thinker) and the system-prompt capture through the context
cache, each with mid-flight joins."""

from __future__ import annotations

import copy
import time

import attrs
import pytest
import torch

from ifb import LLM, SamplingParams
from ifb.params import RequestSpec
from tests.helpers import submit_staggered

from .test_omni_audio import GREEDY
from .test_omni_image import SIZES, image_part

SEEDED = SamplingParams(temperature=1.0, top_k=40, seed=3, max_tokens=6, ignore_eos=True)
SYSTEM = {"role": "system", "content": "You are a helpful assistant who looks at images and answers briefly. " * 2}
#: (where PEFT was applied, its config): one adapter made on the Thinker, one on the whole bundle; the
#: encoders' and the Talker's projections share the decoder's names, so they are excluded
ADAPTERS = {
    "attn": ("thinker", dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             exclude_modules=r".*(audio_tower|visual).*")),
    "qv": ("bundle", dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                          exclude_modules=r".*(audio_tower|visual|talker|code2wav).*")),
}


def image_chat(seed: int, text: str = "Say hi.", params=GREEDY, system=None, **extras) -> RequestSpec:
    user = {"role": "user", "content": [image_part(seed, SIZES[0]), {"type": "text", "text": text}]}
    return RequestSpec(messages=(*([system] if system else []), user), params=params, extras=extras)


def text_chat(text: str, params=GREEDY, **extras) -> RequestSpec:
    return RequestSpec(messages=({"role": "user", "content": text},), params=params, extras=extras)


@pytest.fixture(scope="module")
def adapters(omni_reference_model, tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    _, model = omni_reference_model
    root = tmp_path_factory.mktemp("omni-adapters")
    out = {}
    for i, (name, (where, cfg)) in enumerate(ADAPTERS.items()):
        target = copy.deepcopy(model.thinker if where == "thinker" else model)  # PEFT edits the model it wraps
        peft_model = get_peft_model(target, LoraConfig(**cfg))
        g = torch.Generator().manual_seed(300 + i)
        with torch.no_grad():
            for key, param in peft_model.named_parameters():
                if "lora_A" in key or "lora_B" in key:
                    param.copy_(torch.randn(param.shape, generator=g) * 0.3)
        peft_model.save_pretrained(root / name)
        out[name] = (root / name, peft_model.eval())
    return out


@pytest.fixture(scope="module")
def llm(omni_reference_model, adapters):
    with LLM(str(omni_reference_model[0]), plugin="omni", enable_in_flight_batching=True, max_batch_size=8,
             max_num_batched_tokens=16, lora_adapters={n: str(d) for n, (d, _) in adapters.items()}) as llm:
        yield llm


def alone(llm, spec):
    return llm.engine.submit(spec, wait=True).result()


def choices(outputs, n):
    out = {i: () for i in range(n)}
    for o in outputs:
        out[o.index] += tuple(o.token_ids)
    return [out[i] for i in range(n)]


def test_n_over_an_image_prompt_shares_its_prefill_and_equals_seeded_singles(llm):
    engine, runtime = llm.engine, llm.deployment.runtime
    expected = [alone(llm, image_chat(1, params=attrs.evolve(SEEDED, seed=SEEDED.seed + i))).token_ids
                for i in range(3)]
    assert len(set(expected)) == 3
    target = image_chat(1, params=attrs.evolve(SEEDED, n=3))
    mates = [text_chat("Hello there, how are you?", SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)),
             image_chat(2, "Hello there")]
    mates_alone = [alone(llm, m).token_ids for m in mates]
    num_prompt = [len(runtime.prepare(s).prompt_token_ids) for s in (target, *mates)]
    joined, computed = engine.counters.admitted_mid_flight, engine.counters.computed_prompt_tokens
    handles = []
    for spec in (mates[0], target, mates[1]):
        handles.append(engine.submit(spec, wait=True))
        goal, deadline = engine.scheduler.num_steps + 3, time.monotonic() + 30
        while engine.scheduler.num_steps < goal and not handles[-1].done.is_set() and time.monotonic() < deadline:
            time.sleep(0.0005)
    assert choices(list(handles[1]), 3) == expected
    assert [handles[i].result().token_ids for i in (0, 2)] == mates_alone
    assert engine.counters.admitted_mid_flight - joined >= 1  # the n = 3 request joined the founder's batch
    assert engine.counters.computed_prompt_tokens - computed == num_prompt[0] - 1 + 3 + sum(num_prompt[1:])
    engine.blocks.check_no_leaks()


@torch.no_grad()
def peft_greedy(peft_model, where: str, ids, n=GREEDY.max_tokens):
    thinker = peft_model if where == "thinker" else peft_model.base_model.model.thinker
    out = list(ids)
    for _ in range(n):
        out.append(int(thinker(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def test_adapters_and_base_rows_with_images_in_one_batch_equal_each_alone_and_peft(llm, adapters):
    cases = [("attn", image_chat(1)), ("qv", text_chat("Say hi.")), (None, image_chat(1)), ("qv", image_chat(2)),
             (None, text_chat("Say hi.")), ("attn", text_chat("Say hi."))]
    specs = [attrs.evolve(s, extras={"lora": name} if name else {}) for name, s in cases]
    # a long founder under an adapter: the others join it while it decodes, however slow the machine
    founder = text_chat("Hello there, how are you?", SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
                        lora="attn")
    specs = [founder, *specs]
    solo = [alone(llm, s).token_ids for s in specs]
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
    assert [r.token_ids for r in batched] == solo  # bit-identical greedy tokens
    solo, specs = solo[1:], specs[1:]
    assert len({solo[0], solo[2]}) == 2 and len({solo[1], solo[4], solo[5]}) == 3  # each adapter changes them
    for i in (1, 5):  # text under each adapter: the bundle's and the Thinker's names both reach the decoder
        name = cases[i][0]
        ids = runtime.prepare(specs[i]).prompt_token_ids
        directory, peft_model = adapters[name]
        assert list(solo[i]) == peft_greedy(peft_model, ADAPTERS[name][0], ids), name


def test_a_captured_system_prompt_serves_later_image_requests(omni_reference_model):
    path = str(omni_reference_model[0])
    with LLM(path, plugin="omni", enable_in_flight_batching=True, max_batch_size=4, max_num_batched_tokens=16,
             enable_context_reuse=True, max_kv_cache_capacity=16 * 24) as llm:
        engine, runtime = llm.engine, llm.deployment.runtime
        first = image_chat(3, system=SYSTEM, save_system_prompt_kv_cache=True)
        prepared = runtime.prepare(first)
        image_row = int(prepared.state.media.embeds[0][0][0])
        assert 32 <= prepared.num_pinned_tokens < image_row  # the system turn, before the image
        pinned = prepared.num_pinned_tokens - prepared.num_pinned_tokens % 16
        long_text = text_chat("Hello there, how are you?", SamplingParams(temperature=0.0, max_tokens=30,
                                                                          ignore_eos=True))
        submit_staggered(engine, [long_text, first], gap_steps=2)  # the capture joins a running batch
        assert len(engine.prefix.pinned) == pinned // 16
        for i in range(6):  # other prompts fill the cache and push everything unpinned out
            alone(llm, RequestSpec(prompt_token_ids=tuple(range(40 + i, 100 + i)), params=GREEDY))
        assert engine.counters.prefix_cache_evictions > 0
        second = image_chat(4, "Hello there", system=SYSTEM)
        num_prompt = len(runtime.prepare(second).prompt_token_ids)
        computed = engine.counters.computed_prompt_tokens
        out = alone(llm, second)
        assert engine.counters.computed_prompt_tokens - computed == num_prompt - pinned
    with LLM(path, plugin="omni", enable_in_flight_batching=True) as reference:
        assert out.token_ids == alone(reference, second).token_ids
