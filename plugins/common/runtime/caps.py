"""What every deployment built on the shared decoder runtime declares in common."""

from __future__ import annotations

from ifb.capabilities import EndpointSupport, OptionSupport, RequestOption, Support
from ifb.options import BLOCKING

#: the runtime has no fixed batch dimension; this bounds the seat count it accepts
MAX_BUILT_BATCH = 256

#: the ``DeployConfig.options`` every deployment on ``TextRuntime`` reads (its loader: the name and
#: adapters; the runtime: the context limit); a plugin's loader adds its own
TEXT_RUNTIME_SETTINGS = frozenset({"served_model_name", "lora_adapters", "max_model_len"})

#: ``save_system_prompt_kv_cache``, the legacy capture of ``syscache`` (registered by the text plugin)
SYSTEM_PROMPT_CAPTURE = RequestOption(
    name="save_system_prompt_kv_cache", title="saveSystemPromptKVCache (legacy capture)",
    uses=lambda spec: bool(spec.extras.get("save_system_prompt_kv_cache")), order=50,
    default=OptionSupport(
        Support.REJECTED, reason="The capture runs only in the founding prefill path.",
        alternative="Warm the prompt up before serving (--warmup-prompt) or use the context cache "
                    "(--enable-context-reuse); or use the blocking path."))

TEXT_ENDPOINTS = {"completions": EndpointSupport.SERVED, "chat.completions": EndpointSupport.SERVED}


def text_options() -> dict[str, OptionSupport]:
    """Per-request option support of ``TextRuntime`` under in-flight batching."""
    return {
        # sampling is per sequence in the batch (plugins/common/decoding/sampling.py)
        "differing_sampling": OptionSupport(Support.SERVED, reason="Sampling is per sequence."),
        "lora": OptionSupport(
            Support.REJECTED, reason="Adapter weights are engine-wide under in-flight batching.",
            alternative=f"{BLOCKING} Adapters are registered by name at start-up (--lora NAME=DIR)."),
        "n_sequences": OptionSupport(
            Support.REJECTED, reason="The engine batches across requests, not within one.", alternative=BLOCKING),
        "save_system_prompt_kv_cache": OptionSupport(
            Support.REJECTED, reason="The capture runs only in the founding prefill path.", alternative=BLOCKING),
        "guided_decoding": OptionSupport(
            Support.RUNS_ALONE,
            reason="Guided matchers are kept per request and the engine runs a guided request alone.",
            stall_counter="stalls_guided"),
        "media_under_pruner": OptionSupport(Support.NOT_APPLICABLE, reason="Text input only."),
        "generate_audio": OptionSupport(Support.NOT_APPLICABLE, reason="Text output only."),
        "past_trajectory": OptionSupport(Support.NOT_APPLICABLE, reason="No trajectory execution is built."),
    }

