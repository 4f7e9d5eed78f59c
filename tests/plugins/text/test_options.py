"""The text plugin's settings: the flags' choices are the build's, and a bad keyword fails at once."""

from __future__ import annotations

import pytest

from ifb import LLM
from ifb.plugins import default_host
from ifb_plugins.text import build, options


def test_the_flags_offer_what_the_build_reads() -> None:
    assert options.QUANTIZATION_CHOICES == build.QUANTIZATION_MODES
    assert options.KV_CACHE_DTYPE_CHOICES == tuple(build.KV_CACHE_DTYPES)
    settings = {s.name: s for s in default_host().deploy_settings()}
    assert settings["quantization"].plugin == settings["kv_cache_dtype"].plugin == "text"
    assert default_host().default_kind().name == "text"


def test_a_bad_keyword_is_refused_before_anything_loads() -> None:
    with pytest.raises(ValueError, match=r"--quantization \(quantization\): 'int3' is not one of 'auto', 'int16', 'int8-prompt', 'int8'"):
        LLM("no-such-model", quantization="int3")
