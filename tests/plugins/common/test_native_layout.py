"""The native kernels' sources and the decoder's parameter layout: one definition, checked at load.

``csrc/decoder_params.h`` defines the structs; the C build and the ctypes mirror both come from
it, and a decoder checks that they agree. A field on one side only (a stale or hand-edited
mirror, a library built from other sources) must fail that check.
"""

from __future__ import annotations

import ctypes
import fnmatch
import subprocess
import tomllib
from pathlib import Path

import pytest

from ifb_plugins.common.models import native_decoder

from ifb_plugins.common.quant import kernels as qkernels
from tests.native import kernels_or_none, needs_kernels, require_native_kernels
from ifb_plugins.common.models.native_decoder import (
    PARAMS_HEADER, STRUCTS, build_structs, check_layout, layout_mismatches, parse_layout, reported_layout,
)

ROOT = Path(__file__).resolve().parents[3]
KERNELS = kernels_or_none()
HEADER = qkernels.sources()[PARAMS_HEADER].decode()
#: an extra field at the end of the step's parameters
EXTRA = "    F(long, kv_half)                /* the caches hold float16 (else float32) */"


def with_extra_step_field(header: str) -> str:
    assert EXTRA in header
    return header.replace(EXTRA, EXTRA + "                                          \\\n    F(long, extra)")


def test_the_mirror_is_built_from_the_header() -> None:
    layout = parse_layout(HEADER)
    assert list(layout) == ["weight_t", "layer_t", "decoder_t", "step_t"]
    assert [f for _, f in layout["weight_t"]] == ["kind", "passes", "blocks", "bias", "n", "k"]
    assert STRUCTS["layer_t"].qkv.offset == 4 * ctypes.sizeof(ctypes.c_void_p)
    # norms, qkv in up to 3 parts, o, a dense MLP's 2; a mixture of experts' 5 numbers, 4 pointers, shared expert's 2
    assert ctypes.sizeof(STRUCTS["layer_t"]) == 4 * 8 + 6 * ctypes.sizeof(STRUCTS["weight_t"]) + 9 * 8 + 2 * ctypes.sizeof(STRUCTS["weight_t"])


@needs_kernels
def test_the_build_lays_the_parameters_out_as_the_mirror() -> None:
    assert layout_mismatches(STRUCTS, reported_layout(KERNELS.lib)) == []
    check_layout(KERNELS)


@needs_kernels
def test_a_field_only_in_the_mirror_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    mirror = build_structs(parse_layout(with_extra_step_field(HEADER)))
    problems = layout_mismatches(mirror, reported_layout(KERNELS.lib))
    assert "step_t.extra is only in the ctypes mirror" in problems
    monkeypatch.setattr(native_decoder, "STRUCTS", mirror)
    with pytest.raises(RuntimeError, match="step_t.extra is only in the ctypes mirror"):
        check_layout(KERNELS)


def test_a_field_only_in_the_library_fails_the_check(tmp_path: Path) -> None:
    compiler = qkernels.find_compiler()
    if compiler is None:
        require_native_kernels()  # a failure naming the missing compiler, a skip only under the opt-out
    files = {**qkernels.sources(), PARAMS_HEADER: with_extra_step_field(HEADER).encode()}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    lib_path = tmp_path / "changed.so"
    # -O0: the layout is the same at every optimization level, and this build only reports it
    subprocess.run([compiler, "-O0", "-shared", "-fPIC", "-o", str(lib_path), str(tmp_path / qkernels.SOURCE_NAME),
                    "-lpthread", "-lm"], check=True, capture_output=True, timeout=300)
    library = ctypes.CDLL(str(lib_path))
    problems = layout_mismatches(STRUCTS, reported_layout(library))
    assert "step_t.extra is only in the library" in problems
    assert any(p.startswith("step_t: ") and "bytes in the ctypes mirror" in p for p in problems)
    with pytest.raises(RuntimeError, match="step_t.extra is only in the library"):
        check_layout(qkernels.Kernels(library, lib_path))


def test_the_cache_key_covers_every_source_file() -> None:
    files = qkernels.sources()
    assert qkernels.SOURCE_NAME in files and PARAMS_HEADER in files and len(files) > 10
    key = qkernels.build_key(files, "cc 1", ("-O3",))
    for name in files:
        changed = {**files, name: files[name] + b"\n"}
        assert qkernels.build_key(changed, "cc 1", ("-O3",)) != key, name
    assert qkernels.build_key({**files, "new.h": b""}, "cc 1", ("-O3",)) != key


def test_every_source_file_ships_and_none_is_too_long() -> None:
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "ifb_plugins.common.quant"]
    for name, data in qkernels.sources().items():
        assert any(fnmatch.fnmatch(f"{qkernels.SOURCE_DIR}/{name}", g) for g in globs), name
        assert data.count(b"\n") <= 600, name
