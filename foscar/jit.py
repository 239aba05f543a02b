"""Arch detection and the compile cache.

Kernels compile at first call. The cache key is a tuple of what changes the generated code --
the kernel's name, the :class:`~foscar.scheme.Scheme`, page size, dtypes, the arch -- never batch
size, lengths, page counts or split counts (those are dynamic extents of the compiled kernel).
A compiled kernel is kept in memory for the process and on disk for later processes
(:mod:`foscar.compile_cache`: ``FOSCAR_CACHE_DIR``, ``FOSCAR_CACHE=0``).
"""

from __future__ import annotations

import functools
import os
import threading
import time
import warnings
from collections import OrderedDict

import torch

from .log import logger
from .targets import TARGETS

__all__ = ["ARCHS", "device_arch", "cached_compile", "compile_count", "kernel_count", "fake_ptr", "gmem_ptr",
           "launch"]

ARCHS = TARGETS  # the compile targets (foscar.targets; foscar.archs registers their kernels)

_cache: dict = {}
_lock = threading.Lock()
_compiles = 0
_misses = 0  # in-process cache misses: kernels compiled or loaded from disk
_blackwell_warned = False  # device_arch warns once per process on a Blackwell GPU
_bound: dict[int, tuple] = {}  # id(compiled) -> (compiled, its bound calls: launch); kept for the process
_bound_lock = threading.Lock()  # launch's bookkeeping (the conversion and the launch run outside it)
BOUND_CALLS = 64  # argument lists kept per compiled kernel (launch), least recently used dropped


def device_arch(device=None) -> str:
    """The arch to compile for: ``FOSCAR_ARCH`` if set, else the CUDA device's, as 'sm_XXa'.

    Hopper (compute capability 9.0: H100, H200) runs the kernels; Blackwell (10.0: B200) gets its
    compile-verified kernels with a warning, once per process; any other GPU is refused, naming it."""
    forced = os.environ.get("FOSCAR_ARCH")
    if forced:
        if forced not in ARCHS:
            raise ValueError(f"FOSCAR_ARCH must be one of {ARCHS}, got {forced!r}")
        return forced
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: pass an arch explicitly to compile without a GPU")
    index = None if device is None else torch.device(device).index
    return _cuda_arch(torch.cuda.current_device() if index is None else index)


@functools.cache
def _cuda_arch(device: int) -> str:
    """:func:`device_arch` of CUDA device ``device`` (an index), kept: a capability query costs ~9 us of a launch's
    host time (benchmarks/NOTES.md section 27)."""
    major, minor = torch.cuda.get_device_capability(device)
    arch = f"sm_{major}{minor}a"
    if arch not in ARCHS:
        raise NotImplementedError(
            f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}, sm_{major}{minor}) cannot run "
            f"FOSCAR's kernels: they are built for {', '.join(ARCHS)} only (Hopper: H100, H200; Blackwell: B200, "
            "compile-verified). On this GPU, PagedKVCache / FoscarCache(..., use_kernels=False) run their torch path; "
            "compile_decode(scheme, 'sm_90a') compiles and inspects without running")
    if arch == "sm_100a":
        _warn_blackwell_once(torch.cuda.get_device_name(device))
    return arch


def _warn_blackwell_once(name: str) -> None:
    """Say once per process that the Blackwell kernels about to run never ran anywhere."""
    global _blackwell_warned
    if not _blackwell_warned:
        _blackwell_warned = True
        warnings.warn(f"{name}: FOSCAR's Blackwell (sm_100a) kernels are compile-verified only and have never run on "
                      "a GPU; check their outputs against foscar.reference before relying on them: python -m pytest -m "
                      "gpu (the GPU suite runs this device's kernels)", RuntimeWarning, stacklevel=3)


def cached_compile(key: tuple, build):
    """Return the compiled object for ``key``: from memory, else from the disk cache, else ``build()``.

    ``key`` must name the arch (one of :data:`ARCHS`): the disk cache is shared by every process
    on the machine, whatever GPU each one runs on.
    """
    from . import compile_cache

    global _compiles, _misses
    if not any(arch in key for arch in ARCHS):
        raise ValueError(f"cached_compile: the key must name the arch (one of {ARCHS}), got {key!r}")
    with _lock:  # cute.compile is not thread-safe
        hit = _cache.get(key)
        if hit is None:
            _misses += 1
            hit = compile_cache.load(key)
            if hit is None:
                what = _describe(key)
                kept = (f"to be kept in {compile_cache.cache_dir()}" if compile_cache.enabled()
                        else "FOSCAR_CACHE=0: not kept")
                logger.info("compiling %s (its first use; %s for later processes) ...", what, kept)
                start = time.perf_counter()
                hit = build()
                _compiles += 1
                logger.info("compiled %s in %.1f s", what, time.perf_counter() - start)
                compile_cache.store(key, hit)
            _cache[key] = hit
        return hit


