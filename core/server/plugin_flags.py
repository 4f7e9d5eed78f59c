"""The flags ``ifb serve`` takes from the installed plugins (``ifb_deploy_settings``)."""

from __future__ import annotations

import logging
from typing import Any

import click

from ifb.capabilities import DeploySetting
from ifb.plugins import default_host

log = logging.getLogger("ifb.server")


def setting_flag(setting: DeploySetting) -> click.Option:
    """The click option of a plugin's setting; its help names the plugin."""
    if setting.is_flag:
        return click.Option([setting.flag, setting.name], is_flag=True, default=False,
                            help=f"({setting.plugin}) {setting.help}")
    return click.Option([setting.flag, setting.name], type=setting.type, default=setting.default,
                        metavar=setting.metavar, show_default=setting.default is not None,
                        help=f"({setting.plugin}) {setting.help}")


class PluginFlagsCommand(click.Command):
    """A command that also takes every installed plugin's settings as flags (after its own), loaded when
    the command is parsed or its help shown; they reach the callback as keywords."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        own = super().get_params(ctx)
        if not hasattr(self, "_plugin_flags"):
            names = {param.name for param in own}
            self._plugin_flags = []
            for setting in default_host().deploy_settings():
                if setting.name in names:
                    log.warning("plugin %s: --%s is a flag of the core; its setting is dropped",
                                setting.plugin, setting.name)
                    continue
                self._plugin_flags.append(setting_flag(setting))
        return [*own[:-1], *self._plugin_flags, own[-1]]  # --help stays last


def setting_options(values: dict[str, Any]) -> dict[str, Any]:
    """The ``DeployConfig.options`` the plugin flags in ``values`` (converted by click) set."""
    options = {}
    for setting in default_host().deploy_settings():
        value = setting.option_value(values.get(setting.name))
        if value is not None:
            options[setting.name] = value
    return options


def default_plugin() -> str:
    """The name of the kind that loads when ``--plugin`` is not given."""
    try:
        return default_host().default_kind().name
    except KeyError as exc:
        raise click.UsageError(str(exc.args[0])) from None
