"""Starting the ranks: spawned on this machine, or by torchrun across machines.

On one machine (``ifb serve --tensor-parallel-size N``, ``LLM(tensor_parallel_size=N)``) the
serving process is rank 0 and spawns ranks 1..N-1 (torch.multiprocessing's ``spawn``),
which rendezvous on a free loopback port. Each spawned rank dies with its parent
(``PR_SET_PDEATHSIG``) and also exits when rank 0 stays silent past the collective
time-out, so none outlives the server.

Across machines torchrun starts every rank, on every machine, with its rendezvous
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``); the process of ``RANK`` 0 serves HTTP.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys

import attrs
import torch
import torch.multiprocessing as mp

from ifb.capabilities import DeployConfig
from ifb.parallel.group import backend_for, check_fingerprints, init_ranks, leave_ranks, threads_per_rank

log = logging.getLogger("ifb.parallel")

_PR_SET_PDEATHSIG = 1


@attrs.frozen
class RankEnv:
    """Where this process stands among the ranks, from torchrun's environment (or the spawner's)."""

    rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int


def torchrun_env() -> RankEnv | None:
    """This process's place when torchrun (or another launcher with its variables) started it, else None."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    return RankEnv(rank=int(env["RANK"]), world_size=world,
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
                   master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env.get("MASTER_PORT", 29500)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the collective time-out still ends this rank
        pass


def join_ranks(env: RankEnv, config: DeployConfig):
    """Join the group as ``env.rank``, set this rank's threads, check every rank loads the same model."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = env.master_addr, str(env.master_port)
    torch.set_num_threads(threads_per_rank(env.local_world_size))
    ctx = init_ranks(env.rank, env.world_size, timeout=config.collective_timeout, backend=backend_for())
    try:
        check_fingerprints(ctx, config)
    except BaseException:
        leave_ranks()
        raise
    return ctx


def run_shard(env: RankEnv, config: DeployConfig, load) -> int:
    """A rank other than 0, from start to exit: join, load the shard with ``load(config)``, serve steps.

    Returns the exit status: 0 when rank 0 told it to stop, 1 when a rank was lost or loading failed.
    """
    from ifb.parallel.driver import serve_shard

    try:
        ctx = join_ranks(env, config)
    except Exception as exc:  # noqa: BLE001
        log.error("rank %d: %s", env.rank, exc)
        return 1
    try:
        runtime = load(config)
        serve_shard(runtime, ctx)
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001
        log.error("rank %d: %s", env.rank, exc)
        return 1
    finally:
        leave_ranks()


def _spawned_rank(env: RankEnv, config: DeployConfig, plugin_kind: str) -> None:
    """Entry point of a spawned rank (module-level: spawn imports it by name)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops every rank
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s rank {env.rank} %(name)s: %(message)s")
    from ifb.plugins import default_host

    kind = default_host().kind(plugin_kind)
    sys.exit(run_shard(env, config, kind.load))


@attrs.define
class SpawnedRanks:
    """Ranks 1..N-1 spawned on this machine; ``stop`` ends any that did not exit by themselves."""

    processes: list = attrs.field(factory=list)

    def stop(self, grace: float = 10.0) -> None:
        for p in self.processes:
            p.join(timeout=grace)
        for p in self.processes:
            if p.is_alive():
                log.warning("rank process %d did not stop; killing it", p.pid)
                p.kill()
                p.join(timeout=5)

    def lost(self) -> list[int]:
        """The ranks whose process has exited."""
        return [i + 1 for i, p in enumerate(self.processes) if not p.is_alive()]


def spawn_workers(config: DeployConfig, plugin_kind: str) -> tuple[RankEnv, SpawnedRanks]:
    """Spawn ranks 1..N-1 of ``config.num_ranks`` here; returns rank 0's environment and the processes."""
    world = config.num_ranks
    port = free_port()
    ctx = mp.get_context("spawn")
    ranks = SpawnedRanks()
    for rank in range(1, world):
        env = RankEnv(rank=rank, world_size=world, local_world_size=world, master_addr="127.0.0.1", master_port=port)
        p = ctx.Process(target=_spawned_rank, args=(env, config, plugin_kind), name=f"ifb-rank-{rank}", daemon=True)
        p.start()
        ranks.processes.append(p)
    return RankEnv(0, world, world, "127.0.0.1", port), ranks
