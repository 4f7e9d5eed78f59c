"""No plugin imports another plugin's modules; what they share, they import from ``ifb_plugins.common``'s
public API (``ifb_plugins.common.__all__`` and ``PUBLIC_MODULES``); the shared layer imports no plugin."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ifb_plugins.common as common

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
SOURCES = sorted(p for p in PLUGINS.rglob("*.py") if p.parent != PLUGINS)


def imports(path: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """Every import of ``path``: (line, module, the names taken from it; () for ``import module``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, tuple(alias.name for alias in node.names)))
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." * node.level + (node.module or ""), ()))
    return found


def violations(path: Path, root: Path = PLUGINS) -> list[str]:
    """What ``path`` (a module of plugin ``root/<own>/``) imports that it may not."""
    own = path.relative_to(root).parts[0]
    bad = []
    for line, module, names in imports(path):
        where = f"{path.relative_to(root.parent)}:{line}"
        if module.startswith("."):
            bad.append(f"{where}: relative import {module!r} (name the package)")
            continue
        parts = module.split(".")
        if parts[0] != "ifb_plugins" or len(parts) == 1:
            continue
        target = parts[1]
        if target == own:
            continue
        if target != "common" or own == "common":
            bad.append(f"{where}: imports {module} (another plugin's module)")
        elif len(parts) == 2:
            bad += [f"{where}: imports {name!r} from ifb_plugins.common, which does not export it"
                    for name in names if name not in common.__all__ and name not in common.PUBLIC_MODULES]
        elif len(parts) == 3 and names and all(f"{parts[2]}.{name}" in common.PUBLIC_MODULES for name in names):
            continue  # public modules taken from their package (``from ifb_plugins.common.quant import kernels``)
        elif ".".join(parts[2:]) not in common.PUBLIC_MODULES:
            bad.append(f"{where}: imports {module}, not a public module of ifb_plugins.common")
        else:
            bad += [f"{where}: imports the private {name} from {module}" for name in names if name.startswith("_")]
    return bad


def test_plugins_import_only_themselves_and_the_shared_layers_api() -> None:
    assert len(SOURCES) > 40
    assert [v for path in SOURCES for v in violations(path)] == []


@pytest.mark.parametrize(("source", "expected"), [
    ("from ifb_plugins.text.build import load_text_runtime\n", "another plugin's module"),
    ("import ifb_plugins.mamba.ssm\n", "another plugin's module"),
    ("from ifb_plugins.common.decoding.sampling import _seed_for_step\n", "the private _seed_for_step"),
    ("from ifb_plugins.common._secret import x\n", "not a public module"),
    ("from ifb_plugins.common import nothing_exported\n", "does not export it"),
    ("from .runtime import TextRuntime\n", "relative import"),
])
def test_each_kind_of_violation_is_caught(tmp_path: Path, source: str, expected: str) -> None:
    (tmp_path / "plugins" / "vlm").mkdir(parents=True)
    (tmp_path / "plugins" / "vlm" / "x.py").write_text(source)
    found = violations(tmp_path / "plugins" / "vlm" / "x.py", tmp_path / "plugins")
    assert len(found) == 1 and expected in found[0]


def test_the_shared_layer_imports_no_plugin() -> None:
    shared = [p for p in SOURCES if p.relative_to(PLUGINS).parts[0] == "common"]
    assert shared and [v for path in shared for v in violations(path)] == []


def test_every_export_and_public_module_exists() -> None:
    for name in common.__all__:
        assert getattr(common, name) is not None
    for module in common.PUBLIC_MODULES:
        assert (PLUGINS / "common" / f"{module.replace('.', '/')}.py").exists(), module


def test_the_shared_layer_is_packages_of_modules() -> None:
    """No drawer: the shared layer holds only packages (no module beside them but its own ``__init__``),
    each of at most about twenty modules."""
    common_dir = PLUGINS / "common"
    assert sorted(p.name for p in common_dir.glob("*.py")) == ["__init__.py"]
    for package in (p for p in common_dir.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        assert len(list(package.glob("*.py"))) <= 21, package.name



def test_no_source_file_is_over_600_lines() -> None:
    """Small rooms: every Python and C source of the plugins and the core stays under 600 lines."""
    roots = (PLUGINS, PLUGINS.parent / "core")
    sources = [p for root in roots for p in root.rglob("*") if p.suffix in (".py", ".c", ".h")]
    assert len(sources) > 80
    assert [str(p.relative_to(PLUGINS.parent)) for p in sources if p.read_text().count("\n") > 600] == []
