"""What a caller receives: streamed request outputs and the handle that carries them."""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import AsyncIterator, Callable, Iterator

import attrs


@attrs.frozen
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top_logprobs: tuple[tuple[int, str, float], ...] = ()


@attrs.frozen
class AudioOutput:
    """Audio spoken for a request: the whole container (``data``; empty when it was streamed in chunks)."""

    format: str  # wav, mp3, flac, opus, pcm
    data: bytes
    sample_rate: int
    voice: str
    num_frames: int
    num_samples: int
    is_streamed: bool = False
    #: the text it speaks (a chat answer's transcript)
    transcript: str = ""


#: ``RequestOutput.error_code`` of a request that waited longer than the queue time-out (the server's 429)
QUEUE_TIMEOUT = "queue_timeout"


@attrs.frozen
class RequestOutput:
    """One streamed delta of a request; the last one has ``finished`` set.

    ``finish_reason`` is ``stop``, ``length``, ``cancelled`` or ``error``.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    error: str | None = None
    index: int = 0  # which sequence of the request (n > 1 on the blocking path)
    #: what kind of failure ``error`` is, where a caller answers it differently (``QUEUE_TIMEOUT``)
    error_code: str | None = None
    #: a piece of streamed audio (audio output with streaming)
    audio_chunk: bytes = attrs.field(default=b"", repr=False)
    #: on the final output of a request that asked for audio output: the audio
    audio: AudioOutput | None = attrs.field(default=None, repr=False)
    #: the planned trajectory (trajectory-planning deployments): one step's vector per row
    output_trajectory: tuple[tuple[float, ...], ...] | None = None
    #: on the last output: the stop string that ended the text (None: EOS, a stop token or no stop)
    stop_string: str | None = None


@attrs.frozen
class FinalOutput:
    """A whole request's result, assembled from its deltas."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: tuple[TokenLogprob, ...]
    index: int = 0
    audio: AudioOutput | None = attrs.field(default=None, repr=False)
    #: the planned trajectory (trajectory-planning deployments): one step's vector per row
    output_trajectory: tuple[tuple[float, ...], ...] | None = None


class RequestFailed(RuntimeError):
    """The engine failed this request (a fault in its step); the engine goes on serving."""


_END = object()


class Deliveries:
    """Outputs bound for event loops, held until ``flush`` hands each loop its share at once.

    A decode step streams a token to every running request. One
    ``call_soon_threadsafe`` per loop per step, instead of one per output, spares
    the loop a wake-up (and the engine a self-pipe write) for every token, and
    the two threads as many hand-overs of the GIL. A handle's outputs keep their
    order: they go out in the order they were added.
    """

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}

    def add(self, loop: asyncio.AbstractEventLoop, aq: asyncio.Queue, item: object) -> None:
        self._by_loop.setdefault(loop, []).append((aq, item))

    def flush(self) -> None:
        by_loop, self._by_loop = self._by_loop, {}
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
                pass


def _deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    for aq, item in items:
        aq.put_nowait(item)


class RequestHandle:
    """A submitted request: iterate it (sync or async) for outputs, or cancel it.

    Outputs are pushed by the engine thread; consumers may live in any thread
    or event loop.
    """

    def __init__(self, request_id: str, on_cancel: Callable[[], None] | None = None):
        self.request_id = request_id
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Queue] | None = None
        self._on_cancel = on_cancel
        self.cancelled = threading.Event()
        self.done = threading.Event()

    # -- producer side (engine thread) --
    def push(self, output: RequestOutput, deliveries: Deliveries | None = None) -> None:
        """Hand ``output`` to the consumer; an async consumer's via ``deliveries`` when given
        (it then arrives at their next ``flush``)."""
        with self._lock:
            if self.done.is_set():
                return
            if output.finished:
                self.done.set()
            target = self._async
            if target is None:
                self._queue.put(output)
                if output.finished:
                    self._queue.put(_END)
                return
        loop, aq = target
        now = deliveries is None  # no step is collecting outputs: hand this one over by itself
        if now:
            deliveries = Deliveries()
        deliveries.add(loop, aq, output)
        if output.finished:
            deliveries.add(loop, aq, _END)
        if now:
            deliveries.flush()

    # -- consumer side --
    def cancel(self) -> None:
        """Ask the engine to drop this request; its seat is freed at the next boundary."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            if self._on_cancel is not None:
                self._on_cancel()

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            yield item

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        aq: asyncio.Queue = asyncio.Queue()
        with self._lock:
            while True:  # move what arrived before the consumer attached
                try:
                    aq.put_nowait(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._async = (loop, aq)
        while True:
            item = await aq.get()
            if item is _END:
                return
            yield item

    def ready(self) -> list[RequestOutput]:
        """The outputs that have arrived so far and not been read, without waiting (sync consumers)."""
        out = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return out
            if item is not _END:
                out.append(item)

    def result(self) -> FinalOutput:
        """Block until the request finishes and return the assembled result."""
        return collect(self)


def collect(outputs) -> FinalOutput:
    text, ids, logprobs, last, trajectory = [], [], [], None, None
    for out in outputs:
        if out.output_trajectory is not None:
            trajectory = out.output_trajectory
        text.append(out.text)
        ids.extend(out.token_ids)
        logprobs.extend(out.logprobs)
        last = out
    if last is None:
        raise RequestFailed("the request produced no output")
    if last.finish_reason == "error":
        raise RequestFailed(last.error or "the request failed")
    return FinalOutput(
        request_id=last.request_id, text="".join(text), token_ids=tuple(ids),
        finish_reason=last.finish_reason, num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens, logprobs=tuple(logprobs), index=last.index,
        audio=last.audio, output_trajectory=trajectory,
    )
