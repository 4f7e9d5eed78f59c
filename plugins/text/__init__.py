"""The text plugin: Llama-family decoders (Llama, Qwen2/3, SmolLM, Mistral) and the mixture-of-experts
Mixtral, Qwen2-MoE and Qwen3-MoE under in-flight batching."""

from __future__ import annotations

from ifb import hookimpl
from ifb.capabilities import DeployConfig, DeploymentCaps, DeploymentKind, MatrixVariant, OptionSupport, Support
from ifb_plugins.common.runtime.caps import MAX_BUILT_BATCH, TEXT_ENDPOINTS, TEXT_RUNTIME_SETTINGS, text_options
from ifb_plugins.text.options import SETTINGS, ifb_deploy_settings, ifb_request_options  # noqa: F401 - hooks
from ifb_plugins.text.speculation import speculation_caps

TEXT_SETTINGS = TEXT_RUNTIME_SETTINGS | {setting.name for setting in SETTINGS}


#: how a tensor-parallel deployment differs (its ranks run only the scheduled steps)
_TP_OPTIONS = {
    "lora": OptionSupport(
        Support.SERVED, reason="Each rank holds its share of every adapter (B's rows of Q/K/V and gate/up, A's "
                               "columns of O and down), loaded at start-up (--lora NAME=DIR); rows grouped by "
                               "adapter as on one rank. Loading adapters while serving is refused."),
    "save_system_prompt_kv_cache": OptionSupport(
        Support.NOT_APPLICABLE, reason="The legacy capture prefills outside the scheduled steps the ranks run.",
        alternative="Use the context cache (--enable-context-reuse)."),
}


def declare(config: DeployConfig) -> DeploymentCaps:
    options = text_options(context_reuse=config.enable_context_reuse)
    if config.num_ranks > 1:
        options.update(_TP_OPTIONS)
    return DeploymentCaps(
        stepped_execution=True, seated_admission=True, max_batch_size=MAX_BUILT_BATCH,
        # proven on the CPU (tests/plugins/text); on CUDA (the Triton kernels) tests/gpu has yet to run on a device
        num_ranks=config.num_ranks, batch_invariant_verified=(config.device or "cpu") == "cpu", options=options,
        endpoints=dict(TEXT_ENDPOINTS), supports_tensor_parallel=True, speculation=speculation_caps(config),
    )


#: the rows of ``ifb matrix``: the plain deployment, tensor parallelism, speculative decoding
VARIANTS = (
    MatrixVariant("Text LLM, single rank", DeployConfig(plugin="text", enable_in_flight_batching=True)),
    MatrixVariant("Text LLM, tensor parallelism", DeployConfig(plugin="text", enable_in_flight_batching=True, num_ranks=2),
                  note="--tensor-parallel-size N: ranks spawned on this machine or started by torchrun (gloo on "
                       "CPU, NCCL on CUDA); a GGUF's matrices on their blocks as on one rank (row-parallel splits "
                       "along whole blocks; a split that would cut one is refused at load), float32 otherwise; "
                       "mixture-of-experts layers replicated on every rank."),
    MatrixVariant(
        "Speculative decoding (draft model, n-gram prompt lookup)",
        DeployConfig(plugin="text", enable_in_flight_batching=True, options={"speculative_method": "ngram"}),
        note="Drafts verified in the step's one forward for every seat (K + 1 positions a speculating seat, "
             "prefill chunks beside them); greedy output bit-identical to plain decoding, sampled output "
             "by rejection sampling with each request's own parameters; drafting stops per request and step "
             "where it costs more than it saves. The blocking path serves it too; one rank only (refused "
             "with --tensor-parallel-size)."),
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
        settings=TEXT_SETTINGS, is_default=True, variants=VARIANTS)]


@hookimpl
def ifb_resolve_model(name, plugin):
    if plugin not in ("text",):
        return None
    from ifb_plugins.text.default_model import resolve_model

    return str(resolve_model(name))
