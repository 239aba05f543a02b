"""Dequantize a paged, packed KV cache into a dense BF16 (or FP16) tensor (CuTe DSL, sm_90a and sm_100a).

Why this kernel exists: the BF16 output feeds the dequantize-then-attend baseline and the blocks of
``foscar.chunk_attention`` (``PagedKVCache._cached_blocks``, in the query's dtype), and GPU tests compare
it bit for bit against the torch dequantizer. It reads either arch's packed bit order (``layout``:
``"hopper"``, the mma.sync A-fragment order of ``foscar.layouts.fragment``; ``"blackwell"``, runs of
reduction-axis elements per word, ``foscar.layouts.blackwell``), so a cache of either arch is dequantized
on the GPU. It is a bandwidth kernel -- 2-4 bytes read per 16 written -- so the design goals are few
instructions per output element (each packed word read once per thread, params loaded and converted
once per thread; 5.3-6.6 SASS instructions per element at head_dim 128, from 10.6-15.0) and stores of
whole 128-byte lines; :class:`TilePlan` says which thread makes what, from the layout's explicit formula.

Formats (one KV head dimension ``D``, ``bits`` per code, group ``G``)::

    codes       int32   [num_pages, kv_heads, page_size // 64, tile_words]   tile_words = 64*D*bits/32
    params      float16 [num_pages, kv_heads, page_size, D // G, F]          token-wise groups
                float16 [num_pages, kv_heads, page_size // G, D, F]          channel-wise groups
                        last mode (scale, offset): x = scale * code + offset (F = 2), or the scale of a
                        scale-only format (F = 1): offset = offset_per_scale * scale
    page_table  int32   [batch, max_pages]
    out         bf16    [batch, kv_heads, max_pages * page_size, D]                 (or fp16: ``dtype``)

Token ``i`` of sequence ``b`` lives in page ``page_table[b, i // page_size]``, slot
``i % page_size``. Every page-table entry is read, so unused entries must hold a valid page index.

Values: ``scale * code + offset`` as one FP32 FMA (a scale-only format's offset ``offset_per_scale * scale``: exact
for a power-of-two multiple such as symmetric INT4's -8), then rounded to the output dtype: exactly the torch
dequantizer's value computed in float64, rounded to FP32 then to the dtype (the FP32 torch dequantizer
rounds the product first, so it can be one FP32 ulp off before the final rounding).

The host side takes raw pointers and Int32 extents, not tensors: one compiled function then serves
every shape, the fake-pointer compile on a CPU machine produces exactly the kernel a GPU runs, and
no TVM-FFI is needed to call it from torch.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from fractions import Fraction

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from ..checks import INDEX_LIMIT
from ..jit import cached_compile, device_arch, fake_ptr, launch
from ..layouts.blackwell import bw_tile_position
from ..layouts.fragment import TILE_TOKENS, TileGeometry, tile_position
from ..formats import affine_mismatch
from ..scheme import Axis, Scheme, params_shape

__all__ = ["DequantizeConfig", "Dequantize", "TilePlan", "tile_plan", "POSITIONS", "compile_dequantize",
           "dequantize_pages", "PagesDequantizer"]

THREADS = 128  # a CTA: the 7 thread-index bits of TilePlan.thread
CHUNK = 8  # channels per thread per store: 8 bf16 = one 16-byte store
OUT_TYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
# packed layout -> explicit (token, channel) -> code position formula (the packers' ``foscar.layouts.PACKERS``)
POSITIONS = {"hopper": tile_position, "blackwell": bw_tile_position}
BANK_BITS = 5  # 32 shared-memory banks of one word
SWIZZLE_TARGETS = (2, 3, 4)  # word-index bits a swizzle may flip: not 0, 1, which a 16-byte staging vector spans


@dataclass(frozen=True)
class DequantizeConfig:
    """Everything the compiled kernel depends on (the compile-cache key)."""

    bits: int
    head_dim: int
    role: str  # 'k' or 'v': which packed tile layout
    axis: Axis  # group axis of this role's (scale, offset)
    group: int
    dtype: str = "bfloat16"  # the output's: "bfloat16" or "float16"
    layout: str = "hopper"  # the packed bit order read (an arch's ``Arch.layout``): "hopper" or "blackwell"
    offset_per_scale: Fraction | None = None  # a scale-only format's (``Format.offset_per_scale``); None: pairs

    def __post_init__(self):
        object.__setattr__(self, "axis", Axis(self.axis))
        if self.offset_per_scale is not None:
            if isinstance(self.offset_per_scale, bool) or not isinstance(self.offset_per_scale, (int, Fraction)):
                raise ValueError(f"offset_per_scale must be None, an int or a Fraction, got {self.offset_per_scale!r}")
            object.__setattr__(self, "offset_per_scale", Fraction(self.offset_per_scale))
        TileGeometry(self.role, self.bits, self.head_dim)  # validates role, bits, head_dim
        if self.group % CHUNK or self.group & (self.group - 1):
            raise ValueError(f"group {self.group} must be a power of two and a multiple of {CHUNK}")
        if self.axis is Axis.TOKEN and self.head_dim % self.group:
            raise ValueError(f"token-wise group {self.group} must divide head_dim {self.head_dim}")
        if self.dtype not in OUT_TYPES:
            raise ValueError(f"dtype must be one of {sorted(OUT_TYPES)}, got {self.dtype!r}")
        if self.layout not in POSITIONS:
            raise ValueError(f"layout must be one of {sorted(POSITIONS)}, got {self.layout!r}")

    @classmethod
    def of(cls, scheme_or_config, role: str | None = None, dtype: str = "bfloat16",
           layout: str = "hopper") -> "DequantizeConfig":
        if isinstance(scheme_or_config, cls):
            return scheme_or_config
        if not isinstance(scheme_or_config, Scheme) or role not in ("k", "v"):
            raise TypeError("pass a DequantizeConfig, or a Scheme and role='k' or 'v'")
        quant = scheme_or_config.k if role == "k" else scheme_or_config.v
        mismatch = affine_mismatch(quant.format)
        if mismatch:
            raise ValueError(f"Scheme.{role}.format: {mismatch}")
        return cls(quant.bits, scheme_or_config.head_dim, role, quant.axis, quant.group, dtype, layout,
                   quant.format.offset_per_scale)

    @property
    def param_fields(self) -> int:
        """fp16 params per group: 2 (scale, offset) or 1 (scale)."""
        return 2 if self.offset_per_scale is None else 1

    @property
    def out_type(self):
        return OUT_TYPES[self.dtype]

    @property
    def geometry(self) -> TileGeometry:
        return TileGeometry(self.role, self.bits, self.head_dim)

    @property
    def tile_words(self) -> int:
        return self.geometry.words

    @property
    def plan(self) -> "TilePlan":
        return tile_plan(self.geometry, self.layout)


# --------------------------------------------------------------------------------------------
# The plan: which thread makes which chunk, and where its codes are (host side, trace-time tables)
# --------------------------------------------------------------------------------------------

Bit = tuple  # a coordinate bit of a tile element: ("t", i) = token bit i, ("c", j) = channel bit j


@dataclass(frozen=True)
class TilePlan:
    """Who makes which output chunk of a 64-token tile, and where its codes sit (host-side tables).

    Both packed orders are *bit-linear*: the first bit of (token, channel)'s code in the tile's bit
    stream is the sum of one weight per set coordinate bit (``token_weights[i]`` for token bit ``i``,
    ``channel_weights[j]`` for channel bit ``j``; distinct powers of two). A coordinate bit whose weight
    is < 32 picks a code inside a word (a *shift bit*), a larger one picks the word. So a thread
    whose own share of the tile is fixed by some coordinate bits (``thread``: the bits of its thread
    index; ``step``: its unrolled steps) and walks the others (``inner``) needs only trace-time
    constants -- word offsets and shifts -- on top of one per-thread word index and shift.

    * ``inner``: channel bits 0-2 (the 8 channels of one 16-byte store) and the token shift bits (up
      to the thread's share), so a thread uses every code of a word it reads for its tokens;
    * ``thread``: lane bits 0-4 then warp bits 0-1. The lanes start with channel bits 3-5 (8 chunks
      = 128 contiguous bytes of a row per store instruction: whole lines); the other two lane bits
      are chosen so that a warp's word reads hit distinct banks (with ``swizzle``). Channel shift bits
      on a lane are a per-thread shift (the lanes that share a word read it in one broadcast);
    * ``step``: the rest (token bits), unrolled;
    * ``swizzle``: (high bit, bank bit) pairs of the shared-memory XOR swizzle: word index ``w`` is
      stored at ``w ^ sum(((w >> h) & 1) << b)``. It flips bits 2-4 only, so a 16-byte staging
      vector stays whole and a warp's staging stores stay conflict-free.
    """

    layout: str
    bits: int
    head_dim: int
    token_weights: tuple
    channel_weights: tuple
    inner: tuple
    thread: tuple
    step: tuple
    swizzle: tuple

    def weight(self, bit: Bit) -> int:
        return (self.token_weights if bit[0] == "t" else self.channel_weights)[bit[1]]

    def position(self, token: int, channel: int) -> int:
        """First bit of the code of (token, channel) in the tile's bit stream, from the weights."""
        return (sum(w for i, w in enumerate(self.token_weights) if token >> i & 1)
                + sum(w for j, w in enumerate(self.channel_weights) if channel >> j & 1))

    def coords(self, bits, n: int):
        """(token, channel, bit position) of the coordinate bits ``bits`` set as the binary digits of ``n``."""
        token = sum(1 << b[1] for k, b in enumerate(bits) if n >> k & 1 and b[0] == "t")
        channel = sum(1 << b[1] for k, b in enumerate(bits) if n >> k & 1 and b[0] == "c")
        return token, channel, self.position(token, channel)

    def element(self, step: int, k: int, e: int):
        """(token offset, bit offset) of channel ``e`` of chunk ``k`` of ``step``, past the thread's own
        token and bit position (the thread's chunks share its channels: channel = its channel + ``e``)."""
        step_token, _, step_bit = self.coords(self.step, step)
        token, _, bit = self.coords(self.inner, (k << 3) | e)
        return step_token + token, step_bit + bit

    def word_index(self, word0, offset: int):
        """Shared-memory index of the word ``offset`` words past the thread's own (swizzled) ``word0``:
        the swizzle is linear, so ``word0`` op the constant's swizzled index, op an add where their bits
        are disjoint (an immediate offset), else an XOR. ``word0``: an int or a DSL Int32."""
        const = self.swizzled(offset)
        return word0 + const if (const & self.thread_word_bits) == 0 else word0 ^ const

    def swizzled(self, word: int) -> int:
        """Shared-memory index of tile word ``word``."""
        return word ^ sum(((word >> high) & 1) << low for high, low in self.swizzle)

    @property
    def steps(self) -> int:
        return 1 << len(self.step)

    @property
    def inner_tokens(self) -> int:
        """Tokens a thread makes per step (its chunks per step)."""
        return 1 << (len(self.inner) - 3)

    def thread_strides(self, part: str):
        """Per thread-index bit, what it adds to the thread's token ("t"), channel ("c") or bit position ("p")."""
        if part == "p":
            return tuple(self.weight(b) for b in self.thread)
        return tuple(1 << b[1] if b[0] == part else 0 for b in self.thread)

    @property
    def thread_word_bits(self) -> int:
        """Bits a thread's swizzled word index may have: a constant word offset disjoint from them is added."""
        return functools.reduce(lambda a, b: a | self.swizzled(b), (w >> 5 for w in self.thread_strides("p")), 0)

    @property
    def dynamic_shift(self) -> bool:
        """Whether some thread bit is a shift bit (then each word read is shifted by the thread's shift)."""
        return any(w & 31 for w in self.thread_strides("p"))

    def bank_conflicts(self) -> int:
        """Most distinct words of one warp read that share a bank (1: conflict-free)."""
        lane_words = [self.weight(b) >> 5 for b in self.thread[:5]]
        return _conflicts(lane_words, self.swizzle)


def _conflicts(lane_words, swizzle) -> int:
    def swizzled(w):
        return w ^ sum(((w >> high) & 1) << low for high, low in swizzle)

    words = {sum(w for k, w in enumerate(lane_words) if lane >> k & 1) for lane in range(32)}
    banks = {}
    for w in words:
        banks.setdefault(swizzled(w) % (1 << BANK_BITS), set()).add(w)
    return max(len(v) for v in banks.values())


def _swizzle_for(lane_words, other_words):
    """(high, bank bit) pairs that spread the lanes' words over distinct banks where possible: each
    lane word bit >= 5 goes to a free bank bit among 2-4, preferring one no other thread/constant word
    offset uses (then offsets add, and a read keeps its immediate offset)."""
    low = {w.bit_length() - 1 for w in lane_words if 0 < w < 32}
    high = sorted({w.bit_length() - 1 for w in lane_words if w >= 32})
    other = {b for w in other_words for b in range(BANK_BITS) if w >> b & 1}
    free = sorted((b for b in SWIZZLE_TARGETS if b not in low), key=lambda b: (b in other, b))
    return tuple(zip(high, free))


@functools.lru_cache(maxsize=None)
def tile_plan(geom: TileGeometry, layout: str) -> TilePlan:
    """The :class:`TilePlan` of ``geom`` in ``layout``'s bit order; checks that the explicit position
    formula (``POSITIONS[layout]``) is bit-linear, on every element of the tile."""
    position = POSITIONS[layout]
    dim_bits = geom.head_dim.bit_length() - 1
    token_bits = TILE_TOKENS.bit_length() - 1
    token_w = tuple(position(geom, 1 << i, 0) * geom.bits for i in range(token_bits))
    channel_w = tuple(position(geom, 0, 1 << j) * geom.bits for j in range(dim_bits))
    for t in range(TILE_TOKENS):
        for c in range(geom.head_dim):
            linear = sum(w for i, w in enumerate(token_w) if t >> i & 1) + sum(
                w for j, w in enumerate(channel_w) if c >> j & 1)
            if linear != position(geom, t, c) * geom.bits:
                raise AssertionError(f"{layout} order of {geom} is not bit-linear at token {t}, channel {c}")
    weight = {**{("t", i): w for i, w in enumerate(token_w)}, **{("c", j): w for j, w in enumerate(channel_w)}}
    # distinct powers of two (linear and one-to-one): word offsets and shifts of disjoint bits add without carries
    if sorted(weight.values()) != sorted(geom.bits << k for k in range(len(weight))):
        raise AssertionError(f"{layout} order of {geom}: coordinate weights are not distinct powers of two")
    if dim_bits < 6 or THREADS != 128:
        raise AssertionError("the plan puts channel bits 3-5 on the lanes, 7 thread bits: head_dim >= 64, 128 threads")

    share = token_bits + dim_bits - (THREADS.bit_length() - 1)  # coordinate bits of one thread's elements
    inner = [("c", 0), ("c", 1), ("c", 2)] + [("t", i) for i in range(token_bits) if token_w[i] < 32]
    while len(inner) > share:  # too many token shift bits: the heaviest become per-thread shifts
        inner.remove(max(inner[3:], key=weight.get))
    rest = [("c", j) for j in range(3, dim_bits)] + [("t", i) for i in range(token_bits) if ("t", i) not in inner]
    const_words = [weight[b] >> 5 for b in inner]
    best = None
    for pair in itertools.combinations(rest[3:], 2):  # the two lane bits after channel bits 3-5
        lanes = rest[:3] + list(pair)
        others = [b for b in rest if b not in lanes]
        lane_words = [weight[b] >> 5 for b in lanes]
        swizzle = _swizzle_for(lane_words, const_words + [weight[b] >> 5 for b in others])
        rank = _conflicts(lane_words, swizzle)
        if best is None or rank < best[0]:
            best = (rank, lanes, others, swizzle)
    _, lanes, others, swizzle = best
    thread, step = tuple(lanes + others[:2]), tuple(others[2:])
    if any(b[0] == "c" or weight[b] < 32 for b in step):  # a step's codes lie in other words than the last step's
        raise AssertionError(f"a step bit must be a token word bit (shared channels, each word read once): {step}")
    return TilePlan(layout, geom.bits, geom.head_dim, token_w, channel_w, tuple(inner), thread, step, swizzle)


# --------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------


class Dequantize:
    """One CTA (128 threads) per (``tiles`` consecutive 64-token tiles, kv head, sequence): one tile for
    head_dim >= 128, two for 64. :class:`TilePlan` maps a tile's work onto the threads.

    1. Load each tile's page-table entry; issue its packed words (vectors of up to 16 bytes, coalesced) and the
       thread's (scale, offset) pairs (4 bytes each: one per token, or one per channel and group row),
       each loaded and converted to FP32 once per thread.
    2. Store the words to shared memory through the plan's XOR swizzle; one barrier.
    3. Each thread reads each word it needs once per step (an ``LDS.32``, lanes that share a word
       broadcast it; conflict-free but for the Blackwell INT8 K tile, 2-way),
       takes its codes with a shift and a mask (or a mask and a prescaled
       scale), ``scale * code + offset`` as one FP32 FMA, and writes 16-byte chunks: a warp's store
       covers whole 128-byte lines.
    """

    def __init__(self, config: DequantizeConfig):
        self.cfg = config
        self.plan = config.plan
        self.words = config.tile_words
        # tiles per CTA: at least 64 elements per thread, which amortizes the per-thread index math, the
        # page-table load and the barrier. Not more: the loads of every tile are issued before the barrier,
        # and their params would hold more than 64 registers (fewer threads per SM)
        self.tiles = max(1, 128 // config.head_dim)
        self.vec = min(4, self.words // THREADS)  # words per staging load (16 bytes when possible)
        self.stage_steps = self.words // (self.vec * THREADS)
        self.group_shift = config.group.bit_length() - 1
        # Take a code at bit s as ``word & (mask << s)`` = code * 2^s (exact in FP32) and fold 2^-s into its
        # scale: FMA(scale * 2^-s, code * 2^s, offset) is FMA(scale, code, offset) bit for bit (the products
        # are equal and exact; scale * 2^-s >= 2^-55 stays a normal FP32). One FMUL per (scale, shift) pair
        # instead of one shift per element: used where the thread has fewer such pairs than shifted codes.
        shifted, pairs = 0, set()
        for s in range(self.plan.steps):
            for k in range(self.plan.inner_tokens):
                for e in range(CHUNK):
                    token, bit = self.plan.element(s, k, e)
                    if bit & 31:
                        shifted += 1
                        pairs.add((self.param_key(token), e if config.axis is Axis.CHANNEL else 0, bit & 31))
        self.prescale = len(pairs) < shifted

    @cute.jit
    def __call__(
        self,
        codes: cute.Pointer,
        params: cute.Pointer,
        page_table: cute.Pointer,
        out: cute.Pointer,
        num_pages: cutlass.Int32,
        kv_heads: cutlass.Int32,
        page_size: cutlass.Int32,
        batch: cutlass.Int32,
        max_pages: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        D, G = cfg.head_dim, cfg.group
        tiles_per_page = page_size // TILE_TOKENS
        row_major4 = (3, 2, 1, 0)
        row_major5 = (4, 3, 2, 1, 0)
        # (num_pages, kv_heads, tiles_per_page, tile_words)
        mCodes = cute.make_tensor(
            codes, cute.make_ordered_layout((num_pages, kv_heads, tiles_per_page, self.words), row_major4)
        )
        # (num_pages, kv_heads, page_size, D // G, F) token-wise; (num_pages, kv_heads, page_size // G, D, F)
        # channel-wise; F = param_fields
        shape = (num_pages, kv_heads, *params_shape(cfg.axis, G, page_size, D), cfg.param_fields)
        mParams = cute.make_tensor(params, cute.make_ordered_layout(shape, row_major5))
        # (batch, max_pages)
        mPages = cute.make_tensor(page_table, cute.make_ordered_layout((batch, max_pages), (1, 0)))
        # (batch, kv_heads, max_pages * page_size, D)
        mOut = cute.make_tensor(
            out, cute.make_ordered_layout((batch, kv_heads, max_pages * page_size, D), row_major4)
        )
        tiles = max_pages * tiles_per_page  # of a sequence
        # tile -> (page index, tile in page) with a multiply-high, not a division per thread
        self.kernel(mCodes, mParams, mPages, mOut, cute.fast_divmod_create_divisor_v2(tiles_per_page), tiles).launch(
            grid=[(tiles + self.tiles - 1) // self.tiles, kv_heads, batch], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mCodes: cute.Tensor,
        mParams: cute.Tensor,
        mPages: cute.Tensor,
        mOut: cute.Tensor,
        tiles_per_page: cute.FastDivmodDivisorV2,
        tiles: cutlass.Int32,
    ):
        plan = self.plan
        tidx, _, _ = cute.arch.thread_idx()
        block, head, seq = cute.arch.block_idx()

        # this thread's share of a tile (TilePlan.thread): its token, its chunk's first channel, and
        # the bit position of its (token, channel) in the packed stream
        token0 = _thread_part(plan.thread_strides("t"), tidx)
        channel0 = _thread_part(plan.thread_strides("c"), tidx)
        bit0 = _thread_part(plan.thread_strides("p"), tidx)

        # issue every load of the CTA's tiles, then stage the words
        smem = cutlass.memory.SmemAllocator()
        # (tile_words, tiles per CTA)
        sCodes = smem.allocate_tensor(cutlass.Int32, cute.make_layout((self.words, self.tiles)), byte_alignment=16)
        staged, params = [], []
        for i in cutlass.range_constexpr(self.tiles):
            # past the sequence's last tile (a tile count not a multiple of self.tiles): redo the last one,
            # which writes the same values again, so no branch
            tile = cutlass.min(block * self.tiles + i, tiles - 1)
            page_index, tile_in_page = divmod(tile, tiles_per_page)
            page = mPages[seq, page_index]
            staged.append(self.load_words(mCodes[page, head, tile_in_page, None], tidx))
            params.append(self.load_params(mParams[page, head, None, None, None], tile_in_page, token0, channel0))
        for i in cutlass.range_constexpr(self.tiles):
            self.store_words(staged[i], sCodes[None, i], tidx)
        cute.arch.sync_threads()

        word0 = _swizzled(bit0 >> 5, plan.swizzle)
        shift0 = bit0 & 31
        for i in cutlass.range_constexpr(self.tiles):
            tile = cutlass.min(block * self.tiles + i, tiles - 1)
            # (tile tokens, D) of this tile
            gTile = cute.local_tile(mOut[seq, head, None, None], (TILE_TOKENS, self.cfg.head_dim), (tile, 0))
            scaled = {}  # (param key, channel, shift) -> scale * 2^-shift, for the prescaled codes
            for s in cutlass.range_constexpr(plan.steps):
                self.make_step(s, sCodes[None, i], word0, shift0, params[i], scaled, gTile, token0, channel0)

    # ---- 1. loads ---------------------------------------------------------------------------------

    def load_words(self, gWords: cute.Tensor, tidx):
        """Issue the tile's packed words, ``vec`` consecutive words per thread and load (coalesced)."""
        # ((vec), (words / vec)): vector v of the tile
        gWordsV = cute.zipped_divide(gWords, (self.vec,))
        staged = []
        for st in range(self.stage_steps):
            regs = cute.make_rmem_tensor((self.vec,), cutlass.Int32)
            cute.autovec_copy(gWordsV[None, st * THREADS + tidx], regs)
            staged.append(regs)
        return staged

    def store_words(self, staged, sCodes: cute.Tensor, tidx):
        """Stage the words in shared memory at their swizzled index (the swizzle keeps a vector whole)."""
        # ((vec), (words / vec))
        sWordsV = cute.zipped_divide(sCodes, (self.vec,))
        for st, regs in enumerate(staged):
            word = (st * THREADS + tidx) * self.vec
            cute.autovec_copy(regs, sWordsV[None, _swizzled(word, self.plan.swizzle) // self.vec])

    def load_params(self, gParams: cute.Tensor, tile_in_page, token0, channel0):
        """This thread's groups' (scale, offset) in FP32, each loaded and converted once, keyed by what
        selects them among the thread's elements: its token offset (token-wise: one pair per token, the
        group of its chunk) or its group-row offset (channel-wise: 8 pairs, one per chunk channel)."""
        cfg, plan = self.cfg, self.plan
        slot0 = tile_in_page * TILE_TOKENS + token0
        pairs = {}
        for s in range(plan.steps):
            for k in range(plan.inner_tokens):
                token = plan.element(s, k, 0)[0]
                key = self.param_key(token)
                if key in pairs:
                    continue
                if cutlass.const_expr(cfg.axis is Axis.TOKEN):
                    # (F): the params of (slot0 + token, the chunk's group)
                    pairs[key] = [_load_group(gParams[slot0 + token, channel0 // cfg.group, None], cfg)]
                else:
                    # 8 x (F): the params of the chunk's channels in one group row; slot0 | token: disjoint bits
                    row = ((tile_in_page * TILE_TOKENS) >> self.group_shift) + key
                    if cutlass.const_expr(self.group_shift < 6):  # groups shorter than a tile
                        row = row + (token0 >> self.group_shift)
                    pairs[key] = [_load_group(gParams[row, channel0 + e, None], cfg) for e in range(CHUNK)]
        return pairs

    # ---- 3. dequantize ----------------------------------------------------------------------------

    def param_key(self, token: int):
        """Which of the thread's param pairs a token offset uses: its own (token-wise) or its group row's."""
        return token if self.cfg.axis is Axis.TOKEN else token >> self.group_shift

    def make_step(self, s: int, sCodes: cute.Tensor, word0, shift0, params, scaled, gTile: cute.Tensor, token0,
                  channel0):
        """Step ``s``: this thread's ``inner_tokens`` chunks (8 channels of one token each)."""
        cfg, plan = self.cfg, self.plan
        mask = (1 << cfg.bits) - 1
        words = {}  # word offset -> the word, shifted by the thread's shift: each read once per step
        for k in range(plan.inner_tokens):
            values = cute.make_rmem_tensor((CHUNK,), cfg.out_type)
            token = plan.element(s, k, 0)[0]  # the chunk's (its channels differ in bits 0-2 only)
            for e in range(CHUNK):
                bit = plan.element(s, k, e)[1]
                if bit >> 5 not in words:
                    words[bit >> 5] = self.read_word(sCodes, word0, shift0, bit >> 5)
                word, shift, key = words[bit >> 5], bit & 31, self.param_key(token)
                scale, offset = params[key][e if cfg.axis is Axis.CHANNEL else 0]
                if shift == 0:
                    code = word & mask
                elif self.prescale:  # code * 2^shift, and scale * 2^-shift (see __init__)
                    code = word & (mask << shift)
                    index = (key, e if cfg.axis is Axis.CHANNEL else 0, shift)
                    if index not in scaled:
                        scaled[index] = scale * cutlass.Float32(2.0 ** -shift)
                    scale = scaled[index]
                else:
                    code = (word >> shift) & mask
                values[e] = (scale * code.to(cutlass.Float32) + offset).to(cfg.out_type)
            # ((CHUNK), (D / CHUNK)) of the chunk's row
            gRow = cute.zipped_divide(gTile[token0 + token, None], (CHUNK,))
            cute.autovec_copy(values, gRow[None, channel0 // CHUNK])

    def read_word(self, sCodes: cute.Tensor, word0, shift0, offset: int):
        """Word ``offset`` (a constant) past the thread's own word, shifted right by the thread's shift."""
        plan = self.plan
        word = cutlass.Uint32(sCodes[plan.word_index(word0, offset)])
        return word >> cutlass.Uint32(shift0) if cutlass.const_expr(plan.dynamic_shift) else word


def _load_group(src: cute.Tensor, cfg: DequantizeConfig):
    """(scale, offset) in FP32 of a group's (param_fields) fp16 tensor: one load; the stored offset, or
    ``offset_per_scale * scale`` (a trace-time constant)."""
    raw = cute.make_rmem_tensor((cfg.param_fields,), cutlass.Float16)
    cute.autovec_copy(src, raw)
    if cfg.offset_per_scale is None:
        return raw[0].to(cutlass.Float32), raw[1].to(cutlass.Float32)
    scale = raw[0].to(cutlass.Float32)
    return scale, scale * cutlass.Float32(float(cfg.offset_per_scale))


def _thread_part(strides, tidx):
    """sum over the bits k of the thread index of bit_k * strides[k]: runs of bits whose strides double
    are one field (``(tidx >> k) & mask`` times a stride). Python ints or a DSL Int32 (the CPU tests
    run it on ints)."""
    part, k = 0, 0
    while k < len(strides):
        run = 1
        while k + run < len(strides) and strides[k + run] == strides[k] << run:
            run += 1
        if strides[k]:
            field = (tidx >> k) & ((1 << run) - 1) if k else tidx & ((1 << run) - 1)
            part = part + field * strides[k]
        k += run
    return part


def _swizzled(word, swizzle):
    """``TilePlan.swizzled`` of a DSL Int32 (or an int)."""
    for high, low in swizzle:
        word = word ^ ((word >> (high - low)) & (1 << low))
    return word


def compile_dequantize(scheme_or_config, role: str | None = None, arch: str = "sm_90a", layout: str | None = None):
    """Compile (no GPU needed) for ``arch`` with PTX and cubin kept; see ``foscar.inspect``. ``layout``: the packed
    bit order (default: a config's own, else "hopper")."""
    from ..inspect import compile_for

    cfg = DequantizeConfig.of(scheme_or_config, role, layout=layout or "hopper")
    if layout is not None and cfg.layout != layout:
        raise ValueError(f"layout={layout!r} contradicts the config's layout={cfg.layout!r}")
    i32 = cutlass.Int32(1)
    return compile_for(
        arch,
        Dequantize(cfg),
        fake_ptr(cutlass.Int32),
        fake_ptr(cutlass.Float16),
        fake_ptr(cutlass.Int32),
        fake_ptr(cfg.out_type),
        i32, i32, i32, i32, i32,
        cuda.CUstream(0),
    )


def dequantize_pages(codes, params, page_table, scheme, role: str, dtype=None, layout: str | None = None, out=None):
    """Dense ``dtype`` (BF16 by default, or FP16; a passed DequantizeConfig's own) [batch, kv_heads,
    max_pages*page_size, D] of a paged packed cache (CUDA tensors) in ``layout``'s bit order: "hopper"
    (the default) or "blackwell", the cache arch's ``Arch.layout`` (a passed DequantizeConfig's own).

    ``out``: where to write it (a contiguous CUDA tensor of that shape and dtype), else a new tensor.
    No host sync, so a call can be captured in a CUDA graph. Runs on the current torch stream.
    (:class:`PagesDequantizer` keeps the checks of ``codes`` and ``params`` for many calls.)
    """
    return PagesDequantizer(codes, params, scheme, role, dtype, layout)(page_table, out)


def _described(x) -> str:
    """A bad argument in an error message: a tensor's shape, else its type."""
    return str(tuple(x.shape)) if hasattr(x, "shape") else type(x).__name__


class PagesDequantizer:
    """:func:`dequantize_pages` of one pool of ``codes`` and ``params`` (a cache's layer and role), with their
    checks, the config, the compiled kernel and their pointers resolved once: a call checks and takes only the page
    table (and ``out``). ``PagedKVCache.attend_chunk`` dequantizes a prefix block by block, and the host work of a
    whole ``dequantize_pages`` call (~125 us, most of it checks and lookups) bounds a chunk's first block
    (benchmarks/NOTES.md sections 27, 42)."""

    def __init__(self, codes, params, scheme, role: str, dtype=None, layout: str | None = None):
        import torch

        names = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
        if dtype is not None and dtype not in names:
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        if layout is not None and layout not in POSITIONS:
            raise ValueError(f"layout must be one of {sorted(POSITIONS)} (an arch's packed bit order, Arch.layout), "
                             f"got {layout!r}")
        if isinstance(scheme, DequantizeConfig):
            if dtype is not None and names[dtype] != scheme.dtype:
                raise ValueError(f"dtype={dtype} contradicts the config's dtype={scheme.dtype!r}")
            if layout is not None and layout != scheme.layout:
                raise ValueError(f"layout={layout!r} contradicts the config's layout={scheme.layout!r}")
        cfg = self.cfg = DequantizeConfig.of(scheme, role, names[dtype or torch.bfloat16], layout or "hopper")
        self.dtype, G = getattr(torch, cfg.dtype), cfg.group
        if not isinstance(codes, torch.Tensor) or codes.dim() != 4:
            raise ValueError(f"codes: need a [num_pages, kv_heads, tiles per page, {cfg.tile_words}] int32 tensor, got "
                             f"{_described(codes)}")
        self.num_pages, self.kv_heads, tiles_per_page, _ = codes.shape
        self.page_size = tiles_per_page * TILE_TOKENS
        if cfg.axis is Axis.CHANNEL and self.page_size % G:
            raise ValueError(f"page_size {self.page_size} must be a multiple of the channel-wise group {G}")
        self._check("codes", codes, torch.int32, (self.num_pages, self.kv_heads, tiles_per_page, cfg.tile_words),
                    codes.device)
        self._check("params", params, torch.float16, (self.num_pages, self.kv_heads,
                                                      *params_shape(cfg.axis, G, self.page_size, cfg.head_dim),
                                                      cfg.param_fields), codes.device)
        for name, t in (("codes", codes), ("params", params)):
            if t.numel() >= INDEX_LIMIT:
                raise ValueError(f"{name}: {t.numel()} elements; the dequantize kernel indexes a pool in 32-bit ints, "
                                 f"so it holds fewer than 2^31")
        self.device = codes.device
        self._codes, self._params = codes, params
        self._compiled = None  # compiled at the first call, after its checks

    @staticmethod
    def _check(name, t, want, want_shape, device):
        if (t.dtype != want or tuple(t.shape) != want_shape or not t.is_cuda or not t.is_contiguous()
                or t.device != device):
            raise ValueError(f"{name}: need a contiguous CUDA {want} tensor of shape {want_shape} on codes' device, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")

    def __call__(self, page_table, out=None):
        """The pages of ``page_table [batch, max_pages]`` (int32) as :func:`dequantize_pages` returns them."""
        import torch

        if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2:
            raise ValueError(f"page_table: need a [batch, max_pages] int32 tensor, got {_described(page_table)}")
        batch, max_pages = page_table.shape
        shape = (batch, self.kv_heads, max_pages * self.page_size, self.cfg.head_dim)
        self._check("page_table", page_table, torch.int32, (batch, max_pages), self.device)
        if math.prod(shape) >= INDEX_LIMIT:
            raise ValueError(f"page_table: {batch} x {max_pages} pages dequantize to {math.prod(shape)} elements; the "
                             "kernel writes them with 32-bit offsets, so fewer than 2^31 (fewer pages a call)")
        if out is not None:
            self._check("out", out, self.dtype, shape, self.device)
        else:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
        if out.numel() == 0:
            return out
        if self._compiled is None:
            cfg, arch = self.cfg, device_arch(self.device)
            self._compiled = cached_compile(("dequantize", cfg, arch), lambda: compile_dequantize(cfg, arch=arch))
        launch(self._compiled, (self._codes, cutlass.Int32), (self._params, cutlass.Float16),
               (page_table, cutlass.Int32), (out, self.cfg.out_type), self.num_pages, self.kv_heads, self.page_size,
               batch, max_pages)
        return out
