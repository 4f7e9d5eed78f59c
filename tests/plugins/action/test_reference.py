"""ifb's pi0 against transformers' on the same tiny random checkpoint: preprocessing, prefix KV, plans."""

from __future__ import annotations

import torch
from PIL import Image

from ifb import LLM
from ifb_plugins.action.checkpoint import load_pi0
from ifb_plugins.action.processor import Pi0Processing
from ifb_plugins.action.runtime import initial_noise

from tests.plugins.action.conftest import Pi0Fixture


def test_preprocessing_and_prefix_kv_equal_the_reference(pi0: Pi0Fixture):
    with LLM(str(pi0.path), plugin="action") as llm:
        runtime = llm.deployment.runtime
        for case, ref in zip(pi0.cases, pi0.reference, strict=True):
            from ifb.params import RequestSpec, Trajectory

            spec = RequestSpec(messages=({"role": "user", "content": case.content()[:-1]},),
                               past_trajectory=Trajectory.of([list(case.state)], case.noise_seed))
            plan = runtime.prepare(spec).state
            assert plan.input_ids.tolist() == ref["input_ids"].tolist()
            assert torch.equal(plan.pixel_values, ref["pixel_values"])  # bit for bit, as the processor makes them
            assert torch.equal(plan.state, ref["state"])
            kv, lens = runtime.model.prefix_kv([runtime.model.embed_prefix(plan.input_ids, plan.pixel_values)])
            assert lens.tolist() == [len(ref["input_ids"])]
            assert len(kv) == len(ref["prefix_kv"])
            for (k, v), (ref_k, ref_v) in zip(kv, ref["prefix_kv"], strict=True):
                torch.testing.assert_close(k[0].transpose(0, 1), ref_k, atol=1e-5, rtol=0)
                torch.testing.assert_close(v[0].transpose(0, 1), ref_v, atol=1e-5, rtol=0)


def test_planned_trajectories_equal_sample_actions_with_the_same_noise(pi0: Pi0Fixture):
    with LLM(str(pi0.path), plugin="action") as llm:
        for case, ref in zip(pi0.cases, pi0.reference, strict=True):
            result = llm.chat([{"role": "user", "content": case.content()[:-1]}], trajectory=[list(case.state)],
                              noise_seed=case.noise_seed)
            planned = torch.tensor(result.output_trajectory)
            assert planned.shape == ref["actions"].shape == (5, 7)  # chunk_size x max_action_dim
            assert (planned - ref["actions"]).abs().max() <= 1e-4, case
            assert ref["actions"].abs().max() > 0.5  # a plan, not a vanishing output
        # plan() is the same request: the same seed, the same plan; another seed, another plan
        first = pi0.cases[0]
        images = [c["image_url"]["url"] for c in first.content()[:-2]]
        again = llm.plan(first.text, [list(first.state)], images=images, noise_seed=first.noise_seed)
        assert (torch.tensor(again) - pi0.reference[0]["actions"]).abs().max() <= 1e-4
        other = llm.plan(first.text, [list(first.state)], images=images, noise_seed=first.noise_seed + 1)
        assert (torch.tensor(other) - pi0.reference[0]["actions"]).abs().max() > 1e-2


def test_the_seeded_noise_is_the_documented_draw():
    noise = initial_noise(42, 5, 7)
    assert torch.equal(noise, torch.randn((5, 7), generator=torch.Generator().manual_seed(42), dtype=torch.float32))
    assert not torch.equal(initial_noise(None, 5, 7), initial_noise(None, 5, 7))


def test_a_batch_of_requests_plans_what_each_plans_alone(pi0: Pi0Fixture):
    model = load_pi0(pi0.path)
    processing = Pi0Processing.from_dir(pi0.path)
    prefixes, states, noises = [], [], []
    for case, ref in zip(pi0.cases, pi0.reference, strict=True):
        pixels = torch.stack([processing.image(Image.open(p)) for p in case.images])
        prefixes.append(model.embed_prefix(ref["input_ids"], pixels))
        states.append(processing.state(case.state))
        noises.append(initial_noise(case.noise_seed, 5, 7))
    kv, lens = model.prefix_kv(prefixes)  # padded to the longest prefix
    batched = model.sample(torch.stack(states), torch.stack(noises), kv, lens)
    for i, ref in enumerate(pi0.reference):
        assert (batched[i] - ref["actions"]).abs().max() <= 1e-4
