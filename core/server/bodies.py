"""Decoding a JSON request body into Python values that every later stage can take.

``json.loads`` accepts what later stages cannot: ``NaN`` and ``Infinity``
(not JSON), nesting deep enough to exhaust the interpreter's recursion
limit in any recursive consumer (a chat template, a schema compiler), and
lone UTF-16 surrogates (``"\\ud800"``), which no tokenizer can encode. All
three are refused here with a 400 that names the field.
"""

from __future__ import annotations

import json
from typing import Any

from ifb.server.errors import ApiError

#: deepest nesting of arrays and objects a body may have (JSON Schemas rarely pass 20)
MAX_JSON_DEPTH = 64


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _where(path: tuple) -> str | None:
    text = ""
    for key in path:
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else str(key))
    return text or None


def check_values(data: Any, *, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise ApiError(400) for nesting deeper than ``max_depth`` or a string that is not valid Unicode."""
    stack: list[tuple[Any, tuple, int]] = [(data, (), 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, (dict, list)):
            if depth >= max_depth:
                raise ApiError(400, f"the request body is nested more than {max_depth} levels deep",
                               param=_where(path))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key, path)
                stack.append((item, (*path, key), depth + 1))


def _check_text(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = _where(path)
        raise ApiError(400, f"{where or 'the request body'}: the string holds an unpaired UTF-16 surrogate "
                            f"(U+{ord(text[exc.start]):04X} at character {exc.start}), which is not valid "
                            "Unicode", param=where) from None


def decode_json(raw: bytes) -> Any:
    """The decoded body; ApiError(400) for anything that is not plain, valid JSON."""
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, f"the request body is nested too deeply (the limit is {MAX_JSON_DEPTH} levels)") \
            from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    check_values(data)
    return data
