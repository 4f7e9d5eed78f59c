"""The action plugin: vision-language-action models whose requests carry a past trajectory (the robot
state) and return a planned one. pi0, as transformers defines and saves it, is the reference.

A request is one user message (camera images and the task) plus a ``trajectory`` content part; the
backbone runs the prefix, the action expert denoises ``chunk_size`` actions over the flow-matching
steps, and the answer's ``output_trajectory`` holds them. Served step by step on both paths; under
``--enable-in-flight-batching`` the prefixes completed in a step prefill as one batch and every seated
request's Euler step runs in one forward (tests/plugins/action/test_batching.py: each plan the same as
the request's alone, within 1e-5, with requests joining mid-flight).
"""

from __future__ import annotations

import logging

from ifb import hookimpl
from ifb.capabilities import (
    DeployConfig, DeploymentCaps, DeploymentKind, EndpointSupport, MatrixVariant, OptionSupport, Support,
)
from ifb_plugins.common.runtime.caps import MAX_BUILT_BATCH

log = logging.getLogger("ifb.action")

NOT_TEXT = "pi0 answers with a planned trajectory; it generates no text."


def action_options() -> dict[str, OptionSupport]:
    return {
        "plain_text": OptionSupport(
            Support.SERVED, reason="pi0 generates no text: its answer is the plan (streamed as one last chunk); every "
                                   "request carries a trajectory (the pastTrajectory row)."),
        "past_trajectory": OptionSupport(
            Support.SERVED, reason="The prefixes completed in a step prefill as one batch (each its own paged KV); "
                                   "the seated requests' Euler steps run as one forward, each its own prefix KV, "
                                   "state and noise; a request joins at a step boundary."),
        "differing_sampling": OptionSupport(
            Support.SERVED, reason="pi0 samples no tokens: each request's plan follows from its own noise "
                                   "(noise_seed)."),
        "media_under_pruner": OptionSupport(
            Support.SERVED, reason="No visual-token pruner: the camera images are part of every request's prefix."),
        "guided_decoding": OptionSupport(Support.NOT_APPLICABLE, reason=NOT_TEXT),
        "generate_audio": OptionSupport(Support.NOT_APPLICABLE, reason=NOT_TEXT),
        "save_system_prompt_kv_cache": OptionSupport(Support.NOT_APPLICABLE, reason="No system-prompt capture is built."),
        "lora": OptionSupport(Support.NOT_APPLICABLE, reason="No LoRA adapters are built for pi0."),
        "n_sequences": OptionSupport(Support.NOT_APPLICABLE, reason="One plan per request (send several requests)."),
    }


def declare(config: DeployConfig) -> DeploymentCaps:
    # batch invariance: tests/plugins/action/test_batching.py (staggered joins, plans equal to alone)
    return DeploymentCaps(
        tensor_parallel_note="the action expert and its denoising loop run on one rank; they are not sharded",
        stepped_execution=True, seated_admission=True, max_batch_size=MAX_BUILT_BATCH,
        num_ranks=config.num_ranks, batch_invariant_verified=True, options=action_options(),
        endpoints={"chat.completions": EndpointSupport.SERVED, "completions": EndpointSupport.ABSENT},
        supports_prefix_reuse=False, prefix_reuse_note="pi0's prefix is bidirectional and computed whole per request.",
    )


def load(config: DeployConfig):
    from pathlib import Path

    from ifb_plugins.action.checkpoint import load_pi0
    from ifb_plugins.action.processor import Pi0Processing
    from ifb_plugins.action.runtime import ActionRuntime
    from ifb_plugins.common.chat.tokenizer import TextTokenizer

    if not config.model:
        raise ValueError("the action plugin has no default model: pass a pi0 checkpoint directory")
    from ifb_plugins.common.runtime.placement import float32_only

    # pi0 is built (and tested) in float32 on the CPU: --dtype auto is float32 here
    float32_only(config, "the action deployment")
    path = Path(config.model).expanduser()
    model = load_pi0(path)
    name = config.options.get("served_model_name") or path.name
    cfg = model.cfg
    log.info("loaded %s (pi0: plans %d actions of %d values in %d flow-matching steps)", name, cfg.chunk_size,
             cfg.max_action_dim, cfg.num_inference_steps)
    return ActionRuntime(model=model, processing=Pi0Processing.from_dir(path), tokenizer=TextTokenizer.from_hf_dir(path),
                         caps=declare(config), config=config, model_name=name)


VARIANTS = (
    MatrixVariant("Vision-language-action (pi0 trajectory planning)",
                  DeployConfig(plugin="action", enable_in_flight_batching=True),
                  note="Prefixes prefilled and Euler steps run batched, requests joining at step boundaries; "
                       "each plan within 1e-5 of the request's alone (float32), the pastTrajectory row."),
)


@hookimpl
def ifb_deployment_kinds():
    return [DeploymentKind(
        name="action", plugin="action", title="Vision-language-action (pi0 trajectory planning)", declare=declare,
        load=load, variants=VARIANTS, settings=frozenset({"allowed_local_media_path", "served_model_name"}),
        device_types=frozenset({"cpu"}),
        description="pi0 checkpoints as transformers saves them: PaliGemma backbone, action expert, "
                    "flow-matching sampler; the request's trajectory in, the planned one out")]
