"""The folded float64 reference equals dequantize-then-attend: the algebra the kernels run is exact."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foscar.quantize import quantize_kv
from foscar.reference import attend_dequantized, attend_dequantized_torch, attend_folded
from foscar.scheme import BLACKWELL_FP4, BLACKWELL_FP8, Scheme, construction_for


@st.composite
def problems(draw):
    k_bits, v_bits = draw(st.sampled_from([2, 4])), draw(st.sampled_from([2, 4]))  # independent widths
    head_dim = draw(st.sampled_from([64, 128, 256]))
    groups = sorted({32, 64, 128, head_dim})
    k_axis, v_axis = draw(st.sampled_from(["token", "channel"])), draw(st.sampled_from(["token", "channel"]))
    k_group = draw(st.sampled_from([g for g in groups if k_axis == "channel" or head_dim % g == 0]))
    v_group = draw(st.sampled_from([g for g in groups if v_axis == "channel" or head_dim % g == 0]))
    ratio = draw(st.integers(1, 16))
    scheme = Scheme.make(None, k_axis, k_group, v_axis, v_group, head_dim, ratio, k_bits=k_bits, v_bits=v_bits)
    channel_groups = [g for a, g in ((k_axis, k_group), (v_axis, v_group)) if a == "channel"]
    page_size = draw(st.sampled_from([p for p in (64, 128, 256) if all(p % g == 0 for g in channel_groups)]))
    batch = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(1, 2 * page_size + 3), min_size=batch, max_size=batch))
    seed = draw(st.integers(0, 2**31 - 1))
    return scheme, page_size, lengths, seed


def _make(scheme, page_size, lengths, seed, kv_heads=2):
    gen = torch.Generator().manual_seed(seed)
    tokens = max(lengths)
    shape = (len(lengths), kv_heads, tokens, scheme.head_dim)
    k = (torch.randn(shape, generator=gen) * 2 + torch.randn(scheme.head_dim, generator=gen)).to(scheme.q_dtype)
    v = torch.randn(shape, generator=gen).to(scheme.q_dtype)
    q = torch.randn(len(lengths), kv_heads * scheme.gqa_ratio, scheme.head_dim, generator=gen).to(scheme.q_dtype)
    cache = quantize_kv(k, v, scheme, page_size, torch.tensor(lengths, dtype=torch.int32)).shuffle_pages(gen)
    return q, cache


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(["sm_90a", "sm_100a", "fp4", "fp8"]))
def test_folded_reference_equals_dequantize_then_attend(problem, construction):
    """Each arch's plan (its construction per tensor), and any construction forced on both tensors."""
    scheme, page_size, lengths, seed = problem
    arch, con = (construction, None) if construction.startswith("sm_") else ("sm_90a", {"fp4": BLACKWELL_FP4, "fp8": BLACKWELL_FP8}[construction])
    q, cache = _make(scheme, page_size, lengths, seed)
    sm_scale = scheme.head_dim**-0.5
    out, lse = attend_dequantized(q, cache, sm_scale)
    out_f, lse_f = attend_folded(q, cache, sm_scale, arch, construction=con)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert ((out_f - out).norm() / out.norm()) <= 1e-9
    assert ((out_f - out).abs().max() / out.abs().max()) <= 1e-9
    assert ((lse_f - lse).abs() / lse.abs().clamp_min(1)).max() <= 1e-9


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("k_axis, v_axis", [("token", "token"), ("channel", "token"), ("token", "channel"),
                                            ("channel", "channel")])
@pytest.mark.parametrize("k_bits, v_bits", [(2, 2), (4, 2), (2, 4), (4, 4)])
def test_folded_reference_every_width_pair_and_fold_case(k_bits, v_bits, k_axis, v_axis, arch):
    """The whole {2,4} x {2,4} x four fold cases matrix, each tensor folded with its own construction."""
    scheme = Scheme.make(None, k_axis, 64, v_axis, 32, 128, 3, k_bits=k_bits, v_bits=v_bits)
    plan = scheme.plan(arch)
    assert (plan.k.bits, plan.v.bits) == (k_bits, v_bits)
    for fold, bits in ((plan.k, k_bits), (plan.v, v_bits)):  # centred on Hopper where the case asks (K channel-wise)
        built = construction_for(arch, bits)
        centred = arch == "sm_90a" and fold.centres_codes
        assert fold.construction == (built.centred() if centred else built), (fold, built)
    q, cache = _make(scheme, 128, [150, 64], seed=k_bits * 1000 + v_bits * 100 + len(k_axis) * 10 + len(v_axis))
    out, lse = attend_dequantized(q, cache, 0.09)
    out_f, lse_f = attend_folded(q, cache, 0.09, arch)
    assert ((out_f - out).abs().max() / out.abs().max()) <= 1e-9
    assert ((lse_f - lse).abs() / lse.abs().clamp_min(1)).max() <= 1e-9


