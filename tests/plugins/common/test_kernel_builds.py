"""Every instruction-set variant of the native kernels compiles, on any x86 machine.

``csrc/`` holds a scalar, an AVX2, an AVX-512 (with and without VNNI) and an AMX variant of its
hot loops, chosen by the ``-march`` the library is built with. A CPU runs at most a few of them,
and the kernel tests exercise only those (the native build: ``tests/native.py``); the others are
checked here with the compiler's front end and the flags production builds with
(``kernels.CFLAGS`` and each variant's ``-march``), so that an error in a branch this CPU never
runs fails the suite instead of shipping. Each check also asserts that its ``-march`` selects the
variant it names (the macros ``base.h`` and ``amx.h`` define).
"""

from __future__ import annotations

import platform
import re
import subprocess
from pathlib import Path

import pytest

from ifb_plugins.common.quant import kernels as qkernels
from tests.native import OPT_OUT, opted_out

#: variant -> (-march, IFB_ISA, AVX-512 VNNI, AMX)
VARIANTS = {
    "scalar": ("x86-64", 0, False, False),
    "avx2": ("x86-64-v3", 256, False, False),
    "avx512": ("skylake-avx512", 512, False, False),
    "avx512-vnni": ("cascadelake", 512, True, False),
    "amx": ("sapphirerapids", 512, True, True),
}
#: C's implicit declarations and conversions are warnings in older compilers: here they are the
#: errors they are in newer ones (a misspelt intrinsic must not pass as an undeclared function)
STRICT = ("-Werror=implicit-function-declaration", "-Werror=int-conversion", "-Werror=incompatible-pointer-types")

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="the variants are x86 instruction sets")


def compiler() -> str:
    found = qkernels.find_compiler()
    if found is None:
        if opted_out():
            pytest.skip(f"{OPT_OUT} is set and there is no C compiler")
        pytest.fail(f"no C compiler (set CC or install cc; only a machine without one may set {OPT_OUT}=1)")
    return found


def variant_flags(march: str) -> list[str]:
    """What ``kernels._build_and_load`` passes for ``march`` (``-shared`` aside: no link here)."""
    return [f for f in (*qkernels.CFLAGS, f"-march={march}") if f != "-shared"]


def check(cc: str, source: Path, march: str) -> dict[str, str]:
    """Compile ``source`` for ``march`` through the front end (parse, types, every declaration);
    return the macros defined at its end. Fails the test with the compiler's error."""
    flags = variant_flags(march)
    run = subprocess.run([cc, *flags, *STRICT, "-fsyntax-only", str(source)], capture_output=True, text=True,
                         timeout=300)
    if run.returncode != 0:
        pytest.fail(f"{cc} {' '.join(flags)} does not compile {source.name}:\n{run.stderr.strip()[-4000:]}",
                    pytrace=False)
    macros = subprocess.run([cc, *flags, "-E", "-dM", str(source)], capture_output=True, text=True, timeout=300,
                            check=True).stdout
    return dict(re.findall(r"^#define (\w+) ?(.*)$", macros, flags=re.M))


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sources as ``kernels`` builds them: a copy of every file of ``csrc/``."""
    directory = tmp_path_factory.mktemp("csrc")
    for name, data in qkernels.sources().items():
        (directory / name).write_bytes(data)
    return directory


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_instruction_set_variant_compiles(variant: str, source_dir: Path) -> None:
    march, isa, vnni, amx = VARIANTS[variant]
    macros = check(compiler(), source_dir / qkernels.SOURCE_NAME, march)
    assert int(macros["IFB_ISA"]) == isa
    assert ("__AVX512VNNI__" in macros) == vnni
    assert int(macros["HAS_AMX"]) == int(amx)


def test_an_error_in_a_branch_this_cpu_does_not_run_fails_its_variant(tmp_path: Path) -> None:
    # the check is only worth having if it sees the branches: a syntax error in the AVX-512 code
    # must fail the AVX-512 variant and leave the AVX2 one alone
    cc = compiler()
    for name, data in qkernels.sources().items():
        (tmp_path / name).write_bytes(data)
    header = tmp_path / "isa_avx512.h"
    header.write_text(header.read_text() + "\nINLINE int broken(void) { return 1 }\n")
    check(cc, tmp_path / qkernels.SOURCE_NAME, VARIANTS["avx2"][0])
    flags = variant_flags(VARIANTS["avx512"][0])
    run = subprocess.run([cc, *flags, *STRICT, "-fsyntax-only", str(tmp_path / qkernels.SOURCE_NAME)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "isa_avx512.h" in run.stderr
