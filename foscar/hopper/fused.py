"""The decode launch of ``foscar.cache.PagedKVCache`` (sm_90a): the quantized splits' partials.

Grid ``(num_splits, kv_heads, batch)``: each CTA is split ``x`` of the sequence's packed pages,
exactly the decode kernel's CTA (``foscar.hopper.kernel``: producer warpgroup + consumer warps, an
fp32 partial out), writing partial ``x`` of ``total`` per query row; ``foscar.kernels.sink_window``
runs next, writes the 16-bit sink + window slots' partials ``num_splits ..`` and merges them all.

The cache's tensors are read in place: the page table by the sequence's row (``seq_rows[b]``), the
quantized length computed from the sequence's token count (``seq_lengths[row]``) as
``PagedKVCache.quantized_tokens`` does, so no torch gather or length arithmetic runs per call:
a call is this launch and the window kernel's, CUDA-graph capturable.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..device import LOG2E
from ..kernels.quantize import granule_of
from ..kernels.sink_window import quantized_tokens
from ..layouts.fragment import THREADS
from ..pipeline import split_range
from .kernel import PRODUCER_REGS, DecodeConfig, HopperDecodeKernel

__all__ = ["HopperCacheDecodeKernel"]


class HopperCacheDecodeKernel(HopperDecodeKernel):
    """See the module docstring; ``cfg`` is a split-output :class:`DecodeConfig`."""

    def __init__(self, cfg: DecodeConfig):
        if not cfg.split:
            raise ValueError("the cache decode kernel writes split partials: build its DecodeConfig with split=True")
        super().__init__(cfg)
        self.granule = granule_of(cfg.scheme)

    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer,  # [B, Hq, D] q dtype
        kc_ptr: cute.Pointer,  # the layer's packed pages, as HopperDecodeKernel
        kp_ptr: cute.Pointer,
        vc_ptr: cute.Pointer,
        vp_ptr: cute.Pointer,
        pt_ptr: cute.Pointer,  # int32 [max_seqs, max_pages]
        seq_rows: cute.Pointer,  # int64 [B]: the sequences' rows
        seq_lengths: cute.Pointer,  # int64 [max_seqs]: tokens per sequence (this layer)
        o_part: cute.Pointer,  # fp32 [B, Hq, total, D]: this launch writes partials 0 .. num_splits - 1
        lse_part: cute.Pointer,  # fp32 [B, Hq, total]
        batch: Int32,
        kv_heads: Int32,
        max_pages: Int32,
        num_splits: Int32,
        total: Int32,
        sink: Int32,
        window: Int32,
        sm_scale: Float32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        SharedStorage = self.shared_storage()
        self.kernel(self.tiled_mma(), SharedStorage, q_ptr, kc_ptr, kp_ptr, vc_ptr, vp_ptr, pt_ptr, seq_rows,
                    seq_lengths, o_part, lse_part, kv_heads, max_pages, num_splits, total, sink, window,
                    sm_scale * LOG2E).launch(
            grid=(num_splits, kv_heads, batch),
            block=(cfg.threads, 1, 1),
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr, q_ptr: cute.Pointer,
               kc_ptr: cute.Pointer, kp_ptr: cute.Pointer, vc_ptr: cute.Pointer, vp_ptr: cute.Pointer,
               pt_ptr: cute.Pointer, seq_rows: cute.Pointer, seq_lengths: cute.Pointer, o_part: cute.Pointer,
               lse_part: cute.Pointer, kv_heads: Int32, max_pages: Int32, num_splits: Int32, total: Int32, sink: Int32,
               window: Int32, scale_log2: Float32):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        split, h, b = cute.arch.block_idx()
        role = cute.arch.make_warp_uniform(tidx // THREADS)  # 0: producer, 1..NC: consumers
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        full, empty = storage.full.data_ptr(), storage.empty.data_ptr()
        self.init_ring_barriers(full, empty, tidx)

        row = cute.make_tensor(seq_rows + b, cute.make_layout((1,)))[0]  # the sequence's row (Int64)
        n = Int32(cute.make_tensor(seq_lengths + row, cute.make_layout((1,)))[0])
        qlen = quantized_tokens(n, sink, window, self.granule)
        _n_tiles, t_begin, t_end = split_range(qlen, split, num_splits, cfg.TPG)

        if role == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.produce(storage.ring.data_ptr(), full, empty, kc_ptr, kp_ptr, vc_ptr, vp_ptr, pt_ptr, Int32(row), h,
                         kv_heads, max_pages, t_begin, t_end, cute.arch.make_warp_uniform(tidx // 32), tidx % 32)
        else:
            cute.arch.setmaxregister_increase(cfg.consumer_regs)
            self.consume(tiled_mma, storage.ring.data_ptr(), full, empty, q_ptr, o_part, lse_part, qlen, b, h, split,
                         kv_heads, total, t_begin, t_end, scale_log2, cute.arch.make_warp_uniform(tidx // 32 - 4),
                         tidx % 32)
