"""Several LoRA adapters in one batch, against PEFT's PeftModel over transformers on the same weights.

The adapters are made and saved by ``peft`` itself (``get_peft_model`` + ``save_pretrained``), with random
``lora_B`` (PEFT starts it at zero), so every adapter changes the output.
"""

from __future__ import annotations

import json

import pytest
import torch

from ifb import LLM, SamplingParams
from ifb.params import RequestSpec
from ifb_plugins.common.layers.attention import build_attn_metadata
from ifb_plugins.common.models.decoder import allocate_kv_cache
from ifb_plugins.common.runtime.lora import AdapterError, Group, load_adapter
from tests.helpers import submit_staggered
from tests.models.text import save_tiny_checkpoint, save_tiny_gguf

#: four adapters: different targets, ranks and scalings
ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "attn": dict(r=8, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=2, lora_alpha=2, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all": dict(r=4, lora_alpha=16, use_rslora=True,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}
PROMPTS = {"qv": (5, 6, 7, 8, 9), "attn": tuple(range(20, 43)), "mlp": (11, 12), "all": tuple(range(60, 77)),
           None: tuple(range(90, 110))}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def hf_model(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("lora-base"), "llama", seed=9)


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, (name, cfg) in enumerate(ADAPTERS.items()):
        model = get_peft_model(hf_model(checkpoint), LoraConfig(**cfg))
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for key, param in model.named_parameters():
                if "lora_B" in key or "lora_A" in key:
                    param.copy_(torch.randn(param.shape, generator=g) * 0.3)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


@torch.no_grad()
def peft_greedy(checkpoint, adapter_dir, ids, n=12):
    from peft import PeftModel

    model = hf_model(checkpoint)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    out = list(ids)
    for _ in range(n):
        out.append(int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


@torch.no_grad()
def peft_logits(checkpoint, adapter_dir, ids):
    from peft import PeftModel

    model = hf_model(checkpoint)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    return model(input_ids=torch.tensor([ids])).logits[0, -1]


@torch.no_grad()
def our_logits(runtime, name, ids):
    """First-step logits of our model (as the runtime prepared it) under adapter ``name``."""
    model = runtime.model
    caches = allocate_kv_cache(model.config, 4, 16, torch.float32)
    attn = build_attn_metadata([(0, len(ids), [0, 1, 2, 3])], 16, torch.device("cpu"))
    groups = [Group(runtime.lora.get(name), None)] if name else []
    with runtime.lora.step(groups):
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), attn, caches)
    return model.compute_logits(hidden[-1:])[0]


def alone_and_batched(llm):
    """Each (adapter or base) request alone, then all of them (two base rows) in one staggered batch."""
    names = [*ADAPTERS, None]
    specs = [RequestSpec(prompt_token_ids=PROMPTS[n], params=GREEDY, extras={"lora": n} if n else {}) for n in names]
    alone = {n: llm.engine.submit(s, wait=True).result().token_ids for n, s in zip(names, specs)}
    steps = []
    execute = llm.deployment.runtime.execute

    def recording(step):
        steps.append(len(step.seqs))
        return execute(step)

    llm.deployment.runtime.execute = recording
    try:
        batched = submit_staggered(llm.engine, specs[:2] + [specs[-1]] + specs[2:], gap_steps=1)
    finally:
        del llm.deployment.runtime.execute
    order = names[:2] + [None] + names[2:]
    assert max(steps) >= 5, "the adapters never shared a step"
    return alone, dict(zip(map(str, order), (list(r.token_ids) for r in batched))), order


def test_four_adapters_and_base_rows_in_one_batch_equal_each_alone_and_peft(checkpoint, adapters):
    with LLM(str(checkpoint), enable_in_flight_batching=True, max_batch_size=8, max_num_batched_tokens=16,
             lora_adapters={n: str(p) for n, p in adapters.items()}) as llm:
        alone, batched, order = alone_and_batched(llm)
        for name in order:
            assert batched[str(name)] == list(alone[name]), name  # bit-identical greedy output
        for name in [*ADAPTERS, None]:
            reference = peft_greedy(checkpoint, adapters.get(name), PROMPTS[name])
            assert list(alone[name]) == reference, name
        assert len({tuple(v) for v in alone.values()}) == 5  # every adapter changes the output


