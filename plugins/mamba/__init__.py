"""The mamba plugin: hybrid recurrent / attention decoders (Nemotron-H and Nemotron 3, Bamba, Granite 4.0
hybrid; Qwen3.5 with Gated DeltaNet layers, and its image-text model) under in-flight batching.

Each seat holds its own conv and SSM state beside the paged attention KV;
joiners prefill in place. Under ``--enable-context-reuse`` the runtime keeps
recurrent-state checkpoints beside the published KV blocks
(``checkpoints``), so a joiner resumes a shared prefix from its state.
"""

from __future__ import annotations

from ifb import hookimpl
from ifb.capabilities import DeployConfig, DeploymentCaps, DeploymentKind, OptionSupport, Support
from ifb.gate import UnsupportedDeployment
from ifb.options import BLOCKING
from ifb_plugins.common.runtime.caps import TEXT_ENDPOINTS
from ifb_plugins.mamba.options import ifb_deploy_settings  # noqa: F401 - its hook

#: seats are allocated per deployment (--max-batch-size); this bounds what may be asked
MAX_BUILT_BATCH = 256



IMAGE_REASON = ("No visual-token pruner is built for hybrid models: images are encoded at admission and image "
                "requests join the running batch like any other.")


def has_image_input(config: DeployConfig) -> bool:
    """Whether the deployment's checkpoint is an image-text model (Qwen3.5's): its config.json has a vision_config."""
    import json
    from pathlib import Path

    if not config.model:
        return False
    file = Path(config.model).expanduser() / "config.json"
    try:
        return "vision_config" in json.loads(file.read_text())
    except (OSError, ValueError, TypeError):
        return False  # a GGUF file, or no readable config: the loader names the problem


def mamba_options(has_images: bool = False) -> dict[str, OptionSupport]:
    """Per-request option support of the hybrid runtime under in-flight batching."""
    return {
        # every row of a step samples with its own parameters (ifb_plugins.common.decoding.sampling)
        "differing_sampling": OptionSupport(Support.SERVED, reason="Sampling is per sequence."),
        "n_sequences": OptionSupport(
            Support.REJECTED, reason="n > 1 sequences share the prompt's KV blocks; a recurrent state is not forked.",
            alternative=BLOCKING),
        # No adapter loader is built for this model, so no path serves a per-request adapter.
        "lora": OptionSupport(Support.NOT_APPLICABLE, reason="No LoRA adapters are built for hybrid Mamba models."),
        # The legacy capture is not built here; the context cache covers the shared-prefix case.
        "save_system_prompt_kv_cache": OptionSupport(
            Support.NOT_APPLICABLE, reason="The legacy capture is not built for hybrid models; the context cache "
                                           "(--enable-context-reuse) reuses a shared prefix with its recurrent-state "
                                           "checkpoint."),
        "guided_decoding": OptionSupport(Support.NOT_APPLICABLE, reason="No guided decoder is built."),
        "media_under_pruner": OptionSupport(Support.SERVED, reason=IMAGE_REASON) if has_images else
        OptionSupport(Support.NOT_APPLICABLE, reason="Text input only (the image-text Qwen3.5 checkpoints take images)."),
        "generate_audio": OptionSupport(Support.NOT_APPLICABLE, reason="Text output only."),
        "past_trajectory": OptionSupport(Support.NOT_APPLICABLE, reason="No trajectory execution is built."),
    }


def declare(config: DeployConfig) -> DeploymentCaps:
    # the core resolves --device before declaring; None only where a caller declares a raw config
    device = config.device or "cpu"
    return DeploymentCaps(
        tensor_parallel_note="the Mamba-2 mixers' per-seat conv and SSM state are not sharded over ranks",
        stepped_execution=True, seated_admission=True, max_batch_size=MAX_BUILT_BATCH,
        num_ranks=config.num_ranks,
        # Proven on CPU by tests/plugins/mamba (batched greedy == alone, bit for bit); not on CUDA yet.
        batch_invariant_verified=device == "cpu",
        options=mamba_options(has_image_input(config)), endpoints=dict(TEXT_ENDPOINTS),
        # tests/plugins/context_cache/test_hybrid.py: output with reuse == without, alone and batched
        supports_prefix_reuse=True,
    )


def load(config: DeployConfig):
    from ifb_plugins.mamba.runtime import load_hybrid_runtime

    if config.options.get("hybrid_checkpoint_interval") is not None and not config.enable_context_reuse:
        raise UnsupportedDeployment("--hybrid-checkpoint-interval sets how often prefix reuse keeps the recurrent "
                                    "state: add --enable-context-reuse")
    return load_hybrid_runtime(config, declare(config))


@hookimpl
def ifb_deployment_kinds():
    return [DeploymentKind(
        name="mamba", plugin="mamba", title="Hybrid Mamba (Nemotron-H, Bamba, Granite 4.0 hybrid)", declare=declare,
        load=load, settings=frozenset({"served_model_name", "max_model_len", "hybrid_checkpoint_interval",
                                       "allowed_local_media_path"}),
        description="Hybrid Mamba-2 or Gated DeltaNet / attention decoder from a Hugging Face Nemotron-H (and "
                    "Nemotron 3), Bamba, Granite 4.0 hybrid or Qwen3.5 (dense, MoE; text or image-text, images through Qwen3-VL's vision tower) safetensors directory, or a Nemotron-H / Nemotron 3 / Granite hybrid / Qwen3.5 GGUF file")]
