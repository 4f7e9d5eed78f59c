"""N-gram prompt lookup: draft what followed the last time the context's suffix occurred.

For ``n`` from ``ngram_max`` down to ``ngram_min`` the last ``n`` tokens of a
seat's history are looked up in the rest of it; at the latest earlier match the
tokens that followed it are the drafts. No model: it pays off where the answer
quotes its input (rewriting or continuing a given text or code) and costs
nothing where it finds no match.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ifb_plugins.common.speculative.drafter import DraftRequest


def lookup(tokens: np.ndarray, ngram_min: int, ngram_max: int, num_drafts: int) -> list[int]:
    """The tokens after the latest earlier occurrence of ``tokens``' longest matching suffix that ``num_drafts``
    tokens follow (the earliest one if none does: the longest continuation); [] when no suffix of
    ``ngram_min`` or more tokens occurs earlier."""
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        # windows that end before the last token, so each match has at least one token after it
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            full = hits[hits + n + num_drafts <= length]
            start = int(full[-1] if full.size else hits[0]) + n
            return tokens[start:start + num_drafts].tolist()
    return []


class NgramDrafter:
    """``Drafter`` by prompt lookup; it keeps each seat's history as an array, grown as it grows."""

    needs_hidden_states = False

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"--ngram-min ({ngram_min}) must be at least 1 and at most --ngram-max ({ngram_max})")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.description = f"n-gram prompt lookup ({ngram_min}..{ngram_max} tokens)"
        self._histories: dict[str, tuple[np.ndarray, int]] = {}

    def _history(self, request: DraftRequest) -> np.ndarray:
        buffer, known = self._histories.get(request.request_id, (np.empty(0, dtype=np.int64), 0))
        tokens = request.token_ids
        if len(tokens) > len(buffer):
            grown = np.empty(max(2 * len(buffer), len(tokens), 256), dtype=np.int64)
            grown[:known] = buffer[:known]
            buffer = grown
        if len(tokens) < known:  # never happens for a seat's history; cheap to be safe
            known = 0
        buffer[known:len(tokens)] = tokens[known:]
        self._histories[request.request_id] = (buffer, len(tokens))
        return buffer[:len(tokens)]

    def propose(self, requests: Sequence[DraftRequest]) -> list[Sequence[int] | Exception]:
        out: list[Sequence[int] | Exception] = []
        for request in requests:
            try:
                out.append(lookup(self._history(request), self.ngram_min, self.ngram_max, request.num_drafts))
            except Exception as exc:  # noqa: BLE001 - one seat's failure stops only its drafting
                out.append(exc)
        return out

    def accepted(self, request_id: str, num_valid_tokens: int) -> None:
        pass  # the history grows from the runtime's seat record

    def release(self, request_id: str) -> None:
        self._histories.pop(request_id, None)
