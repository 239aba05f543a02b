"""Host entry points of the Blackwell decode kernel: compile-only (any machine) and run (sm_100).

``compile_decode(scheme, page_size, partial_output, arch="sm_100a")`` compiles with fake pointers
(no GPU needed) and returns the compiled function with its PTX and cubin
(``foscar.inspect.artifacts``). Argument order and output format are those of
``foscar.hopper.decode`` so ``foscar.decode`` can dispatch either variant the same way; the cache
itself must be packed in the Blackwell word order (``foscar.layouts.blackwell``).
"""

from __future__ import annotations

from ..inspect import compile_for
from ..jit import cached_compile, current_stream, fake_ptr, gmem_ptr, half_type
from ..scheme import Scheme
from .kernel import BlackwellConfig

__all__ = ["compile_decode", "run_decode", "compile_cache_decode", "run_cache_decode", "max_query_tokens",
           "DEFAULT_ARCH"]

DEFAULT_ARCH = "sm_100a"


def _check_arch(arch: str):
    if arch != "sm_100a":
        raise ValueError(f"the Blackwell kernel targets sm_100a, got arch={arch!r}")


def compile_decode(scheme: Scheme, page_size: int, partial_output: bool = False, arch: str = DEFAULT_ARCH):
    """Compile (or fetch from the in-process cache) the sm_100a decode kernel of ``scheme``."""
    _check_arch(arch)
    key = ("blackwell_decode", scheme, int(page_size), bool(partial_output), arch)
    return cached_compile(key, lambda: _build(scheme, page_size, partial_output, arch))


def _build(scheme, page_size, partial_output, arch):
    import cuda.bindings.driver as cuda

    from cutlass import Float16, Float32, Int32

    from .kernel import BlackwellDecodeKernel

    cfg = BlackwellConfig(scheme, page_size, partial_output)
    kernel = BlackwellDecodeKernel(cfg)

    return compile_for(
        arch, kernel,
        fake_ptr(cfg.q_dtype), fake_ptr(Int32), fake_ptr(Float16), fake_ptr(Int32), fake_ptr(Float16), fake_ptr(Int32), fake_ptr(Int32),
        fake_ptr(Float32 if partial_output else cfg.q_dtype), fake_ptr(Float32),
        Int32(1), Int32(1), Int32(1), Int32(1), Float32(1.0), cuda.CUstream(0),
    )


def run_decode(q, k_codes, k_params, v_codes, v_params, page_table, lengths, sm_scale, scheme: Scheme, num_splits: int = 1,
               out=None, lse=None, arch: str = DEFAULT_ARCH):
    """Launch on validated CUDA tensors of an sm_100 device (same contract as ``foscar.hopper.decode.run_decode``).

    Never run here (no Blackwell GPU): compile-verified only.
    """
    import torch

    from cutlass import Float16, Float32, Int32

    from ..kernels.combine import combine_splits

    batch, hq, d = q.shape
    page_size = k_codes.shape[2] * 64
    partial = num_splits > 1
    compiled = compile_decode(scheme, page_size, partial, arch)
    q_type = half_type(q.dtype)
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(batch, hq, dtype=torch.float32, device=q.device) if lse is None else lse
    if partial:
        o_part = torch.empty(batch, hq, num_splits, d, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(batch, hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        o_part, lse_part = out, lse
    compiled(
        gmem_ptr(q, q_type), gmem_ptr(k_codes, Int32), gmem_ptr(k_params, Float16), gmem_ptr(v_codes, Int32), gmem_ptr(v_params, Float16),
        gmem_ptr(page_table, Int32), gmem_ptr(lengths, Int32), gmem_ptr(o_part, Float32 if partial else q_type), gmem_ptr(lse_part, Float32),
        Int32(batch), Int32(k_codes.shape[1]), Int32(page_table.shape[1]), Int32(num_splits), Float32(float(sm_scale)),
        current_stream(q.device),
    )
    if partial:
        combine_splits(o_part, lse_part, out, lse)
    return out, lse


def compile_cache_decode(scheme: Scheme, page_size: int, arch: str = DEFAULT_ARCH, tokens: int = 1):
    """Compile (or fetch) the decode launch of ``foscar.cache.PagedKVCache`` (``foscar.blackwell.fused``:
    the quantized splits' partials, read in place from the cache's tensors) for ``tokens`` query tokens per
    sequence (several: the sequences' last tokens; the window launch, ``foscar.kernels.sink_window``, masks
    them causally)."""
    _check_arch(arch)
    limit, why = max_query_tokens(scheme)
    if not 1 <= tokens <= limit:
        raise ValueError(f"q: {tokens} query tokens per sequence: the {arch} cache decode takes 1..{limit} ({why})")
    key = ("blackwell_cache_decode", scheme, int(page_size), arch) + ((int(tokens),) if tokens > 1 else ())
    return cached_compile(key, lambda: _build_cache_decode(scheme, page_size, arch, tokens))


def max_query_tokens(scheme: Scheme) -> tuple[int, str]:
    """The most query tokens per sequence the cache decode takes, and why no more."""
    from ..query_rows import MAX_QUERY_COLUMNS

    return MAX_QUERY_COLUMNS // scheme.gqa_ratio, (f"the query tile holds {MAX_QUERY_COLUMNS} columns per KV head: "
                                                   f"gqa_ratio={scheme.gqa_ratio} x tokens")


def _build_cache_decode(scheme, page_size, arch, tokens):
    from ..kernels.sink_window import cache_decode_compile_args
    from .fused import BlackwellCacheDecodeKernel

    cfg = BlackwellConfig(scheme, page_size, True, tokens)
    return compile_for(arch, BlackwellCacheDecodeKernel(cfg), *cache_decode_compile_args(cfg.q_dtype))


def run_cache_decode(q, k_codes, k_params, v_codes, v_params, page_table, k_win, v_win, seq_rows, seq_lengths, counters,
                     sink: int, window: int, sm_scale: float, scheme: Scheme, num_splits: int, budget: int = 1,
                     arch: str = DEFAULT_ARCH):
    """Decode on a cache layer's tensors, pages in the Blackwell word order: the same contract as
    ``foscar.kernels.sink_window.run_cache_attend`` (``num_splits`` per sequence: ``budget``, the
    Hopper launch's work list, is not built here).
    Never run here (no Blackwell GPU): compile-verified only."""
    from ..kernels.sink_window import run_cache_attend

    tokens = q.shape[1] if q.dim() == 4 else 1
    return run_cache_attend(lambda: compile_cache_decode(scheme, k_codes.shape[2] * 64, arch, tokens), half_type(q.dtype),
                            q, k_codes,
                            k_params, v_codes, v_params, page_table, k_win, v_win, seq_rows, seq_lengths, counters,
                            sink, window, sm_scale, scheme, num_splits, arch)
