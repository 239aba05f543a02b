"""The decode launch of ``foscar.cache.PagedKVCache`` (sm_100a): the quantized splits' partials.

Grid ``(num_splits, kv_heads, batch)``: each CTA is the decode kernel's CTA
(``foscar.blackwell.kernel``: the four warpgroup roles, an fp32 partial out) over split ``x`` of
the sequence's packed pages, writing partial ``x`` of ``total`` per query row;
``foscar.kernels.sink_window`` runs next, writes the 16-bit sink + window slots' partials
``num_splits ..`` and merges them all. The cache's tensors are read in place
(``foscar.blackwell.sequence.CacheSequence``: the page table by the sequence's row, the quantized
length from the sequence's token count), so a call is this launch and the window kernel's,
CUDA-graph capturable. Its pages must be in the Blackwell word order (the cache's append kernel
writes its arch's order). Compile-verified only (no Blackwell GPU here).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..device import LOG2E
from ..kernels.quantize import granule_of
from ..pipeline import PackedPages
from ..query_rows import KvHead, Output
from .kernel import BlackwellConfig, BlackwellDecodeKernel, MmaSetup
from .sequence import CacheSequence

__all__ = ["BlackwellCacheDecodeKernel"]


class BlackwellCacheDecodeKernel(BlackwellDecodeKernel):
    """See the module docstring; ``cfg`` is a split-output :class:`BlackwellConfig`."""

    def __init__(self, cfg: BlackwellConfig):
        if not cfg.split:
            raise ValueError("the cache decode kernel writes split partials: build its BlackwellConfig with split=True")
        super().__init__(cfg)
        self.granule = granule_of(cfg.scheme)

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
        mmas = self.mmas_and_layouts()
        SharedStorage = self.shared_storage(*mmas[3:])
        self.launch(self.kernel(*mmas, SharedStorage, q_ptr, kc_ptr, kp_ptr, vc_ptr, vp_ptr, pt_ptr, seq_rows,
                                seq_lengths, o_part, lse_part, kv_heads, max_pages, num_splits, total, sink, window,
                                sm_scale * LOG2E),
                    (num_splits, kv_heads, batch), SharedStorage, stream)

    @cute.kernel
    def kernel(self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, desc_mma: cute.TiledMma,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, sQ_layout: cute.ComposedLayout,
               sP_layout: cute.ComposedLayout, SharedStorage: cutlass.Constexpr, q_ptr: cute.Pointer,
               kc_ptr: cute.Pointer, kp_ptr: cute.Pointer, vc_ptr: cute.Pointer, vp_ptr: cute.Pointer,
               pt_ptr: cute.Pointer, seq_rows: cute.Pointer, seq_lengths: cute.Pointer, o_part: cute.Pointer,
               lse_part: cute.Pointer, kv_heads: Int32, max_pages: Int32, num_splits: Int32, total: Int32, sink: Int32,
               window: Int32, scale_log2: Float32):
        split, h, b = cute.arch.block_idx()
        seq = CacheSequence(pt_ptr, seq_rows, seq_lengths, max_pages, b, split, num_splits, total, sink, window,
                            self.granule)
        self.run(MmaSetup(mma_qk, mma_pv, desc_mma, sK_layout, sV_layout, sQ_layout, sP_layout), SharedStorage, q_ptr,
                 PackedPages(kc_ptr, kp_ptr, vc_ptr, vp_ptr, pt_ptr, max_pages),
                 Output(o_part, lse_part, True, split, seq.partials()), KvHead(b, h, kv_heads), scale_log2, seq)
