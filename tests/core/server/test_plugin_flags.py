"""``ifb serve``'s plugin flags: every installed plugin's settings become flags of the command, after
its own, and reach its callback as ``DeployConfig.options``."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ifb.plugins import PluginHost
from ifb.server.plugin_flags import PluginFlagsCommand, setting_options

from tests.core.test_settings import Knobs


def test_the_flags_are_added_to_a_command_and_reach_its_callback(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    host = PluginHost(extra_plugins=(Knobs(),))
    monkeypatch.setattr("ifb.server.plugin_flags.default_host", lambda: host)
    seen = {}

    @click.command(cls=PluginFlagsCommand)
    @click.option("--port", type=int, default=1)
    def command(port, **flags):
        seen.update(setting_options(flags))

    help_text = CliRunner().invoke(command, ["--help"]).output
    assert "--level INTEGER RANGE" in help_text and "How much." in help_text and "--loud" in help_text
    assert help_text.rstrip().endswith("Show this message and exit.")
    result = CliRunner().invoke(command, ["--level", "3", "--place", str(tmp_path), "--loud"])
    assert result.exit_code == 0, result.output
    assert seen == {"level": 3, "place": str(tmp_path.resolve()), "loud": True}
    assert CliRunner().invoke(command, ["--level", "10"]).exit_code == 2