def test_reference_matches_a_direct_softmax_for_one_token():
    scheme = Scheme.make(2, gqa_ratio=3)
    q, cache = _make(scheme, 64, [1], seed=1)
    out, lse = attend_dequantized(q, cache, 0.1)
    k, v = cache.dequantize(torch.float64)
    # one token: the output is that token's V for every query head of the group
    assert torch.allclose(out[0], v[0, :, 0].repeat_interleave(3, dim=0), atol=1e-12)
    assert torch.allclose(lse[0], 0.1 * (q[0].double() * k[0, :, 0].repeat_interleave(3, dim=0)).sum(-1), atol=1e-12)


def test_bf16_torch_reference_is_close_but_not_exact():
    scheme = Scheme.make(4, gqa_ratio=4)
    q, cache = _make(scheme, 64, [200, 65], seed=2)
    out, _ = attend_dequantized(q, cache, scheme.head_dim**-0.5)
    out_bf16 = attend_dequantized_torch(q, cache, scheme.head_dim**-0.5)
    err = (out_bf16.double() - out).abs().max()
    assert 0 < err < 2e-2


@pytest.mark.parametrize("fn", [attend_dequantized, attend_folded, attend_dequantized_torch])
def test_references_reject_bad_queries(fn):
    scheme = Scheme.make(2, gqa_ratio=2)
    q, cache = _make(scheme, 64, [10], seed=3)
    with pytest.raises(TypeError, match="q must have dtype"):
        fn(q.float(), cache, 0.1)
    with pytest.raises(ValueError, match=r"q must have shape"):
        fn(q[:, :1], cache, 0.1)
    with pytest.raises(ValueError, match="sm_scale"):
        fn(q, cache, -1.0)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        fn([0.0], cache, 0.1)


def test_the_causal_check_passes_the_reference_and_names_a_wrong_sequence():
    """``foscar.testing.check_causal_output`` (``benchmarks.ab``'s gate of several-token kernels): the float64
    reference itself passes, with or without lse; one element off by 10x the tolerance, or a NaN, fails and names its
    sequence."""
    from foscar.testing import causal_references, check_causal_output, random_problem

    scheme = Scheme.make(2, "token", 64, "token", 64, 64, 4)
    tokens, lengths = 3, [70, 5, 129]
    q, cache = random_problem(scheme, lengths, kv_heads=2, page_size=64, device="cpu")
    q = torch.randn(len(lengths), tokens, *q.shape[1:]).to(q.dtype)
    k, v = cache.dequantize(torch.float64)
    refs = [causal_references(q[b], k[b, :, :n], v[b, :, :n], 0.125) for b, n in enumerate(lengths)]
    out = torch.stack([ref for ref, *_ in refs]).to(q.dtype)
    lse = torch.stack([ref_lse for _, ref_lse, *_ in refs]).float()
    exact = check_causal_output(out, lse, q, cache, 0.125)
    assert exact.ok and exact.err < exact.tol / 2, exact
    assert check_causal_output(out, None, q, cache, 0.125).ok
    wrong = out.clone()
    wrong[1, 2, 5, 7] += 10 * exact.tol
    acc = check_causal_output(wrong, lse, q, cache, 0.125)
    assert not acc.ok and acc.where == "sequence 1 (5 tokens)", acc
    nan = out.clone()
    nan[2, 0, 0, 0] = float("nan")
    acc = check_causal_output(nan, lse, q, cache, 0.125)
    assert not acc.ok and acc.err == float("inf") and acc.where.startswith("sequence 2"), acc
    bad_lse = lse.clone()
    bad_lse[0, 1, 3] += 1.0
    assert not check_causal_output(out, bad_lse, q, cache, 0.125).ok
