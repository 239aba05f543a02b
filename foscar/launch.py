"""The host side of the decode launches, one path for every arch: compile (cached; no GPU needed) and run
on torch CUDA tensors.

An arch's decode kernels are a :class:`KernelSet` subclass in its ``decode`` module
(``foscar.hopper.decode``, ``foscar.blackwell.decode``) that says only what differs: its kernel classes
and their configs (the kernels' limits and entries: ``foscar.decode_kernel``), its compile options (Hopper:
``consumers``, ``ctas_per_sm``) and whether its cache-decode launch attends the 16-bit sink + window itself. This
module builds the argument lists of both arches' entries (:func:`decode_args`, :data:`CACHE_ARGS`: stand-ins to
compile against and pointers to launch with, from :data:`POINTERS` and :data:`SCALARS`), keys the compile cache,
allocates the outputs and partials, and runs the helper launches around the arch's: the split combine
(``foscar.kernels.combine``) and the sink + window kernel (``foscar.kernels.sink_window``).

The compiled kernels take raw pointers, a few runtime int32 extents (batch, kv_heads, max_pages,
num_splits, ...) and the fp32 sm_scale, so one compilation serves every batch size, sequence length, page
count and split count. Compile keys: ``(f"{name}_decode", scheme, page_size, partial_output, *options,
arch)`` and ``(f"{name}_cache_decode", scheme, page_size, *options, arch)``, then ``tokens`` where > 1.

``partial_output`` selects the decode's output: False writes ``o`` (q's dtype, ``[B, Hq, D]``) and ``lse``
(fp32 ``[B, Hq]``, natural log); True writes normalized fp32 partials ``o [B, Hq, S, D]`` and ``lse [B, Hq,
S]`` for the combine kernel (an empty split has ``lse = -inf`` and ``o = 0``). With ``tokens`` query tokens
per sequence (``q [B, tokens, Hq, D]``, the last ``tokens`` tokens of each sequence, causal:
``foscar.query_rows``) every ``Hq`` above is ``tokens x Hq``.
"""

from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import torch
from cutlass import Float16, Float32, Int32, Int64

from .inspect import compile_for
from .jit import cached_compile, fake_ptr, half_type, launch, sm_count
from .kernels.combine import combine_splits
from .kernels.quantize import granule_of
from .kernels.sink_window import check_sink_window, sink_window_attend, sink_window_kernel, window_ctas
from .query_rows import MAX_QUERY_COLUMNS
from .scheme import Scheme
from .split_merge import counter_words
from .work_list import MAX_BUDGET, MAX_SPLITS, grid_ctas, wave_budget

__all__ = ["KernelSet", "POINTERS", "SCALARS", "CACHE_ARGS", "decode_args", "sm_waves", "cache_capacity"]

# The launches' arguments by name. A pointer's element type (None: q's 16-bit type):
POINTERS = {"q": None, "k_codes": Int32, "k_params": Float16, "v_codes": Int32, "v_params": Float16,
            "page_table": Int32, "lengths": Int32, "seq_rows": Int64, "seq_lengths": Int64, "k_win": None,
            "v_win": None, "o_part": Float32, "lse_part": Float32, "out": None, "lse": Float32, "counters": Int32}
# A scalar's type (``parts``: partials per query row, the window kernel's after the splits'):
SCALARS = {"batch": Int32, "kv_heads": Int32, "max_pages": Int32, "budget": Int32, "num_splits": Int32,
           "parts": Int32, "sink": Int32, "ring": Int32, "window": Int32, "sm_scale": Float32}


# The cache decode's arguments (both arches': ``foscar.decode_kernel.CacheDecodeBase``), in order; the stream follows.
CACHE_ARGS = ("q", "k_codes", "k_params", "v_codes", "v_params", "page_table", "seq_rows", "seq_lengths", "k_win",
              "v_win", "o_part", "lse_part", "out", "lse", "counters", "batch", "kv_heads", "max_pages", "budget",
              "num_splits", "parts", "sink", "ring", "window", "sm_scale")


def sm_waves(device: torch.device, ctas: int) -> float:
    """How many waves ``ctas`` CTAs make on ``device``'s SMs at one CTA per SM (0.0 off a GPU): what
    ``KernelSet.launch_options`` is told of a launch's size."""
    return ctas / sm_count(device) if device.type == "cuda" else 0.0


