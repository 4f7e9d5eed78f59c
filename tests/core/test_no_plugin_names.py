"""The core knows no built-in plugin: what a plugin brings, it registers through the hooks.

The rule, over every source file of ``core/`` (code, comments and docstrings):

- no built-in plugin's name, deployment kind's name or setting (``--flag`` or keyword) appears as a
  word, nor ``ifb_plugins``;
- the one name that is also a word of the request API, ``text`` (a content part's type, an output
  field), never appears as a string literal on a line that speaks of a plugin or a kind, nor as
  "text plugin" or a help string's "(text) ...".
"""

from __future__ import annotations

import io
import re
import tokenize
import tomllib
from pathlib import Path

import pytest

from ifb.plugins import PluginHost

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core"
#: built-in names that are also words of the request API
API_WORDS = frozenset({"text"})


def builtin_names() -> set[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    plugins = set(pyproject["project"]["entry-points"]["ifb.plugins"])
    host = PluginHost()
    kinds = {k.name for k in host.deployment_kinds() if k.plugin in plugins}
    settings = {s.name for s in host.deploy_settings() if s.plugin in plugins}
    flags = {s.flag.removeprefix("--") for s in host.deploy_settings() if s.plugin in plugins}
    assert {"text", "context_cache"} <= plugins and settings and kinds >= {"text"}
    return plugins | kinds | settings | flags | {"ifb_plugins"}


def violations(source: str, names: set[str], where: str = "") -> list[str]:
    words = sorted(names - API_WORDS, key=len, reverse=True)
    word_re = re.compile(r"(?<!\w)(" + "|".join(map(re.escape, words)) + r")(?!\w)", re.IGNORECASE)
    api_words = "|".join(map(re.escape, sorted(API_WORDS)))
    # "the text plugin", or a help string that starts "(text) ..."
    phrase_re = re.compile(r"\b(" + api_words + r") plugin\b|[\"']\((" + api_words + r")\)\s", re.IGNORECASE)
    found = []
    for number, line in enumerate(source.splitlines(), 1):
        for match in (*word_re.finditer(line), *phrase_re.finditer(line)):
            found.append(f"{where}:{number}: {match.group(0)!r}")
    literals: dict[int, set[str]] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.STRING:
            try:
                value = eval(token.string, {})  # a literal's value, prefixes and quotes resolved
            except Exception:  # noqa: BLE001 - an f-string with fields is no plain name
                continue
            if value in API_WORDS:
                literals.setdefault(token.start[0], set()).add(value)
    lines = source.splitlines()
    for number, values in literals.items():
        if re.search(r"plugin|kind", lines[number - 1], re.IGNORECASE):
            found += [f"{where}:{number}: {value!r} as a plugin or kind" for value in sorted(values)]
    return found


def test_core_names_no_builtin_plugin() -> None:
    names = builtin_names()
    sources = sorted(CORE.rglob("*.py"))
    assert len(sources) > 30
    assert [v for path in sources for v in violations(path.read_text(), names, str(path.relative_to(ROOT)))] == []


@pytest.mark.parametrize("line", [
    'from ifb_plugins.text.build import load_text_runtime',
    '@click.option("--plugin", default="text", show_default=True)',
    '    plugin: str = "text"',
    '    return sorted(kinds, key=lambda k: (k.plugin != "text", k.name))',
    '# the vlm plugin reads this',
    '@click.option("--kv-cache-dtype", type=str)',
    '    if options.get("visual_token_pruner"):',
    'help="(text) KV cache precision"',
    '"""Speech output is refused."""',
    '    raise KeyError("needs the context_cache plugin")',
])
def test_the_rule_catches_each_way_of_naming_a_plugin(line: str) -> None:
    assert violations(line + "\n", builtin_names())


@pytest.mark.parametrize("line", [
    '    if part["type"] == "text":',
    '    return {"text": out.text, "index": 0}',
    '    status = "text-only"',
    '    enable_context_reuse: bool = False',
    '    """The plugin that loads the model; None: the default kind."""',
])
def test_the_rule_leaves_the_request_api_alone(line: str) -> None:
    assert violations(line + "\n", builtin_names()) == []
