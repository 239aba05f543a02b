"""A prefill-style attention of many query rows over the packed pages of one sequence (sm_90a): the query tiles of
a chunk over a long quantized prefix (``PagedKVCache.attend_chunk``), never writing the prefix in 16 bits.

Why a second Hopper kernel: the decode kernels hold the query as the narrow side of warp MMAs (16 columns a pass)
and build each operand from packed codes in registers, per warp; a chunk of hundreds of tokens then takes one pass
over the pages per 16 columns, bound by the consumers' instructions (``benchmarks/NOTES.md`` section 31). Here the
query rows are the M side of warpgroup MMAs (``wgmma``, 64 rows per consumer warpgroup, 128 per CTA), and each
64-token tile is dequantized once per CTA into shared memory, where both consumer warpgroups read it: the
construction is paid once per 128 query rows, not once per 16.

Roles (384 threads):

* warpgroup 0, the converter: loads a tile's packed words and (scale, offset) params (the dequantize kernel's
  plan, ``foscar.kernels.dequantize.TilePlan``: each word read once), writes ``scale * code + offset`` in q's dtype
  into a ring stage as the swizzled K and V tiles ``wgmma`` reads, then fences them for the async proxy and
  arrives on the stage's ``full`` barrier;
* warpgroups 1 and 2, the consumers: ``S = Q K^T`` (both operands in shared memory), the online softmax in
  registers, ``O += P V`` (P from registers), releasing the stage on its ``empty`` barrier.

The values are the dequantize-then-attend algebra's, rounded as a BF16 (FP16) computation rounds them: each K/V
value is the dequantize kernel's (one FP32 FMA, then the dtype), P is rounded to the dtype for the PV product, S
and O accumulate in FP32. Extra memory is the partial outputs: ``splits x kv_heads x rows x D`` in q's dtype.

Work: a CTA takes 128 query rows of one KV head over one split, a run of whole 64-token tiles (every tile full:
a cache quantizes whole tiles); it writes the rows' normalized output and natural-log LSE, merged with the other
splits and the 16-bit parts by ``foscar.chunk_attention``.

Speed (H200, ``benchmarks/NOTES.md`` section 58): ~1.7 us per tile per CTA, about twice what the SM's instruction
issue allows; the likely bound is the one converter warpgroup, which loads a tile's words and params, waits for
them, then converts (686 SASS instructions a warp) with nothing to overlap the load's latency. Up to 512 query
columns per KV head that beats the decode kernel and the dequantized blocks
(``foscar.chunk_attention.PREFILL_COLUMNS``); longer chunks take the blocks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup
from cutlass.pipeline import (Agent, CooperativeGroup, NamedBarrier, PipelineAsync, PipelineUserType,
                              make_pipeline_state)
from cutlass.tensor_utils import LayoutEnum

from ..barriers import PrefillBarrier
from ..device import LOG2E
from ..kernels.dequantize import THREADS as CONVERTER_THREADS, Dequantize, DequantizeConfig, _swizzled, _thread_part
from ..layouts.fragment import TILE_TOKENS
from ..scheme import Axis, Scheme, params_shape
from ..softmax import normalize, rescale_factor

__all__ = ["PrefillConfig", "HopperPackedPrefill", "RAN_ON_A_GPU", "TILE_ROWS", "compile_prefill", "prefill_config",
           "prefill_splits", "run_prefill"]

TILE_ROWS = 128  # query rows of a CTA: two consumer warpgroups of 64
TILE_N = TILE_TOKENS  # keys of a ring stage: one packed tile
STAGES = 4  # ring stages of dequantized K and V tiles
CONSUMER_WARPGROUPS = TILE_ROWS // 64
THREADS = CONVERTER_THREADS * (1 + CONSUMER_WARPGROUPS)
ROW_BYTES_ALIGN = 1024  # the swizzled wgmma tiles' alignment
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
# The configurations the kernel has run with against float64 on a GPU (the GPU schemes of tests/test_cache_chunk.py),
# as ``PrefillConfig.ran_key``: (K's, V's (head_dim, bits, group axis, group, offset_per_scale), q's dtype). Others
# compile, but the cache's route leaves them to the verified paths until a GPU has run them.
RAN_ON_A_GPU = {((128, 2, Axis.CHANNEL, 128, None), (128, 2, Axis.TOKEN, 128, None), "bfloat16"),
                ((128, 4, Axis.TOKEN, 128, None), (128, 4, Axis.TOKEN, 128, None), "bfloat16"),
                ((128, 2, Axis.TOKEN, 128, None), (128, 2, Axis.TOKEN, 128, None), "float16")}


@dataclass(frozen=True)
class PrefillConfig:
    """What the compiled kernel depends on (the compile-cache key): the K and V dequantize configs (bits, group
    axis and size, format, the arch's packed order, q's dtype) and the head dim."""

    k: DequantizeConfig
    v: DequantizeConfig

    @classmethod
    def of(cls, scheme: Scheme, dtype: str = "bfloat16", layout: str = "hopper") -> "PrefillConfig":
        if scheme.head_dim != 128:  # (64 compiles, but has never run on a GPU)
            raise ValueError(f"the prefill kernel takes head_dim 128, got {scheme.head_dim}")
        return cls(DequantizeConfig.of(scheme, "k", dtype, layout), DequantizeConfig.of(scheme, "v", dtype, layout))

    @property
    def head_dim(self) -> int:
        return self.k.head_dim

    @property
    def ran_key(self) -> tuple:
        """The configuration as ``RAN_ON_A_GPU`` names it."""
        return (*((c.head_dim, c.bits, c.axis, c.group, c.offset_per_scale) for c in (self.k, self.v)), self.k.dtype)

    @property
    def has_run(self) -> bool:
        """Whether this configuration has run on a GPU (``RAN_ON_A_GPU``)."""
        return self.ran_key in RAN_ON_A_GPU

    @property
    def dtype(self):
        return DTYPES[self.k.dtype]


@functools.cache
def prefill_config(scheme: Scheme, dtype: str = "bfloat16", layout: str = "hopper") -> PrefillConfig:
    """``PrefillConfig.of``, kept per (scheme, dtype, layout): a chunk's route asks for it at every call of every
    sequence (~9 us each to build, on a call bound by its host work)."""
    return PrefillConfig.of(scheme, dtype, layout)


def prefill_splits(row_tiles: int, kv_heads: int, tiles: int, sms: int) -> int:
    """Splits of a prefix of ``tiles`` 64-token tiles: as many as keep the CTAs within one wave of ``sms`` (one CTA
    per SM: the ring takes most of shared memory), none shorter than 8 tiles, since each split's partial output is
    written and merged."""
    return max(1, min(sms // (row_tiles * kv_heads), tiles // 8))


@dataclass(frozen=True)
class _Converter:
    """The converter warpgroup's view of one role (K or V): the dequantize kernel's plan for this thread (frozen:
    the DSL takes it as read-only inside the runtime loop)."""

    dq: Dequantize
    token0: Int32
    channel0: Int32
    word0: Int32
    shift0: Int32

    @classmethod
    def of(cls, cfg: DequantizeConfig, tidx) -> "_Converter":
        dq = Dequantize(cfg)
        plan = dq.plan
        bit0 = _thread_part(plan.thread_strides("p"), tidx)
        return cls(dq, _thread_part(plan.thread_strides("t"), tidx), _thread_part(plan.thread_strides("c"), tidx),
                   _swizzled(bit0 >> 5, plan.swizzle), bit0 & 31)

    def load(self, mCodes, mParams, page, head, tile_in_page, tidx):
        """Issue the tile's words and this thread's params (registers)."""
        words = self.dq.load_words(mCodes[page, head, tile_in_page, None], tidx)
        params = self.dq.load_params(mParams[page, head, None, None, None], tile_in_page, self.token0, self.channel0)
        return words, params

    def write(self, params, sCodes, sTile):
        """``scale * code + offset`` of the staged tile into ``sTile`` (64 tokens, D), this thread's chunks."""
        scaled = {}
        for s in range(self.dq.plan.steps):
            self.dq.make_step(s, sCodes, self.word0, self.shift0, params, scaled, sTile, self.token0, self.channel0)


