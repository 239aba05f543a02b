"""Dequantize a paged, packed KV cache into a dense BF16 (or FP16) tensor (CuTe DSL, sm_90a and sm_100a).

Why this kernel exists: it is the simplest kernel that reads the packed format exactly as the
attention kernels will -- one 64-token tile at a time, through the tile's code-position layout
(``foscar.layouts.cute.bit_layout``) -- so a GPU test can compare it bit for bit against the torch
dequantizer, and the BF16 output feeds the dequantize-then-attend baseline and the blocks of
``foscar.chunk_attention`` (in the query's dtype there). Correctness first:
one CTA per tile, a plain SIMT gather; no Tensor Cores.

Formats (one KV head dimension ``D``, ``bits`` per code, group ``G``)::

    codes       int32   [num_pages, kv_heads, page_size // 64, tile_words]   tile_words = 64*D*bits/32
    params      float16 [num_pages, kv_heads, page_size, D // G, 2]          token-wise groups
                float16 [num_pages, kv_heads, page_size // G, D, 2]          channel-wise groups
                        last mode (scale, offset): x = scale * code + offset
    page_table  int32   [batch, max_pages]
    out         bf16    [batch, kv_heads, max_pages * page_size, D]                 (or fp16: ``dtype``)

Token ``i`` of sequence ``b`` lives in page ``page_table[b, i // page_size]``, slot
``i % page_size``. Every page-table entry is read, so unused entries must hold a valid page index.

The host side takes raw pointers and Int32 extents, not tensors: one compiled function then serves
every shape, the fake-pointer compile on a CPU machine produces exactly the kernel a GPU runs, and
no TVM-FFI is needed to call it from torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from ..jit import cached_compile, current_stream, device_arch, fake_ptr, gmem_ptr
from ..layouts.cute import bit_layout
from ..layouts.fragment import TILE_TOKENS, TileGeometry, tile_position
from ..scheme import Axis, Scheme, params_shape

__all__ = ["DequantizeConfig", "Dequantize", "compile_dequantize", "dequantize_pages"]

THREADS = 128
CHUNK = 8  # channels per thread per store: 8 bf16 = one 16-byte store
OUT_TYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


@dataclass(frozen=True)
class DequantizeConfig:
    """Everything the compiled kernel depends on (the compile-cache key)."""

    bits: int
    head_dim: int
    role: str  # 'k' or 'v': which packed tile layout
    axis: Axis  # group axis of this role's (scale, offset)
    group: int
    dtype: str = "bfloat16"  # the output's: "bfloat16" or "float16"

    def __post_init__(self):
        object.__setattr__(self, "axis", Axis(self.axis))
        TileGeometry(self.role, self.bits, self.head_dim)  # validates role, bits, head_dim
        if self.axis is Axis.TOKEN and self.head_dim % self.group:
            raise ValueError(f"token-wise group {self.group} must divide head_dim {self.head_dim}")
        if self.group % CHUNK:
            raise ValueError(f"group {self.group} must be a multiple of {CHUNK}")
        if self.dtype not in OUT_TYPES:
            raise ValueError(f"dtype must be one of {sorted(OUT_TYPES)}, got {self.dtype!r}")

    @classmethod
    def of(cls, scheme_or_config, role: str | None = None, dtype: str = "bfloat16") -> "DequantizeConfig":
        if isinstance(scheme_or_config, cls):
            return scheme_or_config
        if not isinstance(scheme_or_config, Scheme) or role not in ("k", "v"):
            raise TypeError("pass a DequantizeConfig, or a Scheme and role='k' or 'v'")
        quant = scheme_or_config.k if role == "k" else scheme_or_config.v
        return cls(quant.bits, scheme_or_config.head_dim, role, quant.axis, quant.group, dtype)

    @property
    def out_type(self):
        return OUT_TYPES[self.dtype]

    @property
    def geometry(self) -> TileGeometry:
        return TileGeometry(self.role, self.bits, self.head_dim)

    @property
    def tile_words(self) -> int:
        return self.geometry.words


class Dequantize:
    """One CTA (128 threads) per (64-token tile, kv head, sequence).

    1. Stage the tile's packed words in shared memory with vector loads (coalesced).
    2. Each thread produces 8 consecutive channels of one token per step: gathers the 8 codes by
       the tile's bit layout (word ``b >> 5``, shift ``b & 31``), applies ``scale*code + offset``
       in FP32, and writes one 16-byte BF16 vector (a warp writes whole rows: coalesced).
    """

    def __init__(self, config: DequantizeConfig):
        self.cfg = config
        geom = config.geometry
        self.words = geom.words
        self.vec = min(4, self.words // THREADS)  # words per staging load (16 bytes when possible)
        self.stage_steps = self.words // (self.vec * THREADS)
        self.chunks_per_row = config.head_dim // CHUNK
        self.out_steps = TILE_TOKENS * self.chunks_per_row // THREADS
        # The 8 channels of a chunk start at a multiple of 8; the layout's channel digits below 8
        # never carry into higher ones, so their bit offsets are trace-time constants added to the
        # chunk's base offset. Checked here against the explicit formula.
        self.chunk_bits = [tile_position(geom, 0, e) * config.bits for e in range(CHUNK)]
        for c0 in range(0, config.head_dim, CHUNK):
            base = tile_position(geom, 0, c0)
            for e in range(CHUNK):
                assert tile_position(geom, 0, c0 + e) * config.bits == base * config.bits + self.chunk_bits[e]

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
        # (num_pages, kv_heads, page_size, D // G, 2) token-wise; (num_pages, kv_heads, page_size // G, D, 2) channel-wise
        shape = (num_pages, kv_heads, *params_shape(cfg.axis, G, page_size, D), 2)
        mParams = cute.make_tensor(params, cute.make_ordered_layout(shape, row_major5))
        # (batch, max_pages)
        mPages = cute.make_tensor(page_table, cute.make_ordered_layout((batch, max_pages), (1, 0)))
        # (batch, kv_heads, max_pages * page_size, D)
        mOut = cute.make_tensor(
            out, cute.make_ordered_layout((batch, kv_heads, max_pages * page_size, D), row_major4)
        )
        self.kernel(mCodes, mParams, mPages, mOut, tiles_per_page).launch(
            grid=[max_pages * tiles_per_page, kv_heads, batch], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mCodes: cute.Tensor,
        mParams: cute.Tensor,
        mPages: cute.Tensor,
        mOut: cute.Tensor,
        tiles_per_page: cutlass.Int32,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        tile, head, seq = cute.arch.block_idx()
        page = mPages[seq, tile // tiles_per_page]
        tile_in_page = tile % tiles_per_page

        # ---- stage the packed tile in shared memory -------------------------------------------
        smem = cutlass.memory.SmemAllocator()
        sCodes = smem.allocate_tensor(cutlass.Int32, cute.make_layout(self.words), byte_alignment=16)
        # ((vec), (words / vec))
        gWordsV = cute.zipped_divide(mCodes[page, head, tile_in_page, None], (self.vec,))
        sWordsV = cute.zipped_divide(sCodes, (self.vec,))
        staged = cute.make_rmem_tensor((self.vec,), cutlass.Int32)
        for step in cutlass.range_constexpr(self.stage_steps):
            col = step * THREADS + tidx
            cute.autovec_copy(gWordsV[None, col], staged)
            cute.autovec_copy(staged, sWordsV[None, col])
        cute.arch.sync_threads()

        # ---- gather codes by the tile's bit layout, dequantize, store 8 channels --------------
        bits_of = bit_layout(cfg.geometry)  # (token, channel) -> bit position in the tile
        mask = (1 << cfg.bits) - 1
        values = cute.make_rmem_tensor((CHUNK,), cfg.out_type)
        for step in cutlass.range_constexpr(self.out_steps):
            n = step * THREADS + tidx
            token = n // self.chunks_per_row
            c0 = (n % self.chunks_per_row) * CHUNK
            slot = tile_in_page * TILE_TOKENS + token
            base = cute.crd2idx((token, c0), bits_of)
            if cutlass.const_expr(cfg.axis is Axis.TOKEN):
                group = c0 // cfg.group  # a chunk never straddles a group (G % 8 == 0)
                scale = mParams[page, head, slot, group, 0].to(cutlass.Float32)
                offset = mParams[page, head, slot, group, 1].to(cutlass.Float32)
            for e in cutlass.range_constexpr(CHUNK):
                bit = base + self.chunk_bits[e]
                code = (sCodes[bit >> 5] >> (bit & 31)) & mask
                if cutlass.const_expr(cfg.axis is Axis.CHANNEL):
                    scale = mParams[page, head, slot // cfg.group, c0 + e, 0].to(cutlass.Float32)
                    offset = mParams[page, head, slot // cfg.group, c0 + e, 1].to(cutlass.Float32)
                values[e] = (scale * code.to(cutlass.Float32) + offset).to(cfg.out_type)
            # ((CHUNK), (D / CHUNK))
            gRow = cute.zipped_divide(mOut[seq, head, tile * TILE_TOKENS + token, None], (CHUNK,))
            cute.autovec_copy(values, gRow[None, n % self.chunks_per_row])


def compile_dequantize(scheme_or_config, role: str | None = None, arch: str = "sm_90a"):
    """Compile (no GPU needed) for ``arch`` with PTX and cubin kept; see ``foscar.inspect``."""
    from ..inspect import compile_for

    cfg = DequantizeConfig.of(scheme_or_config, role)
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


def dequantize_pages(codes, params, page_table, scheme, role: str, dtype=None):
    """Dense ``dtype`` (BF16 by default, or FP16; a passed DequantizeConfig's own) [batch, kv_heads,
    max_pages*page_size, D] of a paged packed cache in the Hopper bit order (CUDA tensors).

    Runs on the current torch stream.
    """
    import torch

    names = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype is not None and dtype not in names:
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    if isinstance(scheme, DequantizeConfig) and dtype is not None and names[dtype] != scheme.dtype:
        raise ValueError(f"dtype={dtype} contradicts the config's dtype={scheme.dtype!r}")
    cfg = DequantizeConfig.of(scheme, role, names[dtype or torch.bfloat16])
    dtype = getattr(torch, cfg.dtype)
    D, G = cfg.head_dim, cfg.group
    num_pages, kv_heads, tiles_per_page, words = codes.shape
    page_size = tiles_per_page * TILE_TOKENS
    batch, max_pages = page_table.shape
    if cfg.axis is Axis.CHANNEL and page_size % G:
        raise ValueError(f"page_size {page_size} must be a multiple of the channel-wise group {G}")
    expected = [
        ("codes", codes, torch.int32, (num_pages, kv_heads, tiles_per_page, cfg.tile_words)),
        ("params", params, torch.float16, (num_pages, kv_heads, *params_shape(cfg.axis, G, page_size, D), 2)),
        ("page_table", page_table, torch.int32, (batch, max_pages)),
    ]
    for name, t, want, shape in expected:
        if t.dtype != want or tuple(t.shape) != shape or not t.is_cuda or not t.is_contiguous():
            raise ValueError(f"{name}: need a contiguous CUDA {want} tensor of shape {shape}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    out = torch.empty(batch, kv_heads, max_pages * page_size, D, dtype=dtype, device=codes.device)
    if out.numel() == 0:
        return out
    arch = device_arch(codes.device)
    compiled = cached_compile(("dequantize", cfg, arch), lambda: compile_dequantize(cfg, arch=arch))
    stream = current_stream(codes.device)
    compiled(
        gmem_ptr(codes, cutlass.Int32), gmem_ptr(params, cutlass.Float16), gmem_ptr(page_table, cutlass.Int32),
        gmem_ptr(out, cfg.out_type), num_pages, kv_heads, page_size, batch, max_pages, stream,
    )
    return out
