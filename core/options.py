"""The registry of request options: the rows of the request-level matrix.

These are the options of the request API itself; plugins add theirs (media,
audio output, ...) through the ``ifb_request_options`` hook. A deployment
declares its support per option name; undeclared options get the default.
"""

from __future__ import annotations

from ifb.capabilities import OptionSupport, RequestOption, Support
from ifb.params import RequestSpec

BLOCKING = "Use the blocking path (serve without --enable-in-flight-batching)."


def _extra(name: str):
    return lambda spec: bool(spec.extras.get(name))


def has_media(spec: RequestSpec) -> bool:
    """Whether a request carries media: ``extras["media"]`` or a non-text content part in its messages."""
    if spec.extras.get("media"):
        return True
    for message in spec.messages or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, (list, tuple)) and any(
                not isinstance(part, dict) or part.get("type") != "text" for part in content):
            return True
    return False


def _is_guided(spec: RequestSpec) -> bool:
    fmt = spec.extras.get("response_format")
    return fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text")


BUILTIN_OPTIONS: tuple[RequestOption, ...] = (
    RequestOption(
        name="plain_text", title="Plain text generation, streaming, logprobs, stop strings",
        uses=lambda spec: True, default=OptionSupport(Support.SERVED), order=0),
    RequestOption(
        name="differing_sampling", title="Sampling parameters that differ from the resident batch",
        uses=lambda spec: True, relative_to_batch=True, order=10,
        default=OptionSupport(
            Support.FOUNDER_ONLY, reason="Sampling is batch-wide; an incompatible head waits for its own batch.",
            stall_counter="stalls_incompatible")),
    RequestOption(
        name="guided_decoding", title="Guided decoding (grammar / JSON)",
        uses=_is_guided, order=20,
        default=OptionSupport(
            Support.REJECTED, reason="This deployment has no guided decoder.",
            alternative="Use a deployment whose plugin declares guided decoding.")),
    RequestOption(
        name="past_trajectory", title="pastTrajectory (trajectory execution)", uses=_extra("past_trajectory"),
        order=60, default=OptionSupport(
            Support.REJECTED, reason="Trajectory execution founds its own batch and carries drain-time state.",
            alternative=BLOCKING)),
    RequestOption(
        name="lora", title="Per-request LoRA", uses=_extra("lora"), order=70,
        default=OptionSupport(
            Support.REJECTED, reason="Adapter weights are engine-wide under in-flight batching.",
            alternative=BLOCKING)),
    RequestOption(
        name="n_sequences", title="More than one sequence per request", uses=lambda spec: spec.params.n > 1,
        order=80, default=OptionSupport(
            Support.REJECTED, reason="The engine batches across requests, not within one.", alternative=BLOCKING)),
)

