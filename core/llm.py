"""The Python API: ``from ifb import LLM``."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from ifb.capabilities import DeployConfig
from ifb.deploy import Deployment, load_deployment
from ifb.outputs import FinalOutput, RequestFailed, RequestHandle, RequestOutput, collect
from ifb.params import InvalidRequest, RequestSpec, SamplingParams, Trajectory
from ifb.placement import check_device_name, check_dtype_name
from ifb.plugins import default_host


class LLM:
    """A loaded model you can call from any number of threads.

    With ``enable_in_flight_batching`` calls from several threads overlap up to
    ``max_batch_size`` + ``max_queued_requests``; further callers block until
    there is room. Without it (the default) requests run one at a time.

    ``tensor_parallel_size`` > 1 shards the model over that many ranks, spawned on this machine
    (see docs/tensor-parallel.md); ``collective_timeout`` bounds how long a silent rank is waited for.

    ``device`` (``cpu``, ``cuda``, ``cuda:N``; default: cuda when present, else cpu) and ``dtype``
    (``auto``, ``bfloat16``, ``float16``, ``float32``) are ``--device`` and ``--dtype`` (``ifb.placement``).

    ``plugin`` names the deployment kind (None: the installed default). ``plugin_options`` are the
    plugins' settings (``ifb_deploy_settings``; ``ifb serve --help`` lists them as flags), checked as
    the flags are: ``LLM(some_setting=value)`` is ``ifb serve --some-setting value``.
    """

    def __init__(self, model: str | None = None, *, plugin: str | None = None, max_batch_size: int = 4,
                 enable_in_flight_batching: bool = False, max_queued_requests: int = 64,
                 queue_timeout: float = 600.0, enable_context_reuse: bool = False,
                 max_kv_cache_capacity: int | None = None, max_num_batched_tokens: int = 256,
                 tensor_parallel_size: int = 1, collective_timeout: float = 60.0, device: str | None = None,
                 dtype: str = "auto", **plugin_options: Any):
        host = default_host()
        self.config = DeployConfig(
            model=model, plugin=plugin or host.default_kind().name, max_batch_size=max_batch_size,
            enable_in_flight_batching=enable_in_flight_batching, max_queued_requests=max_queued_requests,
            queue_timeout=queue_timeout, enable_context_reuse=enable_context_reuse,
            max_kv_cache_capacity=max_kv_cache_capacity, max_num_batched_tokens=max_num_batched_tokens,
            options=host.setting_options(plugin_options), num_ranks=tensor_parallel_size,
            collective_timeout=collective_timeout, device=check_device_name(device), dtype=check_dtype_name(dtype),
        )
        self.deployment: Deployment = load_deployment(self.config, host)

    @property
    def engine(self):
        return self.deployment.engine

    @property
    def tokenizer(self):
        return self.deployment.runtime.tokenizer

    def _submit(self, spec: RequestSpec):
        return self.engine.submit(spec, wait=True)

    def generate(self, prompts: str | Sequence[str], params: SamplingParams | None = None,
                 **extras: Any) -> list[FinalOutput]:
        """Complete each prompt; returns one result per prompt (all submitted at once).

        An exception while waiting (Ctrl-C's KeyboardInterrupt included) cancels
        every request of the call: each frees its seat at the next boundary.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        params = params or SamplingParams()
        handles: list[RequestHandle] = []
        try:
            for p in prompts:
                handles.append(self._submit(RequestSpec(prompt=p, params=params, extras=extras)))
            return [h.result() for h in handles]
        except BaseException:
            _cancel(handles)
            raise

    def chat(self, messages: list[dict], params: SamplingParams | None = None, *,
             trajectory: Sequence[Sequence[float]] | None = None, noise_seed: int | None = None,
             **extras: Any) -> FinalOutput:
        """Answer one conversation (OpenAI-style messages); an exception while waiting cancels it.

        ``trajectory`` (trajectory-planning deployments): the past trajectory, points oldest first (one
        point: the current state); the result's ``output_trajectory`` is the plan. ``noise_seed`` fixes
        the plan's initial noise (the plugin's docs say how it is drawn).
        """
        planned = Trajectory.of(trajectory, noise_seed) if trajectory is not None else None
        if planned is None and noise_seed is not None:
            raise InvalidRequest("noise_seed seeds a trajectory plan: pass a trajectory with it", param="noise_seed")
        spec = RequestSpec(messages=tuple(messages), params=params or SamplingParams(), extras=extras,
                           past_trajectory=planned)
        handle = self._submit(spec)
        try:
            return handle.result()
        except BaseException:
            _cancel([handle])
            raise

    def plan(self, task: str | list[dict], trajectory: Sequence[Sequence[float]], *,
             images: Sequence[str] = (), noise_seed: int | None = None) -> list[list[float]]:
        """The trajectory a trajectory-planning model plans for ``task`` from ``trajectory``.

        ``task`` is the instruction (or OpenAI-style messages); ``images`` are image URLs (``data:`` URLs
        or, where the deployment allows, local files), one per camera, in the model's camera order.
        Returns the planned steps, one vector per row (``chat(..., trajectory=...)`` gives the whole result).
        """
        if isinstance(task, str):
            parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
            messages = [{"role": "user", "content": [*parts, {"type": "text", "text": task}]}]
        elif images:
            raise InvalidRequest("give images inside the messages when task is a list of messages", param="images")
        else:
            messages = task
        result = self.chat(messages, trajectory=trajectory, noise_seed=noise_seed)
        if result.output_trajectory is None:
            raise RequestFailed("the deployment returned no trajectory")
        return [list(point) for point in result.output_trajectory]

    def stream(self, prompt: str | None = None, params: SamplingParams | None = None, *,
               messages: list[dict] | None = None, **extras: Any) -> Iterator[RequestOutput]:
        """Yield outputs as they are generated; closing the iterator cancels the request."""
        spec = RequestSpec(prompt=prompt, messages=tuple(messages) if messages else None,
                           params=params or SamplingParams(), stream=True, extras=extras)
        handle = self._submit(spec)
        try:
            yield from handle
        finally:
            if not handle.done.is_set():
                handle.cancel()

    def health(self) -> dict:
        return self.engine.health()

    def close(self) -> None:
        self.deployment.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _cancel(handles: list[RequestHandle]) -> None:
    for handle in handles:
        if not handle.done.is_set():
            handle.cancel()


__all__ = ["LLM", "SamplingParams", "collect"]
