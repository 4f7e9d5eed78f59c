"""Load a deployment: resolve the model, apply the gate once, build the engine."""

from __future__ import annotations

import logging

import attrs

from ifb.capabilities import DeployConfig, DeploymentCaps, DeploymentKind
from ifb.counters import SchedulingCounters
from ifb.engine import RequestEngine
from ifb.gate import UnsupportedDeployment, check_deployment
from ifb.kv import pool_for
from ifb.placement import check_dtype_name, describe_device, resolve_device
from ifb.plugins import PluginHost, default_host

log = logging.getLogger("ifb.deploy")

#: ``DeployConfig.options`` keys the core reads itself, whatever the plugin
CORE_SETTINGS = frozenset({"warmup_prompt"})


def check_settings(kind: DeploymentKind, config: DeployConfig) -> None:
    """Refuse ``config.options`` keys that ``kind`` declares it does not read (never a silent no-op)."""
    if kind.settings is None:
        return
    unknown = sorted(set(config.options) - kind.settings - CORE_SETTINGS)
    if unknown:
        named = ", ".join(f"{key} (--{key.replace('_', '-')})" for key in unknown)
        takes = ", ".join(sorted(kind.settings)) or "none"
        raise UnsupportedDeployment(f"the {kind.name} deployment does not read {named}; it would have no effect "
                                    f"(its settings: {takes})")


@attrs.define
class Deployment:
    kind: DeploymentKind
    config: DeployConfig
    caps: DeploymentCaps
    runtime: object
    engine: RequestEngine
    #: why the deployment is on the blocking path (None when served in flight or not asked)
    blocking_reason: str | None

    @property
    def mode(self) -> str:
        return "in-flight batching" if self.engine.is_in_flight else "blocking path (one request at a time)"

    def describe(self) -> str:
        caps = self.caps
        if self.engine.is_in_flight:
            why = (f" (the gate's decision: stepped execution and seated admission declared, "
                   f"max_batch_size {self.config.max_batch_size} within the built {caps.max_batch_size}, "
                   f"{caps.num_ranks} rank{'s' if caps.num_ranks > 1 else ''})")
        elif self.blocking_reason:
            why = f" (the gate's decision: {self.blocking_reason})"
        else:
            why = " (the default; pass --enable-in-flight-batching to batch)"
        return (f"loaded {self.runtime.model_name} with plugin {self.kind.plugin} ({self.kind.title}); "
                f"served by {self.mode}{why}")

    def shutdown(self) -> None:
        self.engine.shutdown()
        close = getattr(self.runtime, "close", None)  # a multi-rank runtime stops its ranks
        if close is not None:
            close()


def load_deployment(config: DeployConfig, host: PluginHost | None = None, *,
                    static_batching: bool = False) -> Deployment:
    """Build the deployment ``config`` asks for; raises UnsupportedDeployment at once
    (before loading weights) when the flag is set and the gate refuses."""
    host = host or default_host()
    kind = host.kind(config.plugin)
    check_settings(kind, config)
    config = placed(kind, config)
    reason = check_deployment(kind.declare(config), config)
    resolved = host.hook.ifb_resolve_model(name=config.model, plugin=kind.name)
    if resolved is not None:
        config = attrs.evolve(config, model=str(resolved))
    runtime = kind.load(config) if config.num_ranks == 1 else load_ranks(kind, config)
    caps = runtime.caps
    reason = check_deployment(caps, config)  # the loaded runtime's own declaration is the final word
    options = host.request_options()
    counters = SchedulingCounters()
    blocks = pool_for(runtime)
    if config.enable_in_flight_batching:
        prefix = None
        if config.enable_context_reuse:
            prefix = host.hook.ifb_prefix_cache(config=config, blocks=blocks, runtime=runtime, counters=counters)
            if prefix is None:
                raise UnsupportedDeployment("--enable-context-reuse needs a plugin that provides prefix reuse "
                                            "(the ifb_prefix_cache hook); none is installed")
        engine = RequestEngine(runtime, config, options, prefix=prefix, blocks=blocks, counters=counters,
                               static_batching=static_batching)
        warmup = config.options.get("warmup_prompt")
        if warmup:
            engine.warmup(warmup)
    else:
        if config.enable_context_reuse:
            raise UnsupportedDeployment(
                "--enable-context-reuse is served under in-flight batching only: add --enable-in-flight-batching")
        # the runtime's own prefix reuse on the blocking path (the legacy system-prompt capture), if any
        own_prefix = getattr(runtime, "blocking_prefix", None)
        engine = RequestEngine(runtime, config, options, in_flight=False, blocks=blocks, counters=counters,
                               prefix=own_prefix(blocks) if own_prefix is not None else None, reason=reason)
    deployment = Deployment(kind, config, caps, runtime, engine, reason)
    if config.num_ranks > 1:
        runtime.on_lost.append(engine.lose)
    log.info(deployment.describe())
    return deployment


def placed(kind: DeploymentKind, config: DeployConfig) -> DeployConfig:
    """``config`` with its device resolved (``ifb.placement``; refused before anything loads), logged."""
    check_dtype_name(config.dtype)
    config = attrs.evolve(config, device=resolve_device(config.device, kind.device_types, kind.name))
    log.info("device: %s; weights dtype: %s", describe_device(config.device), config.dtype)
    return config


def load_ranks(kind: DeploymentKind, config: DeployConfig):
    """Rank 0 of a tensor-parallel deployment: start (or, under torchrun, meet) the other ranks, load
    rank 0's shard, and wrap it in the runtime that broadcasts each step to them."""
    from ifb.parallel.driver import DriverRuntime
    from ifb.parallel.group import leave_ranks
    from ifb.parallel.launch import SpawnedRanks, join_ranks, spawn_workers, torchrun_env

    env = torchrun_env()
    if env is None:
        env, spawned = spawn_workers(config, kind.name)
    else:
        spawned = SpawnedRanks()  # torchrun owns the processes
        if env.world_size != config.num_ranks:
            raise UnsupportedDeployment(f"--tensor-parallel-size {config.num_ranks} but torchrun started "
                                        f"{env.world_size} ranks (WORLD_SIZE)")
        if env.rank != 0:
            raise UnsupportedDeployment(f"rank {env.rank} runs a shard, not the engine")
    try:
        ctx = join_ranks(env, config)
        try:
            inner = kind.load(config)
        except BaseException:
            leave_ranks()
            raise
    except BaseException:
        spawned.stop(grace=config.collective_timeout)
        raise
    log.info("tensor parallelism: rank 0 of %d (%s)", ctx.world_size, ctx.backend)
    return DriverRuntime(inner, ctx, timeout=config.collective_timeout, closers=[spawned.stop])
