"""One launch per decode call of ``foscar.cache.PagedKVCache``: quantized splits, BF16 sink + window
chunks and the split merge in the same grid (sm_90a).

Grid ``(num_splits + window_ctas, kv_heads, batch)``. CTA ``x < num_splits`` is split ``x`` of the
sequence's packed pages, exactly the decode kernel's CTA (``foscar.hopper.kernel``: producer
warpgroup + consumer warps, fp32 partial out); CTA ``x >= num_splits`` attends chunk
``x - num_splits`` of the sequence's 16-bit sink + window slots with its consumer warps
(``foscar.sink_window``; the producer warpgroup has nothing to do). Every CTA then counts itself
done on its (sequence, KV head)'s counter and the last one merges the ``total`` partials into the
output (``foscar.split_merge``).

The cache's tensors are read in place: the page table and the window slots by the sequence's row
(``seq_rows[b]``), the quantized length computed from the sequence's token count
(``seq_lengths[row]``) as ``PagedKVCache.quantized_tokens`` does, so a call is this launch alone
(no gather, no length arithmetic, no window or combine launch) and CUDA-graph capturable.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32, Int64
from cutlass.cute.nvgpu import warp as warp_mma

from ..device import LOG2E
from ..kernels.quantize import granule_of
from ..layouts.fragment import THREADS
from ..pipeline import split_range
from ..sink_window import SinkWindow, quantized_tokens
from ..split_merge import SplitMerge
from .kernel import BAR_CONSUMERS, PRODUCER_REGS, DecodeConfig, HopperDecodeKernel

__all__ = ["HopperCacheDecodeKernel"]


class HopperCacheDecodeKernel(HopperDecodeKernel):
    """See the module docstring; ``cfg`` is a split-output :class:`DecodeConfig`."""

    def __init__(self, cfg: DecodeConfig):
        if not cfg.split:
            raise ValueError("the cache decode kernel writes split partials: build its DecodeConfig with split=True")
        super().__init__(cfg)
        self.granule = granule_of(cfg.scheme)
        self.window = SinkWindow(cfg.D, cfg.R, cfg.NW, BAR_CONSUMERS, cfg.q_dtype)
        if self.window.words > cfg.RING_WORDS:
            raise ValueError(f"window scratch of {4 * self.window.words} B does not fit the ring")
        self.merger = SplitMerge(cfg.D, cfg.R, 32 * cfg.NW, BAR_CONSUMERS, cfg.q_dtype)

    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer,  # [B, Hq, D] q dtype
        kc_ptr: cute.Pointer,  # the layer's packed pages, as HopperDecodeKernel
        kp_ptr: cute.Pointer,
        vc_ptr: cute.Pointer,
        vp_ptr: cute.Pointer,
        pt_ptr: cute.Pointer,  # int32 [max_seqs, max_pages]
        k_win: cute.Pointer,  # q dtype [max_seqs, kv_heads, sink + ring, D]
        v_win: cute.Pointer,
        seq_rows: cute.Pointer,  # int64 [B]: the sequences' rows
        seq_lengths: cute.Pointer,  # int64 [max_seqs]: tokens per sequence (this layer)
        o_part: cute.Pointer,  # fp32 [B, Hq, total, D]
        lse_part: cute.Pointer,  # fp32 [B, Hq, total]
        out: cute.Pointer,  # [B, Hq, D] q dtype
        lse: cute.Pointer,  # fp32 [B, Hq]
        counters: cute.Pointer,  # int32 [B * kv_heads], zero between launches
        batch: Int32,
        kv_heads: Int32,
        max_pages: Int32,
        num_splits: Int32,
        window_ctas: Int32,
        sink: Int32,
        ring: Int32,
        sm_scale: Float32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        tiled_mma = cute.make_tiled_mma(warp_mma.MmaF16BF16Op(Float16, Float32, (16, 8, 16)))

        @cute.struct
        class SharedStorage:
            ring: cute.struct.Align[cute.struct.MemRange[Int32, cfg.RING_WORDS], 1024]
            full: cute.struct.MemRange[Int64, cfg.STAGES]
            empty: cute.struct.MemRange[Int64, cfg.STAGES]
            last: cute.struct.MemRange[Int32, 1]  # SplitMerge.arrive's answer

        self.kernel(tiled_mma, SharedStorage, q_ptr, kc_ptr, kp_ptr, vc_ptr, vp_ptr, pt_ptr, k_win, v_win, seq_rows,
                    seq_lengths, o_part, lse_part, out, lse, counters, kv_heads, max_pages, num_splits, window_ctas,
                    sink, ring, sm_scale * LOG2E).launch(
            grid=(num_splits + window_ctas, kv_heads, batch),
            block=(cfg.threads, 1, 1),
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr, q_ptr: cute.Pointer,
               kc_ptr: cute.Pointer, kp_ptr: cute.Pointer, vc_ptr: cute.Pointer, vp_ptr: cute.Pointer,
               pt_ptr: cute.Pointer, k_win: cute.Pointer, v_win: cute.Pointer, seq_rows: cute.Pointer,
               seq_lengths: cute.Pointer, o_part: cute.Pointer, lse_part: cute.Pointer, out: cute.Pointer,
               lse: cute.Pointer, counters: cute.Pointer, kv_heads: Int32, max_pages: Int32, num_splits: Int32,
               window_ctas: Int32, sink: Int32, ring: Int32, scale_log2: Float32):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        split, h, b = cute.arch.block_idx()
        role = cute.arch.make_warp_uniform(tidx // THREADS)  # 0: producer, 1..NC: consumers
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        full, empty = storage.full.data_ptr(), storage.empty.data_ptr()
        self.init_ring_barriers(full, empty, tidx)

        row = cute.make_tensor(seq_rows + b, cute.make_layout((1,)))[0]  # the sequence's row (Int64)
        n = Int32(cute.make_tensor(seq_lengths + row, cute.make_layout((1,)))[0])
        qlen = quantized_tokens(n, sink, ring - self.granule, self.granule)
        total = num_splits + window_ctas
        _n_tiles, t_begin, t_end = split_range(qlen, split, num_splits, cfg.TPG)  # empty for window CTAs

        if role == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if split < num_splits:
                self.produce(storage.ring.data_ptr(), full, empty, kc_ptr, kp_ptr, vc_ptr, vp_ptr, pt_ptr, Int32(row),
                             h, kv_heads, max_pages, t_begin, t_end, cute.arch.make_warp_uniform(tidx // 32), tidx % 32)
        else:
            cute.arch.setmaxregister_increase(cfg.consumer_regs)
            warp = cute.arch.make_warp_uniform(tidx // 32 - 4)
            lane = tidx % 32
            if split < num_splits:
                self.consume(tiled_mma, storage.ring.data_ptr(), full, empty, q_ptr, o_part, lse_part, qlen, b, h,
                             split, kv_heads, total, t_begin, t_end, scale_log2, warp, lane)
            else:
                q_row0 = (b * kv_heads + h).to(Int64) * cfg.R  # first query row of the KV head
                slot_row = (row * kv_heads + h) * (sink + ring)  # first window slot of (sequence, KV head)
                self.window.attend(storage.ring.data_ptr(), q_ptr, k_win, v_win, slot_row, n, qlen, sink, ring,
                                   split - num_splits, q_row0, o_part, lse_part, split, total, scale_log2, warp, lane)
            if self.merger.arrive(counters + (b * kv_heads + h), storage.last.data_ptr(), total, warp * 32 + lane):
                self.merger.merge(o_part, lse_part, out, lse, (b * kv_heads + h).to(Int64) * cfg.R, total,
                                  warp * 32 + lane)
