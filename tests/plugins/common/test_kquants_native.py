"""The native kernels over GGUF rows kept as stored (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): the torch
reference's bits on every instruction set, whatever the batch and the threads."""

from __future__ import annotations

import gguf
import pytest
import torch

from ifb_plugins.common.quant import kernels as qkernels, linear as quant, int4_torch as quant_torch
from tests.plugins.common.test_kquants import NEW_TYPES, random_blocks
from tests.native import needs_kernels
from tests.plugins.common.test_quant import KERNEL_BUILD_NAMES, KERNEL_BUILDS, KERNELS, restored_threads

Q = gguf.GGMLQuantizationType
pytestmark = needs_kernels


@pytest.mark.parametrize("qtype", NEW_TYPES)
@pytest.mark.parametrize("build", range(len(KERNEL_BUILDS)), ids=lambda i: KERNEL_BUILD_NAMES[i])
@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_stored_matmul_gives_the_torch_reference_bits_alone_or_batched(qtype: Q, build: int,
                                                                      activations: str) -> None:
    kernels = KERNEL_BUILDS[build]
    assert kernels is not None and kernels.isa in (256, 512)
    raw = torch.from_numpy(random_blocks(qtype, 37, 512, seed=12))
    bias = torch.randn(37, generator=torch.Generator().manual_seed(13))
    native = quant.StoredBlockLinear(quant.BlockWeight(qtype, raw, 512), bias, kernels,
                                     activations=activations)  # type: ignore[arg-type]
    reference = quant_torch.BlockTorchLinear(qtype, raw, 512, bias, activations=activations)
    x = torch.randn(21, 512, generator=torch.Generator().manual_seed(14))
    x[5] = 0.0
    full = native(x)
    assert torch.equal(full, reference(x))
    with restored_threads(kernels):
        for n in (1, 3):
            kernels.set_num_threads(n)
            assert all(torch.equal(native(x[i:i + 1]), full[i:i + 1]) for i in range(21))
            assert all(torch.equal(native(x[i:i + w]), full[i:i + w]) for w in (2, 7, 16) for i in range(0, 21 - w, 4))
    assert torch.equal(native(x.view(3, 7, 512)), full.view(3, 7, 37))
    with pytest.raises(ValueError, match="expected 512 input features"):
        native(x[:, :256])


def test_stored_matmul_refuses_what_it_cannot_read() -> None:
    raw = torch.from_numpy(random_blocks(Q.Q4_K, 4, 512))
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="not read as stored"):
        KERNELS.stored_matmul(x, raw[:, :144].contiguous(), int(Q.Q2_K))
    for features in (100, 256, 1024):  # not whole super-blocks; rows of 512 read as 256 or 1024
        with pytest.raises(ValueError, match=f"do not hold {features} input features"):
            KERNELS.stored_matmul(torch.randn(2, features), raw, int(Q.Q4_K))
    with pytest.raises(ValueError, match="must be contiguous uint8"):
        KERNELS.stored_matmul(x, raw.view(torch.int8), int(Q.Q4_K))
    with pytest.raises(ValueError, match="int16 or int8"):
        KERNELS.stored_matmul(x, raw, int(Q.Q4_K), activations="float32")
    with pytest.raises(ValueError, match="do not read Q8_0"):
        quant.StoredBlockLinear(quant.BlockWeight(Q.Q8_0, torch.zeros(4, 34, dtype=torch.uint8), 32), None, KERNELS)
    assert int(Q.Q4_K) in qkernels.STORED_TYPES


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q5_1, Q.Q5_0])
@pytest.mark.parametrize("build", range(len(KERNEL_BUILDS)), ids=lambda i: KERNEL_BUILD_NAMES[i])
@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_interleaved_kquant_kinds_give_the_stored_rows_bits(qtype: Q, build: int, activations: str) -> None:
    # Q4_K / Q6_K / Q5_K / Q5_1 decoded into kinds of the interleaved kernels, Q5_0 rewritten as Q8_0 blocks: each
    # the bits of the rows multiplied as stored, for row counts on every tile path (vector tiles of
    # 1-4 rows, AMX tiles of 16 and padded part tiles of 9-15 where the CPU has AMX)
    kernels = KERNEL_BUILDS[build]
    assert kernels is not None
    raw = torch.from_numpy(random_blocks(qtype, 50, 512, seed=12))
    weight = quant.BlockWeight(qtype, raw, 512)
    bias = torch.randn(50, generator=torch.Generator().manual_seed(13))
    linear = quant.BlockLinear(quant.q5_0_as_q8_0(weight) if qtype == Q.Q5_0 else weight, bias, kernels,
                               activations=activations)  # type: ignore[arg-type]
    assert linear.kind == {Q.Q4_K: 3, Q.Q6_K: 4, Q.Q5_K: 5, Q.Q5_1: 5, Q.Q5_0: 2}[qtype]
    x = torch.randn(37, 512, generator=torch.Generator().manual_seed(14))
    for m in (1, 2, 3, 5, 9, 16, 21, 37):
        assert torch.equal(linear(x[:m]), kernels.stored_matmul(x[:m], raw, int(qtype), bias,
                                                                activations=activations)), m
    alone = torch.cat([linear(x[i:i + 1]) for i in range(37)])
    assert torch.equal(linear(x), alone)
    reference = quant_torch.BlockTorchLinear(qtype, raw, 512, bias, activations=activations)
    assert torch.equal(alone, reference(x))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q5_1, Q.Q5_0])
def test_weight_rows_read_back_from_the_interleaved_blocks_are_ggufs_dequantization(qtype: Q) -> None:
    # what a tied embedding looks up in the output head's blocks (quant.HeadEmbedding)
    raw = torch.from_numpy(random_blocks(qtype, 50, 512, seed=21))
    weight = quant.BlockWeight(qtype, raw, 512)
    linear = quant.BlockLinear(quant.q5_0_as_q8_0(weight) if qtype == Q.Q5_0 else weight, None, KERNELS)
    table = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype).astype("float32"))
    ids = torch.tensor([[0, 15, 16, 49], [31, 32, 1, 0]])
    assert torch.equal(linear.weight_rows(ids), table[ids])
    assert torch.equal(linear.weight_rows(torch.arange(50)), table)
    embedding = quant.HeadEmbedding(linear)
    assert torch.equal(embedding(ids), table[ids])
    assert not list(embedding.buffers())  # the head's blocks, not a copy
