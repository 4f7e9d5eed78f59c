"""What the text plugin adds to ``ifb serve`` and ``LLM(...)``, and its request option.

Light on purpose (no torch): ``ifb serve --help`` and ``ifb matrix`` import it.
"""

from __future__ import annotations

import click

from ifb import hookimpl
from ifb.capabilities import DeploySetting
from ifb_plugins.common.runtime.caps import SYSTEM_PROMPT_CAPTURE

#: ``--quantization``: how a GGUF's matrices run (``build.QUANTIZATION_MODES``)
QUANTIZATION_CHOICES = ("auto", "int16", "int8-prompt", "int8", "weights-only", "none")
#: ``--kv-cache-dtype`` (``build.KV_CACHE_DTYPES``)
KV_CACHE_DTYPE_CHOICES = ("auto", "float32", "float16")
#: ``--speculative-method``: the draft source
SPECULATIVE_METHODS = ("ngram", "draft-model")
#: ``--speculative-policy``: auto drafts only where it pays (``ifb.speculative.SpeculationPolicy``)
SPECULATIVE_POLICIES = ("auto", "always")

SETTINGS = (
    DeploySetting(
        name="quantization", type=click.Choice(QUANTIZATION_CHOICES), default="auto",
        help="auto: a GGUF's blocks times activations quantized to ~15 bits; int16: the same; int8-prompt: "
             "8 bits on prompt tokens, ~15 on generated ones (faster prefill); int8: 8 bits everywhere (faster, "
             "coarser); weights-only: times float32 activations; none: dequantize to fp32."),
    DeploySetting(
        name="kv_cache_dtype", type=click.Choice(KV_CACHE_DTYPE_CHOICES), default="auto",
        help="KV cache precision; auto: float16 with integer activations (auto, int8), else float32."),
    DeploySetting(
        name="speculative_method", type=click.Choice(SPECULATIVE_METHODS), metavar="METHOD",
        help="Speculative decoding's draft source: ngram (prompt lookup, no extra model) or draft-model "
             "(--speculative-model; implied by it)."),
    DeploySetting(
        name="speculative_model", type=str, metavar="NAME|PATH",
        help="The draft model: a checkpoint or GGUF with the target's vocabulary (the target's own GGUF "
             "included, on --speculative-quantization's kernels)."),
    DeploySetting(
        name="speculative_quantization", type=click.Choice(QUANTIZATION_CHOICES), default="int8",
        help="How a GGUF draft model's matrices run (as --quantization)."),
    DeploySetting(
        name="num_speculative_tokens", type=int, metavar="K",
        help="The most tokens drafted per request and step (1..16; default 4)."),
    DeploySetting(name="ngram_min", type=int, metavar="N", help="The shortest suffix n-gram looked up (default 2)."),
    DeploySetting(name="ngram_max", type=int, metavar="N", help="The longest suffix n-gram looked up (default 4)."),
    DeploySetting(
        name="speculative_policy", type=click.Choice(SPECULATIVE_POLICIES), default="auto",
        help="auto: draft per request and step only where the expected accepted tokens pay for the longer "
             "step (busy batches, low acceptance draft less or not at all); always: draft K every step."),
    DeploySetting(
        name="speculative_position_cost", type=float, metavar="X",
        help="The policy's cost of one more verified position, relative to a one-token step (default: measured)."),
    DeploySetting(
        name="speculative_draft_cost", type=float, metavar="X",
        help="The policy's cost of one drafted token, relative to a one-token target step (default: the draft "
             "model's weight bytes over the target's; 0 for ngram)."),
)


@hookimpl
def ifb_deploy_settings():
    return list(SETTINGS)


@hookimpl
def ifb_request_options():
    # the capture is the shared runtime's; the text plugin, which every built-in deployment builds on,
    # registers the row once
    return [SYSTEM_PROMPT_CAPTURE]
