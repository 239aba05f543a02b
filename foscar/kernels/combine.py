"""Split-KV combine: merge per-split partial outputs by their log-sum-exp (CuTe DSL, SIMT).

Long contexts with few sequences split the KV range across CTAs (flash-decoding); each split
writes an output normalised over its own tokens and that split's log-sum-exp. The exact merge is::

    lse = log(sum_s exp(lse_s))          o = sum_s exp(lse_s - lse) * o_s

Empty splits carry ``lse_s = -inf`` and weigh 0 (their ``o_s`` may be garbage: masked, not multiplied); a row whose
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

from ..jit import cached_compile, device_arch, fake_ptr, half_type, launch
from ..device import fsel
from ..softmax import merged_lse
from ..split_merge import BATCH, VEC, PartialSum, row_lse

__all__ = ["Combine", "built_splits", "cached_combine", "compile_combine", "combine_splits"]

THREADS = 256


class Combine:
    """One CTA per (sequence, query head) row. Thread ``t`` owns channels ``[4v, 4v + 4)`` (``v = t %
    (D/4)``) of splits ``g, g + G, ...`` (``g = t // (D/4)``, ``G = threads / (D/4)`` split groups), so
    a row's partials are read by all its threads at once, a few independent loads each, not split
    after split (64 splits of 128 channels were 64 dependent round trips of one warp).

    Pass 1 (every warp, redundantly): the row's max lse and the sum of ``exp(lse_s - max)``
    (``split_merge.row_lse``). Pass 2: each thread's weighted sum over its splits; the groups' sums meet in shared
    memory. ``splits``: the most splits the kernel is built to read in one ``BATCH`` of loads per thread (more
    groups, up to 1024 threads); any count is merged, more in more rounds.
    """

    def __init__(self, head_dim: int, out_dtype=cutlass.BFloat16, splits: int = 32):
        if head_dim % 32:
            raise ValueError(f"head_dim must be a multiple of 32, got {head_dim}")
        self.head_dim = head_dim
        self.out_dtype = out_dtype
        if head_dim > 4 * THREADS:
            raise ValueError(f"head_dim must be at most {4 * THREADS}, got {head_dim}")
        self.vecs = head_dim // VEC  # threads per split group
        # whole warps (pass 1 reduces over full warps): groups * vecs % 32 == 0, about THREADS threads, or as many
        # as reading ``splits`` in one batch takes (at most 1024)
        step = 32 // math.gcd(self.vecs, 32)
        wanted = max(THREADS, min(1024, self.vecs * -(-splits // BATCH)))
        self.groups = max(step, wanted // self.vecs // step * step)
        self.threads = self.groups * self.vecs
        self.partial_sum = PartialSum()

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
        self.kernel(mOp, mLp, mO, mL, splits).launch(grid=[rows, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOp: cute.Tensor, mLp: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor, splits: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        group, vec = tidx // self.vecs, tidx % self.vecs
        # (groups, D): each split group's weighted sums
        sSums = cutlass.memory.SmemAllocator().allocate_tensor(
            cutlass.Float32, cute.make_ordered_layout((self.groups, self.head_dim), (1, 0)), byte_alignment=16)

        # ---- pass 1: the row's lse (each warp computes it; the lse row is a few L1 lines) ----
        m, weights = row_lse(mLp[row, None], splits, lane)

        # ---- pass 2: this thread's splits, a batch of loads at a time ----
        acc = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        acc.fill(0.0)
        self.partial_sum.accumulate(acc, mOp[row, None, None], mLp[row, None], m, vec, group, self.groups, splits)
        for i in cutlass.range_constexpr(VEC):
            sSums[group, vec * VEC + i] = acc[i]
        cute.arch.sync_threads()

        if group == 0:
            inv = fsel(weights > cutlass.Float32(0.0), cute.arch.rcp_approx(weights), cutlass.Float32(0.0))
            for i in cutlass.range_constexpr(VEC):
                acc[i] = sSums[0, vec * VEC + i]
                for g in cutlass.range_constexpr(1, self.groups):
                    acc[i] += sSums[g, vec * VEC + i]
            out = cute.make_rmem_tensor((VEC,), self.out_dtype)
            out.store((acc.load() * inv).to(self.out_dtype))
            # ((VEC), (D / VEC))
            cute.autovec_copy(out, cute.zipped_divide(mO[row, None], (VEC,))[None, vec])
            if vec == 0:
                mL[row] = merged_lse(m, weights)


def built_splits(splits: int) -> int:
    """The ``Combine(splits=...)`` build that merges ``splits`` partials: the power of two at or above, 32 to 256 (a
    few builds; up to 32 splits a head_dim up to 256 keeps its base 256 threads, which read them in one batch of
    loads)."""
    return min(max(32, 1 << (splits - 1).bit_length()), 256)


def compile_combine(head_dim: int, arch: str = "sm_90a", out_dtype=cutlass.BFloat16, splits: int = 32):
    """Compile (no GPU needed) for ``arch`` with PTX and cubin kept; see ``foscar.inspect``. ``splits``: as
    ``Combine``'s."""
    from ..inspect import compile_for

    i32 = cutlass.Int32(1)
    return compile_for(
        arch,
        Combine(head_dim, out_dtype, splits),
        fake_ptr(cutlass.Float32),
        fake_ptr(cutlass.Float32),
        fake_ptr(out_dtype),
        fake_ptr(cutlass.Float32),
        i32, i32, i32,
        cuda.CUstream(0),
    )


def cached_combine(head_dim: int, out_type, arch: str, splits: int = 32):
    """The compiled combine that merges ``splits`` partials (its build: :func:`built_splits`), from the compile
    cache, under the key :func:`combine_splits` uses (the main job's compile report builds the 32-split one)."""
    built = built_splits(splits)
    return cached_compile(("combine", head_dim, out_type, arch, built),
                          lambda: compile_combine(head_dim, arch, out_type, built))


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
    out_type = half_type(out.dtype)
    compiled = cached_combine(D, out_type, device_arch(o_partial.device), splits)
    launch(compiled, (o_partial, cutlass.Float32), (lse_partial, cutlass.Float32), (out, out_type),
           (lse, cutlass.Float32), batch, q_heads, splits)
    return out, lse
