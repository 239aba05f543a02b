"""A paged, quantized KV cache for many sequences: BF16 attention sink + BF16 recent window + packed pages.

Token ``t`` of a sequence of ``n`` tokens lives in one of three parts (OSCAR/KIVI convention)::

    [0, S)               sink:       BF16, kept forever (the attention-sink tokens)
    [S, S + Q)           quantized:  packed codes + fp16 (scale, offset), in pages of ``page_size``
    [S + Q, n)           recent:     BF16 ring buffer, W .. W + T - 1 tokens once n >= S + W

``S`` = ``sink``, ``W`` = ``window``, ``T`` = the *granule* (``foscar.kernels.quantize.granule_of``:
64 tokens, or the longest channel-wise group). ``Q(n) = T * max(0, (n - S - W) // T)`` depends on
``n`` only: whenever the recent part reaches ``W + T`` tokens its oldest granule is quantized as one
block, so every channel-wise group is complete when quantized (KIVI keeps a partial group in full
precision for the same reason) and every packed word is written once, never read-modify-written.

Why a ring: attention is order-invariant, so the recent part can sit in a fixed ``W + T``-slot ring
(slot ``(t - S) % (W + T)``); an append writes one slot and a flush reads ``T`` slots, with no
shifting. Requires ``W % T == 0`` so a granule is contiguous in the ring (``rollback`` adds whole granules
to the ring: :class:`PagedKVCache`).

Layout (all layers in one object; a layer is an index): packed pages
``k_codes [layers, num_pages + 1, kv_heads, page_size // 64, tile_words]`` and params as in
``foscar/quantize.py``, with one extra *trash page* (index ``num_pages``) that unused page-table
entries point at, so every page index a kernel may read is valid. BF16 parts
``k_bf16 [layers, max_seqs, kv_heads, S + W + T, D]``. Pages are shared by all layers: a sequence
owns a list of page indices, used at the same index in every layer's pool.

Decode (:meth:`PagedKVCache.attend`) is one launch on Hopper (two for head_dim 256 with channel-wise K groups
of 256 tokens, whose window tiles do not fit the ring: ``foscar.hopper.cache_decode.fuses_window``) and no torch op
but the optional rotation of q (``Arch.run_cache_decode``): the FOSCAR kernel over the quantized pages and the
16-bit sink + window slots, reading this cache's page table, lengths and 16-bit slots in place, the slots as
16-slot tiles of the same ring (each read once per KV head), each sequence cut into parts by its length on the
device (``foscar.work_list``: a long sequence among short ones gets more CTAs, no host sync), the parts merged
by log-sum-exp in the same launch (``foscar.hopper.cache_decode``; the pages are packed in the bit order of the
cache's arch, ``foscar.archs``; the GPU path -- append kernel and cache decode -- runs on Hopper, and a cache
whose arch lacks it says so when built). Blackwell's (compile-verified) is the same one launch, planned alike
(``foscar.blackwell.cache_decode``). Append (:meth:`append`) of one
token per sequence and ``attend`` are CUDA-graph capturable: device-side index math only, the flush runs every
step as a quantize launch whose granules are skipped (page ``-1``) unless due, and no host sync or page
allocation happens inside. Pages must then be reserved up front (:meth:`reserve`); temporaries come from the
capturing graph's private memory pool.

On CPU tensors (CI) the same logic runs in torch (``use_kernels=False``): the torch quantizer
(``foscar.quantize``) and an fp32 attention over the dequantized pages and the BF16 slots, one softmax over
both. Only this path keeps fp32 copies of what it attends, written with what they copy, so that a decode
step neither unpacks pages nor converts slots: each quantized token's dequantized value (what
``QuantizedKV.dequantize`` gives, written when its granule is quantized) and each 16-bit slot. They cost 4
bytes per element (the pool's codes take 1/4 or 1/2) and are not counted by :meth:`PagedKVCache.nbytes`.

Several new tokens per sequence (chunked prefill, a new turn, draft tokens to verify): :meth:`attend_chunk`
attends them over the cached tokens and, causally, over their own 16-bit K/V, before they are appended (on a
kernel cache the prefix block by block, ``foscar.chunk_attention``; torch code on the torch path). A few of them,
appended first, :meth:`attend` takes itself (``q [B, tokens, Hq, D]``: speculative verification, in the decode
kernel, up to :meth:`max_query_tokens`). :meth:`truncate` rolls the
last tokens back while the ring still holds, in 16 bits, everything the shorter sequence keeps there
(:meth:`rollback_limit`; the constructor's ``rollback`` keeps it from falling below a draft's length).

Optional Hadamard rotation (QuaRot/OSCAR): K and Q are multiplied per head by the normalized
Sylvester Hadamard matrix ``H`` (orthogonal, so ``(qH)(kH)^T = qk^T``): outliers spread over all
channels, which cuts the 2-bit error. V is not rotated.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from typing import NamedTuple

import torch

from .archs import HOPPER, arch_of_device, get_arch
from .checks import checked_sm_scale, is_int
from .chunk_attention import CUDNN_TOKENS, DECODE_COLUMNS, PREFILL_COLUMNS, PackedPrefill, PackedPrefix, chunk_attention
from .jit import sm_count
from .kernels.dequantize import PagesDequantizer
from .kernels.merge_parts import merge_parts
from .kernels.quantize import granule_of
from .layouts import PACKERS, TILE_TOKENS, TileGeometry
from .quantize import PAGE_SIZES, QuantizedKV, dequantize_groups, quantize_groups, stack_params
from .query_rows import MAX_QUERY_COLUMNS, launches
from .scheme import PARAM_DTYPE, Scheme
from .split_merge import counter_words
from .work_list import CTAS_PER_SM, MAX_SPLITS, WINDOW_MERGE_SPLITS, plan_splits

__all__ = ["PagedKVCache", "PagePoolFull", "hadamard"]

MAX_INDEX = 2**31 - 1  # the kernels hold token positions and page indices in 32-bit ints
BLOCK_BYTES = 128 << 20  # K and V of one block of packed pages attend_chunk dequantizes at a time (a kernel cache)
CHUNK_SCORES = 1 << 24  # fp32 scores one block of attend_chunk's query tokens may hold (64 MiB)
INDEX_CACHE = 4096  # device indexes of batches of seq_ids kept (those of captured graphs always)
FP16_MAX = torch.finfo(torch.float16).max  # the largest value a group's fp16 scale and offset hold


class _AttendPlan(NamedTuple):
    """What a torch-path attend of a batch at given lengths reads (the same in every layer)."""

    quantized: slice | torch.Tensor  # the quantized part's tokens in a layer's fp32 pages: a slice, or an index
    width: int  # quantized-part tokens per sequence (whole pages)
    rows: slice | torch.Tensor  # the sequences' rows of the 16-bit slots
    bias: torch.Tensor  # [B, 1, 1, width + S + ring]: 0 at a token the sequence holds, -inf elsewhere
    maybe_empty: bool  # whether a sequence may hold no token at all


class PagePoolFull(RuntimeError):
    """The page pool (or the sequence slots) cannot hold what was asked; the cache is unchanged."""


def hadamard(dim: int, device=None) -> torch.Tensor:
    """The normalized ``dim x dim`` Sylvester Hadamard matrix (fp32, symmetric, orthogonal)."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"dim must be a power of two, got {dim}")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(dim)).to(device)