def test_gguf_base_serves_adapters_within_the_quantizations_bound(checkpoint, adapters, tmp_path):
    import gguf

    path = save_tiny_gguf(checkpoint, tmp_path / "tiny.gguf", weight_type=gguf.GGMLQuantizationType.Q8_0)
    with LLM(str(path), enable_in_flight_batching=True, max_batch_size=8, max_num_batched_tokens=16,
             quantization="weights-only", lora_adapters={n: str(p) for n, p in adapters.items()}) as llm:
        runtime = llm.deployment.runtime
        assert type(runtime.model.model.layers[0].self_attn.qkv_proj).__name__.endswith("BlockLinear")
        alone, batched, order = alone_and_batched(llm)
        for name in order:
            assert batched[str(name)] == list(alone[name]), name
        # the base model's own distance from transformers bounds the adapted model's
        bound = (our_logits(runtime, None, PROMPTS[None]) - peft_logits(checkpoint, None, PROMPTS[None])).abs().max()
        assert 0 < bound < 0.1
        for name in ADAPTERS:
            ours = our_logits(runtime, name, PROMPTS[name])
            theirs = peft_logits(checkpoint, adapters[name], PROMPTS[name])
            delta = (theirs - peft_logits(checkpoint, None, PROMPTS[name])).abs().max()
            assert delta > 10 * bound, name  # the adapter's effect is far above the quantization's error
            assert (ours - theirs).abs().max() <= 3 * bound, name
            assert int(ours.argmax()) == int(theirs.argmax()), name


def test_bad_adapters_are_refused_naming_the_module(checkpoint, adapters, tmp_path):
    from safetensors.torch import load_file, save_file

    model = LLM(str(checkpoint)).deployment  # the blocking path is enough to read the model
    try:
        runtime = model.runtime
        with pytest.raises(AdapterError, match=r"model\.layers\.0\.self_attn\.[qkvo]_proj has rank 8, over --max-lora-rank 4"):
            load_adapter("attn", adapters["attn"], runtime.model, max_rank=4)

        def variant(name, edit):
            directory = tmp_path / name
            directory.mkdir()
            tensors = edit(load_file(str(adapters["qv"] / "adapter_model.safetensors")))
            save_file(tensors, str(directory / "adapter_model.safetensors"))
            (directory / "adapter_config.json").write_text((adapters["qv"] / "adapter_config.json").read_text())
            return directory

        lacks = variant("lacks", lambda t: {k.replace("layers.0.", "layers.7."): v for k, v in t.items()})
        with pytest.raises(AdapterError, match=r"targets model\.layers\.7\.self_attn\.q_proj, which this model does "
                                               r"not have"):
            load_adapter("lacks", lacks, runtime.model)
        wrong = variant("wrong", lambda t: {k: (v[:, :-1].contiguous() if "layers.1.self_attn.v_proj.lora_A" in k else v)
                                            for k, v in t.items()})
        with pytest.raises(AdapterError, match=r"model\.layers\.1\.self_attn\.v_proj has lora_A \(4, 63\)"):
            load_adapter("wrong", wrong, runtime.model)
        config = json.loads((adapters["qv"] / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA"
    finally:
        model.shutdown()


def test_adapters_load_and_unload_at_run_time_through_the_guarded_admin_route(checkpoint, adapters):
    import httpx

    from ifb.server.app import build_app
    from tests.core.server.conftest import running

    with LLM(str(checkpoint), enable_in_flight_batching=True, max_batch_size=4, max_loras=2,
             lora_adapters={"qv": str(adapters["qv"])}) as llm:
        with running(build_app(llm.deployment)) as url:  # no API key: the admin routes are refused
            r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(adapters["mlp"])})
            assert r.status_code == 403 and "--api-key" in r.json()["error"]["message"]
        with running(build_app(llm.deployment, api_key="k")) as url:
            auth = {"Authorization": "Bearer k"}
            body = {"lora_name": "mlp", "lora_path": str(adapters["mlp"])}
            assert httpx.post(f"{url}/v1/load_lora_adapter", json=body).status_code == 401
            assert httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth).status_code == 200
            ids = [m["id"] for m in httpx.get(f"{url}/v1/models", headers=auth).json()["data"]]
            assert ids[1:] == ["mlp", "qv"]
            out = httpx.post(f"{url}/v1/completions", headers=auth, json={
                "model": "mlp", "prompt": list(PROMPTS["mlp"]), "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}).json()
            expected = peft_greedy(checkpoint, adapters["mlp"], PROMPTS["mlp"])
            assert out["choices"][0]["text"] == llm.deployment.runtime.tokenizer.decode(expected)
            # over --max-loras, then a bad one named by its module
            third = httpx.post(f"{url}/v1/load_lora_adapter", headers=auth,
                               json={"lora_name": "all", "lora_path": str(adapters["all"])})
            assert third.status_code == 400 and "--max-loras (2)" in third.json()["error"]["message"]
            assert httpx.post(f"{url}/v1/unload_lora_adapter", headers=auth,
                              json={"lora_name": "mlp"}).status_code == 200
            gone = httpx.post(f"{url}/v1/completions", headers=auth, json={"model": "mlp", "prompt": "x"})
            assert gone.status_code == 404
            assert httpx.post(f"{url}/v1/unload_lora_adapter", headers=auth,
                              json={"lora_name": "mlp"}).status_code == 404
