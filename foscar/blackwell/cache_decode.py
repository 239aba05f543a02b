"""The decode launch of ``foscar.cache.PagedKVCache`` (sm_100a): packed pages, the 16-bit sink + window
blocks and the split merge, in one launch, planned as Hopper's (``foscar.hopper.cache_decode``).

A 1-D grid of work items (``foscar.work_list``: each (sequence, KV head) cut into ``parts`` by its work,
``foscar.work_list.CacheWork``, the same plan as Hopper's for the same batch): all 512 threads of CTA ``x``
find its item (``WorkList.find``, into shared words that each role reads again after the role dispatch:
``foscar.blackwell.sequence.PlannedSequence``), then the CTA is the decode kernel's (``foscar.blackwell.kernel``:
four warpgroup roles, tcgen05 MMAs) over part ``x`` of the (sequence, KV head)'s packed steps, and its
softmax warpgroup attends the window blocks ``part, part + parts, ...`` after its last packed step
(``foscar.blackwell.window``: ``mma.sync`` in the window's 16-bit type over the shared ``foscar.window_tiles``
operands). The output warpgroup's epilogue writes the packed steps' normalized result and lse as the decode
does, into the ring (free once the last O is in), then merges it with the window's ``(O, m, l)`` (log2 domain,
exact) and writes the output (one part) or the item's normalized fp32 partial (``[items, R, D]``); with several
parts the last CTA of the (sequence, KV head) merges them (``foscar.split_merge``: the cache's completion
counters, left zero), in the output warpgroup. Every window byte is read once per KV head, in the same launch,
as on Hopper.

The window's shared memory (at most ~19 KB at head_dim 256) comes out of the ring, which then keeps fewer
stages (``BlackwellConfig``), so there is no two-launch fallback (Hopper's, where a ring of window-sized stages
does not fit, uses ``foscar.kernels.sink_window``); where several query tokens' columns leave no room, a launch
takes fewer tokens (``foscar.blackwell.decode``: ``max_query_tokens``) and the cache runs more launches. The
cache's tensors are read in place: one launch, CUDA-graph capturable. Its pages must be in the Blackwell word
order (the append kernel writes its arch's order). Compile-verified only (no Blackwell GPU here).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.pipeline import NamedBarrier

from ..barriers import BlackwellDecodeBarrier
from ..decode_kernel import CacheArgs, CacheDecodeBase
from ..device import LN2, LOG2E, fsel
from ..jit import half_type
from ..kernels.quantize import granule_of
from ..pipeline import PackedPages
from ..query_rows import KvHead, Output
from ..softmax import finite_reference, merged_lse
from ..split_merge import CacheOutput, SplitMerge
from ..window_tiles import WindowOperands, WindowSlots
from ..work_list import MAX_SPLITS, CacheWork, WorkList
from .kernel import BlackwellConfig, BlackwellDecodeKernel, MmaSetup
from .primitives import WG, scalar
from .sequence import PlannedHead, PlannedSequence, WindowQuery
from .window import WindowBlocks, cache_areas, cache_bytes

__all__ = ["BlackwellCacheDecodeKernel", "cache_decode_config"]


def cache_decode_config(scheme, page_size: int, tokens: int = 1) -> BlackwellConfig:
    """The split-output config with the window blocks' shared memory (``foscar.blackwell.window``); raises
    NotImplementedError where it does not fit (``foscar.blackwell.decode``'s ``max_query_tokens`` avoids that)."""
    rows = BlackwellConfig(scheme, page_size, True, tokens).rows  # raises what the variant cannot build
    cfg = BlackwellConfig(scheme, page_size, True, tokens, window=WindowOperands(scheme.head_dim, rows,
                                                                                half_type(scheme.q_dtype)))
    if cfg.RING * cfg.TILE_BYTES < 4 * (cfg.R * cfg.D + cfg.R):  # the epilogue's packed result over the ring
        raise NotImplementedError(f"{scheme.name}: a ring of {cfg.RING} x {cfg.TILE_BYTES} B is smaller than the "
                                  f"packed result ({cfg.R} x {cfg.D} fp32 and its lse)")
    return cfg


class BlackwellCacheDecodeKernel(CacheDecodeBase, BlackwellDecodeKernel):
    """See the module docstring; ``cfg`` from :func:`cache_decode_config`."""

    def __init__(self, cfg: BlackwellConfig):
        if not cfg.split or cfg.window is None:
            raise ValueError("the cache decode kernel needs a split-output BlackwellConfig with the window's shared "
                             "memory (cache_decode_config)")
        super().__init__(cfg)
        self.granule = granule_of(cfg.scheme)
        self.work = WorkList(cfg.threads, MAX_SPLITS)
        self.cache_work = CacheWork(cfg.TILE_BYTES, cfg.D, self.granule)
        self.window = WindowBlocks(cfg)
        self.merger = SplitMerge(cfg.D, cfg.rows, WG, BlackwellDecodeBarrier.MERGE, cfg.q_dtype, MAX_SPLITS)

    def launch_cache(self, args: CacheArgs, stream: cuda.CUstream):
        """One CTA per work item (``foscar.work_list.grid_ctas``)."""
        mmas = self.mmas_and_layouts()
        SharedStorage = self.shared_storage(*mmas[3:])
        self.launch(self.kernel(*mmas, SharedStorage, args), (args.budget + args.batch * args.kv_heads, 1, 1),
                    SharedStorage.size_in_bytes() + cache_bytes(self.cfg.window), stream)

    @cute.kernel
    def kernel(self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, desc_mma: cute.TiledMma,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, sQ_layout: cute.ComposedLayout,
               sP_layout: cute.ComposedLayout, SharedStorage: cutlass.Constexpr, args: CacheArgs):
        x, _, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        # the cache decode's areas, apart from the decode's SharedStorage, which run() allocates as in the decode
        # kernel (the work list needs its plan words before the role dispatch)
        areas = cutlass.memory.SmemAllocator().allocate(cache_areas(self.cfg.window))
        slots = args.slots
        win_units = self.cache_work.window_units(slots.sink, slots.ring)
        work_of = lambda b: self.cache_work.sequence(args.seq_rows, args.seq_lengths, b, slots.sink,  # noqa: E731
                                                     slots.window, win_units)
        *_item, valid = self.work.find(x, args.batch, args.kv_heads, args.budget, work_of, areas.plan.data_ptr(), tidx)
        if valid:  # (CTAs past the last item exit)
            self.attend_item(MmaSetup(mma_qk, mma_pv, desc_mma, sK_layout, sV_layout, sQ_layout, sP_layout),
                             SharedStorage, areas, args.q, args.pages, slots, args.output, args.kv_heads,
                             args.scale_log2)

    @cute.jit
    def attend_item(self, mmas: MmaSetup, SharedStorage, areas, q_ptr: cute.Pointer, pages: PackedPages,
                    slots: WindowSlots, out: CacheOutput, kv_heads: Int32, scale_log2: Float32):
        """The decode CTA (``BlackwellDecodeKernel.run``) over the item the work list planned into ``areas``."""
        seq = PlannedSequence(self.work, areas, pages.page_table, pages.max_pages, slots, self.granule,
                              WindowQuery(q_ptr, kv_heads, scale_log2))
        self.run(mmas, SharedStorage, q_ptr, pages, out, PlannedHead(self.work, areas.plan.data_ptr(), kv_heads),
                 scale_log2, seq)

    @cute.jit
    def softmax(self, sm, ch, seq, t, lane, wq, tmem_holder, acc_layout, nd: cutlass.Constexpr):
        """The softmax warpgroup: the packed steps, then the window blocks (``foscar.blackwell.window``)."""
        BlackwellDecodeKernel.softmax(self, sm, ch, seq, t, lane, wq, tmem_holder, acc_layout, nd)
        query = seq.query
        self.window.attend(seq, query.q, query.kv_heads, query.scale_log2)

    @cute.jit
    def epilogue(self, sm, ch, accO, out: CacheOutput, head: KvHead, seq, t):
        """The packed steps' result as the decode writes it (normalized, with its lse: the base epilogue) into the
        ring, free once the last O is in (every tile read, every MMA complete); then, once the window's (O, m, l)
        are in shared memory, the two merged into the output (one part) or the item's partial, and with several
        parts the last CTA's merge."""
        cfg = self.cfg
        packed = cute.recast_ptr(ch.ring_words, dtype=Float32)  # o [R, D] | lse [R]
        BlackwellDecodeKernel.epilogue(self, sm, ch, accO, Output(packed, packed + cfg.R * cfg.D, True, 0, 1, Int32(0)),
                                       head, seq, t)
        NamedBarrier(BlackwellDecodeBarrier.WINDOW, 2 * WG).arrive_and_wait()  # and the output warpgroup's rows
        _b, _h, part, parts, item0, _facts, _valid = seq.item()
        item = item0 + part  # (the partial's row: one part writes the output instead)
        self.merge_weights(packed + cfg.R * cfg.D, out, head, seq, item, parts, t)
        for el in cutlass.range(t, cfg.R * cfg.D, WG, unroll=1):  # (R, D) row-major
            self.store_element(packed, out, head, seq, item, parts, el)
        if parts > 1:
            self.merge_parts(out, head, seq, t)

    @cute.jit
    def merge_weights(self, packed_lse: cute.Pointer, out: CacheOutput, head: KvHead, seq, item: Int32, parts: Int32,
                      t):
        """Thread ``r < R``: query row ``r``'s merged lse into the output or the item's partial, and over the
        window's m and l the weights of the packed (normalized) and the window's (unnormalized) results: in the
        log2 domain, with ``a = lse_p log2(e)`` and ``b = m_w + log2 l_w``, ``c_p = 2^(a - M) / T`` and ``c_w =
        2^(m_w - M) / T`` (``M = max(a, b)``, ``T = 2^(a - M) + 2^(b - M)``; 0 for a row that saw nothing)."""
        N = self.cfg.N
        win_ml = cute.make_tensor(cute.recast_ptr(seq.areas.win_ml.data_ptr(), dtype=Float32),
                                  cute.make_layout((2 * N,)))
        if t < self.cfg.R:
            m_w = win_ml[t]
            a = scalar(packed_lse, t)[0] * LOG2E
            b = m_w + cute.math.log2(win_ml[N + t], fastmath=False)  # -inf where the window saw nothing
            reference = finite_reference(cute.arch.fmax(a, b))
            w_a = cute.arch.exp2(a - reference)
            total = w_a + cute.arch.exp2(b - reference)
            inv = fsel(total > Float32(0.0), cute.arch.rcp_approx(total), Float32(0.0))
            self.store_lse(out, head, item, parts, t, merged_lse(reference * LN2, total))
            win_ml[t] = w_a * inv
            win_ml[N + t] = cute.arch.exp2(m_w - reference) * inv
        NamedBarrier(BlackwellDecodeBarrier.MERGE, WG).arrive_and_wait()

    @cute.jit
    def store_lse(self, out: CacheOutput, head: KvHead, item: Int32, parts: Int32, r: Int32, lse: Float32):
        """Query row ``r``'s lse into the output (one part) or the item's partial."""
        final, partial = self.destinations(out, item, parts)
        if parts == 1:
            _obase, lidx = final.offsets(self.cfg.rows, head, r, self.cfg.D)
            scalar(out.lse, lidx)[0] = lse
        else:
            _obase, lidx = partial.offsets(self.cfg.rows, head, r, self.cfg.D)
            scalar(out.lse_part, lidx)[0] = lse

    @cute.jit
    def store_element(self, packed: cute.Pointer, out: CacheOutput, head: KvHead, seq, item: Int32, parts: Int32,
                      el: Int32):
        """Element ``el`` of the (R, D) merged rows, ``o_p c_p + O_w c_w`` (the packed result in ``packed``, the
        window's over its rows, the weights over its m and l), into the output (one part) or the item's partial."""
        D, N = self.cfg.D, self.cfg.N
        areas = seq.areas
        win_o = cute.recast_ptr(areas.win_kv.data_ptr(), dtype=Float32)
        weights = cute.recast_ptr(areas.win_ml.data_ptr(), dtype=Float32)
        r = el // D
        value = scalar(packed, el)[0] * scalar(weights, r)[0] + scalar(win_o, el)[0] * scalar(weights, N + r)[0]
        final, partial = self.destinations(out, item, parts)
        if parts == 1:
            obase, _lidx = final.offsets(self.cfg.rows, head, r, D)
            scalar(out.out, obase + el % D)[0] = value.to(self.cfg.q_dtype)
        else:
            obase, _lidx = partial.offsets(self.cfg.rows, head, r, D)
            scalar(out.o_part, obase + el % D)[0] = value

    def destinations(self, out: CacheOutput, item: Int32, parts: Int32):
        """(the output, q dtype: where the item writes if it is its (sequence, KV head)'s one part; the item's fp32
        partial: where it writes if not)."""
        return Output(out.out, out.lse, False, 0, parts), Output(out.o_part, out.lse_part, True, 0, parts, item)

    @cute.jit
    def merge_parts(self, out: CacheOutput, head: KvHead, seq, t):
        """The last of the (sequence, KV head)'s CTAs merges its parts' partials (``foscar.split_merge``: past 16
        parts in two levels, as Hopper's)."""
        _b, _h, part, parts, item0, _facts, _valid = seq.item()
        self.merger.merge_items(seq.areas.merge.data_ptr(), seq.areas.last.data_ptr(), out,
                                head.b * head.kv_heads + head.h, item0, part, parts,
                                self.cfg.rows.first(head.b, head.h, head.kv_heads), head.kv_heads, t)
