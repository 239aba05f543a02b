"""The Blackwell decode kernels as the shared host path (``foscar.launch``) takes them: the decode kernel
(``foscar.blackwell.kernel``) and the cache decode (``foscar.blackwell.cache_decode``: one launch whose work list
fills the GPU, the window blocks and the split merge in it, as Hopper's). The pages must be in the Blackwell word
order (``foscar.layouts.blackwell``). Compiles on any machine; never run here (no Blackwell GPU)."""

from __future__ import annotations

import functools

from ..launch import KernelSet
from ..scheme import Scheme
from .cache_decode import BlackwellCacheDecodeKernel, cache_decode_config
from .kernel import BlackwellConfig, BlackwellDecodeKernel

__all__ = ["BlackwellKernels", "KERNELS"]


class BlackwellKernels(KernelSet):
    name, arch = "blackwell", "sm_100a"
    decode_kernel, cache_kernel = BlackwellDecodeKernel, BlackwellCacheDecodeKernel  # (limits: the kernel classes)

    def config(self, scheme, page_size, partial_output, tokens):
        return BlackwellConfig(scheme, page_size, partial_output, tokens, packed_causal=True)

    def cache_config(self, scheme, page_size, tokens):
        return cache_decode_config(scheme, page_size, tokens)

    def fuses_window(self, scheme, page_size):
        return True  # the window's shared memory comes out of the ring (foscar.blackwell.cache_decode)

    def max_query_tokens(self, scheme: Scheme) -> tuple[int, str]:
        """As every arch's, but no more tokens than leave room for the cache decode's window areas: more query
        columns take more shared memory (e.g. head_dim 256, INT4 K token groups of 64, gqa 7: 2 tokens do not fit),
        and the cache then runs more launches of fewer tokens."""
        limit, why = super().max_query_tokens(scheme)
        fits = _window_fits(scheme, limit)
        if fits < limit:
            return fits, f"{why}; {fits + 1} leave no shared memory for the cache decode's window blocks"
        return limit, why


@functools.lru_cache(maxsize=256)
def _window_fits(scheme: Scheme, limit: int) -> int:
    """The most query tokens, up to ``limit``, whose cache decode config builds (shared memory and TMEM are the
    same at every page size: probed at 256, a multiple of every group); ``limit`` where the decode's own config
    does not build either (``can_implement`` names why)."""
    for tokens in range(limit, 0, -1):
        try:
            cache_decode_config(scheme, 256, tokens)
            return tokens
        except (NotImplementedError, ValueError):
            try:
                BlackwellConfig(scheme, 256, True, tokens)
            except (NotImplementedError, ValueError):
                return limit
    return limit


KERNELS = BlackwellKernels()
