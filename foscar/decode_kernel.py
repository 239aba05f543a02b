"""The decode kernels' common base, both arches (FlashAttention's ``FlashAttentionForwardBase`` -> ``...Sm90`` /
``...Sm100`` is the model): the launch's arguments as named bundles, the kernels' limits
(:meth:`DecodeKernelBase.can_implement`), the packed tile's ring stage (:class:`StageLayout` and
:meth:`DecodeKernelBase.copy_tile`, the producers' four bulk copies) and the host entries (``__call__``) that
bundle the launch's flat arguments. ``foscar.hopper.kernel`` and ``foscar.blackwell.kernel`` subclass
:class:`DecodeKernelBase`; their cache decodes mix in :class:`CacheDecodeBase`. An arch kernel says how it launches
(``launch_decode``, ``launch_cache``: its MMAs, shared memory and grid), and its ``@cute.kernel`` takes the bundles.

The compiled entries take the flat arguments (``foscar.launch.POINTERS`` and ``SCALARS``, one list for every arch)
and bundle them first thing: the DSL marshals a dataclass argument of a compiled function slower than the same
values flat (DSL 4.8.1, a bundle of two pointers and an int: 22 us against 6 us per call on the CPU), and an eager
decode pays that per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass.cute as cute
from cutlass import Float32, Int32

from .device import LOG2E
from .formats import Unsupported, affine_mismatch, kernel_construction
from .pipeline import PackedPages, bulk_copy_g2s
from .scheme import Axis, Scheme
from .split_merge import CacheOutput
from .window_tiles import WindowSlots

__all__ = ["DecodeArgs", "CacheArgs", "StageLayout", "DecodeKernelBase", "CacheDecodeBase"]


@dataclass(frozen=True)
class DecodeArgs:
    """The decode kernel's runtime arguments: queries ``q`` (``[B, Hq, D]`` or ``[B, tokens, Hq, D]``, q dtype), the
    layer's packed ``pages`` (page table ``[B, max_pages]``), ``lengths`` (int32 ``[B]``), the output ``o`` and ``lse``
    (``foscar.launch``: final or fp32 partials), the KV heads, the splits per (sequence, KV head) and the score scale
    ``sm_scale * log2(e)``."""

    q: cute.Pointer
    pages: PackedPages
    lengths: cute.Pointer
    o: cute.Pointer
    lse: cute.Pointer
    kv_heads: Int32
    num_splits: Int32
    scale_log2: Float32


@dataclass(frozen=True)
class CacheArgs:
    """The cache decode's runtime arguments (``foscar.launch.KernelSet.run_cache_decode``): ``q``, the layer's packed
    ``pages`` (page table ``[max_seqs, max_pages]``), the batch's cache rows ``seq_rows`` (int64 ``[B]``) and every
    row's tokens ``seq_lengths`` (int64 ``[max_seqs]``), the 16-bit ``slots``, where results go (``output``), the
    batch and KV heads, the work list's CTA ``budget`` (one launch) or ``num_splits`` and ``parts`` (Hopper's two
    launches), and the score scale ``sm_scale * log2(e)``."""

    q: cute.Pointer
    pages: PackedPages
    seq_rows: cute.Pointer
    seq_lengths: cute.Pointer
    slots: WindowSlots
    output: CacheOutput
    batch: Int32
    kv_heads: Int32
    budget: Int32
    num_splits: Int32
    parts: Int32
    scale_log2: Float32


class StageLayout:
    """A config's ring stage of one packed 64-token tile (int32 words), both arches: K codes | V codes | K params |
    V params, each a contiguous run in global memory (``foscar.pipeline``). :meth:`lay_out_stage` sets ``K_TW``,
    ``V_TW`` (code words per tile), ``KPW``, ``VPW`` (param words), the four offsets, ``STAGE_WORDS`` and
    ``TILE_BYTES`` (what a tile's copies bring). ``ctas_per_sm``: the CTAs the launch keeps resident per SM
    (``.minnctapersm``: the registers and shared memory a CTA is built with are that share of the SM's)."""

    ctas_per_sm = 1

    def lay_out_stage(self, plan, k_words: int, v_words: int):
        self.K_TW, self.V_TW = k_words, v_words
        self.KPW, self.VPW = plan.k.tile_param_words, plan.v.tile_param_words  # param_fields fp16 per group
        self.K_CODES, self.V_CODES, self.K_PARAMS = 0, self.K_TW, self.K_TW + self.V_TW
        self.V_PARAMS = self.K_PARAMS + self.KPW
        self.STAGE_WORDS = self.V_PARAMS + self.VPW
        self.TILE_BYTES = 4 * self.STAGE_WORDS


class DecodeKernelBase:
    """A decode kernel of one arch: ``cfg`` (the arch's config, a :class:`StageLayout`) built from a Scheme's plan.
    A subclass sets the limits below and ``launch_decode(args: DecodeArgs, grid, stream)``."""

    arch: str  # the compile target
    max_gqa_ratio: int  # query heads per KV head (the query tile's columns)
    page_sizes: tuple[int, ...]
    min_group: int  # smallest group (either axis) the kernel reads

    def __init__(self, cfg):
        self.cfg = cfg

    @classmethod
    def can_implement(cls, scheme: Scheme, page_size: int) -> None:
        """Return if the kernel builds ``scheme`` at ``page_size`` as far as its limits say (the geometry's own
        checks run when its config is built: ``foscar.launch.KernelSet.can_implement``); else raise a ValueError
        naming the field (TypeError for a non-Scheme; ``foscar.formats.Unsupported`` for a format the arch's MMA
        cannot take). Compiles nothing."""
        if not isinstance(scheme, Scheme):
            raise TypeError(f"scheme must be a foscar.Scheme, got {type(scheme).__name__}")
        if type(page_size) is not int or page_size not in cls.page_sizes:
            raise ValueError(f"page_size must be one of {list(cls.page_sizes)} for the {cls.arch} kernel, "
                             f"got {page_size!r}")
        if not 1 <= scheme.gqa_ratio <= cls.max_gqa_ratio:
            raise ValueError(f"Scheme.gqa_ratio={scheme.gqa_ratio}: the {cls.arch} kernel takes "
                             f"1..{cls.max_gqa_ratio} query heads per KV head")
        for name, quant in (("k", scheme.k), ("v", scheme.v)):
            try:
                construction = quant.format.construction(cls.arch)
            except Unsupported as err:
                raise Unsupported(f"Scheme.{name}.format: {err}") from None
            built = kernel_construction(cls.arch, quant.bits)
            if construction != built:
                raise Unsupported(f"Scheme.{name}.format: {quant.format.name} asks for {construction.name} operands; "
                                  f"the {cls.arch} kernel builds {built.name if built else 'none'} from "
                                  f"{quant.bits}-bit codes")
            mismatch = affine_mismatch(quant.format)
            if mismatch:
                raise Unsupported(f"Scheme.{name}.format: {mismatch}")
            if quant.group < cls.min_group:
                raise ValueError(f"Scheme.{name}.group={quant.group}: the {cls.arch} kernel needs groups of at "
                                 f"least {cls.min_group}")
            if quant.axis is Axis.CHANNEL and page_size % quant.group:
                raise ValueError(f"Scheme.{name}.group={quant.group} (channel-wise) must divide page_size={page_size}")

    @cute.jit
    def __call__(self, q: cute.Pointer, k_codes: cute.Pointer, k_params: cute.Pointer, v_codes: cute.Pointer,
                 v_params: cute.Pointer, page_table: cute.Pointer, lengths: cute.Pointer, o: cute.Pointer,
                 lse: cute.Pointer, batch: Int32, kv_heads: Int32, max_pages: Int32, num_splits: Int32,
                 sm_scale: Float32, stream: cuda.CUstream):
        """The compiled decode's entry (``foscar.launch.decode_args``): one CTA per (split, KV head, sequence)."""
        args = DecodeArgs(q, PackedPages(k_codes, k_params, v_codes, v_params, page_table, max_pages), lengths, o,
                          lse, kv_heads, num_splits, sm_scale * LOG2E)
        self.launch_decode(args, (num_splits, kv_heads, batch), stream)

    def launch(self, kernel, grid, smem_bytes: int, stream: cuda.CUstream):
        """Launch a traced ``kernel`` over ``grid`` with ``smem_bytes`` of shared memory, ``cfg.threads`` threads
        per CTA."""
        kernel.launch(
            grid=grid,
            block=(self.cfg.threads, 1, 1),
            smem=smem_bytes,
            min_blocks_per_mp=self.cfg.ctas_per_sm,  # .minnctapersm (with reqntid): ptxas keeps the per-role setmaxnreg
            # two CTAs need the SM's whole shared memory (a carveout given here also spares the DSL a device query)
            preferred_smem_carveout=100 if self.cfg.ctas_per_sm > 1 else None,
            stream=stream,
        )

    def params_element(self, fold, page_head, slot0):
        """fp16 element of a tile's first param (the fold case's params layout); a tile starts at a multiple of 64
        groups (token-wise) or of head_dim (channel-wise), which the bulk copy's 16-byte alignment needs."""
        return fold.param_fields * cute.assume(fold.params_row(page_head, slot0, self.cfg.page_size), divby=4)

    def copy_tile(self, dst: cute.Pointer, full: cute.Pointer, pages: PackedPages, page_head, sub, slot0):
        """The four bulk copies of tile ``sub`` (first slot ``slot0``) of (page, KV head) ``page_head`` into the
        stage at ``dst``, completing on the mbarrier ``full``."""
        cfg = self.cfg
        tile = page_head * cfg.SUB + sub
        k_codes = cute.assume(tile * cfg.K_TW, divby=4)
        v_codes = k_codes if cfg.V_TW == cfg.K_TW else cute.assume(tile * cfg.V_TW, divby=4)
        bulk_copy_g2s(dst + cfg.K_CODES, pages.k_codes + k_codes, 4 * cfg.K_TW, full)
        bulk_copy_g2s(dst + cfg.V_CODES, pages.v_codes + v_codes, 4 * cfg.V_TW, full)
        bulk_copy_g2s(dst + cfg.K_PARAMS, pages.k_params + self.params_element(cfg.plan.k, page_head, slot0),
                      4 * cfg.KPW, full)
        bulk_copy_g2s(dst + cfg.V_PARAMS, pages.v_params + self.params_element(cfg.plan.v, page_head, slot0),
                      4 * cfg.VPW, full)


class CacheDecodeBase:
    """The cache decode's entry, both arches (mixed in before the arch's decode kernel): a subclass sets
    ``launch_cache(args: CacheArgs, stream)``."""

    @cute.jit
    def __call__(self, q: cute.Pointer, k_codes: cute.Pointer, k_params: cute.Pointer, v_codes: cute.Pointer,
                 v_params: cute.Pointer, page_table: cute.Pointer, seq_rows: cute.Pointer, seq_lengths: cute.Pointer,
                 k_win: cute.Pointer, v_win: cute.Pointer, o_part: cute.Pointer, lse_part: cute.Pointer,
                 out: cute.Pointer, lse: cute.Pointer, counters: cute.Pointer, batch: Int32, kv_heads: Int32,
                 max_pages: Int32, budget: Int32, num_splits: Int32, parts: Int32, sink: Int32, ring: Int32,
                 window: Int32, sm_scale: Float32, stream: cuda.CUstream):
        """The compiled cache decode's entry (``foscar.launch.CACHE_ARGS``)."""
        args = CacheArgs(q, PackedPages(k_codes, k_params, v_codes, v_params, page_table, max_pages), seq_rows,
                         seq_lengths, WindowSlots(k_win, v_win, sink, ring, window),
                         CacheOutput(o_part, lse_part, out, lse, counters, batch * kv_heads), batch, kv_heads, budget,
                         num_splits, parts, sm_scale * LOG2E)
        self.launch_cache(args, stream)
