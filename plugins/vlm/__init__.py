"""The vlm plugin: image and audio input under in-flight batching, for real checkpoints.

The model families (``families``: LLaVA, SmolVLM / Idefics3, Qwen2.5-VL, Qwen3-VL,
Qwen2-Audio, Qwen3-ASR, Gemma 4) are
chosen from the checkpoint's ``config.json``. Their encoders run at admission,
in ``prepare``; the projected embeddings replace the prompt's media tokens, so a
media request joins a running batch like any other. Under a visual-token pruner
(``visual_token_pruner``: the fraction of visual tokens kept) media requests are
founder-only.
"""

from __future__ import annotations

import logging
from typing import Any

from ifb import hookimpl
from ifb.capabilities import (
    DeployConfig, DeploymentCaps, DeploymentKind, EndpointSupport, MatrixVariant, OptionSupport, Support,
)
from ifb_plugins.common.runtime.caps import (
    MAX_BUILT_BATCH, TEXT_ENDPOINTS, TEXT_RUNTIME_SETTINGS, text_options,
)
from ifb_plugins.vlm.options import ifb_deploy_settings, ifb_request_options  # noqa: F401 - hooks

log = logging.getLogger("ifb.vlm")

PRUNER_OPTION = "visual_token_pruner"
PRUNER_REASON = ("Pruning runs only in the founding prefill; a seated prefill would skip it. "
                 "Text requests still join the running batch.")


def pruner_ratio(config: DeployConfig) -> float | None:
    """The fraction of visual tokens kept, or None when no pruner is configured (or it keeps them all)."""
    raw: Any = config.options.get(PRUNER_OPTION)
    if raw is None:
        return None
    try:
        ratio = float(raw)
    except (TypeError, ValueError):
        ratio = float("nan")
    if not 0.0 < ratio <= 1.0:  # also false for NaN
        raise ValueError(f"--visual-token-pruner must be the fraction of visual tokens kept, in (0, 1]; got {raw!r}")
    return None if ratio == 1.0 else ratio


def vlm_options(config: DeployConfig) -> dict[str, OptionSupport]:
    # n > 1, adapters on the decoder and the capture are the text runtime's, proven with media by tests/plugins/vlm
    options = text_options(context_reuse=config.enable_context_reuse)
    if pruner_ratio(config) is not None:
        options["media_under_pruner"] = OptionSupport(
            Support.FOUNDER_ONLY, reason=PRUNER_REASON, stall_counter="stalls_incompatible")
    else:
        options["media_under_pruner"] = OptionSupport(
            Support.SERVED, reason="No visual-token pruner is configured: encoders run at admission and media "
                                   "requests join the running batch. Under --visual-token-pruner they are "
                                   "founder-only.")
    return options


def declare(config: DeployConfig) -> DeploymentCaps:
    # Verified by tests/plugins/vlm on the CPU: batched greedy output of media requests equals their output
    # alone; not yet on a CUDA device.
    return DeploymentCaps(
        tensor_parallel_note="the vision and audio encoders and the media splice run on one rank; the decoder is not sharded with them",
        stepped_execution=True, seated_admission=True, max_batch_size=MAX_BUILT_BATCH,
        num_ranks=config.num_ranks, batch_invariant_verified=(config.device or "cpu") == "cpu",
        options=vlm_options(config),
        # transcription is a chat request with the clip; a checkpoint without an audio encoder refuses it
        endpoints={**TEXT_ENDPOINTS, "audio.transcriptions": EndpointSupport.SERVED},
    )


def load(config: DeployConfig):
    from pathlib import Path

    from ifb_plugins.common.runtime.lora import lora_set, prefixed_names
    from ifb_plugins.common.runtime.placement import device_of, float32_only
    from ifb_plugins.vlm.checkpoint import TEXT_MODEL_PREFIXES, TEXT_PREFIXES
    from ifb_plugins.vlm.families import load_vlm
    from ifb_plugins.vlm.runtime import VlmRuntime

    caps = declare(config)
    if not config.model:
        raise ValueError("the vlm plugin has no default model: pass a multimodal checkpoint directory")
    path = Path(config.model).expanduser()
    # the towers and the decoder are built in float32 (tests/plugins/vlm), on the deployment's device
    float32_only(config, "the vlm deployment")
    loaded = load_vlm(path, device_of(config))
    name = config.options.get("served_model_name") or path.name
    # an adapter made on the whole multimodal model names the decoder's modules as the checkpoint nests them
    # (one made on the decoder alone, as the decoder does)
    lora = lora_set(loaded.text_model, config,
                    prefixed_names((*TEXT_PREFIXES, *TEXT_MODEL_PREFIXES, ("model.layers.", "model.layers."))))
    ratio = pruner_ratio(config)
    log.info("loaded %s (%s; media: %s; visual-token pruner: %s)", name, loaded.family,
             ", ".join(loaded.encoders), f"keeps {ratio:g}" if ratio is not None else "off")
    return VlmRuntime(loaded=loaded, caps=caps, config=config, model_name=name, pruner_ratio=ratio, lora=lora)


# The pruner variant comes first: ``ifb matrix`` derives the request-level table (whose row is "Media
# under an active visual-token pruner") and the context-cache row from a kind's first variant.
VARIANTS = (
    MatrixVariant("Vision / audio input under a visual-token pruner",
                  DeployConfig(plugin="vlm", enable_in_flight_batching=True, options={PRUNER_OPTION: 0.5}),
                  note="Media requests are founder-only: they wait for the batch to drain and found the next "
                       "one (pruning runs only in the founding prefill); text requests still join."),
    MatrixVariant("Vision / audio input (multimodal)", DeployConfig(plugin="vlm", enable_in_flight_batching=True),
                  note="Encoders run at admission; media requests join a running batch like any other."),
)


@hookimpl
def ifb_deployment_kinds():
    return [DeploymentKind(
        name="vlm", plugin="vlm", title="Vision / audio input (multimodal)", declare=declare, load=load,
        variants=VARIANTS,
        # its own loader: the text plugin's quantization and KV cache settings are not read
        settings=TEXT_RUNTIME_SETTINGS | {PRUNER_OPTION, "allowed_local_media_path"},
        description="Hugging Face multimodal checkpoints: LLaVA (CLIP or SigLIP tower), SmolVLM / Idefics3, "
                    "Qwen2-Audio, Qwen3-ASR, Gemma 4 (images and audio); encoders at admission, the shared decoders")]
