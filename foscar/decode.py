"""Public decode API: validation, split-KV planning, arch dispatch (through ``foscar.archs``).

``decode(q, cache)`` attends each query head over its sequence in a :class:`QuantizedKV` cache (the
module itself is callable too: ``foscar.decode(q, cache)`` is ``foscar.decode.decode(q, cache)``);
``decode_paged(...)`` takes the raw cache tensors (what a serving engine holds). Every argument is
checked here, with an error naming it, before anything reaches the compiler or the GPU.
"""

from __future__ import annotations

import sys
import types

import torch

from .archs import arch_of_device, get_arch, packed_layouts
from .checks import INDEX_LIMIT, checked_sm_scale, is_int
from .jit import sm_count
from .query_rows import launches
from .quantize import QuantizedKV, check_page_size
from .scheme import PARAM_DTYPE, Scheme
from .work_list import MAX_DECODE_SPLITS, MIN_TOKENS_PER_SPLIT, plan_splits

__all__ = ["compile_decode", "decode", "decode_paged", "plan_splits", "validate_paged", "MAX_DECODE_SPLITS",
           "MIN_TOKENS_PER_SPLIT"]

MAX_GRID_YZ = 65535  # a CUDA grid's y and z extents: the decode launch's KV heads and sequences
MAX_LENGTH = 2**31 - 2**16  # tokens of a sequence: the kernels count its tiles in 32-bit ints


