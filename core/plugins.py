"""The plugin host: discovery through the ``ifb.plugins`` entry-point group."""

from __future__ import annotations

import importlib.metadata as md
import functools

import attrs
import pluggy

from ifb import hookspecs
from ifb.capabilities import DeploymentKind, RequestOption
from ifb.options import BUILTIN_OPTIONS

ENTRY_POINT_GROUP = "ifb.plugins"


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
        return sorted(kinds, key=lambda k: (k.plugin != "text", k.plugin, k.name))

    def kind(self, name: str) -> DeploymentKind:
        for k in self.deployment_kinds():
            if k.name == name or k.plugin == name:
                return k
        known = ", ".join(sorted({k.name for k in self.deployment_kinds()}))
        failed = [i for i in self.infos if i.error and i.name == name]
        if failed:
            raise KeyError(f"plugin {name!r} failed to load: {failed[0].error}")
        raise KeyError(f"no deployment kind {name!r}; installed: {known}")

    def request_options(self) -> list[RequestOption]:
        extra = [o for group in self.hook.ifb_request_options() for o in group]
        return sorted((*BUILTIN_OPTIONS, *extra), key=lambda o: o.order)


@functools.cache
def default_host() -> PluginHost:
    return PluginHost()
