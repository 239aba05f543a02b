"""The Blackwell decode kernels as the shared host path (``foscar.launch``) takes them: the decode kernel
(``foscar.blackwell.kernel``) and the cache decode (``foscar.blackwell.cache_decode``: the quantized splits'
partials, then the window kernel, ``foscar.kernels.sink_window``). The pages must be in the Blackwell word
order (``foscar.layouts.blackwell``). Compiles on any machine; never run here (no Blackwell GPU)."""

from __future__ import annotations

from ..launch import KernelSet
from .cache_decode import BlackwellCacheDecodeKernel
from .kernel import BlackwellConfig, BlackwellDecodeKernel

__all__ = ["BlackwellKernels", "KERNELS"]


class BlackwellKernels(KernelSet):
    name, arch = "blackwell", "sm_100a"
    # limits (BlackwellConfig): at most 16 query columns, each split into hi/lo halves; sKinfo holds the unscales
    # and corrections of at most 4 channel-wise K groups per 128-token step, so groups of >= 32 tokens
    max_gqa_ratio, page_sizes, min_group = 16, (64, 128, 256), 32
    decode_kernel, cache_kernel = BlackwellDecodeKernel, BlackwellCacheDecodeKernel
    cache_args = ("q", "k_codes", "k_params", "v_codes", "v_params", "page_table", "seq_rows", "seq_lengths",
                  "o_part", "lse_part", "batch", "kv_heads", "max_pages", "num_splits", "parts", "sink", "window",
                  "sm_scale")

    def config(self, scheme, page_size, partial_output, tokens):
        return BlackwellConfig(scheme, page_size, partial_output, tokens, packed_causal=True)

    def cache_config(self, scheme, page_size, tokens):
        return BlackwellConfig(scheme, page_size, True, tokens)


KERNELS = BlackwellKernels()
