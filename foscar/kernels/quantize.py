"""Quantize BF16/FP16 token tiles into the packed paged cache (CuTe DSL, sm_90a and sm_100a).

Why this kernel exists: the paged cache manager (``foscar.cache``) keeps the newest tokens in
BF16 and moves them into the packed cache a whole *granule* at a time (a granule is
``max(64, channel-wise group sizes)`` tokens, so every group and every packed 64-token tile it
touches is complete). That move must run on the GPU, inside a CUDA graph, and must give exactly
the cache that ``foscar.quantize.quantize_groups`` + the arch's packer (``foscar.layouts.PACKERS``) give, so the
decode kernels and references see one format whichever path wrote it. It is bit-identical by
construction: it runs the format's :class:`foscar.formats.AppendRule` step by step, the float32 steps of the host
quantizer (``foscar.formats.append_mismatch`` holds the rule against it before compiling):

* ``lo``/``hi``: exact FP32 min/max of the group (``"minmax"``; BF16/FP16 -> FP32 is exact), or 0 and the max of
  ``|x|`` (``"absmax"``);
* ``offset = fp16(lo)`` (where the format stores one), ``scale = fp16((hi - lo) / steps)``: an FP32 subtraction
  and an IEEE-rounded FP32 division (``div.rn.f32``, not the approximate one), then ``cvt.rn.f16.f32``;
* ``code = clamp(roundeven((x - offset) / scale) + shift, 0, 2^bits - 1)`` with the *stored* fp16 values
  widened to FP32 (no subtraction for a scale-only format), the same ``div.rn.f32`` and round-half-even; a
  group with ``scale == 0`` has codes 0.

Min-max INT2/INT4 (``MinMaxFormat``): ``"minmax"``, ``steps = 2^bits - 1``, ``shift = 0``; symmetric INT4:
``"absmax"``, ``steps = 7``, ``shift = 8``, the scale only.

Work split: one CTA (128 threads) per (granule, KV head). Phase 1: one thread per group computes
its params, writes them to the params page and keeps their FP32 values in shared memory.
Phase 2: one thread per packed 32-bit word gathers the word's codes through the inverse of the
tile layout (:func:`word_code_coords` for Hopper's order, :func:`bw_word_code_coords` for
Blackwell's), quantizes them and writes the word once: no read-modify-write, and a warp's stores are contiguous. Reads of the BF16 tile are gathers, but the
tile (16-64 KB) is L1/L2-resident after phase 1; the cache quantizes one granule per sequence
every ``granule`` decode steps, so this kernel is far off the decode critical path.

Formats::

    src         bf16/fp16 [tiles, kv_heads, granule, D]        contiguous
    dest_page   int32     [tiles]   page of each granule; < 0: skip this granule (no writes)
    dest_slot   int32     [tiles]   first token slot of the granule in its page (multiple of granule)
    codes       int32     [num_pages, kv_heads, page_size // 64, tile_words]
    params      float16   [num_pages, kv_heads, page_size, D // G, F]      token-wise groups
                float16   [num_pages, kv_heads, page_size // G, D, F]      channel-wise groups
                          F = param_fields: (scale, offset), or the scale of a scale-only format

A granule whose elements exceed the float16 range gets infinite params (the torch quantizer raises;
a kernel cannot, without a host sync): keep K/V finite and within float16 range.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from ..checks import INDEX_LIMIT
from ..jit import cached_compile, device_arch, fake_ptr, launch
from ..layouts.fragment import THREADS as TILE_THREADS
from ..layouts.fragment import TILE_TOKENS, TileGeometry
from ..formats import AppendRule, affine_mismatch, append_mismatch
from ..scheme import Axis, Scheme, params_shape

__all__ = ["QuantizeConfig", "Quantize", "word_code_coords", "bw_word_code_coords", "WORD_CODE_COORDS",
           "compile_quantize", "quantize_tiles", "granule_of"]

THREADS = 128
SRC_INDEX_LIMIT = INDEX_LIMIT  # elements of src one launch indexes (quantize_tiles launches per run)
SRC_DTYPES = ("bfloat16", "float16")


def granule_of(scheme: Scheme) -> int:
    """Tokens quantized together: 64 (one packed tile), or a channel-wise group if longer."""
    groups = [q.group for q in (scheme.k, scheme.v) if q.axis is Axis.CHANNEL]
    return max([TILE_TOKENS, *groups])


def word_code_coords(geom: TileGeometry, word, e: int, k: int):
    """(token, channel) of the code in slot (``e``, ``k``) of packed ``word`` of a 64-token tile.

    The inverse of ``foscar.layouts.fragment.tile_position``: that code sits at bit
    ``bits * (e * regs_per_word + k)`` of the word. ``word`` may be a Python int or a DSL Int32
    (only ``+ * // %`` by constants are used), so the kernel and the CPU test run this one function.
    """
    ppw, cw = geom.regs_per_word, geom.vector_words
    wi = word % cw
    thread = (word // cw) % TILE_THREADS
    j = word // (cw * TILE_THREADS)
    # fragment register n = (j*cw + wi)*ppw + k = 4*kbm + reg
    if ppw % 4 == 0:  # 2- and 4-bit codes: n % 4 == k % 4
        kbm = (j * cw + wi) * (ppw // 4) + k // 4
        reg = k % 4
    else:  # 8-bit codes: a word holds registers n, n + 1 (ppw = 2)
        n = (j * cw + wi) * ppw + k
        kbm, reg = n // 4, n % 4
    h_r, h_c = reg % 2, reg // 2
    kb, mt = kbm % geom.k_blocks, kbm // geom.k_blocks
    warp, g, tq = thread // 32, (thread % 32) // 4, thread % 4
    row = mt * 64 + 16 * warp + 8 * h_r + g
    col = 16 * kb + 8 * h_c + 2 * tq + e
    return (row, col) if geom.role == "k" else (col, row)


def bw_word_code_coords(geom: TileGeometry, word, e: int, k: int):
    """(token, channel) of the code in slot ``e * regs_per_word + k`` of packed ``word`` in the
    Blackwell order: the inverse of ``foscar.layouts.blackwell.bw_tile_position`` (a word is a run of
    ``E = 32/bits`` consecutive reduction-axis elements of one MMA row; element ``i`` sits in slot
    ``2*(i % (E/2)) + i // (E/2)``). Python ints or DSL Int32, as :func:`word_code_coords`."""
    half = geom.regs_per_word  # E / 2
    chunks_per_row = geom.cols // (2 * half)
    slot = e * half + k
    element = (slot % 2) * half + slot // 2
    row = word // chunks_per_row
    col = (word % chunks_per_row) * (2 * half) + element
    return (row, col) if geom.role == "k" else (col, row)


# the bit order the kernel writes, per packed layout (foscar.layouts.PACKERS): the inverse of its position
WORD_CODE_COORDS = {"hopper": word_code_coords, "blackwell": bw_word_code_coords}


@dataclass(frozen=True)
class QuantizeConfig:
    """Everything the compiled kernel depends on (the compile-cache key)."""

    bits: int
    head_dim: int
    role: str  # 'k' or 'v': which packed tile layout
    axis: Axis
    group: int
    granule: int  # tokens per CTA: a multiple of 64 and of a channel-wise group
    src_dtype: str = "bfloat16"
    layout: str = "hopper"  # the packed bit order written (an arch's layout, WORD_CODE_COORDS)
    rule: AppendRule | None = None  # the format's (Format.append_rule); None: min-max of ``bits``
    param_fields: int = 2  # fp16 params written per group: (scale, offset), or the scale

    def __post_init__(self):
        object.__setattr__(self, "axis", Axis(self.axis))
        if self.rule is None:
            object.__setattr__(self, "rule", AppendRule("minmax", (1 << self.bits) - 1))
        if not isinstance(self.rule, AppendRule):
            raise ValueError(f"rule must be a foscar.formats.AppendRule, got {self.rule!r}")
        if self.param_fields not in (1, 2):
            raise ValueError(f"param_fields must be 1 or 2, got {self.param_fields!r}")
        TileGeometry(self.role, self.bits, self.head_dim)  # validates role, bits, head_dim
        if self.axis is Axis.TOKEN and self.head_dim % self.group:
            raise ValueError(f"token-wise group {self.group} must divide head_dim {self.head_dim}")
        if self.granule % TILE_TOKENS or (self.axis is Axis.CHANNEL and self.granule % self.group):
            raise ValueError(f"granule {self.granule} must be a multiple of 64 and of a channel-wise group ({self.group})")
        if self.src_dtype not in SRC_DTYPES:
            raise ValueError(f"src_dtype must be one of {SRC_DTYPES}, got {self.src_dtype!r}")
        if self.layout not in WORD_CODE_COORDS:
            raise ValueError(f"layout must be one of {sorted(WORD_CODE_COORDS)}, got {self.layout!r}")

    @classmethod
    def of(cls, scheme: Scheme, role: str, layout: str = "hopper") -> "QuantizeConfig":
        """The config of one tensor of ``scheme``: its own bits, axis and group (K and V may differ);
        the granule is the scheme's, shared by both tensors; ``layout`` the arch's packed bit order."""
        if not isinstance(scheme, Scheme) or role not in ("k", "v"):
            raise TypeError("pass a Scheme and role='k' or 'v'")
        quant = scheme.k if role == "k" else scheme.v
        mismatch = affine_mismatch(quant.format) or append_mismatch(quant.format)
        if mismatch:
            raise ValueError(f"Scheme.{role}.format: {mismatch}")
        return cls(quant.bits, scheme.head_dim, role, quant.axis, quant.group, granule_of(scheme), scheme.q_dtype_name,
                   layout, quant.format.append_rule, quant.param_fields)

    @property
    def geometry(self) -> TileGeometry:
        return TileGeometry(self.role, self.bits, self.head_dim)

    @property
    def groups(self) -> int:
        """Groups per granule."""
        rows, pairs = params_shape(self.axis, self.group, self.granule, self.head_dim)
        return rows * pairs

    @property
    def cute_src(self):
        return cutlass.BFloat16 if self.src_dtype == "bfloat16" else cutlass.Float16


class Quantize:
    """One CTA (128 threads) per (granule, KV head); see the module docstring for the two phases."""

    def __init__(self, config: QuantizeConfig):
        self.cfg = config
        geom = config.geometry
        self.words = geom.words
        self.word_steps = self.words // THREADS
        self.group_steps = -(-config.groups // THREADS)
        self.tiles = config.granule // TILE_TOKENS
        self.levels = (1 << config.bits) - 1
        self.ppw = geom.regs_per_word

    @cute.jit
    def __call__(
        self,
        src: cute.Pointer,
        dest_page: cute.Pointer,
        dest_slot: cute.Pointer,
        codes: cute.Pointer,
        params: cute.Pointer,
        tiles: cutlass.Int32,
        kv_heads: cutlass.Int32,
        num_pages: cutlass.Int32,
        page_size: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        D, G, T = cfg.head_dim, cfg.group, cfg.granule
        # (tiles, kv_heads, granule, D)
        mSrc = cute.make_tensor(src, cute.make_ordered_layout((tiles, kv_heads, T, D), (3, 2, 1, 0)))
        # (tiles,)
        mPage = cute.make_tensor(dest_page, cute.make_layout(tiles))
        mSlot = cute.make_tensor(dest_slot, cute.make_layout(tiles))
        # (num_pages, kv_heads, page_size // 64, tile_words)
        mCodes = cute.make_tensor(
            codes, cute.make_ordered_layout((num_pages, kv_heads, page_size // TILE_TOKENS, self.words), (3, 2, 1, 0))
        )
        # (num_pages, kv_heads, page_size, D // G, F) token-wise; (num_pages, kv_heads, page_size // G, D, F)
        # channel-wise; F = param_fields
        shape = (num_pages, kv_heads, *params_shape(cfg.axis, G, page_size, D), cfg.param_fields)
        mParams = cute.make_tensor(params, cute.make_ordered_layout(shape, (4, 3, 2, 1, 0)))
        self.kernel(mSrc, mPage, mSlot, mCodes, mParams).launch(grid=[tiles, kv_heads, 1], block=[THREADS, 1, 1],
                                                                  stream=stream)

    @cute.kernel
    def kernel(self, mSrc: cute.Tensor, mPage: cute.Tensor, mSlot: cute.Tensor, mCodes: cute.Tensor,
               mParams: cute.Tensor):
        cfg = self.cfg
        D, G = cfg.head_dim, cfg.group
        rule, pairs = cfg.rule, cfg.param_fields == 2
        absmax = rule.range == "absmax"
        tidx, _, _ = cute.arch.thread_idx()
        tile, head, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sScale = smem.allocate_tensor(cutlass.Float32, cute.make_layout(cfg.groups), byte_alignment=16)
        if cutlass.const_expr(pairs):
            sOffset = smem.allocate_tensor(cutlass.Float32, cute.make_layout(cfg.groups), byte_alignment=16)
        page = mPage[tile]
        if page >= 0:  # uniform per CTA: a skipped granule writes nothing
            slot = mSlot[tile]
            levels = cutlass.Float32(self.levels)
            steps = cutlass.Float32(rule.steps)

            # ---- phase 1: the params of every group ----------------------------------------------
            for step in cutlass.range_constexpr(self.group_steps):
                grp = step * THREADS + tidx
                if grp < cfg.groups:
                    if cutlass.const_expr(cfg.axis is Axis.TOKEN):
                        token, c0 = grp // (D // G), (grp % (D // G)) * G
                        lo = mSrc[tile, head, token, c0].to(cutlass.Float32)
                        hi = lo
                        if cutlass.const_expr(absmax):
                            hi = cute.math.absf(lo)
                        for i in cutlass.range(1, G, unroll=8):
                            x = mSrc[tile, head, token, c0 + i].to(cutlass.Float32)
                            if cutlass.const_expr(absmax):
                                hi = cute.arch.fmax(hi, cute.math.absf(x))
                            else:
                                lo = cute.arch.fmin(lo, x)
                                hi = cute.arch.fmax(hi, x)
                    else:
                        t0, channel = (grp // D) * G, grp % D
                        lo = mSrc[tile, head, t0, channel].to(cutlass.Float32)
                        hi = lo
                        if cutlass.const_expr(absmax):
                            hi = cute.math.absf(lo)
                        for i in cutlass.range(1, G, unroll=8):
                            x = mSrc[tile, head, t0 + i, channel].to(cutlass.Float32)
                            if cutlass.const_expr(absmax):
                                hi = cute.arch.fmax(hi, cute.math.absf(x))
                            else:
                                lo = cute.arch.fmin(lo, x)
                                hi = cute.arch.fmax(hi, x)
                    if cutlass.const_expr(absmax):
                        lo = cutlass.Float32(0.0)  # the rule's range is [0, max |x|]
                    offset = lo.to(cutlass.Float16)
                    scale = cute.math.div(hi - lo, steps, rounding=cute.math.RoundingMode.NEAREST_EVEN).to(
                        cutlass.Float16
                    )
                    if cutlass.const_expr(cfg.axis is Axis.TOKEN):
                        mParams[page, head, slot + token, c0 // G, 0] = scale
                        if cutlass.const_expr(pairs):
                            mParams[page, head, slot + token, c0 // G, 1] = offset
                    else:
                        mParams[page, head, slot // G + t0 // G, channel, 0] = scale
                        if cutlass.const_expr(pairs):
                            mParams[page, head, slot // G + t0 // G, channel, 1] = offset
                    sScale[grp] = scale.to(cutlass.Float32)
                    if cutlass.const_expr(pairs):
                        sOffset[grp] = offset.to(cutlass.Float32)
            cute.arch.sync_threads()

            # ---- phase 2: one packed word per thread and step -----------------------------------
            geom = cfg.geometry
            for t in cutlass.range_constexpr(self.tiles):
                for step in cutlass.range_constexpr(self.word_steps):
                    word = step * THREADS + tidx
                    packed = cutlass.Int32(0)
                    for e in cutlass.range_constexpr(2):
                        for k in cutlass.range_constexpr(self.ppw):
                            token, channel = WORD_CODE_COORDS[cfg.layout](geom, word, e, k)
                            token = token + t * TILE_TOKENS
                            if cutlass.const_expr(cfg.axis is Axis.TOKEN):
                                grp = token * (D // G) + channel // G
                            else:
                                grp = (token // G) * D + channel
                            s = sScale[grp]
                            if cutlass.const_expr(pairs):
                                z = sOffset[grp]
                            x = mSrc[tile, head, token, channel].to(cutlass.Float32)
                            code = cutlass.Int32(0)  # a constant group (scale 0) has codes 0
                            if s != cutlass.Float32(0.0):
                                if cutlass.const_expr(pairs):
                                    y = cute.math.div(x - z, s, rounding=cute.math.RoundingMode.NEAREST_EVEN)
                                else:
                                    y = cute.math.div(x, s, rounding=cute.math.RoundingMode.NEAREST_EVEN)
                                y = cute.math.roundeven(y)
                                if cutlass.const_expr(rule.shift != 0):
                                    y = y + cutlass.Float32(rule.shift)
                                y = cute.arch.fmin(cute.arch.fmax(y, cutlass.Float32(0.0)), levels)
                                code = y.to(cutlass.Int32)
                            packed = packed | (code << (cfg.bits * (e * self.ppw + k)))
                    mCodes[page, head, slot // TILE_TOKENS + t, word] = packed


def compile_quantize(config: QuantizeConfig, arch: str = "sm_90a"):
    """Compile (no GPU needed) for ``arch`` with PTX and cubin kept; see ``foscar.inspect``."""
    from ..inspect import compile_for

    i32 = cutlass.Int32(1)
    return compile_for(
        arch,
        Quantize(config),
        fake_ptr(config.cute_src),
        fake_ptr(cutlass.Int32),
        fake_ptr(cutlass.Int32),
        fake_ptr(cutlass.Int32),
        fake_ptr(cutlass.Float16),
        i32, i32, i32, i32,
        cuda.CUstream(0),
    )


def quantize_tiles(src, dest_page, dest_slot, codes, params, scheme: Scheme, role: str, layout: str = "hopper"):
    """Quantize ``src [tiles, kv_heads, granule, D]`` (CUDA) into pages ``dest_page`` at ``dest_slot``.

    ``layout``: the packed bit order of the arch that decodes the pages (``Arch.layout``).
    No allocation, no host sync: safe inside CUDA-graph capture. Runs on the current torch stream.
    Shapes are checked here (host metadata only); ``foscar.cache`` is the usual caller.
    """
    import torch

    cfg = QuantizeConfig.of(scheme, role, layout)
    tiles, kv_heads, granule, dim = src.shape
    num_pages, _, tiles_per_page, words = codes.shape
    page_size = tiles_per_page * TILE_TOKENS
    expected = [
        ("src", src, scheme.q_dtype, (tiles, kv_heads, cfg.granule, cfg.head_dim)),
        ("dest_page", dest_page, torch.int32, (tiles,)),
        ("dest_slot", dest_slot, torch.int32, (tiles,)),
        ("codes", codes, torch.int32, (num_pages, kv_heads, tiles_per_page, cfg.geometry.words)),
        ("params", params, torch.float16, (num_pages, kv_heads, *params_shape(cfg.axis, cfg.group, page_size, dim),
                                           cfg.param_fields)),
    ]
    for name, t, dtype, shape in expected:
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_cuda or not t.is_contiguous():
            raise ValueError(f"{name}: need a contiguous CUDA {dtype} tensor of shape {shape}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if page_size % cfg.granule:
        raise ValueError(f"page_size {page_size} must be a multiple of the granule {cfg.granule}")
    for name, t in (("codes", codes), ("params", params)):
        if t.numel() >= INDEX_LIMIT:
            raise ValueError(f"{name}: the quantize kernel indexes a pool in 32-bit ints, so it holds fewer than 2^31 "
                             f"elements; got {tuple(t.shape)} (fewer pages per layer)")
    if tiles == 0:
        return
    arch = device_arch(src.device)
    compiled = cached_compile(("quantize", cfg, arch), lambda: compile_quantize(cfg, arch=arch))


    # the kernel indexes src in 32-bit ints: a bulk append of many long sequences (36 x 100K tokens of 8 KV heads:
    # 3.7e9 elements) launches per run of whole tiles below 2^31 elements
    step = SRC_INDEX_LIMIT // (kv_heads * granule * dim) // 4 * 4  # (4 int32 pages: 16-byte aligned slices)
    if step < 1:
        raise ValueError(f"src: a tile of {kv_heads} KV heads x {granule} x {dim} is past the kernel's 32-bit index")
    for first in range(0, tiles, step):
        last = min(tiles, first + step)
        launch(compiled, (src[first:last], cfg.cute_src), (dest_page[first:last], cutlass.Int32),
               (dest_slot[first:last], cutlass.Int32), (codes, cutlass.Int32), (params, cutlass.Float16), last - first,
               kv_heads, num_pages, page_size)
