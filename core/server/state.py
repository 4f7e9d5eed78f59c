"""What routes (built-in and plugin-supplied) share: the deployment, auth, errors, submission."""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from typing import Any

import attrs
from starlette.concurrency import run_in_threadpool
from starlette.requests import HTTPConnection

from ifb.capabilities import EndpointSupport, Support
from ifb.engine import EngineFull, RequestRejected
from ifb.options import takes_media
from ifb.outputs import RequestHandle
from ifb.params import InvalidRequest, RequestSpec
from ifb.server.errors import ApiError, error_response
from ifb.server.metrics import ServerMetrics
from ifb.server.reasoning import Reasoning

#: body fields a range error may name (``SamplingParams.validate`` messages start with the field)
_PARAM_NAMES = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                "presence_penalty", "frequency_penalty", "logprobs", "stop", "n")


def _param_of(message: str) -> str | None:
    """The first body field a message names (``at most 8 stop strings ...`` -> ``stop``)."""
    return next((word for word in re.findall(r"[a-z_]+", message) if word in _PARAM_NAMES), None)


@attrs.define
class AppState:
    """Handed to every route (``request.app.state.ifb``) and to the ``ifb_http_routes`` hook.

    Plugin routes use ``check_auth``, ``ApiError`` / ``error_response`` for
    OpenAI-shaped errors, ``submit`` to queue a request without blocking the
    event loop, and ``require_endpoint`` to honour the deployment's declaration.
    """

    deployment: Any  # ifb.deploy.Deployment
    model_name: str
    metrics: ServerMetrics
    api_key: str | None = None
    created: int = attrs.field(factory=lambda: int(time.time()))
    #: how thinking is split from answers (``--reasoning-parser``), decided at start-up
    reasoning: Reasoning = Reasoning(parser="none")

    ApiError = ApiError
    error_response = staticmethod(error_response)

    @property
    def engine(self):
        return self.deployment.engine

    @property
    def is_in_flight(self) -> bool:
        return bool(self.engine.is_in_flight)

    @property
    def runtime(self):
        return self.deployment.runtime

    @property
    def chat_template(self) -> str | None:
        """The loaded chat template's source, where the tokenizer has one (tools are rendered by it)."""
        template = getattr(self.runtime.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    @property
    def takes_media(self) -> bool:
        """Whether the deployment reads image or audio content parts at all."""
        return takes_media(self.engine.support)

    @property
    def system_fingerprint(self) -> str:
        """Names the configuration that produced an answer: the model, its plugin and how it is served."""
        from ifb import __version__

        config = self.deployment.config
        key = f"{__version__}|{self.deployment.kind.plugin}|{self.runtime.model_name}|{config.options}"
        return "fp_" + hashlib.sha256(key.encode()).hexdigest()[:10]

    # ---- auth ----
    def is_authorized(self, connection: HTTPConnection) -> bool:
        """``Authorization: Bearer <key>``, or Anthropic's ``x-api-key: <key>``, when a key is set."""
        if self.api_key is None:
            return True
        key = self.api_key.encode()
        scheme, _, token = connection.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key):
            return True
        given = connection.headers.get("x-api-key")
        return given is not None and hmac.compare_digest(given.strip().encode(), key)

    def check_auth(self, connection: HTTPConnection) -> None:
        """Raise ApiError(401) unless the request carries ``Authorization: Bearer <key>``."""
        if not self.is_authorized(connection):
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                           code="invalid_api_key")

    # ---- models ----
    @property
    def lora_names(self) -> list[str]:
        """The LoRA adapters served now (the runtime's registry: registered at start-up or loaded since)."""
        lora = getattr(self.runtime, "lora", None)
        if lora is not None:
            return lora.names()
        return sorted(self.deployment.config.options.get("lora_adapters") or {})  # a runtime without a registry

    def model_extras(self, model: str | None) -> dict[str, Any]:
        """Extras a request's ``model`` field implies: a LoRA adapter's name selects it."""
        if model is None or model in (self.model_name, self.deployment.runtime.model_name):
            return {}
        if model in self.lora_names:
            return {"lora": model}
        served = ", ".join([self.model_name, *self.lora_names])
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served}",
                       param="model", code="model_not_found")

    def endpoint_status(self, endpoint: str) -> EndpointSupport:
        declared = self.deployment.caps.endpoints
        if not declared:  # nothing declared: a text deployment serving completions and chat
            return EndpointSupport.SERVED if endpoint in ("completions", "chat.completions") \
                else EndpointSupport.ABSENT
        return declared.get(endpoint, EndpointSupport.ABSENT)

    def serves_endpoint(self, endpoint: str) -> bool:
        status = self.endpoint_status(endpoint)
        return status is EndpointSupport.SERVED or (
            status is EndpointSupport.REFUSED_UNDER_IFB and not self.is_in_flight)

    def require_endpoint(self, endpoint: str, path: str) -> None:
        """Raise the error a request to an endpoint this deployment does not serve gets."""
        status = self.endpoint_status(endpoint)
        if status is EndpointSupport.ABSENT:
            raise ApiError(404, f"this deployment does not serve {path}", code="endpoint_not_served")
        if status is EndpointSupport.REFUSED_UNDER_IFB and self.is_in_flight:
            raise ApiError(400, f"{path} is not available under in-flight batching; serve without "
                                "--enable-in-flight-batching to use it", code="unsupported_endpoint")

    def option_statuses(self) -> dict[str, str]:
        """Each request option's status on the path this deployment is served by."""
        out = {}
        for option in self.engine.options:
            support = self.engine.support[option.name].support
            if not self.is_in_flight:  # one at a time: only what the deployment lacks entirely is refused
                support = support if support is Support.NOT_APPLICABLE else Support.SERVED
            out[option.name] = support.value
        return out

    # ---- submission ----
    async def submit(self, spec: RequestSpec) -> RequestHandle:
        """Queue ``spec`` (tokenization runs in a worker thread); engine refusals become ApiErrors.

        Under in-flight batching the HTTP gate answers 429 before the engine is
        asked, so the engine's own ``refused`` counter stays at zero (as the spec's
        /health shows); it counts only requests that slip past in a race.
        """
        if self.is_in_flight and self.engine.is_full():
            raise ApiError(429, "the engine is full (batch and queue); retry later", code="engine_full")
        try:
            return await run_in_threadpool(self._submit_now, spec)
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), param=exc.param or _param_of(str(exc))) from None
        except RequestRejected as exc:
            raise ApiError(400, str(exc), param=exc.param, code="unsupported_option") from None
        except EngineFull as exc:
            raise ApiError(429, f"{exc}; retry later", code="engine_full") from None

    def _submit_now(self, spec: RequestSpec) -> RequestHandle:
        check_prompt_length(self.runtime, spec)
        return self.engine.submit(spec)


