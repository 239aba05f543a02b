"""Hopper (sm_90a) fused decode attention over a paged INT2/INT4 KV cache (affine folding).

One CTA = one (split, kv_head, batch) triple: it attends the R = gqa_ratio query heads of one KV
head over a contiguous range of 64-token tiles of one sequence. Everything runs swap-AB so that
the cache sits on the wgmma M side and the few query rows are N (padded to 8 or 16):

    S^T [64 tokens  x N] = K_tile  [64 x D]  . Q^T [D x N]         (A = K codes, registers)
    O^T [D channels x N] = V^T_tile[D x 64] . P^T [64 x N]         (A = V codes, registers)

A comes from registers (RS wgmma): each consumer thread loads its packed words from the
shared-memory ring (the packed order *is* the wgmma A-fragment order, foscar/layouts/fragment.py,
so a 16-byte ld.shared per thread is conflict-free) and turns
two codes into one f16x2 register with one shift and one LOP3 (foscar.operands.HopperRecipe):

    op = ((word >> (bits*k - (10-bits))) & mask) | 0x3C003C00 = f16x2(1 + c/2^bits)

so a code c with (scale s, offset z) is x = s'*op + z' with s' = 2^bits*s, z' = z - 2^bits*s.
B (Q^T, or the scaled Q^T of channel-wise K; P^T, or the per-channel-block scaled P^T of
token-wise V) lives in shared memory, K-major, 128B-swizzled.

The four folding cases (design.md), per query column r, token l, channel d:
  * K token-wise:  S = sum_j s'[l,j]*acc_j + z'[l,j]*Qsum[r,j]   (one accumulator per block j)
  * K channel-wise: B = Q^T scaled by s'[d,t] per token group t (one sQ stage per group in the
    tile), plus sum_d z'[d,t] q[r,d] per group; G=32 -> 2 groups per tile, MMA per group, select.
  * V token-wise:  B = P^T scaled per token by s'[l,j], one sP stage per channel block j, plus
    sum_l z'[l,j] P[l,r] added to every channel of block j (accumulated per thread, reduced once
    at the end); G<64 -> an m64 channel tile spans 64/G blocks: MMA per block, select rows.
  * V channel-wise: O += s'[d,t]*(PV over token group t) + z'[d,t]*Psum[r,t].
All corrections in FP32; softmax in the log2 domain with sm_scale*log2(e) folded into the score.
The MMAs run in FP16 (not BF16): the scaled other operand (Q*s' or P*s') is rounded to the MMA
type, and FP16's 3 extra mantissa bits keep that rounding 4x below BF16's (foscar.operands).

Structure: warp-specialized. Warpgroup 0 is the producer: one thread walks the CTA's tiles and
issues 1-D bulk copies (``cp.async.bulk``, TMA engine) of each tile's K codes, V codes, K params
and V params into a ``STAGES``-deep shared-memory ring guarded by mbarriers (foscar/pipeline.py);
the page-table entries come in 32 at a time, one per lane of the producer warp.
Warpgroups 1..NC are consumers: consumer c takes runs c, c+NC, ... of TPG consecutive tiles
(TPG = G/64 for channel-wise K groups of G >= 128 tokens, so the scaled Q^T is built once per
group; else 1), builds the FP16 operands, runs the RS wgmmas, the FP32 corrections and the online
softmax, and releases the stage. ``setmaxnreg`` moves registers from the producer to the
consumers (ptxas keeps it only with ``.minnctapersm``, hence ``min_blocks_per_mp=1``). At the end the consumers merge their partial
(O, m, l) through shared memory and consumer 0 writes the result.
Split-KV: grid.x = splits; with splits > 1 the kernel writes normalized fp32 partial outputs
[B, Hq, S, D] and lse [B, Hq, S] (natural log; -inf and zeros for an empty split); with
split=False it writes o [B, Hq, D] (q's dtype) and lse fp32 [B, Hq].
"""

from __future__ import annotations

import operator

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float16, Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..device import LN2, LOG2E, NEG_INF, fsel, reduce_over_rows
from ..layouts.fragment import THREADS, TILE_TOKENS, TileGeometry
from ..operands import EXACT_CANCEL_MIN_SCALE, FP16_ONE_X2, HopperRecipe
from ..pipeline import bulk_copy_g2s, stage_and_phase
from ..scheme import Axis, Scheme

BAR_MERGE = 1  # named barrier of all consumer warpgroups (id 0 is sync_threads)
BAR_CONSUMER0 = 2  # consumer warpgroup c uses named barrier BAR_CONSUMER0 + c
REGISTERS = 64 * 1024  # per SM
PRODUCER_REGS = 40  # setmaxnreg of the producer warpgroup
RING_BYTES = 96 * 1024  # shared-memory budget of the stage ring
MAX_STAGES = 16


