"""The Hopper decode kernels as the shared host path (``foscar.launch``) takes them: the decode kernel
(``foscar.hopper.kernel``) and the cache decode (``foscar.hopper.cache_decode``: one launch whose work list fills
the GPU, or, where :func:`~foscar.hopper.cache_decode.fuses_window` says no, the quantized splits' partials, then
the window kernel), compiled with ``consumers`` consumer warpgroups per CTA (``default_consumers(scheme,
tokens)`` unless a benchmark asks for another count; part of the compile key)."""

from __future__ import annotations

from ..launch import KernelSet
from ..scheme import Scheme
from .cache_decode import HopperCacheDecodeKernel, cache_decode_config, fuses_window
from .kernel import DecodeConfig, HopperDecodeKernel, default_consumers

__all__ = ["HopperKernels", "KERNELS"]


class HopperKernels(KernelSet):
    name, arch = "hopper", "sm_90a"
    decode_kernel, cache_kernel = HopperDecodeKernel, HopperCacheDecodeKernel  # (limits: the kernel classes)

    def options(self, scheme: Scheme, tokens: int, consumers: int | None = None) -> tuple[int]:
        """``consumers``: consumer warpgroups per CTA (None: :func:`~foscar.hopper.kernel.default_consumers`)."""
        return (int(default_consumers(scheme, tokens) if consumers is None else consumers),)

    def config(self, scheme, page_size, partial_output, tokens, consumers):
        return DecodeConfig(scheme, page_size, partial_output, consumers, tokens=tokens, packed_causal=True)

    def cache_config(self, scheme, page_size, tokens, consumers):
        return cache_decode_config(scheme, page_size, consumers, tokens)

    def fuses_window(self, scheme, page_size, consumers):
        return fuses_window(scheme, page_size, consumers)


KERNELS = HopperKernels()