def _tensor(name, t, dtype, dims, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.dim() != len(dims):
        raise ValueError(f"{name} must have shape {list(dims)}, got {list(t.shape)}")
    for size, want, label in zip(t.shape, dims, dims):
        if isinstance(want, int) and size != want:
            raise ValueError(f"{name} must have shape {list(dims)}, got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (the device of q), got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device.type != "meta" and t.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address (the kernels read 16-byte vectors); a slice "
                         "at a storage offset is not: pass a copy (.clone())")


def validate_paged(q, k_codes, k_params, v_codes, v_params, page_table, lengths, scheme: Scheme, page_size: int,
                   sm_scale: float | None, check_pages: bool = True) -> float:
    """Raise a TypeError/ValueError naming the first bad argument; returns ``sm_scale`` as a float (None: the scheme's
    ``head_dim ** -0.5``).

    ``check_pages`` reads ``page_table`` and ``lengths`` back to the host to check every used page
    index is in range; it is skipped while a CUDA graph is being captured.
    """
    if not isinstance(scheme, Scheme):
        raise TypeError(f"scheme must be a foscar.Scheme, got {type(scheme).__name__}")
    check_page_size(scheme, page_size)
    sm_scale = checked_sm_scale(sm_scale, scheme.head_dim**-0.5)
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() not in (3, 4):
        raise ValueError(f"q must have shape [batch, q_heads, head_dim] or [batch, tokens, q_heads, head_dim], got "
                         f"{list(q.shape)}")
    batch, q_heads, dim = q.shape[0], q.shape[-2], q.shape[-1]
    tokens = q.shape[1] if q.dim() == 4 else 1
    if batch < 1 or tokens < 1:
        raise ValueError(f"q must hold at least one sequence and one query token, got shape {list(q.shape)}")
    if q.device.type == "meta":
        raise ValueError("q is a meta tensor (a shape without data): decode needs real tensors")
    if dim != scheme.head_dim:
        raise ValueError(f"q's head_dim {dim} must equal Scheme.head_dim {scheme.head_dim}")
    device = q.device
    _tensor("q", q, scheme.q_dtype, ("batch", "tokens", "q_heads", dim) if q.dim() == 4 else ("batch", "q_heads", dim),
            None)
    if not isinstance(k_codes, torch.Tensor) or k_codes.dim() != 4:
        raise ValueError("k_codes must be a 4-d int32 tensor [num_pages, kv_heads, page_size // 64, tile_words]")
    num_pages, kv_heads = k_codes.shape[:2]
    if q_heads != kv_heads * scheme.gqa_ratio:
        raise ValueError(f"q has {q_heads} heads; must be kv_heads ({kv_heads}) * Scheme.gqa_ratio ({scheme.gqa_ratio})")
    for name, t, quant in (("k_codes", k_codes, scheme.k), ("v_codes", v_codes, scheme.v)):
        tile_words = 64 * dim * quant.bits // 32  # K and V may differ in width
        _tensor(name, t, torch.int32, (num_pages, kv_heads, page_size // 64, tile_words), device)
    for name, t, quant in (("k_params", k_params, scheme.k), ("v_params", v_params, scheme.v)):
        _tensor(name, t, PARAM_DTYPE, (num_pages, kv_heads, *quant.params_shape(page_size, dim), quant.param_fields), device)
    _tensor("page_table", page_table, torch.int32, (batch, "max_pages"), device)
    _tensor("lengths", lengths, torch.int32, (batch,), device)
    if batch > MAX_GRID_YZ or kv_heads > MAX_GRID_YZ:  # the launch's grid (splits, KV heads, sequences)
        raise ValueError(f"q: {batch} sequences of {kv_heads} KV heads; one launch takes at most {MAX_GRID_YZ} of each "
                         "(a CUDA grid's y and z): split the batch")
    if page_table.shape[1] * page_size > MAX_LENGTH:  # the kernel counts a sequence's tiles in 32-bit ints
        raise ValueError(f"page_table: {page_table.shape[1]} pages of {page_size} tokens a sequence; a sequence holds "
                         f"at most {MAX_LENGTH} tokens")
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if check_pages and not capturing:
        lens = lengths.cpu()
        if lens.numel() and (int(lens.min()) < tokens or int(lens.max()) > page_table.shape[1] * page_size):
            raise ValueError(f"lengths must lie in [{tokens} (the query tokens, which the pages hold), "
                             f"max_pages*page_size = {page_table.shape[1] * page_size}]")
        used = torch.arange(page_table.shape[1])[None, :] * page_size < lens[:, None]
        pages = page_table.cpu()[used]
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
            raise ValueError(f"page_table holds page indices outside [0, {num_pages}) for tokens below lengths")
    return sm_scale


def decode_paged(q, k_codes, k_params, v_codes, v_params, page_table, lengths, scheme: Scheme, page_size: int,
                 sm_scale: float | None = None, return_lse: bool = False, num_splits: int | None = None,
                 check_pages: bool = True, out=None, lse=None, layout: str | None = None):
    """Decode attention over a paged quantized cache; returns ``out`` (and ``lse`` if asked).

    ``q`` is ``[batch, q_heads, head_dim]``, one query token per sequence, or ``[batch, tokens, q_heads,
    head_dim]``: the sequences' last ``tokens`` tokens (speculative verification: the draft, already
    quantized into the pages), each attending its sequence up to itself (causal); ``lengths`` count them and must
    be at least ``tokens`` (checked on the host unless ``check_pages=False`` or under CUDA-graph capture).
    One launch takes ``gqa_ratio x tokens <= 16`` query rows per KV head (``Arch.max_query_tokens``); more
    tokens run as several launches, the earlier tokens' over the sequences cut short (``lengths - later``).
    ``out`` (q's shape and dtype) and ``lse`` (fp32, q's shape but head_dim) may be given to write in
    place. ``check_pages=False`` skips the host read-back of the page table (it is skipped anyway under
    CUDA-graph capture). ``layout`` (optional) names the bit order the codes were packed in; it must be
    the device's (``foscar.archs.Arch.layout``). ``num_splits`` (None: :func:`plan_splits`'s) CTAs share each
    (sequence, KV head), at most ``MAX_DECODE_SPLITS``, merged by a second launch.
    """
    sm_scale = validate_paged(q, k_codes, k_params, v_codes, v_params, page_table, lengths, scheme, page_size, sm_scale,
                              check_pages)
    page_size = int(page_size)
    if num_splits is not None:
        if not is_int(num_splits) or not 1 <= num_splits <= MAX_DECODE_SPLITS:
            raise ValueError(f"num_splits must be None or an int in [1, {MAX_DECODE_SPLITS}], got {num_splits!r}")
        if num_splits > 1 and q.numel() * num_splits >= INDEX_LIMIT:  # the splits' fp32 partials [rows, splits, D]
            raise ValueError(f"num_splits={num_splits}: the partial outputs of q {list(q.shape)} would hold "
                             f"{q.numel() * num_splits} elements; the combine kernel indexes fewer than 2^31")
    if layout is not None and layout not in packed_layouts():
        raise ValueError(f"layout must be None or one of {packed_layouts()}, got {layout!r}")
    if out is not None:
        _tensor("out", out, q.dtype, tuple(q.shape), q.device)
    if lse is not None:
        _tensor("lse", lse, torch.float32, tuple(q.shape[:-1]), q.device)
    if q.device.type != "cuda":
        raise ValueError(f"q must be a CUDA tensor to run the kernel, got device {q.device}")
    arch = arch_of_device(q.device)
    if layout is not None and layout != arch.layout:
        raise ValueError(f"layout: the cache is packed for {layout!r} but this {arch.name} device reads {arch.layout!r} "
                         f"(quantize with layout={arch.layout!r})")
    arch.can_implement(scheme, page_size)  # a variant the kernel cannot build fails here, before compiling
    if num_splits is None:
        num_splits = plan_splits(q.shape[0], k_codes.shape[1], page_table.shape[1] * page_size, sm_count(q.device))
    num_splits = int(num_splits)
    tokens = q.shape[1] if q.dim() == 4 else 1
    step = arch.max_query_tokens(scheme)[0]
    if tokens <= step:
        out, lse = arch.run_decode(q, k_codes, k_params, v_codes, v_params, page_table, lengths, sm_scale, scheme,
                                   num_splits, out, lse)
        return (out, lse) if return_lse else out
    for launch_tokens in {step, tokens % step} - {0}:  # compile first: a failed call leaves out and lse unwritten
        arch.compile_decode(scheme, page_size, num_splits > 1, launch_tokens,
                            **arch.launch_options_for(scheme, q, k_codes, page_table, num_splits, launch_tokens))
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device) if lse is None else lse
    for first, last, later in launches(tokens, step):
        o_part, lse_part = arch.run_decode(q[:, first:last].contiguous(), k_codes, k_params, v_codes, v_params,
                                           page_table, lengths - later, sm_scale, scheme, num_splits)
        out[:, first:last] = o_part
        lse[:, first:last] = lse_part
    return (out, lse) if return_lse else out


def decode(q, cache: QuantizedKV, sm_scale: float | None = None, return_lse: bool = False, num_splits: int | None = None,
           out=None, lse=None):
    """Decode attention of ``q [batch, kv_heads*gqa_ratio, head_dim]`` (or ``[batch, tokens, ...]``: the
    cache's last ``tokens`` tokens, causal; :func:`decode_paged`) over ``cache``."""
    if not isinstance(cache, QuantizedKV):
        raise TypeError(f"cache must be a foscar.QuantizedKV, got {type(cache).__name__}")
    return decode_paged(q, cache.k_codes, cache.k_params, cache.v_codes, cache.v_params, cache.page_table, cache.lengths,
                        cache.scheme, cache.page_size, sm_scale, return_lse, num_splits, out=out, lse=lse,
                        layout=cache.layout)


def compile_decode(scheme: Scheme, arch: str, page_size: int = 128, split: bool = True, tokens: int = 1):
    """Compile the decode kernel of ``scheme`` for ``arch`` ("sm_90a" or "sm_100a") without a GPU.

    Returns ``foscar.inspect.Artifacts``: PTX, cubin, SASS (via nvdisasm), registers, spills and
    the instruction mix. ``split`` selects the kernel that writes split-KV partials; ``tokens`` the
    query tokens per sequence of one launch (:func:`decode_paged`). A variant the arch's kernel cannot
    build raises a ValueError naming the field (``Arch.can_implement``, ``q`` for ``tokens``).
    """
    from .inspect import artifacts

    target = get_arch(arch)
    if not isinstance(scheme, Scheme):
        raise TypeError(f"scheme must be a foscar.Scheme, got {type(scheme).__name__}")
    return artifacts(target.compile_decode(scheme, check_page_size(scheme, page_size), split, tokens))


class _CallableModule(types.ModuleType):
    """This module, callable: ``foscar.decode`` names both the module and its main function, and
    ``foscar.decode(q, cache)`` should call the function rather than fail with "'module' object is
    not callable"."""

    def __call__(self, *args, **kwargs):
        """:func:`decode`."""
        return decode(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
