"""The shared argument checks (``foscar.checks``): one kind of argument is taken alike by every entry point."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from foscar import BatchAttention, Scheme, quantize_kv
from foscar.cache import PagedKVCache
from foscar.checks import MAX_SM_SCALE
from foscar.decode import plan_splits, validate_paged
from foscar.reference import attend_dequantized

SCHEME = Scheme.make(4, "token", 64, "token", 64, head_dim=64, gqa_ratio=2)


def cache_and_q(rng, layers=1):
    cache = PagedKVCache(SCHEME, layers, 1, 8, 2, 512, sink=0, window=64, device="cpu", use_kernels=False)
    seq = cache.allocate()
    k = torch.randn(1, 1, 200, 64, generator=rng).bfloat16()
    cache.append(0, [seq], k, k)
    return cache, seq, torch.randn(1, 2, 64, generator=rng).bfloat16()


def sm_scale_callers(rng):
    """Each entry point that takes ``sm_scale``, as ``f(sm_scale)``."""
    cache, seq, q = cache_and_q(rng)
    k = torch.randn(1, 1, 64, 64, generator=rng).bfloat16()
    quantized = quantize_kv(k, k, SCHEME)
    tensors = (quantized.k_codes, quantized.k_params, quantized.v_codes, quantized.v_params, quantized.page_table,
               quantized.lengths)
    batch = BatchAttention(cache)

    def run_batch(sm_scale):
        batch.plan([seq], [0, 1])  # each layer runs once per plan
        return batch.run(0, q, k[0, :, :1].transpose(0, 1), k[0, :, :1].transpose(0, 1), sm_scale)

    return {
        "reference": lambda s: attend_dequantized(q, quantized, s),
        "decode_paged": lambda s: validate_paged(q, *tensors, SCHEME, quantized.page_size, s),
        "PagedKVCache.attend": lambda s: cache.attend(0, [seq], q, sm_scale=s),
        "PagedKVCache.attend_chunk": lambda s: cache.attend_chunk(0, [seq], q[:, None], k[:, :, :1], k[:, :, :1], s),
        "BatchAttention.run": run_batch,
    }


@pytest.mark.parametrize("caller", ["reference", "decode_paged", "PagedKVCache.attend", "PagedKVCache.attend_chunk",
                                    "BatchAttention.run"])
def test_every_sm_scale_is_checked_alike(rng, caller):
    """A scale past MAX_SM_SCALE can take a float32 score of float16-range q and k to inf (the softmax to NaN):
    refused with the other bad scales, by every caller; a numpy float or a Fraction is a number like any other."""
    call = sm_scale_callers(rng)[caller]
    for bad in (MAX_SM_SCALE * 1.01, 3e38, 10**400, math.inf, math.nan, np.float32("nan"), 0.0, -0.1, True, "0.1",
                torch.tensor(0.1)):
        with pytest.raises(ValueError, match=r"sm_scale must be (None or )?a positive finite float at most 6\.554e\+04"):
            call(bad)
    for good in (np.float32(0.125), np.float64(0.125), Fraction(1, 8), 1, MAX_SM_SCALE):
        call(good)
    # the largest score: head_dim 256 of float16's largest values
    assert math.isfinite(float(torch.tensor(MAX_SM_SCALE * math.log2(math.e) * 256 * 65504.0**2, dtype=torch.float32)))


def test_numpy_ints_are_ints_and_bools_are_not(rng):
    """Every integer argument takes a numpy int as the int it is (a tensor's ``.numpy()`` values, an index from a
    numpy array) and refuses a bool, the same way."""
    cache = PagedKVCache(SCHEME, np.int64(2), np.int32(1), np.int64(8), np.int64(3), np.int64(512),
                         page_size=np.int64(64), sink=np.int16(0), window=np.int64(64), rollback=np.uint8(0),
                         device="cpu", use_kernels=False)
    assert all(type(getattr(cache, name)) is int for name in ("num_layers", "kv_heads", "num_pages", "max_seqs",
                                                              "max_seq_len", "page_size", "sink", "window"))
    seq = cache.allocate(np.int64(100))
    cache.reserve(np.int64(seq), np.int64(200))
    k = torch.randn(1, 1, 130, 64, generator=rng).bfloat16()
    cache.append(np.int64(1), np.array([seq]).tolist(), k, k)
    cache.append(1, [np.int64(seq)], k[:, :, :1], k[:, :, :1])
    cache.truncate(np.int32(1), [seq], np.int64(1))
    assert cache.seq_len(np.int64(seq), np.int64(1)) == 130
    batch = BatchAttention(cache)
    batch.plan([seq], [np.int64(0), np.int32(2)])
    for bad in (True, np.bool_(True)):
        for message, call in (
            ("num_layers must be an int", lambda: PagedKVCache(SCHEME, bad, 1, 8, 3, 512, device="cpu")),
            ("num_tokens must be an int", lambda: cache.allocate(bad)),
            ("num_tokens must be an int", lambda: cache.reserve(seq, bad)),
            ("num_tokens must be an int", lambda: cache.truncate(1, [seq], bad)),
            ("layer must be an int", lambda: cache.seq_len(seq, bad)),
            ("qo_indptr must hold ints", lambda: batch.plan([seq], [0, bad])),
            ("page_size must be one of", lambda: quantize_kv(k, k, SCHEME, page_size=bad)),
            ("batch must be a positive int", lambda: plan_splits(bad, 1, 128, 132)),
        ):
            with pytest.raises((ValueError, TypeError), match=message):
                call()
    assert quantize_kv(k, k, SCHEME, page_size=np.int64(128)).page_size == 128
    assert plan_splits(np.int64(1), np.int32(2), np.int64(4096), np.int64(132)) == plan_splits(1, 2, 4096, 132)
