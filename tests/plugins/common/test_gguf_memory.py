"""Loading a mixture-of-experts GGUF without float32 copies: every quantized matrix (the routed experts
included) read once from the file's map into its block layout, the load's peak memory within the
file's size plus a small overhead, and a file that cannot fit refused at load, naming both numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ifb_plugins.common.loading import memory
from ifb_plugins.common.loading.checkpoint import build_model, load_checkpoint
from ifb_plugins.common.loading.gguf import materialize, run_bytes
from ifb_plugins.common.quant import kernels as qkernels
from ifb_plugins.common.quant.parts import BlockParts
from tests.native import needs_kernels
from tests.plugins.common.test_loaders import prefill_logits

PROMPT = [5, 17, 33, 90, 4, 200, 11, 7, 61]


@needs_kernels
def test_every_quantized_matrix_is_deferred_and_read_once_into_its_blocks(kquant_moe) -> None:
    _, _, path = kquant_moe
    loaded = load_checkpoint(path, defer_quantized=True)
    layers = loaded.config.num_layers
    experts = {f"model.layers.{i}.mlp.experts.{p}" for i in range(layers) for p in ("gate_up_proj", "down_proj")}
    assert experts <= loaded.deferred and "model.embed_tokens.weight" in loaded.deferred
    for name in loaded.deferred:  # placeholders: no memory behind them
        assert set(loaded.state_dict[name].stride()) == {0}, name
    mapped = next(iter(loaded.tensors.values())).source
    assert 0 < mapped.num_bytes_read < mapped.total_bytes  # only the float32 norms and routers so far
    parts = BlockParts.for_checkpoint(loaded, "native", layer_stack="torch")
    model = build_model(loaded, parts=parts)
    assert loaded.deferred <= parts.consumed and materialize(model, path, loaded.deferred - parts.consumed) == 0
    assert mapped.num_bytes_read == mapped.total_bytes  # every tensor read, each counted once
    whole = load_checkpoint(path)  # the float32 state dict read whole, as before
    reference = build_model(whole, parts=BlockParts.for_checkpoint(whole, "native", layer_stack="torch"))
    assert torch.equal(prefill_logits(model, PROMPT), prefill_logits(reference, PROMPT))


def test_a_float32_deployment_after_deferral_reads_every_expert_as_the_plain_load(kquant_moe) -> None:
    _, _, path = kquant_moe
    deferred = load_checkpoint(path, defer_quantized=True)
    plain = build_model(deferred)
    assert materialize(plain, path, deferred.deferred) == len(deferred.deferred)
    whole = build_model(load_checkpoint(path)).state_dict()
    for name, value in plain.state_dict().items():
        assert torch.equal(value, whole[name]), name


def test_run_bytes_are_the_kernels_layouts(kquant_moe) -> None:
    _, _, path = kquant_moe
    loaded = load_checkpoint(path, defer_quantized=True)
    kinds = {12: 3, 14: 4}  # Q4_K -> K4, Q6_K -> K6
    for name, tensor in loaded.tensors.items():
        if len(tensor.shape) == 3:
            e, n, k = tensor.shape
            kind = kinds[int(tensor.ggml_type)]
            assert run_bytes(tensor, True) == e * -(-n // 16) * 16 * qkernels.kind_row_bytes(kind, k), name
        assert run_bytes(tensor, False) == 4 * torch.Size(tensor.shape).numel()


_PEAK = r"""
import json, sys
from pathlib import Path
from ifb_plugins.common.loading.checkpoint import build_model, load_checkpoint
from ifb_plugins.common.quant import kernels
from ifb_plugins.common.quant.parts import BlockParts
kernels.require()
def status(field):  # the resident set now (VmRSS) and at its peak (VmHWM: this process image's own)
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field))
path, blocks = Path(sys.argv[1]), sys.argv[2] == "blocks"
base = status("VmRSS")
loaded = load_checkpoint(path, defer_quantized=blocks)
model = build_model(loaded, parts=BlockParts.for_checkpoint(loaded, "native", layer_stack="torch") if blocks else None)
print(json.dumps(status("VmHWM") - base))
"""


def peak_growth(path: Path, mode: str) -> int:
    """Bytes the resident set grew by at its peak while ``path`` loaded, in a fresh process."""
    run = subprocess.run([sys.executable, "-c", _PEAK, str(path), mode], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@needs_kernels
def test_the_load_holds_the_files_blocks_not_their_float32_copies(kquant_moe) -> None:
    _, _, path = kquant_moe
    size = path.stat().st_size  # 8 MiB of blocks, 50 MiB of them in float32
    blocks, float32 = peak_growth(path, "blocks"), peak_growth(path, "float32")
    # the blocks once, plus the model's modules and the tokenizer (about 10 MiB here)
    assert blocks <= size + (16 << 20), (blocks, size)
    assert float32 > size + (64 << 20), (float32, size)  # what reading the experts in float32 costs


def test_a_file_that_cannot_fit_is_refused_naming_both_numbers(kquant_moe, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, path = kquant_moe
    monkeypatch.setenv(memory.MEMORY_LIMIT_ENV, str(256 << 20))  # less than the load's overhead alone
    with pytest.raises(memory.InsufficientMemory) as refused:
        load_checkpoint(path, defer_quantized=True)
    text = str(refused.value)
    assert text.startswith(f"{path.name} (0.01 GiB file) needs 0.51 GiB to load (0.01 GiB of tensors as they run")
    assert text.endswith(f"but only 0.25 GiB is available (${memory.MEMORY_LIMIT_ENV})")
    monkeypatch.setenv(memory.MEMORY_LIMIT_ENV, str(540 << 20))  # the blocks fit, the float32 experts do not
    assert load_checkpoint(path, defer_quantized=True).deferred
    with pytest.raises(memory.InsufficientMemory, match="needs 0.55 GiB"):  # float32: the experts' 50 MiB
        load_checkpoint(path)
    monkeypatch.setenv(memory.MEMORY_LIMIT_ENV, "lots")
    with pytest.raises(ValueError, match="must be a number of bytes"):
        load_checkpoint(path)


_UNDER_RLIMIT = r"""
import resource, sys
from ifb_plugins.common.loading import memory
from ifb_plugins.common.loading.checkpoint import load_checkpoint
size = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (size + memory.LOAD_OVERHEAD_BYTES + (1 << 20), resource.RLIM_INFINITY))
try:
    load_checkpoint(sys.argv[1], defer_quantized=True)
except memory.InsufficientMemory as exc:
    print(exc)
"""


def test_an_address_space_limit_refuses_the_load_as_well(kquant_moe) -> None:
    _, _, path = kquant_moe
    run = subprocess.run([sys.executable, "-c", _UNDER_RLIMIT, str(path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "is available (the address-space limit)" in run.stdout, run.stdout
