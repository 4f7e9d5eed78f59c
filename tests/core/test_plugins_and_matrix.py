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
    served = ("Per-request LoRA", "More than one sequence per request", "Guided decoding (grammar / JSON)")
    assert {option: rows[option] for option in served} == dict.fromkeys(served, "served")
    # the capture needs the context cache, which the matrix's first text variant does not turn on
    assert rows["saveSystemPromptKVCache (legacy capture)"] == "rejected"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The fixture plugins installed (really, with pip) into a private site directory."""
    target = tmp_path_factory.mktemp("site")
    for name in ("ifb_echo_plugin", "broken_plugin"):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(target), str(FIXTURES / name)], check=True, capture_output=True)
    return target


def _env(site) -> dict:
    # the caller's PYTHONPATH stays: it may be what points `ifb` at this checkout
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(site), str(ROOT), os.environ.get(
        "PYTHONPATH")) if p)}


def _ifb(site, *args):
    return subprocess.run([sys.executable, "-m", "ifb", *args], capture_output=True, text=True, env=_env(site),
                          timeout=120)


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
    assert {"plugin": "echo", "flag": "--echo-volume", "keyword": "echo_volume",
            "help": "How loud the echo answers (third-party setting)."} in data["settings"]
    markdown = _ifb(site, "matrix").stdout
    assert "| Shouting (third-party option) |" in markdown and "| `--echo-volume` | `echo_volume` | echo |" in markdown


def test_third_party_plugin_adds_a_flag_to_serve_and_a_keyword_to_llm(site):
    help_text = _ifb(site, "serve", "--help")
    assert help_text.returncode == 0, help_text.stderr
    assert "--echo-volume LEVEL" in help_text.stdout and "(echo) How loud the echo answers" in help_text.stdout
    assert "--quantization" in help_text.stdout and "(text)" in help_text.stdout  # the built-ins' flags too
    # the flag is checked by its type, then reaches the plugin's loader as DeployConfig.options["echo_volume"]
    loud = _ifb(site, "serve", "--plugin", "echo", "--echo-volume", "7")
    assert loud.returncode == 1 and "no weights to load (echo_volume 7)" in loud.stderr
    too_loud = _ifb(site, "serve", "--plugin", "echo", "--echo-volume", "12")
    assert too_loud.returncode == 2 and "12 is not in the range 0<=x<=11" in too_loud.stderr
    # the same setting as an LLM keyword, converted and checked alike
    code = ("from ifb import LLM\n"
            "for volume in ('5', 12):\n"
            "    try:\n"
            "        LLM(plugin='echo', echo_volume=volume)\n"
            "    except Exception as exc:\n"
            "        print(type(exc).__name__, exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(site), timeout=120)
    assert "RuntimeError the echo deployment has no weights to load (echo_volume 5)" in out.stdout, out.stderr
    assert "ValueError --echo-volume (echo_volume): 12 is not in the range 0<=x<=11" in out.stdout