class DecodeConfig:
    """Static configuration derived from a Scheme and a page size (everything compile-time)."""

    def __init__(self, scheme: Scheme, page_size: int, split: bool, consumers: int):

        if page_size % TILE_TOKENS or page_size not in (64, 128, 256):
            raise ValueError(f"page_size must be 64, 128 or 256, got {page_size}")
        if consumers not in (1, 2, 3):
            raise ValueError(f"consumers must be 1, 2 or 3 warpgroups, got {consumers}")
        if not 1 <= scheme.gqa_ratio <= 16:
            raise NotImplementedError("the Hopper kernel supports gqa_ratio 1..16")
        for name, quant in (("k", scheme.k), ("v", scheme.v)):
            if quant.axis is Axis.CHANNEL and page_size % quant.group:
                raise ValueError(f"channel-wise {name} group {quant.group} must divide page_size {page_size}")
        self.scheme = scheme
        self.page_size = page_size
        self.split = bool(split)
        self.bits = scheme.bits
        self.D = scheme.head_dim
        self.R = scheme.gqa_ratio
        self.N = 8 if self.R <= 8 else 16  # wgmma N: query rows padded to a multiple of 8
        self.NS = self.N // 4  # distinct query columns per thread in an m64xN accumulator
        self.kgeom = TileGeometry("k", self.bits, self.D)
        self.vgeom = TileGeometry("v", self.bits, self.D)
        self.TW = self.kgeom.words  # int32 words per packed 64-token tile (same for k and v)
        self.WPT = self.kgeom.words_per_thread
        self.CW = self.kgeom.vector_words
        self.SUB = page_size // TILE_TOKENS  # tiles per page
        self.KB_D = self.D // 16  # k16 blocks over head_dim (QK reduction)
        self.KB_T = TILE_TOKENS // 16  # k16 blocks over a tile's tokens (PV reduction)
        self.MT_V = self.D // 64  # m64 channel tiles of V^T
        self.ppw = 16 // self.bits  # fragment registers per packed word
        recipe = HopperRecipe(self.bits)
        self.mask = recipe.mask
        self.shifts = tuple(recipe.right_shift(k) for k in range(self.ppw))  # per register slot
        self.q_dtype = self.cute_dtype(scheme.q_dtype)
        # K
        self.k_token = scheme.k.axis is Axis.TOKEN
        self.GK = scheme.k.group
        self.NJK = self.D // self.GK if self.k_token else 0  # channel blocks (token-wise K)
        self.NGK = max(1, TILE_TOKENS // self.GK) if not self.k_token else 0  # token groups per tile
        self.KPG = 0 if self.k_token else self.page_size // self.GK  # token groups per page
        # V
        self.v_token = scheme.v.axis is Axis.TOKEN
        self.GV = scheme.v.group
        self.NJV = self.D // self.GV if self.v_token else 0
        self.NGV = max(1, TILE_TOKENS // self.GV) if not self.v_token else 0
        self.VPG = 0 if self.v_token else self.page_size // self.GV
        # shared-memory stages of the B operands
        self.Q_STAGES = 1 if self.k_token else self.NGK
        # consecutive tiles of one channel-wise K group: a consumer takes them in a run and scales Q once
        self.TPG = 1 if self.k_token else max(1, self.GK // TILE_TOKENS)
        self.P_STAGES = self.NJV if self.v_token else 1
        self.QD = self.N * self.D // THREADS  # q elements each thread stages
        # warp specialization: producer warpgroup 0, consumer warpgroups 1..NC
        self.NC = consumers
        self.threads = THREADS * (1 + consumers)
        self.consumer_regs = min(240, (REGISTERS - THREADS * PRODUCER_REGS) // (THREADS * consumers) // 8 * 8)
        # stage of the ring (int32 words): K codes | V codes | K params | V params
        self.KPW = 64 * self.NJK if self.k_token else self.NGK * self.D  # one (s, z) fp16 pair per word
        self.VPW = 64 * self.NJV if self.v_token else self.NGV * self.D
        self.K_CODES, self.V_CODES = 0, self.TW
        self.K_PARAMS = 2 * self.TW
        self.V_PARAMS = self.K_PARAMS + self.KPW
        self.STAGE_WORDS = self.V_PARAMS + self.VPW
        self.STAGE_BYTES = 4 * self.STAGE_WORDS
        self.STAGES = max(2 * consumers, min(MAX_STAGES, RING_BYTES // self.STAGE_BYTES))

    @staticmethod
    def cute_dtype(torch_dtype):
        import torch

        return BFloat16 if torch_dtype == torch.bfloat16 else Float16



def _shift_mask(word, sh: int, mask: int):
    """f16x2 operand of two codes: ((word >> sh) & mask) | 1.0x2 -- one SHF + one LOP3.

    The AND and the OR are fused explicitly (LUT 0xEA = (a & b) | c): left to itself the compiler
    emits two LOP3s.
    """
    w = Uint32(word)
    if sh > 0:
        x = w >> sh
    elif sh < 0:
        x = w << (-sh)
    else:
        x = w
    return Int32(cute.arch.lop3(Uint32(x), Uint32(mask), Uint32(FP16_ONE_X2), 0xEA))


class HopperDecodeKernel:
    """Fused paged INT2/INT4 decode attention for sm_90a (see the module docstring)."""

    def __init__(self, cfg: DecodeConfig):
        self.cfg = cfg

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer,  # bf16 [B, Hq, D]
        kc_ptr: cute.Pointer,  # int32 [P, H, SUB, TW]
        kp_ptr: cute.Pointer,  # fp16 token [P, H, PS, D/G, 2] | channel [P, H, PS/G, D, 2]
        vc_ptr: cute.Pointer,
        vp_ptr: cute.Pointer,
        pt_ptr: cute.Pointer,  # int32 [B, max_pages]
        len_ptr: cute.Pointer,  # int32 [B]
        o_ptr: cute.Pointer,  # bf16 [B, Hq, D] | fp32 [B, Hq, S, D]
        lse_ptr: cute.Pointer,  # fp32 [B, Hq] | [B, Hq, S]
        batch: Int32,
        kv_heads: Int32,
        max_pages: Int32,
        num_splits: Int32,
        sm_scale: Float32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        NC = cfg.NC
        # One tiled MMA serves both GEMMs: m64 x N x k16, A (fp16) from registers, B K-major smem.
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            Float16,
            Float16,
            OperandMajorMode.K,
            OperandMajorMode.K,
            Float32,
            (1, 1, 1),
            (64, cfg.N),
            warpgroup.OperandSource.RMEM,
        )
        # (N, D, Q_STAGES*NC): Q^T (or scaled Q^T per token group) of each consumer, K-major, swizzled
        sQ_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (64, cfg.N, cfg.D), Float16, cfg.Q_STAGES * NC)
        # (N, 64, P_STAGES*NC): P^T (or scaled P^T per channel block) of each consumer
        sP_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (64, cfg.N, TILE_TOKENS), Float16, cfg.P_STAGES * NC
        )
        n_qpart = cfg.N * cfg.D // 32 * max(1, cfg.NGK)  # per-warp partial dot products (Qsum / q.z')
        n_red = 4 * cfg.N * max(1, cfg.NJV)
        n_merge = THREADS * (cfg.MT_V * 2 + 2) * cfg.NS  # per thread: output values, m, l

        @cute.struct
        class SharedStorage:
            ring: cute.struct.Align[cute.struct.MemRange[Int32, cfg.STAGES * cfg.STAGE_WORDS], 1024]
            full: cute.struct.MemRange[Int64, cfg.STAGES]
            empty: cute.struct.MemRange[Int64, cfg.STAGES]
            sQ: cute.struct.Align[cute.struct.MemRange[Float16, cute.cosize(sQ_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[Float16, cute.cosize(sP_layout)], 1024]
            sQpart: cute.struct.Align[cute.struct.MemRange[Float32, n_qpart * NC], 16]
            sRed: cute.struct.Align[cute.struct.MemRange[Float32, n_red * NC], 16]
            sRed2: cute.struct.Align[cute.struct.MemRange[Float32, 4 * cfg.N * NC], 16]
            sMerge: cute.struct.Align[cute.struct.MemRange[Float32, n_merge * max(1, NC - 1)], 16]

        scale_log2 = sm_scale * LOG2E
        self.kernel(
            tiled_mma,
            sQ_layout,
            sP_layout,
            SharedStorage,
            q_ptr,
            kc_ptr,
            kp_ptr,
            vc_ptr,
            vp_ptr,
            pt_ptr,
            len_ptr,
            o_ptr,
            lse_ptr,
            kv_heads,
            max_pages,
            num_splits,
            scale_log2,
        ).launch(
            grid=(num_splits, kv_heads, batch),
            block=(cfg.threads, 1, 1),
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,  # with reqntid: ptxas keeps setmaxnreg and allocates per role
        )

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
        q_ptr: cute.Pointer,
        kc_ptr: cute.Pointer,
        kp_ptr: cute.Pointer,
        vc_ptr: cute.Pointer,
        vp_ptr: cute.Pointer,
        pt_ptr: cute.Pointer,
        len_ptr: cute.Pointer,
        o_ptr: cute.Pointer,
        lse_ptr: cute.Pointer,
        kv_heads: Int32,
        max_pages: Int32,
        num_splits: Int32,
        scale_log2: Float32,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        split, h, b = cute.arch.block_idx()
        role = cute.arch.make_warp_uniform(tidx // THREADS)  # 0: producer, 1..NC: consumer role-1

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        full = storage.full.data_ptr()  # (STAGES,) mbarriers: stage filled
        empty = storage.empty.data_ptr()  # (STAGES,) mbarriers: stage read
        if tidx == 0:
            for s in cutlass.range_constexpr(cfg.STAGES):
                cute.arch.mbarrier_init(full + s, 1)
                cute.arch.mbarrier_init(empty + s, THREADS)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # ---------------------------------------------------------------- split range
        length = cute.make_tensor(len_ptr + b, cute.make_layout((1,)))[0]  # lengths[b]
        n_tiles = (length + TILE_TOKENS - 1) // TILE_TOKENS
        # whole runs of TPG tiles per split, so that a split starts at a K group boundary
        per_split = ((n_tiles + num_splits - 1) // num_splits + cfg.TPG - 1) // cfg.TPG * cfg.TPG
        t_begin = split * per_split
        t_end = cutlass.min(t_begin + per_split, n_tiles)

        if role == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if tidx < 32:
                self.produce(storage.ring.data_ptr(), full, empty, kc_ptr, kp_ptr, vc_ptr, vp_ptr, pt_ptr, b, h,
                             kv_heads, max_pages, t_begin, t_end, tidx)
        else:
            cute.arch.setmaxregister_increase(cfg.consumer_regs)
            self.consume(tiled_mma, sQ_layout, sP_layout, storage, full, empty, q_ptr, o_ptr, lse_ptr, length, b, h,
                         split, kv_heads, num_splits, t_begin, t_end, scale_log2, role - 1, tidx % THREADS)

    # ------------------------------------------------------------------------------------------
    # producer: one warp; lane 0 issues the bulk copies
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def produce(self, ring: cute.Pointer, full: cute.Pointer, empty: cute.Pointer, kc_ptr: cute.Pointer,
                kp_ptr: cute.Pointer, vc_ptr: cute.Pointer, vp_ptr: cute.Pointer, pt_ptr: cute.Pointer, b: Int32,
                h: Int32, kv_heads: Int32, max_pages: Int32, t_begin: Int32, t_end: Int32, lane: Int32):
        cfg = self.cfg
        SUB = cfg.SUB
        page_first = t_begin // SUB
        page_end = (t_end + SUB - 1) // SUB
        for chunk in cutlass.range(page_first, page_end, 32, unroll=1):
            # lane l holds the page of the chunk's l-th logical page (clamped into the range)
            my_page = mPT_load(pt_ptr, b.to(Int64) * max_pages + cutlass.min(chunk + lane, page_end - 1))
            tile_lo = cutlass.max(t_begin, chunk * SUB)
            tile_hi = cutlass.min(t_end, (chunk + 32) * SUB)
            for tile in cutlass.range(tile_lo, tile_hi, 1, unroll=1):
                page = cute.arch.shuffle_sync(my_page, offset=tile // SUB - chunk)
                if lane == 0:
                    s, phase = stage_and_phase(tile - t_begin, cfg.STAGES)
                    cute.arch.mbarrier_wait(empty + s, phase ^ 1)
                    cute.arch.mbarrier_arrive_and_expect_tx(full + s, cfg.STAGE_BYTES)
                    head = page.to(Int64) * kv_heads + h  # (page, kv_head) index
                    slot0 = (tile % SUB) * TILE_TOKENS  # first slot of the tile in its page
                    dst = ring + cute.assume(s * cfg.STAGE_WORDS, divby=4)
                    codes = (head * SUB + tile % SUB) * cfg.TW
                    bulk_copy_g2s(dst + cfg.K_CODES, kc_ptr + codes, 4 * cfg.TW, full + s)
                    bulk_copy_g2s(dst + cfg.V_CODES, vc_ptr + codes, 4 * cfg.TW, full + s)
                    bulk_copy_g2s(dst + cfg.K_PARAMS, kp_ptr + 2 * self.params_row(head, slot0, "k"), 4 * cfg.KPW, full + s)
                    bulk_copy_g2s(dst + cfg.V_PARAMS, vp_ptr + 2 * self.params_row(head, slot0, "v"), 4 * cfg.VPW, full + s)

    def params_row(self, head, slot0, which):
        """Index of the first (scale, offset) pair of a tile's params (token rows or token groups)."""
        cfg = self.cfg
        token = cfg.k_token if which == "k" else cfg.v_token
        if token:
            per_token = cfg.NJK if which == "k" else cfg.NJV
            return (head * cfg.page_size + slot0) * per_token
        group, groups_per_page = (cfg.GK, cfg.KPG) if which == "k" else (cfg.GV, cfg.VPG)
        return (head * groups_per_page + slot0 // group) * cfg.D

    # ------------------------------------------------------------------------------------------
    # consumer warpgroup c: local tiles c, c+NC, ...
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consume(self, tiled_mma: cute.TiledMma, sQ_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout,
                storage, full: cute.Pointer, empty: cute.Pointer, q_ptr: cute.Pointer, o_ptr: cute.Pointer,
                lse_ptr: cute.Pointer, length: Int32, b: Int32, h: Int32, split: Int32, kv_heads: Int32,
                num_splits: Int32, t_begin: Int32, t_end: Int32, scale_log2: Float32, c: Int32, tidx: Int32):
        cfg = self.cfg
        N, NS, D, R, NC = cfg.N, cfg.NS, cfg.D, cfg.R, cfg.NC
        bits = cfg.bits
        two_b = float(1 << bits)
        bar = BAR_CONSUMER0 + c  # this warpgroup's named barrier
        warp = tidx // 32
        lane = tidx % 32
        g = lane // 4
        tq = lane % 4

        # ---------------------------------------------------------------- shared memory
        ring = storage.ring.data_ptr()
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (N, D, Q_STAGES*NC)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)  # (N, 64, P_STAGES*NC)
        q_stage0 = c * cfg.Q_STAGES
        p_stage0 = c * cfg.P_STAGES
        n_qpart = N * D // 32 * max(1, cfg.NGK)
        n_red = 4 * N * max(1, cfg.NJV)
        sQpart = cute.make_tensor(storage.sQpart.data_ptr() + c * n_qpart, cute.make_layout(n_qpart))
        sRed = cute.make_tensor(storage.sRed.data_ptr() + c * n_red, cute.make_layout(n_red))  # (warp, [j,] col)
        sRed2 = cute.make_tensor(storage.sRed2.data_ptr() + c * 4 * N, cute.make_layout(4 * N))  # (warp, col)

        # ---------------------------------------------------------------- MMA partitions
        thr_mma = tiled_mma.get_slice(tidx)
        tCsQ = thr_mma.partition_B(sQ)  # (MMA, MMA_N=1, KB_D, Q_STAGES*NC)
        tCrQ = tiled_mma.make_fragment_B(tCsQ)  # descriptors (1, 1, KB_D, Q_STAGES*NC)
        tCsP = thr_mma.partition_B(sP)  # (MMA, 1, KB_T, P_STAGES*NC)
        tCrP = tiled_mma.make_fragment_B(tCsP)  # (1, 1, KB_T, P_STAGES*NC)
        shape_S = thr_mma.partition_shape_C((64, N))  # ((2,2,N/8), 1, 1) fp32 accumulator
        shape_AK = thr_mma.partition_shape_A((64, D))  # ((2,2,2), 1, KB_D) fp16 A fragment
        shape_AV = thr_mma.partition_shape_A((64, TILE_TOKENS))  # ((2,2,2), 1, KB_T)

        # Accumulator value i = e + 2*h_r + 4*nb sits at row 16*warp + g + 8*h_r and column
        # 8*nb + 2*tq + e; column slot cs = e + 2*nb (NS distinct query columns per thread).
        n_acc = N // 2
        cols = [8 * (cs // 2) + 2 * tq + (cs % 2) for cs in range(NS)]  # query column of slot cs

        Hq = kv_heads * R

        # ---------------------------------------------------------------- stage Q
        # thread element qe = tidx + 128*i of the (N, D) query block: row qr = qe // D, channel qe % D
        q_base = (b * Hq + h * R).to(Int64) * D
        qreg = cute.make_rmem_tensor((cfg.QD,), Float32)
        for i in cutlass.range_constexpr(cfg.QD):
            qe = tidx + THREADS * i
            qr = qe // D
            qd = qe % D
            qrc = cutlass.min(qr, R - 1)
            qv = cute.make_tensor(q_ptr + (q_base + qrc * D + qd), cute.make_layout((1,)))[0].to(Float32)
            qv = fsel(qr < R, qv, Float32(0.0))
            qreg[i] = qv
            if cutlass.const_expr(cfg.k_token):
                sQ[qr, qd, q_stage0] = qv.to(Float16)
                # per-warp partial of Qsum over 32 consecutive channels of one row (G >= 32)
                qs = cute.arch.warp_reduction(qv, lambda x, y: x + y)
                if lane == 0:
                    sQpart[qe // 32] = qs
        # Qsum[j][cs] for the thread's columns (token-wise K), from the per-warp partials
        qsum = cute.make_rmem_tensor((max(1, cfg.NJK) * NS,), Float32)
        if cutlass.const_expr(cfg.k_token):
            cute.arch.fence_proxy("async.shared", space="cta")  # sQ: generic writes -> wgmma reads
            cute.arch.barrier(barrier_id=bar, number_of_threads=THREADS)
            for j in cutlass.range_constexpr(cfg.NJK):
                for cs in cutlass.range_constexpr(NS):
                    qcol = cols[cs]
                    qacc = Float32(0.0)
                    for u in cutlass.range_constexpr(cfg.GK // 32):
                        qacc = qacc + sQpart[qcol * (D // 32) + j * (cfg.GK // 32) + u]
                    qsum[j * NS + cs] = qacc

        # ---------------------------------------------------------------- running state
        m_run = cute.make_rmem_tensor((NS,), Float32)  # running max (log2 domain), per column
        l_run = cute.make_rmem_tensor((NS,), Float32)  # per-thread partial row sum
        corr = cute.make_rmem_tensor((max(1, cfg.NJV) * NS,), Float32)  # per-thread sum_l z' P
        for cs in cutlass.range_constexpr(NS):
            m_run[cs] = Float32(NEG_INF)
            l_run[cs] = Float32(0.0)
        for x in cutlass.range_constexpr(max(1, cfg.NJV) * NS):
            corr[x] = Float32(0.0)
        accO = [tiled_mma.make_fragment_C(shape_S) for _ in range(cfg.MT_V)]  # (MMA,1,1) per m64
        for mt in cutlass.range_constexpr(cfg.MT_V):
            accO[mt].fill(0.0)

        rowt = [16 * warp + g + 8 * hr for hr in range(2)]  # the thread's two accumulator rows

        # consumer c takes runs c, c+NC, ... of TPG consecutive tiles (one K group shares its scaled Q)
        n_local = cutlass.max(t_end - t_begin, 0)
        n_runs = (n_local + cfg.TPG - 1) // cfg.TPG
        my_runs = (cutlass.max(n_runs - c, 0) + NC - 1) // NC
        for step in cutlass.range(0, my_runs * cfg.TPG, 1, unroll=1):
            local_tile = cfg.TPG * (c + NC * (step // cfg.TPG)) + step % cfg.TPG
            if local_tile < n_local:
                tok0 = (t_begin + local_tile) * TILE_TOKENS
                valid = length - tok0  # valid tokens in this tile (>= 1)
                ring_stage, ring_phase = stage_and_phase(local_tile, cfg.STAGES)
                cute.arch.mbarrier_wait(full + ring_stage, ring_phase)
                sbuf = ring + cute.assume(ring_stage * cfg.STAGE_WORDS, divby=4)  # the tile's stage
                kpar = cute.recast_ptr(sbuf + cfg.K_PARAMS, dtype=Float16)
                vpar = cute.recast_ptr(sbuf + cfg.V_PARAMS, dtype=Float16)

                # ------------------------------------------------ packed codes -> registers
                kw = load_words(sbuf + cfg.K_CODES, tidx, cfg)
                vw = load_words(sbuf + cfg.V_CODES, tidx, cfg)

                # ------------------------------------------------ K parameters
                if cutlass.const_expr(cfg.k_token):
                    # (hr, j): s' and z' of the thread's two tokens, scale_log2 folded in
                    ks = cute.make_rmem_tensor((2 * cfg.NJK,), Float32)
                    kz = cute.make_rmem_tensor((2 * cfg.NJK,), Float32)
                    for hr in cutlass.range_constexpr(2):
                        pbase = rowt[hr] * cfg.NJK * 2
                        for j in cutlass.range_constexpr(cfg.NJK):
                            s, z = load_param(kpar, pbase + 2 * j)
                            ks[hr * cfg.NJK + j] = s * (two_b * scale_log2)
                            kz[hr * cfg.NJK + j] = (z - two_b * s) * scale_log2
                else:
                    # scaled Q^T per token group of the tile into sQ[:, :, gi], plus the per-warp
                    # partials of the constant sum_d z'[d] q[r,d]. The constant is computed from the
                    # *rounded* scaled q as sum_d Qs[r,d] * (z'/s')[d], so that the bias of the
                    # operand (op = 1 + c/2^b) cancels exactly against the fp16 rounding of Qs:
                    # S = sum_d Qs[r,d] * x[d]/s'[d]. A tiny s' (Qs may be subnormal) falls back to q*z'.
                    if step % cfg.TPG == 0:  # first tile of a K group: scale Q for the group
                        nd = 2 if D > THREADS else 1  # distinct channels per thread (d = tidx % D + 128k)
                        for gi in cutlass.range_constexpr(cfg.NGK):
                            pbase = gi * D * 2
                            ksp = cute.make_rmem_tensor((nd,), Float32)
                            kzp = cute.make_rmem_tensor((nd,), Float32)
                            krt = cute.make_rmem_tensor((nd,), Float32)
                            for kd in cutlass.range_constexpr(nd):
                                s, z = load_param(kpar, pbase + 2 * ((tidx % min(D, THREADS)) + THREADS * kd))
                                ksp[kd] = s * (two_b * scale_log2)
                                kzp[kd] = (z - two_b * s) * scale_log2
                                krt[kd] = kzp[kd] * cute.arch.rcp_approx(fsel(ksp[kd] != Float32(0.0), ksp[kd], Float32(1.0)))
                            for i in cutlass.range_constexpr(cfg.QD):
                                kd = i % nd
                                e = tidx + THREADS * i
                                r = e // D
                                d = e % D
                                qs_b = (qreg[i] * ksp[kd]).to(Float16)
                                sQ[r, d, q_stage0 + gi] = qs_b
                                term = fsel(ksp[kd] >= Float32(EXACT_CANCEL_MIN_SCALE), qs_b.to(Float32) * krt[kd], qreg[i] * kzp[kd])
                                part = cute.arch.warp_reduction(term, lambda x, y: x + y)
                                if lane == 0:
                                    sQpart[gi * (N * D // 32) + e // 32] = part
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.barrier(barrier_id=bar, number_of_threads=THREADS)

                # ------------------------------------------------ S^T = K . Q^T
                tCrK = tiled_mma.make_fragment_A(shape_AK)  # ((2,2,2), 1, KB_D) fp16
                rK32 = cute.recast_tensor(tCrK, Int32)  # ((1,2,2), 1, KB_D): register reg + 4*kb
                for n in cutlass.range_constexpr(4 * cfg.KB_D):
                    rK32[n] = _shift_mask(kw[n // cfg.ppw], cfg.shifts[n % cfg.ppw], cfg.mask)
                n_kacc = cfg.NJK if cfg.k_token else cfg.NGK
                accS = [tiled_mma.make_fragment_C(shape_S) for _ in range(n_kacc)]
                warpgroup.fence()
                for a in cutlass.range_constexpr(n_kacc):
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                    if cutlass.const_expr(cfg.k_token):
                        kbs = range(a * cfg.GK // 16, (a + 1) * cfg.GK // 16)  # channel block j = a
                        stage = q_stage0
                    else:
                        kbs = range(cfg.KB_D)
                        stage = q_stage0 + a  # token group gi = a
                    for kb in kbs:
                        cute.gemm(tiled_mma, accS[a], tCrK[None, None, kb], tCrQ[None, None, kb, stage], accS[a])
                        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)

                # ------------------------------------------------ scores (log2 domain) + mask
                sc = cute.make_rmem_tensor((n_acc,), Float32)
                if cutlass.const_expr(not cfg.k_token):
                    # q.z' per token group and column, from the per-warp partials
                    qz = cute.make_rmem_tensor((cfg.NGK * NS,), Float32)
                    for gi in cutlass.range_constexpr(cfg.NGK):
                        for cs in cutlass.range_constexpr(NS):
                            col = cols[cs]
                            acc = Float32(0.0)
                            for u in cutlass.range_constexpr(D // 32):
                                acc = acc + sQpart[gi * (N * D // 32) + col * (D // 32) + u]
                            qz[gi * NS + cs] = acc
                for i in cutlass.range_constexpr(n_acc):
                    hr = (i // 2) % 2
                    cs = (i % 2) + 2 * (i // 4)
                    if cutlass.const_expr(cfg.k_token):
                        v = Float32(0.0)
                        for j in cutlass.range_constexpr(cfg.NJK):
                            v = v + ks[hr * cfg.NJK + j] * accS[j][i] + kz[hr * cfg.NJK + j] * qsum[j * NS + cs]
                    else:
                        if cutlass.const_expr(cfg.NGK == 1):
                            v = accS[0][i] + qz[cs]
                        else:
                            in1 = rowt[hr] >= cfg.GK  # G=32: rows 32..63 belong to group 1
                            v = fsel(in1, accS[1][i] + qz[NS + cs], accS[0][i] + qz[cs])
                    sc[i] = fsel(rowt[hr] < valid, v, Float32(NEG_INF))

                # ------------------------------------------------ column max over the 64 tokens
                tmax = cute.make_rmem_tensor((NS,), Float32)
                for cs in cutlass.range_constexpr(NS):
                    i0 = (cs % 2) + 4 * (cs // 2)
                    mx = cute.arch.fmax(sc[i0], sc[i0 + 2])
                    mx = reduce_over_rows(mx, cute.arch.fmax)
                    tmax[cs] = mx
                if g == 0:
                    for cs in cutlass.range_constexpr(NS):
                        sRed[warp * N + 8 * (cs // 2) + 2 * tq + (cs % 2)] = tmax[cs]
                cute.arch.barrier(barrier_id=bar, number_of_threads=THREADS)
                alpha = cute.make_rmem_tensor((NS,), Float32)
                for cs in cutlass.range_constexpr(NS):
                    col = cols[cs]
                    mx = cute.arch.fmax(
                        cute.arch.fmax(sRed[col], sRed[N + col]), cute.arch.fmax(sRed[2 * N + col], sRed[3 * N + col])
                    )
                    m_new = cute.arch.fmax(m_run[cs], mx)
                    alpha[cs] = cute.arch.exp2(m_run[cs] - m_new)
                    m_run[cs] = m_new
                    l_run[cs] = l_run[cs] * alpha[cs]

                # ------------------------------------------------ P = exp2(S - m), P^T -> smem
                if cutlass.const_expr(cfg.v_token):
                    vs = cute.make_rmem_tensor((2 * cfg.NJV,), Float32)
                    vz = cute.make_rmem_tensor((2 * cfg.NJV,), Float32)
                    vr = cute.make_rmem_tensor((2 * cfg.NJV,), Float32)
                    for hr in cutlass.range_constexpr(2):
                        pbase = rowt[hr] * cfg.NJV * 2
                        ok = rowt[hr] < valid
                        for j in cutlass.range_constexpr(cfg.NJV):
                            s, z = load_param(vpar, pbase + 2 * j)
                            vs[hr * cfg.NJV + j] = fsel(ok, s * two_b, Float32(0.0))
                            vz[hr * cfg.NJV + j] = fsel(ok, z - two_b * s, Float32(0.0))
                            # z'/s' (0 when s' = 0): the correction uses the rounded scaled P
                            vr[hr * cfg.NJV + j] = vz[hr * cfg.NJV + j] * cute.arch.rcp_approx(
                                fsel(vs[hr * cfg.NJV + j] != Float32(0.0), vs[hr * cfg.NJV + j], Float32(1.0))
                            )
                    for x in cutlass.range_constexpr(cfg.NJV * NS):
                        corr[x] = corr[x] * alpha[x % NS]
                psum = cute.make_rmem_tensor((NS,), Float32)  # per-thread sum of p (fp32)
                pgsum = cute.make_rmem_tensor((NS,), Float32)  # same of fp16(p) (channel-wise V)
                for cs in cutlass.range_constexpr(NS):
                    psum[cs] = Float32(0.0)
                    pgsum[cs] = Float32(0.0)
                for i in cutlass.range_constexpr(n_acc):
                    hr = (i // 2) % 2
                    cs = (i % 2) + 2 * (i // 4)
                    col = cols[cs]
                    p = cute.arch.exp2(sc[i] - m_run[cs])
                    psum[cs] = psum[cs] + p
                    if cutlass.const_expr(cfg.v_token):
                        # Ps = fp16(p*s'); correction Ps*(z'/s') so that O = sum_l Ps * x/s' exactly
                        # (the operand bias cancels against the rounding of Ps); p*z' for tiny s'.
                        for j in cutlass.range_constexpr(cfg.NJV):
                            x = hr * cfg.NJV + j
                            ps_b = (p * vs[x]).to(Float16)
                            sP[col, rowt[hr], p_stage0 + j] = ps_b
                            term = fsel(vs[x] >= Float32(EXACT_CANCEL_MIN_SCALE), ps_b.to(Float32) * vr[x], p * vz[x])
                            corr[j * NS + cs] = corr[j * NS + cs] + term
                    else:
                        # Psum from the rounded P, the values the MMA multiplies
                        p_b = p.to(Float16)
                        sP[col, rowt[hr], p_stage0] = p_b
                        pgsum[cs] = pgsum[cs] + p_b.to(Float32)
                for cs in cutlass.range_constexpr(NS):
                    l_run[cs] = l_run[cs] + psum[cs]
                    psum[cs] = pgsum[cs]
                if cutlass.const_expr(not cfg.v_token):
                    # Psum per token group: reduce over g (shuffles) then over warps (smem)
                    for cs in cutlass.range_constexpr(NS):
                        psum[cs] = reduce_over_rows(psum[cs], operator.add)
                    if g == 0:
                        for cs in cutlass.range_constexpr(NS):
                            sRed2[warp * N + 8 * (cs // 2) + 2 * tq + (cs % 2)] = psum[cs]
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=bar, number_of_threads=THREADS)

                # ------------------------------------------------ V parameters (channel-wise)
                if cutlass.const_expr(not cfg.v_token):
                    # Psum[gi][cs]
                    pgs = cute.make_rmem_tensor((cfg.NGV * NS,), Float32)
                    for gi in cutlass.range_constexpr(cfg.NGV):
                        for cs in cutlass.range_constexpr(NS):
                            col = cols[cs]
                            if cutlass.const_expr(cfg.NGV == 1):
                                pgs[cs] = sRed2[col] + sRed2[N + col] + sRed2[2 * N + col] + sRed2[3 * N + col]
                            else:
                                pgs[gi * NS + cs] = sRed2[(2 * gi) * N + col] + sRed2[(2 * gi + 1) * N + col]
                    # (mt, hr, gi): s', z' of the thread's channels for each token group of the tile
                    cvs = cute.make_rmem_tensor((cfg.MT_V * 2 * cfg.NGV,), Float32)
                    cvz = cute.make_rmem_tensor((cfg.MT_V * 2 * cfg.NGV,), Float32)
                    for gi in cutlass.range_constexpr(cfg.NGV):
                        ok = gi * cfg.GV < valid
                        pbase = gi * D * 2
                        for mt in cutlass.range_constexpr(cfg.MT_V):
                            for hr in cutlass.range_constexpr(2):
                                s, z = load_param(vpar, pbase + 2 * (mt * 64 + rowt[hr]))
                                x = (mt * 2 + hr) * cfg.NGV + gi
                                cvs[x] = fsel(ok, s * two_b, Float32(0.0))
                                cvz[x] = fsel(ok, z - two_b * s, Float32(0.0))

                cute.arch.mbarrier_arrive(empty + ring_stage)  # last read of the stage (codes and params are in registers)

                # ------------------------------------------------ O^T += V^T . P^T (+ corrections)
                tCrV = [tiled_mma.make_fragment_A(shape_AV) for _ in range(cfg.MT_V)]  # ((2,2,2),1,KB_T)
                for mt in cutlass.range_constexpr(cfg.MT_V):
                    rV32 = cute.recast_tensor(tCrV[mt], Int32)
                    for nn in cutlass.range_constexpr(4 * cfg.KB_T):
                        n = mt * 4 * cfg.KB_T + nn
                        rV32[nn] = _shift_mask(vw[n // cfg.ppw], cfg.shifts[n % cfg.ppw], cfg.mask)
                if cutlass.const_expr(cfg.v_token):
                    n_sub = max(1, 64 // cfg.GV)  # channel blocks per m64 tile
                else:
                    n_sub = cfg.NGV  # token groups per tile
                accV = [[tiled_mma.make_fragment_C(shape_S) for _ in range(n_sub)] for _ in range(cfg.MT_V)]
                warpgroup.fence()
                for mt in cutlass.range_constexpr(cfg.MT_V):
                    for a in cutlass.range_constexpr(n_sub):
                        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                        if cutlass.const_expr(cfg.v_token):
                            kbs = range(cfg.KB_T)
                            stage = p_stage0 + (mt * 64) // cfg.GV + a  # channel block j
                        else:
                            kbs = range(a * cfg.KB_T // n_sub, (a + 1) * cfg.KB_T // n_sub)  # token group
                            stage = p_stage0
                        for kb in kbs:
                            cute.gemm(tiled_mma, accV[mt][a], tCrV[mt][None, None, kb], tCrP[None, None, kb, stage], accV[mt][a])
                            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)

                for mt in cutlass.range_constexpr(cfg.MT_V):
                    for i in cutlass.range_constexpr(n_acc):
                        hr = (i // 2) % 2
                        cs = (i % 2) + 2 * (i // 4)
                        if cutlass.const_expr(cfg.v_token):
                            if cutlass.const_expr(n_sub == 1):
                                add = accV[mt][0][i]
                            else:
                                add = fsel(warp >= 2, accV[mt][1][i], accV[mt][0][i])
                        else:
                            add = Float32(0.0)
                            for gi in cutlass.range_constexpr(cfg.NGV):
                                x = (mt * 2 + hr) * cfg.NGV + gi
                                add = add + cvs[x] * accV[mt][gi][i] + cvz[x] * pgs[gi * NS + cs]
                        accO[mt][i] = accO[mt][i] * alpha[cs] + add

        # ---------------------------------------------------------------- epilogue
        # row sum l and (token-wise V) the offset correction: reduce over the 64 rows
        cute.arch.barrier(barrier_id=bar, number_of_threads=THREADS)
        for cs in cutlass.range_constexpr(NS):
            l_run[cs] = reduce_over_rows(l_run[cs], operator.add)
        if cutlass.const_expr(cfg.v_token):
            for x in cutlass.range_constexpr(cfg.NJV * NS):
                corr[x] = reduce_over_rows(corr[x], operator.add)
        if g == 0:
            for cs in cutlass.range_constexpr(NS):
                col = cols[cs]
                sRed2[warp * N + col] = l_run[cs]
                if cutlass.const_expr(cfg.v_token):
                    for j in cutlass.range_constexpr(cfg.NJV):
                        sRed[(warp * cfg.NJV + j) * N + col] = corr[j * NS + cs]
        cute.arch.barrier(barrier_id=bar, number_of_threads=THREADS)
        # this consumer's unnormalized output (offset correction of V added), per (mt, hr, cs)
        n_out = cfg.MT_V * 2 * NS
        outv = cute.make_rmem_tensor((n_out,), Float32)
        for cs in cutlass.range_constexpr(NS):
            col = cols[cs]
            l_run[cs] = sRed2[col] + sRed2[N + col] + sRed2[2 * N + col] + sRed2[3 * N + col]
            if cutlass.const_expr(cfg.v_token):
                for j in cutlass.range_constexpr(cfg.NJV):
                    corr[j * NS + cs] = (
                        sRed[(0 * cfg.NJV + j) * N + col]
                        + sRed[(1 * cfg.NJV + j) * N + col]
                        + sRed[(2 * cfg.NJV + j) * N + col]
                        + sRed[(3 * cfg.NJV + j) * N + col]
                    )
            for mt in cutlass.range_constexpr(cfg.MT_V):
                for hr in cutlass.range_constexpr(2):
                    val = accO[mt][(cs % 2) + 2 * hr + 4 * (cs // 2)]
                    if cutlass.const_expr(cfg.v_token):
                        if cutlass.const_expr(cfg.NJV == 1):
                            val = val + corr[cs]
                        else:
                            # block of channel d: static per (mt, warp-half) only when GV>=64
                            channel = mt * 64 + rowt[hr]
                            jsel = Float32(0.0)
                            for j in cutlass.range_constexpr(cfg.NJV):
                                jsel = fsel(channel // cfg.GV == j, corr[j * NS + cs], jsel)
                            val = val + jsel
                    outv[(mt * 2 + hr) * NS + cs] = val

        # ---------------------------------------------------------------- merge the consumers
        # consumers 1..NC-1 leave (outputs, m, l) in shared memory, thread by thread; consumer 0
        # rescales everything to the common max and adds
        per_thread = n_out + 2 * NS
        sMerge = cute.make_tensor(storage.sMerge.data_ptr(), cute.make_layout(THREADS * per_thread * max(1, NC - 1)))
        if c > 0:
            base = ((c - 1) * THREADS + tidx) * per_thread
            for x in cutlass.range_constexpr(n_out):
                sMerge[base + x] = outv[x]
            for cs in cutlass.range_constexpr(NS):
                sMerge[base + n_out + cs] = m_run[cs]
                sMerge[base + n_out + NS + cs] = l_run[cs]
        cute.arch.barrier(barrier_id=BAR_MERGE, number_of_threads=THREADS * NC)
        if c == 0:
            for other in cutlass.range_constexpr(1, NC):
                base = ((other - 1) * THREADS + tidx) * per_thread
                for cs in cutlass.range_constexpr(NS):
                    m_o = sMerge[base + n_out + cs]
                    m_new = cute.arch.fmax(m_run[cs], m_o)
                    m_ref = fsel(m_new == Float32(NEG_INF), Float32(0.0), m_new)  # all empty: weights 0
                    w_self = cute.arch.exp2(m_run[cs] - m_ref)
                    w_o = cute.arch.exp2(m_o - m_ref)
                    l_run[cs] = l_run[cs] * w_self + sMerge[base + n_out + NS + cs] * w_o
                    for mt in cutlass.range_constexpr(cfg.MT_V):
                        for hr in cutlass.range_constexpr(2):
                            x = (mt * 2 + hr) * NS + cs
                            outv[x] = outv[x] * w_self + sMerge[base + x] * w_o
                    m_run[cs] = m_new

            # write O (and lse from the threads of rows 0: warp 0, g 0)
            for cs in cutlass.range_constexpr(NS):
                col = cols[cs]
                lt = l_run[cs]
                has = lt > Float32(0.0)
                inv_l = fsel(has, cute.arch.rcp_approx(lt), Float32(0.0))
                lse = fsel(has, (m_run[cs] + cute.math.log2(lt)) * LN2, Float32(NEG_INF))
                if col < R:
                    hq = (b * Hq + h * R + col).to(Int64)
                    if cutlass.const_expr(cfg.split):
                        obase = (hq * num_splits + split) * D
                        lidx = hq * num_splits + split
                    else:
                        obase = hq * D
                        lidx = hq
                    if tidx < 4:
                        cute.make_tensor(lse_ptr + lidx, cute.make_layout((1,)))[0] = lse
                    for mt in cutlass.range_constexpr(cfg.MT_V):
                        for hr in cutlass.range_constexpr(2):
                            out = cute.make_tensor(o_ptr + (obase + mt * 64 + rowt[hr]), cute.make_layout((1,)))
                            val = outv[(mt * 2 + hr) * NS + cs] * inv_l
                            out[0] = val if cutlass.const_expr(cfg.split) else val.to(cfg.q_dtype)


def mPT_load(pt_ptr, idx):
    """page_table[idx] (int32)."""
    return cute.make_tensor(pt_ptr + idx, cute.make_layout((1,)))[0]


def load_param(p_ptr, idx):
    """(scale, offset) fp16 pair at element idx -> two fp32."""
    t = cute.make_tensor(p_ptr + idx, cute.make_layout((2,)))
    return t[0].to(Float32), t[1].to(Float32)


def load_words(c_ptr, tidx, cfg: DecodeConfig):
    """The thread's WPT packed words of one tile in shared memory: vector j (CW words) at tile
    vector j*128+tidx (16-byte ld.shared, consecutive threads on consecutive vectors)."""
    base = cute.make_tensor(c_ptr, cute.make_layout((cfg.CW, THREADS, cfg.WPT // cfg.CW), stride=(1, cfg.CW, THREADS * cfg.CW)))
    src = base[None, tidx, None]  # (CW, J)
    dst = cute.make_rmem_tensor((cfg.CW, cfg.WPT // cfg.CW), Int32)
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=32 * cfg.CW)
    cute.copy(atom, src, dst)
    return cute.make_tensor(dst.iterator, cute.make_layout((cfg.WPT,)))
