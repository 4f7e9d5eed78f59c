"""No module reaches into another module's private attributes (core/, plugins/ and tests/).

Three rules, checked on the AST:

- ``x._name`` where ``x`` is not ``self`` / ``cls``: ``_name`` must be defined in
  the same module (a module's own private helpers may use each other).
- ``self._name`` / ``cls._name`` in a plugin: ``_name`` must be defined in the
  same plugin package. A private attribute inherited from ``ifb`` or from
  another package (a plugin subclassing ``ifb_plugins.common.TextRuntime``) is
  a cross-module reach; the base class offers a public name instead.
- in tests/, ``x._name`` where ``x`` was imported from ``ifb`` or ``ifb_plugins``:
  a test uses what the module offers (the reference libraries' own
  internals, transformers' for instance, are not ours to name).

Not counted: dunder names (``__init__``) and sunder names (``_fields_``, ctypes'
public protocol); and ``torch._*`` operators (``_weight_int4pack_mm_for_cpu``),
which have no public spelling and are pinned by the quantization tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED_BASES = {"torch"}
OURS = {"ifb", "ifb_plugins"}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and not name.endswith("_")


def defined_names(tree: ast.AST) -> set[str]:
    """Names a module defines: functions, classes, assigned names and attributes, annotated fields."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name)
    return names


def private_reads(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, base, attribute) of every private attribute read on a plain name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            base = node.value.id if isinstance(node.value, ast.Name) else ast.unparse(node.value)
            found.append((node.lineno, base, node.attr))
    return found


def violations(paths: list[Path], package_names: set[str] | None, root: Path = ROOT) -> list[str]:
    """What ``paths`` (one package's modules) read that belongs to another module.

    ``package_names``: the names the package defines (for ``self._x``); None skips that rule (core).
    """
    bad = []
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        own = defined_names(tree)
        for line, base, attr in private_reads(tree):
            where = f"{path.relative_to(root)}:{line}: {base}.{attr}"
            if base in ("self", "cls"):
                if package_names is not None and attr not in package_names:
                    bad.append(f"{where} (inherited from another package)")
            elif base not in ALLOWED_BASES and attr not in own:
                bad.append(f"{where} (another module's private attribute)")
    return bad


def packages(root: Path = ROOT) -> list[tuple[list[Path], set[str] | None]]:
    """core/ as one unit, and each plugin package with the names it defines."""
    units: list[tuple[list[Path], set[str] | None]] = [(sorted((root / "core").rglob("*.py")), None)]
    for package in sorted(p for p in (root / "plugins").iterdir() if p.is_dir()):
        paths = sorted(package.rglob("*.py"))
        names = set().union(*(defined_names(ast.parse(p.read_text())) for p in paths)) if paths else set()
        units.append((paths, names))
    return units


def test_no_private_attribute_is_read_across_modules() -> None:
    units = packages()
    assert sum(len(paths) for paths, _ in units) > 100
    assert [v for paths, names in units for v in violations(paths, names)] == []


def imported_from_us(tree: ast.AST) -> set[str]:
    """Names a module binds by importing ``ifb`` / ``ifb_plugins`` or something from them."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in OURS}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OURS:
            names |= {a.asname or a.name for a in node.names}
    return names


def test_no_test_reads_a_private_attribute_of_ours() -> None:
    paths = sorted(p for p in (ROOT / "tests").rglob("*.py") if "build" not in p.relative_to(ROOT).parts)
    assert len(paths) > 50
    bad = []
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        ours = imported_from_us(tree)
        bad += [f"{path.relative_to(ROOT)}:{line}: {base}.{attr}" for line, base, attr in private_reads(tree)
                if base in ours]
    assert bad == []


def test_the_rules_catch_what_they_name(tmp_path: Path) -> None:
    (tmp_path / "base.py").write_text("class Base:\n    def __init__(self):\n        self._blocks = []\n")
    (tmp_path / "child.py").write_text(
        "import torch\nfrom base import Base\n\n"
        "class Child(Base):\n    def run(self, other):\n"
        "        self._mine = 1\n        torch._int4_op(self._mine)\n"
        "        return self._blocks, other._blocks, other._mine, other.__class__, other._fields_\n")
    child = tmp_path / "child.py"
    found = violations([child], defined_names(ast.parse(child.read_text())), root=tmp_path)
    assert found == ["child.py:8: self._blocks (inherited from another package)",
                     "child.py:8: other._blocks (another module's private attribute)"]
    test = ast.parse("from ifb_plugins.common import qkernels\nimport transformers\n"
                     "qkernels._load.cache_clear()\ntransformers._internal\n")
    assert [(base, attr) for _, base, attr in private_reads(test) if base in imported_from_us(test)] == [
        ("qkernels", "_load")]
