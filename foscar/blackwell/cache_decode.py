"""The decode launch of ``foscar.cache.PagedKVCache`` (sm_100a): packed pages, the 16-bit sink + window
blocks and the split merge, in one launch, planned as Hopper's (``foscar.hopper.cache_decode``).

A 1-D grid of work items (``foscar.work_list``: each (sequence, KV head) cut into ``parts`` by its work,
``foscar.work_list.CacheWork``, the same plan as Hopper's for the same batch): all 512 threads of CTA ``x``
find its item (``WorkList.find``, into shared words that each role reads again after the role dispatch:
``foscar.blackwell.sequence.PlannedSequence``), then the CTA is the decode kernel's (``foscar.blackwell.kernel``:
four warpgroup roles, tcgen05 MMAs) over part ``x`` of the (sequence, KV head)'s packed steps, and its
preparation warpgroup attends the window blocks ``part, part + parts, ...`` after its last packed step
(``foscar.blackwell.window``: ``mma.sync`` in the window's 16-bit type over the shared ``foscar.window_tiles``
operands). The output warpgroup's epilogue merges the two ``(O, m, l)`` (log2 domain, exact) and writes the
output (one part) or the item's normalized fp32 partial (``[items, R, D]``); with several parts the last CTA
of the (sequence, KV head) merges them (``foscar.split_merge``: the cache's completion counters, left zero),
in the output warpgroup. Every window byte is read once per KV head, in the same launch, as on Hopper.

Every config fits: the window's shared memory (at most ~25 KB at head_dim 256) comes out of the ring, which
then keeps fewer stages (``BlackwellConfig``), so there is no two-launch fallback (Hopper's, where a ring of
window-sized stages does not fit, uses ``foscar.kernels.sink_window``). The cache's tensors are read in
place: one launch, CUDA-graph capturable. Its pages must be in the Blackwell word order (the cache's append
kernel writes its arch's order). Compile-verified only (no Blackwell GPU here).
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.pipeline import NamedBarrier

from ..barriers import BlackwellDecodeBarrier
from ..device import LOG2E
from ..jit import half_type
from ..kernels.quantize import granule_of
from ..pipeline import PackedPages
from ..query_rows import KvHead, Output
from ..softmax import finite_reference, normalize
from ..split_merge import SplitMerge
from ..window_tiles import WindowOperands
from ..work_list import MAX_SPLITS, CacheWork, WorkList
from . import storage as sm_
from .kernel import BlackwellConfig, BlackwellDecodeKernel, MmaSetup
from .primitives import WG, scalar
from .sequence import PlannedHead, PlannedSequence
from .window import PrepWindow, WindowSlots, cache_areas, cache_bytes

__all__ = ["BlackwellCacheDecodeKernel", "cache_decode_config"]


def cache_decode_config(scheme, page_size: int, tokens: int = 1) -> BlackwellConfig:
    """The split-output config with the window blocks' shared memory (``foscar.blackwell.window``)."""
    rows = BlackwellConfig(scheme, page_size, True, tokens).rows  # raises what the variant cannot build
    return BlackwellConfig(scheme, page_size, True, tokens, window=WindowOperands(scheme.head_dim, rows,
                                                                                  half_type(scheme.q_dtype)))


@dataclass(frozen=True)
class CacheOutput:
    """What the epilogue reads and where its result goes: the output ``out [B, Hq, D]`` (q dtype) and ``lse [B,
    Hq]``, the per-item fp32 partials ``o_part [items, R, D]``, ``lse_part [items, R]``, the completion
    ``counters`` (int32, one per (sequence, KV head)); in shared memory the window's result (``win_o``: O [R, D]
    fp32, ``win_ml``: m [N] | l [N]) and the merge's scratch and flag (``foscar.blackwell.window.cache_words``)."""

    o_part: cute.Pointer
    lse_part: cute.Pointer
    out: cute.Pointer
    lse: cute.Pointer
    counters: cute.Pointer
    win_o: cute.Pointer
    win_ml: cute.Pointer
    merge: cute.Pointer
    last: cute.Pointer


