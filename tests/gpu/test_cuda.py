"""The ``gpu`` suite: every part of the CUDA path on a real device (skipped, with the reason
"needs a CUDA device", where torch sees none; ``tests/conftest.py``).

- the Triton kernels compiled, against the same references as the interpreter run
  (tests/plugins/common/test_triton_device_kernels.py);
- model parity with transformers on the device: float32 greedy tokens equal and first-step
  logits within 1e-4 (Hugging Face checkpoint), bfloat16 within the CPU test's agreement;
- a GGUF file's blocks in the Triton matmuls: greedy tokens agree with the CPU's float32 run;
- batched == alone under in-flight batching with mid-flight joins;
- ``ifb serve --device cuda`` end to end over HTTP.
"""

from __future__ import annotations

import pytest
import torch

from ifb.llm import LLM
from ifb.params import RequestSpec, SamplingParams
from tests.helpers import alone_and_staggered
from tests.models.converted import save_tiny_dense
from tests.plugins.common.test_triton_device_kernels import (
    ATTENTION_CASES, MATMUL_SHAPES, QTYPES, compare_attention, compare_matmuls,
)
from tests.plugins.text.test_dtype import AGREEMENT

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 33, 101], [250, 7], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return save_tiny_dense(tmp_path_factory.mktemp("gpu") / "qwen2", "qwen2", seed=4)


def greedy(path, prompts=PROMPTS, **settings) -> list[list[int]]:
    with LLM(str(path), **settings) as llm:
        return [list(llm.engine.submit(RequestSpec(prompt_token_ids=tuple(p), params=GREEDY)).result().token_ids)
                for p in prompts]


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_compiled_kernels_equal_their_references(half: torch.dtype) -> None:
    results = {**compare_matmuls("cuda", half), **compare_attention("cuda", half)}
    expected = {f"{q}-{s}" for q in QTYPES for s in MATMUL_SHAPES} | set(ATTENTION_CASES)
    assert set(results) == expected
    assert {k: v for k, v in results.items() if not v < 1.0} == {}


def test_float32_parity_with_transformers_on_the_device(qwen2) -> None:
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(str(qwen2), dtype=torch.float32).cuda().eval()
    with LLM(str(qwen2), device="cuda", dtype="float32") as llm:
        runtime = llm.deployment.runtime
        assert next(runtime.model.parameters()).device.type == "cuda"
        assert runtime.kv_caches[0][0].device.type == "cuda"
        for prompt in PROMPTS:
            out = llm.engine.submit(RequestSpec(prompt_token_ids=tuple(prompt), params=SamplingParams(
                max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1))).result()
            ids = torch.tensor([prompt], device="cuda")
            with torch.no_grad():
                expected = reference.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)[0, len(prompt):]
                first = torch.log_softmax(reference(ids).logits[0, -1].float(), -1)
            assert list(out.token_ids) == expected.tolist()
            assert abs(out.logprobs[0].logprob - first[out.token_ids[0]].item()) <= 1e-4


def test_bfloat16_on_the_device_agrees_with_float32(qwen2) -> None:
    reference = greedy(qwen2, device="cuda", dtype="float32")
    tokens = greedy(qwen2, device="cuda")  # auto: bfloat16 on CUDA
    same = sum(a == b for t, r in zip(tokens, reference) for a, b in zip(t, r))
    assert same / sum(map(len, reference)) >= AGREEMENT, (tokens, reference)


@pytest.mark.parametrize("outtype", ["q8_0"])
def test_gguf_blocks_in_triton_agree_with_the_cpu(llama_cpp_families, outtype: str) -> None:
    path = llama_cpp_families["llama"].ggufs[outtype]
    cpu = greedy(path, device="cpu", quantization="weights-only")
    cuda = greedy(path, device="cuda", dtype="float32")
    same = sum(a == b for t, r in zip(cuda, cpu) for a, b in zip(t, r))
    assert same / sum(map(len, cpu)) >= AGREEMENT, (cuda, cpu)


def test_batched_equals_alone_on_the_device(qwen2) -> None:
    # the default device is cuda here: the deployment ran on it
    alone, batched = alone_and_staggered(qwen2, "text", PROMPTS * 2, key=lambda r: r.token_ids)
    assert batched == alone


def test_server_end_to_end_on_the_device(qwen2, tmp_path) -> None:
    from tests.e2e.test_server import Server

    with LLM(str(qwen2), device="cuda", dtype="float32") as llm:
        expected = llm.engine.submit(RequestSpec(prompt_token_ids=tuple(PROMPTS[0]), params=SamplingParams(
            max_tokens=8, temperature=0.0, ignore_eos=True))).result().text
    server = Server(tmp_path / "serve.log", str(qwen2), "--device", "cuda", "--dtype", "float32",
                    "--enable-in-flight-batching")
    try:
        server.wait_ready()
        client = server.client()
        model = client.models.list().data[0].id
        answer = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0.0,
                                           extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 8
        assert answer.choices[0].text == expected
        assert server.health()["status"] == "ok"
    finally:
        server.stop()
