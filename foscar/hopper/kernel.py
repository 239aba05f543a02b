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
register with one LOP3, plus one shift per word for its top slots and one for its bottom slots
(foscar.operands.HopperRecipe):

    op = ((word >> shift[k] or << -shift[k]) & mask[k]) | magic[k] = f16x2(bias[k] + c/2^bits)

The bias depends only on the slot k, i.e. on the MMA's k16 block parity and the A register
(``bias_slot``): one MMA of a constant A fragment of -bias with the same B operand removes it
inside the accumulator (for K once per Q^T, as the accumulator's initial value; for V once per
tile and n8 block). So a code c with (scale s, offset z) is x = s'*op' + z with s' = 2^bits*s and
op' = op - bias = c/2^bits. For K channel-wise (``KChannelWise.centres_codes``) the constant is
-(bias + centre/2^bits) and the codes are centred, op' = (c - centre)/2^bits, x = s'*op' + (z + centre*s).
B lives in registers too: Q^T (or the scaled Q^T of channel-wise K) is built once per warp (per K
group); P^T comes from the S^T accumulator by ``movmatrix`` (an 8x8 transpose of the f16x2
registers), scaled per token for token-wise V.

The four folding cases (foscar/folds.py; their device hooks here: foscar/hopper/folds.py), per query
column r, token l, channel d:
  * K token-wise:  S = sum_j s'[l,j]*acc_j + z[l,j]*Qsum[r,j]   (one accumulator per block j)
  * K channel-wise: B = Q^T scaled by s'[d,t] per token group t (G=32: two per tile, one per
    pair of token blocks), plus sum_d z[d,t] q[r,d] per group.
  * V token-wise:  B = P^T scaled per token by s'[l,j] for the channel block j of the MMA's
    channels, plus sum_l z[l,j] P[l,r] added to every channel of block j at the end.
  * V channel-wise: O += s'[d,t]*(PV over token group t) + z[d,t]*Psum[r,t].
All corrections in FP32; softmax in the log2 domain with sm_scale*log2(e) folded into the score.
The MMAs run in FP16 (not BF16): the scaled other operand (Q*s' or P*s') is rounded to the MMA
type, and FP16's 3 extra mantissa bits keep that rounding 4x below BF16's (foscar.operands).

