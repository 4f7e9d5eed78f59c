"""The reference for the harmony chat format: OpenAI's ``openai-harmony`` package.

Its encoding needs the ``o200k_base`` vocabulary file, which it would download from OpenAI; the
tests take it from the npm registry instead: ``js-tiktoken`` ships the same ranks (compressed: a
line per run of consecutive ranks). ``vocab_dir`` unpacks them once into the test cache and checks
the rebuilt file against the sha256 ``openai-harmony`` itself requires, so the file is the original.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tarfile
import tempfile
from functools import lru_cache
from pathlib import Path

from tests.models.llama_cpp import cache_root

JS_TIKTOKEN = "js-tiktoken@1.0.21"
JS_TIKTOKEN_SHA256 = "3b1f24b185565ca9a8d8f51466dfc4f99d67f1f05bc009258710ddb7a8d810fa"
#: the hash openai-harmony checks the vocabulary file against
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
VOCAB = "o200k_base.tiktoken"


def _ranks_text(js_module: str) -> str:
    data = json.loads(js_module[js_module.index("{"):].rstrip().rstrip(";"))
    ranks: list[tuple[int, str]] = []
    for line in data["bpe_ranks"].split("\n"):
        if line:
            _, offset, *tokens = line.split(" ")
            ranks.extend((int(offset) + i, token) for i, token in enumerate(tokens))
    return "".join(f"{token} {rank}\n" for rank, token in sorted(ranks))


def vocab_dir() -> Path:
    """A directory holding ``o200k_base.tiktoken`` (made once from the npm package)."""
    target = cache_root() / "o200k"
    if (target / VOCAB).exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["npm", "pack", JS_TIKTOKEN, "--silent"], cwd=tmp, check=True, capture_output=True,
                       timeout=300)
        (tgz,) = Path(tmp).glob("*.tgz")
        digest = hashlib.sha256(tgz.read_bytes()).hexdigest()
        if digest != JS_TIKTOKEN_SHA256:
            raise RuntimeError(f"{JS_TIKTOKEN} has sha256 {digest}, expected {JS_TIKTOKEN_SHA256}")
        with tarfile.open(tgz) as archive:
            module = archive.extractfile("package/dist/ranks/o200k_base.js").read().decode()
    text = _ranks_text(module)
    digest = hashlib.sha256(text.encode()).hexdigest()
    if digest != O200K_SHA256:
        raise RuntimeError(f"the rebuilt {VOCAB} has sha256 {digest}, expected {O200K_SHA256}")
    target.mkdir(parents=True, exist_ok=True)
    partial = target / f"{VOCAB}.{os.getpid()}"
    partial.write_text(text)
    os.replace(partial, target / VOCAB)
    return target


@lru_cache(maxsize=1)
def encoding():
    """openai-harmony's gpt-oss encoding."""
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(vocab_dir())
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def text_of(tokens: list[int]) -> str:
    """Harmony tokens as text, the special tokens spelled out."""
    return encoding().decode(tokens)
