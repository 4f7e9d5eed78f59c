"""What every deployment built on the shared decoder runtime declares in common."""

from __future__ import annotations

from ifb.capabilities import EndpointSupport, OptionSupport, RequestOption, Support

#: the runtime has no fixed batch dimension; this bounds the seat count it accepts
MAX_BUILT_BATCH = 256

#: the ``DeployConfig.options`` every deployment on ``TextRuntime`` reads (its loader: the name and
#: adapters; the runtime: the context limit); a plugin's loader adds its own
TEXT_RUNTIME_SETTINGS = frozenset({"served_model_name", "lora_adapters", "max_loras", "max_lora_rank",
                                   "max_model_len"})

#: ``save_system_prompt_kv_cache``, the legacy capture of ``syscache`` (registered by the text plugin)
SYSTEM_PROMPT_CAPTURE = RequestOption(
    name="save_system_prompt_kv_cache", title="saveSystemPromptKVCache (legacy capture)",
    uses=lambda spec: bool(spec.extras.get("save_system_prompt_kv_cache")), order=50,
    default=OptionSupport(
        Support.REJECTED, reason="The capture runs only in the founding prefill path.",
        alternative="Warm the prompt up before serving (--warmup-prompt) or use the context cache "
                    "(--enable-context-reuse); or use the blocking path."))

TEXT_ENDPOINTS = {"completions": EndpointSupport.SERVED, "chat.completions": EndpointSupport.SERVED}


#: why the legacy capture needs the context cache under in-flight batching
CAPTURE_NEEDS_CONTEXT_CACHE = OptionSupport(
    Support.REJECTED, reason="The capture publishes the system prompt into the context cache, which is off.",
    alternative="Serve with --enable-context-reuse (or warm the prompt up with --warmup-prompt); or use the "
                "blocking path.")


def text_options(*, context_reuse: bool = False) -> dict[str, OptionSupport]:
    """Per-request option support of ``TextRuntime`` under in-flight batching (``context_reuse``: the context
    cache is on, ``--enable-context-reuse``)."""
    return {
        # sampling is per sequence in the batch (plugins/common/decoding/sampling.py)
        "differing_sampling": OptionSupport(Support.SERVED, reason="Sampling is per sequence."),
        "lora": OptionSupport(
            Support.SERVED, reason="Each row applies its own adapter: rows are grouped by adapter, base rows "
                                   "untouched (--lora NAME=DIR, --max-loras, --max-lora-rank)."),
        "n_sequences": OptionSupport(
            Support.SERVED, reason="One prefill; the n sequences (best_of candidates) share the prompt's KV blocks "
                                   "(copy on write of the last) and each samples its own stream; n and best_of are "
                                   "at most the batch size."),
        "save_system_prompt_kv_cache": OptionSupport(
            Support.SERVED, reason="The capture publishes the system prompt into the context cache and later "
                                   "requests lease it.")
        if context_reuse else CAPTURE_NEEDS_CONTEXT_CACHE,
        "guided_decoding": OptionSupport(
            Support.SERVED, reason="Each request's matcher advances on its own row; the step's masks are computed "
                                   "while the forward runs."),
        "media_under_pruner": OptionSupport(Support.NOT_APPLICABLE, reason="Text input only."),
        "generate_audio": OptionSupport(Support.NOT_APPLICABLE, reason="Text output only."),
        "past_trajectory": OptionSupport(Support.NOT_APPLICABLE, reason="No trajectory execution is built."),
    }
