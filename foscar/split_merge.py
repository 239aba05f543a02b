"""Split-KV merge inside the decode launch: the last CTA of a (sequence, KV head) to finish merges.

The CTAs that share one (sequence, KV head) -- the quantized splits and the BF16 sink + window
chunks -- each write a normalized fp32 partial ``(o_s, lse_s)`` (``foscar.softmax`` conventions).
Then each counts itself done on a per-(sequence, KV head) counter in global memory; the CTA that
brings the count to ``total`` merges all partials into the final output (the exact merge of
``foscar.kernels.combine``) and sets the counter back to 0, so the next launch (or CUDA-graph
replay) finds it zeroed. One launch instead of decode + combine (+ window) launches, and no host
sync: the counters are a persistent workspace zeroed once when allocated.

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
    """Device side, for ``threads`` threads of a CTA that meet at named barrier ``barrier_id``:
    ``arrive`` (am I last?) and ``merge`` (R query rows x D channels of one (sequence, KV head))."""

    def __init__(self, head_dim: int, rows: int, threads: int, barrier_id: int, out_dtype):
        self.D = head_dim
        self.R = rows
        self.threads = threads
        self.barrier_id = barrier_id
        self.out_dtype = out_dtype

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
    def merge(self, o_part: cute.Pointer, lse_part: cute.Pointer, out: cute.Pointer, lse: cute.Pointer, row0,
              total: Int32, tc: Int32):
        """``out[row0 + r, d]`` (``out_dtype``) and ``lse[row0 + r]`` from the partials
        ``o_part [.., total, D]`` / ``lse_part [.., total]`` of rows ``row0 .. row0 + R - 1`` (Int64),
        one element per thread and pass."""
        cute.arch.fence_acq_rel_gpu()  # acquire: the other CTAs' partials, not stale lines
        D = self.D
        for el in cutlass.range(tc, self.R * D, self.threads, unroll=1):
            row = row0 + el // D
            d = el % D
            m = Float32(NEG_INF)
            for s in cutlass.range(total, unroll=1):
                m = cute.arch.fmax(m, at(lse_part, row * total + s))
            weights = Float32(0.0)
            acc = Float32(0.0)
            if m > Float32(NEG_INF):
                for s in cutlass.range(total, unroll=1):
                    lse_s = at(lse_part, row * total + s)
                    if lse_s > Float32(NEG_INF):  # an empty split's o is not read
                        w = lse_weight(lse_s, m)
                        weights = weights + w
                        acc = acc + w * at(o_part, (row * total + s) * D + d)
            inv = cutlass.select_(weights > Float32(0.0), cute.arch.rcp_approx(weights), Float32(0.0))
            store(out, row * D + d, (acc * inv).to(self.out_dtype))
            if d == 0:
                store(lse, row, merged_lse(m, weights))


def at(ptr: cute.Pointer, idx):
    """``ptr[idx]``."""
    return cute.make_tensor(ptr + idx, cute.make_layout((1,)))[0]


def store(ptr: cute.Pointer, idx, value):
    """``ptr[idx] = value``."""
    cute.make_tensor(ptr + idx, cute.make_layout((1,)))[0] = value
