"""The Hopper prefill kernel (``foscar.hopper.prefill``) on the CPU: what it builds and refuses, its splits, and its
SASS (compiled here for sm_90a: no spill, the products it should issue, whole-line shared-memory stores). Its
values are checked on the GPU against float64 (``tests/test_cache_chunk.py``: ``packed_by="prefill"`` and
``test_the_prefill_kernel_over_a_long_prefix_in_splits``)."""

import re

import pytest
import torch

from foscar import Scheme
from foscar.archs import BLACKWELL, HOPPER
from foscar.hopper.prefill import RAN_ON_A_GPU, TILE_N, PrefillConfig, compile_prefill, prefill_splits
from foscar.inspect import artifacts
from test_cache_chunk import GPU_SCHEMES
from user_formats import INT8, SYM_INT4

COMPILED = [Scheme.make(2, "channel", 128, "token", 128, 128, 4),
            Scheme.make(4, "token", 128, "token", 128, 128, 4, q_dtype=torch.float16),
            Scheme.make(k_bits=4, v_bits=2, head_dim=128, gqa_ratio=8)]


@pytest.mark.parametrize("scheme", COMPILED, ids=lambda s: s.name)
def test_the_prefill_kernel_compiles_without_spills(scheme):
    """Both roles' loops: the consumers issue ``D/16`` QK and 4 PV warpgroup MMAs per 64-token tile and nothing
    spills; shared memory is stored whole vectors at a time (8 values of a chunk in the swizzled tiles: 16 bytes; the
    packed words staged: 8 or 16), never element by element."""
    found = artifacts(compile_prefill(PrefillConfig.of(scheme, scheme.q_dtype_name)))
    assert found.resources().local_bytes == 0
    mma_loops = [loop for loop in found.loops() if loop.mma]
    assert [loop.mma for loop in mma_loops] == [scheme.head_dim // 16 + TILE_N // 16]
    stores = set(re.findall(r"\bSTS(\.\S+)?", found.sass))
    assert ".128" in stores and stores <= {".128", ".64"}, stores


def test_what_the_prefill_kernel_takes():
    assert HOPPER.takes_prefill(COMPILED[0]) and not BLACKWELL.takes_prefill(COMPILED[0])
    for head_dim in (64, 256):
        other = Scheme.make(2, "token", 64, "token", 64, head_dim, 4)
        assert not HOPPER.takes_prefill(other)
        with pytest.raises(ValueError, match="head_dim"):
            PrefillConfig.of(other)
    with pytest.raises(NotImplementedError, match="sm_100a"):
        BLACKWELL.run_prefill(None, None, None, None, None, None, 64, 0.1, COMPILED[0])


@pytest.mark.parametrize("scheme", [Scheme.make(2, "channel", 128, "channel", 128, 128, 4),  # V channel-wise
                                    Scheme.make(format=INT8, head_dim=128, gqa_ratio=4),
                                    Scheme.make(2, "channel", 64, "token", 64, 128, 4),
                                    Scheme.make(format=SYM_INT4, head_dim=128, gqa_ratio=4),
                                    # each role's format ran, but not these pairs or query dtypes
                                    Scheme.make(2, "token", 128, "token", 128, 128, 4),
                                    Scheme.make(4, "token", 128, "token", 128, 128, 4, q_dtype=torch.float16),
                                    Scheme.make(k_bits=4, v_bits=2, head_dim=128, gqa_ratio=8)],
                         ids=lambda s: s.name)
def test_the_route_leaves_configurations_no_gpu_has_run(scheme):
    """The kernel builds these (the dequantize kernel reads their formats), but none has run on a GPU: the cache's
    route gives their chunks to the decode kernel or the blocks."""
    assert not PrefillConfig.of(scheme, scheme.q_dtype_name).has_run and not HOPPER.takes_prefill(scheme)


def test_what_has_run_is_what_the_gpu_tests_run():
    """Every configuration the route takes is one that ``tests/test_cache_chunk.py``'s GPU tests force through the
    kernel, and every scheme those tests force through it is taken (else they would test another path)."""
    assert all(HOPPER.takes_prefill(scheme) for scheme in GPU_SCHEMES)
    assert {PrefillConfig.of(scheme, scheme.q_dtype_name).ran_key for scheme in GPU_SCHEMES} == RAN_ON_A_GPU


@pytest.mark.parametrize("row_tiles, kv_heads, tiles, want", [
    (1, 8, 1563, 16),  # a short chunk: the splits fill one wave of 132 SMs
    (4, 8, 1563, 4),
    (32, 8, 1563, 1),  # 256 CTAs: more than a wave already
    (1, 8, 40, 5),  # no split shorter than 8 tiles
    (1, 1, 3, 1),
])
def test_prefill_splits_fill_one_wave(row_tiles, kv_heads, tiles, want):
    assert prefill_splits(row_tiles, kv_heads, tiles, 132) == want
