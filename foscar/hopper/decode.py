"""The Hopper decode kernels as the shared host path (``foscar.launch``) takes them: the decode kernel
(``foscar.hopper.kernel``) and the cache decode (``foscar.hopper.cache_decode``: one launch whose work list fills
the GPU, or, where :func:`~foscar.hopper.cache_decode.fuses_window` says no, the quantized splits' partials, then
the window kernel), compiled with ``consumers`` consumer warpgroups per CTA and ``ctas_per_sm`` CTAs per SM (both
part of the compile key): ``default_consumers(scheme, tokens)`` at one CTA per SM, but 2 warpgroups for a decode
launch whose CTAs attend short splits and one warpgroup at two CTAs per SM for an unsplit launch of short sequences
(:meth:`HopperKernels.launch_options`) and for a cache decode of many short sequences
(:meth:`HopperKernels.cache_launch_options`), unless a caller asks. ``compile_decode`` without options (what
``foscar.inspect`` and the notebooks show) builds the default."""

from __future__ import annotations

from ..launch import KernelSet
from ..scheme import Scheme
from .cache_decode import HopperCacheDecodeKernel, cache_decode_config, fuses_window, two_ctas_pipeline_with_window
from .kernel import DecodeConfig, HopperDecodeKernel, default_consumers, two_ctas_pipeline

__all__ = ["HopperKernels", "KERNELS", "SHORT_SPLIT_TOKENS", "SHORT_CONTEXT_TOKENS"]

SHORT_SPLIT_TOKENS = 2048  # tokens per CTA at most for which a split decode launch takes 2 consumer warpgroups
SHORT_CONTEXT_TOKENS = 8192  # packed tokens per sequence at most for which a launch of many runs two CTAs per SM


class HopperKernels(KernelSet):
    name, arch = "hopper", "sm_90a"
    decode_kernel, cache_kernel = HopperDecodeKernel, HopperCacheDecodeKernel  # (limits: the kernel classes)

    def options(self, scheme: Scheme, tokens: int, consumers: int | None = None,
                ctas_per_sm: int | None = None) -> tuple[int, int]:
        """``consumers``: consumer warpgroups per CTA (None: :func:`~foscar.hopper.kernel.default_consumers`);
        ``ctas_per_sm``: CTAs resident per SM, 1 or 2 (None: 1; 2 takes one consumer warpgroup), each built with that
        share of its registers and shared memory."""
        for name, value in (("consumers", consumers), ("ctas_per_sm", ctas_per_sm)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be None or an int, got {value!r}")
        ctas_per_sm = 1 if ctas_per_sm is None else ctas_per_sm
        if consumers is None:  # two CTAs per SM hold one consumer warpgroup each (DecodeConfig)
            consumers = default_consumers(scheme, tokens) if ctas_per_sm == 1 else 1
        return consumers, ctas_per_sm

    def launch_options(self, scheme: Scheme, tokens: int, capacity: int, num_splits: int, waves: float = 0.0) -> dict:
        """Two consumer warpgroups instead of three for a split launch (too few sequences to fill the GPU) whose
        CTAs attend at most ``SHORT_SPLIT_TOKENS`` of the ``capacity`` tokens a page-table row holds: with ~3 tiles
        per warp the per-warp set-up and the warps' merge outweigh the third warpgroup (H200, benchmarks/NOTES.md
        section 34, 1 x 32K in 16 splits of 2K tokens: INT4 K token-wise 17.2 us with 2, 18.2 with 3; INT2 K
        channel-wise 15.3 against 17.0, measured when it defaulted to 3: it takes 2 everywhere since the pipelined
        loop, section 37).

        One consumer warpgroup at two CTAs per SM for an unsplit one-token launch over page-table rows of at most
        ``SHORT_CONTEXT_TOKENS`` that makes more than one wave at one CTA per SM (``waves``: many short sequences,
        256 x 2K; a grid of at most a wave would leave each SM one CTA of 4 consumer warps instead of 12, and past
        one wave the one-CTA launch needs a second round; measured at 1.9, 7.8 and 15.5 waves, not between 1 and 1.9):
        one CTA's prologue, ring fill and merge then overlap the other's loop, where a CTA alone on its SM leaves them
        bare (section 42, Qwen3-8B 256 x 2K: INT2 K token-wise 160.3 -> 123.2 us, K channel-wise 165.9 -> 133.8, INT4
        177.8 -> 162.0; 32 x 8K, 1.9 waves: 0.95-0.99x), where its loop still pipelines in half the SM's shared memory
        (:func:`~foscar.hopper.kernel.two_ctas_pipeline`)."""
        consumers = default_consumers(scheme, tokens)
        if consumers == 3 and num_splits > 1 and capacity // num_splits <= SHORT_SPLIT_TOKENS:
            consumers = 2
        if (num_splits == 1 and tokens == 1 and capacity <= SHORT_CONTEXT_TOKENS and waves > 1
                and two_ctas_pipeline(scheme)):
            return {"consumers": 1, "ctas_per_sm": 2}
        return {"consumers": consumers, "ctas_per_sm": 1}

    def cache_launch_options(self, scheme: Scheme, page_size: int, tokens: int, capacity: int, pairs: int,
                             budget: int) -> dict:
        """The cache decode's :meth:`launch_options` rule for two CTAs per SM: one query token, sequences bounded by
        ``SHORT_CONTEXT_TOKENS`` packed tokens (``capacity``: ``foscar.launch.cache_capacity``, a page-table row or
        the pool over the batch), more (sequence, KV head) ``pairs`` than the work list's one-wave ``budget`` (so
        every pair is one part at least: many short sequences), and the loop pipelined with the window tiles in
        half an SM's shared memory (:func:`~foscar.hopper.cache_decode.two_ctas_pipeline_with_window`); its work
        list then fills twice the budget."""
        if (tokens == 1 and 0 < capacity <= SHORT_CONTEXT_TOKENS and pairs > budget
                and two_ctas_pipeline_with_window(scheme, page_size)):
            return {"consumers": 1, "ctas_per_sm": 2}
        return {}

    def ctas_per_sm(self, opts: tuple) -> int:
        return opts[1]  # (consumers, ctas_per_sm): options()

    def config(self, scheme, page_size, partial_output, tokens, consumers, ctas_per_sm):
        return DecodeConfig(scheme, page_size, partial_output, consumers, tokens=tokens, packed_causal=True,
                            ctas_per_sm=ctas_per_sm)

    def cache_config(self, scheme, page_size, tokens, consumers, ctas_per_sm):
        return cache_decode_config(scheme, page_size, consumers, tokens, ctas_per_sm)

    def fuses_window(self, scheme, page_size, consumers, ctas_per_sm):
        return fuses_window(scheme, page_size, consumers, ctas_per_sm)


KERNELS = HopperKernels()