class BlackwellCacheDecodeKernel(BlackwellDecodeKernel):
    """See the module docstring; ``cfg`` from :func:`cache_decode_config`."""

    def __init__(self, cfg: BlackwellConfig):
        if not cfg.split or cfg.window is None:
            raise ValueError("the cache decode kernel needs a split-output BlackwellConfig with the window's shared "
                             "memory (cache_decode_config)")
        super().__init__(cfg)
        self.granule = granule_of(cfg.scheme)
        self.work = WorkList(cfg.threads, MAX_SPLITS)
        self.cache_work = CacheWork(cfg.STAGE_BYTES, cfg.D, self.granule)
        self.window = PrepWindow(cfg)
        self.merger = SplitMerge(cfg.D, cfg.rows, WG, BlackwellDecodeBarrier.MERGE, cfg.q_dtype)

    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer,  # [B, Hq, D] q dtype
        kc_ptr: cute.Pointer,  # the layer's packed pages, as BlackwellDecodeKernel
        kp_ptr: cute.Pointer,
        vc_ptr: cute.Pointer,
        vp_ptr: cute.Pointer,
        pt_ptr: cute.Pointer,  # int32 [max_seqs, max_pages]
        seq_rows: cute.Pointer,  # int64 [B]: the sequences' rows
        seq_lengths: cute.Pointer,  # int64 [max_seqs]: tokens per sequence (this layer)
        k_win: cute.Pointer,  # [max_seqs, kv_heads, sink + ring, D] q dtype: the 16-bit slots
        v_win: cute.Pointer,
        o_part: cute.Pointer,  # fp32 [grid_ctas, R, D]: per work item
        lse_part: cute.Pointer,  # fp32 [grid_ctas, R]
        out: cute.Pointer,  # [B, Hq, D] q dtype
        lse: cute.Pointer,  # fp32 [B, Hq]
        counters: cute.Pointer,  # int32 [>= B * kv_heads], zero (left zero)
        batch: Int32,
        kv_heads: Int32,
        max_pages: Int32,
        budget: Int32,  # the CTAs of a wave, which the work list fills (foscar.work_list)
        sink: Int32,
        ring: Int32,
        window: Int32,
        sm_scale: Float32,
        stream: cuda.CUstream,
    ):
        mmas = self.mmas_and_layouts()
        SharedStorage = self.shared_storage(*mmas[3:])
        self.launch(self.kernel(*mmas, SharedStorage, q_ptr, kc_ptr, kp_ptr, vc_ptr, vp_ptr, pt_ptr, seq_rows,
                                seq_lengths, k_win, v_win, o_part, lse_part, out, lse, counters, batch, kv_heads,
                                max_pages, budget, sink, ring, window, sm_scale * LOG2E),
                    (budget + batch * kv_heads, 1, 1),  # foscar.work_list.grid_ctas
                    SharedStorage.size_in_bytes() + cache_bytes(self.cfg.window), stream)

    @cute.kernel
    def kernel(self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, desc_mma: cute.TiledMma,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, sQ_layout: cute.ComposedLayout,
               sP_layout: cute.ComposedLayout, SharedStorage: cutlass.Constexpr, q_ptr: cute.Pointer,
               kc_ptr: cute.Pointer, kp_ptr: cute.Pointer, vc_ptr: cute.Pointer, vp_ptr: cute.Pointer,
               pt_ptr: cute.Pointer, seq_rows: cute.Pointer, seq_lengths: cute.Pointer, k_win: cute.Pointer,
               v_win: cute.Pointer, o_part: cute.Pointer, lse_part: cute.Pointer, out: cute.Pointer,
               lse: cute.Pointer, counters: cute.Pointer, batch: Int32, kv_heads: Int32, max_pages: Int32,
               budget: Int32, sink: Int32, ring: Int32, window: Int32, scale_log2: Float32):
        x, _, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        # the cache decode's areas apart from the decode's SharedStorage, which run() allocates: inside the runtime
        # `if` below, so the ring's and operands' addresses stay constants (allocated here, the prep warpgroup's
        # hoisted operand addresses spilled at head_dim 256)
        areas = cutlass.memory.SmemAllocator().allocate(cache_areas(self.cfg.window))
        pages = PackedPages(kc_ptr, kp_ptr, vc_ptr, vp_ptr, pt_ptr, max_pages)
        slots = WindowSlots(k_win, v_win, sink, ring, window)
        win_units = self.cache_work.window_units(slots.sink, slots.ring)
        work_of = lambda b: self.cache_work.sequence(seq_rows, seq_lengths, b, slots.sink, slots.window,  # noqa: E731
                                                     win_units)
        *_item, valid = self.work.find(x, batch, kv_heads, budget, work_of, areas.plan.data_ptr(), tidx)
        if valid:  # (CTAs past the last item exit)
            self.attend_item(MmaSetup(mma_qk, mma_pv, desc_mma, sK_layout, sV_layout, sQ_layout, sP_layout),
                             SharedStorage, areas, q_ptr, pages, slots,
                             CacheOutput(o_part, lse_part, out, lse, counters, areas.win_kv.data_ptr(),
                                         areas.win_ml.data_ptr(), areas.merge.data_ptr(), areas.last.data_ptr()),
                             kv_heads, scale_log2)

    @cute.jit
    def attend_item(self, mmas: MmaSetup, SharedStorage, areas, q_ptr: cute.Pointer, pages: PackedPages,
                    slots: WindowSlots, out: CacheOutput, kv_heads: Int32, scale_log2: Float32):
        """The decode CTA (``BlackwellDecodeKernel.run``) over the item the work list planned into ``areas``."""
        seq = PlannedSequence(self.work, areas, pages.page_table, pages.max_pages, slots, self.granule)
        self.run(mmas, SharedStorage, q_ptr, pages, out, PlannedHead(self.work, areas.plan.data_ptr(), kv_heads),
                 scale_log2, seq)

    @cute.jit
    def prep(self, sm, storage, mmas: MmaSetup, ch, q_ptr: cute.Pointer, seq, head: KvHead, scale_log2: Float32, t,
             lane, wq, nd: cutlass.Constexpr):
        """The preparation warpgroup: the packed steps' operands, then the window blocks."""
        BlackwellDecodeKernel.prep(self, sm, storage, mmas, ch, q_ptr, seq, head, scale_log2, t, lane, wq, nd)
        self.window.attend(seq, q_ptr, head.kv_heads, scale_log2)

    @cute.jit
    def epilogue(self, sm, accO, out: CacheOutput, head: KvHead, seq, t):
        """Once the window's (O, m, l) are in shared memory: the output (one part) or the item's partial, and
        with several parts the last CTA's merge."""
        NamedBarrier(BlackwellDecodeBarrier.WINDOW, 2 * WG).arrive_and_wait()
        _b, _h, part, parts, item0, _facts, _valid = seq.item()
        q_row0 = self.cfg.rows.first(head.b, head.h, head.kv_heads)  # row of the KV head's query column 0
        if parts == 1:
            self.merge_window(sm, accO, out, Output(out.out, out.lse, False, part, parts), head, t)
        else:
            self.merge_window(sm, accO, out, Output(out.o_part, out.lse_part, True, part, parts, item0 + part), head,
                              t)
            if self.merger.arrive(out.counters + (head.b * head.kv_heads + head.h), out.last, parts, t):
                partials = lambda: self.merger.item_major(out.o_part, out.lse_part, item0, parts)  # noqa: E731
                self.merger.merge(out.merge, partials, out.out, out.lse, q_row0, head.kv_heads, parts, t)

    @cute.jit
    def merge_window(self, sm, accO, cache: CacheOutput, out: Output, head: KvHead, t):
        """The packed steps' (accO with the V hook's terms, l, m: ``sFinal``) and the window's (``cache``: O, m, l)
        merged per query row into ``out`` (thread t: channels t + DM * mt): ``o = O_p c_p + O_w c_w``, the
        weights ``c_x = 2^(m_x - m) / l`` from :meth:`merge_weights`."""
        cfg = self.cfg
        N, D, R = cfg.N, cfg.D, cfg.R
        o_ptr = out.o  # (``out`` named in an assignment in an `if`: a value the `if` writes)
        win_o = cute.make_tensor(cute.recast_ptr(cache.win_o, dtype=Float32), cute.make_layout((R * D,)))
        weights = self.merge_weights(sm, cache, out, head, t)
        for r in cutlass.range_constexpr(N):
            if r < R:
                obase, _lidx = out.offsets(cfg.rows, head, r, D)
                if t < cfg.DM:
                    for mt in cutlass.range_constexpr(cfg.MT):
                        d = mt * cfg.DM + t
                        val = self.vh.output_term(sm, accO[mt * N + r], d, r) * weights[r] + win_o[r * D + d] * weights[N + r]
                        if cutlass.const_expr(out.partial):
                            scalar(o_ptr, obase + d)[0] = val
                        else:
                            scalar(o_ptr, obase + d)[0] = val.to(cfg.q_dtype)

    @cute.jit
    def merge_weights(self, sm, cache: CacheOutput, out: Output, head: KvHead, t):
        """Thread ``r < R``: query row ``r``'s merged lse into ``out`` and the weights of the packed and window
        results, ``2^(m_p - m) / l`` and ``2^(m_w - m) / l`` (``m = max(m_p, m_w)``, ``l = l_p 2^(m_p - m) + l_w
        2^(m_w - m)``; 0 for a row that saw nothing), written over the window's m and l: returns them, ``[N + r]``
        the window's, once the output warpgroup has them all."""
        N = self.cfg.N
        win_ml = cute.make_tensor(cute.recast_ptr(cache.win_ml, dtype=Float32), cute.make_layout((2 * N,)))
        lse_ptr = out.lse
        _obase, lidx = out.offsets(self.cfg.rows, head, t, self.cfg.D)
        if t < self.cfg.R:
            m_p, m_w = sm.sFinal[sm_.final_m(t)], win_ml[t]
            m = cute.arch.fmax(m_p, m_w)
            reference = finite_reference(m)  # both empty: weights 0, l 0
            w_p, w_w = cute.arch.exp2(m_p - reference), cute.arch.exp2(m_w - reference)
            inv_l, lse = normalize(sm.sFinal[sm_.final_l(t)] * w_p + win_ml[N + t] * w_w, m, fastmath=False)
            scalar(lse_ptr, lidx)[0] = lse
            win_ml[t] = w_p * inv_l
            win_ml[N + t] = w_w * inv_l
        NamedBarrier(BlackwellDecodeBarrier.MERGE, WG).arrive_and_wait()
        return win_ml
