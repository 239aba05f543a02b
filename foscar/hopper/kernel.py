"""Hopper (sm_90a) fused decode attention over a paged INT2/INT4 KV cache (affine folding).

One CTA = one (split, kv_head, batch) triple: it attends the R = gqa_ratio query heads of one KV
head over a contiguous range of 64-token tiles of one sequence. Everything runs swap-AB so that
the cache sits on the MMA's M side and the few query rows are N (padded to 8 or 16), with
per-warp ``mma.sync.m16n8k16`` (FP16 in, FP32 accumulate):

    S^T [16 tokens   x 8] = K  [16 x 16 ch]     . Q^T [16 ch x 8]      (per token block, k16 block)
    O^T [16 channels x 8] = V^T[16 x 16 tokens] . P^T [16 tokens x 8]  (per channel block, token block)

Each consumer *warp* owns whole tiles (all 64 tokens) and keeps its own online-softmax state, so
nothing is exchanged between warps until the very end (benchmarks/NOTES.md section 6: small-N
wgmma cost 13 SM cycles per 1024 KV elements, mma.sync 1.53 per 256, and the cross-warp
max/P exchanges of the warpgroup form cost more instructions than the MMAs).

A (the codes) comes from registers: the packed order of a tile is the mma A-fragment order of a
128-thread warpgroup (foscar/layouts/fragment.py); the warp that owns the tile reads the words of
all four "virtual warps" (16-byte ld.shared, conflict-free) and turns two codes into one f16x2
register with one LOP3, plus one shift per word for its top slots (foscar.operands.HopperRecipe):

    op = ((word >> shift[k]) & mask[k]) | magic[k] = f16x2(bias[k] + c/2^bits)

The bias depends only on the slot k, i.e. on the MMA's k16 block parity and the A register
(``bias_slot``): one MMA of a constant A fragment of -bias with the same B operand removes it
inside the accumulator (for K once per Q^T, as the accumulator's initial value; for V once per
tile and n8 block). So a code c with (scale s, offset z) is x = s'*op' + z with s' = 2^bits*s and
op' = op - bias = c/2^bits.
B lives in registers too: Q^T (or the scaled Q^T of channel-wise K) is built once per warp (per K
group); P^T comes from the S^T accumulator by ``movmatrix`` (an 8x8 transpose of the f16x2
registers), scaled per token for token-wise V.

The four folding cases (design.md), per query column r, token l, channel d:
  * K token-wise:  S = sum_j s'[l,j]*acc_j + z[l,j]*Qsum[r,j]   (one accumulator per block j)
  * K channel-wise: B = Q^T scaled by s'[d,t] per token group t (G=32: two per tile, one per
    pair of token blocks), plus sum_d z[d,t] q[r,d] per group.
  * V token-wise:  B = P^T scaled per token by s'[l,j] for the channel block j of the MMA's
    channels, plus sum_l z[l,j] P[l,r] added to every channel of block j at the end.
  * V channel-wise: O += s'[d,t]*(PV over token group t) + z[d,t]*Psum[r,t].
All corrections in FP32; softmax in the log2 domain with sm_scale*log2(e) folded into the score.
The MMAs run in FP16 (not BF16): the scaled other operand (Q*s' or P*s') is rounded to the MMA
type, and FP16's 3 extra mantissa bits keep that rounding 4x below BF16's (foscar.operands).

Structure: warp-specialized. Warpgroup 0 is the producer: one thread walks the CTA's tiles and
issues 1-D bulk copies (``cp.async.bulk``, TMA engine) of each tile's K codes, V codes, K params
and V params into a ``STAGES``-deep shared-memory ring guarded by mbarriers (foscar/pipeline.py);
the page-table entries come in 32 at a time, one per lane of the producer warp.
Warpgroups 1..NC hold NW = 4*NC consumer warps: warp w takes runs w, w+NW, ... of TPG
consecutive tiles (TPG = G/64 for channel-wise K groups of G >= 128 tokens, so the scaled Q^T is
built once per group; else 1), loads the stage's codes and params into registers, releases the
stage, and runs the MMAs, the FP32 corrections and the online softmax. ``setmaxnreg`` moves
registers from the producer to the consumers (ptxas keeps it only with ``.minnctapersm``, hence
``min_blocks_per_mp=1``). At the end the warps leave (O, m, l) in shared memory (over the ring)
and all consumer threads merge them, one output element each.
Split-KV: grid.x = splits; with splits > 1 the kernel writes normalized fp32 partial outputs
[B, Hq, S, D] and lse [B, Hq, S] (natural log; -inf and zeros for an empty split); with
split=False it writes o [B, Hq, D] (q's dtype) and lse fp32 [B, Hq].
"""

from __future__ import annotations

import operator

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32, Int64
from cutlass.cute.nvgpu import warp as warp_mma

from ..device import (LN2, LOG2E, NEG_INF, fsel, movmatrix_trans, output_offsets, pack_f16x2,
                      reduce_over_rows)
from ..layouts.fragment import THREADS, TILE_TOKENS, TileGeometry
from ..operands import HopperRecipe, HopperSlot, bias_slot
from ..pipeline import bulk_copy_g2s, stage_and_phase
from ..scheme import Axis, Scheme

