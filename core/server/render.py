"""Engine outputs -> OpenAI response bodies and stream chunks (completions and chat)."""

from __future__ import annotations

import base64
import math
import time
import uuid
from typing import Any

import attrs

from ifb.outputs import AudioOutput, RequestOutput, TokenLogprob
from ifb.params import ThinkingBlock
from ifb.server.answer import AnswerStream, whole
from ifb.server.tools import ToolPlan


@attrs.define
class Sequence:
    """One choice of a request as its outputs arrive (n > 1 has several)."""

    index: int
    texts: list[str] = attrs.field(factory=list)
    logprobs: list[TokenLogprob] = attrs.field(factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    #: OpenAI's ``message.audio`` when the answer was spoken
    audio: dict | None = None
    output_trajectory: tuple[tuple[float, ...], ...] | None = None
    stop_string: str | None = None  # the stop string that ended it


@attrs.define
class Collected:
    """Everything a request streamed so far, per choice, plus usage."""

    seqs: dict[int, Sequence] = attrs.field(factory=dict)
    num_prompt_tokens: int = 0

    def add(self, out: RequestOutput) -> Sequence:
        seq = self.seqs.setdefault(out.index, Sequence(out.index))
        seq.texts.append(out.text)
        seq.logprobs.extend(out.logprobs)
        # the last output's count is the request's (the tokens of a stop string are not counted)
        seq.num_output_tokens = out.num_output_tokens if out.finished else max(seq.num_output_tokens,
                                                                               out.num_output_tokens)
        if out.finish_reason is not None:
            seq.finish_reason = out.finish_reason
            seq.stop_string = out.stop_string
        if out.audio is not None:
            seq.audio = chat_audio(out.audio)
        if out.output_trajectory is not None:
            seq.output_trajectory = out.output_trajectory
        self.num_prompt_tokens = max(self.num_prompt_tokens, out.num_prompt_tokens)
        return seq

    def usage(self) -> dict[str, int]:
        completion = sum(s.num_output_tokens for s in self.seqs.values())
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.num_prompt_tokens + completion}


#: how long a spoken answer's audio id stays valid, as OpenAI's ``expires_at`` says it
AUDIO_TTL_S = 3600


def chat_audio(audio: AudioOutput) -> dict:
    """OpenAI's ``choices[0].message.audio``: ``{id, data (base64), expires_at, transcript}``."""
    return {"id": f"audio_{uuid.uuid4().hex}", "data": base64.b64encode(audio.data).decode("ascii"),
            "expires_at": int(time.time()) + AUDIO_TTL_S, "transcript": audio.transcript}


def _finite(logprob: float) -> float:
    # JSON has no -inf; a token the sampler ruled out gets a very low finite value instead
    return logprob if math.isfinite(logprob) else -9999.0


def _trajectory(points: tuple[tuple[float, ...], ...]) -> list[list[float]]:
    return [list(point) for point in points]


def _finish_reason(reason: str | None) -> str | None:
    return {"cancelled": "abort"}.get(reason, reason) if reason else None


class Renderer:
    """Shared envelope: id, object, created, model.

    A streamed event is a dict (sent as ``data:``) or an ``(event name, dict)`` pair.
    """

    object_full = ""
    object_chunk = ""
    #: the stream's last ``data:`` line (None: the stream ends with its last event)
    done_marker: str | None = "[DONE]"

    def __init__(self, response_id: str, model: str, created: int, *, num_choices: int, include_usage: bool,
                 system_fingerprint: str | None = None):
        self.response_id = response_id
        self.model = model
        self.created = created
        self.num_choices = num_choices
        self.include_usage = include_usage
        self.system_fingerprint = system_fingerprint

    def _envelope(self, obj: str, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint, "choices": choices}

    def chunk(self, choices: list[dict]) -> dict[str, Any]:
        body = self._envelope(self.object_chunk, choices)
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, collected: Collected) -> dict[str, Any]:
        body = self._envelope(self.object_chunk, [])
        body["usage"] = collected.usage()
        return body

    def opening(self) -> list[dict[str, Any]]:
        """Chunks sent before the first token."""
        return []

    def closing(self, collected: Collected) -> list[dict[str, Any]]:
        """Chunks sent after the last output."""
        return [self.usage_chunk(collected)] if self.include_usage else []

    def error_event(self, error: Any) -> dict[str, Any]:
        """The event a request that failed mid-stream ends with."""
        return error.body()

    def delta(self, out: RequestOutput, seq: Sequence) -> list[dict[str, Any]]:
        """The chunks one output streams (none while text is held back)."""
        raise NotImplementedError

    def full(self, collected: Collected) -> dict[str, Any]:
        raise NotImplementedError


