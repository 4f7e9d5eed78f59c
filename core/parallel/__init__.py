"""Tensor parallelism on torch.distributed: one engine (rank 0) drives N ranks.

Rank 0 owns the engine, HTTP and sampling. Each step the engine schedules (the
diff ``ScheduledStep`` already is) is broadcast to every rank as a cattrs
encoding (``wire``); each rank runs its shard of the forward and the ranks meet
in all-reduces inside the model. Ranks are spawned on this machine
(``launch.spawn_workers``) or started by ``torchrun`` across machines
(``launch.torchrun_env``). A plugin shards its model by reading ``current()``
while it loads.
"""

from __future__ import annotations

import attrs

from ifb.runtime import RuntimeLost


@attrs.frozen
class ParallelContext:
    """This process's place among the ranks, set while a multi-rank deployment loads and runs."""

    rank: int
    world_size: int
    #: the torch.distributed process group the ranks share (the default group)
    group: object = attrs.field(eq=False, repr=False, default=None)
    backend: str = "gloo"

    @property
    def is_driver(self) -> bool:
        """Rank 0: the rank that owns the engine, HTTP and sampling."""
        return self.rank == 0


_current: ParallelContext | None = None


def current() -> ParallelContext | None:
    """The parallel context of this process, or None when it runs one rank."""
    return _current


def set_current(ctx: ParallelContext | None) -> None:
    global _current
    _current = ctx


class RankLost(RuntimeLost):
    """A rank died, stopped answering within the collective time-out, or fell out of step:
    the deployment cannot go on (the engine fails every request and stops)."""


__all__ = ["ParallelContext", "RankLost", "current", "set_current"]
