"""Where a deployment runs: the torch device (``--device`` / ``LLM(device=...)``) and the weights'
floating dtype (``--dtype`` / ``LLM(dtype=...)``), one setting each for every plugin.

The device is resolved once, before anything loads: None becomes ``cuda`` when torch sees a CUDA
device and the deployment kind builds there (``DeploymentKind.device_types``), ``cpu`` otherwise; ``cuda`` on a machine without one (or ``cuda:N`` past the last one) is
refused with ``UnsupportedDeployment``, which ``ifb serve`` reports in one line. The dtype is a
name that the loader maps to a torch dtype: ``auto`` is bfloat16 on CUDA and float32 on the CPU,
for the loaders that build their weights in more than float32 (a loader that builds float32 only
refuses any other explicit choice).
"""

from __future__ import annotations

import re

import click

from ifb.gate import UnsupportedDeployment

#: values of ``DeployConfig.dtype``
DTYPES = ("auto", "bfloat16", "float16", "float32")
_DEVICE_RE = re.compile(r"cpu|cuda(:\d+)?")


class DeviceName(click.ParamType):
    """``cpu``, ``cuda`` or ``cuda:N`` (checked for form here; for presence when the deployment loads)."""

    name = "device"

    def convert(self, value, param, ctx):
        if value is None:
            return None
        text = str(value).strip().lower()
        if not _DEVICE_RE.fullmatch(text):
            self.fail(f"{value!r} is not cpu, cuda or cuda:N", param, ctx)
        return text

    def get_metavar(self, param, ctx=None) -> str:
        return "[cpu|cuda|cuda:N]"


def check_device_name(value: str | None) -> str | None:
    """``value`` as ``--device`` takes it; ValueError naming the flag when it is malformed."""
    try:
        return DeviceName().convert(value, None, None)
    except click.BadParameter as exc:
        raise ValueError(f"--device (device): {exc.message}") from None


def check_dtype_name(value: str) -> str:
    """``value`` as ``--dtype`` takes it; ValueError naming the flag when it is none of ``DTYPES``."""
    if value not in DTYPES:
        raise ValueError(f"--dtype (dtype): {value!r} is not one of {', '.join(DTYPES)}")
    return value


def resolve_device(value: str | None, device_types: frozenset[str] = frozenset({"cpu", "cuda"}),
                   kind: str = "this") -> str:
    """The device a deployment asked as ``value`` runs on (see the module docstring); ``device_types``
    are those the ``kind`` deployment builds on (``DeploymentKind.device_types``)."""
    import torch

    name = check_device_name(value)
    has_cuda = torch.cuda.is_available()
    if name is None:
        return "cuda" if has_cuda and "cuda" in device_types else "cpu"
    if name.partition(":")[0] not in device_types:
        raise UnsupportedDeployment(f"--device {name}: the {kind} deployment runs on "
                                    f"{', '.join(sorted(device_types))} only")
    if name.startswith("cuda"):
        if not has_cuda:
            raise UnsupportedDeployment(f"--device {name}: no CUDA device is available here "
                                        f"(torch {torch.__version__} sees none); use --device cpu")
        index = int(name.partition(":")[2] or 0)
        count = torch.cuda.device_count()
        if index >= count:
            raise UnsupportedDeployment(f"--device {name}: there {'is' if count == 1 else 'are'} only {count} "
                                        f"CUDA device{'' if count == 1 else 's'} (cuda:0..cuda:{count - 1})")
    return name


def describe_device(name: str) -> str:
    """``name`` with what it is, for the start-up log: ``cuda:0 (NVIDIA H200, 139.8 GiB free)``."""
    import torch

    if not name.startswith("cuda"):
        return f"{name} ({torch.get_num_threads()} torch threads)"
    device = torch.device(name)
    free, _ = torch.cuda.mem_get_info(device)
    return f"{name} ({torch.cuda.get_device_name(device)}, {free / 2**30:.1f} GiB free)"
