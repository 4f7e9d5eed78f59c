"""Joining the ranks: the process group, the start-up fingerprint check, threads per rank."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from datetime import timedelta
from importlib import metadata
from pathlib import Path

import attrs
import torch
import torch.distributed as dist

from ifb.capabilities import DeployConfig
from ifb.parallel import ParallelContext, set_current

log = logging.getLogger("ifb.parallel")

#: bytes read from each end of a model file for its fingerprint (with its size)
_FINGERPRINT_SPAN = 8 << 20


def backend_for(kind: str | None = None) -> str:
    """NCCL where the ranks run on CUDA (``kind`` "cuda..."), gloo on CPU."""
    if kind is None:
        kind = "cuda" if torch.cuda.is_available() and os.environ.get("IFB_DEVICE", "") != "cpu" else "cpu"
    return "nccl" if kind.startswith("cuda") else "gloo"


def init_ranks(rank: int, world_size: int, *, timeout: float, backend: str = "gloo") -> ParallelContext:
    """Join the process group from the rendezvous environment (MASTER_ADDR, MASTER_PORT), with
    ``timeout`` seconds for every collective: past it a silent rank is a lost rank."""
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    ctx = ParallelContext(rank=rank, world_size=world_size, group=dist.group.WORLD, backend=backend)
    set_current(ctx)
    return ctx


def leave_ranks() -> None:
    set_current(None)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a lost peer can make the teardown itself fail
            log.debug("destroying the process group failed", exc_info=True)


def threads_per_rank(num_local_ranks: int) -> int:
    """The cores of this machine divided among the ranks it runs (at least one each)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, num_local_ranks))


def _file_digest(path: Path, h) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with path.open("rb") as f:
        h.update(f.read(_FINGERPRINT_SPAN))
        if size > 2 * _FINGERPRINT_SPAN:
            f.seek(size - _FINGERPRINT_SPAN)
            h.update(f.read(_FINGERPRINT_SPAN))
        elif size > _FINGERPRINT_SPAN:
            h.update(f.read())


def fingerprint(config: DeployConfig) -> bytes:
    """What every rank must agree on: the ifb and torch versions, how the deployment is configured,
    and the model's files (each file's name, size and first and last 8 MiB)."""
    h = hashlib.sha256()
    try:
        version = metadata.version("ifb")
    except metadata.PackageNotFoundError:
        version = "unknown"
    settings = attrs.asdict(attrs.evolve(config, model=None))
    h.update(json.dumps({"ifb": version, "torch": torch.__version__, "config": settings},
                        sort_keys=True, default=str).encode())
    if config.model:
        path = Path(config.model)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if path.is_dir() and file.suffix not in (".json", ".safetensors", ".gguf", ".model", ".txt", ".jinja"):
                continue
            _file_digest(file, h)
    return h.digest()


def check_fingerprints(ctx: ParallelContext, config: DeployConfig) -> None:
    """Exchange fingerprints; every rank raises when one differs, naming the ranks."""
    mine = torch.frombuffer(bytearray(fingerprint(config)), dtype=torch.uint8)
    everyone = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, mine)
    differ = [r for r, fp in enumerate(everyone) if not torch.equal(fp, everyone[0])]
    if differ:
        raise RuntimeError(
            f"rank(s) {', '.join(map(str, differ))} started with a different model file, ifb version or "
            f"configuration than rank 0 (start-up fingerprints differ); every rank must load the same model "
            f"with the same ifb")