Structure: warp-specialized. Warpgroup 0 is the producer: each of its 4 warps walks every 4th tile
of the CTA and one elected lane issues 1-D bulk copies (``cp.async.bulk``, TMA engine) of the tile's K
codes, V codes, K params and V params into a ``STAGES``-deep shared-memory ring guarded by
mbarriers (foscar/pipeline.py; the cache decode's 16-bit window tiles, before them, are copied by
all 32 lanes of each producer warp: foscar.hopper.cache_decode);
the page-table entries come in 32 at a time, one per lane of the producer warp.
Warpgroups 1..NC hold NW = 4*NC consumer warps: warp w takes runs w, w+NW, ... of TPG
consecutive tiles (TPG = G/64 for channel-wise K groups of G >= 128 tokens, so the scaled Q^T is
built once per group; else 1). A tile is a *front* (K words and params into registers, S^T, the online
softmax, P^T) and a *back* (O^T += PV from the V words). Where the carried tile fits (``PIPELINED``: one n8
block of query columns, and at least 3 ring stages per warp) the loop is software-pipelined: a tile's front
runs beside the previous tile's back, whose stage it still holds, two independent streams in one basic
block that the scheduler interleaves; elsewhere the front also loads the V words and releases the stage at
once (benchmarks/NOTES.md sections 36-37). The span's last tile or two, which need the mask, come after the
loop by a masking copy. ``setmaxnreg`` moves
registers from the producer to the consumers (ptxas keeps it only with ``.minnctapersm``, hence
``min_blocks_per_mp``: 1, or 2 where a config keeps two CTAs per SM, each with half the SM's registers and shared
memory: ``DecodeConfig.ctas_per_sm``). At the end the warps leave (O, m, l) in shared memory (over the ring)
and all consumer threads merge them, one output element each.
Split-KV: grid.x = splits; with splits > 1 the kernel writes normalized fp32 partial outputs
[B, Hq, S, D] and lse [B, Hq, S] (natural log; -inf and zeros for an empty split); with
split=False it writes o [B, Hq, D] (q's dtype) and lse fp32 [B, Hq].
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32, Int64
from cutlass.cute.nvgpu import warp as warp_mma
from cutlass.pipeline import NamedBarrier

from ..barriers import HopperDecodeBarrier
from ..decode_kernel import DecodeArgs, DecodeKernelBase, StageLayout
from ..device import (MAX_THREAD_REGS, NEG_INF, at, check_register_budget, divmod_nonnegative, fsel, launch_regs,
                      movmatrix_trans, reduce_over_rows, set_warpgroup_registers, store)
from ..jit import half_type
from ..layouts.fragment import THREADS, TILE_TOKENS, TileGeometry
from ..pipeline import Channel, PackedPages, Ring, TileSpan, first_item
from ..query_rows import KvHead, Output, QueryRows
from ..scheme import Scheme
from ..softmax import finite_reference, normalize, online_update
from ..window_tiles import BLOCK
from .folds import hooks_for, q_index
from ..warp_mma import WarpMma
from .mma import TOKEN_BLOCKS, FragmentOperand

PRODUCER_REGS = 40  # setmaxnreg of the producer warpgroup
PRODUCER_WARPS = 4  # the whole producer warpgroup issues copies
SM_SMEM_BYTES = 228 * 1024  # shared memory of an SM (sm_90)
RING_SLACK_BYTES = 8 * 1024  # of a CTA's share: its mbarriers, the ring's alignment, the 1 KB the driver reserves
MAX_STAGES = 48
MERGE_PAD = 4  # fp32 words of padding per merged output row: conflict-free fragment stores


def ring_bytes(ctas_per_sm: int) -> int:
    """Shared-memory budget of a CTA's stage ring (the merge reuses it) at ``ctas_per_sm`` CTAs per SM."""
    return SM_SMEM_BYTES // ctas_per_sm - RING_SLACK_BYTES


def consumer_regs(consumers: int, ctas_per_sm: int = 1) -> int:
    """setmaxnreg of the consumer warpgroups: what the producer's decrease frees of the CTA's launch allotment, shared
    among them. ``setmaxnreg.inc`` waits until the registers it asks for are free in the CTA, so asking for more than
    the allotment holds hangs the kernel (4 warpgroups: 96 per thread at launch; the SM's 64K less the producer's,
    shared by 512 consumer threads, asked 112: 1K more than the producer frees)."""
    threads = THREADS * (1 + consumers)
    freed = launch_regs(threads, ctas_per_sm) * threads - THREADS * PRODUCER_REGS
    return min(MAX_THREAD_REGS, freed // (THREADS * consumers) // 8 * 8)


@functools.lru_cache(maxsize=1024)
def default_consumers(scheme: Scheme, tokens: int = 1) -> int:
    """Consumer warpgroups: as many warps as keep a warp's loop-carried state (fp32 O^T, the Q^T
    fragments, q for channel-wise K) in registers next to a tile's working set (its packed
    words): 3 warpgroups leave 152 registers per thread, 2 leave 232, 1 leaves 240. (Measured on
    the H200, benchmarks/NOTES.md section 8: INT2 K channel-wise g128, state 80 + 32 words, runs 8%
    faster with 3 warpgroups despite an 8-byte spill; INT4, 80 + 64 words, 6% slower; the variants
    with more V state spill 24-192 bytes with 3.) Fewer where the ring's stages of that many warps do not fit (8-bit
    codes: a 64-token tile of K and V at head_dim 128 is 16 KB, and channel-wise K groups take runs of
    tiles per warp). ``tokens``: query tokens per sequence (their rows widen the state like query heads)."""
    wanted = _consumers_for_state(scheme, scheme.gqa_ratio * tokens)
    return next((c for c in range(wanted, 1, -1) if _ring_fits(scheme, c)), 1)


def _ring_fits(scheme: Scheme, consumers: int) -> bool:
    try:
        DecodeConfig(scheme, TILE_TOKENS, True, consumers)
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=1024)
def two_ctas_pipeline(scheme: Scheme) -> bool:
    """Whether one consumer warpgroup at two CTAs per SM (half the SM's shared memory for its ring) keeps the
    software-pipelined loop (:func:`pipelines`: one n8 block of query columns, 3 stages per warp), as the variants
    measured faster that way do (benchmarks/NOTES.md section 42); 8-bit codes keep one stage per warp there."""
    try:
        return DecodeConfig(scheme, TILE_TOKENS, False, 1, ctas_per_sm=2).PIPELINED
    except ValueError:
        return False


def pipelines(rows: int, stages_per_warp: int | None = None) -> bool:
    """Whether the consumer loop of ``rows`` query rows per KV head, over a ring of ``stages_per_warp`` stages for each
    consumer warp (None: any), is software-pipelined (DecodeConfig.PIPELINED): the tile it carries into the next fits
    the registers beside one n8 block of columns (with two the loop spills 2-3x more), and the stage it holds leaves
    two of the warp's stages filling (with one, the loop waits for each fill: INT4 K channel-wise, 2 stages per warp,
    ran 3-11% slower pipelined; H200, benchmarks/NOTES.md section 37)."""
    return rows <= 8 and (stages_per_warp is None or stages_per_warp >= 3)


def _consumers_for_state(scheme: Scheme, rows: int) -> int:
    """:func:`default_consumers`'s count by the registers a warp's state and working set take (``rows``
    query rows per KV head). An estimate whose counts are the measured ones (benchmarks/NOTES.md sections 8, 20,
    34-37), not an exact register count: it counts channel-wise K's q at 32 bits (the kernel keeps 16-bit pairs) and
    the pipelined loop's carried tile wherever the columns fit one n8 block, whether or not the ring then pipelines
    (``DecodeConfig.PIPELINED`` also asks for 3 stages per warp); the two cancel for INT2 K channel-wise (2
    warpgroups: 3 spill with the carried tile). Recounting either changes defaults that were measured."""
    plan = scheme.plan("sm_90a")
    nb = 1 if rows <= 8 else 2
    blocks = scheme.head_dim // 16
    state = blocks * nb * (4 + 2)  # O^T accumulators + f16x2 Q^T
    if not plan.k.token_wise:
        state += blocks * nb * 4 + blocks * nb * 2 * (plan.k.tile_groups - 1)
    # the pipelined loop carries a tile's P^T fragments, alpha and stage into the next (HopperDecodeKernel.front); 2
    # registers counted for the stage, as when the defaults were measured (section 37)
    pending = (4 * 2 + 2) * nb + 2 if pipelines(rows) else 0
    if state + pending <= 64:
        return 3
    # K + V words of the 4 virtual threads a warp reads per tile
    tile_words = 4 * sum(TileGeometry(f.tensor, f.bits, scheme.head_dim).words_per_thread for f in (plan.k, plan.v))
    # channel-wise V (per-group PV accumulators) or several V channel groups (P^T per group) add state
    v_extra = 0 if plan.v.token_wise and plan.v.channel_blocks == 1 else 16
    if nb == 1 and state + tile_words + v_extra + pending <= 112:
        return 3
    # 16 query columns with channel-wise K at head_dim 128 (state 160) spill with either count, yet run 1.5x faster
    # with 2 than 1 (H200, 8 x 32K, gqa 16: INT2 kc128 61.2 -> 41.4 us, INT4 67.5 -> 44.1; benchmarks/NOTES.md
    # section 20). (The same state with 8 columns, head_dim 256, keeps 1: with 2 its window tiles do not fit the ring.)
    return 2 if state <= 96 or (nb == 2 and state <= 160) else 1


def warp_steps(tiles, warp, run: int, warps: int):
    """How many of the local tiles ``0 .. tiles - 1`` consumer warp ``warp`` attends, when ``warps`` warps take runs of
    ``run`` consecutive tiles in turn (warp w: runs w, w + warps, ...)."""
    ahead = cutlass.max(tiles - run * warp, 0)  # tiles from the warp's first run on
    return run * (ahead // (run * warps)) + cutlass.min(ahead % (run * warps), run)


@dataclass(frozen=True)
class PendingTile:
    """What a tile's :meth:`~HopperDecodeKernel.back` takes from its front, in registers: ``held`` (the tile's ring
    stage), the P^T fragments, the V case's P state, alpha, and the V params and words where the front read them. A
    front that holds its stage (``hold``: the pipelined loop, unmasked tiles only) leaves the words None, and the params
    too unless the V case scales P by them (``scales_p``): the back reads them from the held stage. ``take`` copies
    another's values in (the pipelined loop's carried tile). Frozen, like ``foscar.pipeline``'s bundles: its methods
    run inside runtime loops."""

    held: cute.Tensor
    pB: list
    acc_p: object
    alpha: cute.Tensor
    v_params: object
    v_words: list | None = None

    def take(self, other: PendingTile, finish):
        """``finish()`` (this tile's back), then ``other``'s values in."""
        finish()
        for mine, theirs in zip(self.tensors(), other.tensors()):
            mine.store(theirs.load())

    def tensors(self):
        out = [self.held, self.alpha] + [f for per_tb in self.pB for per_nb in per_tb for f in per_nb]
        for extra in (self.acc_p, self.v_params):
            if extra is not None:
                out += list(extra) if isinstance(extra, tuple) else [extra]
        return out


@dataclass(frozen=True)
class QueryOperand:
    """A consumer warp's loop-invariant query side: the K case's state built from fp32 q at its Q^T fragment
    positions (``load_query``, ``k_hooks.setup``: Q^T fragments, bias accumulators, Qsum) and the score scale
    ``sm_scale * log2(e)``."""

    k_state: object
    scale_log2: Float32


@dataclass(frozen=True)
class WarpState:
    """A consumer warp's running attention over its tiles, updated in place: the online softmax's max (log2
    domain) and the thread's partial row sum per column slot, O^T per (m16 channel block, n8 block) and the V
    case's own state."""

    row_max: cute.Tensor
    row_sum: cute.Tensor
    acc_o: list
    v: object


class DecodeConfig(StageLayout):
    """Static configuration of one build: the variant's plan (``Scheme.plan("sm_90a")``: per tensor
    its fold case and operand construction), page size, output format and consumer warpgroups.

    The variant's limits (gqa ratio, page sizes, group sizes) are ``foscar.archs.HOPPER.can_implement``'s,
    checked before this is built; what only the geometry tells (the ring fits, ``tokens`` query tokens
    per sequence fit the query tile: ``foscar.query_rows``) is checked here. ``packed_causal``: the query
    tokens are the last tokens of the packed pages (``decode_paged``), so the packed tiles carry the causal
    mask (the cache decode's draft tokens sit in its window instead)."""

    def __init__(self, scheme: Scheme, page_size: int, split: bool, consumers: int, window=None, tokens: int = 1,
                 packed_causal: bool = False, ctas_per_sm: int = 1):
        if consumers not in (1, 2, 3, 4):
            raise ValueError(f"consumers must be 1 to 4 warpgroups, got {consumers}")
        if ctas_per_sm not in (1, 2) or (ctas_per_sm == 2 and consumers != 1):
            raise ValueError(f"ctas_per_sm must be 1, or 2 with one consumer warpgroup (half an SM's registers: 128 "
                             f"per thread at launch), got {ctas_per_sm} with consumers={consumers}")
        self.ctas_per_sm = ctas_per_sm
        plan = scheme.plan("sm_90a")
        self.scheme = scheme
        self.plan = plan
        self.page_size = page_size
        self.split = bool(split)
        self.D = scheme.head_dim
        self.rows = QueryRows(scheme.gqa_ratio, tokens)
        self.R = self.rows.R  # query columns per KV head: gqa x tokens
        self.packed_causal = bool(packed_causal) and tokens > 1
        # a packed tile with at least this many tokens before the sequence's end needs no mask (``row_bound``); the
        # tiles with fewer, at the span's end, are at most MASKED_TILES
        self.UNMASKED_VALID = TILE_TOKENS + (tokens - 1 if self.packed_causal else 0)
        self.MASKED_TILES = (self.UNMASKED_VALID - 1) // TILE_TOKENS + 1
        self.N = 8 if self.R <= 8 else 16  # query columns padded to whole n8 blocks
        self.NB = self.N // 8  # n8 blocks
        self.NS = 2 * self.NB  # distinct query columns per thread in an m16n8 accumulator set
        self.k_operand = FragmentOperand("k", plan.k.bits, self.D, plan.k.construction.b)
        self.v_operand = FragmentOperand("v", plan.v.bits, self.D, plan.v.construction.b)
        self.SUB = page_size // TILE_TOKENS  # tiles per page
        self.KB_D = self.D // 16  # k16 blocks over head_dim (QK reduction)
        self.MB_V = self.D // 16  # m16 channel blocks of V^T
        self.KB_T = TILE_TOKENS // 16  # k16 blocks of a tile's tokens in the packed V layout
        self.q_dtype = half_type(scheme.q_dtype)
        # consecutive tiles of one channel-wise K group: a warp takes them in a run and scales Q once
        self.TPG = plan.k.tiles_per_group
        # warp specialization: producer warpgroup 0, consumer warpgroups 1..NC (NW warps)
        self.NC = consumers
        self.NW = 4 * consumers
        self.threads = THREADS * (1 + consumers)
        self.launch_regs = launch_regs(self.threads, ctas_per_sm)
        self.consumer_regs = consumer_regs(consumers, ctas_per_sm)
        check_register_budget("Hopper decode", [PRODUCER_REGS] + [self.consumer_regs] * consumers, self.launch_regs)
        # stage of the ring (int32 words): K codes | V codes | K params | V params (foscar.decode_kernel)
        self.lay_out_stage(plan, self.k_operand.words, self.v_operand.words)
        # a stage may instead hold a window tile (``window``: foscar.window_tiles.WindowOperands of the
        # 16-bit sink + window slots, foscar.hopper.cache_decode): BLOCK slots' padded K rows | V rows
        self.window = window
        # arrivals that complete a stage's fill: the producer's one (its bulk copies complete the bytes),
        # or, with window tiles, one per producer lane (a window tile's lanes arrive when their cp.async
        # copies land: cp.async.mbarrier.arrive.noinc); a packed tile's producer then arrives for all 32
        self.FULL_ARRIVALS = 1 if window is None else 32
        if window is not None:
            self.WIN_K, self.WIN_V = 0, window.rows_words(BLOCK)
            self.STAGE_WORDS = max(self.STAGE_WORDS, 2 * window.rows_words(BLOCK))
        # Every stage belongs to one consumer warp (STAGES is a multiple of TPG*NW and warp w takes
        # the runs w, w+NW, ...): a warp waits on a stage's `full` parity right after its own
        # previous use of it, never two phases ahead of the fill (which would read as complete).
        per_round = self.TPG * self.NW
        budget = ring_bytes(ctas_per_sm)
        rounds = min(MAX_STAGES, budget // (4 * self.STAGE_WORDS)) // per_round
        if rounds < 1:
            raise ValueError(f"ring stages of {4 * self.STAGE_WORDS} B: {per_round} do not fit in {budget} B")
        self.STAGES = rounds * per_round
        # the consumer loop runs a tile's front beside the previous tile's back where the carried tile fits the
        # registers and a warp's held stage leaves it two in flight (benchmarks/NOTES.md section 37)
        self.PIPELINED = pipelines(self.R, self.STAGES // self.NW)
        # merge area (fp32 words, over the ring): per warp O^T rows (N x (D + pad)), then m and l
        self.MERGE_ROW = self.D + MERGE_PAD
        self.MERGE_WARP = self.N * self.MERGE_ROW + 2 * self.N
        self.RING_WORDS = max(self.STAGES * self.STAGE_WORDS, self.NW * self.MERGE_WARP)


class HopperDecodeKernel(DecodeKernelBase):
    """Fused paged INT2/INT4 decode attention for sm_90a (see the module docstring)."""

    arch = "sm_90a"
    # limits (DecodeConfig): query columns padded to at most two n8 blocks; a group spans whole k16/m16 MMA blocks
    max_gqa_ratio, page_sizes, min_group = 16, (64, 128, 256), 16

    def __init__(self, cfg: DecodeConfig):
        super().__init__(cfg)
        self.k_hooks = hooks_for(cfg.plan.k, cfg)  # the fold cases' device hooks (foscar.hopper.folds)
        self.v_hooks = hooks_for(cfg.plan.v, cfg)

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------
    def launch_decode(self, args: DecodeArgs, grid, stream: cuda.CUstream):
        """Launch the CTAs of ``grid`` (split, KV head, sequence) over ``args``."""
        SharedStorage = self.shared_storage()
        self.launch(self.kernel(self.tiled_mma(), SharedStorage, args), grid, SharedStorage.size_in_bytes(), stream)

    @staticmethod
    def tiled_mma():
        """One warp, m16 x n8 x k16, FP16 operands, FP32 accumulators: both GEMMs."""
        return cute.make_tiled_mma(warp_mma.MmaF16BF16Op(Float16, Float32, (16, 8, 16)))

    def shared_storage(self, **extra):
        """Shared memory: the stage ring (the warps' merge area after the loop), its mbarriers, and
        the ``extra`` fields a subclass names."""
        cfg = self.cfg
        fields = {  # built as a dict: this module's annotations are strings (PEP 563) outside jit functions
            "ring": cute.struct.Align[cute.struct.MemRange[Int32, cfg.RING_WORDS], 1024],
            "barriers": cute.struct.MemRange[Int64, 2 * cfg.STAGES],  # the ring's Channel: full, then empty
            **extra,
        }
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr, args: DecodeArgs):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        split, h, b = cute.arch.block_idx()
        role = cute.arch.make_warp_uniform(tidx // THREADS)  # 0: producer, 1..NC: consumers

        smem = cutlass.memory.SmemAllocator()
        ring = self.ring_of(smem.allocate(SharedStorage))
        self.init_ring_barriers(ring, tidx)
        head = KvHead(b, h, args.kv_heads, b)
        # whole runs of TPG tiles per split, so that a split starts at a K group boundary
        tiles = TileSpan.of_split(at(args.lengths, b), split, args.num_splits, cfg.TPG)

        if role == 0:
            set_warpgroup_registers(PRODUCER_REGS, cfg.launch_regs)
            self.produce(ring, args.pages, head, tiles, cute.arch.make_warp_uniform(tidx // 32), tidx % 32)
        else:
            set_warpgroup_registers(cfg.consumer_regs, cfg.launch_regs)
            warp = cute.arch.make_warp_uniform(tidx // 32 - 4)
            mma = WarpMma(tiled_mma, tidx % 32, cfg.NB)
            self.consume(mma, warp, ring, args.q, head, tiles,
                         Output(args.o, args.lse, cfg.split, split, args.num_splits), args.scale_log2)

    def ring_of(self, storage) -> Ring:
        """The stage ring in ``storage`` (:meth:`shared_storage`)."""
        cfg = self.cfg
        return Ring(storage.ring.data_ptr(), Channel(storage.barriers.data_ptr(), cfg.STAGES), cfg.STAGE_WORDS)

    @cute.jit
    def init_ring_barriers(self, ring: Ring, tidx: Int32):
        """The ring's mbarriers (``foscar.pipeline``): ``full`` counts the producer's arrivals
        (``FULL_ARRIVALS``), ``empty`` the 32 lanes of the warp that owns the stage; then the whole CTA
        syncs."""
        if tidx == 0:
            ring.barriers.init(self.cfg.FULL_ARRIVALS, 32)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

    # ------------------------------------------------------------------------------------------
    # producer: PRODUCER_WARPS warps, one lane of each issues the bulk copies of every P-th tile
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def produce(self, ring: Ring, pages: PackedPages, head: KvHead, tiles: TileSpan, pw: Int32, lane: Int32,
                ring_first=None):
        """Producer warp ``pw``'s tiles of ``tiles``, from ``head``'s pages into the ring. ``ring_first``:
        the local tile (ring position) of the first packed tile, when other tiles come first
        (``foscar.hopper.cache_decode``); else 0."""
        cfg = self.cfg
        P = PRODUCER_WARPS
        SUB = cfg.SUB
        ring0 = 0 if ring_first is None else ring_first  # the ring item of tile tiles.begin
        begin, end = tiles.begin, tiles.end
        page_first = divmod_nonnegative(begin, SUB)[0]
        page_end = divmod_nonnegative(end + SUB - 1, SUB)[0]
        for chunk in cutlass.range(page_first, page_end, 32, unroll=1):
            # lane l holds the page of the chunk's l-th logical page (clamped into the range)
            table_row = head.row.to(Int64) * pages.max_pages
            my_page = at(pages.page_table, table_row + cutlass.min(chunk + lane, page_end - 1))
            tile_lo = cutlass.max(begin, chunk * SUB)
            tile_hi = cutlass.min(end, (chunk + 32) * SUB)
            # producer warp pw issues ring items pw, pw + P, ...: one thread's issue rate is the
            # pipeline's bound otherwise (benchmarks/NOTES.md section 6)
            first = first_item(tile_lo, tile_lo - begin + ring0, pw, P)
            for tile in cutlass.range(first, tile_hi, P, unroll=1):
                page_of_chunk, sub = divmod_nonnegative(tile, SUB)
                page = cute.arch.shuffle_sync(my_page, offset=page_of_chunk - chunk)
                # elect.sync, not `lane == 0`: ptxas then knows one lane issues, and moves the copies' operands to
                # uniform registers directly (under `lane == 0` each copy was an ELECT / R2UR loop over the active
                # lanes' values, ~10 instructions; benchmarks/NOTES.md section 48)
                with cute.arch.elect_one():
                    s, phase = ring.position(tile - begin + ring0)
                    ring.wait_empty(s, phase)
                    cute.arch.mbarrier_arrive_and_expect_tx(ring.barriers.full(s), cfg.TILE_BYTES)
                    if cutlass.const_expr(cfg.FULL_ARRIVALS > 1):  # the arrivals a window tile's lanes make
                        cute.arch.mbarrier_arrive(ring.barriers.full(s), arrive_count=cfg.FULL_ARRIVALS - 1)
                    self.copy_tile(ring.stage(s), ring.barriers.full(s), pages,
                                   page.to(Int64) * head.kv_heads + head.h, sub, sub * TILE_TOKENS)

    # ------------------------------------------------------------------------------------------
    # consumer warp w: runs w, w+NW, ... of TPG consecutive tiles, each tile whole
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consume(self, mma: WarpMma, warp: Int32, ring: Ring, q_ptr: cute.Pointer, head: KvHead, tiles: TileSpan,
                out: Output, scale_log2: Float32):
        merge = self.attend_tiles(mma, warp, ring, q_ptr, head, tiles, scale_log2)
        self.merge_and_store(merge, out, head, warp * 32 + mma.lane)

    @cute.jit
    def attend_tiles(self, mma: WarpMma, warp: Int32, ring: Ring, q_ptr: cute.Pointer, head: KvHead, tiles: TileSpan,
                     scale_log2: Float32, window=None):
        """Consumer warp ``warp``'s tiles of ``tiles`` (``window``'s, if given, before the packed ones:
        ``foscar.hopper.cache_decode``); then every warp's (O, m, l) in the merge area over the ring, which this
        returns."""
        cfg = self.cfg
        qv = self.load_query(mma, q_ptr, head)
        query = QueryOperand(self.k_hooks.setup(mma, qv), scale_log2)
        state = self.start_state(mma)

        n_local = tiles.count()
        n_front = 0
        if cutlass.const_expr(window is not None):
            n_front = window.tiles  # local tiles 0 .. n_front - 1: the window's, before the packed ones
            attend_window = window.attend  # (a method of a local object is not called inside a runtime loop)
        n_tiles = n_front + n_local
        # the loop takes the tiles that need no mask, by one copy of the tile's code; the last one or two packed
        # tiles (``MASKED_TILES``) come after it by a masking copy (a predicated mask would issue its selects in
        # every tile). A warp's tiles stay in order: its masked tiles are the span's last.
        n_plain = n_front + tiles.leading_tiles(cfg.UNMASKED_VALID)
        n_window = 0
        if cutlass.const_expr(window is not None):
            n_window = warp_steps(n_front, warp, cfg.TPG, cfg.NW)
            for step in cutlass.range(0, n_window, 1, unroll=1):
                attend_window(self, mma, ring, state, cfg.TPG * (warp + cfg.NW * (step // cfg.TPG)) + step % cfg.TPG,
                              scale_log2)
        n_mine = warp_steps(n_plain, warp, cfg.TPG, cfg.NW)
        if cutlass.const_expr(cfg.PIPELINED):
            if n_mine > n_window:
                # software-pipelined: a tile's scores and softmax (its front) run beside the previous tile's PV (its
                # back), two independent streams in one basic block for the scheduler
                pending = self.front(mma, ring, query, state, tiles, warp, n_front, n_window, window is not None,
                                     False, hold=True)
                for step in cutlass.range(n_window + 1, n_mine, 1, unroll=1):
                    pending.take(self.front(mma, ring, query, state, tiles, warp, n_front, step, window is not None,
                                            False, hold=True), lambda: self.back(mma, ring, state, pending))
                self.back(mma, ring, state, pending)
        else:
            for step in cutlass.range(n_window, n_mine, 1, unroll=1):
                self.back(mma, ring, state, self.front(mma, ring, query, state, tiles, warp, n_front, step,
                                                        window is not None, False))
        for extra in cutlass.range_constexpr(cfg.MASKED_TILES):
            local_tile = n_plain + extra
            run = local_tile // cfg.TPG
            if local_tile < n_tiles and run % cfg.NW == warp:
                step = cfg.TPG * (run // cfg.NW) + local_tile % cfg.TPG
                self.back(mma, ring, state, self.front(mma, ring, query, state, tiles, warp, n_front, step,
                                                        window is not None, True))
        return self.share_result(mma, warp, ring, state)

    def start_state(self, mma: WarpMma) -> WarpState:
        """The running state before any tile: max -inf, sums 0, O^T 0, the V case's start."""
        vf = self.v_hooks
        m_run = cute.make_rmem_tensor((mma.NS,), Float32)
        l_run = cute.make_rmem_tensor((mma.NS,), Float32)
        for cs in range(mma.NS):
            m_run[cs] = Float32(NEG_INF)
            l_run[cs] = Float32(0.0)
        vst = vf.setup(mma)
        acc_o = [[mma.zero_accumulator() for _ in range(mma.NB)] for _ in range(self.cfg.MB_V)]
        return WarpState(m_run, l_run, acc_o, vst)

    @cute.jit
    def share_result(self, mma: WarpMma, warp: Int32, ring: Ring, state: WarpState):
        """This warp's (O, m, l) into its part of the merge area over the ring, once every consumer warp is
        past its last stage read; returns the merge area once every warp's is there."""
        cfg = self.cfg
        vf = self.v_hooks
        for cs in cutlass.range_constexpr(mma.NS):
            state.row_sum[cs] = reduce_over_rows(state.row_sum[cs], operator.add)
        vf.finish(mma, state.v)
        NamedBarrier(HopperDecodeBarrier.CONSUMERS, cfg.NW * 32).arrive_and_wait()
        merge = cute.make_tensor(cute.recast_ptr(ring.words, dtype=Float32), cute.make_layout(cfg.RING_WORDS))
        mine = warp * cfg.MERGE_WARP
        cols = [mma.column(cs) for cs in range(mma.NS)]
        for md in cutlass.range_constexpr(cfg.MB_V):
            for nb in cutlass.range_constexpr(mma.NB):
                for i in cutlass.range_constexpr(4):
                    val = vf.output(mma, state.v, state.acc_o[md][nb][i], md, nb, i)
                    merge[mine + cols[i % 2 + 2 * nb] * cfg.MERGE_ROW + 16 * md + mma.g + 8 * (i // 2)] = val
        if mma.lane // 4 == 0:  # g == 0: one lane per column slot
            for cs in cutlass.range_constexpr(mma.NS):
                merge[mine + cfg.N * cfg.MERGE_ROW + cols[cs]] = state.row_max[cs]
                merge[mine + cfg.N * cfg.MERGE_ROW + cfg.N + cols[cs]] = state.row_sum[cs]
        NamedBarrier(HopperDecodeBarrier.CONSUMERS, cfg.NW * 32).arrive_and_wait()
        return merge

    # ------------------------------------------------------------------------------------------
    # consumer stages
    # ------------------------------------------------------------------------------------------
    def front(self, mma: WarpMma, ring: Ring, query: QueryOperand, state: WarpState, tiles: TileSpan, warp: Int32,
              n_front, step: Int32, window: bool, masked: bool, hold: bool = False) -> PendingTile:
        """The first half of this warp's ``step``-th tile: stage -> K words and the params, S^T, the online softmax,
        P^T. ``hold``: the stage stays held for :meth:`back` (the pipelined loop: its V words would be live across
        the next tile's front); else the V words and params come into registers too and the stage is released at
        once, for the producer to refill while this tile computes. ``n_front``: the window tiles before the packed
        ones (``window``); ``masked``: the tile may have rows past the end (or past a column's causal bound); else it
        has none."""
        cfg = self.cfg
        if cutlass.const_expr(hold and masked):  # back() reads a held stage's V params unmasked
            raise ValueError("a masked tile's front must release its stage (hold=False)")
        kf, vf = self.k_hooks, self.v_hooks
        ring_tile = cfg.TPG * (warp + cfg.NW * (step // cfg.TPG)) + step % cfg.TPG
        local_tile = ring_tile - n_front
        valid = tiles.valid_tokens(local_tile)  # valid tokens in this tile (>= 1)
        ring_stage, ring_phase = ring.position(ring_tile if window else local_tile)
        ring.wait_full(ring_stage, ring_phase)
        sbuf = ring.stage(ring_stage)
        # virtual warp u of the packed tile: K token block u
        kw = [cfg.k_operand.load_words(sbuf + cfg.K_CODES, 32 * u + mma.lane) for u in range(4)]
        # the thread's accumulator rows are tokens 16*tb + g + 8*hr: index t = 2*tb + hr
        rows = [16 * (t // 2) + mma.g + 8 * (t % 2) for t in range(2 * TOKEN_BLOCKS)]
        ktp = kf.load_params(mma, query.k_state, cute.recast_ptr(sbuf + cfg.K_PARAMS, dtype=Float16), rows, step,
                             query.scale_log2)
        vw = None
        vtp = self.v_params(mma, sbuf, valid, masked) if cutlass.const_expr(vf.scales_p or not hold) else None
        if cutlass.const_expr(not hold):
            vw = self.v_words(mma, sbuf)
            ring.release(ring_stage)  # codes and params are in registers
        sc = self.scores(mma, query.k_state, ktp, kw)
        if cutlass.const_expr(masked):
            self.mask_scores(mma, sc, rows, valid)
        # under the causal mask a column may see none of the tile's tokens
        alpha, _moved = self.online_softmax(mma, sc, state, may_be_empty=cfg.packed_causal)
        vf.rescale_corrections(mma, state.v, alpha)
        pB, acc_p = self.p_operands(mma, state, vtp, sc)
        held = cute.make_rmem_tensor((1,), Int32)  # the stage
        held[0] = ring_stage
        return PendingTile(held, pB, acc_p, alpha, vtp, vw)

    def back(self, mma: WarpMma, ring: Ring, state: WarpState, tile: PendingTile):
        """The second half of a tile (:meth:`front`'s): O^T = O^T * alpha + the tile's PV; where the front held the
        stage (an unmasked tile), its V words (and the V params a case takes after the MMA) from there first, and the
        stage released."""
        vw, vtp = tile.v_words, tile.v_params
        if cutlass.const_expr(vw is None):
            sbuf = ring.stage(tile.held[0])
            vw = self.v_words(mma, sbuf)
            if cutlass.const_expr(vtp is None):
                vtp = self.v_params(mma, sbuf, None, False)
            ring.release(tile.held[0])
        self.v_hooks.accumulate(mma, state.v, vtp, tile.acc_p, state.acc_o, tile.pB, vw, tile.alpha)

    def v_words(self, mma: WarpMma, sbuf):
        """The thread's V code words of the tile in stage ``sbuf``: virtual warp u's (V channel blocks u, u+4, ...)."""
        return [self.cfg.v_operand.load_words(sbuf + self.cfg.V_CODES, 32 * u + mma.lane) for u in range(4)]

    def v_params(self, mma: WarpMma, sbuf, valid, masked: bool):
        """The V case's params of the tile in stage ``sbuf`` (zero past ``valid`` tokens where ``masked``)."""
        rows = [16 * (t // 2) + mma.g + 8 * (t % 2) for t in range(2 * TOKEN_BLOCKS)]
        vtp = self.v_hooks.load_params(mma, cute.recast_ptr(sbuf + self.cfg.V_PARAMS, dtype=Float16), rows)
        if cutlass.const_expr(masked):
            self.v_hooks.mask_params(mma, vtp, rows, valid)
        return vtp

    def load_query(self, mma: WarpMma, q_ptr: cute.Pointer, head: KvHead):
        """fp32 q values of the thread's Q^T B-fragment positions (``q_index`` order); 0 for the
        padding columns past R (``foscar.query_rows``: the column's row of q)."""
        cfg = self.cfg
        q_base = cfg.rows.row(head.b, head.h, 0, head.kv_heads) * cfg.D
        qv = cute.make_rmem_tensor((mma.NB * cfg.KB_D * 4,), Float32)
        for nb in range(mma.NB):
            col = 8 * nb + mma.g  # the query column
            q_row = q_base + cfg.rows.offset(cutlass.min(col, cfg.R - 1), head.kv_heads) * cfg.D
            for kb in range(cfg.KB_D):
                for hh in range(2):
                    for e in range(2):
                        d = 16 * kb + 8 * hh + 2 * mma.tq + e
                        x = cute.make_tensor(q_ptr + (q_row + d), cute.make_layout((1,)))[0].to(Float32)
                        qv[q_index(cfg, nb, kb, hh, e)] = fsel(col < cfg.R, x, Float32(0.0))
        return qv

    def scores(self, mma: WarpMma, kst, ktp, kw):
        """S^T = K . Q^T of the tile with the K case's scale and correction, unmasked: ``sc[(tb * NB + nb) * 4 + i]``,
        log2 domain."""
        cfg = self.cfg
        sc = cute.make_rmem_tensor((TOKEN_BLOCKS * mma.NB * 4,), Float32)  # (tb, nb, i)
        for tb in range(TOKEN_BLOCKS):
            kfr = [cfg.k_operand.a_fragment(mma, kw[tb], 4 * kb) for kb in range(cfg.KB_D)]
            for nb in range(mma.NB):
                vals = self.k_hooks.scores(mma, kst, ktp, kfr, tb, nb)
                for i in range(4):
                    sc[(tb * mma.NB + nb) * 4 + i] = vals[i]
        return sc

    def mask_scores(self, mma: WarpMma, sc, rows, valid: Int32):
        """-inf for the scores past the end (and, with ``packed_causal``, past each column's token): only a tile with
        ``valid < UNMASKED_VALID`` has any; the others skip these selects (benchmarks/NOTES.md section 36)."""
        cfg = self.cfg
        bound = [valid] * mma.NS  # per column slot: the tile's rows it attends are those below
        if cutlass.const_expr(cfg.packed_causal):
            bound = [cfg.rows.row_bound(mma.column(cs), valid) for cs in range(mma.NS)]
        for tb in range(TOKEN_BLOCKS):
            for nb in range(mma.NB):
                for i in range(4):
                    x = (tb * mma.NB + nb) * 4 + i
                    sc[x] = fsel(rows[2 * tb + i // 2] < bound[i % 2 + 2 * nb], sc[x], Float32(NEG_INF))

    def online_softmax(self, mma: WarpMma, sc, state: WarpState, token_blocks: int = TOKEN_BLOCKS,
                       may_be_empty=False):
        """Fold the scores of ``token_blocks`` m16 blocks into the running max and sum of this warp's
        tokens; returns (alpha per column slot, whether any column's max moved in the warp: O needs
        rescaling). ``may_be_empty``: the blocks may hold no token (every score -inf), so the max
        may stay -inf."""
        m_run, l_run = state.row_max, state.row_sum
        alpha = cute.make_rmem_tensor((mma.NS,), Float32)
        for cs in range(mma.NS):
            nb, e = cs // 2, cs % 2
            mx = sc[nb * 4 + e]
            for t in range(1, 2 * token_blocks):
                mx = cute.arch.fmax(mx, sc[((t // 2) * mma.NB + nb) * 4 + e + 2 * (t % 2)])
            mx = reduce_over_rows(mx, cute.arch.fmax)
            m_run[cs], alpha[cs], _ = online_update(m_run[cs], mx, cute.arch.exp2, may_be_empty)
            l_run[cs] = l_run[cs] * alpha[cs]
        moved = alpha[0] != Float32(1.0)
        for cs in range(1, mma.NS):
            moved = moved | (alpha[cs] != Float32(1.0))
        return alpha, cute.arch.vote_any_sync(moved)

    def max_reference(self, m):
        """The running max that P subtracts: finite where a column may have seen no token yet (-inf - -inf)."""
        return finite_reference(m) if self.cfg.packed_causal else m

    def p_operands(self, mma: WarpMma, state: WarpState, vtp, sc):
        """P = exp2(S - m) into the P^T B fragments ``pB[tb][nb][ps]`` (rows = tokens become k by
        ``movmatrix``), one copy per P set of the V case (scaled or not), adding P to the row sums."""
        vf = self.v_hooks
        pB = [[[mma.fragment_B() for _ in range(vf.psets)] for _ in range(mma.NB)] for _ in range(TOKEN_BLOCKS)]
        acc_p = vf.begin_p(mma, state.v)
        for tb in range(TOKEN_BLOCKS):
            for nb in range(mma.NB):
                p = [cute.arch.exp2(sc[(tb * mma.NB + nb) * 4 + i] - self.max_reference(state.row_max[i % 2 + 2 * nb]))
                     for i in range(4)]
                for i in range(4):
                    state.row_sum[i % 2 + 2 * nb] = state.row_sum[i % 2 + 2 * nb] + p[i]
                for ps in range(vf.psets):
                    p_regs = cute.recast_tensor(pB[tb][nb][ps], Int32)
                    for hr in range(2):
                        p_regs[hr] = movmatrix_trans(vf.pack_p(mma, state.v, vtp, acc_p, p, tb, nb, hr, ps))
        vf.end_p(mma, acc_p)
        return pB, acc_p

    @cute.jit
    def merge_and_store(self, merge: cute.Tensor, out: Output, head: KvHead, tc: Int32):
        """Merge the NW warps' (O, m, l) from shared memory, one output element per consumer thread
        and pass (coalesced along the channel), and write O (normalized) and lse to ``out``."""
        cfg = self.cfg
        N, D, R, NW = cfg.N, cfg.D, cfg.R, cfg.NW
        ml = N * cfg.MERGE_ROW  # offset of m (then l) in a warp's area
        for x in cutlass.range_constexpr((R * D + NW * 32 - 1) // (NW * 32)):
            el = tc + NW * 32 * x
            if el < R * D:
                col = el // D
                d = el % D
                m_all = Float32(NEG_INF)
                for w in cutlass.range_constexpr(NW):
                    m_all = cute.arch.fmax(m_all, merge[w * cfg.MERGE_WARP + ml + col])
                m_ref = finite_reference(m_all)  # all empty: weights 0
                lt = Float32(0.0)
                ot = Float32(0.0)
                for w in cutlass.range_constexpr(NW):
                    wt = cute.arch.exp2(merge[w * cfg.MERGE_WARP + ml + col] - m_ref)
                    lt = lt + merge[w * cfg.MERGE_WARP + ml + N + col] * wt
                    ot = ot + merge[w * cfg.MERGE_WARP + col * cfg.MERGE_ROW + d] * wt
                inv_l, lse = normalize(lt, m_all, fastmath=False)
                obase, lidx = out.offsets(cfg.rows, head, col, D)
                if d == 0:  # (``store``: an assignment naming ``out`` would make it a value the `if` writes)
                    store(out.lse, lidx, lse)
                val = ot * inv_l
                o = cute.make_tensor(out.o + (obase + d), cute.make_layout((1,)))
                o[0] = val if cutlass.const_expr(out.partial) else val.to(cfg.q_dtype)
