"""Split-KV log-sum-exp combine: a torch reference (checked on the CPU against unsplit attention)
and the CuTe DSL kernel against it (GPU)."""

import math

import pytest
import torch


def combine_reference(o_partial, lse_partial):
    """(o [batch, q_heads, D], lse [batch, q_heads]) in the input dtype; empty splits have lse -inf.

    Rows whose splits are all empty get o = 0 and lse = -inf, as the kernel does.
    """
    lse = torch.logsumexp(lse_partial, dim=-1)  # -inf when every split is empty
    weights = torch.exp(lse_partial - lse[..., None]).nan_to_num(0.0)  # -inf - -inf = nan -> 0
    o_partial = torch.where(torch.isinf(lse_partial)[..., None], 0.0, o_partial)  # garbage in empty splits
    return (weights[..., None] * o_partial).sum(-2), lse


def split_attention(q, k, v, bounds):
    """Per-split normalised outputs and natural-log LSEs of single-query attention."""
    scores = torch.einsum("bhd,bhld->bhl", q, k) / math.sqrt(q.shape[-1])
    outs, lses = [], []
    for lo, hi in bounds:
        s = scores[..., lo:hi]
        if hi == lo:
            outs.append(torch.full_like(q, float("nan")))
            lses.append(torch.full(q.shape[:-1], -math.inf, dtype=q.dtype))
            continue
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.einsum("bhl,bhld->bhd", torch.softmax(s, -1), v[..., lo:hi, :]))
    return torch.stack(outs, 2), torch.stack(lses, 2)


def test_reference_equals_unsplit_attention(rng):
    gen = rng
    b, h, length, d = 2, 3, 50, 16
    shapes = ((d,), (length, d), (length, d))
    q, k, v = (torch.randn(b, h, *shape, generator=gen, dtype=torch.float64) for shape in shapes)
    bounds = [(0, 7), (7, 7), (7, 30), (30, 50), (50, 50)]  # two empty splits
    o_partial, lse_partial = split_attention(q, k, v, bounds)
    o, lse = combine_reference(o_partial, lse_partial)
    scores = torch.einsum("bhd,bhld->bhl", q, k) / math.sqrt(d)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
    torch.testing.assert_close(o, torch.einsum("bhl,bhld->bhd", torch.softmax(scores, -1), v))


def test_reference_all_empty_row():
    o, lse = combine_reference(torch.full((1, 1, 3, 4), float("nan")), torch.full((1, 1, 3), -math.inf))
    assert torch.equal(o, torch.zeros(1, 1, 4)) and lse.item() == -math.inf


def test_combine_block_is_whole_warps():
    """Each warp reduces the row's lse over every split (pass 1), so a block of partial warps would
    give its last warp another max: every head_dim gets whole warps (96 once got 240 threads)."""
    from foscar.kernels.combine import Combine

    from foscar.kernels.combine import built_splits
    from foscar.split_merge import BATCH

    for d in range(32, 1025, 32):
        for splits in (32, 64, 128, 256):
            kernel = Combine(d, splits=splits)
            assert kernel.threads % 32 == 0 and kernel.threads == kernel.groups * d // 4 <= 1024, (d, splits)
            # one batch of loads per thread reads the splits, where 1024 threads allow (groups come in steps that
            # keep whole warps)
            step = 32 // math.gcd(d // 4, 32)
            assert kernel.groups * BATCH >= splits or kernel.threads + step * d // 4 > 1024, (d, splits)
    assert [built_splits(n) for n in (1, 32, 33, 64, 65, 128, 129, 256, 1000)] == [32, 32, 64, 64, 128, 128, 256,
                                                                                   256, 256]
    with pytest.raises(ValueError, match="head_dim must be a multiple of 32"):
        Combine(100)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("splits", [1, 7, 40, 128, 200])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_combine_kernel_matches_reference(d, splits, out_dtype, rng):
    from foscar.kernels import combine_splits

    gen = rng
    b, h = 3, 5
    o_partial = torch.randn(b, h, splits, d, generator=gen)
    lse_partial = torch.randn(b, h, splits, generator=gen) * 4
    lse_partial[0, 1, :] = -math.inf  # an all-empty row
    if splits > 1:
        lse_partial[1, :, 0] = -math.inf  # an empty split ...
        o_partial[1, :, 0] = float("nan")  # ... whose output is garbage
    out = torch.full((b, h, d), float("nan"), dtype=out_dtype, device="cuda")  # poisoned
    lse_out = torch.full((b, h), float("nan"), device="cuda")
    o, lse = combine_splits(o_partial.cuda(), lse_partial.cuda(), out, lse_out)
    assert o is out and lse is lse_out
    torch.cuda.synchronize()
    o_ref, lse_ref = combine_reference(o_partial.double(), lse_partial.double())
    torch.testing.assert_close(lse.cpu().double(), lse_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o.cpu().float(), o_ref.float(), rtol=2**-7, atol=1e-3)
