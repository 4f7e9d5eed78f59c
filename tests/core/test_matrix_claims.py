"""Every row of ``ifb matrix`` that claims a built-in plugin serves something under in-flight batching
names the test that runs it there, through the public API (``LLM``, the engine, the HTTP routes).

``CLAIMS`` maps each such row to its tests, one line per row. The walker fails on a served,
founder-only or text-only row that has no line (a newly declared row needs a test that exercises
it), on a line whose row is gone or no longer claims to be served, and on a line naming a test that
does not exist or whose module never starts a deployment under the flag. A row that cannot be
exercised is not given a line: its declaration changes instead.
"""

from __future__ import annotations

import ast
import json
import pathlib

from click.testing import CliRunner

from ifb.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).resolve().relative_to(ROOT)
#: the statuses that claim a row runs under the flag (``ifb.matrix``); the others claim nothing served
CLAIMING = ("served", "served, unverified", "founder-only", "text-only")
NOT_CLAIMING = ("rejected", "n/a", "blocking path")

#: "plugin | deployment" or "plugin | deployment | request option" -> the tests that exercise it
CLAIMS: dict[str, tuple[str, ...]] = {
    # -- deployments --
    "text | Text LLM, single rank": (
        "tests/plugins/text/test_runtime.py::test_batched_greedy_equals_each_prompt_alone",
        # the Mistral architecture on the native whole-stack decoder
        "tests/plugins/common/test_gguf_llama_cpp.py::test_mistral_on_the_native_decoder_serves_transformers_greedy_tokens_under_in_flight_batching",
    ),
    "text | Text LLM, tensor parallelism": (
        "tests/plugins/text/test_tensor_parallel.py::test_two_ranks_serve_the_one_rank_tokens_under_in_flight_batching",),
    "text | Speculative decoding (draft model, n-gram prompt lookup)": (
        "tests/plugins/text/test_speculative.py::test_greedy_output_is_bit_identical_with_drafts",),
    "text | Text LLM, single rank + context cache (prefix reuse)": (
        "tests/plugins/context_cache/test_cache.py::test_greedy_outputs_are_identical_with_and_without_reuse",),
    "action | Vision-language-action (pi0 trajectory planning)": (
        "tests/plugins/action/test_batching.py::test_staggered_requests_plan_what_each_plans_alone",),
    "diffusion | Diffusion backbone": ("tests/plugins/diffusion/test_batching.py::test_staggered_joins_answer_as_alone",),
    "mamba | Hybrid Mamba (Nemotron-H, Bamba, Granite 4.0 hybrid)": (
        "tests/plugins/mamba/test_batch_invariance.py::test_staggered_chunked_batch_equals_each_request_alone",),
    "mamba | Hybrid Mamba (Nemotron-H, Bamba, Granite 4.0 hybrid) + context cache (prefix reuse)": (
        "tests/plugins/context_cache/test_hybrid.py::test_greedy_output_is_identical_with_and_without_reuse_alone_and_batched",),
    "speech | Speech output, Omni bundle": (
        "tests/plugins/speech/test_omni.py::test_thinker_tokens_equal_the_reference_under_in_flight_batching",
        "tests/plugins/speech/test_omni.py::test_under_the_flag_only_the_thinker_is_loaded_and_speech_is_refused",),
    "speech | Speech output, Omni bundle + context cache (prefix reuse)": (
        "tests/plugins/speech/test_omni_combinations.py::test_the_context_cache_reuses_a_shared_system_prompt_across_media",),
    "vlm | Vision / audio input (multimodal)": (
        "tests/plugins/vlm/test_runtime.py::test_media_requests_join_mid_flight_and_match_their_output_alone",),
    "vlm | Vision / audio input under a visual-token pruner": (
        "tests/plugins/vlm/test_runtime.py::test_under_the_pruner_media_founds_a_batch_while_text_joins",),
    "vlm | Vision / audio input under a visual-token pruner + context cache (prefix reuse)": (
        "tests/plugins/vlm/test_combinations.py::test_pruner_and_context_cache_together",),
    # -- request options (on each plugin's first deployment) --
    "text | Text LLM, single rank | Plain text generation, streaming, logprobs, stop strings": (
        "tests/plugins/text/test_runtime.py::test_logprobs_stop_token_ids_and_max_tokens",
        "tests/plugins/text/test_runtime.py::test_chat_streams_text",),
    "text | Text LLM, single rank | Sampling parameters that differ from the resident batch": (
        "tests/plugins/text/test_runtime.py::test_differing_sampling_parameters_share_a_batch",
        "tests/plugins/text/test_runtime.py::test_seeded_sampling_is_reproducible_whatever_the_batch_mates",),
    "text | Text LLM, single rank | Guided decoding (grammar / JSON)": (
        "tests/plugins/common/test_guided.py::test_guided_and_plain_requests_share_steps",),
    "text | Text LLM, single rank | Per-request LoRA": (
        "tests/plugins/common/test_lora.py::test_four_adapters_and_base_rows_in_one_batch_equal_each_alone_and_peft",),
    "text | Text LLM, single rank | More than one sequence per request": (
        "tests/plugins/text/test_n_sequences.py::test_n_in_a_busy_batch_with_context_cache_and_greedy",),
    # every pi0 request carries a trajectory and camera images: the staggered plans exercise each row
    "action | Vision-language-action (pi0 trajectory planning) | Plain text generation, streaming, logprobs, stop strings": (
        "tests/plugins/action/test_batching.py::test_staggered_requests_plan_what_each_plans_alone",),
    "action | Vision-language-action (pi0 trajectory planning) | Sampling parameters that differ from the resident batch": (
        "tests/plugins/action/test_batching.py::test_staggered_requests_plan_what_each_plans_alone",),
    "action | Vision-language-action (pi0 trajectory planning) | Media under an active visual-token pruner": (
        "tests/plugins/action/test_batching.py::test_staggered_requests_plan_what_each_plans_alone",),
    "action | Vision-language-action (pi0 trajectory planning) | pastTrajectory (trajectory execution)": (
        "tests/plugins/action/test_batching.py::test_staggered_requests_plan_what_each_plans_alone",
        "tests/plugins/action/test_serve.py::test_under_in_flight_batching_concurrent_plans_are_each_the_reference",),
    "vlm | Vision / audio input (multimodal) | More than one sequence per request": (
        "tests/plugins/vlm/test_options.py::test_n_over_an_image_prompt_shares_its_prefill_and_equals_seeded_singles",),
    "vlm | Vision / audio input (multimodal) | Per-request LoRA": (
        "tests/plugins/vlm/test_options.py::test_adapters_and_base_rows_with_images_in_one_batch_equal_each_alone_and_peft",),
    "speech | Speech output, Omni bundle | More than one sequence per request": (
        "tests/plugins/speech/test_omni_options.py::test_n_over_an_image_prompt_shares_its_prefill_and_equals_seeded_singles",),
    "speech | Speech output, Omni bundle | Per-request LoRA": (
        "tests/plugins/speech/test_omni_options.py::test_adapters_and_base_rows_with_images_in_one_batch_equal_each_alone_and_peft",),
    "diffusion | Diffusion backbone | Plain text generation, streaming, logprobs, stop strings": (
        "tests/plugins/diffusion/test_batching.py::test_streams_one_output_per_finished_block",
        "tests/plugins/diffusion/test_batching.py::test_a_stop_token_ends_one_resident_only",),
    "diffusion | Diffusion backbone | Sampling parameters that differ from the resident batch": (
        "tests/plugins/diffusion/test_batching.py::test_staggered_joins_answer_as_alone",),
    "mamba | Hybrid Mamba (Nemotron-H, Bamba, Granite 4.0 hybrid) | Plain text generation, streaming, logprobs, stop strings": (
        "tests/plugins/mamba/test_batch_invariance.py::test_staggered_chunked_batch_equals_each_request_alone",),
    "mamba | Hybrid Mamba (Nemotron-H, Bamba, Granite 4.0 hybrid) | Sampling parameters that differ from the resident batch": (
        "tests/plugins/mamba/test_batch_invariance.py::test_staggered_chunked_batch_equals_each_request_alone",),
    "speech | Speech output, Omni bundle | Plain text generation, streaming, logprobs, stop strings": (
        "tests/plugins/speech/test_omni.py::test_thinker_tokens_equal_the_reference_under_in_flight_batching",),
    "speech | Speech output, Omni bundle | Sampling parameters that differ from the resident batch": (
        "tests/plugins/speech/test_omni_combinations.py::test_differing_sampling_parameters_share_the_thinkers_batch_with_media",),
    "speech | Speech output, Omni bundle | Guided decoding (grammar / JSON)": (
        "tests/plugins/speech/test_omni_combinations.py::test_a_guided_media_request_joins_a_running_batch",),
    "speech | Speech output, Omni bundle | Media under an active visual-token pruner": (
        "tests/plugins/speech/test_omni_image.py::test_image_requests_join_a_running_batch_with_their_output_alone",),
    "vlm | Vision / audio input (multimodal) | Plain text generation, streaming, logprobs, stop strings": (
        "tests/plugins/vlm/test_runtime.py::test_media_requests_join_mid_flight_and_match_their_output_alone",
        "tests/plugins/vlm/test_runtime.py::test_server_answers_bad_media_with_400",),
    "vlm | Vision / audio input (multimodal) | Sampling parameters that differ from the resident batch": (
        "tests/plugins/vlm/test_combinations.py::test_differing_sampling_parameters_share_a_batch_with_media",),
    "vlm | Vision / audio input (multimodal) | Guided decoding (grammar / JSON)": (
        "tests/plugins/vlm/test_runtime.py::test_guided_media_and_plain_requests_share_steps",),
    "vlm | Vision / audio input (multimodal) | Media under an active visual-token pruner": (
        "tests/plugins/vlm/test_runtime.py::test_under_the_pruner_media_founds_a_batch_while_text_joins",),
}


