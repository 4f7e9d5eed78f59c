"""The native kernels in tests: required wherever they can build.

A build or load failure of ``ifb_plugins.common.quant.kernels`` fails every test that needs the
kernels, with the compiler's error, instead of skipping it. Only a machine without a C compiler
may opt out, explicitly, with ``IFB_TEST_WITHOUT_NATIVE_KERNELS=1`` (CI never sets it); then those
tests skip, naming the variable and the reason.
"""

from __future__ import annotations

import os

import pytest

from ifb_plugins.common.quant import kernels as qkernels

#: the opt-out for machines without a C compiler
OPT_OUT = "IFB_TEST_WITHOUT_NATIVE_KERNELS"


def opted_out() -> bool:
    return os.environ.get(OPT_OUT, "") not in ("", "0")


def kernels_or_none(march: str | None = None) -> qkernels.Kernels | None:
    """The kernels for module-level use (parametrization); None when they do not build.

    A test that uses them must also be marked ``needs_kernels``, which turns that None into a
    failure naming the compiler's error (``tests/conftest.py``).
    """
    try:
        return qkernels.require(march)
    except qkernels.KernelsUnavailable:
        return None


def require_native_kernels(march: str | None = None) -> qkernels.Kernels:
    """The kernels; a test failure with the reason when they do not build (a skip only under ``OPT_OUT``)."""
    try:
        return qkernels.require(march)
    except qkernels.KernelsUnavailable as exc:
        if opted_out():
            pytest.skip(f"{OPT_OUT} is set: the native kernels are not built here ({exc})")
        pytest.fail(f"the native GGUF kernels (-march={march or 'native'}) do not build or load: {exc}\n"
                    f"(only a machine without a C compiler may set {OPT_OUT}=1)", pytrace=False)


#: a test that needs the kernels: fails with the build's error where they do not build (``tests/conftest.py``)
needs_kernels = pytest.mark.native_kernels
