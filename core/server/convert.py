"""Parsed OpenAI request bodies -> ``RequestSpec`` (sampling parameters and extras).

Known OpenAI fields this server does not implement are refused here with a
400 naming the field; fields the engine judges per deployment (guided
decoding, audio output) travel in ``extras`` and the engine decides.
"""

from __future__ import annotations

from typing import Any

import attrs

from ifb.options import text_only_message
from ifb.params import InvalidRequest, RequestSpec, SamplingParams, Trajectory
from ifb.server import reasoning as thinking
from ifb.server import tools
from ifb.server.errors import ApiError
from ifb.server.schemas import (
    ChatCompletionRequest, ChatMessage, CompletionRequest, ResponseFormat, Stop, converter,
)

#: chat roles the templates know; ``developer`` is OpenAI's newer name for ``system``
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_MODALITIES = ("text", "audio")


def _refuse(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="unsupported_parameter")


def _stop(stop: Stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _sampling(body: CompletionRequest | ChatCompletionRequest, *, max_tokens: int | None,
              logprobs: int | None) -> SamplingParams:
    def given(value: Any, default: Any) -> Any:
        return default if value is None else value

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=given(body.temperature, 1.0),
        top_p=given(body.top_p, 1.0),
        top_k=given(body.top_k, 0),
        min_p=given(body.min_p, 0.0),
        repetition_penalty=given(body.repetition_penalty, 1.0),
        presence_penalty=given(body.presence_penalty, 0.0),
        frequency_penalty=given(body.frequency_penalty, 0.0),
        seed=body.seed,
        logprobs=logprobs,
        stop=_stop(body.stop),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        n=body.n,
    )


def _common_checks(body: CompletionRequest | ChatCompletionRequest) -> None:
    if body.logit_bias:
        raise _refuse("logit_bias", "logit_bias is not supported by this server (only an empty object)")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")


