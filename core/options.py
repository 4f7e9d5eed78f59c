"""The registry of request options: the rows of the request-level matrix.

These are the options of the request API itself; plugins add theirs (media,
audio output, ...) through the ``ifb_request_options`` hook. A deployment
declares its support per option name; undeclared options get the default.
"""

from __future__ import annotations

from typing import Mapping

from ifb.capabilities import OptionSupport, RequestOption, Support
from ifb.params import RequestSpec

BLOCKING = "Use the blocking path (serve without --enable-in-flight-batching)."

#: why a deployment that plans no trajectories refuses one on every path
NO_TRAJECTORY_PLANNER = "This model has no trajectory planner: it plans no trajectories."

#: the spec's reason for rejecting trajectory execution under in-flight batching (a deployment that
#: serves it on the blocking path only declares it)
TRAJECTORY_BLOCKING_ONLY = "Trajectory execution founds its own batch and carries drain-time response state."


def _extra(name: str):
    return lambda spec: bool(spec.extras.get(name))


#: the request option through which a deployment says whether it reads media; ``NOT_APPLICABLE``: text only
MEDIA_OPTION = "media_under_pruner"


def takes_media(support: Mapping[str, OptionSupport]) -> bool:
    """Whether a deployment (its declared option support) reads image or audio content parts at all."""
    media = support.get(MEDIA_OPTION)
    return media is None or media.support is not Support.NOT_APPLICABLE


def text_only_message(where: str, part_type: str) -> str:
    """The refusal of a media part (``where``: ``messages[i].content[j]``) sent to a text-only deployment."""
    return (f"Text input only: this model reads no images or audio, and {where} is an {part_type} part; "
            "serve a vision or audio model to send media")


def media_refusal(spec: RequestSpec, support: Mapping[str, OptionSupport]) -> str | None:
    """The refusal for a request with media to a deployment that reads text only, naming the first part; else None."""
    if takes_media(support) or not has_media(spec):
        return None
    for i, message in enumerate(spec.messages or ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, (list, tuple)) else ()):
            part_type = part.get("type") if isinstance(part, dict) else type(part).__name__
            if part_type != "text":
                return text_only_message(f"messages[{i}].content[{j}]", str(part_type))
    return text_only_message("the request's media", "image or audio")


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
        name="past_trajectory", title="pastTrajectory (trajectory execution)",
        uses=lambda spec: spec.past_trajectory is not None, order=60,
        param=lambda spec: spec.past_trajectory.field if spec.past_trajectory is not None else None,
        default=OptionSupport(
            Support.NOT_APPLICABLE, reason=NO_TRAJECTORY_PLANNER,
            alternative="Serve a model whose plugin plans trajectories (ifb matrix lists them).")),
    RequestOption(
        name="lora", title="Per-request LoRA", uses=_extra("lora"), order=70,
        default=OptionSupport(
            Support.REJECTED, reason="Adapter weights are engine-wide under in-flight batching.",
            alternative=BLOCKING)),
    RequestOption(
        name="n_sequences", title="More than one sequence per request", uses=lambda spec: spec.params.num_candidates > 1,
        order=80, default=OptionSupport(
            Support.REJECTED, reason="The engine batches across requests, not within one.", alternative=BLOCKING)),
)