def _describe(key: tuple) -> str:
    """A compile's name for the log: the kernel, then what tells its variants apart (a scheme's name, numbers, flags,
    dtypes; not a config object's fields), then the arch."""
    from .scheme import Scheme

    arch = next(x for x in key if x in ARCHS)
    parts = [x.name if isinstance(x, Scheme) else getattr(x, "__name__", x) for x in key[1:] if x != arch]
    return " ".join(str(x) for x in [key[0], *parts, "for", arch] if isinstance(x, (str, int, bool)))


def compile_count() -> int:
    """How many compilations this process has done, disk-cache loads not counted (tests use it
    to prove disk-cache hits)."""
    return _compiles


def kernel_count() -> int:
    """How many kernels this process has obtained, compiled or loaded from disk (tests use it to
    prove in-process cache hits, whatever the disk cache holds)."""
    return _misses


def half_type(torch_dtype):
    """The CuTe type of a 16-bit torch dtype (bfloat16, else float16): what the kernels take for q,
    their outputs and the 16-bit window."""
    import cutlass

    return cutlass.BFloat16 if torch_dtype == torch.bfloat16 else cutlass.Float16


def fake_ptr(dtype):
    """A global-memory pointer of CuTe type ``dtype`` to compile against (no GPU, no tensor)."""
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace

    return make_ptr(dtype, 16, AddressSpace.gmem, assumed_align=16)


def gmem_ptr(tensor: torch.Tensor, dtype):
    """The CuTe pointer of a CUDA tensor; the kernels assume 16-byte alignment, so check it."""
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace

    if tensor.data_ptr() % 16:
        raise ValueError(f"a {tuple(tensor.shape)} tensor passed to a FOSCAR kernel is not 16-byte aligned")
    return make_ptr(dtype, tensor.data_ptr(), AddressSpace.gmem, assumed_align=16)


@functools.cache
def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA ``device`` (kept: a device-properties query per call costs microseconds)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch(compiled, *args) -> None:
    """Call the compiled kernel ``compiled`` on the current torch stream of its tensors' device. ``args``, in the
    kernel's order (the stream follows): ``(tensor, cute_type)`` for a CUDA tensor passed as a pointer (16-byte
    aligned: :func:`gmem_ptr`), ``(number, cute_type)`` for a scalar of that type, or a plain number.

    The DSL converts a call's arguments (``generate_execution_args``: ~20 us for ten arguments, more for more)
    before it launches; ``launch`` keeps the converted list of each distinct call (its pointers' addresses, numbers
    and stream; the last ``BOUND_CALLS``) and replays it (``run_compiled_program``), so a repeated call (the
    caching allocator hands out the same addresses) pays only the launch (benchmarks/NOTES.md section 45)."""
    device = next(a[0].device for a in args if isinstance(a, tuple) and isinstance(a[0], torch.Tensor))
    stream = torch.cuda.current_stream(device).cuda_stream
    key = (stream, *(a[0].data_ptr() if isinstance(a, tuple) and isinstance(a[0], torch.Tensor)
                     else a[0] if isinstance(a, tuple) else a for a in args))
    function = getattr(compiled, "function", compiled)  # a compile_cache.LoadedKernel's DSL function
    with _bound_lock:
        calls = _bound.setdefault(id(compiled), (compiled, OrderedDict()))[1]
        bound = calls.get(key)
        if bound is not None:
            calls.move_to_end(key)
    if bound is None:
        import cuda.bindings.driver as cuda

        converted = (*(gmem_ptr(*a) if isinstance(a, tuple) and isinstance(a[0], torch.Tensor)
                       else a[1](a[0]) if isinstance(a, tuple) else a for a in args), cuda.CUstream(stream))
        bound = (function.execution_args.generate_execution_args(converted, {}), converted)
        with _bound_lock:
            calls[key] = bound
            if len(calls) > BOUND_CALLS:
                calls.popitem(last=False)
    function.run_compiled_program(bound[0][0])