def decode_args(partial_output: bool) -> tuple[str, ...]:
    """The decode kernel's arguments (both arches': ``foscar.decode_kernel.DecodeKernelBase``), in order; the
    stream follows."""
    outputs = ("o_part", "lse_part") if partial_output else ("out", "lse")
    return ("q", "k_codes", "k_params", "v_codes", "v_params", "page_table", "lengths", *outputs, "batch",
            "kv_heads", "max_pages", "num_splits", "sm_scale")


def _stand_ins(names, q_type) -> tuple:
    """What a kernel taking ``names`` compiles against (no GPU, no tensor)."""
    return (*(fake_ptr(POINTERS[n] or q_type) if n in POINTERS else SCALARS[n](1) for n in names),
            cuda.CUstream(0))


def _launch_args(names, q_type, values: dict) -> tuple:
    """``values`` (tensors and numbers by name) as the arguments :func:`foscar.jit.launch` takes for a kernel taking
    ``names``."""
    return tuple((values[n], POINTERS[n] or q_type) if n in POINTERS else (values[n], SCALARS[n]) for n in names)


class KernelSet:
    """An arch's decode kernels (see the module docstring). A subclass sets the class attributes and the
    configs; ``options`` are its keyword compile options, resolved to a tuple that is part of the compile
    key and goes to the configs after their fixed arguments. :meth:`can_implement` states the kernels' limits
    before anything compiles, as the CUTLASS examples' kernel classes do."""

    name: str  # the compile keys' prefix: "hopper"
    arch: str  # the compile target its kernels are written for
    decode_kernel: type  # a foscar.decode_kernel.DecodeKernelBase, built from config(); its limits are the set's
    cache_kernel: type  # built from cache_config()

    def can_implement(self, scheme: Scheme, page_size: int) -> None:
        """Return if the decode kernels build ``scheme`` at ``page_size``; else raise a ValueError naming the
        field (TypeError for a non-Scheme; ``foscar.formats.Unsupported`` for a format the arch's MMA cannot
        take): the kernel class's limits (``DecodeKernelBase.can_implement``), then its config (the checks that
        need its geometry, built once per variant). Compiles nothing."""
        self.decode_kernel.can_implement(scheme, page_size)
        try:
            self._config_builds(scheme, page_size)
        except (NotImplementedError, ValueError) as err:
            raise ValueError(
                f"{scheme.name} at page_size={page_size}: the {self.arch} kernel cannot build it ({err}); change "
                "Scheme.k / Scheme.v (bits, group), Scheme.head_dim, Scheme.gqa_ratio or page_size"
            ) from err

    @functools.lru_cache(maxsize=1024)
    def _config_builds(self, scheme: Scheme, page_size: int) -> bool:
        """Build the split-output decode config once per (scheme, page size): ``can_implement`` runs on every
        decode call, and a config costs ~25 us of Python (a refusal raises and is not cached)."""
        self.config(scheme, page_size, True, 1, *self.options(scheme, 1))
        return True

    def options(self, scheme: Scheme, tokens: int) -> tuple:
        """The compile options for ``tokens`` query tokens per sequence, from the keyword options a caller
        gives (none here; a TypeError names an unknown one)."""
        return ()

    def launch_options(self, scheme: Scheme, tokens: int, capacity: int, num_splits: int, waves: float = 0.0) -> dict:
        """The keyword options :meth:`run_decode` compiles with where its caller gives none (or None), for a launch of
        ``num_splits`` splits over page-table rows of ``capacity`` tokens that makes ``waves`` waves of CTAs at one CTA
        per SM (:func:`sm_waves`; 0: not known) (none here)."""
        return {}

    def cache_launch_options(self, scheme: Scheme, page_size: int, tokens: int, capacity: int, pairs: int,
                             budget: int) -> dict:
        """The keyword options :meth:`run_cache_decode` compiles with where its caller gives none, for ``pairs``
        (sequence, KV head) pairs of sequences holding about ``capacity`` packed tokens at most (:func:`cache_capacity`;
        0: not known), over a work list of ``budget`` CTAs, one wave at one CTA per SM (none here)."""
        return {}

    def ctas_per_sm(self, opts: tuple) -> int:
        """The CTAs per SM a kernel built with the resolved options ``opts`` (:meth:`options`) runs (here 1)."""
        return 1

    def cache_launch(self, scheme: Scheme, page_size: int, tokens: int, capacity: int, pairs: int, budget: int,
                     options: dict, packed_mean: int = 0) -> tuple[tuple, int]:
        """A cache decode launch's resolved options (``options``, else :meth:`cache_launch_options`) and its work
        list's budget: a wave, ``budget`` (at one CTA per SM) times the CTAs per SM those options run; for one query
        token at one CTA per SM past one wave, the budget that cuts the pairs into whole waves, where the caller
        knows the sequences' mean packed tokens ``packed_mean`` (:func:`~foscar.work_list.wave_budget`; the part
        costs of the two-CTA config and of several query tokens are not measured)."""
        opts = self.options(scheme, tokens, **(options or self.cache_launch_options(
            scheme, page_size, tokens, capacity, pairs, budget)))
        ctas = self.ctas_per_sm(opts)
        wave = min(budget * ctas, MAX_BUDGET)
        return opts, wave_budget(wave, pairs, packed_mean) if ctas == 1 and tokens == 1 else wave

    def launch_options_for(self, scheme: Scheme, q, k_codes, page_table, num_splits: int, tokens: int) -> dict:
        """:meth:`launch_options` of a decode launch of ``q`` (its batch) over ``k_codes`` (KV heads, page size) and
        ``page_table`` (capacity) in ``num_splits`` splits: what :meth:`run_decode` compiles and what a caller
        compiling ahead of it asks for (``foscar.decode.decode_paged``)."""
        page_size = k_codes.shape[2] * 64
        return self.launch_options(scheme, tokens, page_table.shape[1] * page_size, num_splits,
                                   sm_waves(q.device, q.shape[0] * k_codes.shape[1] * num_splits))

    def config(self, scheme: Scheme, page_size: int, partial_output: bool, tokens: int, *options):
        """The decode kernel's config for ``tokens`` query tokens per sequence, the last tokens of its packed
        pages (causal); building it runs the checks that need its geometry."""
        raise NotImplementedError

    def cache_config(self, scheme: Scheme, page_size: int, tokens: int, *options):
        raise NotImplementedError

    def fuses_window(self, scheme: Scheme, page_size: int, *options) -> bool:
        """Whether the cache decode attends the sink + window slots in its own launch (its work list's CTAs
        write per-item partials) rather than leaving them to ``foscar.kernels.sink_window``'s launch."""
        return False

    def _compile(self, kernel, names):
        return compile_for(self.arch, kernel, *_stand_ins(names, kernel.cfg.q_dtype))

    def compile_decode(self, scheme: Scheme, page_size: int, partial_output: bool = False, tokens: int = 1,
                       **options):
        """The compiled decode kernel of ``scheme`` for ``tokens`` query tokens per sequence (cached; works
        without a GPU; keeps its PTX and cubin, ``foscar.inspect``)."""
        self.check_launch_tokens(scheme, tokens, "decode")
        opts = self.options(scheme, tokens, **options)
        key = (f"{self.name}_decode", scheme, int(page_size), bool(partial_output), *opts, self.arch)
        key += (int(tokens),) if tokens > 1 else ()
        return cached_compile(key, lambda: self._compile(self.decode_kernel(self.config(
            scheme, page_size, partial_output, tokens, *opts)), decode_args(partial_output)))

    def run_decode(self, q, k_codes, k_params, v_codes, v_params, page_table, lengths, sm_scale, scheme: Scheme,
                   num_splits: int = 1, out=None, lse=None, **options):
        """Launch on validated CUDA tensors (``foscar.decode.decode_paged`` validates); returns ``(out,
        lse)``, written in place when given (q's dtype and shape, ``[B, Hq, D]`` or ``[B, tokens, Hq, D]``;
        fp32 of q's shape but the last dim: a caller can poison them, or keep them static for CUDA graphs).
        ``options``: the arch's compile options (default: :meth:`launch_options`). With ``num_splits > 1`` the
        kernel writes fp32 partials that ``foscar.kernels.combine`` merges into them."""
        tokens = q.shape[1] if q.dim() == 4 else 1
        batch, d = q.shape[0], q.shape[-1]
        rows = tokens * q.shape[-2]  # query rows per sequence, token-major (foscar.query_rows)
        partial = num_splits > 1
        page_size = k_codes.shape[2] * 64
        options = {k: v for k, v in options.items() if v is not None}
        options = options or self.launch_options_for(scheme, q, k_codes, page_table, num_splits, tokens)
        compiled = self.compile_decode(scheme, page_size, partial, tokens, **options)
        out = torch.empty_like(q) if out is None else out
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device) if lse is None else lse
        o_part = torch.empty(batch, rows, num_splits, d, dtype=torch.float32, device=q.device) if partial else None
        lse_part = torch.empty(batch, rows, num_splits, dtype=torch.float32, device=q.device) if partial else None
        values = dict(q=q, k_codes=k_codes, k_params=k_params, v_codes=v_codes, v_params=v_params,
                      page_table=page_table, lengths=lengths, out=out, lse=lse, o_part=o_part, lse_part=lse_part,
                      batch=batch, kv_heads=k_codes.shape[1], max_pages=page_table.shape[1], num_splits=num_splits,
                      sm_scale=float(sm_scale))
        launch(compiled, *_launch_args(decode_args(partial), half_type(q.dtype), values))
        if partial:
            combine_splits(o_part, lse_part, out.view(batch, rows, d), lse.view(batch, rows))
        return out, lse

    def max_query_tokens(self, scheme: Scheme) -> tuple[int, str]:
        """The most query tokens per sequence one decode launch takes, and why no more: ``gqa_ratio x
        tokens`` query columns fit one query tile (``foscar.query_rows``)."""
        return MAX_QUERY_COLUMNS // scheme.gqa_ratio, (f"a query tile holds {MAX_QUERY_COLUMNS} columns per KV "
                                                       f"head: gqa_ratio={scheme.gqa_ratio} x tokens")

    def check_launch_tokens(self, scheme: Scheme, tokens: int, what: str, more: str = "") -> None:
        """A ValueError naming ``q`` if one ``what`` launch cannot take ``tokens`` query tokens per sequence;
        ``more``: where more go."""
        limit, why = self.max_query_tokens(scheme)
        if type(tokens) is not int or not 1 <= tokens <= limit:
            raise ValueError(f"q: {tokens!r} query tokens per sequence: the {self.arch} {what} takes 1..{limit} "
                             f"({why}{'; ' + more if more else ''})")

    def compile_cache_decode(self, scheme: Scheme, page_size: int, tokens: int = 1, **options):
        """The compiled decode launch of ``foscar.cache.PagedKVCache`` for ``tokens`` query tokens per
        sequence (cached; works without a GPU): it reads the cache's tensors in place."""
        return self._cache_decode(scheme, page_size, tokens, self.options(scheme, tokens, **options))

    def _cache_decode(self, scheme, page_size, tokens, opts):
        self.check_launch_tokens(scheme, tokens, "cache decode")
        key = (f"{self.name}_cache_decode", scheme, int(page_size), *opts, self.arch)
        key += (int(tokens),) if tokens > 1 else ()
        return cached_compile(key, lambda: self._compile(self.cache_kernel(self.cache_config(
            scheme, page_size, tokens, *opts)), CACHE_ARGS))

    def cache_partials(self, scheme: Scheme, page_size: int, batch: int, kv_heads: int, num_splits: int,
                       budget: int, slots: int, tokens: int = 1, capacity: int = 0, packed_mean: int = 0,
                       **options) -> tuple[int, ...]:
        """The shape of the fp32 ``o`` partials :meth:`run_cache_decode` allocates (``lse``'s: all but the
        last dim): one launch, one ``[R, D]`` per work item (``foscar.work_list``: at most ``budget + batch *
        kv_heads``, the work list's budget: :meth:`cache_launch`; R = gqa x tokens); two, ``[batch, Hq, parts,
        D]``, the window kernel's partials after the splits'. ``capacity``: as :meth:`run_cache_decode` derives
        it from the cache's tensors (:func:`cache_capacity`; 0: not known); ``packed_mean``: as given to it."""
        opts, budget = self.cache_launch(scheme, page_size, tokens, capacity, batch * kv_heads, budget, options,
                                         packed_mean)
        return self._partials(scheme, page_size, batch, kv_heads, num_splits, budget, slots, tokens, opts)

    def _partials(self, scheme, page_size, batch, kv_heads, num_splits, budget, slots, tokens, opts):
        r, d = scheme.gqa_ratio * tokens, scheme.head_dim
        if self.fuses_window(scheme, page_size, *opts):
            return (grid_ctas(budget, batch, kv_heads), r, d)
        return (batch, kv_heads * r, num_splits + window_ctas(slots), d)

    def run_cache_decode(self, q, k_codes, k_params, v_codes, v_params, page_table, k_win, v_win, seq_rows,
                         seq_lengths, counters, sink: int, window: int, sm_scale: float, scheme: Scheme,
                         num_splits: int, budget: int, packed_mean: int = 0, **options):
        """Decode on a cache layer's tensors (``PagedKVCache.attend`` validates them): ``q [B, Hq, D]``, or
        ``q [B, tokens, Hq, D]`` for several query tokens per sequence (the sequence's last tokens: causal),
        packed pages in the arch's word order, ``page_table [max_seqs, max_pages]``, 16-bit ``k_win, v_win
        [max_seqs, kv_heads, sink + ring, D]``, ``seq_rows`` int64 [B], ``seq_lengths`` int64 [max_seqs],
        ``counters`` int32 (>= ``split_merge.counter_words(B * kv_heads, MAX_SPLITS)``, zero; left zero). One
        launch whose work list fills :meth:`cache_launch`'s budget (a wave of ``budget`` CTAs at one CTA per SM,
        or more; ``packed_mean``: the sequences' mean packed tokens where the caller knows them, else 0) where
        :meth:`fuses_window`, else ``num_splits`` splits per sequence then the window kernel.
        Returns ``(out, lse)``: q's dtype and shape, fp32 ``lse`` of q's shape less head_dim."""
        batch, tokens, d = q.shape[0], q.shape[1] if q.dim() == 4 else 1, q.shape[-1]
        kv_heads, slots = k_win.shape[1], k_win.shape[2]
        page_size = k_codes.shape[2] * 64
        _check_cache_launch(num_splits, counters, batch * kv_heads, budget)  # before anything compiles or launches
        opts, budget = self.cache_launch(scheme, page_size, tokens, cache_capacity(k_codes, page_table, batch),
                                         batch * kv_heads, budget, options, packed_mean)
        one_launch = self.fuses_window(scheme, page_size, *opts)
        if not one_launch:
            check_sink_window(d, scheme.gqa_ratio * tokens, slots)
            sink_window_kernel(q, kv_heads, self.arch)  # compiled before the first launch counts the counters
        compiled = self._cache_decode(scheme, page_size, tokens, opts)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        shape = self._partials(scheme, page_size, batch, kv_heads, num_splits, budget, slots, tokens, opts)
        o_part = torch.empty(shape, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(shape[:-1], dtype=torch.float32, device=q.device)
        values = dict(q=q, k_codes=k_codes, k_params=k_params, v_codes=v_codes, v_params=v_params,
                      page_table=page_table, seq_rows=seq_rows, seq_lengths=seq_lengths, k_win=k_win, v_win=v_win,
                      o_part=o_part, lse_part=lse_part, out=out, lse=lse, counters=counters, batch=batch,
                      kv_heads=kv_heads, max_pages=page_table.shape[1], budget=budget, num_splits=num_splits,
                      parts=0 if one_launch else shape[2], sink=sink, ring=slots - sink, window=window,
                      sm_scale=float(sm_scale))
        launch(compiled, *_launch_args(CACHE_ARGS, half_type(q.dtype), values))
        if not one_launch:
            sink_window_attend(q, k_win, v_win, seq_rows, seq_lengths, o_part, lse_part, out, lse, counters,
                               num_splits, sink, window, granule_of(scheme), sm_scale, self.arch)
        return out, lse


def cache_capacity(k_codes, page_table, batch: int) -> int:
    """A bound on the packed tokens of a cache decode's sequences, from the cache's tensors: the least of a page-table
    row's (every sequence's bound) and the page pool's (``k_codes``' first dim) over ``batch`` (the batch's mean
    bound: each of ``PagedKVCache``'s pages belongs to one sequence)."""
    return min(page_table.shape[1], k_codes.shape[0] // batch) * k_codes.shape[2] * 64


def _check_cache_launch(num_splits: int, counters, heads: int, budget: int):
    """A cache decode's launch values (raises a ValueError naming the argument): ``num_splits``, the
    CTA ``budget`` of a work list (``foscar.work_list``) and the completion ``counters`` (int32: one
    per (sequence, KV head), ``heads`` of them, then the merge's group counters: ``split_merge.counter_words``)."""
    if heads < 1:
        raise ValueError(f"batch must hold at least one sequence (batch * kv_heads = {heads})")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if type(budget) is not int or not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget must be an int in [1, {MAX_BUDGET}] (CTAs of a wave: PagedKVCache.cta_budget), "
                         f"got {budget!r}")
    need = counter_words(heads, MAX_SPLITS)
    if counters.dtype != torch.int32 or counters.numel() < need:
        raise ValueError(f"counters: need int32 with >= {need} elements (split_merge.counter_words of batch * "
                         f"kv_heads = {heads}), got {counters.dtype} with {counters.numel()}")
