"""Split-KV combine: merge per-split partial outputs by their log-sum-exp (CuTe DSL, SIMT).

Long contexts with few sequences split the KV range across CTAs (flash-decoding); each split
writes an output normalised over its own tokens and that split's log-sum-exp. The exact merge is::

    lse = log(sum_s exp(lse_s))          o = sum_s exp(lse_s - lse) * o_s

Empty splits carry ``lse_s = -inf`` and are skipped (their ``o_s`` may be garbage); a row whose
splits are all empty gets ``o = 0`` and ``lse = -inf``. Same math on both arches and no Tensor
Cores, so one kernel compiled for sm_90a and sm_100a.

Shapes: ``o_partial`` fp32 [batch, q_heads, splits, D], ``lse_partial`` fp32 [batch, q_heads,
splits] (natural log), outputs ``o`` bf16 or fp16 [batch, q_heads, D] and ``lse`` fp32 [batch, q_heads];
``splits`` is a runtime value. Host side takes pointers and extents, as in ``dequantize``.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from ..jit import cached_compile, current_stream, device_arch, fake_ptr, gmem_ptr
from ..softmax import lse_weight, merged_lse

__all__ = ["Combine", "compile_combine", "combine_splits"]

WARPS = 4  # rows (sequence, query head) per CTA: one warp each


class Combine:
    """One warp per (sequence, query head) row; lane ``i`` owns channels ``[i*D/32, (i+1)*D/32)``.

    Pass 1 (lanes stride over splits, then warp reductions): the max and the sum of
    ``exp(lse_s - max)``, hence ``lse``. Pass 2 (all lanes walk every split): accumulate
    ``exp(lse_s - lse) * o_s`` with one vector load per lane per split.
    """

    def __init__(self, head_dim: int, out_dtype=cutlass.BFloat16):
        if head_dim % 32:
            raise ValueError(f"head_dim must be a multiple of 32, got {head_dim}")
        self.head_dim = head_dim
        self.out_dtype = out_dtype
        self.per_lane = head_dim // 32

    @cute.jit
    def __call__(
        self,
        o_partial: cute.Pointer,
        lse_partial: cute.Pointer,
        o: cute.Pointer,
        lse: cute.Pointer,
        batch: cutlass.Int32,
        q_heads: cutlass.Int32,
        splits: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        D = self.head_dim
        rows = batch * q_heads  # contiguous [batch, q_heads] flattens to rows
        # (rows, splits, D)
        mOp = cute.make_tensor(o_partial, cute.make_ordered_layout((rows, splits, D), (2, 1, 0)))
        # (rows, splits)
        mLp = cute.make_tensor(lse_partial, cute.make_ordered_layout((rows, splits), (1, 0)))
        # (rows, D)
        mO = cute.make_tensor(o, cute.make_ordered_layout((rows, D), (1, 0)))
        # (rows,)
        mL = cute.make_tensor(lse, cute.make_layout(rows))
        self.kernel(mOp, mLp, mO, mL, rows, splits).launch(
            grid=[(rows + WARPS - 1) // WARPS, 1, 1], block=[32 * WARPS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mOp: cute.Tensor,
        mLp: cute.Tensor,
        mO: cute.Tensor,
        mL: cute.Tensor,
        rows: cutlass.Int32,
        splits: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = bidx * WARPS + tidx // 32
        if row < rows:
            neg_inf = cutlass.Float32(-math.inf)
            # ---- pass 1: lse over splits ----------------------------------------------------
            m = neg_inf
            for s in cutlass.range(lane, splits, 32, unroll=1):
                m = cute.arch.fmax(m, mLp[row, s])
            m = cute.arch.warp_reduction_max(m)
            row_lse = neg_inf
            if m > neg_inf:
                total = cutlass.Float32(0.0)
                for s in cutlass.range(lane, splits, 32, unroll=1):
                    total += lse_weight(mLp[row, s], m)
                total = cute.arch.warp_reduction_sum(total)
                row_lse = merged_lse(m, total)

            # ---- pass 2: weighted sum of the partial outputs ---------------------------------
            acc = cute.make_rmem_tensor((self.per_lane,), cutlass.Float32)
            acc.fill(0.0)
            part = cute.make_rmem_tensor((self.per_lane,), cutlass.Float32)
            for s in cutlass.range(splits, unroll=1):
                split_lse = mLp[row, s]
                if split_lse > neg_inf:
                    weight = lse_weight(split_lse, row_lse)
                    # ((per_lane), (32))
                    cute.autovec_copy(cute.zipped_divide(mOp[row, s, None], (self.per_lane,))[None, lane], part)
                    for i in cutlass.range_constexpr(self.per_lane):
                        acc[i] += weight * part[i]
            out = cute.make_rmem_tensor((self.per_lane,), self.out_dtype)
            out.store(acc.load().to(self.out_dtype))
            # ((per_lane), (32))
            cute.autovec_copy(out, cute.zipped_divide(mO[row, None], (self.per_lane,))[None, lane])
            if lane == 0:
                mL[row] = row_lse


def compile_combine(head_dim: int, arch: str = "sm_90a", out_dtype=cutlass.BFloat16):
    """Compile (no GPU needed) for ``arch`` with PTX and cubin kept; see ``foscar.inspect``."""
    from ..inspect import compile_for

    i32 = cutlass.Int32(1)
    return compile_for(
        arch,
        Combine(head_dim, out_dtype),
        fake_ptr(cutlass.Float32),
        fake_ptr(cutlass.Float32),
        fake_ptr(out_dtype),
        fake_ptr(cutlass.Float32),
        i32, i32, i32,
        cuda.CUstream(0),
    )


def combine_splits(o_partial, lse_partial, out, lse):
    """Merge CUDA split partials into ``out`` (bf16/fp16 [batch, q_heads, D]) and ``lse``
    (fp32 [batch, q_heads]) on the current torch stream; returns ``(out, lse)``."""
    import torch

    batch, q_heads, splits, D = o_partial.shape
    for name, t, dtype, shape in (("o_partial", o_partial, (torch.float32,), (batch, q_heads, splits, D)),
                                  ("lse_partial", lse_partial, (torch.float32,), (batch, q_heads, splits)),
                                  ("out", out, (torch.bfloat16, torch.float16), (batch, q_heads, D)),
                                  ("lse", lse, (torch.float32,), (batch, q_heads))):
        if t.dtype not in dtype or tuple(t.shape) != shape or not t.is_cuda or not t.is_contiguous():
            raise ValueError(f"{name}: need a contiguous CUDA {dtype} tensor of shape {shape}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if out.numel() == 0:
        return out, lse
    out_type = cutlass.BFloat16 if out.dtype == torch.bfloat16 else cutlass.Float16
    arch = device_arch(o_partial.device)
    compiled = cached_compile(("combine", D, out_type, arch), lambda: compile_combine(D, arch, out_type))


    stream = current_stream(o_partial.device)
    compiled(gmem_ptr(o_partial, cutlass.Float32), gmem_ptr(lse_partial, cutlass.Float32), gmem_ptr(out, out_type),
             gmem_ptr(lse, cutlass.Float32), batch, q_heads, splits, stream)
    return out, lse
