"""What rank 0 sends every rank, each step: a ``Command``, encoded by one strict cattrs converter.

A command is the engine's ``ScheduledStep`` (the diff: new seats once, then new
tokens and new block ids) plus the seats released since the last one. The
requests' prepared ``state`` stays on rank 0: sampling, guided decoding and
everything else that reads it run there, while the other ranks only run their
shard of the forward. The bytes travel as a uint8 tensor after an int64 length
(two broadcasts); nothing is pickled.
"""

from __future__ import annotations

import enum
import json

import attrs
import cattrs
import torch
import torch.distributed as dist

from ifb.runtime import NewSeq, ScheduledStep


class Kind(enum.IntEnum):
    STEP = 1
    KEEPALIVE = 2  # rank 0 is idle but alive: the other ranks' wait starts again
    STOP = 3  # the deployment is shutting down: every rank exits cleanly


@attrs.frozen
class Command:
    kind: Kind
    step: ScheduledStep | None = None
    #: requests that left their seats since the last command (their per-seat state is dropped first)
    released: tuple[str, ...] = ()


def _converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)
    # a NewSeq's prepared state is rank 0's (see the module docstring): it is not encoded
    unstructure_new = cattrs.gen.make_dict_unstructure_fn(
        NewSeq, conv, state=cattrs.gen.override(omit=True))
    structure_new = cattrs.gen.make_dict_structure_fn(
        NewSeq, conv, state=cattrs.gen.override(omit=True), _cattrs_forbid_extra_keys=True)
    conv.register_unstructure_hook(NewSeq, unstructure_new)
    conv.register_structure_hook(NewSeq, structure_new)
    return conv


CONVERTER = _converter()


def encode(command: Command) -> bytes:
    return json.dumps(CONVERTER.unstructure(command), separators=(",", ":")).encode()


def decode(data: bytes) -> Command:
    return CONVERTER.structure(json.loads(data), Command)


def send(command: Command, group=None) -> int:
    """Broadcast ``command`` from rank 0; returns the payload's size in bytes."""
    data = encode(command)
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=group)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=group)
    return len(data)


def receive(group=None) -> Command:
    """The next command from rank 0 (on every other rank); raises when rank 0 is gone."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)
    return decode(buf.numpy().tobytes())
