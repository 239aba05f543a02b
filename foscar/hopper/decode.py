"""The Hopper decode kernels as the shared host path (``foscar.launch``) takes them: the decode kernel
(``foscar.hopper.kernel``) and the cache decode (``foscar.hopper.cache_decode``: one launch whose work list fills
the GPU, or, where :func:`~foscar.hopper.cache_decode.fuses_window` says no, the quantized splits' partials, then
the window kernel), compiled with ``consumers`` consumer warpgroups per CTA (part of the compile key):
``default_consumers(scheme, tokens)``, but 2 for a decode launch whose CTAs attend short splits
(:meth:`HopperKernels.launch_options`), unless a caller asks for a count. ``compile_decode`` without options (what
``foscar.inspect`` and the notebooks show) builds the default."""

from __future__ import annotations

from ..launch import KernelSet
from ..scheme import Scheme
from .cache_decode import HopperCacheDecodeKernel, cache_decode_config, fuses_window
from .kernel import DecodeConfig, HopperDecodeKernel, default_consumers

__all__ = ["HopperKernels", "KERNELS", "SHORT_SPLIT_TOKENS"]

SHORT_SPLIT_TOKENS = 2048  # tokens per CTA at most for which a split decode launch takes 2 consumer warpgroups


class HopperKernels(KernelSet):
    name, arch = "hopper", "sm_90a"
    decode_kernel, cache_kernel = HopperDecodeKernel, HopperCacheDecodeKernel  # (limits: the kernel classes)

    def options(self, scheme: Scheme, tokens: int, consumers: int | None = None) -> tuple[int]:
        """``consumers``: consumer warpgroups per CTA (None: :func:`~foscar.hopper.kernel.default_consumers`)."""
        return (int(default_consumers(scheme, tokens) if consumers is None else consumers),)

    def launch_options(self, scheme: Scheme, tokens: int, capacity: int, num_splits: int) -> dict:
        """Two consumer warpgroups instead of three for a split launch (too few sequences to fill the GPU) whose
        CTAs attend at most ``SHORT_SPLIT_TOKENS`` of the ``capacity`` tokens a page-table row holds: with ~3 tiles
        per warp the per-warp set-up and the warps' merge outweigh the third warpgroup (H200, benchmarks/NOTES.md
        section 34, 1 x 32K in 16 splits of 2K tokens: INT4 K token-wise 17.2 us with 2, 18.2 with 3; INT2 K
        channel-wise 15.3 against 17.0, measured when it defaulted to 3: it takes 2 everywhere since the pipelined
        loop, section 37). Unsplit launches of short sequences (256 x 2K) keep the default: not measured with 2."""
        consumers = default_consumers(scheme, tokens)
        if consumers == 3 and num_splits > 1 and capacity // num_splits <= SHORT_SPLIT_TOKENS:
            consumers = 2
        return {"consumers": consumers}

    def config(self, scheme, page_size, partial_output, tokens, consumers):
        return DecodeConfig(scheme, page_size, partial_output, consumers, tokens=tokens, packed_causal=True)

    def cache_config(self, scheme, page_size, tokens, consumers):
        return cache_decode_config(scheme, page_size, consumers, tokens)

    def fuses_window(self, scheme, page_size, consumers):
        return fuses_window(scheme, page_size, consumers)


KERNELS = HopperKernels()
