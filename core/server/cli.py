"""``ifb serve``: load a deployment and serve it over OpenAI-compatible HTTP."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import attrs
import click

from ifb.capabilities import DeployConfig
from ifb.placement import DTYPES, DeviceName
from ifb.server.reasoning import PARSERS
from ifb.server.plugin_flags import PluginFlagsCommand, default_plugin, setting_options

log = logging.getLogger("ifb.server")

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _parse_lora(values: tuple[str, ...]) -> dict[str, str]:
    adapters: dict[str, str] = {}
    for value in values:
        name, sep, directory = value.partition("=")
        if not sep or not name or not directory:
            raise click.BadParameter(f"{value!r} is not NAME=DIR", param_hint="--lora")
        if not Path(directory).expanduser().is_dir():
            raise click.BadParameter(f"{directory!r} is not a directory", param_hint="--lora")
        if name in adapters:
            raise click.BadParameter(f"adapter {name!r} is given twice", param_hint="--lora")
        adapters[name] = str(Path(directory).expanduser())
    return adapters


def _reason(exc: BaseException) -> str:
    # KeyError's str() quotes its message
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return str(exc) or type(exc).__name__


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)


@click.command(cls=PluginFlagsCommand)
@click.argument("model", required=False)
@click.option("--plugin", default=None,
              help="Plugin (deployment kind) that loads the model.  [default: the installed default kind]")
@click.option("--max-batch-size", type=click.IntRange(min=1), default=4, show_default=True,
              help="Requests that decode together (seats in the running batch).")
@click.option("--enable-in-flight-batching", is_flag=True,
              help="Let queued requests join the running batch at the next step boundary.")
@click.option("--max-queued-requests", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests that may wait beyond the batch; past it a request gets 429.")
@click.option("--queue-timeout", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Seconds a request may wait in the queue on the default path before it gets 429.")
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=None,
              help="Per-step token budget (prefill chunks + decodes).  [default: 256]")
@click.option("--enable-context-reuse", is_flag=True, help="Reuse published KV prefixes across requests.")
@click.option("--max-kv-cache-capacity", type=click.IntRange(min=1), default=None,
              help="Tokens of KV cache to allocate.")
@click.option("--lora", "loras", multiple=True, metavar="NAME=DIR",
              help="Register a LoRA adapter; a request selects it with \"model\": NAME. Repeatable.")
@click.option("--max-loras", type=click.IntRange(min=1), default=None,
              help="LoRA adapters loaded at once (start-up and the admin route /v1/load_lora_adapter). "
                   "[default: 4 with --lora, else none]")
@click.option("--max-lora-rank", type=click.IntRange(min=1), default=None,
              help="The largest adapter rank accepted.  [default: 64]")
@click.option("--served-model-name", default=None, help="The model name clients use (default: from the file).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--api-key", envvar="IFB_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on every route but /health (or set IFB_API_KEY).")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info", show_default=True)
@click.option("--warmup-prompt", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A system prompt file to prefill and publish before serving (needs --enable-context-reuse).")
@click.option("--max-request-body-bytes", type=click.IntRange(min=1), default=16 * 1024 * 1024, show_default=True,
              help="Largest request body; a larger one is refused with 413 before it is read.")
@click.option("--allowed-hosts", "allowed_hosts", multiple=True, metavar="NAME",
              help="A Host name (or *.suffix, or *) served besides loopback names. Repeatable. Bound to "
                   "loopback, other Host headers are refused (DNS rebinding).")
@click.option("--allowed-origins", "allowed_origins", multiple=True, metavar="ORIGIN",
              help="A web origin (https://app.example) whose pages may call the server (CORS). Repeatable; "
                   "other origins are refused.")
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), default=None,
              help="Ranks to shard the model over (tensor parallelism): spawned on this machine, or the ranks "
                   "torchrun started (WORLD_SIZE).  [default: 1, or WORLD_SIZE under torchrun]")
@click.option("--collective-timeout", type=click.FloatRange(min=1), default=60.0, show_default=True,
              help="Seconds a collective between ranks may take; past it the silent rank is lost and the "
                   "server fails its requests and exits.")
@click.option("--reasoning-parser", type=click.Choice(PARSERS), default="auto", show_default=True,
              help="Split a reasoning model's thinking from its answer (reasoning_content, reasoning items, "
                   "thinking blocks); auto: from the chat template.")
@click.option("--device", type=DeviceName(), default=None,
              help="The torch device every part of the model runs on.  [default: cuda when a CUDA device is "
                   "present, else cpu]")
@click.option("--dtype", type=click.Choice(DTYPES), default="auto", show_default=True,
              help="The weights' floating dtype; auto: bfloat16 on CUDA, float32 on the CPU.")
@click.option("--static-batching", is_flag=True, hidden=True,
              help="(For benchmarks) admit a batch together and drain it before the next; needs in-flight batching.")
def serve(model: str | None, plugin: str, max_batch_size: int, enable_in_flight_batching: bool,
          max_queued_requests: int, queue_timeout: float, max_num_batched_tokens: int | None,
          enable_context_reuse: bool, max_kv_cache_capacity: int | None, loras: tuple[str, ...],
          max_loras: int | None, max_lora_rank: int | None,
          served_model_name: str | None, host: str, port: int, api_key: str | None, log_level: str,
          warmup_prompt: Path | None = None, max_request_body_bytes: int = 16 * 1024 * 1024,
          allowed_hosts: tuple[str, ...] = (), allowed_origins: tuple[str, ...] = (),
          static_batching: bool = False, reasoning_parser: str = "auto", tensor_parallel_size: int | None = None,
          collective_timeout: float = 60.0, device: str | None = None, dtype: str = "auto", **plugin_flags) -> None:
    """Serve MODEL (a file, a directory or a known name; default: the plugin's default model)
    over OpenAI-compatible HTTP: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

    The flags marked (PLUGIN) come from the installed plugins (see `ifb matrix`)."""
    import uvicorn

    from ifb.deploy import load_deployment
    from ifb.parallel.launch import torchrun_env
    from ifb.server.app import build_app
    from ifb.server.guard import GuardConfig, is_loopback

    _setup_logging(log_level)
    if static_batching and not enable_in_flight_batching:
        raise click.UsageError("--static-batching needs --enable-in-flight-batching")
    options: dict = {}
    adapters = _parse_lora(loras)
    if adapters:
        options["lora_adapters"] = adapters
    if max_loras is not None:
        options["max_loras"] = max_loras
    if max_lora_rank is not None:
        options["max_lora_rank"] = max_lora_rank
    if served_model_name:
        options["served_model_name"] = served_model_name
    if warmup_prompt is not None:
        if not enable_context_reuse:
            raise click.UsageError("--warmup-prompt publishes a prefix in the context cache: add --enable-context-reuse")
        options["warmup_prompt"] = warmup_prompt.read_text()
    options.update(setting_options(plugin_flags))
    plugin = plugin or default_plugin()
    fields = dict(
        model=model, plugin=plugin, max_batch_size=max_batch_size,
        enable_in_flight_batching=enable_in_flight_batching, max_queued_requests=max_queued_requests,
        queue_timeout=queue_timeout, enable_context_reuse=enable_context_reuse,
        max_kv_cache_capacity=max_kv_cache_capacity, options=options,
        num_ranks=_num_ranks(tensor_parallel_size, torchrun_env()), collective_timeout=collective_timeout,
        device=device, dtype=dtype,
    )
    if max_num_batched_tokens is not None:
        fields["max_num_batched_tokens"] = max_num_batched_tokens
    config = DeployConfig(**fields)
    env = torchrun_env()
    if env is not None and env.rank != 0:  # torchrun's other ranks run shards; rank 0 serves HTTP
        sys.exit(_serve_shard(env, config))
    log.info("loading %s with plugin %s", model or "the default model", plugin)
    try:
        deployment = load_deployment(config, static_batching=static_batching)
    except Exception as exc:  # noqa: BLE001 - any start-up refusal is reported, without a traceback
        log.debug("start-up failed", exc_info=True)
        click.echo(f"ifb serve: {_reason(exc)}", err=True)
        sys.exit(1)
    try:
        guard = GuardConfig(check_host=is_loopback(host) or bool(allowed_hosts), allowed_hosts=allowed_hosts,
                            allowed_origins=allowed_origins, max_request_body_bytes=max_request_body_bytes)
        app = build_app(deployment, api_key=api_key, model_name=served_model_name, guard=guard,
                        reasoning_parser=reasoning_parser)
        if not logging.getLogger("ifb.deploy").isEnabledFor(logging.INFO):  # else load_deployment logged it
            click.echo(f"ifb serve: {deployment.describe()}", err=True)
        click.echo(f"ifb serve: listening on http://{host}:{port}/v1 "
                   f"({'API key required' if api_key else 'no API key'})", err=True)
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                               timeout_graceful_shutdown=5))

        def lost(error: BaseException) -> None:  # the engine failed every request: stop serving, exit non-zero
            click.echo(f"ifb serve: {error}; stopping", err=True)
            server.should_exit = True

        deployment.engine.on_lost.append(lost)
        server.run()
    finally:
        deployment.shutdown()
    if deployment.engine.lost is not None:
        sys.exit(3)


def _num_ranks(tensor_parallel_size: int | None, env) -> int:
    if env is None:
        return tensor_parallel_size or 1
    if tensor_parallel_size not in (None, env.world_size):
        raise click.UsageError(f"--tensor-parallel-size {tensor_parallel_size} but torchrun started "
                               f"{env.world_size} ranks (WORLD_SIZE)")
    return env.world_size


def _serve_shard(env, config: DeployConfig) -> int:
    """A rank other than 0 under torchrun: load this rank's shard and run the steps rank 0 sends."""
    from ifb.deploy import placed
    from ifb.parallel.launch import run_shard
    from ifb.plugins import default_host

    host = default_host()
    kind = host.kind(config.plugin)
    config = placed(kind, config)  # the device and dtype resolved as rank 0 resolves them (same fingerprint)
    resolved = host.hook.ifb_resolve_model(name=config.model, plugin=kind.name)
    if resolved is not None:
        config = attrs.evolve(config, model=str(resolved))
    return run_shard(env, config, kind.load)
