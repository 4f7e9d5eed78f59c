"""What the text plugin adds to ``ifb serve`` and ``LLM(...)``, and its request option.

Light on purpose (no torch): ``ifb serve --help`` and ``ifb matrix`` import it.
"""

from __future__ import annotations

import click

from ifb import hookimpl
from ifb.capabilities import DeploySetting
from ifb_plugins.common.runtime.caps import SYSTEM_PROMPT_CAPTURE

#: ``--quantization``: how a GGUF's matrices run (``build.QUANTIZATION_MODES``)
QUANTIZATION_CHOICES = ("auto", "int8", "weights-only", "none")
#: ``--kv-cache-dtype`` (``build.KV_CACHE_DTYPES``)
KV_CACHE_DTYPE_CHOICES = ("auto", "float32", "float16")

SETTINGS = (
    DeploySetting(
        name="quantization", type=click.Choice(QUANTIZATION_CHOICES), default="auto",
        help="auto: a GGUF's blocks times activations quantized to ~15 bits; int8: to 8 bits (faster, "
             "coarser); weights-only: times float32 activations; none: dequantize to fp32."),
    DeploySetting(
        name="kv_cache_dtype", type=click.Choice(KV_CACHE_DTYPE_CHOICES), default="auto",
        help="KV cache precision; auto: float16 with integer activations (auto, int8), else float32."),
)


@hookimpl
def ifb_deploy_settings():
    return list(SETTINGS)


@hookimpl
def ifb_request_options():
    # the capture is the shared runtime's; the text plugin, which every built-in deployment builds on,
    # registers the row once
    return [SYSTEM_PROMPT_CAPTURE]
