"""ifb's block diffusion against ``torch.manual_seed(i); model.generate(...)`` of transformers."""

from __future__ import annotations

import pytest

from ifb import LLM
from ifb.params import RequestSpec, SamplingParams

from . import reference

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog. A paged KV", "What is the capital"]
MAX_TOKENS = 20  # two whole blocks and half of a third: the answer is cut inside a block


@pytest.fixture(scope="module")
def near_zero(diffusion_reference):
    llm = LLM(str(diffusion_reference[0]), plugin="diffusion", diffusion_t_min=0.0, diffusion_t_max=1e-6)
    yield llm
    llm.deployment.shutdown()


@pytest.fixture(scope="module")
def default(diffusion_reference):
    llm = LLM(str(diffusion_reference[0]), plugin="diffusion")
    yield llm
    llm.deployment.shutdown()


def _ids(text: str) -> list[int]:
    return reference.tokenizer().encode(text)


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_near_zero_schedule_equals_generate(diffusion_reference, near_zero, i):
    expected = reference.generate(diffusion_reference[1], _ids(PROMPTS[i]), seed=i, max_new_tokens=MAX_TOKENS,
                                  **reference.NEAR_ZERO)
    (out,) = near_zero.generate(PROMPTS[i], SamplingParams(max_tokens=MAX_TOKENS, seed=i, ignore_eos=True))
    assert list(out.token_ids) == expected and out.finish_reason == "length"
    assert out.num_prompt_tokens == len(_ids(PROMPTS[i]))
    assert out.text == reference.tokenizer().decode(expected, skip_special_tokens=True)


def test_temperature_zero_is_the_schedules_limit(near_zero, default):
    params = SamplingParams(max_tokens=MAX_TOKENS, seed=1, ignore_eos=True)
    (schedule,) = near_zero.generate(PROMPTS[1], params)
    (limit,) = default.generate(PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS, seed=1, ignore_eos=True,
                                                           temperature=0.0))
    assert limit.token_ids == schedule.token_ids


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_default_schedule_equals_generate(diffusion_reference, default, i):
    # the checkpoint's own schedule (t 0.8 -> 0.4): tokens are drawn, some renoised, from the same random numbers
    expected = reference.generate(diffusion_reference[1], _ids(PROMPTS[i]), seed=i + 10, max_new_tokens=MAX_TOKENS)
    (out,) = default.generate(PROMPTS[i], SamplingParams(max_tokens=MAX_TOKENS, seed=i + 10, ignore_eos=True))
    assert list(out.token_ids) == expected


def test_stops_at_the_block_with_an_end_token(diffusion_reference, near_zero):
    ids = _ids(PROMPTS[0])
    free = reference.generate(diffusion_reference[1], ids, seed=3, max_new_tokens=24, **reference.NEAR_ZERO)
    end = free[11]  # a token of the second block, taken as the end token
    expected = reference.generate(diffusion_reference[1], ids, seed=3, max_new_tokens=24, eos_token_id=end,
                                  **reference.NEAR_ZERO)
    assert expected[-1] == end and len(expected) <= 12
    (out,) = near_zero.generate(PROMPTS[0], SamplingParams(max_tokens=24, seed=3, ignore_eos=True,
                                                           stop_token_ids=(end,)))
    assert list(out.token_ids) == expected and out.finish_reason == "stop"


def test_each_finished_block_is_one_streamed_output(near_zero):
    handle = near_zero.engine.submit(RequestSpec(prompt=PROMPTS[2], stream=True, params=SamplingParams(
        max_tokens=MAX_TOKENS, seed=2, ignore_eos=True)), wait=True)
    outputs = list(handle)
    assert [len(o.token_ids) for o in outputs] == [8, 8, 4]
    assert [o.finished for o in outputs] == [False, False, True]


def test_unsupported_sampling_parameters_are_refused(near_zero):
    from ifb.params import InvalidRequest

    for params, name in ((SamplingParams(top_p=0.5), "top_p"), (SamplingParams(logprobs=2), "logprobs"),
                         (SamplingParams(presence_penalty=1.0), "presence_penalty")):
        with pytest.raises(InvalidRequest, match=name):
            near_zero.generate("Hi", params)


def test_a_confident_stable_block_stops_early(near_zero):
    runtime = near_zero.deployment.runtime
    job = runtime.denoiser.new_job(_ids(PROMPTS[0]), runtime.new_sampler(SamplingParams(seed=0)))
    while runtime.denoiser.step([job]) == [None]:
        pass
    # near-zero temperatures: zero entropy, so the block stops once self-conditioning leaves its argmax unchanged
    assert 2 <= job.num_forwards < runtime.settings.max_denoising_steps
