"""The mamba plugin: hybrid Mamba-2 / attention decoders (Nemotron-H) under in-flight batching.

Each seat holds its own conv and SSM state beside the paged attention KV;
joiners prefill in place. Prefix reuse is refused: a reused prefix would need
the recurrent state at the prefix boundary, which is not checkpointed.
"""

from __future__ import annotations

from ifb import hookimpl
from ifb.capabilities import DeployConfig, DeploymentCaps, DeploymentKind, OptionSupport, Support
from ifb.options import BLOCKING
from ifb_plugins.common.caps import TEXT_ENDPOINTS
from ifb_plugins.mamba.options import ifb_deploy_settings  # noqa: F401 - its hook

#: seats are allocated per deployment (--max-batch-size); this bounds what may be asked
MAX_BUILT_BATCH = 256

PREFIX_REUSE_NOTE = ("prefix reuse needs a checkpoint of the recurrent (conv and SSM) state at the end of the "
                     "reused prefix, which hybrid Mamba deployments do not keep; the KV blocks alone are not enough")


def mamba_options() -> dict[str, OptionSupport]:
    """Per-request option support of the hybrid runtime under in-flight batching."""
    return {
        # every row of a step samples with its own parameters (ifb_plugins.common.sampling)
        "differing_sampling": OptionSupport(Support.SERVED, reason="Sampling is per sequence."),
        "n_sequences": OptionSupport(
            Support.REJECTED, reason="The engine batches across requests, not within one.", alternative=BLOCKING),
        # No adapter loader is built for this model, so no path serves a per-request adapter.
        "lora": OptionSupport(Support.NOT_APPLICABLE, reason="No LoRA adapters are built for hybrid Mamba models."),
        # The capture caches a prefix for later requests: the same recurrent-state gap as prefix reuse.
        "save_system_prompt_kv_cache": OptionSupport(
            Support.NOT_APPLICABLE, reason="A captured prefix would need a recurrent-state checkpoint, "
                                           "which this deployment does not keep."),
        "guided_decoding": OptionSupport(Support.NOT_APPLICABLE, reason="No guided decoder is built."),
        "media_under_pruner": OptionSupport(Support.NOT_APPLICABLE, reason="Text input only."),
        "generate_audio": OptionSupport(Support.NOT_APPLICABLE, reason="Text output only."),
        "past_trajectory": OptionSupport(Support.NOT_APPLICABLE, reason="No trajectory execution is built."),
    }


def declare(config: DeployConfig) -> DeploymentCaps:
    device = str(config.options.get("device") or "cpu")
    return DeploymentCaps(
        stepped_execution=True, seated_admission=True, max_batch_size=MAX_BUILT_BATCH,
        num_ranks=config.num_ranks,
        # Proven on CPU by tests/plugins/mamba (batched greedy == alone, bit for bit); not on CUDA yet.
        batch_invariant_verified=device == "cpu",
        options=mamba_options(), endpoints=dict(TEXT_ENDPOINTS),
        supports_prefix_reuse=False, prefix_reuse_note=PREFIX_REUSE_NOTE,
    )


def load(config: DeployConfig):
    from ifb_plugins.mamba.runtime import load_hybrid_runtime

    return load_hybrid_runtime(config, declare(config))


@hookimpl
def ifb_deployment_kinds():
    return [DeploymentKind(
        name="mamba", plugin="mamba", title="Hybrid Mamba (Nemotron-H)", declare=declare, load=load,
        settings=frozenset({"served_model_name", "max_model_len", "device"}),
        description="Hybrid Mamba-2 / attention decoder from a Hugging Face Nemotron-H safetensors directory")]