#: a token of any vocabulary we serve covers at most this many characters of ordinary text
_CHARS_PER_TOKEN = 16


def _prompt_text(spec: RequestSpec) -> str | None:
    if spec.prompt is not None:
        return spec.prompt
    if spec.messages is None:
        return None
    return "\n".join(m["content"] for m in spec.messages if isinstance(m.get("content"), str))


def check_prompt_length(runtime: Any, spec: RequestSpec) -> None:
    """Refuse a prompt far longer than the context after tokenizing only its beginning.

    A prompt of more than ``max_model_len * 16`` characters is tokenized up to
    that length first: when that much already holds more tokens than the
    context, the rest cannot matter. (A chat template only adds tokens to its
    messages' text.) Otherwise the engine tokenizes it whole, as any prompt.
    """
    text = _prompt_text(spec)
    limit = runtime.max_model_len * _CHARS_PER_TOKEN
    if text is None or len(text) <= limit:
        return
    # a cut inside a word can split its last piece differently: a margin keeps the test sound
    num_tokens = len(runtime.tokenizer.encode(text[:limit], add_special_tokens=False)) - 8
    if num_tokens >= runtime.max_model_len:
        raise InvalidRequest(f"the prompt has more than {num_tokens} tokens (its first {limit} of "
                             f"{len(text)} characters already do); this model's context is "
                             f"{runtime.max_model_len} tokens")