BAR_CONSUMERS = 1  # named barrier of all consumer warps (id 0 is sync_threads)
REGISTERS = 64 * 1024  # per SM
PRODUCER_REGS = 40  # setmaxnreg of the producer warpgroup
PRODUCER_WARPS = 4  # the whole producer warpgroup issues copies
SMEM_BYTES = 220 * 1024  # shared-memory budget of the stage ring (the merge reuses it)
MAX_STAGES = 48
TOKEN_BLOCKS = TILE_TOKENS // 16  # m16 token blocks of a tile (QK) = k16 token blocks (PV)
MERGE_PAD = 4  # fp32 words of padding per merged output row: conflict-free fragment stores


def default_consumers(scheme: Scheme) -> int:
    """Consumer warpgroups: as many warps as keep a warp's loop-carried state (fp32 O^T, the Q^T
    fragments, fp32 q for channel-wise K) in registers next to a tile's working set (its packed
    words): 3 warpgroups leave 152 registers per thread, 2 leave 232, 1 leaves 240. (Measured on
    the H200, benchmarks/NOTES.md section 8: INT2 K channel-wise g128, state 80 + 32 words, runs 8%
    faster with 3 warpgroups despite an 8-byte spill; INT4, 80 + 64 words, 6% slower; the variants
    with more V state spill 24-192 bytes with 3.)"""
    nb = 1 if scheme.gqa_ratio <= 8 else 2
    blocks = scheme.head_dim // 16
    state = blocks * nb * (4 + 2)  # O^T accumulators + f16x2 Q^T
    if scheme.k.axis is Axis.CHANNEL:
        state += blocks * nb * 4 + blocks * nb * 2 * (max(1, TILE_TOKENS // scheme.k.group) - 1)
    if state <= 56:
        return 3
    tile_words = 2 * 4 * TileGeometry("k", scheme.bits, scheme.head_dim).words_per_thread  # K + V, 4 virtual threads
    # channel-wise V (per-group PV accumulators) or several V channel groups (P^T per group) add state
    v_extra = 0 if scheme.v.axis is Axis.TOKEN and scheme.v.group == scheme.head_dim else 16
    if nb == 1 and state + tile_words + v_extra <= 112:
        return 3
    return 2 if state <= 96 else 1


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
            if quant.group < 16:
                raise ValueError(f"{name} group {quant.group}: the Hopper kernel needs groups of >= 16")
        self.scheme = scheme
        self.page_size = page_size
        self.split = bool(split)
        self.bits = scheme.bits
        self.D = scheme.head_dim
        self.R = scheme.gqa_ratio
        self.N = 8 if self.R <= 8 else 16  # query columns padded to whole n8 blocks
        self.NB = self.N // 8  # n8 blocks
        self.NS = 2 * self.NB  # distinct query columns per thread in an m16n8 accumulator set
        self.kgeom = TileGeometry("k", self.bits, self.D)
        self.TW = self.kgeom.words  # int32 words per packed 64-token tile (same for k and v)
        self.WPT = self.kgeom.words_per_thread  # words per virtual thread (128 per tile)
        self.CW = self.kgeom.vector_words
        self.SUB = page_size // TILE_TOKENS  # tiles per page
        self.KB_D = self.D // 16  # k16 blocks over head_dim (QK reduction)
        self.MB_V = self.D // 16  # m16 channel blocks of V^T
        self.KB_T = TILE_TOKENS // 16  # k16 blocks of a tile's tokens in the packed V layout
        self.ppw = 16 // self.bits  # fragment registers per packed word
        self.slots = HopperRecipe(self.bits).slots  # per register slot: shift, mask, magic, bias
        self.q_dtype = self.cute_dtype(scheme.q_dtype)
        # K
        self.k_token = scheme.k.axis is Axis.TOKEN
        self.GK = scheme.k.group
        self.NJK = self.D // self.GK if self.k_token else 0  # channel blocks (token-wise K)
        self.NGK = max(1, TILE_TOKENS // self.GK) if not self.k_token else 0  # token groups per tile
        self.KPG = 0 if self.k_token else self.page_size // self.GK  # token groups per page
        # consecutive tiles of one channel-wise K group: a warp takes them in a run and scales Q once
        self.TPG = 1 if self.k_token else max(1, self.GK // TILE_TOKENS)
        # V
        self.v_token = scheme.v.axis is Axis.TOKEN
        self.GV = scheme.v.group
        self.NJV = self.D // self.GV if self.v_token else 0
        self.NGV = max(1, TILE_TOKENS // self.GV) if not self.v_token else 0
        self.VPG = 0 if self.v_token else self.page_size // self.GV
        # warp specialization: producer warpgroup 0, consumer warpgroups 1..NC (NW warps)
        self.NC = consumers
        self.NW = 4 * consumers
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
        # Every stage belongs to one consumer warp (STAGES is a multiple of TPG*NW and warp w takes
        # the runs w, w+NW, ...): a warp waits on a stage's `full` parity right after its own
        # previous use of it, never two phases ahead of the fill (which would read as complete).
        per_round = self.TPG * self.NW
        rounds = min(MAX_STAGES, SMEM_BYTES // self.STAGE_BYTES) // per_round
        if rounds < 1:
            raise ValueError(f"ring stages of {self.STAGE_BYTES} B: {per_round} do not fit in {SMEM_BYTES} B")
        self.STAGES = rounds * per_round
        # merge area (fp32 words, over the ring): per warp O^T rows (N x (D + pad)), then m and l
        self.MERGE_ROW = self.D + MERGE_PAD
        self.MERGE_WARP = self.N * self.MERGE_ROW + 2 * self.N
        self.RING_WORDS = max(self.STAGES * self.STAGE_WORDS, self.NW * self.MERGE_WARP)

    @staticmethod
    def cute_dtype(torch_dtype):
        import torch

        return BFloat16 if torch_dtype == torch.bfloat16 else Float16


def _slot_operand(word, slot: HopperSlot):
    """f16x2 operand ``bias + c/2^bits`` of a slot's two codes: ((word >> shift) & mask) | magic,
    one LOP3 (the shift by 6 is shared by the word's top slots; the compiler keeps one).

    The AND and the OR are fused explicitly (LUT 0xEA = (a & b) | c): left to itself the compiler
    emits two LOP3s.
    """
    w = cutlass.Uint32(word)
    x = w >> slot.shift if slot.shift else w
    return Int32(cute.arch.lop3(cutlass.Uint32(x), cutlass.Uint32(slot.mask), cutlass.Uint32(slot.magic), 0xEA))


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
        # one warp, m16 x n8 x k16, FP16 operands, FP32 accumulators: both GEMMs
        tiled_mma = cute.make_tiled_mma(warp_mma.MmaF16BF16Op(Float16, Float32, (16, 8, 16)))

        @cute.struct
        class SharedStorage:
            ring: cute.struct.Align[cute.struct.MemRange[Int32, cfg.RING_WORDS], 1024]
            full: cute.struct.MemRange[Int64, cfg.STAGES]
            empty: cute.struct.MemRange[Int64, cfg.STAGES]

        scale_log2 = sm_scale * LOG2E
        self.kernel(
            tiled_mma,
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
        role = cute.arch.make_warp_uniform(tidx // THREADS)  # 0: producer, 1..NC: consumers

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        full = storage.full.data_ptr()  # (STAGES,) mbarriers: stage filled
        empty = storage.empty.data_ptr()  # (STAGES,) mbarriers: stage read (by one warp)
        if tidx == 0:
            for s in cutlass.range_constexpr(cfg.STAGES):
                cute.arch.mbarrier_init(full + s, 1)
                cute.arch.mbarrier_init(empty + s, 32)
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
            self.produce(storage.ring.data_ptr(), full, empty, kc_ptr, kp_ptr, vc_ptr, vp_ptr, pt_ptr, b, h,
                         kv_heads, max_pages, t_begin, t_end, cute.arch.make_warp_uniform(tidx // 32), tidx % 32)
        else:
            cute.arch.setmaxregister_increase(cfg.consumer_regs)
            warp = cute.arch.make_warp_uniform(tidx // 32 - 4)
            self.consume(tiled_mma, storage.ring.data_ptr(), full, empty, q_ptr, o_ptr, lse_ptr, length, b, h,
                         split, kv_heads, num_splits, t_begin, t_end, scale_log2, warp, tidx % 32)

    # ------------------------------------------------------------------------------------------
    # producer: PRODUCER_WARPS warps, lane 0 of each issues the bulk copies of every P-th tile
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def produce(self, ring: cute.Pointer, full: cute.Pointer, empty: cute.Pointer, kc_ptr: cute.Pointer,
                kp_ptr: cute.Pointer, vc_ptr: cute.Pointer, vp_ptr: cute.Pointer, pt_ptr: cute.Pointer, b: Int32,
                h: Int32, kv_heads: Int32, max_pages: Int32, t_begin: Int32, t_end: Int32, pw: Int32, lane: Int32):
        cfg = self.cfg
        P = PRODUCER_WARPS
        SUB = cfg.SUB
        page_first = t_begin // SUB
        page_end = (t_end + SUB - 1) // SUB
        for chunk in cutlass.range(page_first, page_end, 32, unroll=1):
            # lane l holds the page of the chunk's l-th logical page (clamped into the range)
            my_page = mPT_load(pt_ptr, b.to(Int64) * max_pages + cutlass.min(chunk + lane, page_end - 1))
            tile_lo = cutlass.max(t_begin, chunk * SUB)
            tile_hi = cutlass.min(t_end, (chunk + 32) * SUB)
            # producer warp pw issues local tiles pw, pw + P, ...: one thread's issue rate is the
            # pipeline's bound otherwise (benchmarks/NOTES.md section 6)
            first = tile_lo + (pw + P - (tile_lo - t_begin) % P) % P
            for tile in cutlass.range(first, tile_hi, P, unroll=1):
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
    # consumer warp w: runs w, w+NW, ... of TPG consecutive tiles, each tile whole
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consume(self, tiled_mma: cute.TiledMma, ring: cute.Pointer, full: cute.Pointer, empty: cute.Pointer,
                q_ptr: cute.Pointer, o_ptr: cute.Pointer, lse_ptr: cute.Pointer, length: Int32, b: Int32, h: Int32,
                split: Int32, kv_heads: Int32, num_splits: Int32, t_begin: Int32, t_end: Int32,
                scale_log2: Float32, warp: Int32, lane: Int32):
        cfg = self.cfg
        N, NB, NS, D, R, NW = cfg.N, cfg.NB, cfg.NS, cfg.D, cfg.R, cfg.NW
        TB = TOKEN_BLOCKS
        two_b = float(1 << cfg.bits)
        g = lane // 4
        tq = lane % 4

        # ---------------------------------------------------------------- MMA fragments
        thr = tiled_mma.get_slice(lane)
        shape_A = thr.partition_shape_A((16, 16))  # ((2,2,2),1,1) fp16: value e + 2*h_r + 4*h_c
        shape_B = thr.partition_shape_B((8, 16))  # ((2,2),1,1) fp16: value e + 2*hh; k = 2*tq+e+8*hh, n = g
        shape_C = thr.partition_shape_C((16, 8))  # ((2,2),1,1) fp32: value i = e + 2*h_r; row g+8*h_r, col 2*tq+e
        # Accumulator value i of n-block nb sits in column 8*nb + 2*tq + e: column slot cs = e + 2*nb.
        cols = [8 * (cs // 2) + 2 * tq + (cs % 2) for cs in range(NS)]

        # ---------------------------------------------------------------- Q^T (B operand)
        Hq = kv_heads * R
        q_base = (b * Hq + h * R).to(Int64) * D
        qv = cute.make_rmem_tensor((NB * cfg.KB_D * 4,), Float32)
        for nb in cutlass.range_constexpr(NB):
            head = 8 * nb + g
            q_row = q_base + cutlass.min(head, R - 1) * D
            for kb in cutlass.range_constexpr(cfg.KB_D):
                for hh in cutlass.range_constexpr(2):
                    for e in cutlass.range_constexpr(2):
                        d = 16 * kb + 8 * hh + 2 * tq + e
                        x = cute.make_tensor(q_ptr + (q_row + d), cute.make_layout((1,)))[0].to(Float32)
                        qv[q_index(cfg, nb, kb, hh, e)] = fsel(head < R, x, Float32(0.0))

        n_qsets = 1 if cfg.k_token else cfg.NGK
        qB = [[[tiled_mma.make_fragment_B(shape_B) for _ in range(cfg.KB_D)] for _ in range(NB)] for _ in range(n_qsets)]
        qsum = cute.make_rmem_tensor((max(1, cfg.NJK) * NS,), Float32)  # token-wise K: Qsum[j, column slot]
        qz = cute.make_rmem_tensor((max(1, cfg.NGK) * NS,), Float32)  # channel-wise K: sum_d z q per group
        # -(bias x Q^T): the initial value of every S^T accumulator (token-wise K: per channel block j;
        # channel-wise K: per token group, set with the scaled Q^T)
        k_bias = [[zero_accumulator(tiled_mma, shape_C) for _ in range(NB)] for _ in range(max(cfg.NJK, cfg.NGK))]
        if cutlass.const_expr(cfg.k_token):
            for nb in cutlass.range_constexpr(NB):
                for kb in cutlass.range_constexpr(cfg.KB_D):
                    regs = cute.recast_tensor(qB[0][nb][kb], Int32)
                    for hh in cutlass.range_constexpr(2):
                        regs[hh] = pack_f16x2(qv[q_index(cfg, nb, kb, hh, 0)], qv[q_index(cfg, nb, kb, hh, 1)])
            blocks_per_group = cfg.GK // 16
            for j in cutlass.range_constexpr(cfg.NJK):
                for nb in cutlass.range_constexpr(NB):
                    add_bias_mmas(tiled_mma, shape_A, k_bias[j][nb], qB[0][nb],
                                  range(j * blocks_per_group, (j + 1) * blocks_per_group), cfg)
            for j in cutlass.range_constexpr(cfg.NJK):
                for nb in cutlass.range_constexpr(NB):
                    part = Float32(0.0)
                    for kb in cutlass.range_constexpr(j * cfg.GK // 16, (j + 1) * cfg.GK // 16):
                        for x in cutlass.range_constexpr(4):
                            part = part + qv[q_index(cfg, nb, kb, 0, 0) + x]
                    part = reduce_over_tq(part)
                    for e in cutlass.range_constexpr(2):
                        qsum[j * NS + 2 * nb + e] = to_columns(part, tq, e)

        # ---------------------------------------------------------------- running state
        m_run = cute.make_rmem_tensor((NS,), Float32)  # running max (log2 domain), per column slot
        l_run = cute.make_rmem_tensor((NS,), Float32)  # per-thread partial row sum
        corr = cute.make_rmem_tensor((max(1, cfg.NJV) * NS,), Float32)  # token-wise V: per-thread sum_l z P
        for cs in cutlass.range_constexpr(NS):
            m_run[cs] = Float32(NEG_INF)
            l_run[cs] = Float32(0.0)
        for x in cutlass.range_constexpr(max(1, cfg.NJV) * NS):
            corr[x] = Float32(0.0)
        accO = [[zero_accumulator(tiled_mma, shape_C) for _ in range(NB)] for _ in range(cfg.MB_V)]  # (m16 channel block, n8 block)
        # token-wise V: -(bias x P^T) summed like O, per channel block j (rows: channel parity only)
        v_bias = [[zero_accumulator(tiled_mma, shape_C) for _ in range(NB)] for _ in range(cfg.NJV)]

        n_local = cutlass.max(t_end - t_begin, 0)
        n_runs = (n_local + cfg.TPG - 1) // cfg.TPG
        my_runs = (cutlass.max(n_runs - warp, 0) + NW - 1) // NW
        for step in cutlass.range(0, my_runs * cfg.TPG, 1, unroll=1):
            local_tile = cfg.TPG * (warp + NW * (step // cfg.TPG)) + step % cfg.TPG
            if local_tile < n_local:
                tok0 = (t_begin + local_tile) * TILE_TOKENS
                valid = length - tok0  # valid tokens in this tile (>= 1)
                ring_stage, ring_phase = stage_and_phase(local_tile, cfg.STAGES)
                cute.arch.mbarrier_wait(full + ring_stage, ring_phase)
                sbuf = ring + cute.assume(ring_stage * cfg.STAGE_WORDS, divby=4)  # the tile's stage
                kpar = cute.recast_ptr(sbuf + cfg.K_PARAMS, dtype=Float16)
                vpar = cute.recast_ptr(sbuf + cfg.V_PARAMS, dtype=Float16)

                # ------------------------------------------------ stage -> registers
                # virtual warp u of the packed tile: K token block u, V channel blocks u, u+4, ...
                kw = [load_words(sbuf + cfg.K_CODES, 32 * u + lane, cfg) for u in range(4)]
                vw = [load_words(sbuf + cfg.V_CODES, 32 * u + lane, cfg) for u in range(4)]
                # the thread's accumulator rows are tokens 16*tb + g + 8*hr: index t = 2*tb + hr
                rows = [16 * (t // 2) + g + 8 * (t % 2) for t in range(2 * TB)]
                if cutlass.const_expr(cfg.k_token):
                    ks = cute.make_rmem_tensor((2 * TB * cfg.NJK,), Float32)  # s' * scale_log2
                    kz = cute.make_rmem_tensor((2 * TB * cfg.NJK,), Float32)  # z' * scale_log2
                    for t in cutlass.range_constexpr(2 * TB):
                        for j in cutlass.range_constexpr(cfg.NJK):
                            s, z = load_param(kpar, (rows[t] * cfg.NJK + j) * 2)
                            ks[t * cfg.NJK + j] = s * (two_b * scale_log2)
                            kz[t * cfg.NJK + j] = z * scale_log2
                else:
                    if step % cfg.TPG == 0:  # first tile of a K group run: scale Q^T for the group(s)
                        self.scale_q(tiled_mma, shape_A, shape_C, qB, qz, k_bias, qv, kpar, scale_log2, tq)
                if cutlass.const_expr(cfg.v_token):
                    vs = cute.make_rmem_tensor((2 * TB * cfg.NJV,), Float32)  # s' (0 past the end)
                    vz = cute.make_rmem_tensor((2 * TB * cfg.NJV,), Float32)  # z (0 past the end)
                    for t in cutlass.range_constexpr(2 * TB):
                        ok = rows[t] < valid
                        for j in cutlass.range_constexpr(cfg.NJV):
                            x = t * cfg.NJV + j
                            s, z = load_param(vpar, (rows[t] * cfg.NJV + j) * 2)
                            vs[x] = fsel(ok, s * two_b, Float32(0.0))
                            vz[x] = fsel(ok, z, Float32(0.0))
                else:
                    # channels 16*md + g + 8*hr, per token group of the tile: x = (md*2 + hr)*NGV + gi
                    cvs = cute.make_rmem_tensor((cfg.MB_V * 2 * cfg.NGV,), Float32)
                    cvz = cute.make_rmem_tensor((cfg.MB_V * 2 * cfg.NGV,), Float32)
                    for gi in cutlass.range_constexpr(cfg.NGV):
                        ok = gi * cfg.GV < valid
                        for md in cutlass.range_constexpr(cfg.MB_V):
                            for hr in cutlass.range_constexpr(2):
                                s, z = load_param(vpar, (gi * D + 16 * md + g + 8 * hr) * 2)
                                x = (md * 2 + hr) * cfg.NGV + gi
                                cvs[x] = fsel(ok, s * two_b, Float32(0.0))
                                cvz[x] = fsel(ok, z, Float32(0.0))
                cute.arch.mbarrier_arrive(empty + ring_stage)  # codes and params are in registers

                # ------------------------------------------------ S^T = K . Q^T, scores (log2 domain)
                sc = cute.make_rmem_tensor((TB * NB * 4,), Float32)  # (tb, nb, i)
                for tb in cutlass.range_constexpr(TB):
                    kfr = [a_fragment(tiled_mma, shape_A, kw[tb], 4 * kb, cfg) for kb in range(cfg.KB_D)]
                    for nb in cutlass.range_constexpr(NB):
                        if cutlass.const_expr(cfg.k_token):
                            accS = [mma_chain(tiled_mma, shape_C, k_bias[j][nb],
                                              [(kfr[kb], qB[0][nb][kb]) for kb in range(j * cfg.GK // 16, (j + 1) * cfg.GK // 16)])
                                    for j in range(cfg.NJK)]
                        else:
                            gi = (16 * tb) // cfg.GK if cfg.NGK > 1 else 0
                            acc = mma_chain(tiled_mma, shape_C, k_bias[gi][nb], [(kfr[kb], qB[gi][nb][kb]) for kb in range(cfg.KB_D)])
                        for i in cutlass.range_constexpr(4):
                            t = 2 * tb + i // 2
                            cs = i % 2 + 2 * nb
                            if cutlass.const_expr(cfg.k_token):
                                v = Float32(0.0)
                                for j in cutlass.range_constexpr(cfg.NJK):
                                    x = t * cfg.NJK + j
                                    v = v + ks[x] * accS[j][i] + kz[x] * qsum[j * NS + cs]
                            else:
                                v = acc[i] + qz[gi * NS + cs]
                            sc[(tb * NB + nb) * 4 + i] = fsel(rows[t] < valid, v, Float32(NEG_INF))

                # ------------------------------------------------ online softmax (this warp's tokens)
                alpha = cute.make_rmem_tensor((NS,), Float32)
                for cs in cutlass.range_constexpr(NS):
                    nb, e = cs // 2, cs % 2
                    mx = sc[nb * 4 + e]
                    for t in cutlass.range_constexpr(1, 2 * TB):
                        mx = cute.arch.fmax(mx, sc[((t // 2) * NB + nb) * 4 + e + 2 * (t % 2)])
                    mx = reduce_over_rows(mx, cute.arch.fmax)
                    m_new = cute.arch.fmax(m_run[cs], mx)
                    alpha[cs] = cute.arch.exp2(m_run[cs] - m_new)
                    m_run[cs] = m_new
                    l_run[cs] = l_run[cs] * alpha[cs]
                # the running max moved for some column of the warp: O must be rescaled (token-wise
                # V; channel-wise V rescales in its correction FMA anyway)
                moved = alpha[0] != Float32(1.0)
                for cs in cutlass.range_constexpr(1, NS):
                    moved = moved | (alpha[cs] != Float32(1.0))
                rescale = cute.arch.vote_any_sync(moved)
                for x in cutlass.range_constexpr(cfg.NJV * NS):
                    corr[x] = corr[x] * alpha[x % NS]

                # ------------------------------------------------ P = exp2(S - m) -> P^T B fragments
                n_psets = cfg.NJV if cfg.v_token else 1
                pB = [[[tiled_mma.make_fragment_B(shape_B) for _ in range(n_psets)] for _ in range(NB)] for _ in range(TB)]
                pg = cute.make_rmem_tensor((max(1, cfg.NGV) * NS,), Float32)  # channel-wise V: sum of fp16(p)
                for x in cutlass.range_constexpr(max(1, cfg.NGV) * NS):
                    pg[x] = Float32(0.0)
                for tb in cutlass.range_constexpr(TB):
                    for nb in cutlass.range_constexpr(NB):
                        p = [cute.arch.exp2(sc[(tb * NB + nb) * 4 + i] - m_run[i % 2 + 2 * nb]) for i in range(4)]
                        for i in cutlass.range_constexpr(4):
                            l_run[i % 2 + 2 * nb] = l_run[i % 2 + 2 * nb] + p[i]
                        for ps in cutlass.range_constexpr(n_psets):
                            p_regs = cute.recast_tensor(pB[tb][nb][ps], Int32)
                            for hr in cutlass.range_constexpr(2):
                                if cutlass.const_expr(cfg.v_token):
                                    x = (2 * tb + hr) * cfg.NJV + ps
                                    packed = pack_f16x2(p[2 * hr] * vs[x], p[2 * hr + 1] * vs[x])  # Ps = fp16(p*s')
                                    for e in cutlass.range_constexpr(2):
                                        corr[ps * NS + 2 * nb + e] = corr[ps * NS + 2 * nb + e] + p[2 * hr + e] * vz[x]
                                else:
                                    packed = pack_f16x2(p[2 * hr], p[2 * hr + 1])
                                    gi = (16 * tb) // cfg.GV if cfg.NGV > 1 else 0
                                    for e in cutlass.range_constexpr(2):
                                        pg[gi * NS + 2 * nb + e] = pg[gi * NS + 2 * nb + e] + p[2 * hr + e]
                                p_regs[hr] = movmatrix_trans(packed)  # rows = tokens -> k = tokens
                if cutlass.const_expr(not cfg.v_token):
                    for x in cutlass.range_constexpr(cfg.NGV * NS):
                        pg[x] = reduce_over_rows(pg[x], operator.add)  # Psum per token group and column

                # ------------------------------------------------ O^T += V^T . P^T (+ corrections)
                if cutlass.const_expr(cfg.v_token):
                    if rescale:
                        for row in accO + v_bias:
                            for nb in cutlass.range_constexpr(NB):
                                for i in cutlass.range_constexpr(4):
                                    row[nb][i] = row[nb][i] * alpha[i % 2 + 2 * nb]
                    for j in cutlass.range_constexpr(cfg.NJV):
                        for nb in cutlass.range_constexpr(NB):
                            add_bias_mmas(tiled_mma, shape_A, v_bias[j][nb], [pB[tb][nb][j] for tb in range(TB)], range(TB), cfg)
                else:
                    # per token group and n8 block: the initial value of every channel block's PV accumulator
                    pv_bias = [[zero_accumulator(tiled_mma, shape_C) for _ in range(NB)] for _ in range(cfg.NGV)]
                    for gi in cutlass.range_constexpr(cfg.NGV):
                        for nb in cutlass.range_constexpr(NB):
                            add_bias_mmas(tiled_mma, shape_A, pv_bias[gi][nb], [pB[tb][nb][0] for tb in range(TB)],
                                          range(gi * TB // cfg.NGV, (gi + 1) * TB // cfg.NGV), cfg)
                for md in cutlass.range_constexpr(cfg.MB_V):
                    # channel block md = virtual warp md % 4 of m64 tile md // 4; k16 block = token block
                    vfr = [a_fragment(tiled_mma, shape_A, vw[md % 4], ((md // 4) * cfg.KB_T + tb) * 4, cfg) for tb in range(TB)]
                    for nb in cutlass.range_constexpr(NB):
                        if cutlass.const_expr(cfg.v_token):
                            j = (16 * md) // cfg.GV  # the channel block of these 16 channels
                            for tb in cutlass.range_constexpr(TB):
                                cute.gemm(tiled_mma, accO[md][nb], vfr[tb], pB[tb][nb][j], accO[md][nb])
                        else:
                            accV = [mma_chain(tiled_mma, shape_C, pv_bias[gi][nb],
                                              [(vfr[tb], pB[tb][nb][0]) for tb in range(gi * TB // cfg.NGV, (gi + 1) * TB // cfg.NGV)])
                                    for gi in range(cfg.NGV)]
                            for i in cutlass.range_constexpr(4):
                                cs = i % 2 + 2 * nb
                                add = Float32(0.0)
                                for gi in cutlass.range_constexpr(cfg.NGV):
                                    x = (md * 2 + i // 2) * cfg.NGV + gi
                                    add = add + cvs[x] * accV[gi][i] + cvz[x] * pg[gi * NS + cs]
                                accO[md][nb][i] = accO[md][nb][i] * alpha[cs] + add

        # ---------------------------------------------------------------- this warp's (O, m, l)
        for cs in cutlass.range_constexpr(NS):
            l_run[cs] = reduce_over_rows(l_run[cs], operator.add)
        for x in cutlass.range_constexpr(cfg.NJV * NS):
            corr[x] = reduce_over_rows(corr[x], operator.add)
        # every consumer warp is past its last stage read: the ring becomes the merge area
        cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=NW * 32)
        merge = cute.make_tensor(cute.recast_ptr(ring, dtype=Float32), cute.make_layout(cfg.RING_WORDS))
        mine = warp * cfg.MERGE_WARP
        for md in cutlass.range_constexpr(cfg.MB_V):
            for nb in cutlass.range_constexpr(NB):
                for i in cutlass.range_constexpr(4):
                    cs = i % 2 + 2 * nb
                    val = accO[md][nb][i]
                    if cutlass.const_expr(cfg.v_token):
                        j = (16 * md) // cfg.GV
                        val = val + corr[j * NS + cs] + v_bias[j][nb][i]
                    merge[mine + cols[cs] * cfg.MERGE_ROW + 16 * md + g + 8 * (i // 2)] = val
        if g == 0:
            for cs in cutlass.range_constexpr(NS):
                merge[mine + N * cfg.MERGE_ROW + cols[cs]] = m_run[cs]
                merge[mine + N * cfg.MERGE_ROW + N + cols[cs]] = l_run[cs]
        cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=NW * 32)
        self.merge_and_store(merge, o_ptr, lse_ptr, b, h, split, kv_heads, num_splits, warp * 32 + lane)

    @cute.jit
    def scale_q(self, tiled_mma: cute.TiledMma, shape_A, shape_C, qB, qz, k_bias, qv, kpar: cute.Pointer,
                scale_log2: Float32, tq: Int32):
        """Channel-wise K: Q^T scaled by s'[d] of each token group of the tile into ``qB[gi]``, the
        per-group constant sum_d z[d] q[r,d] into ``qz``, and -(bias x scaled Q^T) into
        ``k_bias[gi]`` (the S^T accumulators' initial value: it cancels the operand bias against
        the same rounded Qs the data MMAs multiply)."""
        cfg = self.cfg
        two_b = float(1 << cfg.bits)
        for gi in cutlass.range_constexpr(cfg.NGK):
            part = [Float32(0.0) for _ in range(cfg.NB)]
            for kb in cutlass.range_constexpr(cfg.KB_D):
                for hh in cutlass.range_constexpr(2):
                    ksp, kzp = [], []
                    for e in cutlass.range_constexpr(2):
                        s, z = load_param(kpar, (gi * cfg.D + 16 * kb + 8 * hh + 2 * tq + e) * 2)
                        ksp.append(s * (two_b * scale_log2))
                        kzp.append(z * scale_log2)
                    for nb in cutlass.range_constexpr(cfg.NB):
                        base = q_index(cfg, nb, kb, hh, 0)
                        packed = pack_f16x2(qv[base] * ksp[0], qv[base + 1] * ksp[1])
                        cute.recast_tensor(qB[gi][nb][kb], Int32)[hh] = packed
                        for e in cutlass.range_constexpr(2):
                            part[nb] = part[nb] + qv[base + e] * kzp[e]
            for nb in cutlass.range_constexpr(cfg.NB):
                total = reduce_over_tq(part[nb])
                for e in cutlass.range_constexpr(2):
                    qz[gi * cfg.NS + 2 * nb + e] = to_columns(total, tq, e)
                k_bias[gi][nb].fill(0.0)
                add_bias_mmas(tiled_mma, shape_A, k_bias[gi][nb], qB[gi][nb], range(cfg.KB_D), cfg)

    @cute.jit
    def merge_and_store(self, merge: cute.Tensor, o_ptr: cute.Pointer, lse_ptr: cute.Pointer, b: Int32, h: Int32,
                        split: Int32, kv_heads: Int32, num_splits: Int32, tc: Int32):
        """Merge the NW warps' (O, m, l) from shared memory, one output element per consumer thread
        and pass (coalesced along the channel), and write O (normalized) and lse."""
        cfg = self.cfg
        N, D, R, NW = cfg.N, cfg.D, cfg.R, cfg.NW
        Hq = kv_heads * R
        ml = N * cfg.MERGE_ROW  # offset of m (then l) in a warp's area
        for x in cutlass.range_constexpr((R * D + NW * 32 - 1) // (NW * 32)):
            el = tc + NW * 32 * x
            if el < R * D:
                col = el // D
                d = el % D
                m_all = Float32(NEG_INF)
                for w in cutlass.range_constexpr(NW):
                    m_all = cute.arch.fmax(m_all, merge[w * cfg.MERGE_WARP + ml + col])
                m_ref = fsel(m_all == Float32(NEG_INF), Float32(0.0), m_all)  # all empty: weights 0
                lt = Float32(0.0)
                ot = Float32(0.0)
                for w in cutlass.range_constexpr(NW):
                    wt = cute.arch.exp2(merge[w * cfg.MERGE_WARP + ml + col] - m_ref)
                    lt = lt + merge[w * cfg.MERGE_WARP + ml + N + col] * wt
                    ot = ot + merge[w * cfg.MERGE_WARP + col * cfg.MERGE_ROW + d] * wt
                has = lt > Float32(0.0)
                inv_l = fsel(has, cute.arch.rcp_approx(lt), Float32(0.0))
                lse = fsel(has, (m_all + cute.math.log2(lt)) * LN2, Float32(NEG_INF))
                obase, lidx = output_offsets(cfg.split, (b * Hq + h * R + col).to(Int64), split, num_splits, D)
                if d == 0:
                    cute.make_tensor(lse_ptr + lidx, cute.make_layout((1,)))[0] = lse
                val = ot * inv_l
                out = cute.make_tensor(o_ptr + (obase + d), cute.make_layout((1,)))
                out[0] = val if cutlass.const_expr(cfg.split) else val.to(cfg.q_dtype)


def q_index(cfg: DecodeConfig, nb: int, kb: int, hh: int, e: int) -> int:
    """Index in a thread's q values of q[head 8*nb + g, channel 16*kb + 8*hh + 2*tq + e]: the order
    of the Q^T B fragments (value e + 2*hh of n8 block nb, k16 block kb)."""
    return ((nb * cfg.KB_D + kb) * 2 + hh) * 2 + e


def a_fragment(tiled_mma: cute.TiledMma, shape_A, words, n0: int, cfg: DecodeConfig):
    """mma A fragment (fp16 m16 x k16) of fragment registers n0..n0+3 of a virtual thread's packed words."""
    frag = tiled_mma.make_fragment_A(shape_A)
    regs = cute.recast_tensor(frag, Int32)
    for r in range(4):
        n = n0 + r
        regs[r] = _slot_operand(words[n // cfg.ppw], cfg.slots[n % cfg.ppw])
    return frag


def bias_fragment(tiled_mma: cute.TiledMma, shape_A, k_block: int, cfg: DecodeConfig):
    """Constant A fragment of -bias for k16 block ``k_block``: its MMA with a B operand is minus
    what the operand biases of that block add to the accumulator (exact: powers of two)."""
    frag = tiled_mma.make_fragment_A(shape_A)
    regs = cute.recast_tensor(frag, Int32)
    for r in range(4):
        regs[r] = Int32((cfg.slots[bias_slot(cfg.ppw, k_block, r)].magic | 0x80008000) - (1 << 32))
    return frag


def add_bias_mmas(tiled_mma: cute.TiledMma, shape_A, acc, b_frags, k_blocks, cfg: DecodeConfig):
    """acc -= sum over ``k_blocks`` of bias x B (in place): cancels what the operand biases of those
    k16 blocks add to an accumulator of the same B operand."""
    for kb in k_blocks:
        cute.gemm(tiled_mma, acc, bias_fragment(tiled_mma, shape_A, kb, cfg), b_frags[kb], acc)


def mma_chain(tiled_mma: cute.TiledMma, shape_C, init, pairs):
    """init + sum of A x B over the (A, B) fragment ``pairs``, in a new accumulator.

    ``init`` is copied first (free: HMMA reads C and writes D in different registers): the DSL's
    warp-MMA gemm writes its result into C's registers when D and C differ, which would clobber
    ``init``."""
    acc = tiled_mma.make_fragment_C(shape_C)
    acc.store(init.load())
    for a, b in pairs:
        cute.gemm(tiled_mma, acc, a, b, acc)
    return acc


def zero_accumulator(tiled_mma: cute.TiledMma, shape_C):
    acc = tiled_mma.make_fragment_C(shape_C)
    acc.fill(0.0)
    return acc


def to_columns(per_head, tq, e: int):
    """Value of accumulator column 2*tq + e (of an n8 block) from a per-lane value that lane 4*g
    holds for B-fragment column (query head) g of the same block."""
    return cute.arch.shuffle_sync(per_head, offset=4 * (2 * tq + e))


def reduce_over_tq(x):
    """Sum over the 4 lanes of a row group (lane bits 0..1: the k pairs of a B fragment)."""
    for offset in (1, 2):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=offset)
    return x


def mPT_load(pt_ptr, idx):
    """page_table[idx] (int32)."""
    return cute.make_tensor(pt_ptr + idx, cute.make_layout((1,)))[0]


def load_param(p_ptr, idx):
    """(scale, offset) fp16 pair at element idx -> two fp32."""
    t = cute.make_tensor(p_ptr + idx, cute.make_layout((2,)))
    return t[0].to(Float32), t[1].to(Float32)


def load_words(c_ptr, vthread, cfg: DecodeConfig):
    """The WPT packed words of virtual thread ``vthread`` (0..127) of one tile in shared memory:
    vector j (CW words) at tile vector j*128+vthread (16-byte ld.shared, a warp's 32 lanes on
    consecutive vectors)."""
    base = cute.make_tensor(c_ptr, cute.make_layout((cfg.CW, THREADS, cfg.WPT // cfg.CW), stride=(1, cfg.CW, THREADS * cfg.CW)))
    src = base[None, vthread, None]  # (CW, J)
    dst = cute.make_rmem_tensor((cfg.CW, cfg.WPT // cfg.CW), Int32)
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=32 * cfg.CW)
    cute.copy(atom, src, dst)
    return cute.make_tensor(dst.iterator, cute.make_layout((cfg.WPT,)))
