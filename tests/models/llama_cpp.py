"""GGUF fixtures made by llama.cpp's own converter, ``convert_hf_to_gguf.py``.

The converter (and the ``gguf-py`` package it imports) is vendored in the ``llama-cpp-python``
source distribution on PyPI. ``converter_dir`` downloads that sdist once from the registry
(its sha256 checked), extracts only the converter's files into the user cache directory, keyed
by the version, and ``convert`` runs it, in one subprocess for a batch of files, on checkpoints
that transformers saved: its vendored ``gguf`` must not meet the installed one the tests import.

One thing of the converter is replaced: the table that recognizes a BPE pre-tokenizer by the
hash of its output on a fixed text. It knows the hub's tokenizers only, and a test's tiny
tokenizer (the SmolLM layout: every digit on its own, then GPT-2's byte-level regex) is none of
them, so it is told the name, ``smollm``. Everything it writes about the weights is its own.
"""

from __future__ import annotations

import hashlib
import html
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Sequence

import platformdirs

#: the llama-cpp-python release whose vendored llama.cpp converts the fixtures
VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
#: the sdist's llama.cpp, and what of it the converter needs
VENDOR = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")
#: the output types the converter writes itself (the K-quants need llama.cpp's C++ llama-quantize)
OUTTYPES = ("f32", "bf16", "q8_0")

_RUNNER = r"""
import json, runpy, sys
root, pre, jobs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
for src, out, outtype, flags in jobs:
    sys.argv = ["convert_hf_to_gguf.py", src, "--outfile", out, "--outtype", outtype, *flags]
    try:
        runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
"""


def cache_root() -> Path:
    """``$IFB_TEST_CACHE`` or ``<user cache>/ifb/tests``."""
    override = os.environ.get("IFB_TEST_CACHE")
    return Path(override).expanduser() if override else Path(platformdirs.user_cache_dir("ifb")) / "tests"


def _sdist_url() -> str:
    """The sdist's address on the package index pip reads (PEP 503's simple page; ``$PIP_INDEX_URL``)."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    page_url = f"{index}/llama-cpp-python/"
    with urllib.request.urlopen(page_url, timeout=60) as r:
        page = r.read().decode()
    name = f"llama_cpp_python-{VERSION}.tar.gz"
    for href in re.findall(r'href="([^"]+)"', page):
        if href.split("#")[0].endswith("/" + name) or href.split("#")[0] == name:
            return urllib.parse.urljoin(page_url, html.unescape(href.split("#")[0]))
    raise RuntimeError(f"{page_url} lists no {name}")


def _extract(target: Path, members: tuple[str, ...], marker: str) -> Path:
    """``members`` (prefixes under the sdist's llama.cpp) extracted into ``target`` once; ``marker`` a file
    the extraction has when it is complete."""
    if (target / marker).exists():
        return target
    with urllib.request.urlopen(_sdist_url(), timeout=600) as r:
        data = r.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(f"llama-cpp-python {VERSION} sdist has sha256 {digest}, expected {SDIST_SHA256}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp, tarfile.open(fileobj=io.BytesIO(data)) as sdist:
        wanted = [m for m in sdist.getmembers() if m.isfile() and m.name.startswith(VENDOR)
                  and m.name[len(VENDOR):].startswith(members)]
        for member in wanted:
            member.name = member.name[len(VENDOR):]
        sdist.extractall(tmp, members=wanted, filter="data")
        try:
            os.replace(tmp, target)  # atomic: a concurrent session sees none or all of it
        except OSError:
            if not (target / marker).exists():
                raise
        else:
            os.mkdir(tmp)  # the context manager removes what it made
    return target


def converter_dir() -> Path:
    """The extracted converter of llama-cpp-python ``VERSION`` (fetched from PyPI on first use)."""
    return _extract(cache_root() / f"llama-cpp-converter-{VERSION}", MEMBERS, "convert_hf_to_gguf.py")


def chat_template(name: str) -> str:
    """A released checkpoint's chat template as llama.cpp keeps it for its own tests
    (``models/templates/NAME.jinja`` in the same sdist)."""
    target = _extract(cache_root() / f"llama-cpp-templates-{VERSION}", ("models/templates/",),
                      f"models/templates/{name}.jinja")
    return (target / "models" / "templates" / f"{name}.jinja").read_text()


def convert(jobs: Sequence[tuple[Path, Path, str] | tuple[Path, Path, str, Sequence[str]]],
            pre_tokenizer: str = "smollm") -> None:
    """Convert each ``(checkpoint directory, output file, outtype[, converter flags])`` with llama.cpp's
    converter (flags are its own command-line options, e.g. ``--no-mtp``)."""
    for _, _, outtype, *_ in jobs:
        if outtype not in OUTTYPES:
            raise ValueError(f"the converter writes {OUTTYPES}, not {outtype!r}")
    spec = json.dumps([[str(src), str(out), outtype, list(flags[0]) if flags else []]
                       for src, out, outtype, *flags in jobs])
    run = subprocess.run([sys.executable, "-c", _RUNNER, str(converter_dir()), pre_tokenizer, spec],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "NO_LOCAL_GGUF": "1"})
    if run.returncode != 0:
        raise RuntimeError(f"llama.cpp's convert_hf_to_gguf.py ({VERSION}) failed:\n{run.stderr[-4000:]}")
