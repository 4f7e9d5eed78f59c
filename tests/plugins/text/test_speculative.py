"""Speculative decoding on tiny checkpoints: greedy output bit-identical with and without drafts, for each
draft source, alone and in a busy batch with mid-flight joins and preemption; bad configurations refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from ifb import LLM, SamplingParams
from ifb.params import RequestSpec
from tests.helpers import submit_staggered
from tests.models.text import save_tiny_checkpoint, save_tiny_gguf

# prompts that repeat themselves, so prompt lookup finds its n-grams
PROMPTS = [[5 + (j % n) for j in range(3 * n)] for n in (4, 7, 5, 9)] + [list(range(30, 52))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    target = save_tiny_checkpoint(root / "target", "llama", seed=1)
    return {
        "target": target,
        "target_gguf": save_tiny_gguf(target, root / "target.gguf"),
        # another model sharing the vocabulary: one layer, other weights (it drafts badly, which tests rejection)
        "small": save_tiny_checkpoint(root / "small", "llama", seed=2, num_layers=1),
        "other_vocab": save_tiny_checkpoint(root / "other", "llama", seed=3, vocab_size=352),
    }


def run(model: Path, mode: str, **options) -> tuple[list, dict]:
    """``alone``: one at a time (the blocking path); ``joins``: staggered arrivals, each joining a running
    batch; ``preemption``: all at once into 64 tokens of KV, so residents are preempted."""
    kw = {}
    if mode != "alone":
        kw = dict(enable_in_flight_batching=True, max_batch_size=4, max_num_batched_tokens=16)
    if mode == "preemption":
        kw["max_kv_cache_capacity"] = 64
    with LLM(str(model), **kw, **options) as llm:
        specs = [RequestSpec(prompt_token_ids=tuple(p), params=PARAMS) for p in PROMPTS]
        if mode == "joins":
            results = submit_staggered(llm.engine, specs, gap_steps=1)
        elif mode == "preemption":
            results = [h.result() for h in [llm.engine.submit(s) for s in specs]]
        else:
            results = [llm.engine.submit(s).result() for s in specs]
        health = llm.health()
    return [(r.token_ids, r.text, [lp.logprob for lp in r.logprobs]) for r in results], health


SOURCES = {
    "ngram": ("target", dict(speculative_method="ngram", ngram_min=1, ngram_max=3)),
    "draft-model": ("target", lambda m: dict(speculative_model=str(m["small"]), num_speculative_tokens=3)),
    "own-gguf-int8": ("target_gguf", lambda m: dict(speculative_model=str(m["target_gguf"]),
                                                    speculative_quantization="int8")),
    "gguf-target-ngram": ("target_gguf", dict(speculative_method="ngram", num_speculative_tokens=6, ngram_min=1)),
}


@pytest.mark.parametrize("mode", ["alone", "joins", "preemption"])
@pytest.mark.parametrize("source", list(SOURCES))
def test_greedy_output_is_bit_identical_with_drafts(models, source, mode):
    target, options = SOURCES[source]
    options = options(models) if callable(options) else options
    assert_same_with_drafts(models[target], mode, speculative_policy="always", **options)


def assert_same_with_drafts(model: Path, mode: str, **options) -> None:
    """``run`` with and without ``options``' drafts: the same tokens and texts, logprobs within 1e-4, drafts
    accepted, and (batched) the joins or preemptions the mode is about."""
    plain, _ = run(model, mode)
    got, health = run(model, mode, **options)
    assert [(tokens, text) for tokens, text, _ in got] == [(tokens, text) for tokens, text, _ in plain]
    for (_, _, lp_got), (_, _, lp_plain) in zip(got, plain):
        assert lp_got == pytest.approx(lp_plain, abs=1e-4)
    spec = health["speculative_decoding"]
    assert spec["drafted"] > 0 and spec["accepted"] > 0 and spec["draft_failures"] == 0
    if mode != "alone":
        scheduling = health["scheduling"]
        assert scheduling["preempted" if mode == "preemption" else "admitted_mid_flight"] > 0
        assert scheduling["completed"] == len(PROMPTS)


def test_a_draft_model_with_another_vocabulary_is_refused_naming_both_sizes(models):
    with pytest.raises(ValueError, match="352 tokens.*320"):
        LLM(str(models["target"]), speculative_model=str(models["other_vocab"]))


@pytest.mark.parametrize("k", [0, 17])
def test_k_outside_1_to_16_is_refused(models, k):
    with pytest.raises(ValueError, match="--num-speculative-tokens must be between 1 and 16"):
        LLM(str(models["target"]), speculative_method="ngram", num_speculative_tokens=k)


@pytest.mark.parametrize(("options", "message"), [
    (dict(ngram_min=2), "give --speculative-method"),
    (dict(speculative_method="draft-model"), "needs --speculative-model"),
    (dict(speculative_method="ngram", ngram_min=4, ngram_max=2), "--ngram-min"),
])
def test_settings_that_do_not_fit_are_refused(models, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(models["target"]), **options)


def test_a_draft_failure_at_run_time_fails_only_that_requests_drafting(models):
    with LLM(str(models["target"]), speculative_model=str(models["small"]), speculative_policy="always",
             enable_in_flight_batching=True, max_batch_size=2) as llm:
        drafter = llm.deployment.runtime.drafter
        forward = drafter._forward

        def failing(chunks):
            if any(r.request_id == "bad" for r, _, _ in chunks):
                raise RuntimeError("injected draft fault")
            return forward(chunks)

        drafter._forward = failing
        specs = [RequestSpec(prompt_token_ids=tuple(PROMPTS[0]), params=PARAMS, request_id=i) for i in ("bad", "ok")]
        handles = [llm.engine.submit(s) for s in specs]
        results = [h.result() for h in handles]
        health = llm.health()
    plain, _ = run(models["target"], "alone")
    assert [r.token_ids for r in results] == [plain[0][0]] * 2
    assert all(r.finish_reason == "length" for r in results)
    assert health["speculative_decoding"]["draft_failures"] >= 1 and health["scheduling"]["failed"] == 0


GUIDED = [
    {"type": "regex", "regex": "(ab){6}c(ab){6}"},
    {"type": "json_schema", "json_schema": {"name": "pair", "schema": {
        "type": "object", "properties": {"aa": {"type": "string", "enum": ["xx", "yy"]},
                                         "ab": {"type": "string", "enum": ["xx", "yy"]}},
        "required": ["aa", "ab"], "additionalProperties": False}}},
]


@pytest.mark.parametrize("mode", ["alone", "joins"])
def test_guided_requests_draft_and_stay_exact(models, mode):
    """Guided requests are drafted for and verified row by row under their grammar: the output equals
    guided decoding without drafts (greedy), drafts are accepted, and every output fits its grammar."""
    import json
    import re

    def serve(**options):
        kw = {}
        if mode == "joins":
            kw = dict(enable_in_flight_batching=True, max_batch_size=4, max_num_batched_tokens=16)
        specs = [RequestSpec(prompt_token_ids=tuple(p), params=SamplingParams(temperature=0.0, max_tokens=40),
                             extras={"response_format": fmt}) for p, fmt in zip(PROMPTS, GUIDED * 2)]
        with LLM(str(models["target"]), **kw, **options) as llm:
            if mode == "joins":
                results = submit_staggered(llm.engine, specs, gap_steps=1)
            else:
                results = [llm.engine.submit(s).result() for s in specs]
            return [(r.token_ids, r.text) for r in results], llm.health()

    plain, _ = serve()
    got, health = serve(speculative_method="ngram", ngram_min=1, ngram_max=3, speculative_policy="always")
    assert got == plain
    for (_, text), fmt in zip(got, GUIDED * 2):
        if fmt["type"] == "regex":
            assert re.fullmatch(fmt["regex"], text), text
        else:
            assert set(json.loads(text)) == {"aa", "ab"}
    spec = health["speculative_decoding"]
    assert spec["drafted"] > 0 and spec["accepted"] > 0 and spec["draft_failures"] == 0