def _response_format(fmt: ResponseFormat | None) -> dict | None:
    """Guided decoding requests go to the engine, which accepts or rejects them per deployment."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ApiError(400, "response_format of type json_schema needs a json_schema object",
                           param="response_format.json_schema")
        schema = {k: v for k, v in converter.unstructure(fmt.json_schema).items() if v is not None}
        return {"type": "json_schema", "json_schema": schema}
    if fmt.type in ("regex", "grammar"):
        value = getattr(fmt, fmt.type)
        if not isinstance(value, str) or not value:
            raise ApiError(400, f"response_format of type {fmt.type} needs a non-empty {fmt.type} string",
                           param=f"response_format.{fmt.type}")
        return {"type": fmt.type, fmt.type: value}
    raise ApiError(400, f"unknown response_format type {fmt.type!r} "
                        "(text, json_object, json_schema, regex or grammar)", param="response_format.type")


def completion_spec(body: CompletionRequest, extras: dict[str, Any]) -> RequestSpec:
    """The engine request for a ``/v1/completions`` body."""
    _common_checks(body)
    if body.echo and body.logprobs is not None:
        raise _refuse("echo", "echo with logprobs is not supported: this server does not score prompt tokens")
    if body.suffix:
        raise _refuse("suffix", "suffix (insertion) is not supported by this server")
    if body.best_of is not None:
        if not body.n <= body.best_of <= 16:
            raise ApiError(400, f"best_of ({body.best_of}) must be between n ({body.n}) and 16", param="best_of")
        if body.stream and body.best_of > body.n:
            raise ApiError(400, "best_of cannot be used with stream: the candidates are compared when all have "
                                "finished", param="best_of")
    prompt, prompt_ids = _prompt(body.prompt)
    extras = dict(extras)
    guided = _response_format(body.response_format)
    if guided is not None:
        extras["response_format"] = guided
    return RequestSpec(
        prompt=prompt, prompt_token_ids=prompt_ids,
        params=attrs.evolve(_sampling(body, max_tokens=body.max_tokens, logprobs=body.logprobs),
                            best_of=body.best_of),
        stream=body.stream, extras=extras, speculative=body.speculative,
    )


def _prompt(prompt: Any) -> tuple[str | None, tuple[int, ...] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise _refuse("prompt", "send one prompt per request (a list of prompts is not supported)")
        prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt, None
    return None, tuple(prompt)


def chat_spec(body: ChatCompletionRequest, extras: dict[str, Any], *, template: str | None = None,
              takes_media: bool = True) -> RequestSpec:
    """The engine request for a ``/v1/chat/completions`` body (``chat_request`` without the plan)."""
    return chat_request(body, extras, template=template, takes_media=takes_media)[0]


def chat_request(body: ChatCompletionRequest, extras: dict[str, Any], *, template: str | None = None,
                 takes_media: bool = True, reasoning: thinking.Reasoning | None = None,
                 choice: thinking.ThinkingChoice | None = None) -> tuple[RequestSpec, tools.ToolPlan | None]:
    """The engine request for a ``/v1/chat/completions`` body, and its tool plan (None: no tools).

    ``template`` is the loaded chat template (it decides how tools are rendered
    and parsed); ``takes_media`` whether the deployment reads image or audio parts;
    ``reasoning`` the deployment's reasoning set-up and ``choice`` what the
    request asks of thinking (default: its ``reasoning_effort``). The spec's
    ``thinking`` is the block its answer may start with.
    """
    _common_checks(body)
    plan = _tool_plan(body, template)
    if body.top_logprobs is not None:
        if not body.logprobs and body.top_logprobs > 0:
            raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        if not 0 <= body.top_logprobs <= 20:
            raise ApiError(400, "top_logprobs must be between 0 and 20", param="top_logprobs")
    extras = dict(extras)
    guided = _response_format(body.response_format)
    if guided is not None:
        extras["response_format"] = guided
    reasoning = reasoning or thinking.Reasoning(parser="none")
    has_channels = reasoning.parser == "harmony"
    if has_channels and guided is not None:
        raise ApiError(400, "response_format is not supported with the harmony chat format (its answer is "
                            "a channel message the grammar cannot start inside)", param="response_format")
    for i, modality in enumerate(body.modalities or ()):
        if modality not in _MODALITIES:
            raise ApiError(400, f"unknown modality {modality!r} (text or audio)", param=f"modalities[{i}]")
    if "audio" in (body.modalities or ()):
        extras["generate_audio"] = True
        if body.audio is not None:
            extras["audio"] = {k: v for k, v in converter.unstructure(body.audio).items() if v is not None}
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    trajectory = _trajectory(body)
    messages = [_message(m, i, takes_media) for i, m in enumerate(body.messages)]
    if plan is not None:
        grammar = tools.forcing_grammar(plan)
        if grammar is not None and has_channels:
            raise ApiError(400, "tool_choice required or a named function is not supported with the harmony "
                                "chat format (use auto)", param="tool_choice")
        if grammar is not None:
            if guided is not None:
                raise ApiError(400, "tool_choice required or a named function cannot be combined with "
                                    "response_format", param="response_format")
            extras["response_format"] = {"type": "grammar", "grammar": grammar}
        if plan.in_template:
            extras["tools"] = [converter.unstructure(t) for t in plan.tools]
    if plan is not None or any("tool_calls" in m or m["role"] == "tool" for m in messages):
        messages = tools.render_messages(messages, plan)
    if has_channels:  # gpt-oss's template looks into any content it is given: a call's null is left out
        messages = [{k: v for k, v in m.items() if not (k == "content" and v is None)} for m in messages]
    choice = choice or thinking.effort_choice(body.reasoning_effort, "reasoning_effort")
    kwargs = thinking.template_kwargs(reasoning, choice, body.chat_template_kwargs)
    params = _sampling(body, max_tokens=max_tokens, logprobs=logprobs)
    if has_channels:  # the format's markers are special tokens the answer is split by
        params = attrs.evolve(params, skip_special_tokens=False)
    spec = RequestSpec(
        messages=tuple(messages),
        params=params,
        stream=body.stream, extras=extras, past_trajectory=trajectory, chat_template_kwargs=kwargs,
        thinking=thinking.thinking_block(reasoning, kwargs), speculative=body.speculative,
    )
    return spec, plan


def _trajectory(body: ChatCompletionRequest) -> Trajectory | None:
    """The request's one trajectory content part (and ``noise_seed``), checked for shape and finiteness."""
    found = None
    for i, message in enumerate(body.messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if part.type != "trajectory":
                continue
            where = f"messages[{i}].content[{j}]"
            if part.trajectory is None:
                raise ApiError(400, "a content part of type trajectory needs a trajectory field "
                                    "(a list of points, each a list of numbers)", param=where)
            if found is not None:
                raise ApiError(400, f"one trajectory per request: {found.field} already carries one",
                               param=f"{where}.trajectory")
            found = Trajectory.of(part.trajectory, body.noise_seed, field=f"{where}.trajectory")
    if found is None:
        if body.noise_seed is not None:
            raise ApiError(400, "noise_seed seeds a trajectory plan: send a trajectory content part with it",
                           param="noise_seed")
        return None
    try:
        found.validate()
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    return found


def _tool_plan(body: ChatCompletionRequest, template: str | None) -> tools.ToolPlan | None:
    tool_list = None
    if body.tools is not None:
        for i, tool in enumerate(body.tools):
            if tool.type != "function":
                raise ApiError(400, f"unknown tool type {tool.type!r} (only function)", param=f"tools[{i}].type")
            if not tool.function.name:
                raise ApiError(400, "a function needs a name", param=f"tools[{i}].function.name")
        tool_list = [{k: v for k, v in converter.unstructure(t).items() if v is not None} for t in body.tools]
        for t in tool_list:
            t["function"] = {k: v for k, v in t["function"].items() if v is not None}
    choice: Any = body.tool_choice
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise ApiError(400, f"unknown tool_choice {choice!r} (none, auto, required or a named function)",
                       param="tool_choice")
    if choice is not None and not isinstance(choice, str):
        if choice.type != "function":
            raise ApiError(400, f"unknown tool_choice type {choice.type!r} (function)", param="tool_choice.type")
        choice = {"type": "function", "function": {"name": choice.function.name}}
    return tools.plan(tool_list, choice, body.parallel_tool_calls, template)


def _message(message: ChatMessage, index: int, takes_media: bool) -> dict[str, Any]:
    role = _ROLES.get(message.role)
    if role is None:
        raise ApiError(400, f"unsupported role {message.role!r} (system, developer, user, assistant or tool)",
                       param=f"messages[{index}].role")
    if message.content is None and not (role == "assistant" and message.tool_calls):
        raise ApiError(400, f"messages[{index}].content is null: a {message.role} message needs content "
                            "(a string or a list of parts)", param=f"messages[{index}].content")
    if message.tool_calls and role != "assistant":
        raise ApiError(400, "only assistant messages carry tool_calls", param=f"messages[{index}].tool_calls")
    out: dict[str, Any] = {"role": role, "content": _content(message.content, index, takes_media)}
    if message.name is not None:
        out["name"] = message.name
    if message.reasoning_content is not None:
        if role != "assistant":
            raise ApiError(400, "only assistant messages carry reasoning_content",
                           param=f"messages[{index}].reasoning_content")
        # Qwen3's templates read ``reasoning_content``, gpt-oss's ``thinking``
        out["reasoning_content"] = out["thinking"] = message.reasoning_content
    if message.tool_calls:
        out["tool_calls"] = [converter.unstructure(c) for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _content(content: Any, index: int, takes_media: bool = True) -> Any:
    """Text parts are joined into one string; media parts stay as OpenAI-shaped dicts for the plugin."""
    if content is None or isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        where = f"messages[{index}].content[{j}]"
        if part.type == "trajectory":  # taken out of the messages by ``_trajectory``
            continue
        field = {"text": "text", "image_url": "image_url", "input_audio": "input_audio"}.get(part.type)
        if field is None:
            raise ApiError(400, f"unknown content part type {part.type!r} (text, image_url, input_audio "
                                "or trajectory)", param=f"{where}.type")
        if getattr(part, field) is None:
            raise ApiError(400, f"a content part of type {part.type} needs a {field} field", param=where)
        if field != "text" and not takes_media:
            raise ApiError(400, text_only_message(where, part.type), param=where, code="unsupported_content")
        parts.append({"type": part.type, field: converter.unstructure(getattr(part, field))})
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts
