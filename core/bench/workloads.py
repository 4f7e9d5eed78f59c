"""Benchmark workloads: what to send, how long each answer is, and when to send it.

A workload is a frozen definition (built in, or loaded from a JSON file with
the same fields) that expands deterministically, for its seed, into a list of
``PlannedRequest``: two runs of one workload send the same prompts with the
same lengths at the same offsets, so their results are comparable.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Literal

import attrs
import cattrs
from cattrs.v import format_exception

Kind = Literal["fixed", "skewed", "shared_prefix"]

#: Prompts are drawn from this list only, so that every run (and every server) sees the same text.
WORDS: tuple[str, ...] = tuple("""
river mountain window garden silver morning letter bridge candle forest
harbor winter lantern meadow engine pocket ladder orchard valley whistle
market shadow thunder pebble station kettle compass feather island cellar
blanket ribbon village sailor hammer basket mirror violin tunnel cottage
answer button canvas desert farmer glacier helmet jacket kitchen lemon
marble needle ocean pillow quarry rocket saddle teacup umbrella velvet
wagon yellow zebra anchor barrel cactus dragon empire falcon guitar
hollow insect jungle kernel lizard magnet narrow orange parrot quiet
rabbit spider timber useful vessel walnut yonder amber bright clever
gentle humble jolly lively modest noble proud rapid steady tender
walks carries builds paints follows gathers opens reads sings watches
slowly softly early later always never often quickly nearly gladly
""".split())

SYSTEM_INTRO = "You are a patient assistant. Background notes for every answer:"
USER_INTRO = "Write a long story that mentions these words:"


@attrs.frozen
class LengthBand:
    """Output lengths drawn uniformly from ``[min_tokens, max_tokens]`` with relative ``weight``."""

    weight: float
    min_tokens: int
    max_tokens: int

    def __attrs_post_init__(self) -> None:
        if self.weight <= 0 or not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"bad length band {self}: need weight > 0 and 1 <= min_tokens <= max_tokens")


@attrs.frozen
class PlannedRequest:
    """One request of a planned run."""

    index: int
    #: seconds after the start of the run (open loop); None: sent when a client is free (closed loop)
    send_at: float | None
    prompt: str
    #: the shared system prompt (shared_prefix), or None
    system: str | None
    #: None: the request carries no max_tokens (the answer ends at EOS, or at the server's cap)
    max_tokens: int | None


@attrs.frozen
class Workload:
    """A benchmark workload.

    ``rate`` (requests/s) set: open loop, Poisson arrivals; otherwise closed loop:
    ``concurrency`` clients, each sending its next request when its previous one ends.
    """

    name: str
    kind: Kind
    num_requests: int
    concurrency: int = 1
    rate: float | None = None
    seed: int = 0
    #: output lengths: a weighted mix of uniform bands
    output_lengths: tuple[LengthBand, ...] = (LengthBand(1.0, 64, 64),)
    #: prompt length in words, uniform in [min, max]
    prompt_words: tuple[int, int] = (24, 24)
    #: words of the system prompt all requests share (shared_prefix only)
    shared_prefix_words: int = 0
    #: ask the server to ignore end-of-sequence, so each answer has exactly its planned length
    ignore_eos: bool = True
    #: False: send no max_tokens, as OpenAI clients do by default (answers end at EOS;
    #: ``output_lengths`` is then unused). Use it with ``--endpoint chat``: completions default to 16.
    send_max_tokens: bool = True
    #: the words each prompt starts with, before its drawn words
    instruction: str = USER_INTRO

    def __attrs_post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError("num_requests must be at least 1")
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be positive (requests per second)")
        if not self.output_lengths:
            raise ValueError("output_lengths needs at least one band")
        low, high = self.prompt_words
        if not 1 <= low <= high:
            raise ValueError("prompt_words must be [min, max] with 1 <= min <= max")
        if self.shared_prefix_words < 0:
            raise ValueError("shared_prefix_words must not be negative")
        if self.kind == "shared_prefix" and self.shared_prefix_words == 0:
            raise ValueError("a shared_prefix workload needs shared_prefix_words > 0")

    @property
    def is_open_loop(self) -> bool:
        return self.rate is not None

    def with_overrides(self, *, num_requests: int | None = None, concurrency: int | None = None,
                       rate: float | None = None, max_tokens: int | None = None, seed: int | None = None,
                       ignore_eos: bool | None = None) -> Workload:
        """A copy with the given fields replaced; ``max_tokens`` makes every output that long."""
        changes: dict = {}
        if num_requests is not None:
            changes["num_requests"] = num_requests
        if concurrency is not None:
            changes["concurrency"] = concurrency
            if rate is None:
                changes["rate"] = None  # asking for clients means a closed loop
        if rate is not None:
            changes["rate"] = rate
        if max_tokens is not None:
            changes["output_lengths"] = (LengthBand(1.0, max_tokens, max_tokens),)
            changes["send_max_tokens"] = True
        if seed is not None:
            changes["seed"] = seed
        if ignore_eos is not None:
            changes["ignore_eos"] = ignore_eos
        return attrs.evolve(self, **changes)

    def plan(self) -> list[PlannedRequest]:
        """Expand into requests; the same workload always gives the same plan."""
        # Separate streams: changing e.g. the rate leaves prompts and lengths as they were.
        words = random.Random(f"{self.seed}:prompts")
        lengths = random.Random(f"{self.seed}:lengths")
        arrivals = random.Random(f"{self.seed}:arrivals")
        system = None
        if self.shared_prefix_words:
            prefix = random.Random(f"{self.seed}:prefix")
            system = f"{SYSTEM_INTRO} {_words(prefix, self.shared_prefix_words)}"
        planned: list[PlannedRequest] = []
        clock = 0.0
        for index in range(self.num_requests):
            send_at = None
            if self.rate is not None:
                send_at = clock
                clock += arrivals.expovariate(self.rate)
            num_words = words.randint(*self.prompt_words)
            prompt = f"{self.instruction} {_words(words, num_words)}"
            planned.append(PlannedRequest(index=index, send_at=send_at, prompt=prompt, system=system,
                                          max_tokens=self._draw_length(lengths) if self.send_max_tokens else None))
        return planned

    def _draw_length(self, rng: random.Random) -> int:
        band = rng.choices(self.output_lengths, weights=[b.weight for b in self.output_lengths])[0]
        return rng.randint(band.min_tokens, band.max_tokens)


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


BUILTIN: dict[str, Workload] = {
    "fixed": Workload(name="fixed", kind="fixed", num_requests=32, concurrency=8,
                      output_lengths=(LengthBand(1.0, 64, 64),), prompt_words=(24, 24)),
    # most answers short, a few very long (the spec's example: seven stop near 30, one runs to 900)
    "skewed": Workload(name="skewed", kind="skewed", num_requests=120, rate=6.0,
                       output_lengths=(LengthBand(0.8, 8, 32), LengthBand(0.2, 256, 768)),
                       prompt_words=(8, 96)),
    "shared_prefix": Workload(name="shared_prefix", kind="shared_prefix", num_requests=32, concurrency=8,
                              output_lengths=(LengthBand(1.0, 32, 32),), prompt_words=(8, 24),
                              shared_prefix_words=950),
}

_converter = cattrs.Converter(forbid_extra_keys=True)


class WorkloadError(ValueError):
    """A workload name or file that cannot be used; the message says why."""


def _explain(exc: BaseException, type_) -> str:
    # Our own checks (ValueError from __attrs_post_init__) already say what is wrong.
    if type(exc) is ValueError:
        return str(exc)
    return format_exception(exc, type_)


def workload_from_dict(data: dict) -> Workload:
    """Build a workload from the JSON form (the same field names as ``Workload``)."""
    try:
        return _converter.structure(data, Workload)
    except cattrs.BaseValidationError as exc:
        raise WorkloadError("; ".join(cattrs.transform_error(exc, format_exception=_explain))) from None
    except (ValueError, TypeError) as exc:
        raise WorkloadError(str(exc)) from None


def workload_to_dict(workload: Workload) -> dict:
    """The JSON form of ``workload`` (what ``workload_from_dict`` reads)."""
    return _converter.unstructure(workload)


def load_workload(name_or_path: str) -> Workload:
    """A built-in workload by name, or one read from a JSON file."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise WorkloadError(f"{name_or_path!r} is neither a built-in workload "
                            f"({', '.join(BUILTIN)}) nor a JSON file")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise WorkloadError(f"cannot read workload {path}: {exc}") from None
    if not isinstance(data, dict):
        raise WorkloadError(f"{path} must hold a JSON object with the workload's fields")
    return workload_from_dict(data)
