"""Plugin settings (``ifb_deploy_settings``) in the plugin host: one declaration gives an ``ifb serve`` flag and an ``LLM``
keyword, converted and checked alike; a name already taken is dropped, loudly."""

from __future__ import annotations

import logging
from pathlib import Path

import click
import pytest

from ifb import hookimpl
from ifb.capabilities import DeploySetting
from ifb.plugins import PluginHost

LEVEL = DeploySetting(name="level", type=click.IntRange(0, 9), default=5, help="How much.")
PLACE = DeploySetting(name="place", type=click.Path(exists=True, file_okay=False, path_type=Path),
                      to_option=lambda path: str(path.resolve()), help="Where.")
LOUD = DeploySetting(name="loud", is_flag=True, help="Shout.")


class Knobs:
    @hookimpl
    def ifb_deploy_settings(self):
        return [LEVEL, PLACE, LOUD]


class Rival:
    @hookimpl
    def ifb_deploy_settings(self):
        return [DeploySetting(name="level", help="Mine too."), DeploySetting(name="max_batch_size", help="No.")]


def test_a_keyword_is_converted_and_checked_as_the_flag_is(tmp_path: Path) -> None:
    host = PluginHost(extra_plugins=(Knobs(),))
    assert host.setting_options({"level": "7", "place": str(tmp_path), "loud": True, "other": 1}) == {
        "level": 7, "place": str(tmp_path.resolve()), "loud": True, "other": 1}
    assert host.setting_options({"level": 5, "loud": False, "place": None}) == {}  # defaults are "not set"
    with pytest.raises(ValueError, match=r"--level \(level\): 12 is not in the range 0<=x<=9"):
        host.setting_options({"level": 12})
    with pytest.raises(ValueError, match=r"--place \(place\): Directory .* does not exist"):
        host.setting_options({"place": str(tmp_path / "nowhere")})
    with pytest.raises(ValueError, match="is a flag"):
        host.setting_options({"loud": "yes"})


def test_a_name_taken_by_the_core_or_another_plugin_is_dropped_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ifb.plugins"):
        settings = PluginHost(extra_plugins=(Knobs(), Rival())).deploy_settings()
    assert [s.help for s in settings if s.name == "level"] == ["How much."]
    assert "max_batch_size" not in {s.name for s in settings}
    assert "the setting level is dropped" in caplog.text and "the setting max_batch_size is dropped" in caplog.text


class Broken:
    @hookimpl
    def ifb_deploy_settings(self):
        raise RuntimeError("needs libfoo")


def test_a_plugin_whose_hook_fails_is_reported_and_the_others_stay(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="ifb.plugins"):
        settings = PluginHost(extra_plugins=(Knobs(), Broken())).deploy_settings()
    assert {s.name for s in settings} >= {"level", "place", "loud"}
    assert "ifb_deploy_settings failed" in caplog.text and "needs libfoo" in caplog.text