def _device_memory(device: torch.device) -> int | None:
    """Bytes of memory on ``device`` (a CUDA GPU's, or the host's RAM for the CPU), where known."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    return None


def _check_fits(parts: dict[str, int], device: torch.device) -> None:
    """A ValueError naming the arguments and sizes if ``parts`` (bytes) exceed ``device``'s memory."""
    memory = _device_memory(device)
    total = sum(parts.values())
    if memory is not None and total > memory:
        listed = ", ".join(f"{part} {_gib(n)}" for part, n in sorted(parts.items(), key=lambda item: -item[1]))
        raise ValueError(f"PagedKVCache: the sizes asked for need {_gib(total)} ({listed}), more than the "
                         f"{_gib(memory)} of {device}; lower the arguments of the largest part")


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def block_pages(kv_heads: int, page_size: int, head_dim: int, dtype) -> int:
    """Pages of one block of ``PagedKVCache.attend_chunk``'s prefix (K and V in ``dtype``): at most ``BLOCK_BYTES``,
    rounded down to a multiple of ``CUDNN_TOKENS`` tokens where it holds that many (full blocks are then shapes
    cuDNN plans once, ``foscar.chunk_attention``); at least one page."""
    per_block = max(1, BLOCK_BYTES // (2 * kv_heads * page_size * head_dim * torch.finfo(dtype).bits // 8))
    unit = CUDNN_TOKENS // page_size
    return per_block // unit * unit if per_block >= unit else per_block


class PagedKVCache:
    """Paged KV cache of ``num_layers`` layers for up to ``max_seqs`` sequences (module docstring).

    ``scheme``: the quantization variant (its ``q_dtype`` is the K/V/Q dtype, its ``gqa_ratio`` the
    query heads per KV head). ``num_pages``: pages in the pool, each ``page_size`` quantized tokens
    of every layer. ``max_seq_len``: the longest sequence (sizes the page table). ``sink``,
    ``window``: BF16 parts (OSCAR: 64 and 256). ``rotate``: Hadamard-rotate K and Q.
    ``device``: default CUDA where torch has a GPU, else the CPU (the torch path below).
    ``use_kernels``: quantize and attend with the CuTe DSL kernels (default: on CUDA devices).
    ``arch``: the arch whose decode kernel reads the pages ("sm_90a", "sm_100a"; ``foscar.archs``): it
    sets their bit order and, with ``use_kernels``, the limits the scheme is checked against at
    construction. Default: the CUDA device's, "sm_90a" on other devices (and, with ``use_kernels=False``, on
    a GPU the kernels do not run on).

    ``rollback``: the tokens :meth:`truncate` can always remove (speculative decoding's rejected drafts, appended
    before :meth:`attend` verifies them): the ring keeps ``ceil((rollback - 1) / granule)`` granules more 16-bit
    slots, so :meth:`rollback_limit` never falls below it (default 0: it may fall to 1 right after a granule
    is quantized).

    ``cta_budget`` (attribute, default the SM count x ``foscar.work_list.CTAS_PER_SM``): the CTAs of one wave
    of the decode launch, which its work list spreads a batch over (``foscar.work_list``); within a wave, lower it
    to cut sequences into fewer parts. Past one wave (more (sequence, KV head) pairs than it) the launch may run
    two CTAs per SM with twice the budget (many short sequences on Hopper) or cut pairs into parts over whole waves
    of it (``KernelSet.cache_launch``), so a budget below the pair count changes the plan that way too.
    ``num_splits(batch)``: the split count of the launches without a work list (Hopper's two-launch variants), from
    capacities.
    """

    def __init__(self, scheme: Scheme, num_layers: int, kv_heads: int, num_pages: int, max_seqs: int, max_seq_len: int,
                 page_size: int | None = None, sink: int = 64, window: int = 256, rotate: bool = False,
                 device=None, use_kernels: bool | None = None, arch: str | None = None, rollback: int = 0):
        if not isinstance(scheme, Scheme):
            raise TypeError(f"scheme must be a foscar.Scheme, got {type(scheme).__name__}")
        self.scheme = scheme
        self.granule = granule = granule_of(scheme)
        page_size = max(128, granule) if page_size is None else page_size
        if not is_int(page_size) or page_size not in PAGE_SIZES or page_size % granule:
            raise ValueError(f"page_size must be one of {PAGE_SIZES} and a multiple of the granule {granule}, got {page_size!r}")
        sizes = (("num_layers", num_layers, 1), ("kv_heads", kv_heads, 1), ("num_pages", num_pages, 1),
                 ("max_seqs", max_seqs, 1), ("max_seq_len", max_seq_len, 1), ("sink", sink, 0), ("window", window, 0),
                 ("rollback", rollback, 0))
        for name, value, low in sizes:
            if not is_int(value) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        # plain ints from here (numpy ints are taken too): they size tensors and key compiled kernels
        page_size = int(page_size)
        num_layers, kv_heads, num_pages, max_seqs, max_seq_len, sink, window, rollback = (int(v) for _, v, _ in sizes)
        if max_seq_len > MAX_INDEX:
            raise ValueError(f"max_seq_len={max_seq_len}: the kernels hold token positions in 32-bit ints, so "
                             f"max_seq_len is at most {MAX_INDEX}")
        if num_pages >= MAX_INDEX:  # page indices 0 .. num_pages (the trash page)
            raise ValueError(f"num_pages={num_pages}: the page table holds 32-bit page indices, so num_pages is at "
                             f"most {MAX_INDEX - 1}")
        if window % granule:
            raise ValueError(f"window must be a multiple of the granule {granule} (scheme {scheme.name}), got {window}")
        if not isinstance(rotate, bool):
            raise TypeError(f"rotate must be a bool, got {rotate!r}")
        if use_kernels is not None and not isinstance(use_kernels, bool):
            raise TypeError(f"use_kernels must be a bool or None, got {use_kernels!r}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"device must name a torch device ('cuda', 'cuda:1', 'cpu'), got {device!r}") from err
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: torch sees no CUDA GPU here; use device='cpu' (the torch path "
                             "of this cache, no kernels) or run on a GPU machine")
        if self.device.type == "cuda" and self.device.index is None:  # tensors report cuda:N
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.use_kernels = self.device.type == "cuda" if use_kernels is None else use_kernels
        if self.use_kernels and self.device.type != "cuda":
            raise ValueError("use_kernels=True needs a CUDA device")
        if arch is not None:
            self.arch = get_arch(arch)
        elif self.device.type != "cuda":
            self.arch = HOPPER
        else:
            try:
                self.arch = arch_of_device(self.device)
            except NotImplementedError:  # a GPU the kernels do not run on (the error names it)
                if self.use_kernels:
                    raise
                self.arch = HOPPER  # the torch path reads any bit order
        if self.use_kernels:
            if not self.arch.cache_decode:
                raise ValueError(f"use_kernels: the cache's GPU decode (the 16-bit window in place) is not built for "
                                 f"{self.arch.name}; use use_kernels=False")
            device_arch = arch_of_device(self.device)
            if device_arch is not self.arch:
                raise ValueError(f"arch={self.arch.name}: the kernels cannot run on {self.device} "
                                 f"({device_arch.name}); leave arch unset or use use_kernels=False")
        # recent-part slots: the window and a granule, and whole granules more so that a truncate of `rollback`
        # tokens always finds the 16-bit values of a granule quantized in between (rollback_limit)
        ring = window + granule + granule * -(-max(rollback - 1, 0) // granule)
        if self.use_kernels:  # fail now, naming the field, not at the first attend
            self.arch.check_cache(scheme, page_size, sink + ring,
                                  f"sink + window + granule{' + rollback margin' if ring > window + granule else ''} "
                                  f"({sink} + {ring})")
        self.num_layers, self.kv_heads, self.num_pages, self.max_seqs = num_layers, kv_heads, num_pages, max_seqs
        self.page_size, self.sink, self.window, self.max_seq_len = page_size, sink, window, max_seq_len
        self.rollback = rollback
        self.ring = ring
        self.max_pages = max(1, -(-self.quantized_tokens(max_seq_len) // page_size))
        self.trash_page = num_pages
        _check_fits(self._planned_bytes(), self.device)  # before allocating: a clear error, not the allocator's
        d, dtype, dev = scheme.head_dim, scheme.q_dtype, self.device
        pool = num_pages + 1
        self.k_codes, self.k_params = self._pool("k", scheme.k, pool)
        self.v_codes, self.v_params = self._pool("v", scheme.v, pool)
        bf16_shape = (num_layers, max_seqs, kv_heads, sink + self.ring, d)
        self.k_bf16 = torch.zeros(bf16_shape, dtype=dtype, device=dev)
        self.v_bf16 = torch.zeros(bf16_shape, dtype=dtype, device=dev)
        # torch path: fp32 copies of what attend reads (module docstring): the dequantized pages
        # ([layers, kv_heads, pool * page_size, D]: a page's tokens contiguous per head) and the 16-bit slots
        fp32 = lambda *shape: {role: torch.zeros(shape, dtype=torch.float32, device=dev) for role in "kv"}  # noqa: E731
        self._dequantized = None if self.use_kernels else fp32(num_layers, kv_heads, pool * page_size, d)
        self._slots_fp32 = None if self.use_kernels else fp32(*bf16_shape)
        self._dequantizers = {}  # (layer, role, dtype): a PagesDequantizer of attend_chunk's blocks
        self._prefix_schemes = {}  # step: _packed_prefix's scheme of gqa x step query heads, None where not built
        # rows padded to 16 bytes: a layer's row is handed to the decode launch, whose pointers are 16-byte aligned
        self.lengths = torch.zeros(num_layers, max_seqs + max_seqs % 2, dtype=torch.int64, device=dev)[:, :max_seqs]
        self.page_table = torch.full((max_seqs, self.max_pages), self.trash_page, dtype=torch.int32, device=dev)
        self.rotation = hadamard(d, dev) if rotate else None
        # host state: the page allocator, and a mirror of ``lengths`` for reservation and validation
        self._free_pages = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives the lowest index
        self._pages: list[list[int] | None] = [None] * max_seqs  # None: slot free
        self._claims = [0] * max_seqs  # how often each slot was allocated: a plan for an earlier claim is stale
        self._host_len = torch.zeros((num_layers, max_seqs), dtype=torch.int64, device="cpu")  # host mirror
        # the longest each sequence was since its last truncate (its ring slots hold the last `ring` tokens of that)
        self._written = torch.zeros((num_layers, max_seqs), dtype=torch.int64)
        # set once an append is captured into a graph: a replay may move ``lengths`` at any time after, bypassing the
        # host, so from then on the mirror is re-read before each use (one small copy)
        self._appends_captured = False
        self._index_cache: dict[tuple, torch.Tensor] = {}  # device index of each batch of seq_ids (insertion order)
        self._captured_ids: set[tuple] = set()  # batches a captured graph reads: their indexes stay
        self._plan: tuple[tuple, _AttendPlan] | None = None  # the last torch-path attend's (key, plan)
        # the attend launch's per-(sequence, KV head) and per-group completion counters (foscar.split_merge):
        # zero between launches, shared by the layers (their launches are ordered on the stream)
        self._counters = torch.zeros(counter_words(max_seqs * kv_heads, MAX_SPLITS), dtype=torch.int32, device=dev)
        self._heads = torch.arange(kv_heads, device=dev)
        self._granule_steps = torch.arange(granule, device=dev)
        self._page_steps = torch.arange(page_size, device=dev)
        self._slots = torch.arange(sink + self.ring, device=dev)  # the 16-bit slots of a sequence
        self._num_sms = sm_count(dev) if dev.type == "cuda" else 1
        self.cta_budget = self._num_sms * CTAS_PER_SM  # one wave of the decode launch (class docstring)
        self._splits: dict[int, int] = {}  # num_splits per batch size

    def _planned_bytes(self) -> dict[str, int]:
        """Bytes of each part the constructor allocates (all layers), by the arguments that size it."""
        layers, heads, d, ps = self.num_layers, self.kv_heads, self.scheme.head_dim, self.page_size
        page = 0  # one page of one layer and KV head: K and V codes and fp16 params
        for role, quant in (("k", self.scheme.k), ("v", self.scheme.v)):
            rows, cols = quant.params_shape(ps, d)
            page += ps // TILE_TOKENS * TileGeometry(role, quant.bits, d).words * 4 + rows * cols * quant.param_fields * 2
        rows = self.max_seqs + self.max_seqs % 2
        return {
            "the page pool (num_pages)": layers * (self.num_pages + 1) * heads * page,
            "the 16-bit sink + window (max_seqs, sink, window)": 2 * layers * self.max_seqs * heads *
                                                                 (self.sink + self.ring) * d * 2,
            "the page table (max_seqs x max_seq_len)": self.max_seqs * self.max_pages * 4,
            "lengths and counters (max_seqs)": layers * rows * 8 + counter_words(self.max_seqs * heads, MAX_SPLITS) * 4,
        }

    def _pool(self, role, quant, pool):
        d, ps = self.scheme.head_dim, self.page_size
        words = TileGeometry(role, quant.bits, d).words
        codes = torch.zeros(self.num_layers, pool, self.kv_heads, ps // TILE_TOKENS, words, dtype=torch.int32,
                            device=self.device)
        params = torch.zeros(self.num_layers, pool, self.kv_heads, *quant.params_shape(ps, d), quant.param_fields,
                             dtype=PARAM_DTYPE, device=self.device)
        return codes, params

    # ------------------------------------------------------------------ sizes and accounting

    def quantized_tokens(self, n: int) -> int:
        """Tokens of a sequence of ``n`` tokens that live in quantized pages."""
        return self.granule * max(0, (n - self.sink - self.window) // self.granule)

    def _quantized_tokens_dev(self, n: torch.Tensor) -> torch.Tensor:
        return torch.div((n - self.sink - self.window).clamp(min=0), self.granule, rounding_mode="floor") * self.granule

    def pages_for(self, n: int) -> int:
        """Pages a sequence of ``n`` tokens needs."""
        return -(-self.quantized_tokens(n) // self.page_size)

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def sequences(self) -> list[int]:
        """Ids of the allocated sequences."""
        return [i for i, pages in enumerate(self._pages) if pages is not None]

    def seq_len(self, seq_id: int, layer: int = 0) -> int:
        """Tokens held by sequence ``seq_id`` in ``layer`` (the host mirror; once an append has been captured into a
        graph, re-read from the device at every call, since a replay may have moved it)."""
        self._check_seq("seq_id", seq_id)
        self._check_layer(layer)
        self._sync_mirror()
        return int(self._host_len[layer, seq_id])

    def seq_lens(self, seq_ids) -> torch.Tensor:
        """Tokens held by each of ``seq_ids`` in every layer: a host int64 tensor ``[num_layers, len(seq_ids)]``
        (the host mirror, as :meth:`seq_len`; one read for a batch)."""
        ids, _ = self._rows(seq_ids)
        self._sync_mirror()
        return self._host_len[:, list(ids)].clone()

    def pages_of(self, seq_id: int) -> list[int]:
        self._check_seq("seq_id", seq_id)
        return list(self._pages[seq_id])

    def nbytes(self) -> dict:
        """Device bytes of each part (all layers): packed pool, BF16 sink + window, page table (the torch
        path's fp32 copies of them are not the cache's format, and not counted)."""
        size = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {"quantized": size(self.k_codes, self.k_params, self.v_codes, self.v_params),
                "bf16": size(self.k_bf16, self.v_bf16), "page_table": size(self.page_table)}

    def bytes_per_page(self) -> int:
        """Bytes of one page over all layers (K and V codes and params)."""
        return sum(t[:, 0].numel() * t.element_size() for t in (self.k_codes, self.k_params, self.v_codes, self.v_params))

    def used_bytes(self) -> int:
        """Bytes the allocated sequences occupy: their pages plus their BF16 slots (all layers)."""
        pages = sum(len(p) for p in self._pages if p is not None)
        slot = self.k_bf16[:, 0].numel() * self.k_bf16.element_size() * 2
        return pages * self.bytes_per_page() + len(self.sequences) * slot

    # ------------------------------------------------------------------ allocation

    def allocate(self, num_tokens: int = 0) -> int:
        """Claim a free sequence slot (and pages for ``num_tokens`` tokens); returns its id."""
        self._no_capture("allocate")
        num_tokens = self._checked_num_tokens(num_tokens)
        try:
            seq_id = self._pages.index(None)
        except ValueError:
            raise PagePoolFull(f"all max_seqs={self.max_seqs} sequence slots are in use; free one first") from None
        need = self.pages_for(num_tokens)
        if need > self.free_pages:
            raise PagePoolFull(f"num_tokens={num_tokens} needs {need} pages, {self.free_pages} of num_pages="
                               f"{self.num_pages} are free")
        self._pages[seq_id] = []
        self._claims[seq_id] += 1
        self._grow(seq_id, need)
        # (free zeroed them; a graph replayed after that, a misuse, may have moved them since)
        self.lengths[:, seq_id] = 0
        self._host_len[:, seq_id] = 0
        self._written[:, seq_id] = 0
        return seq_id

    def allocate_prefilled(self, num_tokens: int) -> int:
        """Claim a sequence that already holds ``num_tokens`` tokens: whatever its pages and BF16
        slots contain now is taken as their contents (every layer). For benchmarks: write random codes
        and params straight into the pools (the real layout and byte counts, without quantizing a
        long prefix first); attention time does not depend on the values. Returns its id."""
        seq_id = self.allocate(num_tokens)
        self._sync_mirror()
        self.lengths[:, seq_id] = num_tokens
        self._host_len[:, seq_id] = num_tokens
        self._copy_to_fp32(seq_id)
        return seq_id

    def _copy_to_fp32(self, seq_id: int) -> None:
        """Torch path: derive the fp32 copies of ``seq_id``'s pages and slots from the pools (all layers)."""
        if self._dequantized is None:
            return
        for role, bf16 in (("k", self.k_bf16), ("v", self.v_bf16)):
            self._slots_fp32[role][:, seq_id] = bf16[:, seq_id].float()
        pages = self._pages[seq_id]
        if not pages:
            return
        table = torch.tensor([pages], dtype=torch.int32).to(self.device)
        lengths = torch.tensor([len(pages) * self.page_size], dtype=torch.int32).to(self.device)
        tokens = (table[0].long()[:, None] * self.page_size + self._page_steps).reshape(-1)
        for layer in range(self.num_layers):
            pages_kv = QuantizedKV(self.scheme, self.page_size, self.k_codes[layer], self.k_params[layer],
                                   self.v_codes[layer], self.v_params[layer], table, lengths, self.arch.layout)
            for role, x in zip("kv", pages_kv.dequantize()):
                self._dequantized[role][layer].index_copy_(1, tokens, x[0])

    def free(self, seq_id: int) -> None:
        """Return the pages of ``seq_id`` to the pool and release its slot."""
        self._no_capture("free")
        self._check_seq("seq_id", seq_id)
        self._sync_mirror(check=False)
        self._free_pages.extend(reversed(self._pages[seq_id]))
        self._pages[seq_id] = None
        self.page_table[seq_id].fill_(self.trash_page)
        self._plan = None
        self.lengths[:, seq_id] = 0
        self._host_len[:, seq_id] = 0
        self._written[:, seq_id] = 0

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Make sure ``seq_id`` has pages for ``num_tokens`` tokens in total (call before capturing
        a graph whose replays append tokens: replays cannot allocate)."""
        self._no_capture("reserve")
        self._check_seq("seq_id", seq_id)
        num_tokens = self._checked_num_tokens(num_tokens)
        need = self.pages_for(num_tokens) - len(self._pages[seq_id])
        if need > self.free_pages:
            raise PagePoolFull(f"sequence {seq_id} needs {need} more pages for num_tokens={num_tokens}, "
                               f"{self.free_pages} of num_pages={self.num_pages} are free")
        self._grow(seq_id, need)

    def _grow(self, seq_id: int, count: int) -> None:
        if count <= 0:
            return
        pages = self._pages[seq_id]
        new = [self._free_pages.pop() for _ in range(count)]
        self._plan = None  # it read the page table
        self.page_table[seq_id, len(pages):len(pages) + count] = torch.tensor(new, dtype=torch.int32).to(self.device)
        pages.extend(new)

    def _shrink(self, seq_id: int, count: int) -> None:
        """Undo :meth:`_grow` of ``count`` pages: the free list as it was before."""
        pages = self._pages[seq_id]
        given = pages[len(pages) - count:]
        del pages[len(pages) - count:]
        self._plan = None
        self.page_table[seq_id, len(pages):len(pages) + count] = self.trash_page
        self._free_pages.extend(reversed(given))

    def _reserve_for_append(self, ids: tuple, held: list[int], tokens: int) -> list[tuple[int, int]]:
        """All-or-nothing page reservation for appending ``tokens`` to ``ids``, which hold ``held`` tokens in
        the layer appended to (pages are shared by the layers: the first layer to grow reserves them for all).
        Returns the ``(seq_id, pages)`` grown."""
        need = [self.pages_for(n + tokens) - len(self._pages[s]) for s, n in zip(ids, held)]
        if sum(max(0, x) for x in need) > self.free_pages:
            raise PagePoolFull(f"page pool full: appending {tokens} token(s) to seq_ids {list(ids)} needs "
                               f"{sum(max(0, x) for x in need)} more pages, {self.free_pages} of num_pages="
                               f"{self.num_pages} are free")
        grown = [(seq_id, count) for seq_id, count in zip(ids, need) if count > 0]
        for seq_id, count in grown:
            self._grow(seq_id, count)
        return grown

    # ------------------------------------------------------------------ rollback

    def rollback_limit(self, seq_id: int, layer: int = 0) -> int:
        """How many of its last tokens :meth:`truncate` can remove from ``seq_id`` in ``layer``: as many as leave
        every token that the shorter sequence holds in 16 bits still in the 16-bit slots. Removing tokens rewrites
        no page, but a shorter sequence may hold in the ring a granule that is quantized now, and the ring reuses
        a quantized granule's slots for the tokens after it. So right after a granule is quantized, ``granule``
        tokens (it goes back to 16 bits); ``r`` tokens later, ``r`` (each reused one of its slots); a sequence
        whose ring never wrapped, all. A truncate writes no slot, so it lowers the limit by what it removes."""
        n = self.seq_len(seq_id, layer)
        return max(0, n - self._shortest_restorable(layer, seq_id))

    def _shortest_restorable(self, layer: int, seq_id: int) -> int:
        """The fewest tokens a sequence can be cut to: its 16-bit part then lies in slots not written since. (Its
        lengths only grew since the last truncate, so the most it held is the larger of then and now.)"""
        written = max(int(self._written[layer, seq_id]), int(self._host_len[layer, seq_id]))
        if written <= self.sink + self.ring:
            return 0
        # cut to m tokens, the ring must still hold tokens S + Q(m) .. m - 1; it holds the last `ring` written
        return self.sink + self.window + self.granule * -(-(written - self.sink - self.ring) // self.granule)

    def truncate(self, layer: int, seq_ids, num_tokens: int) -> None:
        """Remove the last ``num_tokens`` tokens of each sequence of ``seq_ids`` in ``layer`` (a rollback: rejected
        draft tokens, an undone step), as if they had never been appended. At most :meth:`rollback_limit` tokens
        (what the shorter sequences hold in 16 bits must still be in the 16-bit slots), else a ValueError and
        nothing changes. The sequences keep their pages (as after :meth:`reserve`)."""
        self._no_capture("truncate")
        self._check_layer(layer)
        ids, index = self._rows(seq_ids)
        if not is_int(num_tokens) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        num_tokens = int(num_tokens)
        self._sync_mirror()
        held = self._host_len[layer, list(ids)]
        for seq_id, n in zip(ids, held.tolist()):
            if num_tokens > n:
                raise ValueError(f"num_tokens={num_tokens}: sequence {seq_id} holds only {n} tokens in layer {layer}")
            limit = max(0, n - self._shortest_restorable(layer, seq_id))
            if num_tokens > limit:
                raise ValueError(f"num_tokens={num_tokens}: sequence {seq_id} holds {n} tokens in layer {layer} and "
                                 f"can roll back at most {limit} (rollback_limit): a shorter sequence would hold in "
                                 "16 bits tokens that are quantized now and whose 16-bit slots the ring has reused")
        if num_tokens:
            self._written[layer, list(ids)] = torch.maximum(self._written[layer, list(ids)], held)
            self.lengths[layer].index_copy_(0, index, (held - num_tokens).to(self.device))
            self._host_len[layer, list(ids)] = held - num_tokens

    # ------------------------------------------------------------------ validation helpers

    def _no_capture(self, what: str) -> None:
        if _capturing(self.device):
            raise RuntimeError(f"{what}() runs on the host and cannot be captured in a CUDA graph")

    def _checked_num_tokens(self, num_tokens) -> int:
        """A sequence's token count (``allocate``, ``reserve``) as an int, or a ValueError."""
        if not is_int(num_tokens) or not 0 <= num_tokens <= self.max_seq_len:
            raise ValueError(f"num_tokens must be an int in [0, max_seq_len={self.max_seq_len}], got {num_tokens!r}")
        return int(num_tokens)

    def _check_layer(self, layer) -> None:
        if not is_int(layer) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")

    def _check_seq(self, name: str, seq_id) -> None:
        if not is_int(seq_id):
            raise TypeError(f"{name} must be an int sequence id, got {type(seq_id).__name__}")
        if not 0 <= seq_id < self.max_seqs or self._pages[seq_id] is None:
            raise ValueError(f"{name}: unknown sequence id {seq_id} (allocated: {self.sequences})")

    def _rows(self, seq_ids) -> tuple[tuple, torch.Tensor]:
        """Validated ids and their device index (cached, so that graph replays find it)."""
        if isinstance(seq_ids, torch.Tensor) or not isinstance(seq_ids, (list, tuple, range)):
            raise TypeError(f"seq_ids must be a list, tuple or range of ints, got {type(seq_ids).__name__}")
        ids = tuple(int(s) if is_int(s) else s for s in seq_ids)
        if not ids:
            raise ValueError("seq_ids must not be empty")
        for s in ids:
            self._check_seq("seq_ids", s)
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids must not repeat a sequence, got {list(ids)}")
        index = self._index_cache.get(ids)
        if _capturing(self.device):
            if index is None:
                raise RuntimeError(f"seq_ids {list(ids)} were never used before capture: run the step once eagerly")
            self._captured_ids.add(ids)  # a graph reads this index from now on: never evicted
        elif index is None:
            self._evict_indexes()
            index = self._index_cache[ids] = torch.tensor(ids, dtype=torch.int64).to(self.device)
        return ids, index

    def _evict_indexes(self) -> None:
        """Keep the device indexes of batches bounded (a serving loop meets a new batch almost every step): past
        ``INDEX_CACHE`` entries, drop the oldest that no captured graph reads."""
        if len(self._index_cache) < INDEX_CACHE:
            return
        for ids in list(self._index_cache)[:len(self._index_cache) - INDEX_CACHE // 2]:
            if ids not in self._captured_ids:
                del self._index_cache[ids]

    def _check_kind(self, name: str, t) -> None:
        """A tensor of the cache's dtype on its device."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != self.scheme.q_dtype:
            raise TypeError(f"{name} must have dtype {self.scheme.q_dtype} (the cache's Scheme.q_dtype), got {t.dtype}")
        if t.device != self.device:
            raise ValueError(f"{name} must be on the cache's device {self.device}, got {t.device}")

    def _check_tensor(self, name: str, t, batch: int, heads: int, tokens: int | None) -> None:
        self._check_kind(name, t)
        d = self.scheme.head_dim
        if tokens is None:
            if t.dim() != 3 or t.shape[0] != batch or t.shape[2] != d:
                raise ValueError(f"{name} must have shape [batch={batch}, heads, head_dim={d}], got {list(t.shape)}")
            if t.shape[1] != heads:
                raise ValueError(f"{name} has {t.shape[1]} heads; the cache needs kv_heads*gqa_ratio = {heads}")
            return
        if t.dim() != 4 or t.shape[0] != batch or t.shape[3] != d or t.shape[2] < 1:
            raise ValueError(f"{name} must have shape [batch={batch}, kv_heads, tokens >= 1, head_dim={d}], "
                             f"got {list(t.shape)}")
        if t.shape[1] != heads:
            raise ValueError(f"{name} has {t.shape[1]} heads; the cache holds kv_heads = {heads}")

    def _sync_mirror(self, check: bool = True) -> None:
        """Re-read the device's lengths once an append was captured (a replay may have moved them), and refuse to go
        on with a sequence whose replays appended past its pages (``check=False``: :meth:`free`, which gives it up)
        or appended to it after it was freed."""
        if not self._appends_captured or _capturing(self.device):
            return
        self._host_len[:] = self.lengths.cpu()
        if not check:
            return
        most = self._host_len.max(dim=0).values  # [max_seqs]: pages are shared by the layers
        freed = torch.tensor([pages is None for pages in self._pages])
        moved = (freed & (most > 0)).nonzero().flatten().tolist()
        if moved:  # (reported once: the slot's lengths back to 0, as free left them)
            self.lengths[:, moved] = 0
            self._host_len[:, moved] = 0
            raise RuntimeError(f"graph replays appended to sequence {moved[0]} after free(): a captured graph still "
                               "appends to its seq id (its tokens went to the trash page); capture again after free")
        need = torch.div(self._quantized_tokens_dev(most) + self.page_size - 1, self.page_size, rounding_mode="floor")
        have = torch.tensor([0 if pages is None else len(pages) for pages in self._pages])
        over = (need > have).nonzero().flatten().tolist()
        if over:
            seq_id, most = over[0], int(most[over[0]])
            raise RuntimeError(f"sequence {seq_id}: graph replays appended up to {most} tokens, more than its "
                               f"{len(self._pages[seq_id])} pages hold; the quantized tokens past them went to the "
                               "trash page and are lost. free() the sequence, and reserve() pages for every token the "
                               "replays append before capturing")

    # ------------------------------------------------------------------ append

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        if self.rotation is None:
            return x
        return (x.float() @ self.rotation).to(x.dtype)

    @torch.no_grad()  # the cache keeps values, never autograd history (k, v may require grad)
    def append(self, layer: int, seq_ids, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``k, v [len(seq_ids), kv_heads, tokens, head_dim]`` to the sequences of ``seq_ids``.

        One token per sequence (decode) is fully device-side and CUDA-graph capturable; several
        tokens (prefill) plan on the host. Every argument is checked before anything changes.
        """
        self._check_layer(layer)
        ids, index = self._rows(seq_ids)
        self._check_tensor("k", k, len(ids), self.kv_heads, 1)
        self._check_tensor("v", v, len(ids), self.kv_heads, 1)
        if v.shape != k.shape:
            raise ValueError(f"v must have the shape of k {list(k.shape)}, got {list(v.shape)}")
        tokens = k.shape[2]
        capturing = _capturing(self.device)
        self._check_values(k, v)
        flush = True  # whether a one-token append runs the quantize step
        if capturing:
            if tokens != 1:
                raise RuntimeError("append of several tokens per sequence plans on the host: not capturable")
            if not self.use_kernels:
                raise RuntimeError("append: the torch path (use_kernels=False) checks its values on the host as it "
                                   "quantizes, which a CUDA graph cannot capture; capture with use_kernels=True")
            self._appends_captured = True
        else:
            self._sync_mirror()
            held = self._host_len[layer, list(ids)].tolist()
            if max(held) + tokens > self.max_seq_len:
                raise ValueError(f"k: appending {tokens} token(s) would exceed max_seq_len={self.max_seq_len}")
            grown = self._reserve_for_append(ids, held, tokens)
            # the torch path skips the quantize step of the (usual) append that completes no granule; the
            # kernel path keeps it, so that its eager steps are the graph's
            flush = self.use_kernels or any(self.quantized_tokens(n + 1) > self.quantized_tokens(n) for n in held)
        k = self._rotate(k)
        try:
            if tokens == 1:
                self._append_step(layer, index, k, v, flush)
            else:
                self._append_bulk(layer, ids, index, k, v)
        except BaseException:
            # the quantize step failed (the lengths have not moved): the pages go back as well
            for seq_id, count in () if capturing else grown:
                self._shrink(seq_id, count)
            raise
        if not capturing:
            self._host_len[layer, list(ids)] += tokens

    def _check_values(self, k, v) -> None:
        """The torch path's quantizer refuses inf, nan and values beyond float16's range (the group's scale and offset
        are fp16: ``foscar.formats``) once a granule is due, which may be appends later, after the slots and lengths
        of those appends changed: here before anything changes. The kernels do not check (it would take a host sync
        per append, which a CUDA graph cannot capture either): such a value makes its group's attention non-finite
        (``foscar.kernels.quantize``)."""
        if self.use_kernels or _capturing(self.device):
            return
        for name, t in (("k", k), ("v", v)):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} holds inf or nan")
            if bool((t.abs() > FP16_MAX).any()):
                raise ValueError(f"{name} holds values beyond the float16 range (|x| > {FP16_MAX:g}), which its "
                                 "group's fp16 scale and offset cannot hold")
        # what is quantized is the rotated k, whose values may be up to sqrt(head_dim) times larger
        if self.rotation is not None and bool((self._rotate(k).abs() > FP16_MAX).any()):
            raise ValueError(f"k holds values that the cache's rotation (rotate=True: a Hadamard transform, up to "
                             f"sqrt(head_dim) times larger) takes beyond the float16 range (|x| > {FP16_MAX:g})")

    def _ring_slot(self, pos):
        """BF16 slot of absolute token position ``pos`` (int or tensor) in the sink + ring buffer."""
        if isinstance(pos, torch.Tensor):
            return torch.where(pos < self.sink, pos, self.sink + (pos - self.sink) % self.ring)
        return pos if pos < self.sink else self.sink + (pos - self.sink) % self.ring

    def _append_step(self, layer, index, k, v, flush):
        n0 = self.lengths[layer, index]  # [B]
        where = (index[:, None], self._heads[None, :], self._ring_slot(n0)[:, None])
        # what the slot held (a quantized token a truncate may bring back), put back if the torch path's quantizer
        # refuses the granule, which may hold the new token (the kernel path's quantize step checks nothing here)
        previous = None if self.use_kernels else [bf16[layer][where] for bf16 in (self.k_bf16, self.v_bf16)]
        self._write_slots(layer, where, k[:, :, 0], v[:, :, 0])
        n1 = n0 + 1
        try:
            if flush:
                self._flush_step(layer, index, n0, n1)
        except BaseException:
            if previous is not None:
                self._write_slots(layer, where, *previous)
            raise
        # last: a refusal leaves the length, and so everything the cache shows, as it was
        self.lengths[layer].index_copy_(0, index, n1)

    def _flush_step(self, layer, index, n0, n1):
        """Quantize the granule a one-token append completes, if any."""
        q0, q1 = self._quantized_tokens_dev(n0), self._quantized_tokens_dev(n1)
        # the granule that may be due: tokens S + q0 .. S + q0 + T - 1, all in the ring now
        ring = self.sink + (q0[:, None] + self._granule_steps[None, :]) % self.ring  # [B, T]
        column = torch.div(q0, self.page_size, rounding_mode="floor").clamp(max=self.max_pages - 1)
        page = self.page_table[index, column]
        page = torch.where(q1 > q0, page, -1).to(torch.int32)
        slot_in_page = (q0 % self.page_size).to(torch.int32)
        slots = {"k": self.k_bf16[layer], "v": self.v_bf16[layer]}
        # each role's granule out of the ring: [B, kvh, T, D]
        self._quantize(layer, lambda role: slots[role][index[:, None], :, ring].permute(0, 2, 1, 3).contiguous(),
                       page, slot_in_page)

    def _append_bulk(self, layer, ids, index, k, v):
        srcs, pages, slots = {"k": [], "v": []}, [], []
        ring_pos, ring_vals, sink_writes = [], {"k": [], "v": []}, []
        T = self.granule
        for b, seq_id in enumerate(ids):
            n0 = int(self._host_len[layer, seq_id])
            n1 = n0 + k.shape[2]
            q0, q1 = self.quantized_tokens(n0), self.quantized_tokens(n1)
            s0, s1 = self.sink + q0, self.sink + q1  # token range to quantize now
            # new tokens from here on are written to the ring: those it holds (from s1) and, in the slots left,
            # the quantized ones before them, so that the ring holds the last `ring` tokens appended (truncate)
            first_recent = max(n0, self.sink, n1 - self.ring)
            for role, new, bf16 in (("k", k, self.k_bf16), ("v", v, self.v_bf16)):
                if s1 > s0:
                    parts = []
                    if min(n0, s1) > s0:  # older tokens, still in the ring
                        old = torch.tensor([self._ring_slot(p) for p in range(s0, min(n0, s1))], device=self.device)
                        parts.append(bf16[layer, seq_id][:, old])
                    if s1 > max(n0, s0):
                        parts.append(new[b, :, max(n0, s0) - n0:s1 - n0])
                    block = torch.cat(parts, dim=1)  # [kvh, q1 - q0, D]
                    srcs[role].append(block.reshape(self.kv_heads, (q1 - q0) // T, T, -1).transpose(0, 1))
                ring_vals[role].append(new[b, :, first_recent - n0:])
            if n0 < self.sink:
                end = min(n1, self.sink)
                sink_writes.append(((seq_id, slice(None), slice(n0, end)), k[b, :, :end - n0], v[b, :, :end - n0]))
            ring_pos.append((seq_id, range(first_recent, n1)))
            for q in range(q0, q1, T):
                pages.append(self._pages[seq_id][q // self.page_size])
                slots.append(q % self.page_size)
        if pages:
            page = torch.tensor(pages, dtype=torch.int32).to(self.device)
            slot = torch.tensor(slots, dtype=torch.int32).to(self.device)
            self._quantize(layer, lambda role: torch.cat(srcs[role]).contiguous(), page, slot)
        # the slots after the quantize step: its sources were copied out of the ring, and a quantizer's refusal
        # (torch path) leaves the cache as it was
        for where, k_sink, v_sink in sink_writes:
            self._write_slots(layer, where, k_sink, v_sink)
        rows = torch.tensor([s for s, r in ring_pos for _ in r], dtype=torch.int64)
        cols = torch.tensor([self._ring_slot(p) for _, r in ring_pos for p in r], dtype=torch.int64)
        if rows.numel():
            rows, cols = rows.to(self.device), cols.to(self.device)
            k_vals, v_vals = (torch.cat([x.transpose(0, 1) for x in ring_vals[role]]) for role in "kv")  # [t, kvh, D]
            self._write_slots(layer, (rows[:, None], self._heads[None, :], cols[:, None]), k_vals, v_vals)
        self.lengths[layer].index_copy_(0, index, (self._host_len[layer, list(ids)] + k.shape[2]).to(
            self.device))

    def _write_slots(self, layer, where, k, v):
        """Write ``k``, ``v`` to the 16-bit slots ``where`` (an index into a layer's ``[max_seqs, kv_heads,
        S + ring]``) and, on the torch path, to their fp32 copies."""
        for role, bf16, x in (("k", self.k_bf16, k), ("v", self.v_bf16, v)):
            bf16[layer][where] = x
            if self._slots_fp32 is not None:
                self._slots_fp32[role][layer][where] = x.float()

    def _quantize(self, layer, source, page, slot):
        """Quantize the granules ``source(role) [N, kvh, T, D]`` gives into ``page`` (< 0: skip) at token ``slot``.
        The kernel path quantizes a role as it writes it (its launch refuses nothing; one role's source at a time);
        the torch path runs both roles' quantizers before either writes, so that a format's refusal of v leaves k's
        pages as they were."""
        if self.use_kernels:
            from .kernels.quantize import quantize_tiles

            for role in ("k", "v"):
                quantize_tiles(source(role), page, slot, *self._packed(layer, role), self.scheme, role,
                               self.arch.layout)
            return
        for write in [self._quantized(layer, role, source(role), page, slot) for role in ("k", "v")]:
            write()

    def _packed(self, layer, role):
        """A role's packed codes and params of ``layer``."""
        if role == "k":
            return self.k_codes[layer], self.k_params[layer]
        return self.v_codes[layer], self.v_params[layer]

    def _quantized(self, layer, role, src, page, slot):
        """One role's granules quantized on the torch path: returns what writes them to the role's codes, params
        and fp32 copy."""
        codes, params = self._packed(layer, role)
        quant = self.scheme.k if role == "k" else self.scheme.v
        page = torch.where(page < 0, self.trash_page, page).long()
        c, scale, offset = quantize_groups(src, quant, name=role)
        n, kvh, t, d = src.shape
        pack = PACKERS[self.arch.layout][0]
        words = pack(c.reshape(n, kvh, t // TILE_TOKENS, TILE_TOKENS, d), TileGeometry(role, quant.bits, d))
        tiles = (slot.long() // TILE_TOKENS)[:, None] + torch.arange(t // TILE_TOKENS, device=src.device)[None, :]
        first = quant.params_shape(slot.long(), d)[0]  # the granule's first params row
        rows = first[:, None] + torch.arange(quant.params_shape(t, d)[0], device=src.device)[None, :]
        stacked = stack_params(scale, offset, quant).transpose(1, 2)
        tokens = (page * self.page_size + slot.long())[:, None] + torch.arange(t, device=src.device)[None, :]
        values = dequantize_groups(c, scale, offset, quant)  # [N, kvh, T, D]
        values = values.transpose(0, 1).reshape(kvh, n * t, d)

        def write():
            codes[page[:, None], :, tiles] = words.transpose(1, 2)
            params[page[:, None], :, rows] = stacked
            self._dequantized[role][layer].index_copy_(1, tokens.reshape(-1), values)
        return write

    # ------------------------------------------------------------------ attend

    def num_splits(self, batch: int) -> int:
        """Split-KV factor for a decode batch where the launch has no work list (Hopper's two-launch
        variants): fixed by capacities only (graph-stable), so kept per batch size (planning
        takes ~35 us of Python, and every attend asks)."""
        if batch not in self._splits:
            self._splits[batch] = plan_splits(batch, self.kv_heads, self.max_pages * self.page_size, self._num_sms,
                                              WINDOW_MERGE_SPLITS)
        return self._splits[batch]

    def attend(self, layer: int, seq_ids, q: torch.Tensor, sm_scale: float | None = None, return_lse: bool = False):
        """Decode attention of ``q [len(seq_ids), kv_heads*gqa_ratio, head_dim]`` over each sequence, or of
        ``q [len(seq_ids), tokens, kv_heads*gqa_ratio, head_dim]``: the sequences' last ``tokens`` tokens
        (speculative verification: the draft tokens, appended first), each attending every token up to its
        own (causal). They sit in the 16-bit window (``tokens <= window``); on the GPU one kernel launch takes
        ``gqa_ratio x tokens <= 16`` query rows per KV head (``Arch.max_query_tokens``), and more tokens, up to
        :meth:`max_query_tokens`, run as several launches: the tokens of each but the last see the sequence as
        a truncate of the tokens after them would leave it (its ``lengths`` less those tokens, which the ring
        still holds in 16 bits while they are within ``rollback``).

        Returns ``out`` (q's dtype and shape) and, if asked, ``lse`` (fp32, q's shape less head_dim, natural
        log, scores scaled by ``sm_scale``, default ``head_dim**-0.5``). A sequence with no token yet attends
        to the empty softmax: ``out = 0`` and ``lse = -inf`` (what a merge with other partials expects).
        Capturable in a CUDA graph. On the GPU one attend per cache may be in flight at a time (its launches
        share the cache's completion counters): issue a cache's attends on one stream.
        """
        self._check_layer(layer)
        ids, index = self._rows(seq_ids)
        tokens = self._check_query(layer, q, ids)
        sm_scale = self._sm_scale(sm_scale)
        q = self._rotate(q).contiguous()  # the kernels read q densely (a q sliced from a fused QKV is not)
        rows = q.view(q.shape[0], tokens, *q.shape[-2:])
        step = self._tokens_per_launch()
        parts = [self._attend_tokens(layer, ids, index, rows[:, first:last].contiguous(), sm_scale, later)
                 for first, last, later in launches(tokens, step)]
        out, lse = (torch.cat(x, dim=1) if len(x) > 1 else x[0] for x in zip(*parts))
        out, lse = out.view(q.shape).to(q.dtype), lse.view(q.shape[:-1])
        return (out, lse) if return_lse else out

    def _attend_tokens(self, layer, ids, index, q, sm_scale, later: int):
        """``attend`` of ``q [B, tokens, Hq, D]``, the tokens of each sequence that precede its last ``later``
        ones: over the sequence as a truncate of those would leave it."""
        lengths = self.lengths[layer] if later == 0 else self.lengths[layer] - later
        if self.use_kernels:  # packed pages + 16-bit slots, merged (Arch.run_cache_decode: one launch on Hopper)
            one = q[:, 0] if q.shape[1] == 1 else q
            out, lse = self.arch.run_cache_decode(
                one, self.k_codes[layer], self.k_params[layer], self.v_codes[layer], self.v_params[layer],
                self.page_table, self.k_bf16[layer], self.v_bf16[layer], index, lengths, self._counters,
                self.sink, self.window, sm_scale, self.scheme, self.num_splits(q.shape[0]), self.cta_budget,
                self._packed_mean(layer, ids, later))
            return out.view(q.shape), lse.view(q.shape[:-1])
        plan = self._attend_plan(layer, ids, index, later)
        return self._softmax_attend(layer, q, plan, lengths[index], sm_scale)

    def _packed_mean(self, layer, ids, later: int) -> int:
        """The mean packed tokens of sequences ``ids`` without their last ``later`` tokens, from the host mirror,
        which lags behind appends replayed in a CUDA graph (reading the device's lengths would sync): a hint that
        plans the decode's parts past one wave (``foscar.work_list.wave_budget``; any plan attends correctly, and a
        graph keeps the plan of its capture); 0 (not asked) for a batch within one wave, where it plans nothing."""
        if len(ids) * self.kv_heads <= self.cta_budget:
            return 0
        held = (self._host_len[layer, list(ids)] - later - self.sink - self.window).clamp(min=0)
        return int((held // self.granule * self.granule).sum()) // len(ids)

    def _tokens_per_launch(self) -> int:
        """The most query tokens per sequence one kernel launch (or one torch-path softmax) attends."""
        window = max(self.window, 1)
        return min(window, self.arch.max_query_tokens(self.scheme)[0]) if self.use_kernels else window

    def max_query_tokens(self) -> int:
        """The most query tokens per sequence :meth:`attend` takes (the sequences' last tokens): the 16-bit window
        holds them; on the GPU one kernel launch takes ``gqa_ratio x tokens <= 16`` query columns
        (``Arch.max_query_tokens``), and ``rollback`` tokens more run as earlier launches over the sequence as
        a truncate would leave it. More go through :meth:`attend_chunk`, before they are appended."""
        return min(max(self.window, 1), self._tokens_per_launch() + self.rollback)

    def _check_query(self, layer, q, ids) -> int:
        """Validate ``attend``'s ``q`` (3-D: one token per sequence; 4-D: ``tokens`` of them); returns ``tokens``."""
        heads = self.kv_heads * self.scheme.gqa_ratio
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            self._check_tensor("q", q, len(ids), heads, None)
            return 1
        self._check_kind("q", q)
        batch, tokens, d = len(ids), q.shape[1], self.scheme.head_dim
        if q.shape[0] != batch or q.shape[2] != heads or q.shape[3] != d or tokens < 1:
            raise ValueError(f"q must have shape [batch={batch}, tokens >= 1, heads={heads}, head_dim={d}] "
                             f"(or [batch, heads, head_dim]), got {list(q.shape)}")
        if tokens > max(self.window, 1):
            raise ValueError(f"q: {tokens} query tokens per sequence exceed window={self.window}: attend's query "
                             "tokens are the last ones appended, which the 16-bit window holds (attend_chunk "
                             "takes longer chunks)")
        step = self._tokens_per_launch()
        if self.use_kernels:
            self.arch.check_query_tokens(self.scheme, self.page_size, min(tokens, step))
        if tokens > self.max_query_tokens():
            raise ValueError(f"q: {tokens} query tokens per sequence: one kernel launch takes {step} and rollback="
                             f"{self.rollback} more (earlier launches read the sequence as a truncate would leave "
                             f"it), at most {self.max_query_tokens()}; construct the cache with rollback >= "
                             f"{tokens - step}, or attend_chunk the tokens before appending them")
        if not _capturing(self.device):  # a capture sees no lengths: the caller appended the tokens
            self._sync_mirror()
            held = self._host_len[layer, list(ids)]
            if int(held.min()) < tokens:
                short = ids[int(held.argmin())]
                raise ValueError(f"q: {tokens} query tokens per sequence, but sequence {short} holds "
                                 f"{int(held.min())} tokens: append the query tokens' K/V before attend")
            for seq in ids if tokens > step else ():  # a truncate since the draft's append lowers the margin
                if self.rollback_limit(seq, layer) < tokens - step:
                    raise ValueError(f"q: {tokens} query tokens per sequence run as launches of {step}; the first "
                                     f"reads sequence {seq} without its last {tokens - step} tokens, but the ring "
                                     f"keeps only {self.rollback_limit(seq, layer)} of them readable so "
                                     "(rollback_limit, lowered by a truncate): append the draft, then attend it")
        return tokens

    def _sm_scale(self, sm_scale) -> float:
        return checked_sm_scale(sm_scale, self.scheme.head_dim**-0.5)

    def attend_chunk(self, layer: int, seq_ids, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     sm_scale: float | None = None, return_lse: bool = False):
        """Attention of ``L`` new tokens per sequence that follow its cached tokens (chunked prefill, a new turn,
        the tokens a draft proposes): ``q [len(seq_ids), L, kv_heads*gqa_ratio, head_dim]``, and the new
        tokens' own ``k, v [len(seq_ids), kv_heads, L, head_dim]``, which are *not* appended (:meth:`append`
        them afterwards to keep them). Query ``i`` attends every cached token, as :meth:`attend` does, and new
        tokens ``0 .. i`` (causal), those in 16 bits as given (rotated like appended keys when ``rotate``).

        Returns ``out [B, L, Hq, D]`` (q's dtype) and, if asked, ``lse [B, L, Hq]`` (fp32, as :meth:`attend`).
        The cache is not changed. Host-planned: not capturable in a CUDA graph. Two computations:

        * a kernel cache (GPU): per sequence, the packed pages are attended by the arch's prefill kernel (Hopper,
          ``foscar.hopper.prefill``: the chunk's query rows 128 to a CTA, each packed tile dequantized once per CTA in
          shared memory; up to ``foscar.chunk_attention.PREFILL_COLUMNS`` query columns per KV head), or by the decode
          kernel with the new tokens as query heads (tiles of 16 columns, ``DECODE_COLUMNS`` in all), or else
          dequantized into q's dtype one block at a time and attended by a fused attention; the 16-bit slots and,
          causally, the new tokens by the fused attention; all merged by their LSE (``foscar.chunk_attention``):
          extra memory is one block and the chunk, not the prefix;
        * the torch path's cache: one fp32 softmax per block of query tokens over its fp32 copies of the pages,
          the 16-bit slots and the new tokens (a block's scores take at most ``CHUNK_SCORES`` elements).
        """
        self._no_capture("attend_chunk")
        self._check_layer(layer)
        ids, index = self._rows(seq_ids)
        batch, heads = len(ids), self.kv_heads * self.scheme.gqa_ratio
        self._check_tensor("k", k, batch, self.kv_heads, 1)
        self._check_tensor("v", v, batch, self.kv_heads, 1)
        if v.shape != k.shape:
            raise ValueError(f"v must have the shape of k {list(k.shape)}, got {list(v.shape)}")
        tokens, d = k.shape[2], self.scheme.head_dim
        self._check_kind("q", q)
        if list(q.shape) != [batch, tokens, heads, d]:
            raise ValueError(f"q must have shape [batch={batch}, tokens={tokens} (k's), heads={heads}, head_dim={d}], "
                             f"got {list(q.shape)}")
        sm_scale = self._sm_scale(sm_scale)
        self._sync_mirror()
        held = self._host_len[layer, list(ids)].tolist()
        if max(held) + tokens > self.max_seq_len:
            raise ValueError(f"q: {tokens} new tokens after the {max(held)} cached of a sequence exceed "
                             f"max_seq_len={self.max_seq_len}")
        q, k = self._rotate(q), self._rotate(k)
        if self._dequantized is None:
            prefixes = [self._packed_prefix(layer, seq, n, tokens, sm_scale) for seq, n in zip(ids, held)]
            merge = merge_parts if self.device.type == "cuda" else None  # (tests run this path on the CPU)
            parts = [chunk_attention(q[b], k[b], v[b], self._cached_blocks(layer, seq, n, q.dtype, prefix is None),
                                     sm_scale, prefix, merge)
                     for b, (seq, n, prefix) in enumerate(zip(ids, held, prefixes))]
            if batch == 1:  # one sequence: its outputs as they are (a GPU cache's are contiguous: no copy)
                out, lse = (x[None].contiguous() for x in parts[0])
            else:
                out, lse = (torch.stack(x) for x in zip(*parts))
            return (out, lse) if return_lse else out
        plan = self._attend_plan(layer, ids, index, 0)
        cached = self._read(layer, "k", plan), self._read(layer, "v", plan)
        rows = max(1, CHUNK_SCORES // (batch * heads * (plan.bias.shape[-1] + tokens)))
        parts = [self._chunk_softmax(q[:, start:start + rows], k[:, :, :start + rows], v[:, :, :start + rows], start,
                                     cached, plan, sm_scale) for start in range(0, tokens, rows)]
        out = torch.cat([o for o, _ in parts], dim=1).to(q.dtype)
        return (out, torch.cat([lse for _, lse in parts], dim=1)) if return_lse else out

    def _packed_prefix(self, layer, seq, n, tokens, sm_scale) -> PackedPrefill | PackedPrefix | None:
        """The packed pages of sequence ``seq`` (``n`` tokens) for ``chunk_attention`` to attend without writing them
        in 16 bits: through the arch's prefill kernel (``PackedPrefill``) up to ``PREFILL_COLUMNS`` query columns
        (``gqa x tokens``) where it has one and takes the scheme; else through the decode kernel (``PackedPrefix``),
        where a chunk of ``tokens`` is short enough for that to beat dequantized blocks (its tiles, one pass over the
        pages each, hold at most ``DECODE_COLUMNS`` query columns) and the kernel takes the chunk's tokens as query
        heads; else None (``_cached_blocks`` dequantizes them)."""
        quantized, gqa = self.quantized_tokens(n), self.scheme.gqa_ratio
        if self.device.type != "cuda" or not quantized:
            return None
        if gqa * tokens <= PREFILL_COLUMNS and self.arch.takes_prefill(self.scheme):
            table = self.page_table[seq, :-(-quantized // self.page_size)].clone()  # a copy: 16-byte aligned
            codes = self.k_codes[layer], self.k_params[layer], self.v_codes[layer], self.v_params[layer]
            return PackedPrefill(lambda q_rows: self.arch.run_prefill(q_rows, *codes, table, quantized, sm_scale,
                                                                      self.scheme))
        step = self.arch.max_query_tokens(self.scheme)[0]
        if step < 1:
            return None
        if -(-tokens // step) * MAX_QUERY_COLUMNS > DECODE_COLUMNS:  # more passes over the pages than blocks cost
            return None
        if step not in self._prefix_schemes:  # one compiled variant per cache scheme
            scheme = dataclasses.replace(self.scheme, gqa_ratio=gqa * step)
            try:
                self.arch.can_implement(scheme, self.page_size)
            except ValueError:  # a ratio past the kernel's, a config that does not build
                scheme = None
            self._prefix_schemes[step] = scheme
        scheme = self._prefix_schemes[step]
        if scheme is None:
            return None
        tiles, pages = -(-tokens // step), -(-quantized // self.page_size)
        table = self.page_table[seq, :pages].expand(tiles, pages).clone()  # the same pages for every tile; aligned
        lengths = torch.full((tiles,), quantized, dtype=torch.int32, device=self.device)
        splits = plan_splits(tiles, self.kv_heads, pages * self.page_size, self._num_sms)
        codes = self.k_codes[layer], self.k_params[layer], self.v_codes[layer], self.v_params[layer]
        return PackedPrefix(step, lambda q: self.arch.run_decode(q, *codes, table, lengths, sm_scale, scheme, splits))

    def _cached_blocks(self, layer, seq, n, dtype, packed: bool = True):
        """What sequence ``seq`` of ``n`` tokens holds, as blocks ``(k, v) [kv_heads, T, D]`` in ``dtype`` for
        ``chunk_attention``: its packed pages (unless not ``packed``) dequantized at most ``BLOCK_BYTES`` at a time,
        whole multiples of ``CUDNN_TOKENS`` tokens where a block holds that many (the dequantize kernel on a GPU cache,
        in its arch's bit order; the torch dequantizer on a CPU cache), then its 16-bit slots."""
        quantized, ps = self.quantized_tokens(n) if packed else 0, self.page_size
        per_block = block_pages(self.kv_heads, ps, self.scheme.head_dim, dtype)
        pages = -(-quantized // ps)
        for first in range(0, pages, per_block):
            # a copy: the kernel takes 16-byte aligned pointers, which a slice of a row need not be
            table = self.page_table[seq:seq + 1, first:min(pages, first + per_block)].clone()
            held = min(quantized - first * ps, table.shape[1] * ps)
            if self.device.type == "cuda":
                yield tuple(self._dequantizer(layer, role, dtype)(table)[0, :, :held] for role in "kv")
            else:
                block = QuantizedKV(self.scheme, ps, self.k_codes[layer], self.k_params[layer], self.v_codes[layer],
                                    self.v_params[layer], table, torch.tensor([held], device=self.device),
                                    self.arch.layout)
                yield tuple(x[0, :, :held].to(dtype) for x in block.dequantize())
        runs = self._slot_runs(n)
        if runs:
            yield tuple(torch.cat([x[layer, seq][:, run] for run in runs], 1) for x in (self.k_bf16, self.v_bf16))

    def __deepcopy__(self, memo):
        """A copy (a view to truncate, a prompt cache reused): every attribute deep-copied but the kept dequantize
        launchers (:meth:`_dequantizer`), which hold compiled-kernel handles and pointers into this cache's pools: the
        copy builds its own."""
        copied = object.__new__(type(self))
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            copied.__dict__[name] = {} if name == "_dequantizers" else copy.deepcopy(value, memo)
        return copied

    def _dequantizer(self, layer: int, role: str, dtype) -> PagesDequantizer:
        """The dequantize kernel's launcher for one layer's ``role`` pages into ``dtype``, kept: its checks and
        lookups are paid once, not at every block of every chunk."""
        key = (layer, role, dtype)
        if key not in self._dequantizers:
            self._dequantizers[key] = PagesDequantizer(*self._packed(layer, role), self.scheme, role, dtype,
                                                       layout=self.arch.layout)
        return self._dequantizers[key]

    def _slot_runs(self, n: int) -> list[slice]:
        """The 16-bit slots that hold tokens of a sequence of ``n`` tokens (``_valid_slots``' on the host), as at most
        three runs: the sink's, then the ring's from its oldest token, wrapping once. Slices, not an index tensor: no
        host sync, no copy to the GPU."""
        recent = max(0, n - self.sink - self.quantized_tokens(n))
        oldest = self.quantized_tokens(n) % self.ring
        end = oldest + recent
        runs = [slice(0, min(self.sink, n)), slice(self.sink + oldest, self.sink + min(end, self.ring)),
                slice(self.sink, self.sink + max(0, end - self.ring))]
        return [run for run in runs if run.stop > run.start]

    def _chunk_softmax(self, q, k, v, first, cached, plan, sm_scale):
        """fp32 attention of new tokens ``first .. first + l - 1`` (``q [B, l, Hq, D]``, rotated) over the cached
        tokens (``cached``, ``plan``) and new tokens ``0 .. first + l - 1`` (``k, v [B, kvh, c, D]``, causal)."""
        batch, rows, hq, d = q.shape
        kvh, width = self.kv_heads, plan.width
        group = hq // kvh
        (k_q, k_s), (v_q, v_s) = cached
        qg = (q.float() * sm_scale).view(batch, rows, kvh, group, d).permute(0, 2, 3, 1, 4).reshape(
            batch, kvh, group * rows, d)  # rows ordered (query head of the group, token)
        scores = torch.cat([torch.matmul(qg, k_q.mT), torch.matmul(qg, k_s.mT)], dim=-1).add_(plan.bias)
        later = torch.arange(k.shape[2], device=q.device)[None, :] > torch.arange(first, first + rows,
                                                                                   device=q.device)[:, None]
        new = torch.matmul(qg, k.float().mT).view(batch, kvh, group, rows, -1).masked_fill_(later, -torch.inf)
        scores = torch.cat([scores, new.view(batch, kvh, group * rows, -1)], dim=-1)
        lse = torch.logsumexp(scores, dim=-1)  # finite: each token attends at least itself
        p = scores.sub_(lse[..., None]).exp_()
        cached_end = plan.bias.shape[-1]
        out = torch.matmul(p[..., :width], v_q).add_(torch.matmul(p[..., width:cached_end], v_s))
        out.add_(torch.matmul(p[..., cached_end:], v.float()))
        out = out.view(batch, kvh, group, rows, d).permute(0, 3, 1, 2, 4).reshape(batch, rows, hq, d)
        return out, lse.view(batch, kvh, group, rows).permute(0, 3, 1, 2).reshape(batch, rows, hq)

    def _attend_plan(self, layer, ids, index, later: int) -> _AttendPlan:
        """What a torch-path attend of ``ids`` reads, each sequence without its last ``later`` tokens; outside a
        capture it is kept for the next attend of the same sequences at the same lengths (every layer's at a
        decode step): pages and slots are laid out alike in every layer, and a page-table change drops it."""
        capturing = _capturing(self.device)
        if not capturing:
            self._sync_mirror()
            key = (ids, tuple((self._host_len[layer, list(ids)] - later).tolist()))
            if self._plan is not None and self._plan[0] == key:
                return self._plan[1]
        contiguous = ids == tuple(range(ids[0], ids[0] + len(ids)))
        rows = slice(ids[0], ids[0] + len(ids)) if contiguous else index  # slices avoid gathers
        n = self.lengths[layer, index] - later
        qlen = self._quantized_tokens_dev(n)
        table = self.page_table[rows]
        if not capturing:  # only pages that hold tokens (at least one): work follows the lengths, not max_seq_len
            table = table[:, :max(1, -(-int(qlen.max()) // self.page_size))]
        width = table.shape[1] * self.page_size
        first = self._page_run(ids, table.shape[1])
        if first is not None:  # one sequence whose pages follow each other in the pool: read in place
            quantized = slice(first * self.page_size, first * self.page_size + width)
        else:
            quantized = (table.long()[:, :, None] * self.page_size + self._page_steps).reshape(-1)
        valid = torch.cat([torch.arange(width, device=self.device)[None, :] < qlen[:, None],
                           self._valid_slots(n, qlen)], dim=1)
        bias = torch.zeros(valid.shape, device=self.device).masked_fill_(~valid, -torch.inf)[:, None, None, :]
        plan = _AttendPlan(quantized, width, rows, bias, capturing or 0 in key[1])  # a capture sees no lengths
        if not capturing:
            self._plan = (key, plan)
        return plan

    def _page_run(self, ids, count):
        """The first page where ``ids`` is one sequence whose first ``count`` pages are consecutive in the
        pool, else None (and None while capturing: the host page lists may be ahead of a replay)."""
        if len(ids) != 1 or _capturing(self.device):
            return None
        pages = self._pages[ids[0]][:count]
        return pages[0] if len(pages) == count and pages == list(range(pages[0], pages[0] + count)) else None

    def _valid_slots(self, n, qlen):
        """Which of the ``S + ring`` 16-bit slots of sequences of ``n`` tokens hold one: ``[B, S + ring]``."""
        j = self._slots[None, :]
        recent = (n - self.sink - qlen).clamp(min=0)[:, None]
        in_ring = (j - self.sink - qlen[:, None]) % self.ring < recent
        return torch.where(j < self.sink, j < n[:, None], in_ring)

    def _read(self, layer, role, plan):
        """fp32 ``(quantized part [B, kvh, width, D], slots [B, kvh, S + ring, D])`` of ``role`` by ``plan``."""
        values = self._dequantized[role][layer]
        if isinstance(plan.quantized, slice):
            quantized = values[None, :, plan.quantized]
        else:
            batch = plan.quantized.numel() // plan.width
            quantized = values.index_select(1, plan.quantized).view(self.kv_heads, batch, plan.width, -1)
            quantized = quantized.transpose(0, 1)
        return quantized, self._slots_fp32[role][layer][plan.rows]

    def _softmax_attend(self, layer, q, plan, n, sm_scale):
        """fp32 attention of ``q [B, tokens, Hq, D]``, the last ``tokens`` of sequences of ``n`` tokens, over
        what ``plan`` reads: one softmax over the quantized part and the slots, each query token masked from the
        slots that hold later tokens (those are in the 16-bit window: ``tokens <= window``); a sequence that
        holds no token gets ``out = 0``, ``lse = -inf``."""
        batch, tokens, hq, d = q.shape
        group = hq // self.kv_heads
        (k_q, k_s), (v_q, v_s) = self._read(layer, "k", plan), self._read(layer, "v", plan)
        qg = (q.float() * sm_scale).view(batch, tokens, self.kv_heads, group, d).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(batch, self.kv_heads, group * tokens, d)  # rows (query head of the group, token)
        scores = torch.cat([torch.matmul(qg, k_q.mT), torch.matmul(qg, k_s.mT)], dim=-1).add_(plan.bias)
        if tokens > 1:
            later = self._slot_positions(n, self._quantized_tokens_dev(n))[:, None, :] > (
                n[:, None] - tokens + torch.arange(tokens, device=self.device)[None, :])[:, :, None]  # [B, tokens, slots]
            slots = scores[..., plan.width:].view(batch, self.kv_heads, group, tokens, -1)
            slots.masked_fill_(later[:, None, None], -torch.inf)
        lse = torch.logsumexp(scores, dim=-1)
        p = scores.sub_((torch.where(torch.isfinite(lse), lse, 0.0) if plan.maybe_empty else lse)[..., None]).exp_()
        out = torch.matmul(p[..., :plan.width], v_q).add_(torch.matmul(p[..., plan.width:], v_s))
        out = out.view(batch, self.kv_heads, group, tokens, d).permute(0, 3, 1, 2, 4).reshape(q.shape)
        return out, lse.view(batch, self.kv_heads, group, tokens).permute(0, 3, 1, 2).reshape(q.shape[:-1])

    def _slot_positions(self, n, qlen):
        """The token position each of the ``S + ring`` 16-bit slots holds (where it holds one): ``[B, S + ring]``."""
        j = self._slots[None, :]
        return torch.where(j < self.sink, j, self.sink + qlen[:, None] + (j - self.sink - qlen[:, None]) % self.ring)

    # ------------------------------------------------------------------ inspection

    def dense(self, layer: int, seq_id: int):
        """(k, v) ``[kv_heads, n, D]`` fp32 of one sequence in token order, the quantized part
        dequantized (still rotated if ``rotate``): what :meth:`attend` attends over."""
        self._check_layer(layer)
        self._check_seq("seq_id", seq_id)
        self._sync_mirror()
        n = int(self._host_len[layer, seq_id])
        qn = self.quantized_tokens(n)
        out = []
        for role, bf16 in (("k", self.k_bf16), ("v", self.v_bf16)):
            parts = [bf16[layer, seq_id, :, :min(n, self.sink)].float()]
            if qn:
                cache = QuantizedKV(self.scheme, self.page_size, self.k_codes[layer], self.k_params[layer],
                                    self.v_codes[layer], self.v_params[layer],
                                    self.page_table[seq_id:seq_id + 1, :-(-qn // self.page_size)],
                                    torch.tensor([qn], dtype=torch.int32, device=self.device), self.arch.layout)
                parts.append(cache.dequantize(torch.float32)[0 if role == "k" else 1][0, :, :qn])
            recent = [self._ring_slot(p) for p in range(self.sink + qn, n)]
            parts.append(bf16[layer, seq_id][:, torch.tensor(recent, dtype=torch.int64, device=self.device)].float())
            out.append(torch.cat(parts, dim=1))
        return tuple(out)
