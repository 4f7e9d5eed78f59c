"""The text plugin: Llama-family decoders (Llama, Qwen2/3, SmolLM, Mistral) and the mixture-of-experts
Mixtral, Qwen2-MoE and Qwen3-MoE under in-flight batching."""

from __future__ import annotations

from ifb import hookimpl
from ifb.capabilities import DeployConfig, DeploymentCaps, DeploymentKind
from ifb_plugins.common.runtime.caps import MAX_BUILT_BATCH, TEXT_ENDPOINTS, TEXT_RUNTIME_SETTINGS, text_options
from ifb_plugins.text.options import SETTINGS, ifb_deploy_settings, ifb_request_options  # noqa: F401 - hooks

TEXT_SETTINGS = TEXT_RUNTIME_SETTINGS | {setting.name for setting in SETTINGS}


def declare(config: DeployConfig) -> DeploymentCaps:
    return DeploymentCaps(
        stepped_execution=True, seated_admission=True, max_batch_size=MAX_BUILT_BATCH,
        num_ranks=config.num_ranks, batch_invariant_verified=True, options=text_options(context_reuse=config.enable_context_reuse),
        endpoints=dict(TEXT_ENDPOINTS),
    )


def load(config: DeployConfig):
    from ifb_plugins.text.build import load_text_runtime

    return load_text_runtime(config, declare(config))


@hookimpl
def ifb_deployment_kinds():
    return [DeploymentKind(
        name="text", plugin="text", title="Text LLM, single rank", declare=declare, load=load,
        description="Llama-family decoder (mixtures of experts included: Mixtral, Qwen2-MoE, Qwen3-MoE) "
                    "from a GGUF file or a Hugging Face safetensors directory",
        settings=TEXT_SETTINGS, is_default=True)]


@hookimpl
def ifb_resolve_model(name, plugin):
    if plugin not in ("text",):
        return None
    from ifb_plugins.text.default_model import resolve_model

    return str(resolve_model(name))
