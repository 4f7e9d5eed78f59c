"""The plugin host: discovery through the ``ifb.plugins`` entry-point group."""

from __future__ import annotations

import importlib.metadata as md
import functools
import logging

import attrs
import pluggy

from ifb import hookspecs
from ifb.capabilities import DeployConfig, DeploymentKind, DeploySetting, RequestOption
from ifb.options import BUILTIN_OPTIONS

ENTRY_POINT_GROUP = "ifb.plugins"

log = logging.getLogger("ifb.plugins")

#: names a plugin's ``DeploySetting`` may not take: ``DeployConfig``'s fields (``LLM``'s own keywords)
#: and the ``DeployConfig.options`` keys the core's own flags set
CORE_SETTING_NAMES = frozenset(a.name for a in attrs.fields(DeployConfig)) | {
    "lora_adapters", "max_loras", "max_lora_rank", "served_model_name", "warmup_prompt"}


@attrs.frozen
class PluginInfo:
    name: str
    module: str
    distribution: str
    version: str
    error: str | None = None  # why it failed to import, if it did

    @property
    def is_builtin(self) -> bool:
        return self.distribution == "ifb"


class PluginHost:
    """Loads every installed plugin; a plugin that fails to import is reported, the rest load."""

    def __init__(self, extra_plugins: tuple = ()):
        self.pm = pluggy.PluginManager("ifb")
        self.pm.add_hookspecs(hookspecs)
        self.infos: list[PluginInfo] = []
        for ep in md.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist else "?"
            version = ep.dist.version if ep.dist else "?"
            try:
                plugin = ep.load()
                self.pm.register(plugin, name=ep.name)
            except Exception as exc:  # noqa: BLE001 - any import failure is reported, not fatal
                self.infos.append(PluginInfo(ep.name, ep.value, dist, version, f"{type(exc).__name__}: {exc}"))
                continue
            self.infos.append(PluginInfo(ep.name, ep.value, dist, version))
        for plugin in extra_plugins:
            self.pm.register(plugin)

    @property
    def hook(self):
        return self.pm.hook

    def deployment_kinds(self) -> list[DeploymentKind]:
        kinds = [k for group in self.hook.ifb_deployment_kinds() for k in group]
        return sorted(kinds, key=lambda k: (not k.is_default, k.plugin, k.name))

    def default_kind(self) -> DeploymentKind:
        """The kind that declares ``is_default``: what loads when no plugin is named."""
        defaults = [k for k in self.deployment_kinds() if k.is_default]
        if len(defaults) != 1:
            named = ", ".join(f"{k.name} ({k.plugin})" for k in defaults) or "none is installed"
            raise KeyError(f"no single default deployment kind ({named}): name one with --plugin")
        return defaults[0]

    def kind(self, name: str | None) -> DeploymentKind:
        """The kind called ``name`` (a kind's or a plugin's name); None: the default kind."""
        if name is None:
            return self.default_kind()
        for k in self.deployment_kinds():
            if k.name == name or k.plugin == name:
                return k
        known = ", ".join(sorted({k.name for k in self.deployment_kinds()}))
        failed = [i for i in self.infos if i.error and i.name == name]
        if failed:
            raise KeyError(f"plugin {name!r} failed to load: {failed[0].error}")
        raise KeyError(f"no deployment kind {name!r}; installed: {known}")

    @functools.cached_property
    def _settings(self) -> dict[str, DeploySetting]:
        settings: dict[str, DeploySetting] = {}
        for impl in self.hook.ifb_deploy_settings.get_hookimpls():  # in registration order
            try:
                declared = list(impl.function())
            except Exception:  # noqa: BLE001 - one plugin's broken hook must not take the others' flags away
                log.exception("plugin %s: ifb_deploy_settings failed; its settings are not offered", impl.plugin_name)
                continue
            for setting in declared:
                setting = attrs.evolve(setting, plugin=impl.plugin_name)
                taken = settings.get(setting.name)
                if setting.name in CORE_SETTING_NAMES or taken is not None:
                    log.warning("plugin %s: the setting %s is dropped, %s has it", setting.plugin, setting.name,
                                f"plugin {taken.plugin}" if taken else "the core")
                    continue
                settings[setting.name] = setting
        return settings

    def deploy_settings(self) -> list[DeploySetting]:
        """Every plugin's ``DeploySetting`` (``ifb serve`` flags and ``LLM`` keywords), by plugin."""
        return sorted(self._settings.values(), key=lambda s: s.plugin)  # each plugin's in its order

    def setting_options(self, values: dict) -> dict:
        """``LLM`` keywords as ``DeployConfig.options``: a registered setting's value converted (and
        checked) by its type, left out when it is its default; any other key passed as it is (a kind's
        ``settings`` refuses what it does not read)."""
        options = {}
        for key, value in values.items():
            setting = self._settings.get(key)
            value = setting.parse(value) if setting is not None else value
            if value is not None or setting is None:
                options[key] = value
        return options

    def request_options(self) -> list[RequestOption]:
        extra = [o for group in self.hook.ifb_request_options() for o in group]
        return sorted((*BUILTIN_OPTIONS, *extra), key=lambda o: o.order)


@functools.cache
def default_host() -> PluginHost:
    return PluginHost()
