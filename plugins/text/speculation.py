"""The text deployment's speculative decoding, as its settings configure it (light: no torch).

``speculation_caps(config)`` is what ``declare`` puts in ``DeploymentCaps.speculation``;
``build.load_text_runtime`` gives the runtime its drafter (``drafting.build_drafter``).
"""

from __future__ import annotations

import attrs

from ifb.capabilities import DeployConfig
from ifb.speculative import SpeculationCaps, SpeculationPolicy, check_max_num_drafts

DEFAULT_NUM_SPECULATIVE_TOKENS = 4
DEFAULT_NGRAM_MIN, DEFAULT_NGRAM_MAX = 2, 4

#: a verified position's cost relative to a one-token step at batch 1, per --quantization mode, as
#: benchmarks/speculative.py measured it on the default model (docs/engine.md): the native kernels'
#: step grows by about 0.1-0.2 of itself per position (their 4-row tiles decode each weight block once
#: for up to 4 rows; int8 and weights-only assumed alike), the float32 torch path's hardly at all (it
#: streams its weights once for every row)
POSITION_COST = {"auto": 0.15, "int16": 0.15, "int8-prompt": 0.15, "int8": 0.15, "weights-only": 0.15, "none": 0.02}

#: the settings that only mean something with a draft source
_NEEDS_METHOD = ("num_speculative_tokens", "ngram_min", "ngram_max", "speculative_policy",
                 "speculative_position_cost", "speculative_draft_cost", "speculative_quantization")
SPECULATION_SETTINGS = frozenset({"speculative_method", "speculative_model", *_NEEDS_METHOD})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def speculation_method(config: DeployConfig) -> str | None:
    """The configured draft source (``ngram``, ``draft-model``) or None; ValueError for settings that do not fit."""
    options = config.options
    method, model = options.get("speculative_method"), options.get("speculative_model")
    if method is None and model:
        method = "draft-model"
    if method is None:
        stray = [_flag(name) for name in _NEEDS_METHOD if options.get(name) is not None]
        if stray:
            raise ValueError(f"{', '.join(stray)} configure speculative decoding: give --speculative-method "
                             "or --speculative-model too")
        return None
    if config.num_ranks > 1:
        raise ValueError("speculative decoding runs on one rank: the tensor-parallel shards verify no drafts "
                         "(drop --tensor-parallel-size, or the speculative settings)")
    if method == "draft-model" and not model:
        raise ValueError("--speculative-method draft-model needs --speculative-model NAME|PATH")
    if method == "ngram" and model:
        raise ValueError("--speculative-method ngram drafts without a model: drop --speculative-model")
    if method == "ngram" and options.get("speculative_quantization") is not None:
        raise ValueError("--speculative-quantization sets a draft model's kernels; ngram has no model")
    return method


def ngram_range(config: DeployConfig) -> tuple[int, int]:
    """``(--ngram-min, --ngram-max)``, checked."""
    low = config.options.get("ngram_min")
    high = config.options.get("ngram_max")
    low = DEFAULT_NGRAM_MIN if low is None else low
    high = max(DEFAULT_NGRAM_MAX, low) if high is None else high
    if not 1 <= low <= high <= 64:
        raise ValueError(f"--ngram-min ({low}) and --ngram-max ({high}) need 1 <= min <= max <= 64")
    return low, high


def speculation_caps(config: DeployConfig) -> SpeculationCaps | None:
    """The speculative decoding ``config`` asks for, or None; ValueError naming the setting at fault."""
    method = speculation_method(config)
    if method is None:
        return None
    options = config.options
    k = options.get("num_speculative_tokens")
    k = check_max_num_drafts(DEFAULT_NUM_SPECULATIVE_TOKENS if k is None else k, "--num-speculative-tokens")
    mode = options.get("quantization") or "auto"
    position_cost = options.get("speculative_position_cost")
    draft_cost = options.get("speculative_draft_cost")
    for name, value in (("speculative_position_cost", position_cost), ("speculative_draft_cost", draft_cost)):
        if value is not None and not 0.0 <= value <= 100.0:
            raise ValueError(f"{_flag(name)} must be between 0 and 100, not {value}")
    policy = SpeculationPolicy(
        position_cost=POSITION_COST.get(mode, POSITION_COST["auto"]) if position_cost is None else position_cost,
        draft_cost=draft_cost or 0.0, is_always=options.get("speculative_policy") == "always")
    if method == "ngram":
        low, high = ngram_range(config)
        description = f"n-gram prompt lookup ({low}..{high} tokens)"
    else:
        description = f"draft model {options['speculative_model']}"
    return SpeculationCaps(method=method, max_num_drafts=k, policy=policy, description=description)


def with_draft_cost(caps: SpeculationCaps, config: DeployConfig, measured: float, description: str) -> SpeculationCaps:
    """``caps`` once the draft model is loaded: its cost measured (unless --speculative-draft-cost set it)."""
    policy = caps.policy
    if config.options.get("speculative_draft_cost") is None:
        policy = attrs.evolve(policy, draft_cost=measured)
    return attrs.evolve(caps, policy=policy, description=description)
