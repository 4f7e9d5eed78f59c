"""Plugin discovery, the gate's refusals, and the generated support matrix."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ifb.capabilities import DeployConfig
from ifb.cli import main
from ifb.gate import UnsupportedDeployment, check_deployment, ifb_unsupported_reason

from tests.core.fakes import text_caps

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.mark.parametrize("caps,config,message", [
    (text_caps(stepped_execution=False), DeployConfig(), "does not support stepped execution"),
    (text_caps(seated_admission=False), DeployConfig(max_batch_size=4),
     "max_batch_size 4 > 1 needs seated admission"),
    (text_caps(max_batch_size=2), DeployConfig(max_batch_size=4),
     "max_batch_size 4 exceeds the batch size the runtime was built for \\(2\\)"),
    (text_caps(num_ranks=2), DeployConfig(), "spans 2 ranks; the in-flight engine drives 1"),
    (text_caps(supports_prefix_reuse=False, prefix_reuse_note="no state checkpoints"),
     DeployConfig(enable_context_reuse=True), "--enable-context-reuse is not supported.*no state checkpoints"),
])
def test_every_load_time_refusal_names_its_reason(caps, config, message):
    import re
    assert re.search(message, ifb_unsupported_reason(caps, config))
    with pytest.raises(UnsupportedDeployment, match=message):
        check_deployment(caps, DeployConfig(**{**_fields(config), "enable_in_flight_batching": True}))
    if not config.enable_context_reuse:  # without the flag: the blocking path, with the reason kept
        assert re.search(message, check_deployment(caps, config))


def _fields(config):
    import attrs
    return attrs.asdict(config, recurse=False)


def test_single_rank_batch_of_one_without_seating_is_fine():
    assert ifb_unsupported_reason(text_caps(seated_admission=False), DeployConfig(max_batch_size=1)) is None


def test_docs_support_matrix_is_generated_and_current():
    result = CliRunner().invoke(main, ["matrix", "--builtin-only"])
    assert result.exit_code == 0, result.output
    current = (ROOT / "docs" / "support-matrix.md").read_text()
    assert result.output == current, "docs/support-matrix.md is stale: run `ifb matrix --builtin-only > docs/support-matrix.md`"


def test_matrix_json_has_both_tables():
    data = json.loads(CliRunner().invoke(main, ["matrix", "--format", "json"]).output)
    text = [r for r in data["deployments"] if r["plugin"] == "text"]
    assert {r["deployment"]: r["status"] for r in text}["Text LLM, single rank"] == "served"
    rows = {r["option"]: r["status"] for r in data["requests"] if r["plugin"] == "text"}
    assert rows["Per-request LoRA"] == "rejected"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The fixture plugins installed (really, with pip) into a private site directory."""
    target = tmp_path_factory.mktemp("site")
    for name in ("ifb_echo_plugin", "broken_plugin"):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(target), str(FIXTURES / name)], check=True, capture_output=True)
    return target


def _ifb(site, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "ifb", *args], capture_output=True, text=True, env=env, timeout=120)


def test_third_party_plugin_appears_in_plugins_and_matrix(site):
    listing = _ifb(site, "plugins")
    assert listing.returncode == 0, listing.stderr
    echo = next(line for line in listing.stdout.splitlines() if line.startswith("echo"))
    assert "0.3.1" in echo and "ifb-echo-plugin" in echo
    assert "text" in listing.stdout and "built-in" in listing.stdout
    broken = next(line for line in listing.stdout.splitlines() if line.startswith("broken"))
    assert "FAILED TO LOAD" in broken and "needs libfoo" in broken

    data = json.loads(_ifb(site, "matrix", "--format", "json").stdout)
    echo_row = next(r for r in data["deployments"] if r["plugin"] == "echo")
    assert echo_row["status"] == "blocking path" and "stepped execution" in echo_row["note"]
    options = {r["option"] for r in data["requests"]}
    assert "Shouting (third-party option)" in options
