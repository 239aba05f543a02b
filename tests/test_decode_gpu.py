"""GPU: the device arch's decode kernel (tests/device_arch.py) against the float64 reference, over the coverage matrix.

Fresh random inputs every run, NaN-poisoned outputs, every element checked; tolerance: 2x the
error of a BF16 PyTorch dequantize-then-SDPA of the same cache (foscar.testing).
"""

import dataclasses

import pytest
import torch

from foscar.decode import decode
from foscar.reference import attend_dequantized
from foscar.scheme import Scheme
from foscar.testing import check_output, coverage_matrix, random_problem

from device_arch import require_arch, skip_unless_builds

pytestmark = pytest.mark.gpu


def _poisoned(q):
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=q.device)
    return out, lse


@pytest.mark.parametrize("scheme, page_size, lengths", coverage_matrix(), ids=lambda p: getattr(p, "name", None))
def test_decode_matches_reference(scheme, page_size, lengths):
    skip_unless_builds(scheme, page_size)
    q, cache = random_problem(scheme, lengths, kv_heads=2, page_size=page_size)
    out, lse = decode(q, cache, return_lse=True, out=_poisoned(q)[0], lse=_poisoned(q)[1])
    acc = check_output(out, lse, q, cache, scheme.head_dim**-0.5)
    assert acc.ok, acc


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_split_counts_and_query_dtypes(num_splits, q_dtype):
    scheme = dataclasses.replace(coverage_matrix()[2][0], q_dtype=q_dtype)  # K channel-wise, V token-wise
    q, cache = random_problem(scheme, [1, 700, 129], kv_heads=3, page_size=128)
    out, lse = _poisoned(q)
    decode(q, cache, return_lse=True, num_splits=num_splits, out=out, lse=lse)
    acc = check_output(out, lse, q, cache, scheme.head_dim**-0.5)
    assert out.dtype == q_dtype and acc.ok, acc


@pytest.mark.parametrize("scheme", [Scheme.make(2, "token", 128, "token", 128, 128, 4),
                                    Scheme.make(2, "channel", 128, "token", 128, 128, 16),
                                    Scheme.make(4, "token", 128, "token", 128, 128, 4)], ids=lambda s: s.name)
def test_one_cta_over_a_long_sequence(scheme):
    """One split: a CTA accumulates every tile of 64K tokens into its O (the plan of a large batch of long
    sequences: 16 x 100K gets one split). The MMA's FP32 accumulation truncates; a V operand bias summed over the
    whole split once put these 3-8x past the rule (benchmarks/NOTES.md section 30)."""
    q, cache = random_problem(scheme, [65536, 30001], kv_heads=2, page_size=128)
    out, lse = _poisoned(q)
    decode(q, cache, return_lse=True, num_splits=1, out=out, lse=lse)
    acc = check_output(out, lse, q, cache, scheme.head_dim**-0.5)
    assert acc.ok, acc


@pytest.mark.parametrize("scheme, max_err, mean_err", [
    (Scheme.make(2, "token", 128, "token", 128, 128, 4, q_dtype=torch.float16), 5e-4, 5e-5),
    (Scheme.make(4, "token", 128, "token", 128, 128, 4, q_dtype=torch.float16), 4e-4, 3e-5),
], ids=lambda p: getattr(p, "name", None))
def test_scores_of_one_token_sequences(scheme, max_err, mean_err, rng):
    """A sequence of one token has ``lse = sm_scale * q.k``: its lse error is the kernel's score error, i.e. what
    cancelling the operand biases in the MMA's truncating FP32 accumulation costs (``foscar.operands``). With the slot
    biases up to 16, 32K scores of FP16 q erred at most 1.4e-4 on the H200 (mean 6e-6 INT2, 1.3e-5 INT4); with the
    biases up to 256 / 64 of the unlifted bottom slots, one draw gave max 2.8e-3 / 6.4e-4, mean 3.2e-4 / 6.5e-5
    (benchmarks/NOTES.md section 44), beyond both bounds."""
    require_arch("sm_90a", "bounds measured on the Hopper kernel's FP16 operands")
    q, cache = random_problem(scheme, [1] * 1024, kv_heads=8, page_size=128, generator=rng)
    out, lse = _poisoned(q)
    decode(q, cache, sm_scale=0.1, return_lse=True, num_splits=1, out=out, lse=lse)
    err = (lse.double() - attend_dequantized(q, cache, 0.1)[1]).abs()
    assert float(err.max()) <= max_err and float(err.mean()) <= mean_err, (float(err.max()), float(err.mean()))


def _two_ctas_matrix():
    """The coverage matrix's variants whose unsplit launch over rows of at most SHORT_CONTEXT_TOKENS may run two CTAs
    per SM (``foscar.hopper.kernel.two_ctas_pipeline``)."""
    from foscar.hopper.decode import SHORT_CONTEXT_TOKENS
    from foscar.hopper.kernel import two_ctas_pipeline

    return [(scheme, page_size, lengths) for scheme, page_size, lengths in coverage_matrix("sm_90a")
            if two_ctas_pipeline(scheme) and -(-max(lengths) // page_size) * page_size <= SHORT_CONTEXT_TOKENS]


@pytest.mark.parametrize("scheme, page_size, lengths", _two_ctas_matrix(), ids=lambda p: getattr(p, "name", None))
def test_many_short_sequences_at_two_ctas_per_sm(scheme, page_size, lengths, monkeypatch):
    """More than a wave of short ragged sequences in one split: ``decode`` compiles and launches one consumer
    warpgroup at two CTAs per SM (``HopperKernels.launch_options``; registers and shared memory halved, a smaller
    ring), into NaN-poisoned outputs, against float64."""
    require_arch("sm_90a", "the Hopper kernel's launch options")
    from foscar.hopper.decode import KERNELS

    asked, compile_decode = [], KERNELS.compile_decode

    def recorded(*args, **options):
        asked.append(options)
        return compile_decode(*args, **options)

    monkeypatch.setattr(KERNELS, "compile_decode", recorded)
    q, cache = random_problem(scheme, lengths * -(-140 // len(lengths)), kv_heads=2, page_size=page_size)
    out, lse = _poisoned(q)
    decode(q, cache, return_lse=True, num_splits=1, out=out, lse=lse)
    assert asked == [{"consumers": 1, "ctas_per_sm": 2}]  # (280+ CTAs: over two waves on 132 SMs)
    acc = check_output(out, lse, q, cache, scheme.head_dim**-0.5)
    assert acc.ok, acc


def test_second_call_with_other_lengths_does_not_recompile():
    from foscar.jit import kernel_count

    scheme = coverage_matrix()[0][0]
    q, cache = random_problem(scheme, [100, 7], page_size=128)
    decode(q, cache, num_splits=3)
    before = kernel_count()  # compiled or loaded from disk: either would mean a new key
    q, cache = random_problem(scheme, [5000, 1, 300], page_size=128)
    decode(q, cache, num_splits=5)
    assert kernel_count() == before
