"""Request parameters that cross every boundary: sampling settings and the request spec."""

from __future__ import annotations

import math
from typing import Any

import attrs

from ifb.transcription import Transcription


class InvalidRequest(ValueError):
    """A request whose parameters are malformed or out of range (HTTP 400).

    ``param`` names the request field at fault where the raiser knows it (``messages[0].content[1].trajectory``).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidRequest(message)


@attrs.frozen
class SamplingParams:
    """Per-sequence sampling settings. Defaults follow the OpenAI API (temperature 1)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # None: no logprobs; N: the chosen token plus N alternatives
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    #: candidates generated for the n returned: those with the highest cumulative logprob (None: n)
    best_of: int | None = None
    #: False: special tokens stay in the output text (a channel format such as harmony is parsed from them)
    skip_special_tokens: bool = True

    def validate(self) -> None:
        """Raise InvalidRequest naming the first out-of-range field."""
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be at least 1")
        _check(0.0 <= self.temperature <= 2.0, "temperature must be between 0 and 2")
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]")
        _check(self.top_k >= -1, "top_k must be -1, 0 (disabled) or a positive number")
        _check(0.0 <= self.min_p <= 1.0, "min_p must be between 0 and 1")
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty must be in (0, 2]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be between -2 and 2")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be between -2 and 2")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be between 0 and 20")
        _check(len(self.stop) <= 8, "at most 8 stop strings are allowed")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty")
        _check(1 <= self.n <= 16, "n must be between 1 and 16")
        if self.best_of is not None and not self.n <= self.best_of <= 16:
            raise InvalidRequest(f"best_of ({self.best_of}) must be between n ({self.n}) and 16", param="best_of")

    @property
    def num_candidates(self) -> int:
        """Sequences generated for the request: ``best_of`` where given, else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def batch_key(self) -> tuple:
        """What must match for two requests to share a batch when sampling is batch-wide."""
        return (
            self.temperature, self.top_p, self.top_k, self.min_p, self.max_tokens,
            self.repetition_penalty, self.presence_penalty, self.frequency_penalty,
        )


@attrs.frozen
class ThinkingBlock:
    """The block a reasoning model writes before its answer (``<think>...</think>``).

    Guided decoding (a ``response_format`` or a forced tool call) applies to the
    answer after the block, never to the thinking in it. ``is_open``: the prompt
    already opened the block, so the output starts inside it (DeepSeek-R1-style
    templates); otherwise the model may open one itself.
    """

    start: str = "<think>"
    end: str = "</think>"
    is_open: bool = False
    #: the output is a sequence of channel messages (OpenAI's harmony format: the ``analysis`` channel is
    #: thinking, ``final`` the answer, a ``commentary`` message to ``functions.NAME`` a tool call);
    #: ``start`` and ``end`` are then the analysis message's header and end
    has_channels: bool = False


@attrs.frozen
class Trajectory:
    """The past trajectory (or robot state) a trajectory-planning request carries, and how to plan from it.

    ``points`` are the past states, oldest first, each a vector of the same length; one point is the
    current state. ``noise_seed`` fixes the planner's initial noise (the plugin documents exactly how it
    is drawn). ``field`` is where the request carried it, for error messages.
    """

    points: tuple[tuple[float, ...], ...]
    noise_seed: int | None = None
    field: str = "trajectory"

    @classmethod
    def of(cls, points: Any, noise_seed: int | None = None, field: str = "trajectory") -> Trajectory:
        """A trajectory from nested sequences of numbers (a flat vector is one point); InvalidRequest if not."""
        if isinstance(points, (list, tuple)) and points and all(_is_number(x) for x in points):
            points = [points]
        if not isinstance(points, (list, tuple)) or not all(isinstance(row, (list, tuple)) for row in points):
            raise InvalidRequest(f"{field} must be a list of points, each a list of numbers", param=field)
        for i, row in enumerate(points):
            if not all(_is_number(x) for x in row):
                raise InvalidRequest(f"{field}[{i}] must be a list of numbers", param=field)
        return cls(tuple(tuple(float(x) for x in row) for row in points), noise_seed, field)

    @property
    def num_points(self) -> int:
        return len(self.points)

    @property
    def dim(self) -> int:
        return len(self.points[0]) if self.points else 0

    def validate(self) -> None:
        """Raise InvalidRequest naming ``field``: no points, ragged or empty points, NaN or infinity."""
        field = self.field
        if not self.points:
            raise InvalidRequest(f"{field} holds no points: send at least the current state", param=field)
        for i, row in enumerate(self.points):
            if len(row) != self.dim or not row:
                raise InvalidRequest(f"{field}[{i}] has {len(row)} values; every point needs the same "
                                     f"non-zero number ({self.dim} in {field}[0])", param=field)
            if not all(math.isfinite(x) for x in row):
                raise InvalidRequest(f"{field}[{i}] holds NaN or infinity: every value must be finite", param=field)
        if self.noise_seed is not None and not 0 <= self.noise_seed < 2 ** 63:
            raise InvalidRequest("noise_seed must be between 0 and 2**63 - 1", param="noise_seed")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@attrs.frozen
class RequestSpec:
    """One request as a caller submits it, before tokenization.

    Exactly one of ``prompt`` (text), ``prompt_token_ids`` or ``messages`` (chat) is set.
    ``extras`` carries options that plugins and request-option predicates read
    (``lora``, ``response_format``, ``media``, ``generate_audio``, ...).
    """

    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None
    params: SamplingParams = SamplingParams()
    stream: bool = False
    extras: dict[str, Any] = attrs.field(factory=dict, hash=False)
    request_id: str | None = None
    #: the past trajectory / state to plan from (trajectory-planning deployments), or None
    past_trajectory: Trajectory | None = None
    #: False: never draft for this request, even where the deployment speculates (``speculative`` in the body)
    speculative: bool = True
    #: variables the chat template receives besides the messages (``enable_thinking``, ``reasoning_effort``)
    chat_template_kwargs: dict[str, Any] = attrs.field(factory=dict, hash=False)
    #: the thinking block the answer may start with; None: the output is all answer
    thinking: ThinkingBlock | None = None
    #: set by the transcription routes (their messages ask in words too); a runtime whose model has its
    #: own transcription prompt builds it from this
    transcription: Transcription | None = None

    def validate(self) -> None:
        given = [x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)]
        _check(sum(given) == 1, "give exactly one of prompt, prompt_token_ids or messages")
        if self.prompt_token_ids is not None:
            _check(len(self.prompt_token_ids) > 0, "prompt_token_ids must not be empty")
        if self.messages is not None:
            _check(len(self.messages) > 0, "messages must not be empty")
        self.params.validate()
        if self.past_trajectory is not None:
            self.past_trajectory.validate()
