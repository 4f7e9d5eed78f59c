"""Incremental detokenization and stop strings, shared by every runtime.

Decoding one token at a time breaks multi-byte UTF-8 characters and merged
pieces, so text is decoded over a sliding window of ids and only released once
it no longer ends in a replacement character. Text that could be the start of
a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

from ifb.runtime import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = ()):
        self._tokenizer = tokenizer
        # a few prompt tokens give the decoder the context it needs for leading spaces
        self._ids: list[int] = list(prompt_token_ids[-4:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all text decoded so far (truncated at a stop string)
        self._released = 0
        self.stopped = False

    def add(self, token_id: int) -> None:
        """Feed one generated token; sets ``stopped`` when a stop string appeared."""
        if self.stopped:
            return
        self._ids.append(token_id)
        before = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        after = self._tokenizer.decode(self._ids[self._prefix_offset:])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            new = after[len(before):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._append(new)

    def _append(self, new: str) -> None:
        start = max(0, len(self.text) - self._hold)
        self.text += new
        hits = [at for at in (self.text.find(s, start) for s in self._stop) if at != -1]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def release(self, final: bool) -> str:
        """Text that may be streamed now; on ``final`` everything left."""
        end = len(self.text) if (final or self.stopped) else max(self._released, len(self.text) - self._hold)
        out = self.text[self._released:end]
        self._released = end
        return out

    def flush(self) -> None:
        """Decode whatever is pending even if it ends mid-character (end of generation)."""
        pending = self._tokenizer.decode(self._ids[self._prefix_offset:])
        before = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        if len(pending) > len(before) and not self.stopped:
            self._append(pending[len(before):])
            self._prefix_offset = self._read_offset = len(self._ids)
