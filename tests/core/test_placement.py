"""``--device`` / ``--dtype`` (``ifb.placement``): resolved once for every plugin, a missing CUDA
device refused at start-up in one line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from ifb.capabilities import DeployConfig
from ifb.gate import UnsupportedDeployment
from ifb.llm import LLM
from ifb.placement import check_device_name, check_dtype_name, resolve_device
from ifb.server.cli import serve


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as a CPU-only machine sees it, wherever the test runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_unset_device_is_cuda_where_present_and_the_kind_builds_there() -> None:
    assert resolve_device(None) == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(None, frozenset({"cpu"})) == "cpu"
    assert resolve_device("cpu") == "cpu"
    assert DeployConfig().device is None and DeployConfig().dtype == "auto"


def test_cuda_is_refused_without_a_device_and_on_a_cpu_only_kind(no_cuda: None) -> None:
    assert resolve_device(None) == "cpu"
    for name in ("cuda", "cuda:1"):
        with pytest.raises(UnsupportedDeployment, match=f"--device {name}: no CUDA device is available"):
            resolve_device(name)
    with pytest.raises(UnsupportedDeployment, match="the tts deployment runs on cpu only"):
        resolve_device("cuda", frozenset({"cpu"}), "tts")


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "cpu:0", "mps"])
def test_malformed_devices_are_refused_naming_the_flag(name: str) -> None:
    with pytest.raises(ValueError, match=r"--device \(device\)"):
        check_device_name(name)
    with pytest.raises(ValueError, match=r"--device \(device\)"):
        LLM("unused", device=name)


def test_unknown_dtype_is_refused_naming_the_flag() -> None:
    assert check_dtype_name("bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match=r"--dtype \(dtype\): 'float8' is not one of auto"):
        LLM("unused", dtype="float8")


def test_llm_device_cuda_is_refused_before_loading(no_cuda: None, tmp_path) -> None:
    # the path does not exist: the refusal comes before any loader looks at it
    with pytest.raises(UnsupportedDeployment, match="no CUDA device"):
        LLM(str(tmp_path / "absent"), device="cuda")


def test_serve_refuses_cuda_in_one_line_with_exit_code_1(no_cuda: None, tmp_path) -> None:
    result = CliRunner().invoke(serve, [str(tmp_path / "absent"), "--device", "cuda"])
    assert result.exit_code == 1
    assert "ifb serve: --device cuda: no CUDA device is available here" in result.output
    assert "Traceback" not in result.output


def test_serve_refuses_a_malformed_device_as_a_usage_error() -> None:
    result = CliRunner().invoke(serve, ["x", "--device", "gpu0"])
    assert result.exit_code == 2 and "'gpu0' is not cpu, cuda or cuda:N" in result.output


def test_serve_on_a_machine_without_cuda_exits_cleanly(tmp_path) -> None:
    # a real process with no CUDA device visible (CUDA_VISIBLE_DEVICES empty hides any there is)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "ifb", "serve", str(tmp_path / "absent"), "--device", "cuda:0"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "ifb serve: --device cuda:0: no CUDA device is available here" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_resolved_device_is_logged_at_start_up(caplog, tmp_path) -> None:
    from tests.models.converted import save_tiny_dense

    path = save_tiny_dense(tmp_path / "llama", "llama")
    with caplog.at_level(logging.INFO, logger="ifb.deploy"):
        with LLM(str(path), device="cpu") as llm:
            assert llm.deployment.config.device == "cpu"
            assert next(llm.deployment.runtime.model.parameters()).device.type == "cpu"
    assert any(r.getMessage().startswith("device: cpu (") and "weights dtype: auto" in r.getMessage()
               for r in caplog.records)


def test_batch_invariance_is_declared_for_the_cpu_only() -> None:
    from ifb.plugins import default_host

    host = default_host()
    for name in ("text", "vlm", "mamba"):
        kind = host.kind(name)
        assert kind.declare(DeployConfig(plugin=name, device="cpu")).batch_invariant_verified, name
        assert not kind.declare(DeployConfig(plugin=name, device="cuda")).batch_invariant_verified, name
