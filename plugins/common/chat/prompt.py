"""Turning a request's prompt into token ids: shared by every runtime built on the text tokenizer."""

from __future__ import annotations

from typing import Any

from ifb.params import InvalidRequest, RequestSpec
from ifb.runtime import Tokenizer


def render_chat(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """Render text-only chat messages with the checkpoint's template (InvalidRequest on bad input).

    ``tools`` (OpenAI tool objects) go to a template that reads them; the server
    passes them only to such a template. ``template_kwargs`` are further template
    variables (a request's ``chat_template_kwargs``: ``enable_thinking``, ...).
    """
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise InvalidRequest("each message needs a role and content")
        if not isinstance(m.get("content"), (str, type(None))):
            raise InvalidRequest("this deployment accepts text content only")
    kwargs: dict[str, Any] = dict(template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)  # type: ignore[call-arg]
    except Exception as exc:  # noqa: BLE001 - the template's own error is the message
        raise InvalidRequest(f"the chat template rejected these messages: {exc}") from exc


def prompt_token_ids(tokenizer: Tokenizer, vocab_size: int, spec: RequestSpec) -> list[int]:
    """The ids of ``spec``'s prompt: given ids (checked against the vocabulary), a chat, or text."""
    if spec.prompt_token_ids is not None:
        ids = list(spec.prompt_token_ids)
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
        return ids
    if spec.messages is not None:
        # the template writes any special tokens itself
        text = render_chat(tokenizer, list(spec.messages), tools=spec.extras.get("tools"),
                           template_kwargs=spec.chat_template_kwargs)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(spec.prompt or "", add_special_tokens=True)
