"""A GGUF file's memory map as the loader reads it, and the check that the model fits in memory.

``MappedFile`` is the file's one read-only map (``gguf.GGUFReader``'s): each tensor is read
once, into its run layout (interleaved blocks, or float32 for what stays float32), and its
pages are then handed back to the kernel (``madvise(MADV_DONTNEED)``: clean file pages, read
again from the page cache if ever touched), so the resident set of a load is the model as it
runs plus one tensor in flight, not that plus the whole mapped file. Each read advances a
progress bar over the file's tensor bytes (``tqdm``; shown on a terminal).

``check_fits`` refuses, before any tensor is read, a model whose run layout and
``LOAD_OVERHEAD_BYTES`` exceed the memory this process can still take (``available_memory``:
the least of the kernel's ``MemAvailable``, the cgroup's headroom, the address-space limit's
headroom and ``$IFB_MEMORY_LIMIT``), naming both numbers.
"""

from __future__ import annotations

import mmap
import os
import resource
from pathlib import Path

import attrs
import numpy as np
from tqdm import tqdm

#: what a load takes beyond the model's tensors as they run: the interpreter, torch and the
#: tokenizer (about 300 MiB), a tensor's pages in flight and its transient copies
LOAD_OVERHEAD_BYTES = 512 << 20
#: ``$IFB_MEMORY_LIMIT``: bytes the process may use (a deployment's own cap, below what the machine has)
MEMORY_LIMIT_ENV = "IFB_MEMORY_LIMIT"


class InsufficientMemory(MemoryError):
    """The model does not fit in the memory available; the message names both numbers."""


@attrs.define(eq=False)
class MappedFile:
    """A file's read-only ``np.memmap`` (``array``): ``release`` counts a tensor read and drops its pages."""

    path: Path
    array: np.memmap = attrs.field(repr=False)
    #: bytes of tensor data in the file (the progress bar's total)
    total_bytes: int
    num_bytes_read: int = 0
    _seen: set[int] = attrs.field(factory=set, repr=False)
    _bar: tqdm | None = attrs.field(default=None, repr=False)

    def release(self, offset: int, nbytes: int) -> None:
        """Bytes ``[offset, offset + nbytes)`` of the file were read into their run layout: count
        them once, and drop their pages from this process (the whole pages inside the range)."""
        if offset not in self._seen:
            self._seen.add(offset)
            self.num_bytes_read += nbytes
            if self._bar is None:
                self._bar = tqdm(total=self.total_bytes, unit="B", unit_scale=True, desc=f"loading {self.path.name}",
                                 leave=False, disable=None)
            self._bar.update(nbytes)
            if self.num_bytes_read >= self.total_bytes:
                self._bar.close()
        mapped = getattr(self.array, "_mmap", None)
        page = mmap.PAGESIZE
        start, stop = -(-offset // page) * page, (offset + nbytes) // page * page
        if mapped is not None and stop > start and hasattr(mapped, "madvise"):
            mapped.madvise(mmap.MADV_DONTNEED, start, stop - start)


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_headroom() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None


def _address_space_headroom() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return soft - int(line.split()[1]) * 1024
    except OSError:
        pass
    return soft


def available_memory() -> tuple[int, str]:
    """The bytes this process can still take, and where that bound comes from."""
    found: list[tuple[int, str]] = []
    if (value := os.environ.get(MEMORY_LIMIT_ENV)) is not None:
        try:
            found.append((int(value), f"${MEMORY_LIMIT_ENV}"))
        except ValueError:
            raise ValueError(f"${MEMORY_LIMIT_ENV} must be a number of bytes, not {value!r}") from None
    for probe, source in ((_meminfo_available, "available memory"), (_cgroup_headroom, "the cgroup's limit"),
                          (_address_space_headroom, "the address-space limit")):
        if (headroom := probe()) is not None:
            found.append((headroom, source))
    return min(found) if found else (1 << 62, "no limit found")


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def check_fits(path: Path, file_bytes: int, run_bytes: int) -> None:
    """Raise ``InsufficientMemory`` unless ``run_bytes`` (the tensors as they will run) plus
    ``LOAD_OVERHEAD_BYTES`` fit in ``available_memory()``."""
    needed = run_bytes + LOAD_OVERHEAD_BYTES
    available, source = available_memory()
    if needed > available:
        raise InsufficientMemory(
            f"{path.name} ({gib(file_bytes)} file) needs {gib(needed)} to load ({gib(run_bytes)} of tensors as "
            f"they run + {gib(LOAD_OVERHEAD_BYTES)} overhead), but only {gib(available)} is available ({source})")
