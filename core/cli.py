"""The ``ifb`` command line."""

from __future__ import annotations

import logging
import sys

import click

from ifb.plugins import default_host


@click.group()
@click.version_option(package_name="ifb")
def main() -> None:
    """ifb: serve LLMs with in-flight batching."""


@main.command()
def plugins() -> None:
    """List installed plugins, their versions and where they came from."""
    host = default_host()
    kinds = {}
    for kind in host.deployment_kinds():
        kinds.setdefault(kind.plugin, []).append(kind.name)
    for info in host.infos:
        origin = "built-in" if info.is_builtin else f"from {info.distribution}"
        line = f"{info.name:<16} {info.version:<10} {origin:<24} {info.module}"
        if info.error:
            line += f"  FAILED TO LOAD: {info.error}"
        elif kinds.get(info.name):
            line += f"  deployments: {', '.join(kinds[info.name])}"
        click.echo(line)


@main.command()
@click.option("--format", "fmt", type=click.Choice(["markdown", "json"]), default="markdown", show_default=True)
@click.option("--builtin-only", is_flag=True, help="Only the plugins that ship with ifb (as in docs/).")
def matrix(fmt: str, builtin_only: bool) -> None:
    """Print the support matrix of everything installed."""
    from ifb import matrix as m

    host = default_host()
    deployments, requests = m.build(host, builtin_only=builtin_only)
    render = m.render_json if fmt == "json" else m.render_markdown
    click.echo(render(deployments, requests, m.setting_rows(host, builtin_only=builtin_only)), nl=False)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _register_optional_commands() -> None:
    try:
        from ifb.server.cli import serve
    except ImportError:  # pragma: no cover - the server package is part of the distribution
        return
    main.add_command(serve)
    try:
        from ifb.bench.cli import bench
    except ImportError:
        return
    main.add_command(bench)


_register_optional_commands()
