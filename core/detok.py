"""Incremental detokenization and stop strings, shared by every runtime.

Decoding one token at a time breaks multi-byte UTF-8 characters and merged
pieces, so text is decoded over a sliding window of ids and only released once
it no longer ends in a replacement character. Text that could be the start of
a stop string is held back until it is known not to be one, and so are the
tokens (with their logprobs) that produced it: the tokens of a stop string,
which the text leaves out, are left out of the outputs and their counts too.
"""

from __future__ import annotations

from ifb.runtime import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # a few prompt tokens give the decoder the context it needs for leading spaces
        self._ids: list[int] = list(prompt_token_ids[-4:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all text decoded so far (truncated at a stop string)
        self._released = 0
        self.stopped = False
        #: the stop string that ended the text (None: none did)
        self.matched_stop: str | None = None
        #: per token fed: where its text starts in ``text``, and what travels with it
        self._starts: list[int] = []
        self._items: list[tuple[int, object]] = []
        self._num_items_released = 0
        #: tokens fed whose text lies wholly in or after a stop string
        self.num_dropped = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token_id: int, item: object = None) -> None:
        """Feed one generated token; sets ``stopped`` when a stop string appeared.

        ``item`` (its logprob, say) comes back from ``release_tokens`` together
        with the token once the text it starts is released.
        """
        if self.stopped:
            return
        self._starts.append(len(self.text))
        self._items.append((token_id, item))
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix_offset:self._read_offset])
        after = self._decode(self._ids[self._prefix_offset:])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            new = after[len(before):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._append(new)

    def _append(self, new: str) -> None:
        start = max(0, len(self.text) - self._hold)
        self.text += new
        hits = [at for at in (self.text.find(s, start) for s in self._stop) if at != -1]
        if hits:
            cut = min(hits)
            self.matched_stop = next(s for s in self._stop if self.text.find(s, start) == cut)
            self.text = self.text[:cut]
            self.stopped = True
            kept = sum(1 for start in self._starts if start < cut)
            self.num_dropped = len(self._items) - kept
            del self._items[kept:], self._starts[kept:]

    def release(self, final: bool) -> str:
        """Text that may be streamed now; on ``final`` everything left."""
        end = len(self.text) if (final or self.stopped) else max(self._released, len(self.text) - self._hold)
        out = self.text[self._released:end]
        self._released = end
        return out

    def release_tokens(self, final: bool) -> tuple[tuple[int, ...], tuple]:
        """(token ids, their items) that may be streamed now: call after ``release``.

        A token goes out once its text has started to: no stop string can begin
        before the released text's end.
        """
        if final or self.stopped or not self._stop:
            end = len(self._items)
        else:
            end = self._num_items_released
            while end < len(self._items) and self._starts[end] < self._released:
                end += 1
        out = self._items[self._num_items_released:end]
        self._num_items_released = end
        return tuple(t for t, _ in out), tuple(item for _, item in out if item is not None)

    def flush(self) -> None:
        """Decode whatever is pending even if it ends mid-character (end of generation)."""
        pending = self._decode(self._ids[self._prefix_offset:])
        before = self._decode(self._ids[self._prefix_offset:self._read_offset])
        if len(pending) > len(before) and not self.stopped:
            self._append(pending[len(before):])
            self._prefix_offset = self._read_offset = len(self._ids)
