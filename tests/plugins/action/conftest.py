"""A tiny random pi0 saved by transformers, and the reference's answers for a few requests on it."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[3]


@attrs.frozen
class Case:
    text: str
    images: tuple[Path, ...]
    state: tuple[float, ...]
    noise_seed: int

    def content(self) -> list[dict]:
        """The chat message's content: the cameras as data URLs, the task, the state as a trajectory part."""
        parts = [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in self.images]
        return [*parts, {"type": "text", "text": self.text}, {"type": "trajectory", "trajectory": [list(self.state)]}]


@attrs.frozen
class Pi0Fixture:
    path: Path
    cases: tuple[Case, ...]
    #: per case: the processor's ``input_ids`` (real tokens), ``pixel_values``, ``state``, the prefix KV per
    #: layer (``[Hkv, L, D]`` keys and values) and ``sample_actions``' plan ``[chunk, action dim]``
    reference: tuple[dict, ...]


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _png(path: Path, seed: int, height: int, width: int) -> Path:
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    path.write_bytes(buf.getvalue())
    return path


@pytest.fixture(scope="session")
def pi0(tmp_path_factory) -> Pi0Fixture:
    root = tmp_path_factory.mktemp("pi0")
    a, b, c = _png(root / "a.png", 1, 40, 60), _png(root / "b.png", 2, 50, 30), _png(root / "c.png", 3, 28, 28)
    cases = (
        Case("pick up the cube", (a,), (0.3, -1.0, 2.0, 0.5), 7),
        Case("stack the red block on the blue one", (a, b), (1.0, 0.0, -0.5, 0.25), 8),
        Case("open the drawer", (c,), (-0.7, 0.4, 0.0, 3.0), 123456789),
        Case("wipe the table", (b, c, a), (0.0, 0.0, 0.0, 0.0), 0),
    )
    cases_file = root / "cases.json"
    cases_file.write_text(json.dumps([{"text": k.text, "images": [str(p) for p in k.images], "state": list(k.state),
                                       "noise_seed": k.noise_seed} for k in cases]))
    model_dir, out = root / "model", root / "reference.pt"
    done = subprocess.run(
        [sys.executable, "-m", "tests.plugins.action.reference", "build-and-run", str(model_dir), str(cases_file),
         str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-4000:]
    return Pi0Fixture(model_dir, cases, tuple(torch.load(out)))
