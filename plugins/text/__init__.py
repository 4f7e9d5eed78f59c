"""The text plugin: Llama-family decoders (Llama, Qwen2/3, SmolLM, Mistral) under in-flight batching."""

from __future__ import annotations

from ifb import hookimpl
from ifb.capabilities import (
    DeployConfig, DeploymentCaps, DeploymentKind, EndpointSupport, OptionSupport, Support,
)
from ifb.options import BLOCKING

#: the runtime has no fixed batch dimension; this bounds the seat count it accepts
MAX_BUILT_BATCH = 256

#: the ``DeployConfig.options`` every deployment on ``TextRuntime`` reads (its loader: the name and
#: adapters; the runtime: the context limit); the text loader adds its kernels' and cache's
TEXT_RUNTIME_SETTINGS = frozenset({"served_model_name", "lora_adapters", "max_model_len"})
TEXT_SETTINGS = TEXT_RUNTIME_SETTINGS | {"quantization", "kv_cache_dtype"}

TEXT_ENDPOINTS = {"completions": EndpointSupport.SERVED, "chat.completions": EndpointSupport.SERVED}


def text_options() -> dict[str, OptionSupport]:
    """Per-request option support of the text runtime under in-flight batching."""
    return {
        # sampling is per sequence in the batch (plugins/text/sampling.py)
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


def declare(config: DeployConfig) -> DeploymentCaps:
    return DeploymentCaps(
        stepped_execution=True, seated_admission=True, max_batch_size=MAX_BUILT_BATCH,
        num_ranks=config.num_ranks, batch_invariant_verified=True, options=text_options(),
        endpoints=dict(TEXT_ENDPOINTS),
    )


def load(config: DeployConfig):
    from ifb_plugins.text.build import load_text_runtime

    return load_text_runtime(config, declare(config))


@hookimpl
def ifb_deployment_kinds():
    return [DeploymentKind(
        name="text", plugin="text", title="Text LLM, single rank", declare=declare, load=load,
        description="Llama-family decoder from a GGUF file or a Hugging Face safetensors directory",
        settings=TEXT_SETTINGS)]


@hookimpl
def ifb_resolve_model(name, plugin):
    if plugin not in ("text",):
        return None
    from ifb_plugins.text.default_model import resolve_model

    return str(resolve_model(name))
