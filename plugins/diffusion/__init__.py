"""The diffusion plugin: DiffusionGemma, a block-diffusion language model, as transformers defines it.

``diffusion`` (title "Diffusion backbone"): the Gemma-4-style text backbone
(sliding and full attention, bidirectional inside a canvas, two RoPE variants,
soft-capped logits, a dense MLP beside routed experts in every layer) from a
directory transformers' ``save_pretrained`` wrote, and the reference's
block-diffusion sampler. The spec keeps a diffusion backbone on the blocking
path ("cannot reseat mid-request"); here each engine step is one denoising
step of every resident, their canvases sharing one forward, so a request joins
at a step boundary, leaves when its last block is done, and is served under
in-flight batching (its answer the same as alone).

See docs/plugins/diffusion.md.
"""

from __future__ import annotations

import click

from ifb import hookimpl
from ifb.capabilities import DeployConfig, DeploymentCaps, DeploymentKind, DeploySetting, OptionSupport, Support
from ifb_plugins.common.runtime.caps import MAX_BUILT_BATCH, TEXT_ENDPOINTS

TITLE = "Diffusion backbone"

#: the sampler settings a deployment may override (else the checkpoint's generation_config.json, else the
#: reference's defaults); each an ``ifb serve --diffusion-*`` flag and an ``LLM(diffusion_*=...)`` keyword
SETTINGS = (
    DeploySetting(name="diffusion_steps", type=click.IntRange(min=1),
                  help="Most denoising steps per block (DiffusionGemma's max_denoising_steps; reference 48)."),
    DeploySetting(name="diffusion_t_min", type=click.FloatRange(min=0.0),
                  help="The temperature schedule's last (lowest) temperature, t_min (reference 0.4)."),
    DeploySetting(name="diffusion_t_max", type=click.FloatRange(min=0.0, min_open=True),
                  help="The temperature schedule's first temperature, t_max (reference 0.8)."),
    DeploySetting(name="diffusion_entropy_bound", type=click.FloatRange(min=0.0, min_open=True),
                  help="Entropy-bound acceptance: the most summed entropy, less the largest, accepted per step "
                       "(reference 0.1)."),
    DeploySetting(name="diffusion_stability", type=click.IntRange(min=0),
                  help="Steps the argmax must stay unchanged for a block to stop early (reference 1)."),
    DeploySetting(name="diffusion_confidence", type=click.FloatRange(min=0.0, min_open=True),
                  help="Mean entropy under which a stable block stops early (reference 0.005)."),
)
#: ``DeployConfig.options`` keys -> ``SamplerSettings`` fields
SAMPLER_FIELDS = {
    "diffusion_steps": "max_denoising_steps", "diffusion_t_min": "t_min", "diffusion_t_max": "t_max",
    "diffusion_entropy_bound": "entropy_bound", "diffusion_stability": "stability_threshold",
    "diffusion_confidence": "confidence_threshold",
}


def diffusion_options() -> dict[str, OptionSupport]:
    """What the block-diffusion runtime does with each request option, on either path."""
    no_grammar = "The block-diffusion sampler accepts tokens by entropy, with no grammar matcher."
    return {
        "differing_sampling": OptionSupport(
            Support.SERVED, reason="Each request has its own sampler, temperature and random numbers."),
        "lora": OptionSupport(Support.NOT_APPLICABLE, reason="No LoRA adapters are built for DiffusionGemma."),
        "guided_decoding": OptionSupport(Support.NOT_APPLICABLE, reason=no_grammar),
        "media_under_pruner": OptionSupport(Support.NOT_APPLICABLE, reason="Text input only."),
        "generate_audio": OptionSupport(Support.NOT_APPLICABLE, reason="Text output only."),
        "past_trajectory": OptionSupport(Support.NOT_APPLICABLE, reason="No trajectory execution is built."),
        "save_system_prompt_kv_cache": OptionSupport(
            Support.NOT_APPLICABLE, reason="Each request encodes its own prompt; no capture is built."),
        "n_sequences": OptionSupport(Support.NOT_APPLICABLE, reason="One sequence per request."),
    }


def declare(config: DeployConfig) -> DeploymentCaps:
    # batch invariance: tests/plugins/diffusion/test_batching.py (staggered joins, answers equal to alone)
    return DeploymentCaps(
        tensor_parallel_note="the denoising loop over a block runs on one rank; the model is not sharded",
        stepped_execution=True, seated_admission=True, max_batch_size=MAX_BUILT_BATCH, num_ranks=config.num_ranks,
        batch_invariant_verified=True, options=diffusion_options(), endpoints=dict(TEXT_ENDPOINTS),
        supports_prefix_reuse=False,
        prefix_reuse_note="a request's prompt KV is encoded for it alone; no prefix reuse is built")


def load(config: DeployConfig):
    from pathlib import Path

    from ifb_plugins.diffusion.loader import load_diffusion_dir
    from ifb_plugins.diffusion.runtime import DiffusionRuntime

    if not config.model:
        raise FileNotFoundError("the diffusion deployment has no default model: give a DiffusionGemma checkpoint "
                                "directory (as transformers' save_pretrained writes it)")
    from ifb_plugins.common.runtime.placement import float32_only

    # the denoiser is built (and tested) in float32 on the CPU: --dtype auto is float32 here
    float32_only(config, "the diffusion deployment")
    overrides = {field: config.options.get(key) for key, field in SAMPLER_FIELDS.items()}
    loaded = load_diffusion_dir(config.model, overrides)
    name = config.options.get("served_model_name") or Path(config.model).name
    return DiffusionRuntime(loaded=loaded, caps=declare(config), config=config, model_name=name)


@hookimpl
def ifb_deployment_kinds():
    return [DeploymentKind(
        name="diffusion", plugin="diffusion", title=TITLE, declare=declare, load=load,
        settings=frozenset({"served_model_name", "max_model_len", *SAMPLER_FIELDS}), device_types=frozenset({"cpu"}),
        description="DiffusionGemma (block diffusion: canvases denoised with entropy-bound acceptance) "
                    "from a Hugging Face safetensors directory")]


@hookimpl
def ifb_deploy_settings():
    return list(SETTINGS)
