"""The diffusion plugin: DiffusionGemma, a block-diffusion language model, as transformers defines it.

``diffusion`` (title "Diffusion backbone"): the Gemma-4-style text backbone
(sliding and full attention, bidirectional inside a canvas, two RoPE variants,
soft-capped logits, a dense MLP beside routed experts in every layer) from a
directory transformers' ``save_pretrained`` wrote, and the reference's
block-diffusion sampler. A request is not a sequence of token steps: each block
is denoised over many forwards and finished whole, so the engine cannot seat a
request into a running batch mid-request; ``--enable-in-flight-batching`` is
refused at start-up and the deployment serves one request at a time.

See docs/plugins/diffusion.md.
"""

from __future__ import annotations

import click

from ifb import hookimpl
from ifb.capabilities import DeployConfig, DeploymentCaps, DeploymentKind, DeploySetting, OptionSupport, Support
from ifb_plugins.common.caps import TEXT_ENDPOINTS

TITLE = "Diffusion backbone"
#: why the stepped loop cannot drive it (the gate shows it at start-up; the matrix row too)
NOTE = ("cannot reseat mid-request: a block-diffusion request denoises each block over many forwards and "
        "finishes it whole, which the engine's token steps do not drive")

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
    """What the block-diffusion runtime does with each request option (on its only path, the blocking one)."""
    no_grammar = "The block-diffusion sampler accepts tokens by entropy, with no grammar matcher."
    return {
        "guided_decoding": OptionSupport(Support.NOT_APPLICABLE, reason=no_grammar),
        "media_under_pruner": OptionSupport(Support.NOT_APPLICABLE, reason="Text input only."),
        "generate_audio": OptionSupport(Support.NOT_APPLICABLE, reason="Text output only."),
        "past_trajectory": OptionSupport(Support.NOT_APPLICABLE, reason="No trajectory execution is built."),
        "lora": OptionSupport(Support.NOT_APPLICABLE, reason="No LoRA adapters are built for DiffusionGemma."),
        "save_system_prompt_kv_cache": OptionSupport(
            Support.NOT_APPLICABLE, reason="Each request encodes its own prompt; no capture is built."),
        "n_sequences": OptionSupport(Support.NOT_APPLICABLE, reason="One sequence per request."),
    }


def declare(config: DeployConfig) -> DeploymentCaps:
    return DeploymentCaps(
        stepped_execution=False, seated_admission=False, max_batch_size=1, num_ranks=config.num_ranks,
        options=diffusion_options(), endpoints=dict(TEXT_ENDPOINTS), notes=NOTE, supports_prefix_reuse=False,
        prefix_reuse_note="a request's prompt KV is encoded for it alone; no prefix reuse is built")


def load(config: DeployConfig):
    from pathlib import Path

    from ifb_plugins.diffusion.loader import load_diffusion_dir
    from ifb_plugins.diffusion.runtime import DiffusionRuntime

    if not config.model:
        raise FileNotFoundError("the diffusion deployment has no default model: give a DiffusionGemma checkpoint "
                                "directory (as transformers' save_pretrained writes it)")
    overrides = {field: config.options.get(key) for key, field in SAMPLER_FIELDS.items()}
    loaded = load_diffusion_dir(config.model, overrides)
    name = config.options.get("served_model_name") or Path(config.model).name
    return DiffusionRuntime(loaded=loaded, caps=declare(config), config=config, model_name=name)


@hookimpl
def ifb_deployment_kinds():
    return [DeploymentKind(
        name="diffusion", plugin="diffusion", title=TITLE, declare=declare, load=load,
        settings=frozenset({"served_model_name", "max_model_len", *SAMPLER_FIELDS}),
        description="DiffusionGemma (block diffusion: canvases denoised with entropy-bound acceptance) "
                    "from a Hugging Face safetensors directory")]


@hookimpl
def ifb_deploy_settings():
    return list(SETTINGS)
