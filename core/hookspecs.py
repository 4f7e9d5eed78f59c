"""The hooks a plugin implements. Built-in plugins register exactly like third-party ones.

A plugin is a module (or object) exposed through the ``ifb.plugins``
entry-point group that implements some of these hooks with ``@ifb.hookimpl``.
"""

from __future__ import annotations

from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("ifb")
hookimpl = pluggy.HookimplMarker("ifb")


@hookspec
def ifb_deployment_kinds() -> list:
    """Return the ``DeploymentKind`` objects this plugin can build.

    Each kind declares its capabilities for a ``DeployConfig`` without loading
    weights, so ``ifb matrix`` can show it and the gate can judge it.
    """


@hookspec
def ifb_request_options() -> list:
    """Return extra ``RequestOption`` rows this plugin adds to the registry (a row of ``ifb matrix``'s
    request-level tables each; the built-in plugins add theirs here too)."""


@hookspec
def ifb_deploy_settings() -> list:
    """Return the ``DeploySetting`` objects this plugin's deployments read.

    Each becomes an ``ifb serve`` flag (``--name-with-dashes``, shown in ``--help`` and in ``ifb
    matrix``) and an ``LLM(name=...)`` keyword, both converted by the setting's type and passed to
    ``DeployConfig.options[name]``. A name the core or another plugin has taken is dropped with a
    warning. List the names in your ``DeploymentKind.settings`` too, so that other kinds refuse them.
    """


@hookspec(firstresult=True)
def ifb_resolve_model(name: str | None, plugin: str) -> str | None:
    """Turn a model name (or None for the default) into a local path, or None if unknown."""


@hookspec(firstresult=True)
def ifb_prefix_cache(config: Any, blocks: Any, runtime: Any, counters: Any) -> Any:
    """Return a ``PrefixMatcher`` for prefix KV reuse when ``config.enable_context_reuse`` is set.

    The provider attaches its ``BlockCache`` to ``blocks`` (an ``ifb.kv.BlockManager``)
    and reports queries, hits and evictions in ``counters``. None when it does not apply.
    """


@hookspec
def ifb_http_routes(app_state: Any) -> list:
    """Return extra Starlette routes for the server (an audio route, say)."""
