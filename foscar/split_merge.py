"""Split-KV merge inside a launch: the last CTA of a (sequence, KV head) to finish merges.

The CTAs of a launch that share one (sequence, KV head) each write a normalized fp32 partial
``(o_s, lse_s)`` (``foscar.softmax`` conventions) next to partials that earlier launches on the
stream wrote. Then each counts itself done on a per-(sequence, KV head) counter in global memory;
the CTA that brings the count to the launch's CTAs per (sequence, KV head) merges all partials into
the final output (the exact merge of ``foscar.kernels.combine``) and sets the counter back to 0, so
the next launch (or CUDA-graph replay) finds it zeroed. No combine launch, no host sync: the
counters are a persistent workspace zeroed once when allocated.

Memory ordering (PTX memory model, the "last block" pattern of the CUDA reduction samples):
every thread fences (gpu scope) after its partial stores, the CTA's threads meet at a barrier,
one thread does the counting atomic (acq_rel, gpu scope); the last CTA's threads fence again
before reading the other CTAs' partials.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .device import NEG_INF
from .softmax import lse_weight, merged_lse

__all__ = ["SplitMerge"]


class SplitMerge:
    """Device side, for ``threads`` threads (``threads / 32`` warps) of a CTA that meet at named
    barrier ``barrier_id``: ``arrive`` (am I last?) and ``merge`` (R query rows x D channels of one
    (sequence, KV head), from at most ``max_partials`` partials each)."""

    def __init__(self, head_dim: int, rows: int, max_partials: int, threads: int, barrier_id: int, out_dtype):
        self.D, self.R = head_dim, rows
        self.max_partials = max_partials
        self.threads = threads
        self.warps = threads // 32
        self.barrier_id = barrier_id
        self.out_dtype = out_dtype
        # shared scratch of merge (fp32 words): weights [R, max_partials] | row max [R] | row weight sum [R]
        self.W, self.M, self.L = 0, rows * max_partials, rows * max_partials + rows
        self.scratch_words = rows * max_partials + 2 * rows

    def _barrier(self):
        cute.arch.barrier(barrier_id=self.barrier_id, number_of_threads=self.threads)

    @cute.jit
    def arrive(self, counter: cute.Pointer, flag: cute.Pointer, total: Int32, tc: Int32):
        """Count this CTA's partial as written; returns whether it was the last of ``total``.
        ``counter``: the (sequence, KV head)'s int32 in global memory; ``flag``: one shared int32."""
        cute.arch.fence_acq_rel_gpu()  # release: this thread's partial stores before the count
        self._barrier()
        if tc == 0:
            old = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
            last = old == total - 1
            store(flag, 0, Int32(last))
            if last:  # every other CTA has counted: reset for the next launch
                store(counter, 0, Int32(0))
        self._barrier()
        return at(flag, 0) != Int32(0)

    @cute.jit
    def merge(self, scratch: cute.Pointer, o_part: cute.Pointer, lse_part: cute.Pointer, out: cute.Pointer,
              lse: cute.Pointer, row0, total: Int32, tc: Int32):
        """``out[row0 + r, d]`` (``out_dtype``) and ``lse[row0 + r]`` from the partials
        ``o_part [.., total, D]`` / ``lse_part [.., total]`` of rows ``row0 .. row0 + R - 1`` (Int64).
        Three rounds, each a parallel load: every partial's lse (one per thread), each row's weights
        (a warp per row, in shared memory), then one output element per thread and pass."""
        cute.arch.fence_acq_rel_gpu()  # acquire: the other CTAs' partials, not stale lines
        D, R, P = self.D, self.R, self.max_partials
        w = cute.make_tensor(cute.recast_ptr(scratch, dtype=Float32), cute.make_layout((self.scratch_words,)))
        for idx in cutlass.range(tc, R * total, self.threads, unroll=1):
            w[self.W + (idx // total) * P + idx % total] = at(lse_part, row0 * total + idx)
        self._barrier()
        warp, lane = tc // 32, tc % 32
        for r in cutlass.range(warp, R, self.warps, unroll=1):
            m = Float32(NEG_INF)
            for s in cutlass.range(lane, total, 32, unroll=1):
                m = cute.arch.fmax(m, w[self.W + r * P + s])
            m = cute.arch.warp_reduction_max(m)
            weights = Float32(0.0)
            for s in cutlass.range(lane, total, 32, unroll=1):
                lse_s = w[self.W + r * P + s]  # an empty partial (-inf) weighs 0 and its o is not read
                ws = cutlass.select_(lse_s > Float32(NEG_INF), lse_weight(lse_s, m), Float32(0.0))
                w[self.W + r * P + s] = ws
                weights = weights + ws
            weights = cute.arch.warp_reduction_sum(weights)
            if lane == 0:
                w[self.M + r] = m
                w[self.L + r] = weights
        self._barrier()
        for el in cutlass.range(tc, R * D, self.threads, unroll=1):
            r = el // D
            d = el % D
            acc = Float32(0.0)
            for s in cutlass.range(total, unroll=4):
                ws = w[self.W + r * P + s]
                o_s = at(o_part, ((row0 + r) * total + s) * D + d)
                acc = acc + ws * cutlass.select_(ws > Float32(0.0), o_s, Float32(0.0))
            weights = w[self.L + r]
            inv = cutlass.select_(weights > Float32(0.0), cute.arch.rcp_approx(weights), Float32(0.0))
            store(out, (row0 + r) * D + d, (acc * inv).to(self.out_dtype))
            if d == 0:
                store(lse, row0 + r, merged_lse(w[self.M + r], weights))


def at(ptr: cute.Pointer, idx):
    """``ptr[idx]``."""
    return cute.make_tensor(ptr + idx, cute.make_layout((1,)))[0]


def store(ptr: cute.Pointer, idx, value):
    """``ptr[idx] = value``."""
    cute.make_tensor(ptr + idx, cute.make_layout((1,)))[0] = value
