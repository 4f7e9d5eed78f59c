"""Gemma 4's assistant drafter against transformers, and speculative decoding with it under the engine.

The reference is transformers' own candidate generator for the assistant
(``SinglePositionMultiTokenCandidateGenerator``) on the target's outputs over
the context before the last known token. Called after the target has seen
exactly that context, it is the generator ``generate(assistant_model=...)``
runs; in later rounds of its own loop it hands the assistant one more KV
position (the rejected draft's, at the query's own position), which a paged
cache does not keep as context, so each round here is compared against a
fresh call on the clean context.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ifb_plugins.common.layers.attention import build_attn_metadata
from ifb_plugins.common.speculative.drafter import DraftRequest
from ifb_plugins.text.families import build_family_model
from tests.models.gemma4 import SLIDING_WINDOW, fit_tiny_gemma4_assistant, save_tiny_gemma4, save_tiny_gemma4_assistant
from tests.plugins.text.test_speculative import PROMPTS as SPECULATIVE_PROMPTS
from tests.plugins.text.test_speculative import assert_same_with_drafts

PROMPTS = [
    [(7 * i) % 290 + 5 for i in range(40)],  # past the sliding window
    [17, 4, 260],
    [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113],
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma4_assistant")
    models = {"target": save_tiny_gemma4(root / "target", seed=1),
              "assistant": save_tiny_gemma4_assistant(root / "assistant", seed=2),
              "ordered": save_tiny_gemma4_assistant(root / "ordered", seed=3, use_ordered_embeddings=True),
              "fitted": save_tiny_gemma4_assistant(root / "fitted", seed=4)}
    # a random assistant's drafts are all rejected: this one learned the engine test's continuations
    assert fit_tiny_gemma4_assistant(models["target"], models["fitted"], SPECULATIVE_PROMPTS, steps=20) > 0.5
    return models


def reference_drafts(target, assistant, context: list[int], last_token: int, k: int) -> list[int]:
    """transformers' candidates after the target ran over ``context`` and sampled ``last_token``."""
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

    with torch.no_grad():
        out = target(torch.tensor([context]), output_hidden_states=True, return_shared_kv_states=True)
    assistant.generation_config.num_assistant_tokens = k
    generator = SinglePositionMultiTokenCandidateGenerator(assistant, target.get_input_embeddings(),
                                                           GenerationConfig(max_length=4096))
    ids = torch.tensor([context + [last_token]])
    with torch.no_grad():
        candidates, _ = generator.get_candidates(ids, {"attention_mask": torch.ones_like(ids)}, out,
                                                 is_first_iteration=False, n_last_matches=0)
    return candidates[0, len(context) + 1:].tolist()


@pytest.mark.parametrize("which", ["assistant", "ordered", "fitted"])
def test_drafts_equal_transformers_candidates(models, which):
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    from ifb import LLM

    hf_target = Gemma4ForCausalLM.from_pretrained(str(models["target"])).eval()
    hf_assistant = Gemma4AssistantForCausalLM.from_pretrained(str(models[which])).eval()
    with LLM(str(models["target"]), speculative_model=str(models[which]), num_speculative_tokens=4) as llm:
        runtime = llm.engine.runtime
        drafter, model = runtime.drafter, runtime.model
        assert drafter.needs_hidden_states and "assistant" in drafter.description
        caches = runtime.kv_caches
        checked = 0
        for ids in PROMPTS:
            with torch.no_grad():  # the target's greedy continuation gives contexts of several lengths
                sequence = hf_target.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0].tolist()
            for p in (len(ids), len(ids) + 5, len(sequence) - 1):
                context, block_ids = sequence[:p], list(range(8))
                attn = build_attn_metadata([(0, p, block_ids)], 16)
                with torch.no_grad():
                    hidden = model(torch.tensor(context), torch.arange(p), attn, caches)
                request = DraftRequest("r", sequence[:p + 1], 4, block_ids, hidden[-1])
                (ours,) = drafter.propose([request])
                assert not isinstance(ours, Exception), ours
                assert list(ours) == reference_drafts(hf_target, hf_assistant, context, sequence[p], 4), (p, ids)
                checked += 1
        assert checked == 3 * len(PROMPTS) and max(len(s) for s in PROMPTS) > SLIDING_WINDOW


def test_batched_drafts_equal_each_alone(models):
    """Seats drafting in one step share each forward; every seat's drafts are what it drafts alone."""
    from ifb import LLM

    with LLM(str(models["target"]), speculative_model=str(models["assistant"]), num_speculative_tokens=3) as llm:
        runtime = llm.engine.runtime
        requests = []
        for n, ids in enumerate(PROMPTS):
            blocks = list(range(4 * n, 4 * n + 4))
            attn = build_attn_metadata([(0, len(ids), blocks)], 16)
            with torch.no_grad():
                hidden = runtime.model(torch.tensor(ids), torch.arange(len(ids)), attn, runtime.kv_caches)
            requests.append(DraftRequest(f"r{n}", ids + [9], 3 - n % 2, blocks, hidden[-1]))
        together = runtime.drafter.propose(requests)
        alone = [runtime.drafter.propose([r])[0] for r in requests]
    assert [list(d) for d in together] == [list(d) for d in alone]
    assert [len(d) for d in together] == [3, 2, 3]


@pytest.mark.parametrize("mode", ["alone", "joins", "preemption"])
def test_greedy_output_is_bit_identical_with_the_assistant(models, mode):
    assert_same_with_drafts(models["target"], mode, speculative_policy="always",
                            speculative_model=str(models["fitted"]), num_speculative_tokens=3)


def test_an_assistant_for_another_target_is_refused(models, tmp_path):
    from ifb import LLM
    from tests.models.text import save_tiny_checkpoint

    llama = save_tiny_checkpoint(tmp_path / "llama", "llama", seed=1, vocab_size=320)
    with pytest.raises(ValueError, match="drafts for a Gemma 4 target"):
        LLM(str(llama), speculative_model=str(models["assistant"]))
    with pytest.raises(ValueError, match="--speculative-model"):
        LLM(str(models["assistant"]))