class CompletionRenderer(Renderer):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, *args, echo: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._offsets: dict[int, int] = {}  # text_offset of the next token, per choice
        self.echo = echo  # the prompt's text, which each choice's text starts with (``echo``)
        self._echoed: set[int] = set()

    def _with_echo(self, index: int, text: str) -> str:
        if self.echo is None or index in self._echoed:
            return text
        self._echoed.add(index)
        return self.echo + text

    def _logprobs(self, index: int, lps: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict[str, Any]:
        offset = self._offsets.get(index, 0)
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            tokens.append(lp.token)
            token_lps.append(_finite(lp.logprob))
            top = {tok: _finite(value) for _, tok, value in lp.top_logprobs}
            top.setdefault(lp.token, _finite(lp.logprob))
            tops.append(top)
            offsets.append(offset)
            offset += len(lp.token)
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def delta(self, out: RequestOutput, seq: Sequence) -> list[dict[str, Any]]:
        if not out.text and not out.finish_reason and not out.logprobs:
            return []
        return [self.chunk([{
            "index": out.index, "text": self._with_echo(out.index, out.text),
            "logprobs": self._logprobs(out.index, out.logprobs) if out.logprobs else None,
            "finish_reason": _finish_reason(out.finish_reason),
        }])]

    def full(self, collected: Collected) -> dict[str, Any]:
        choices = [{
            "index": seq.index, "text": self._with_echo(seq.index, "".join(seq.texts)),
            "logprobs": self._logprobs(seq.index, seq.logprobs) if seq.logprobs else None,
            "finish_reason": _finish_reason(seq.finish_reason),
        } for seq in sorted(collected.seqs.values(), key=lambda s: s.index)]
        body = self._envelope(self.object_full, choices)
        body["usage"] = collected.usage()
        return body


def _token_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(lps: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict[str, Any]:
    """OpenAI's chat shape: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for lp in lps:
        entry = _token_entry(lp.token, lp.logprob)
        entry["top_logprobs"] = [_token_entry(tok, value) for _, tok, value in lp.top_logprobs]
        content.append(entry)
    return {"content": content, "refusal": None}


class ChatRenderer(Renderer):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, *args, wants_logprobs: bool = False, tools: ToolPlan | None = None,
                 thinking: ThinkingBlock | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.wants_logprobs = wants_logprobs
        self.tools = tools
        self.thinking = thinking  # the block thinking is split out of (``reasoning_content``)
        self._streams: dict[int, AnswerStream] = {}

    def opening(self) -> list[dict[str, Any]]:
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]) for i in range(self.num_choices)]

    def delta(self, out: RequestOutput, seq: Sequence) -> list[dict[str, Any]]:
        if not out.text and not out.finish_reason and not out.logprobs:
            return []
        reason = _finish_reason(out.finish_reason)
        stream = self._streams.setdefault(out.index, AnswerStream(self.tools, self.thinking))
        piece = stream.feed(out.text, out.finished)
        text, thought = piece.text, piece.thinking
        # each call in one chunk (id, name and all arguments): the client accumulates them
        chunks = [self.chunk([{"index": out.index, "delta": {"tool_calls": [call.to_openai(i)]},
                               "logprobs": None, "finish_reason": None}]) for i, call in enumerate(piece.calls)]
        if piece.calls and reason == "stop":
            reason = "tool_calls"
        lps = chat_logprobs(out.logprobs) if self.wants_logprobs and out.logprobs else None
        delta: dict[str, Any] = {}
        if thought:
            delta["reasoning_content"] = thought
        if text or not (out.finish_reason or thought):
            delta["content"] = text
        if out.finish_reason and seq.audio is not None:
            delta["audio"] = seq.audio
        if out.finish_reason and seq.output_trajectory is not None:
            delta["output_trajectory"] = _trajectory(seq.output_trajectory)
        if chunks and (text or thought):  # content first, then the calls, then the finish
            return [self.chunk([{"index": out.index, "delta": delta, "logprobs": lps, "finish_reason": None}]),
                    *chunks, self.chunk([{"index": out.index, "delta": {}, "logprobs": None,
                                          "finish_reason": reason}])]
        if chunks:
            return [*chunks, self.chunk([{"index": out.index, "delta": {}, "logprobs": lps,
                                          "finish_reason": reason}])]
        if not text and not thought and not out.finished and not lps:
            return []
        return [self.chunk([{"index": out.index, "delta": delta, "logprobs": lps, "finish_reason": reason}])]

    def full(self, collected: Collected) -> dict[str, Any]:
        choices = []
        for seq in sorted(collected.seqs.values(), key=lambda s: s.index):
            answer = whole("".join(seq.texts), self.tools, self.thinking)
            message: dict[str, Any] = {"role": "assistant", "content": answer.text, "refusal": None}
            if answer.thinking is not None:
                message["reasoning_content"] = answer.thinking
            reason = _finish_reason(seq.finish_reason)
            if answer.calls:
                message["tool_calls"] = [c.to_openai() for c in answer.calls]
                reason = "tool_calls" if reason == "stop" else reason
            if seq.audio is not None:
                message["audio"] = seq.audio
            if seq.output_trajectory is not None:
                message["output_trajectory"] = _trajectory(seq.output_trajectory)
            choices.append({
                "index": seq.index, "message": message,
                "logprobs": chat_logprobs(seq.logprobs) if self.wants_logprobs else None,
                "finish_reason": reason,
            })
        body = self._envelope(self.object_full, choices)
        body["usage"] = collected.usage()
        return body
