"""The decode launch of ``foscar.cache.PagedKVCache`` (sm_90a): packed pages, the 16-bit sink +
window slots and the split merge, in one launch.

A 1-D grid of work items (``foscar.work_list``: each (sequence, KV head) cut into ``parts`` by its
length, planned in the launch from the batch's lengths): each CTA is the decode kernel's CTA
(``foscar.hopper.kernel``: producer warpgroup + consumer warps over a shared-memory ring) for part
``x`` of its (sequence, KV head)'s packed tiles and for its window tiles ``x, x + parts, ...``:
blocks of 16 sink + window slots (``foscar.window_tiles``) that travel through the same ring, before
the packed tiles (after them, each CTA ended on a burst of 16-bit reads with nothing left to overlap: 128 x 8K
11-15% slower than two launches). A window tile is copied by the 32 lanes of a producer warp
(16-byte ``cp.async`` into padded rows, slots holding no token zero-filled; each lane arrives on the
stage's ``full`` barrier once its copies land, ``cp.async.mbarrier.arrive.noinc``: the barrier counts
32 arrivals, and a packed tile's producer makes all 32) and attended by the consumer warp that owns its stage, into that
warp's own online softmax and O^T, in the window's 16-bit type (BF16 or FP16 MMAs). So every
window byte is read once per KV head, within the same launch, and no second launch runs.

One part writes the output directly; with several, each CTA writes its normalized fp32 partial
(per work item, ``[items, R, D]``) and the last CTA of the (sequence, KV head) merges them
(``foscar.split_merge``: the cache's completion counters, left at zero).

Where a ring of window-sized stages does not fit in shared memory (head_dim 256 with channel-wise K
groups of 256 tokens: a consumer warp owns a run of 4 stages, 16 of 16.5 KB), the config has no window
tiles (:func:`cache_decode_config`) and the decode is two launches over a grid ``(num_splits,
kv_heads, batch)``: these CTAs write partials ``0 .. num_splits - 1`` of ``parts``, and
``foscar.kernels.sink_window``'s launch attends the 16-bit slots and merges (:func:`fuses_window`
says which).

The cache's tensors are read in place: the page table by the sequence's row (``seq_rows[b]``), the
quantized length computed from the sequence's token count (``seq_lengths[row]``) as
``PagedKVCache.quantized_tokens`` does: a call is one launch, CUDA-graph capturable.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..barriers import HopperDecodeBarrier
from ..decode_kernel import CacheArgs, CacheDecodeBase
from ..device import at, set_warpgroup_registers
from ..jit import half_type
from ..kernels.quantize import granule_of
from ..layouts.fragment import THREADS
from ..pipeline import Ring, TileSpan
from ..query_rows import KvHead, Output
from ..softmax import finite_reference
from ..split_merge import CacheOutput, SplitMerge
from ..window_tiles import (BLOCK, WindowOperands, quantized_tokens, slot_holds_token, slot_position,
                            window_blocks)
from ..warp_mma import WarpMma
from ..work_list import MAX_SPLITS, PLAN_WORDS, CacheWork, WorkList
from .kernel import PRODUCER_REGS, PRODUCER_WARPS, DecodeConfig, HopperDecodeKernel, WarpState

__all__ = ["HopperCacheDecodeKernel", "cache_decode_config", "fuses_window", "two_ctas_pipeline_with_window"]


def cache_decode_config(scheme, page_size: int, consumers: int, tokens: int = 1, ctas_per_sm: int = 1) -> DecodeConfig:
    """The split-output config whose ring stages also hold a window tile; where such a ring does not
    fit (head_dim 256 with channel-wise K groups of 256 tokens: 16 stages of 16.5 KB), the packed-only
    config: the cache decode is then two launches (:func:`fuses_window`). ``tokens``: query tokens per
    sequence (``foscar.query_rows``; several only where the window tiles fit: they carry the causal mask)."""
    # raises what the variant cannot build
    plain = DecodeConfig(scheme, page_size, True, consumers, tokens=tokens, ctas_per_sm=ctas_per_sm)
    window = WindowOperands(scheme.head_dim, plain.rows, half_type(scheme.q_dtype))
    try:
        return DecodeConfig(scheme, page_size, True, consumers, window, tokens, ctas_per_sm=ctas_per_sm)
    except ValueError:  # the one check the window adds: its stages' ring fits
        return plain


@functools.lru_cache(maxsize=256)
def fuses_window(scheme, page_size: int, consumers: int, ctas_per_sm: int = 1) -> bool:
    """Whether the cache decode of ``scheme`` is one launch (the window tiles in the decode ring) or
    two: this kernel's quantized splits' partials, then ``foscar.kernels.sink_window``'s launch,
    which attends the 16-bit slots and merges all partials."""
    return cache_decode_config(scheme, page_size, consumers, ctas_per_sm=ctas_per_sm).window is not None


@functools.lru_cache(maxsize=256)
def two_ctas_pipeline_with_window(scheme, page_size: int) -> bool:
    """Whether the one-launch cache decode at one consumer warpgroup and two CTAs per SM holds its window tiles in
    the ring and keeps the software-pipelined loop (``DecodeConfig.PIPELINED``: 3 stages per warp; the window
    tiles' larger stages leave K channel-wise 2)."""
    try:
        cfg = cache_decode_config(scheme, page_size, 1, ctas_per_sm=2)
    except ValueError:
        return False
    return cfg.window is not None and cfg.PIPELINED


@dataclass(frozen=True)
class CachePart:
    """What one CTA attends: part ``part`` of ``n_parts`` of sequence ``b`` (cache row ``row``, ``n``
    tokens), KV head ``h``, into partial ``out_index`` of ``out_count`` per row; ``item0``: the (sequence,
    KV head)'s first work item (one launch; None: two launches, row-major partials)."""

    b: Int32
    h: Int32
    row: Int64
    n: Int32
    part: Int32
    n_parts: Int32
    out_index: Int32
    out_count: Int32
    item0: Int32 | None = None


class CacheWindow:
    """One CTA's window tiles (built in the kernel from its runtime values): tile ``i`` is block
    ``split + num_splits * i`` of the sequence's 16-slot blocks and local tile ``i`` of the ring, before
    the packed tiles; their count is rounded up to whole runs of ``TPG`` (so the packed runs stay
    aligned to channel-wise K groups), the extra tiles' slots all past the cache row."""

    def __init__(self, cfg: DecodeConfig, args: CacheArgs, part: CachePart, kv_heads, qlen, q_row0, first):
        """``qlen``: the sequence's packed tokens; ``q_row0``: the row of the KV head's query column 0; ``first``:
        the element of the (sequence, KV head)'s slot 0 in ``args.slots.k_win`` / ``v_win``."""
        self.cfg, self.ops = cfg, cfg.window
        slots = args.slots
        self.k_win, self.v_win, self.q_ptr = slots.k_win, slots.v_win, args.q
        self.q_row0, self.kv_heads, self.first = q_row0, kv_heads, first
        self.n, self.qlen, self.sink, self.ring = part.n, qlen, slots.sink, slots.ring
        self.slots = slots.sink + slots.ring
        self.split, self.num_splits = part.part, part.n_parts
        self.recent = cutlass.max(part.n - slots.sink - qlen, Int32(0))
        tiles = window_blocks(self.slots, part.part, part.n_parts)
        self.tiles = (tiles + cfg.TPG - 1) // cfg.TPG * cfg.TPG

    def holds(self, j):
        return slot_holds_token(j, self.n, self.qlen, self.sink, self.ring, self.recent)

    def slot0(self, i):
        """First slot of window tile ``i``."""
        return BLOCK * (self.split + self.num_splits * i)

    @cute.jit
    def produce(self, ring: Ring, pw: Int32, lane: Int32):
        """Producer warp ``pw`` (all lanes): the window tiles ``pw``, ``pw + 4``, ... (ring item ``i`` is warp ``i % 4``'s:
        ``foscar.pipeline.first_item``)"""
        cfg = self.cfg
        for i in cutlass.range(pw, self.tiles, PRODUCER_WARPS, unroll=1):
            s, phase = ring.position(i)
            ring.wait_empty(s, phase)  # every lane: its own copies wait for the stage
            j0 = self.slot0(i)
            dst = ring.stage(s)
            # a tile past the row (rounding to TPG) reads from its last slot, copying 0 bytes of it
            src = cutlass.min(j0, self.slots - 1)
            first = self.first + src.to(Int64) * cfg.D
            rows_in = cutlass.max(cutlass.min(BLOCK, self.slots - j0), 1)
            # a runtime loop: the producer's 40 registers do not hold an unrolled one's addresses
            self.ops.copy_rows(((dst + cfg.WIN_K, self.k_win), (dst + cfg.WIN_V, self.v_win)), first, rows_in, j0,
                               self.holds, lane, 32, BLOCK, unrolled=False)
            cute.arch.cp_async_mbarrier_arrive_noinc(ring.barriers.full(s))  # this lane's arrival, once its copies land

    @cute.jit
    def attend(self, kernel: HopperDecodeKernel, mma: WarpMma, ring: Ring, state: WarpState, i: Int32,
               scale_log2: Float32):
        """Window tile ``i`` (local tile ``i``) into the warp's online softmax and O^T (the V case's state rescaled like
        after a packed tile; its corrections get nothing: these slots are exact)."""
        cfg, ops, vf = self.cfg, self.ops, kernel.v_hooks
        wmma = WarpMma(ops.tiled_mma(), mma.lane, cfg.NB)  # the window's 16-bit type, same fragment geometry
        q_t = ops.query_fragments(wmma, self.q_ptr, self.q_row0, self.kv_heads)
        j0 = self.slot0(i)
        valid = tuple(self.holds(j0 + wmma.g + 8 * hr) for hr in range(2))
        visible = None  # one query token: it sees every token the slots hold
        if cutlass.const_expr(cfg.rows.tokens > 1):  # several: the causal mask, by the slots' token positions
            positions = [slot_position(j0 + wmma.g + 8 * hr, self.qlen, self.sink, self.ring) for hr in range(2)]
            visible = lambda nb, i: cfg.rows.sees(8 * nb + 2 * wmma.tq + i % 2, positions[i // 2], self.n)  # noqa: E731
        stage, phase = ring.position(i)
        ring.wait_full(stage, phase)
        sbuf = ring.stage(stage)
        sc = ops.scores(wmma, sbuf + cfg.WIN_K, 0, q_t, scale_log2, valid, visible)
        alpha, moved = kernel.online_softmax(mma, sc, state, token_blocks=1, may_be_empty=True)
        vf.rescale_corrections(mma, state.v, alpha)
        rescale = vf.rescale_direct  # (a method of a local object is not called inside a runtime `if`)
        if moved:
            rescale(mma, state.v, state.acc_o, alpha)
        p = cute.make_rmem_tensor((4 * cfg.NB,), Float32)
        for nb in cutlass.range_constexpr(cfg.NB):
            for x in cutlass.range_constexpr(4):
                cs = x % 2 + 2 * nb
                p[4 * nb + x] = cute.arch.exp2(sc[4 * nb + x] - finite_reference(state.row_max[cs]))
                state.row_sum[cs] = state.row_sum[cs] + p[4 * nb + x]
        p_t = ops.probability_fragments(wmma, p)
        for md in cutlass.range_constexpr(cfg.MB_V):
            a = ops.value_fragment(wmma, sbuf + cfg.WIN_V, 0, md)
            for nb in cutlass.range_constexpr(cfg.NB):
                wmma.gemm(state.acc_o[md][nb], a, p_t[nb])
        ring.release(stage)


class HopperCacheDecodeKernel(CacheDecodeBase, HopperDecodeKernel):
    """See the module docstring; ``cfg`` from :func:`cache_decode_config`."""

    def __init__(self, cfg: DecodeConfig):
        if not cfg.split:
            raise ValueError("the cache decode kernel needs a split-output DecodeConfig (cache_decode_config)")
        super().__init__(cfg)

        self.granule = granule_of(cfg.scheme)
        self.work = WorkList(cfg.threads, MAX_SPLITS)
        self.cache_work = CacheWork(cfg.TILE_BYTES, cfg.D, self.granule)
        self.merger = SplitMerge(cfg.D, cfg.rows, cfg.NW * 32, HopperDecodeBarrier.CONSUMERS, cfg.q_dtype, MAX_SPLITS)

    def cache_storage(self):
        if self.cfg.window is None:  # two launches: the window kernel merges
            return self.shared_storage()
        return self.shared_storage(
            merge_scratch=cute.struct.Align[cute.struct.MemRange[Float32, self.merger.scratch_words], 16],
            last=cute.struct.MemRange[Int32, 1],  # SplitMerge.arrive's answer
            plan=cute.struct.MemRange[Int32, PLAN_WORDS],  # WorkList.find's scratch and answer
        )

    def launch_cache(self, args: CacheArgs, stream: cuda.CUstream):
        """One CTA per work item (``foscar.work_list.grid_ctas``), or, with no window tiles, per (split, KV head,
        sequence)."""
        cfg = self.cfg
        SharedStorage = self.cache_storage()
        grid = (args.budget + args.batch * args.kv_heads, 1, 1)
        if cfg.window is None:
            grid = (args.num_splits, args.kv_heads, args.batch)
        self.launch(self.kernel(self.tiled_mma(), SharedStorage, args), grid, SharedStorage.size_in_bytes(), stream)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr, args: CacheArgs):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        stage_ring = self.ring_of(storage)
        self.init_ring_barriers(stage_ring, tidx)
        if cutlass.const_expr(cfg.window is None):  # two launches: the grid is (split, KV head, sequence)
            split, h, b = cute.arch.block_idx()
            row = at(args.seq_rows, b)  # the sequence's row (Int64)
            part = CachePart(b, h, row, Int32(at(args.seq_lengths, row)), split, args.num_splits, split, args.parts)
            self.attend_part(tiled_mma, storage, stage_ring, args, part, tidx)
            # (budget: the work list's only)
        else:
            x, _, _ = cute.arch.block_idx()
            # a (sequence, KV head)'s work: its packed tiles' bytes and its window tiles', in 256-byte
            # units; its parts: at most one per MIN_TOKENS_PER_SPLIT packed tokens (foscar.work_list.plan_splits);
            # the sequence's token count and row come back with the item
            slots = args.slots
            win_units = self.cache_work.window_units(slots.sink, slots.ring)
            work_of = lambda b: self.cache_work.sequence(args.seq_rows, args.seq_lengths, b, slots.sink,  # noqa: E731
                                                         slots.window, win_units)
            b, h, part, n_parts, item0, (n, row), valid = self.work.find(x, args.batch, args.kv_heads, args.budget,
                                                                         work_of, storage.plan.data_ptr(), tidx)
            if valid:
                self.attend_part(tiled_mma, storage, stage_ring, args,
                                 CachePart(b, h, row.to(Int64), n, part, n_parts, item0 + part, n_parts, item0), tidx)
            # (num_splits, parts: the two-launch grid's only)

    @cute.jit
    def attend_part(self, tiled_mma: cute.TiledMma, storage, ring: Ring, args: CacheArgs, part: CachePart,
                    tidx: Int32):
        """``part`` (:class:`CachePart`) of the layer's cache (``args``): its window tiles, then its packed tiles, into
        partial ``part.out_index`` of ``part.out_count`` per row (two launches: row-major ``[B, Hq,
        out_count, D]``), or with ``part.item0`` the output (one part) or work item ``out_index``'s partial,
        the last of its CTAs merging."""
        cfg, slots, kv_heads = self.cfg, args.slots, args.kv_heads
        role = cute.arch.make_warp_uniform(tidx // THREADS)  # 0: producer, 1..NC: consumers
        head = KvHead(part.b, part.h, kv_heads, Int32(part.row))
        qlen = quantized_tokens(part.n, slots.sink, slots.window, self.granule)
        tiles = TileSpan.of_split(qlen, part.part, part.n_parts, cfg.TPG)
        q_row0 = cfg.rows.first(part.b, part.h, kv_heads)  # row of the KV head's query column 0
        first = (part.row * kv_heads + part.h) * (slots.sink + slots.ring) * cfg.D  # element of the window's slot 0
        # (built in each branch: a Python object cannot be carried through a runtime `if`)
        window_of = lambda: None  # noqa: E731  (two launches: no window tiles)
        if cutlass.const_expr(cfg.window is not None):
            window_of = lambda: CacheWindow(cfg, args, part, kv_heads, qlen, q_row0, first)  # noqa: E731

        if role == 0:
            set_warpgroup_registers(PRODUCER_REGS, cfg.launch_regs)
            pw, lane = cute.arch.make_warp_uniform(tidx // 32), tidx % 32
            ring_first = None
            if cutlass.const_expr(cfg.window is not None):
                window_of().produce(ring, pw, lane)  # the window tiles first
                ring_first = window_of().tiles
            self.produce(ring, args.pages, head, tiles, pw, lane, ring_first=ring_first)
            if cutlass.const_expr(cfg.window is not None):
                # the lane's window copies land before it exits: their arrivals wait for them, and PTX does not say
                # that a thread's pending cp.async outlives it (cp.async.wait_all)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)
        else:
            set_warpgroup_registers(cfg.consumer_regs, cfg.launch_regs)
            warp, lane = cute.arch.make_warp_uniform(tidx // 32 - 4), tidx % 32
            window = window_of()
            merge = self.attend_tiles(WarpMma(tiled_mma, lane, cfg.NB), warp, ring, args.q, head, tiles,
                                      args.scale_log2, window=window)
            self.store_part(storage, args.output, part, head, q_row0, merge, warp * 32 + lane)

    @cute.jit
    def store_part(self, storage, out: CacheOutput, part: CachePart, head: KvHead, q_row0: Int64, merge: cute.Tensor,
                   tc: Int32):
        """The consumer threads' end of ``part``: merge the warps' results into the part's partial or the output;
        the last of several parts' CTAs then merges the partials."""
        if cutlass.const_expr(part.item0 is None):  # row-major partials; the window kernel merges
            self.merge_and_store(merge, Output(out.o_part, out.lse_part, True, part.out_index, part.out_count),
                                 head, tc)
        elif part.n_parts == 1:
            self.merge_and_store(merge, Output(out.out, out.lse, False, part.part, part.n_parts), head, tc)
        else:
            self.merge_and_store(merge, Output(out.o_part, out.lse_part, True, part.part, part.n_parts,
                                               part.out_index), head, tc)
            self.merger.merge_items(storage.merge_scratch.data_ptr(), storage.last.data_ptr(), out,
                                    head.b * head.kv_heads + head.h, part.item0, part.part, part.n_parts, q_row0,
                                    head.kv_heads, tc)
