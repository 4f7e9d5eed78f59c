"""Native kernels for GGUF checkpoints on CPUs (``csrc/qkernels.c``), compiled on first use.

- ``block_matmul``: matmuls that read Q4_0 / Q4_1 / Q8_0 blocks (regrouped
  once by ``interleave`` so that 16 output columns sit side by side, same
  bytes). By default each activation row is quantized per block of 32 to
  codes of about 15 bits (``int8``: 8 bits, as llama.cpp's CPU path does) and
  a block's product is an exact integer sum (AVX-512 VNNI, else AVX-512BW /
  AVX2 byte multiplies): about 1.5-2.7x the speed of rebuilding the weights
  in float32 (``int8``: 2-3x). With float32 activations the result differs
  from a float32 matmul on the dequantized weights by summation order only. (torch's packed int4 CPU matmul needs
  bfloat16 activations for speed, and for the few rows of a decode step it is
  limited by its unpacking more than by memory.)
- Q4_K and Q6_K rows are decoded once at load by ``interleave_kquant`` into
  kinds of their own for ``block_matmul`` (K4: 4-bit codes with each 32-weight
  sub-block's 6-bit scale and minimum; K6: 6-bit codes, as nibbles and 2-bit
  planes, with the int8 scales of a block's halves; both with float16 ``d``
  once per super-block, as the file has them), integer activations only: the
  bits of ``stored_matmul``, at the speed of the interleaved kernels (VNNI, AMX).
- ``stored_matmul``: the same integer scheme over GGUF rows kept exactly as
  stored for Q5_0, Q5_1, Q4_K, Q5_K and Q6_K (``csrc/matmul_stored.h``: each
  row decoded once per call; the same bits as ``quant_blocks.block_matmul``,
  its torch reference, on every instruction set).
- ``paged_attention``: causal attention over the paged KV cache that computes
  every query row on its own.
- ``ifb_decoder_forward`` (see ``native_decoder``): a whole decoder stack per call.

Work is split over a small pool of threads (``set_num_threads``) by groups of
output columns, (token, head) pairs, or (for the activation codes and the
decoder's norms, RoPE and SwiGLU, once a step holds enough rows) rows and
blocks, never inside a sum, so no result depends on the batch or the thread
count; the integer paths' results do not depend on the instruction set either.

On CPUs with AMX (and a kernel that grants it), whole tiles of 16 input rows (and
9 to 15 rows left over, padded with zero rows) get their integer block sums from
AMX tile products, bit-identical to the vector code; ``IFB_KERNEL_AMX=0`` turns
that off.

The C code (``csrc/``: ``qkernels.c``, which includes the headers beside it, one
concern each, as one translation unit) is built once per machine with the system
C compiler (``$CC``, else ``cc``) and ``-O3 -march=native`` (``$IFB_KERNEL_MARCH``
replaces ``native``, e.g. ``x86-64-v3`` for the AVX2 code on an AVX-512 CPU) into
the user cache directory, keyed by every source file, the compiler, the flags and
the CPU's feature flags. Without a
compiler, or on a CPU with neither AVX2 nor AVX-512, ``load()`` returns None
with a warning and the caller falls back to another path; ``require()`` raises
``KernelsUnavailable`` with the reason (the compiler's error) instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path
from typing import Literal, Sequence

import platformdirs
import torch

from ifb_plugins.common.layers.attention import AttnMetadata

log = logging.getLogger("ifb.text")

#: the package folder of the C sources, and the translation unit compiled from it
SOURCE_DIR = "csrc"
SOURCE_NAME = "qkernels.c"
#: bytes per column and 32-weight block of each kind as ``block_matmul`` reads it (0: Q4_0, 1: Q4_1,
#: 2: Q8_0 as stored; 3: Q4_K, 4: Q6_K and 5: Q5_K / Q5_1 as ``interleave_kquant`` decodes them)
BLOCK_BYTES = (18, 20, 34, 18, 26, 40)
#: and per column and 256-weight super-block (the head of Q4_K's d and dmin, of Q6_K's d)
SUPER_BYTES = (0, 0, 0, 4, 2, 0)


def kind_row_bytes(kind: int, k: int) -> int:
    """Bytes of one output column's ``k`` weights in ``kind``'s interleaved layout."""
    return k // 32 * BLOCK_BYTES[kind] + k // 256 * SUPER_BYTES[kind]
#: the kinds ``interleave_kquant`` makes, by ggml type number (Q4_K, Q6_K, Q5_K, Q5_1)
KQUANT_KINDS = {12: 3, 14: 4, 13: 5, 7: 5}
#: exact float32 arithmetic (no fused multiply-add contraction); ``-march`` is added per build
CFLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC")

#: the GGUF types ``stored_matmul`` reads (ggml's type numbers: Q5_0, Q5_1, Q4_K, Q5_K, Q6_K),
#: with their weights and bytes per block
STORED_BLOCKS = {6: (32, 22), 7: (32, 24), 12: (256, 144), 13: (256, 176), 14: (256, 210)}
STORED_TYPES = tuple(STORED_BLOCKS)

Activations = Literal["int16", "int8", "float32"]
#: how ``block_matmul`` takes its input rows, as the C code's int8 passes per block:
#: ``int16``: codes of about 15 bits per block of 32 (max|x| / 32512 steps), near float32 results;
#: ``int8``: llama.cpp's 8-bit codes (max|x| / 127 steps), the fastest; ``float32``: as they are
ACTIVATIONS: dict[str, int] = {"int16": 2, "int8": 1, "float32": 0}
#: KV cache dtypes the native attention reads, and the C code's flag for each (1: float16)
KV_DTYPES: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1}


def cache_dir() -> Path:
    """``$IFB_KERNEL_CACHE`` or ``<user cache>/ifb/kernels``."""
    override = os.environ.get("IFB_KERNEL_CACHE")
    return Path(override).expanduser() if override else Path(platformdirs.user_cache_dir("ifb")) / "kernels"


def cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags (a build's cache key)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    keep = [line for line in text.splitlines() if line.startswith(("flags", "model name", "Features"))]
    return "\n".join(sorted(set(keep)))


def find_compiler() -> str | None:
    """The C compiler the kernels are built with (``$CC``, else ``cc``) on the PATH; None if there is none."""
    name = os.environ.get("CC", "cc")
    return shutil.which(name)


def sources() -> dict[str, bytes]:
    """Every file of the C sources by name (``qkernels.c`` and the headers it includes)."""
    folder = resources.files("ifb_plugins.common.quant").joinpath(SOURCE_DIR)
    found = {entry.name: entry.read_bytes() for entry in folder.iterdir()
             if entry.is_file() and entry.name.endswith((".c", ".h"))}
    if SOURCE_NAME not in found:
        raise FileNotFoundError(f"{SOURCE_DIR}/{SOURCE_NAME}")
    return dict(sorted(found.items()))


def build_key(files: dict[str, bytes], compiler_version: str, flags: tuple[str, ...]) -> str:
    """The cache key of a build: every source file (name and bytes), the compiler, the flags, the CPU."""
    parts = [b"%s\0%s" % (name.encode(), data) for name, data in sorted(files.items())]
    parts += [compiler_version.encode(), " ".join(flags).encode(), cpu_signature().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _build(files: dict[str, bytes], compiler: str, flags: tuple[str, ...], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        src, lib = Path(tmp) / SOURCE_NAME, Path(tmp) / target.name
        cmd = [compiler, *flags, "-o", str(lib), str(src), "-lpthread", "-lm"]
        # -O3 over the whole unit takes about a minute of CPU: a busy machine needs more wall time
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()[-2000:]}")
        os.replace(lib, target)  # atomic: a concurrent loader sees the old file or the whole new one


class Kernels:
    """The loaded library: ``block_matmul`` and ``paged_attention`` on torch tensors."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.lib = lib
        self.path = path
        self.isa = int(lib.ifb_qk_isa())
        ptr, long = ctypes.c_void_p, ctypes.c_long
        self._matmul = lib.ifb_block_matmul
        self._matmul.argtypes = [ptr, long, long, ptr, ctypes.c_int, ctypes.c_int, ptr, ptr, long]
        self._matmul.restype = ctypes.c_int
        self._matmul_rows = lib.ifb_block_matmul_rows
        self._matmul_rows.argtypes = [ptr, long, long, ptr, ctypes.c_int, ctypes.c_int, ptr, ptr, ptr, long, long]
        self._matmul_rows.restype = ctypes.c_int
        self._interleave = lib.ifb_interleave
        self._interleave.argtypes = [ptr, long, long, ctypes.c_int, ptr]
        self._interleave.restype = None
        self._interleave_kquant = lib.ifb_interleave_kquant
        self._interleave_kquant.argtypes = [ptr, long, long, ctypes.c_int, ptr]
        self._interleave_kquant.restype = ctypes.c_int
        self._stored = lib.ifb_stored_matmul
        self._stored.argtypes = [ptr, long, long, ptr, ctypes.c_int, ctypes.c_int, ptr, ptr, long]
        self._stored.restype = ctypes.c_int
        self._attention = lib.ifb_paged_attention
        self._attention.argtypes = [ptr, long, long, long, long, long, ptr, ptr, ctypes.c_int, long, ptr, long, ptr,
                                    ptr, long, ctypes.c_float, ptr]
        self._attention.restype = None
        self._windowed = lib.ifb_windowed_attention
        self._windowed.argtypes = [ptr, long, long, long, long, long, ptr, ptr, ctypes.c_int, long, ptr, long, ptr,
                                   ptr, long, ctypes.c_float, long, ptr, ptr]
        self._windowed.restype = None
        self._argmax = lib.ifb_argmax_rows
        self._argmax.argtypes = [ptr, long, long, ptr]
        self._argmax.restype = None
        self._set_threads = lib.ifb_qk_set_threads
        self._set_threads.argtypes = [ctypes.c_int]
        self._get_threads = lib.ifb_qk_get_threads

    @property
    def num_threads(self) -> int:
        """Threads per matmul, the calling thread included."""
        return int(self._get_threads())

    def set_num_threads(self, n: int) -> None:
        """Split each matmul's output columns over ``n`` threads (helpers start on first use)."""
        self._set_threads(int(n))

    def interleave(self, blocks: torch.Tensor, kind: int) -> torch.Tensor:
        """GGUF rows ``[N, K / 32 * block bytes]`` (uint8) of ``kind`` 0 (Q4_0), 1 (Q4_1) or
        2 (Q8_0) in the layout ``block_matmul`` reads: output columns in groups of 16, each
        group's blocks with the 16 columns side by side. ``[ceil(N / 16) * 16, row bytes]``,
        the padding columns zero."""
        blocks = blocks.contiguous()
        n, row_bytes = blocks.shape
        k = row_bytes // BLOCK_BYTES[kind] * 32
        out = torch.empty(-(-n // 16) * 16, row_bytes, dtype=torch.uint8)
        self._interleave(blocks.data_ptr(), n, k, kind, out.data_ptr())
        return out

    def interleave_kquant(self, rows: torch.Tensor, qtype: int) -> torch.Tensor:
        """Q4_K, Q6_K, Q5_K or Q5_1 rows ``[N, K / block weights * block bytes]`` (uint8, as stored; ``qtype`` is ggml's
        type number) decoded into kind ``KQUANT_KINDS[qtype]`` of ``block_matmul``:
        ``[ceil(N / 16) * 16, kind_row_bytes(kind, K)]``, the padding columns zero."""
        if int(qtype) not in KQUANT_KINDS:
            raise ValueError(f"ggml type {qtype} has no interleaved kind")
        rows = rows.contiguous()
        n, row_bytes = rows.shape
        weights, nbytes = STORED_BLOCKS[int(qtype)]
        if row_bytes % nbytes:
            raise ValueError(f"rows of {row_bytes} bytes are not whole type-{qtype} blocks")
        k = row_bytes // nbytes * weights
        kind = KQUANT_KINDS[int(qtype)]
        out = torch.empty(-(-n // 16) * 16, kind_row_bytes(kind, k), dtype=torch.uint8)
        status = self._interleave_kquant(rows.data_ptr(), n, k, int(qtype), out.data_ptr())
        if status == -1:
            raise MemoryError("no memory to decode a row")
        if status != 0:
            raise ValueError(f"ggml type {qtype} rows of {k} weights cannot be interleaved")
        return out

    def block_matmul(self, x: torch.Tensor, blocks: torch.Tensor, kind: int, n: int,
                     bias: torch.Tensor | None = None, *, activations: Activations = "int16",
                     row_activations: Sequence[Activations] | None = None) -> torch.Tensor:
        """``x [M, K]`` times ``n`` weight rows interleaved by ``interleave``; float32 ``[M, n]``.

        ``bias`` (``[n]``, contiguous float32) is optional. ``activations`` (see
        ``ACTIVATIONS``): ``int16`` (the default) and ``int8`` quantize each row of ``x`` per
        32-block and multiply the blocks in integers (VNNI where the CPU has it); ``float32``
        rebuilds the weights in float32, the result differing from a float32 matmul by
        summation order only. ``row_activations`` (``int16`` or ``int8`` per row of ``x``, with
        integer ``activations``): each row's own codes, its result that of a call at its
        activations (what the native decoder runs prompt rows with).
        """
        x = _rows(x)
        m, k = x.shape
        row_passes = None
        if row_activations is not None:
            if activations not in ("int16", "int8") or len(row_activations) != m \
                    or not set(row_activations) <= {"int16", "int8"}:
                raise ValueError(f"row_activations: int16 or int8 for each of the {m} rows, with integer activations")
            row_passes = torch.tensor([ACTIVATIONS[a] for a in row_activations], dtype=torch.uint8)
        if kind >= 3 and activations == "float32":
            raise ValueError("the K-quant kinds take int16 or int8 activations")
        if blocks.shape[0] != -(-n // 16) * 16 or blocks.shape[1] != kind_row_bytes(kind, k):
            raise ValueError(f"{tuple(blocks.shape)} interleaved blocks do not hold {n} rows of {k}")
        out = torch.empty(m, n, dtype=torch.float32)
        status = self._matmul_rows(x.data_ptr(), m, k, blocks.data_ptr(), kind, ACTIVATIONS[activations],
                                   None if row_passes is None else row_passes.data_ptr(),
                                   None if bias is None else bias.data_ptr(), out.data_ptr(), n, n)
        if status == -1:
            raise MemoryError(f"no memory for the codes of {m} x {k} activations")
        if status != 0:
            raise ValueError(f"unknown block kind {kind}")
        return out

    def stored_matmul(self, x: torch.Tensor, rows: torch.Tensor, qtype: int, bias: torch.Tensor | None = None, *,
                      activations: Activations = "int16") -> torch.Tensor:
        """``x [M, K]`` times GGUF rows ``[N, row bytes]`` (uint8, as stored) of ggml type
        ``qtype`` (one of ``STORED_TYPES``); float32 ``[M, N]``. ``activations``: ``int16`` or
        ``int8`` (the integer scheme of ``block_matmul``)."""
        if activations not in ("int16", "int8"):
            raise ValueError(f"stored blocks are multiplied with int16 or int8 activations, not {activations!r}")
        x = _rows(x)
        m, k = x.shape
        if not rows.is_contiguous() or rows.dtype != torch.uint8:
            raise ValueError("stored rows must be contiguous uint8")
        if int(qtype) not in STORED_BLOCKS:
            raise ValueError(f"ggml type {qtype} is not read as stored")
        weights, nbytes = STORED_BLOCKS[int(qtype)]
        n = rows.shape[0]
        if rows.dim() != 2 or k % weights or rows.shape[1] != k // weights * nbytes:  # C would read past them
            raise ValueError(f"{tuple(rows.shape)} stored rows of type {qtype} do not hold {k} input features")
        out = torch.empty(m, n, dtype=torch.float32)
        status = self._stored(x.data_ptr(), m, k, rows.data_ptr(), int(qtype), ACTIVATIONS[activations],
                              None if bias is None else bias.data_ptr(), out.data_ptr(), n)
        if status == -1:
            raise MemoryError(f"no memory for the codes of {m} x {k} activations")
        if status != 0:
            raise ValueError(f"ggml type {qtype} with {k} input features is not read as stored")
        return out

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        attn: AttnMetadata, *, scale: float | None = None, window: int | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``attention.paged_attention`` for float32 or float16 caches: causal attention of ``q [T, Hq, D]``
        over the paged K/V (the step's own K/V already written); returns ``[T, Hq, D]``.

        ``scale`` multiplies ``q . k`` (``D ** -0.5`` unless given); with ``window`` a query at
        position p sees only p - window + 1 .. p (earlier blocks are not read); ``sinks [Hq]`` adds
        one logit per head to every softmax whose probability is dropped (gpt-oss).
        Every query row is computed on its own, so a token's result does not depend on the
        step's other tokens, whether they are batch mates or the rest of its prefill chunk.
        """
        t, hq, d = q.shape
        if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != d:
            q = q.float().contiguous()
        if (k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype
                or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
            raise ValueError("the native attention reads contiguous float32 or float16 KV caches")
        check_attention_metadata(attn, k_cache.shape[1])
        tables, starts, lens = attn.block_tables, attn.query_start_loc, attn.seq_lens
        if window is not None and window < 1:
            raise ValueError(f"a sliding window of {window} positions sees nothing")
        if sinks is not None:
            sinks = sinks.detach().float().contiguous()
            if sinks.shape != (hq,):
                raise ValueError(f"sinks of shape {tuple(sinks.shape)} for {hq} query heads")
        out = torch.empty(t, hq, d, dtype=torch.float32)
        self._windowed(q.data_ptr(), q.stride(0), t, hq, k_cache.shape[2], d, k_cache.data_ptr(),
                       v_cache.data_ptr(), KV_DTYPES[k_cache.dtype], attn.block_size, tables.data_ptr(),
                       tables.shape[1], starts.data_ptr(), lens.data_ptr(), lens.shape[0],
                       d ** -0.5 if scale is None else scale, window or 0,
                       None if sinks is None else sinks.data_ptr(), out.data_ptr())
        return out

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """Each row's greedy pick in ``logits [N, V]``: the first index of its maximum (or of its
        first NaN), as ``logits.max(dim=-1)`` picks it, over the kernels' threads."""
        x = _rows(logits)
        if x.shape[1] == 0:
            raise ValueError("argmax over an empty vocabulary")
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        return out.tolist()


def check_attention_metadata(attn: AttnMetadata, cache_block_size: int) -> None:
    """Raise unless ``attn`` is what the C code reads: contiguous int64 block tables, query
    starts and sequence lengths, for KV caches of ``cache_block_size`` slots per block."""
    tables, starts, lens = attn.block_tables, attn.query_start_loc, attn.seq_lens
    if not (tables.is_contiguous() and tables.dtype == starts.dtype == lens.dtype == torch.int64):
        raise ValueError("the native kernels read contiguous int64 attention metadata")
    if cache_block_size != attn.block_size:
        raise ValueError(f"KV cache blocks of {cache_block_size} slots, metadata for {attn.block_size}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the contiguous float32 matrix the C code reads."""
    if x.dim() != 2:
        raise ValueError(f"expected [rows, features], got {tuple(x.shape)}")
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    return x


class KernelsUnavailable(RuntimeError):
    """The kernels cannot be built or loaded here; the message says why (the compiler's error, if any)."""


def load(march: str | None = None) -> Kernels | None:
    """The compiled kernels, building them on first use; None (with a warning) when that is impossible.

    ``march``: the ``-march`` target, by default ``$IFB_KERNEL_MARCH`` or ``native``.
    """
    try:
        return require(march)
    except KernelsUnavailable as exc:
        log.warning("native GGUF kernels unavailable: %s", exc)
        return None


def require(march: str | None = None) -> Kernels:
    """``load``, but raising ``KernelsUnavailable`` (with the compiler's error) instead of returning None."""
    loaded = _load(march or os.environ.get("IFB_KERNEL_MARCH") or "native")
    if isinstance(loaded, KernelsUnavailable):
        raise loaded
    return loaded


def forget_loaded() -> None:
    """Drop the kernels ``load`` keeps, so that the next call builds or finds them again (``CC`` changed)."""
    _load.cache_clear()


def compiler_version(compiler: str) -> str:
    """``compiler --version``'s output (part of a build's cache key)."""
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelsUnavailable(f"{compiler} --version failed ({exc})") from exc


@functools.cache
def _load(march: str) -> Kernels | KernelsUnavailable:
    """The build for ``march``, or why there is none (kept too: a failed build is not retried)."""
    try:
        return _build_and_load(march)
    except KernelsUnavailable as exc:
        return exc


def _build_and_load(march: str) -> Kernels:
    try:
        files = sources()
    except OSError as exc:
        raise KernelsUnavailable(f"{SOURCE_DIR}/{SOURCE_NAME} is missing ({exc})") from exc
    compiler = find_compiler()
    if compiler is None:
        raise KernelsUnavailable("no C compiler (set CC or install cc)")
    flags = (*CFLAGS, f"-march={march}")
    target = cache_dir() / f"qkernels-{build_key(files, compiler_version(compiler), flags)}.so"
    try:
        if not target.exists():
            log.info("compiling native GGUF kernels into %s", target)
            _build(files, compiler, flags, target)
        kernels = Kernels(ctypes.CDLL(str(target)), target)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        raise KernelsUnavailable(str(exc)) from exc
    if kernels.isa == 0:
        raise KernelsUnavailable("this CPU has neither AVX2 nor AVX-512")
    return kernels