class HopperPackedPrefill:
    """The kernel (module docstring). ``__call__`` takes raw pointers and Int32 extents, as the dequantize kernel."""

    def __init__(self, cfg: PrefillConfig):
        self.cfg = cfg
        self.D = cfg.head_dim
        self.dtype = cfg.dtype

    def layouts(self):
        """Swizzled shared-memory layouts: Q (128 rows, D), K and V stages (64 tokens, D, STAGES), all rows of D
        contiguous elements (V read as the MN-major B operand of the PV product)."""
        atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype,
                                                                                 self.D), self.dtype)
        sQ = cute.tile_to_shape(atom, (TILE_ROWS, self.D), order=(0, 1))
        sKV = cute.tile_to_shape(atom, (TILE_N, self.D, STAGES), order=(0, 1, 2))
        return sQ, sKV

    def tiled_mmas(self):
        qk = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K,
                                               cute.nvgpu.OperandMajorMode.K, Float32, (CONSUMER_WARPGROUPS, 1, 1),
                                               (64, TILE_N))
        pv = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K,
                                               cute.nvgpu.OperandMajorMode.MN, Float32, (CONSUMER_WARPGROUPS, 1, 1),
                                               (64, self.D), a_source=warpgroup.OperandSource.RMEM)
        return qk, pv

    @cute.jit
    def __call__(self, q: cute.Pointer, k_codes: cute.Pointer, k_params: cute.Pointer, v_codes: cute.Pointer,
                 v_params: cute.Pointer, page_table: cute.Pointer, out: cute.Pointer, lse: cute.Pointer,
                 num_pages: Int32, kv_heads: Int32, page_size: Int32, rows: Int32, tiles: Int32,
                 tiles_per_split: Int32, splits: Int32, sm_scale: Float32, stream: cuda.CUstream):
        cfg, D = self.cfg, self.D
        tiles_per_page = page_size // TILE_TOKENS
        # (kv_heads, rows, D): row g * L + t of a KV head is query head g of its group, chunk token t
        mQ = cute.make_tensor(q, cute.make_ordered_layout((kv_heads, rows, D), (2, 1, 0)))
        mK, mV = (self.pool(codes, params, c, num_pages, kv_heads, page_size, tiles_per_page)
                  for codes, params, c in ((k_codes, k_params, cfg.k), (v_codes, v_params, cfg.v)))
        mPages = cute.make_tensor(page_table, cute.make_layout((tiles // tiles_per_page + 1,)))
        # (splits, kv_heads, rows, D) and (splits, kv_heads, rows)
        mOut = cute.make_tensor(out, cute.make_ordered_layout((splits, kv_heads, rows, D), (3, 2, 1, 0)))
        mLse = cute.make_tensor(lse, cute.make_ordered_layout((splits, kv_heads, rows), (2, 1, 0)))
        sQ_layout, sKV_layout = self.layouts()
        fields = {
            "barriers": cute.struct.MemRange[cutlass.Int64, 2 * STAGES],  # the ring: full, then empty
            "k_codes": cute.struct.Align[cute.struct.MemRange[Int32, cfg.k.tile_words], 16],
            "v_codes": cute.struct.Align[cute.struct.MemRange[Int32, cfg.v.tile_words], 16],
            "q": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], ROW_BYTES_ALIGN],
            "k": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], ROW_BYTES_ALIGN],
            "v": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], ROW_BYTES_ALIGN],
        }
        SharedStorage = cute.struct(type("PrefillStorage", (), {"__annotations__": fields}))
        qk, pv = self.tiled_mmas()
        grid = [(rows + TILE_ROWS - 1) // TILE_ROWS, kv_heads, splits]
        self.kernel(qk, pv, SharedStorage, sQ_layout, sKV_layout, mQ, mK, mV, mPages, mOut, mLse, tiles,
                    tiles_per_page, tiles_per_split, rows, sm_scale * Float32(LOG2E)).launch(
            grid=grid, block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @staticmethod
    def pool(codes, params, c: DequantizeConfig, num_pages, kv_heads, page_size, tiles_per_page):
        """(codes (num_pages, kv_heads, tiles_per_page, tile_words), params as the dequantize kernel's)."""
        mCodes = cute.make_tensor(codes, cute.make_ordered_layout(
            (num_pages, kv_heads, tiles_per_page, c.tile_words), (3, 2, 1, 0)))
        shape = (num_pages, kv_heads, *params_shape(c.axis, c.group, page_size, c.head_dim), c.param_fields)
        mParams = cute.make_tensor(params, cute.make_ordered_layout(shape, (4, 3, 2, 1, 0)))
        return mCodes, mParams

    @cute.kernel
    def kernel(self, qk: cute.TiledMma, pv: cute.TiledMma, SharedStorage: cutlass.Constexpr, sQ_layout, sKV_layout,
               mQ: cute.Tensor, mK, mV, mPages: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor, tiles: Int32,
               tiles_per_page: Int32, tiles_per_split: Int32, rows: Int32, scale_log2: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row_tile, head, split = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        ring = PipelineAsync.create(
            num_stages=STAGES, producer_group=CooperativeGroup(Agent.Thread, CONVERTER_THREADS),
            consumer_group=CooperativeGroup(Agent.Thread, CONVERTER_THREADS * CONSUMER_WARPGROUPS),
            barrier_storage=storage.barriers.data_ptr())
        sQ = storage.q.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.k.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.v.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        first = split * tiles_per_split
        count = cutlass.min(tiles, first + tiles_per_split) - first
        if warp < 4:
            self.convert(mK, mV, mPages, storage, sK, sV, ring, head, first, count, tiles_per_page, tidx)
        else:
            ctidx = tidx - CONVERTER_THREADS
            self.load_q(mQ[head, None, None], sQ, row_tile, rows, ctidx)
            self.attend(qk, pv, sQ, sK, sV, ring, count, scale_log2, mOut[split, head, None, None],
                        mLse[split, head, None], row_tile, rows, ctidx)

    @cute.jit
    def convert(self, mK, mV, mPages: cute.Tensor, storage, sK: cute.Tensor, sV: cute.Tensor, ring: PipelineAsync,
                head: Int32, first: Int32, count: Int32, tiles_per_page: Int32, tidx: Int32):
        """The converter warpgroup: each tile of the split dequantized into a ring stage (the module docstring)."""
        kc, vc = _Converter.of(self.cfg.k, tidx), _Converter.of(self.cfg.v, tidx)
        sKc = storage.k_codes.get_tensor(cute.make_layout((self.cfg.k.tile_words,)))
        sVc = storage.v_codes.get_tensor(cute.make_layout((self.cfg.v.tile_words,)))
        staging = NamedBarrier(PrefillBarrier.CONVERTER, CONVERTER_THREADS)
        state = make_pipeline_state(PipelineUserType.Producer, STAGES)
        for i in cutlass.range(count, unroll=1):
            tile = first + i
            page = mPages[tile // tiles_per_page]
            tile_in_page = tile % tiles_per_page
            k_words, k_params = kc.load(*mK, page, head, tile_in_page, tidx)
            v_words, v_params = vc.load(*mV, page, head, tile_in_page, tidx)
            staging.arrive_and_wait()  # the previous tile's words are read
            kc.dq.store_words(k_words, sKc, tidx)
            vc.dq.store_words(v_words, sVc, tidx)
            staging.arrive_and_wait()
            ring.producer_acquire(state)
            kc.write(k_params, sKc, sK[None, None, state.index])
            vc.write(v_params, sVc, sV[None, None, state.index])
            cute.arch.fence_view_async_shared()  # the generic-proxy stores, before wgmma's async reads
            ring.producer_commit(state)
            state.advance()

    @cute.jit
    def load_q(self, gQ: cute.Tensor, sQ: cute.Tensor, row_tile: Int32, rows: Int32, ctidx: Int32):
        """The CTA's 128 query rows into ``sQ``, 16 bytes a copy; rows past ``rows`` zero."""
        chunks = self.D // 8
        for j in cutlass.range_constexpr(TILE_ROWS * chunks // (CONVERTER_THREADS * CONSUMER_WARPGROUPS)):
            v = j * CONVERTER_THREADS * CONSUMER_WARPGROUPS + ctidx
            r, c = v // chunks, v % chunks
            row = row_tile * TILE_ROWS + r
            vals = cute.make_rmem_tensor((8,), self.dtype)
            vals.fill(0.0)
            if row < rows:
                cute.autovec_copy(cute.zipped_divide(gQ[row, None], (8,))[None, c], vals)
            cute.autovec_copy(vals, cute.zipped_divide(sQ[r, None], (8,))[None, c])
        cute.arch.fence_view_async_shared()
        NamedBarrier(PrefillBarrier.CONSUMERS, CONVERTER_THREADS * CONSUMER_WARPGROUPS).arrive_and_wait()

    @cute.jit
    def attend(self, qk: cute.TiledMma, pv: cute.TiledMma, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
               ring: PipelineAsync, count: Int32, scale_log2: Float32, gOut: cute.Tensor, gLse: cute.Tensor,
               row_tile: Int32, rows: Int32, ctidx: Int32):
        """A consumer warpgroup: its 64 rows over the split's tiles, then their output and LSE."""
        wg = ctidx // CONVERTER_THREADS
        wg_threads = cute.make_layout(CONSUMER_WARPGROUPS, stride=CONVERTER_THREADS)
        wg_qk, wg_pv = qk.get_slice(wg_threads(wg)), pv.get_slice(wg_threads(wg))
        sVt = cute.composition(sV, cute.make_ordered_layout((self.D, TILE_N, STAGES), order=(1, 0, 2)))
        # (MMA, MMA_M, MMA_K) and (MMA, MMA_N, MMA_K, STAGES)
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(sVt))
        acc_O = cute.make_rmem_tensor(wg_pv.partition_shape_C((TILE_ROWS, self.D)), Float32)
        acc_O.fill(0.0)
        # ((2 rows, MMA_M), (2 columns, N / 8, MMA_N)) views of the accumulators
        rows_per_thread = 2
        m_run = cute.make_rmem_tensor((rows_per_thread,), Float32)
        l_run = cute.make_rmem_tensor((rows_per_thread,), Float32)
        m_run.fill(-Float32.inf)
        l_run.fill(0.0)
        state = make_pipeline_state(PipelineUserType.Consumer, STAGES)
        for _ in cutlass.range(count, unroll=1):
            ring.consumer_wait(state)
            acc_S = cute.make_rmem_tensor(wg_qk.partition_shape_C((TILE_ROWS, TILE_N)), Float32)
            _gemm(qk, acc_S, tSrQ, tSrK[None, None, None, state.index], zero_init=True)
            S = cute.make_tensor(acc_S.iterator, _acc_mn(acc_S.layout))
            O = cute.make_tensor(acc_O.iterator, _acc_mn(acc_O.layout))
            for r in cutlass.range_constexpr(rows_per_thread):
                row_max = S[r, 0]
                for c in cutlass.range_constexpr(1, cute.size(S, mode=[1])):
                    row_max = cute.arch.fmax(row_max, S[r, c])
                row_max = cute.arch.fmax(row_max, cute.arch.shuffle_sync_bfly(row_max, offset=1))
                row_max = cute.arch.fmax(row_max, cute.arch.shuffle_sync_bfly(row_max, offset=2))
                m_new = cute.arch.fmax(m_run[r], row_max * scale_log2)
                alpha = rescale_factor(m_run[r], m_new)
                m_run[r] = m_new
                tile_sum = Float32(0.0)
                for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                    p = cute.math.exp2(S[r, c] * scale_log2 - m_new, fastmath=True)
                    S[r, c] = p
                    tile_sum += p
                l_run[r] = l_run[r] * alpha + tile_sum
                for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                    O[r, c] = O[r, c] * alpha
            tOrP = cute.make_rmem_tensor_like(cute.make_tensor(acc_S.iterator, _acc_frg_a(acc_S.layout)), self.dtype)
            tOrP.store(cute.make_tensor(acc_S.iterator, _acc_frg_a(acc_S.layout)).load().to(self.dtype))
            _gemm(pv, acc_O, tOrP, tOrVt[None, None, None, state.index], zero_init=False)
            ring.consumer_release(state)
            state.advance()
        self.store(pv.get_slice(ctidx), acc_O, m_run, l_run, gOut, gLse, row_tile, rows)

    @cute.jit
    def store(self, thr_pv, acc_O: cute.Tensor, m_run: cute.Tensor, l_run: cute.Tensor, gOut: cute.Tensor,
              gLse: cute.Tensor, row_tile: Int32, rows: Int32):
        """The rows' normalized output (q's dtype) and natural-log LSE, rows past ``rows`` not written. ``thr_pv``:
        the PV product's slice of this thread (the fragments' slices are the warpgroup's)."""
        O = cute.make_tensor(acc_O.iterator, _acc_mn(acc_O.layout))
        # (row, column) of each of this thread's accumulator elements, in the same view
        coords = thr_pv.partition_C(cute.make_identity_tensor((TILE_ROWS, self.D)))
        C = cute.make_tensor(coords.iterator, _acc_mn(coords.layout))
        lane = cute.arch.lane_idx()
        for r in cutlass.range_constexpr(cute.size(O, mode=[0])):
            total = l_run[r]
            total += cute.arch.shuffle_sync_bfly(total, offset=1)
            total += cute.arch.shuffle_sync_bfly(total, offset=2)
            inv_l, lse = normalize(total, m_run[r])
            row = row_tile * TILE_ROWS + C[r, 0][0]
            if row < rows:
                for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                    gOut[row, C[r, c][1]] = (O[r, c] * inv_l).to(self.dtype)
                if lane % 4 == 0:
                    gLse[row] = lse


def _gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor, zero_init: bool):
    """``acc (+)= A B`` over the k blocks, as one wgmma group, waited for (quack's ``sm90_utils.gemm``)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in range(cute.size(tA.shape[2])):
        cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    warpgroup.wait_group(0)


def _acc_mn(acc_layout: cute.Layout) -> cute.Layout:
    """A wgmma accumulator's ((2, 2, N/8), MMA_M, MMA_N) as ((2 rows, MMA_M), (2 columns, N/8, MMA_N)) (quack's
    ``layout_utils.convert_layout_acc_mn``)."""
    flat = cute.make_layout(acc_layout.shape)
    shape = ((flat.shape[0][1], flat.shape[1]), (flat.shape[0][0], flat.shape[0][2], flat.shape[2]))
    stride = ((flat.stride[0][1], flat.stride[1]), (flat.stride[0][0], flat.stride[0][2], flat.stride[2]))
    return cute.composition(acc_layout, cute.make_layout(shape, stride=stride))


def _acc_frg_a(acc_layout: cute.Layout) -> cute.Layout:
    """A 16-bit wgmma accumulator ((2, 2, N/8), MMA_M, MMA_N) as the A fragment of the next product ((2, 2, 2),
    MMA_M, (N/16, MMA_N)) (quack's ``layout_utils.convert_layout_acc_frgA``; N/8 even here)."""
    split = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    return cute.make_layout(
        ((split.shape[0][0], split.shape[0][1], split.shape[0][2][0]), split.shape[1],
         (split.shape[0][2][1], split.shape[2])),
        stride=((split.stride[0][0], split.stride[0][1], split.stride[0][2][0]), split.stride[1],
                (split.stride[0][2][1], split.stride[2])))


def compile_prefill(cfg: PrefillConfig, arch: str = "sm_90a"):
    """Compile (no GPU needed) with PTX and cubin kept (``foscar.inspect``)."""
    from ..inspect import compile_for
    from ..jit import fake_ptr

    i32 = Int32(1)
    return compile_for(arch, HopperPackedPrefill(cfg), fake_ptr(cfg.dtype), fake_ptr(Int32), fake_ptr(cutlass.Float16),
                       fake_ptr(Int32), fake_ptr(cutlass.Float16), fake_ptr(Int32), fake_ptr(cfg.dtype),
                       fake_ptr(Float32), i32, i32, i32, i32, i32, i32, i32, Float32(1.0), cuda.CUstream(0))


def run_prefill(q_rows, k_codes, k_params, v_codes, v_params, page_row, tokens: int, sm_scale: float, scheme: Scheme,
                layout: str = "hopper"):
    """Launch on checked CUDA tensors of a cache layer (``PagedKVCache`` checks them): ``q_rows [kv_heads, rows, D]``
    (contiguous, bf16 or fp16: row ``g * L + t`` of a KV head) over the first ``tokens`` (a positive multiple of 64)
    tokens of the pages ``page_row [pages]`` (int32, contiguous). Returns the splits' ``(out [splits, kv_heads,
    rows, D]`` in q's dtype, ``lse [splits, kv_heads, rows]`` fp32, natural log of the scaled scores)."""
    import torch

    from ..jit import cached_compile, device_arch, launch, sm_count

    kv_heads, rows, d = q_rows.shape
    if tokens <= 0 or tokens % TILE_TOKENS:
        raise ValueError(f"tokens: the prefill kernel attends whole {TILE_TOKENS}-token tiles, got {tokens}")
    dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[q_rows.dtype]
    cfg = prefill_config(scheme, dtype, layout)
    tiles, page_size = tokens // TILE_TOKENS, k_codes.shape[2] * TILE_TOKENS
    per_split = -(-tiles // prefill_splits(-(-rows // TILE_ROWS), kv_heads, tiles, sm_count(q_rows.device)))
    splits = -(-tiles // per_split)
    out = torch.empty(splits, kv_heads, rows, d, dtype=q_rows.dtype, device=q_rows.device)
    lse = torch.empty(splits, kv_heads, rows, dtype=torch.float32, device=q_rows.device)
    arch = device_arch(q_rows.device)
    compiled = cached_compile(("hopper_prefill", cfg, arch), lambda: compile_prefill(cfg, arch))
    launch(compiled, (q_rows, cfg.dtype), (k_codes, Int32), (k_params, cutlass.Float16), (v_codes, Int32),
           (v_params, cutlass.Float16), (page_row, Int32), (out, cfg.dtype), (lse, Float32), k_codes.shape[0],
           kv_heads, page_size, rows, tiles, per_split, splits, (sm_scale, Float32))
    return out, lse