def matrix_rows() -> dict[str, str]:
    """``ifb matrix --builtin-only`` as "plugin | deployment[ | option]" -> status."""
    result = CliRunner().invoke(main, ["matrix", "--builtin-only", "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    rows = {f"{r['plugin']} | {r['deployment']}": r["status"] for r in data["deployments"]}
    rows.update({f"{r['plugin']} | {r['deployment']} | {r['option']}": r["status"] for r in data["requests"]})
    return rows


def test_every_status_is_known_to_claim_or_not():
    unknown = sorted({s for s in matrix_rows().values() if s not in CLAIMING + NOT_CLAIMING})
    assert not unknown, (f"ifb matrix shows statuses {unknown}: add each to CLAIMING (it claims the row runs "
                         f"under --enable-in-flight-batching) or NOT_CLAIMING in {HERE}")


def test_every_claimed_row_names_a_test_that_exercises_it():
    rows = matrix_rows()
    missing = [key for key, status in rows.items() if status in CLAIMING and key not in CLAIMS]
    assert not missing, (
        "these ifb matrix rows claim to be served under in-flight batching but no test is registered for them; "
        "write a test that runs each through the public API with the flag on (staggered arrivals, joins asserted) "
        f"and add one line per row to CLAIMS in {HERE}:\n"
        + "\n".join(f'    "{key}": ("tests/plugins/PLUGIN/test_FILE.py::test_NAME",),' for key in missing)
        + "\nor, where the row cannot be exercised, change the plugin's declaration.")


def test_every_registered_row_is_still_claimed():
    rows = matrix_rows()
    stale = {key: rows.get(key, "gone") for key in CLAIMS if rows.get(key) not in CLAIMING}
    assert not stale, ("these CLAIMS lines name rows that ifb matrix no longer shows as served "
                       f"(status in brackets); remove or rename them in {HERE}:\n"
                       + "\n".join(f"    {key!r} [{status}]" for key, status in stale.items()))


def _test_names(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        names |= {f"{cls.name}::{n.name}" for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return {n for n in names if n.rsplit("::", 1)[-1].startswith("test_")}


def test_every_registered_test_exists_and_runs_under_the_flag():
    problems = []
    for key, node_ids in CLAIMS.items():
        assert node_ids, f"{key}: no tests named"
        for node_id in node_ids:
            file, _, name = node_id.partition("::")
            path = ROOT / file
            if not path.is_file():
                problems.append(f"{key}: {file} does not exist")
            elif name not in _test_names(path):
                problems.append(f"{key}: {file} has no test {name!r}")
            elif "enable_in_flight_batching" not in path.read_text():
                problems.append(f"{key}: {file} never starts a deployment under the flag")
    assert not problems, "fix these CLAIMS lines:\n" + "\n".join(problems)
