"""Split-KV merge inside a launch: the last CTA of a (sequence, KV head) to finish merges.

The CTAs of a launch that share one (sequence, KV head) each write a normalized fp32 partial
``(o_s, lse_s)`` (``foscar.softmax`` conventions) next to partials that earlier launches on the
stream wrote. Then each counts itself done on a per-(sequence, KV head) counter in global memory;
the CTA that brings the count to the launch's CTAs per (sequence, KV head) merges all partials into
the final output (the exact merge of ``foscar.kernels.combine``) and sets the counter back to 0, so
the next launch (or CUDA-graph replay) finds it zeroed. No combine launch, no host sync: the
counters are a persistent workspace zeroed once when allocated.

Work-list partials (:meth:`SplitMerge.merge_items`) merge in two levels past ``TWO_LEVELS_PAST`` parts: the last
CTA of each group of ``GROUP`` consecutive parts merges its group into the group's first partial (fp32, in place),
and whichever group-merging CTA counts last on the (sequence, KV head)'s counter merges the groups. One CTA alone reading 64 partials (256 KB at 8 query rows x 128
channels) reads in 8 rounds of loads; two levels read in 2 + 1 but pay a second fence, count and lse round
(benchmarks/NOTES.md section 28: faster at 64 parts, slower at 16). A group's merge loads ``BATCH / 2`` partials at
once: with all of ``BATCH`` the Hopper cache decode spilled a register. The group counters follow the (sequence,
KV head) counters: :func:`counter_words` sizes the workspace.

Memory ordering (PTX memory model, the "last block" pattern of the CUDA reduction samples):
every thread fences (gpu scope) after its partial stores, the CTA's threads meet at a barrier,
one thread does the counting atomic (acq_rel, gpu scope); the last CTA's threads fence again
before reading the other CTAs' partials.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.pipeline import NamedBarrier

from .device import NEG_INF, at, fsel, store
from .softmax import finite_reference, lse_weight, merged_lse
from .work_list import GROUP, MAX_SPLITS

__all__ = ["CacheOutput", "SplitMerge", "PartialSum", "row_lse", "VEC", "BATCH", "LSE_LOADS", "GROUP",
           "TWO_LEVELS_PAST", "counter_words"]


VEC = 4  # fp32 channels a thread loads at once (16 bytes)
BATCH = 8  # partials a thread loads before it uses the first
LSE_LOADS = 4  # lses a lane loads before it uses the first: one round trip covers 128 partials
TWO_LEVELS_PAST = 2 * GROUP  # parts up to this merge in one level (see the module docstring)


def counter_words(heads: int, max_parts: int) -> int:
    """Int32 completion counters for ``heads`` (sequence, KV head)s of at most ``max_parts`` parts each: one per
    (sequence, KV head), then ``ceil(max_parts / GROUP)`` group counters each."""
    return heads * (1 + -(-max_parts // GROUP))


@cute.jit
def row_lse(lse_row: cute.Tensor, count: Int32, lane: Int32):
    """One warp's ``(reference, weights)`` of a row's ``count`` partial lses ``lse_row (count,)``: their max and
    ``sum_s exp(lse_s - max)`` (0 when all are empty: max -inf). Each lane loads ``LSE_LOADS`` lses at once and keeps a
    running max and a sum rescaled to it, so up to ``32 * LSE_LOADS`` partials cost one round trip of memory latency
    (a max loop then a sum loop of one load per lane cost two per 32 partials)."""
    m = Float32(NEG_INF)
    weights = Float32(0.0)
    for base in cutlass.range(lane, count, 32 * LSE_LOADS, unroll=1):
        lses = [None] * LSE_LOADS
        for k in cutlass.range_constexpr(LSE_LOADS):
            lses[k] = lse_row[cutlass.min(base + 32 * k, count - 1)]
        top = m
        for k in cutlass.range_constexpr(LSE_LOADS):
            lses[k] = fsel(base + 32 * k < count, lses[k], Float32(NEG_INF))
            top = cute.arch.fmax(top, lses[k])
        reference = finite_reference(top)
        weights = weights * lse_weight(m, reference)  # 0 while m is -inf
        for k in cutlass.range_constexpr(LSE_LOADS):
            weights = weights + lse_weight(lses[k], reference)  # 0 for an empty partial
        m = top
    top = cute.arch.warp_reduction_max(m)
    weights = cute.arch.warp_reduction_sum(weights * lse_weight(m, finite_reference(top)))
    return top, weights


class PartialSum:
    """The weighted sum at the heart of every split merge (here and ``foscar.kernels.combine``):
    ``acc[i] += sum_s exp(lse_s - reference) * o[s, VEC*vec + i]`` over partials ``s = first,
    first + step, ... < count`` of one row. ``BATCH`` partials' loads issue before the first is used
    (a partial after the last is clamped and masked), so a row's partials cost a few round trips of
    memory latency, not one per partial; an empty partial (lse -inf) adds 0 whatever its o holds."""

    @cute.jit
    def accumulate(self, acc: cute.Tensor, o_row: cute.Tensor, lse_row: cute.Tensor, reference: Float32, vec: Int32,
                   first: Int32, step: Int32, count: Int32, batch: int = BATCH):
        """``acc`` fp32 (VEC,) registers; ``o_row`` fp32 (count, D); ``lse_row`` (count,); ``batch``: partials whose
        loads issue at once (``BATCH``)."""
        for base in cutlass.range(first, count, step * batch, unroll=1):
            parts = [cute.make_rmem_tensor((VEC,), Float32) for _ in range(batch)]
            lses = [None] * batch
            for k in cutlass.range_constexpr(batch):
                s = cutlass.min(base + k * step, count - 1)
                lses[k] = lse_row[s]
                # ((VEC), (D / VEC))
                cute.autovec_copy(cute.zipped_divide(o_row[s, None], (VEC,))[None, vec], parts[k])
            for k in cutlass.range_constexpr(batch):
                lse_s = fsel(base + k * step < count, lses[k], Float32(NEG_INF))
                weight = lse_weight(lse_s, reference)
                for i in cutlass.range_constexpr(VEC):
                    acc[i] += fsel(lse_s > Float32(NEG_INF), weight * parts[k][i], Float32(0.0))


@dataclass(frozen=True)
class CacheOutput:
    """Where a cache decode's result goes (both arches'): the output ``out [B, Hq, D]`` (q dtype) and ``lse [B,
    Hq]``, the fp32 partials ``o_part``, ``lse_part`` (one launch: per work item, ``[items, R, D]`` and ``[items,
    R]``; Hopper's two launches: row-major ``[B, Hq, parts, D]``, ``[B, Hq, parts]``), and the completion
    ``counters`` (int32: one per (sequence, KV head), ``heads`` = B x kv_heads of them, then the group counters:
    :func:`counter_words`)."""

    o_part: cute.Pointer
    lse_part: cute.Pointer
    out: cute.Pointer
    lse: cute.Pointer
    counters: cute.Pointer
    heads: Int32

class SplitMerge:
    """Device side, for ``threads`` threads (``threads / 32`` warps) of a CTA that meet at named
    barrier ``barrier_id``: ``arrive`` (am I last?) and ``merge`` (the R query columns x D channels of one
    (sequence, KV head), ``query``: ``foscar.query_rows.QueryRows``, from any number of partials)."""

    def __init__(self, head_dim: int, query, threads: int, barrier_id: int, out_dtype, max_parts: int = MAX_SPLITS):
        rows = query.R
        self.groups_per_head = -(-max_parts // GROUP)  # group counters per (sequence, KV head): counter_words
        self.D, self.R, self.query = head_dim, rows, query
        self.threads = threads
        self.warps = threads // 32
        self.barrier = NamedBarrier(barrier_id, threads)
        self.out_dtype = out_dtype
        # shared scratch of merge (fp32 words): row max [R] | row weight sum [R]
        self.M, self.L = 0, rows
        self.scratch_words = 2 * rows
        self.partial_sum = PartialSum()

    def _barrier(self):
        self.barrier.arrive_and_wait()

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

    def row_major(self, o_part: cute.Pointer, lse_part: cute.Pointer, row0, kv_heads: Int32, total: Int32):
        """(o, lse) partials of the R columns (column 0's row ``row0``, Int64; ``query.offset`` apart) held
        row-major as ``o [rows, total, D]``, ``lse [rows, total]``: ``(R, total, D)`` and ``(R, total)`` tensors
        for :meth:`merge` (several tokens: the column mode is (gqa, tokens), its tokens ``kv_heads * gqa``
        rows apart)."""
        D, R, q = self.D, self.R, self.query
        if cutlass.const_expr(q.tokens == 1):
            return (cute.make_tensor(o_part + row0 * total * D, cute.make_ordered_layout((R, total, D), (2, 1, 0))),
                    cute.make_tensor(lse_part + row0 * total, cute.make_ordered_layout((R, total), (1, 0))))
        token_rows = kv_heads * q.gqa * total  # lse elements from a column to the same head's next token
        cols = (q.gqa, q.tokens)
        return (cute.make_tensor(o_part + row0 * total * D,
                                 cute.make_layout((cols, total, D), stride=((total * D, token_rows * D), D, 1))),
                cute.make_tensor(lse_part + row0 * total, cute.make_layout((cols, total), stride=((total, token_rows), 1))))

    def item_major(self, o_part: cute.Pointer, lse_part: cute.Pointer, item0: Int32, total: Int32, step=1):
        """The same for partials held per work item (``foscar.work_list``): ``o [items, R, D]``,
        ``lse [items, R]``, ``total`` items ``item0, item0 + step, ...``."""
        D, R = self.D, self.R
        first = item0.to(Int64) * R
        return (cute.make_tensor(o_part + first * D, cute.make_layout((R, total, D), stride=(D, step * R * D, 1))),
                cute.make_tensor(lse_part + first, cute.make_layout((R, total), stride=(1, step * R))))

    @cute.jit
    def merge_items(self, scratch: cute.Pointer, flag: cute.Pointer, output: CacheOutput, head: Int32, item0: Int32,
                    part: Int32, parts: Int32, row0, kv_heads: Int32, tc: Int32):
        """After this CTA wrote work item ``item0 + part``'s partial into ``output``: count it, and merge where it was
        the last (see the module docstring). ``head``: the (sequence, KV head)'s index of ``output.heads`` (its
        counter; its group counters follow all ``heads`` counters); the rest as :meth:`merge`."""
        counters, heads = output.counters, output.heads
        o_part, lse_part, out, lse = output.o_part, output.lse_part, output.out, output.lse
        counts = Int32(1)  # whether this CTA counts on the (sequence, KV head)'s counter: a part, or a group
        inputs, step = parts, Int32(1)  # what the last to count there merges: items item0, item0 + step, ...
        if parts > TWO_LEVELS_PAST:
            group = part // GROUP
            first = item0 + group * GROUP
            members = cutlass.min(parts - group * GROUP, GROUP)
            counts = Int32(0)
            if self.arrive(counters + (heads + head * self.groups_per_head + group), flag, members, tc):
                at0 = first.to(Int64) * self.R
                self.merge(scratch, lambda: self.item_major(o_part, lse_part, first, members), o_part + at0 * self.D,
                           lse_part + at0, Int64(0), kv_heads, members, tc, partial=True)
                counts = Int32(1)
            inputs, step = (parts + GROUP - 1) // GROUP, Int32(GROUP)
        if counts != 0:
            if self.arrive(counters + head, flag, inputs, tc):
                self.merge(scratch, lambda: self.item_major(o_part, lse_part, item0, inputs, step), out, lse, row0,
                           kv_heads, inputs, tc)

    @cute.jit
    def merge(self, scratch: cute.Pointer, partials, out: cute.Pointer, lse: cute.Pointer, row0, kv_heads: Int32,
              total: Int32, tc: Int32, partial: bool = False):
        """Column ``r``'s ``out[row, d]`` (``out_dtype``) and ``lse[row]`` (``row = row0 + query.offset(r,
        kv_heads)``, ``row0`` Int64: column 0's) from the ``total`` partials of the R columns:
        ``partials()`` gives them as ``o_rows (R, total, D)``,
        ``lse_rows (R, total)`` (:meth:`row_major`, :meth:`item_major`), built after the acquire fence.
        Two rounds: each row's max lse and weight sum (a warp per row, its lanes over the partials),
        then 4 output channels per thread (``PartialSum``: a batch of partials' loads in flight).
        ``partial``: write a work item's fp32 partial instead (``out [R, D]``, ``lse [R]``), which may be one of
        the partials read: each thread rewrites only the channels it read, and the lses once all are read."""
        cute.arch.fence_acq_rel_gpu()  # acquire: the other CTAs' partials, not stale lines
        D, R = self.D, self.R
        w = cute.make_tensor(cute.recast_ptr(scratch, dtype=Float32), cute.make_layout((self.scratch_words,)))
        o_rows, lse_rows = partials()  # (R, total, D): the rows' partials; (R, total): their lses
        warp, lane = tc // 32, tc % 32
        for r in cutlass.range(warp, R, self.warps, unroll=1):
            m, weights = row_lse(lse_rows[r, None], total, lane)
            if lane == 0:
                w[self.M + r] = m
                w[self.L + r] = weights
        self._barrier()
        vecs = D // VEC
        # (R * D,): the outputs (one token: R consecutive rows)
        out_rows = cute.make_tensor(out + row0 * D, cute.make_layout((R * D,)))
        offset = self.query.offset  # (a method of a local object is not called inside a runtime loop)
        for unit in cutlass.range(tc, R * vecs, self.threads, unroll=1):
            r, vec = unit // vecs, unit % vecs
            acc = cute.make_rmem_tensor((VEC,), Float32)
            acc.fill(0.0)
            self.partial_sum.accumulate(acc, o_rows[r, None, None], lse_rows[r, None], w[self.M + r], vec, 0, 1,
                                        total, BATCH // 2 if partial else BATCH)
            weights = w[self.L + r]
            inv = fsel(weights > Float32(0.0), cute.arch.rcp_approx(weights), Float32(0.0))
            out_dtype = Float32 if cutlass.const_expr(partial) else self.out_dtype
            result = cute.make_rmem_tensor((VEC,), out_dtype)
            result.store((acc.load() * inv).to(out_dtype))
            if cutlass.const_expr(partial or self.query.tokens == 1):
                # ((VEC), (R * D / VEC))
                cute.autovec_copy(result, cute.zipped_divide(out_rows, (VEC,))[None, unit])
            else:  # the column's row: (VEC,) at channel VEC * vec
                dst = out + cute.assume((row0 + offset(r, kv_heads)) * D + vec * VEC, divby=VEC)
                cute.autovec_copy(result, cute.make_tensor(dst, cute.make_layout((VEC,))))
            if cutlass.const_expr(not partial):
                if vec == 0:
                    store(lse, row0 + offset(r, kv_heads), merged_lse(w[self.M + r], weights))
        if cutlass.const_expr(partial):
            self._barrier()  # every thread has read the lses
            for r in cutlass.range(tc, R, self.threads, unroll=1):
                store(lse, r, merged_lse(w[self.M + r], w[self.L + r]))
