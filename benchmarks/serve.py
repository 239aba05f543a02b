"""Serving throughput at a long-context workload: a graph-captured decode loop of a full-size model,
the largest concurrency each KV format fits in memory, aggregate and per-sequence output tokens/s.

    python -m benchmarks.serve [--quick] [--formats bf16,fp8,fp8-xqa,int4,int2,k4v2,int2-kivi] [--out DIR]
    python -m benchmarks.serve --formats int4,int2 --append   # add formats to today's records
    python -m benchmarks.serve --model tiny --device cpu      # the loop and the memory account, seconds

Model: Qwen3-8B geometry (36 layers, hidden 4096, 32 query / 8 KV heads, head_dim 128, per-head
q/k RMSNorm, RoPE theta 1e6, SwiGLU MLP 12288, vocab 151936, untied LM head), random BF16 weights
made on the device: decode throughput does not depend on weight values. The decoder below is plain
torch; its attention is a pluggable backend (``append_attend(layer, q, k, v)``), one per KV format.

Workload (FOSCAR paper: 100K-token inputs, 99% prefix-cache hit, 1K outputs): N sequences, each with
a ``--context``-token prefix already in its cache, then decode steps. The prefix is random codes and
scales (FOSCAR) or random BF16/FP8 values (FlashInfer) written straight into the pages at the real
layout: the bytes read per step are those of a real prefix, and attention time does not depend on
the values. Each sequence's pages cover ``--context + --output-len`` tokens, so max N is the
concurrency at which every sequence can still generate its outputs.

One decode step = one CUDA-graph replay of the whole model step: embedding, every layer (QKV,
q/k norm, RoPE, append of the new K/V, attention, output projection, MLP), final norm, logits,
greedy sample written back to the static token buffer; no host sync inside. Timed: ``--steps``
replays back to back after ``--warmup`` replays (CUDA events), per format and N:
aggregate tokens/s = N * steps / time, per-sequence tokens/s = steps / time.

Formats (``FORMATS``; a format that cannot run is reported as missing, never dropped):
  bf16, fp8  FlashInfer BatchDecodeWithPagedKVCacheWrapper (HND pages of 64, tensor cores, as
             benchmarks/decode.py; installed by the ``bench`` extra, ``pip install -e '.[bench]'``); the new token is written at position ``context`` of each
             sequence every step and attention covers ``context + 1`` tokens, planned once per N
             (an engine re-plans on the host between steps as lengths grow; over 64+ steps of a
             100K context that changes the work by < 0.1%)
  fp8-xqa    the same FP8 pages through FlashInfer's XQA decode (TensorRT-LLM's Hopper FP8 kernel: Q and P in
             e4m3 for the products), the faster FP8 path on sm_90 (benchmarks/NOTES.md section 19)
  int4, int2 FOSCAR ``PagedKVCache`` (token-wise K and V, groups of head_dim, pages of 128, BF16
             sink 64 + recent window 256; INT2 with Hadamard rotation as OSCAR runs it); lengths
             grow on the device and due tiles are quantized inside the graph
  k4v2       the same with 4-bit K and 2-bit V (``Scheme.make(k_bits=4, v_bits=2)``)
  int2-kivi  INT2 with K grouped per channel (KIVI's layout, groups of 128 tokens): the INT2 layout the
             accuracy evaluation (benchmarks/accuracy.py) finds accurate, token-wise INT2 is not

Memory account per format (bytes): device total = other (CUDA context, libraries, measured before
the format allocates) + weights + KV pages + BF16 window + metadata (page tables, lengths) +
workspace (FlashInfer's buffer and ``--reserve-gib`` for step temporaries; the temporaries the steps
did use are measured) + free (less than one more sequence). Max N is the most that fits.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from .decode import XQA_PAGE

GIB = 2**30


# ----------------------------------------------------------------------------- model
@dataclass(frozen=True)
class Geometry:
    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    rope_theta: float = 1e6
    eps: float = 1e-6


@dataclass(frozen=True)
class Preset:
    geometry: Geometry
    context: int  # prefix tokens in each sequence's cache
    output_len: int  # tokens each sequence may still generate (its pages are reserved up front)
    steps: int  # timed replays per point
    warmup: int  # replays before timing
    points: int  # concurrency levels per format
    reserve_gib: float  # kept free for step temporaries
    memory_gib: float | None  # memory budget; None: the device's total


PRESETS = {
    "qwen3-8b": Preset(Geometry("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936), 100_000, 1024, 64, 4, 6, 2.0, None),
    # tiny: two quantized pages behind the BF16 sink + window; 6 MiB hold 3 (INT4) or 4 (INT2) sequences
    "tiny": Preset(Geometry("tiny", 2, 256, 4, 2, 64, 512, 1024), 512, 64, 4, 1, 3, 1 / 1024, 6 / 1024),
}


def rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def apply_rope(x, cos, sin):
    """Rotate-half RoPE of ``x [n, heads, D]`` at angles ``[n, D/2]`` (fp32)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@dataclass
class Layer:
    attn_norm: torch.Tensor
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, hidden]
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: torch.Tensor  # [hidden, Hq D]
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 mlp, hidden]
    down: torch.Tensor  # [hidden, mlp]


class Decoder:
    """A Qwen3-style decoder for one decode step of a batch; attention comes from a backend."""

    def __init__(self, geo: Geometry, device, seed: int = 0, dtype=torch.bfloat16):
        self.geo, self.device = geo, torch.device(device)
        gen = torch.Generator(self.device).manual_seed(seed)

        def linear(out_features, in_features):  # fan-in scaled, so activations stay O(1)
            w = torch.randn(out_features, in_features, generator=gen, device=self.device, dtype=dtype)
            return w.mul_(in_features**-0.5)

        def ones(n):
            return torch.ones(n, device=self.device, dtype=dtype)

        h, d = geo.hidden, geo.head_dim
        self.embed = torch.randn(geo.vocab, h, generator=gen, device=self.device, dtype=dtype)
        self.layers = [Layer(ones(h), linear((geo.q_heads + 2 * geo.kv_heads) * d, h), ones(d), ones(d),
                             linear(h, geo.q_heads * d), ones(h), linear(2 * geo.mlp, h), linear(h, geo.mlp))
                       for _ in range(geo.layers)]
        self.final_norm = ones(h)
        self.lm_head = linear(geo.vocab, h)
        self.inv_freq = geo.rope_theta ** -(torch.arange(0, d, 2, device=self.device, dtype=torch.float32) / d)

    def nbytes(self) -> int:
        tensors = [self.embed, self.final_norm, self.lm_head, self.inv_freq]
        tensors += [t for layer in self.layers for t in vars(layer).values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, tokens, positions, append_attend):
        """Logits ``[n, vocab]`` for ``tokens [n]`` at ``positions [n]``; ``append_attend(layer, q
        [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D])`` stores the new K/V and returns attention ``[n, Hq, D]``."""
        g = self.geo
        n, d = tokens.shape[0], g.head_dim
        angles = positions.float()[:, None] * self.inv_freq[None]
        cos, sin = angles.cos(), angles.sin()
        x = F.embedding(tokens, self.embed)
        for i, layer in enumerate(self.layers):
            q, k, v = F.linear(rms_norm(x, layer.attn_norm, g.eps), layer.qkv).split(
                [g.q_heads * d, g.kv_heads * d, g.kv_heads * d], dim=-1)
            q = apply_rope(rms_norm(q.reshape(n, g.q_heads, d), layer.q_norm, g.eps), cos, sin)
            k = apply_rope(rms_norm(k.reshape(n, g.kv_heads, d), layer.k_norm, g.eps), cos, sin)
            attn = append_attend(i, q, k, v.reshape(n, g.kv_heads, d).contiguous())
            x = x + F.linear(attn.reshape(n, g.q_heads * d), layer.o)
            gate, up = F.linear(rms_norm(x, layer.mlp_norm, g.eps), layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        return F.linear(rms_norm(x, self.final_norm, g.eps), self.lm_head)


# ----------------------------------------------------------------------------- KV formats
class FormatMissing(RuntimeError):
    """The format cannot run here (library or API absent, wrong device); reported as missing."""


@dataclass(frozen=True)
class Format:
    backend: str  # "flashinfer" or "foscar"
    description: str
    kv_dtype: str | None = None  # flashinfer: torch dtype name of the pages
    scheme: dict = field(default_factory=dict)  # foscar: Scheme.make bit-width arguments
    rotate: bool = False  # foscar: Hadamard rotation of K and Q


FORMATS = {
    "bf16": Format("flashinfer", "FlashInfer paged decode, BF16 pages", kv_dtype="bfloat16"),
    "fp8": Format("flashinfer", "FlashInfer paged decode, FP8 e4m3 pages (scale 1)", kv_dtype="float8_e4m3fn"),
    "fp8-xqa": Format("flashinfer-xqa", "FlashInfer XQA decode (TensorRT-LLM's Hopper FP8 kernel), FP8 e4m3 pages "
                      "(scale 1)", kv_dtype="float8_e4m3fn"),
    "int4": Format("foscar", "FOSCAR INT4 token-wise K/V + BF16 sink 64 + window 256", scheme=dict(bits=4)),
    "int2": Format("foscar", "FOSCAR INT2 token-wise K/V + BF16 sink 64 + window 256, Hadamard-rotated K/Q",
                   scheme=dict(bits=2), rotate=True),
    "k4v2": Format("foscar", "FOSCAR INT4 K / INT2 V token-wise + BF16 sink 64 + window 256",
                   scheme=dict(k_bits=4, v_bits=2)),
    "int2-kivi": Format("foscar", "FOSCAR INT2 K channel-wise g128 / V token-wise + BF16 sink 64 + window 256, "
                        "Hadamard-rotated K/Q", scheme=dict(bits=2, k="channel", k_group=128), rotate=True),
}


def fill_random_(t: torch.Tensor, generator, chunk: int = 2**28) -> None:
    """Random contents for timing, ``chunk`` elements at a time (pools of 100+ GiB; FP8 goes through
    a BF16 temporary of one chunk): any bit pattern of an integer pool, N(0, 1) floats."""
    for part in t.view(-1).split(chunk):
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            part.copy_(torch.randn(part.shape, generator=generator, device=t.device, dtype=torch.bfloat16))
        elif t.is_floating_point():
            part.normal_(generator=generator)
        else:
            part.random_(generator=generator)


class FlashInferKV:
    """FlashInfer ``BatchDecodeWithPagedKVCacheWrapper`` over one page pool for all layers
    (``[layers, pages, 2, kv_heads, 64, D]``, HND); sequence ``s`` owns pages ``[s P, (s + 1) P)``."""

    PAGE = 64
    WORKSPACE = 256 * 2**20  # as benchmarks/decode.py

    @staticmethod
    def check(device):
        if device.type != "cuda":
            raise FormatMissing("FlashInfer runs on CUDA devices only")
        from .decode import import_flashinfer

        try:
            import_flashinfer()
        except ImportError as exc:
            raise FormatMissing(f"flashinfer is not importable ({exc})") from None

    @classmethod
    def footprint(cls, geo, fmt, capacity):
        """(bytes per sequence, fixed bytes), by part of the memory account."""
        page_bytes = geo.layers * 2 * geo.kv_heads * cls.PAGE * geo.head_dim * getattr(torch, fmt.kv_dtype).itemsize
        return {"kv_pages": -(-capacity // cls.PAGE) * page_bytes}, {"workspace": cls.WORKSPACE}

    def __init__(self, geo, fmt, max_seqs, context, capacity, device, generator):
        import flashinfer

        self.geo, self.context = geo, context
        self.kv_dtype = getattr(torch, fmt.kv_dtype)
        self.pages_per_seq = -(-capacity // self.PAGE)
        self.kv = torch.empty(geo.layers, max_seqs * self.pages_per_seq, 2, geo.kv_heads, self.PAGE, geo.head_dim,
                              dtype=self.kv_dtype, device=device)
        fill_random_(self.kv, generator)
        # row view [layers, pages * 2 * kv_heads * 64, D] for the appends (FP8 as bytes: index_copy_ of raw bits)
        raw = self.kv.view(torch.uint8) if self.kv_dtype.itemsize == 1 else self.kv
        self.rows = raw.view(geo.layers, -1, geo.head_dim)
        self.workspace = torch.zeros(self.WORKSPACE, dtype=torch.uint8, device=device)
        self.attention = self.make_attention(flashinfer)
        self.scales = dict(k_scale=1.0, v_scale=1.0) if self.kv_dtype != torch.bfloat16 else {}

    def make_attention(self, flashinfer):
        """The FlashInfer object that attends (planned by :meth:`plan`, called by :meth:`attend`)."""
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "HND", use_tensor_cores=True)

    def nbytes(self):
        return {"kv_pages": self.kv.numel() * self.kv.element_size(), "workspace": self.WORKSPACE}

    @staticmethod
    def page_plan(batch, pages_per_seq, length, page):
        """FlashInfer's ``(indptr, indices, last_page_len)`` (int32) for sequences ``0 .. batch - 1``
        of ``length`` tokens each, sequence ``s`` owning pages ``[s pages_per_seq, (s + 1) pages_per_seq)``."""
        used = -(-length // page)
        seqs = torch.arange(batch, dtype=torch.int32)
        indices = (seqs[:, None] * pages_per_seq + torch.arange(used, dtype=torch.int32)[None]).flatten()
        indptr = torch.arange(batch + 1, dtype=torch.int32) * used
        return indptr, indices, torch.full((batch,), length - page * (used - 1), dtype=torch.int32)

    @staticmethod
    def token_rows(batch, pages_per_seq, position, kv_heads, page):
        """Rows ``[batch * kv_heads]`` (sequence-major) of token ``position``'s K and V in the row view
        ``[pages * 2 * kv_heads * page, D]`` of one layer's HND pages ``[pages, 2, kv_heads, page, D]``."""
        first = torch.arange(batch)[:, None] * pages_per_seq + position // page
        k_rows = (first * 2 * kv_heads + torch.arange(kv_heads)[None]) * page + position % page
        return k_rows.flatten(), (k_rows + kv_heads * page).flatten()

    def prepare(self, batch):
        """Plan attention over ``context + 1`` tokens for sequences ``0 .. batch - 1``; each step
        writes their new token at position ``context``."""
        self.plan(batch)
        rows = self.token_rows(batch, self.pages_per_seq, self.context, self.geo.kv_heads, self.PAGE)
        self.k_rows, self.v_rows = (r.to(self.kv.device) for r in rows)

    def plan(self, batch):
        g, dev = self.geo, self.kv.device
        plan = self.page_plan(batch, self.pages_per_seq, self.context + 1, self.PAGE)
        self.attention.plan(*(t.to(dev) for t in plan), g.q_heads, g.kv_heads, g.head_dim, self.PAGE,
                            q_data_type=torch.bfloat16, kv_data_type=self.kv_dtype)

    def tokens_held(self, batch):
        return None  # fixed by the plan

    def _store(self, x):
        x = x.reshape(-1, self.geo.head_dim).to(self.kv_dtype)
        return x.view(torch.uint8) if self.kv_dtype.itemsize == 1 else x

    def append_attend(self, layer, q, k, v):
        self.rows[layer].index_copy_(0, self.k_rows, self._store(k))
        self.rows[layer].index_copy_(0, self.v_rows, self._store(v))
        return self.attend(layer, q)

    def attend(self, layer, q):
        return self.attention.run(q, self.kv[layer], **self.scales)


class FlashInferXQAKV(FlashInferKV):
    """The same FP8 pages attended by FlashInfer's XQA decode (``benchmarks.decode.FlashInferXQADecode``'s call):
    on sm_90 the faster FP8 path, whose products take Q and P in e4m3 (``benchmarks/NOTES.md`` section 19)."""

    PAGE = XQA_PAGE

    def make_attention(self, flashinfer):
        from .decode import xqa_decode_of

        return xqa_decode_of(flashinfer)

    @staticmethod
    def check(device):
        FlashInferKV.check(device)
        from .decode import import_flashinfer, xqa_decode_of

        try:
            xqa_decode_of(import_flashinfer())
        except ImportError as exc:
            raise FormatMissing(str(exc)) from None

    def plan(self, batch):
        """Sequences ``0 .. batch - 1`` of ``context + 1`` tokens, each over its own pages."""
        g, dev = self.geo, self.kv.device
        self.block_tables = torch.arange(batch * self.pages_per_seq, dtype=torch.int32, device=dev).view(batch, -1)
        self.seq_lens = torch.full((batch,), self.context + 1, dtype=torch.int32, device=dev).view(torch.uint32)
        self.out = torch.empty(batch, g.q_heads, g.head_dim, dtype=torch.bfloat16, device=dev)

    def attend(self, layer, q):
        self.attention(q, self.kv[layer], self.workspace, self.block_tables, self.seq_lens,
                       self.pages_per_seq * self.PAGE, bmm1_scale=self.geo.head_dim**-0.5, bmm2_scale=1.0,
                       out=self.out, kv_layout="HND")
        return self.out


def foscar_scheme(geo, fmt):
    from foscar import Scheme

    return Scheme.make(**{"k": "token", "v": "token", **fmt.scheme}, head_dim=geo.head_dim,
                       gqa_ratio=geo.q_heads // geo.kv_heads)


def prefill_random(cache, context, capacity, generator) -> list[int]:
    """Fill a :class:`~foscar.cache.PagedKVCache` with random codes, scales and BF16 parts, and make
    its ``max_seqs`` sequences (ids 0, 1, ...) of ``context`` tokens each, pages reserved for ``capacity``."""
    for t in (cache.k_codes, cache.k_params, cache.v_codes, cache.v_params, cache.k_bf16, cache.v_bf16):
        fill_random_(t, generator)
    seqs = [cache.allocate_prefilled(context) for _ in range(cache.max_seqs)]
    for seq in seqs:
        cache.reserve(seq, capacity)
    return seqs


class FoscarKV:
    """FOSCAR ``PagedKVCache`` (all layers, one page pool): append and attend per layer."""

    SINK, WINDOW = 64, 256

    @staticmethod
    def check(device):
        pass  # the torch path runs anywhere; a missing scheme shows in footprint()

    @classmethod
    def _cache(cls, geo, fmt, num_pages, max_seqs, capacity, device):
        from foscar.cache import PagedKVCache

        return PagedKVCache(foscar_scheme(geo, fmt), geo.layers, geo.kv_heads, num_pages, max_seqs, capacity,
                            sink=cls.SINK, window=cls.WINDOW, rotate=fmt.rotate, device=device,
                            use_kernels=False if str(device) == "meta" else None)

    @staticmethod
    def _parts(cache):
        size, lengths = cache.nbytes(), cache.lengths
        return {"kv_pages": size["quantized"], "bf16_window": size["bf16"],
                "metadata": size["page_table"] + lengths.numel() * lengths.element_size()}

    @classmethod
    def footprint(cls, geo, fmt, capacity):
        """(bytes per sequence, fixed bytes), by part, from a cache of one sequence on the meta device."""
        probe = cls._cache(geo, fmt, 1, 1, capacity, "meta")
        per_seq = {**cls._parts(probe), "kv_pages": probe.pages_for(capacity) * probe.bytes_per_page()}
        return per_seq, {"kv_pages": probe.bytes_per_page()}  # fixed: the trash page

    def __init__(self, geo, fmt, max_seqs, context, capacity, device, generator):
        probe = self._cache(geo, fmt, 1, 1, capacity, "meta")
        self.cache = self._cache(geo, fmt, max_seqs * probe.pages_for(capacity), max_seqs, capacity, device)
        self.seqs = prefill_random(self.cache, context, capacity, generator)

    def nbytes(self):
        return self._parts(self.cache)

    def prepare(self, batch):
        self.ids = self.seqs[:batch]

    def tokens_held(self, batch):
        return self.cache.lengths[:, :batch].clone()

    def append_attend(self, layer, q, k, v):
        self.cache.append(layer, self.ids, k[:, :, None], v[:, :, None])
        return self.cache.attend(layer, self.ids, q.contiguous())


BACKENDS = {"flashinfer": FlashInferKV, "flashinfer-xqa": FlashInferXQAKV, "foscar": FoscarKV}


# ----------------------------------------------------------------------------- memory account
ACCOUNT_PARTS = ("other", "weights", "kv_pages", "bf16_window", "metadata", "workspace", "free")


def plan_capacity(total, other, weights, reserve, per_seq, fixed, cap=None):
    """Max concurrency (at most ``cap``) and the memory account at it: every part in bytes, summing
    to ``total``; returns (max N, account, bytes per sequence)."""
    per = sum(per_seq.values())
    available = total - other - weights - reserve - sum(fixed.values())
    max_batch = max(0, available // per)
    if cap:
        max_batch = min(max_batch, cap)
    account = dict.fromkeys(ACCOUNT_PARTS, 0)
    account.update(other=other, weights=weights, workspace=reserve)
    for part, value in fixed.items():
        account[part] += value
    for part, value in per_seq.items():
        account[part] += max_batch * value
    account["free"] = total - sum(account[p] for p in ACCOUNT_PARTS if p != "free")
    return max_batch, account, per


TOP_FRACTIONS = (0.6, 0.75, 0.9)  # extra levels below the maximum, where a peak can hide


def concurrency_grid(max_batch: int, points: int) -> list[int]:
    """Geometric concurrency levels from 1 to ``max_batch`` (``points`` of them before rounding), plus
    ``TOP_FRACTIONS`` of the maximum: a format's peak can sit below its max N (FlashInfer FP8 at 100K
    prefixes: 269 tok/s at N=10, 191 at N=17, nothing measured between in the first run)."""
    if max_batch < 1:
        return []
    if points < 2 or max_batch == 1:
        return [max_batch]
    grid = {round(max_batch ** (i / (points - 1))) for i in range(points)}
    return sorted(grid | {max(1, round(max_batch * f)) for f in TOP_FRACTIONS})


# ----------------------------------------------------------------------------- the step loop
@functools.cache
def _side_stream(device):
    """One warm-up stream for every loop: libraries keep per-stream state (cuBLAS a workspace), so a
    fresh stream per concurrency level would pile that up."""
    return torch.cuda.Stream(device)


class DecodeLoop:
    """Decode steps for sequences ``0 .. batch - 1``: static token and position buffers; on CUDA one
    step is captured into a CUDA graph (no allocation, no host sync in a replay) unless ``graph`` is False."""

    def __init__(self, model: Decoder, backend, batch: int, position: int, generator, graph: bool = True):
        self.model, self.backend, self.use_graph = model, backend, graph
        dev = model.device
        self.tokens = torch.randint(0, model.geo.vocab, (batch,), generator=generator, device=dev)
        self.positions = torch.full((batch,), position, dtype=torch.int64, device=dev)
        self.graph = None
        backend.prepare(batch)

    def step(self):
        logits = self.model.forward(self.tokens, self.positions, self.backend.append_attend)
        self.tokens.copy_(logits.argmax(dim=-1))
        self.positions.add_(1)

    def capture(self):
        """One eager step (compiles kernels, caches index tensors, initializes cuBLAS), then, on
        CUDA, capture one step into a graph. The eager step on a side stream, as torch asks."""
        if self.model.device.type != "cuda" or not self.use_graph:
            self.step()
            return
        stream = _side_stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.step()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        # a capture allocates from the graph's own pool and cannot free blocks cached elsewhere: release what the
        # eager step cached first (benchmarks/tp.py's BF16 on transformers 5.17: tens of GiB of K/V copies)
        torch.cuda.empty_cache()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()

    def run(self, steps: int) -> float:
        """Seconds for ``steps`` steps back to back (CUDA events around the replays)."""
        if self.graph is None:
            start = time.perf_counter()
            for _ in range(steps):
                self.step()
            return time.perf_counter() - start
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            self.graph.replay()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3


def measure_point(model, backend, batch, preset, generator, graph: bool = True):
    """One concurrency level: capture (``graph``, on CUDA), warm up, time; checks that the loop made
    in-range tokens and, where the cache tracks lengths, that every layer advanced by one token per step."""
    before = backend.tokens_held(batch)
    loop = DecodeLoop(model, backend, batch, preset.context, generator, graph)
    start_tokens = loop.tokens.clone()
    loop.capture()
    loop.run(preset.warmup)
    seconds = loop.run(preset.steps)
    tokens = loop.tokens.cpu()
    appended = 1 + preset.warmup + preset.steps  # the eager step, the warm-up and the timed replays
    point = {"batch": batch, "steps": preset.steps, "ms_per_step": 1e3 * seconds / preset.steps,
             "aggregate_tokens_per_s": batch * preset.steps / seconds,
             "per_sequence_tokens_per_s": preset.steps / seconds,
             "tokens_in_range": bool(((tokens >= 0) & (tokens < model.geo.vocab)).all()),
             "tokens_changed": bool((tokens != start_tokens.cpu()).any()),
             "positions_advanced": int((loop.positions - preset.context).min()) == appended}
    after = backend.tokens_held(batch)
    point["cache_advanced"] = None if before is None else bool(((after - before) == appended).all())
    failed = [check for check in ("tokens_in_range", "tokens_changed", "positions_advanced", "cache_advanced")
              if point[check] is False]
    if failed:  # the timing stands, but the loop did not do what a decode step does
        point["note"] = f"check failed: {', '.join(failed)}"
    del loop
    return point


# ----------------------------------------------------------------------------- the sweep
def device_memory(device, budget_gib, weights):
    """(total, other) bytes: the device's (or ``budget_gib``'s) total, and what is in use besides the
    weights (CUDA context, libraries, anything torch still holds)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if budget_gib is not None:
            free -= total - int(budget_gib * GIB)
            total = int(budget_gib * GIB)
        return total, max(0, total - free - weights)
    if budget_gib is None:
        raise ValueError("--memory-gib is needed on the CPU (no device memory to read)")
    return int(budget_gib * GIB), 0


def run_format(name, model, preset, device, log, seed=0, max_batch_cap=None):
    """Plan, allocate, sweep one format; returns its record (status ok / missing / failed)."""
    fmt = FORMATS[name]
    rec = {"format": name, "backend": fmt.backend, "description": fmt.description, "status": "ok", "note": "",
           "max_batch": 0, "account": {}, "points": []}
    backend = None
    capacity = preset.context + preset.output_len
    gen = torch.Generator(device).manual_seed(seed)
    try:
        cls = BACKENDS[fmt.backend]
        cls.check(device)
        per_seq, fixed = cls.footprint(model.geo, fmt, capacity)
        total, other = device_memory(device, preset.memory_gib, model.nbytes())
        reserve = int(preset.reserve_gib * GIB)
        max_batch, account, per = plan_capacity(total, other, model.nbytes(), reserve, per_seq, fixed, max_batch_cap)
        rec.update(max_batch=max_batch, account=account, bytes_per_sequence=per, per_sequence=per_seq, fixed=fixed)
        if max_batch < 1:
            raise MemoryError(f"not one sequence of {capacity} tokens fits ({per / GIB:.2f} GiB each)")
        log(f"{name}: max N {max_batch} ({per / GIB:.3f} GiB per sequence); allocating")
        backend = cls(model.geo, fmt, max_batch, preset.context, capacity, device, gen)
        measured = backend.nbytes()
        planned = {part: fixed.get(part, 0) + max_batch * per_seq.get(part, 0) for part in measured}
        if part := next((p for p in measured if measured[p] != planned[p] and p != "workspace"), None):
            raise AssertionError(f"memory account: {part} is {measured[part]} bytes, planned {planned[part]}")
        if device.type == "cuda":  # from here on: what the steps need beyond weights and pages
            torch.cuda.reset_peak_memory_stats(device)
        grid = concurrency_grid(max_batch, preset.points)
        rec["grid"] = grid
        for batch in grid:
            t0 = time.perf_counter()
            try:
                point = measure_point(model, backend, batch, preset, gen)
            except Exception as exc:  # keep the format's other points
                point = {"batch": batch, "note": f"failed: {type(exc).__name__}: {str(exc)[:300]}"}
            rec["points"].append(point)
            result = (f"{point['ms_per_step']:.2f} ms/step, {point['aggregate_tokens_per_s']:.1f} tok/s"
                      if "ms_per_step" in point else "")
            log(f"{name}: N {batch}: {result} {point.get('note', '')} ({time.perf_counter() - t0:.1f} s)")
            _release(device)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            rec["measured"] = {"peak_allocated": peak,
                               "step_temporaries": peak - model.nbytes() - sum(measured.values())}
    except FormatMissing as exc:
        rec.update(status="missing", note=str(exc))
    except Exception as exc:  # reported, never dropped
        rec.update(status="failed", note=f"{type(exc).__name__}: {str(exc)[:300]}")
    finally:
        del backend
        _release(device)
    timed = [p for p in rec["points"] if "aggregate_tokens_per_s" in p]
    rec["peak"] = max(timed, key=lambda p: p["aggregate_tokens_per_s"]) if timed else None
    if rec["status"] == "ok" and not timed:
        rec.update(status="failed", note=rec["note"] or "no point ran")
    log(f"{name}: {rec['status']}" + (f" ({rec['note']})" if rec["note"] else ""))
    return rec


def _release(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# peak ratios the project aims for, reported, not asserted (INT2 vs BF16 was 4.4x before the read-ceiling work)
TARGETS = (("int2", "bf16", 5.5), ("int2", "fp8", 2.0), ("int2", "fp8-xqa", 2.0), ("int4", "bf16", 3.0))


def peak_ratios(records):
    peaks = {r["format"]: r["peak"]["aggregate_tokens_per_s"] for r in records if r["peak"]}
    out = []
    for fmt, base, target in TARGETS:
        ratio = peaks[fmt] / peaks[base] if fmt in peaks and base in peaks else None
        out.append({"format": fmt, "baseline": base, "target": target, "ratio": ratio,
                    "met": None if ratio is None else ratio >= target})
    return out


# ----------------------------------------------------------------------------- records
def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def summary_table(records):
    lines = ["| format | status | max N | N | ms/step | aggregate tok/s | per-seq tok/s | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        if not r["points"]:
            lines.append(f"| {r['format']} | {r['status']} | {r['max_batch']} | - | - | - | - | {r['note']} |")
        for p in r["points"]:
            peak = " (peak)" if p == r["peak"] else ""
            lines.append(f"| {r['format']} | {r['status']} | {r['max_batch']} | {p['batch']}{peak} | "
                         f"{_fmt(p.get('ms_per_step'), '.2f')} | {_fmt(p.get('aggregate_tokens_per_s'), '.1f')} | "
                         f"{_fmt(p.get('per_sequence_tokens_per_s'), '.2f')} | {p.get('note', '')} |")
    return "\n".join(lines)


def account_table(records):
    accounts = [r for r in records if r["account"]]
    unit, size = ("GiB", GIB) if any(sum(r["account"].values()) >= GIB for r in accounts) else ("MiB", 2**20)
    lines = [f"Memory account at max N ({unit}):", "",
             "| format | max N | per sequence | " + " | ".join(ACCOUNT_PARTS) + " | total | step temporaries used |",
             "|---|---|---|" + "---|" * (len(ACCOUNT_PARTS) + 2)]
    for r in accounts:
        a = r["account"]
        used = r.get("measured", {}).get("step_temporaries")
        lines.append(f"| {r['format']} | {r['max_batch']} | {r['bytes_per_sequence'] / size:.3f} | "
                     + " | ".join(f"{a[p] / size:.2f}" for p in ACCOUNT_PARTS) + f" | {sum(a.values()) / size:.2f} | "
                     + ("-" if used is None else f"{used / size:.2f}") + " |")
    return "\n".join(lines)


def write_records(records, meta, stem):
    ratios = peak_ratios(records)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "formats": records, "peak_ratios": ratios}, f, indent=1)
    verdict = {None: "-", True: "met", False: "not met"}
    ratio_lines = [f"- {x['format']} / {x['baseline']} peak aggregate: {_fmt(x['ratio'], '.2f')}x (target "
                   f">= {x['target']}x: {verdict[x['met']]})" for x in ratios]
    with open(stem + ".md", "w") as f:
        f.write(f"# Serving throughput, {meta['model']} ({meta['device']}, {meta['date']})\n\n"
                f"Command: `{meta['command']}`. Versions: {meta['versions']}.\n\n{meta['workload']}\n\n"
                f"{summary_table(records)}\n\nPeaks (targets are reported, not asserted):\n\n"
                + "\n".join(ratio_lines) + "\n\n" + account_table(records) + "\n")


def plot(records, meta, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    missing = []
    for r in records:
        pts = [p for p in r["points"] if "aggregate_tokens_per_s" in p]
        if not pts:
            missing.append(f"{r['format']}: {r['status']}")
            continue
        xs = [p["per_sequence_tokens_per_s"] for p in pts]
        ys = [p["aggregate_tokens_per_s"] for p in pts]
        ax.plot(xs, ys, marker="o", label=f"{r['format']} (max N {r['max_batch']})")
        for p, x, y in zip(pts, xs, ys):
            ax.annotate(f"N={p['batch']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("per-sequence output tokens/s")
    ax.set_ylabel("aggregate output tokens/s")
    ax.set_title(f"{meta['model']}, {meta['context']}-token prefixes ({meta['device']})", fontsize=10)
    ax.grid(alpha=0.3)
    if len(missing) < len(records):
        ax.legend(fontsize=8)
    if missing:
        ax.text(0.01, 0.01, "not run: " + "; ".join(missing), transform=ax.transAxes, fontsize=7, va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _versions():
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    for name in ("flashinfer", "cutlass", "triton"):
        try:
            out[name] = getattr(__import__(name), "__version__", "?")
        except Exception as exc:
            out[name] = f"missing ({type(exc).__name__})"
    return out


def workload_note(preset, device):
    step = "one CUDA-graph replay of the whole model step" if device.type == "cuda" else "one eager step (CPU)"
    return (f"Workload: N sequences with a {preset.context}-token prefix each (random codes/values written straight "
            f"into the pages at the real layout; pages reserved for {preset.output_len} more tokens), random BF16 "
            f"weights (throughput does not depend on weight values). One step = {step} with greedy sampling; "
            f"{preset.steps} steps timed after {preset.warmup} warm-up steps. FlashInfer formats attend over "
            "context + 1 tokens, planned once per N; FOSCAR lengths grow on the device.")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(PRESETS), default="qwen3-8b")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    parser.add_argument("--quick", action="store_true", help="3 concurrency levels per format (default: 6; tiny 3)")
    parser.add_argument("--points", type=int, default=None, help="concurrency levels per format")
    parser.add_argument("--max-batch", type=int, default=None, help="cap the concurrency below what fits")
    parser.add_argument("--context", type=int, default=None, help="prefix tokens per sequence (default: the preset's)")
    parser.add_argument("--output-len", type=int, default=None, help="output tokens each sequence has pages for")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per point (default 64)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--memory-gib", type=float, default=None, help="memory budget (default: the GPU's total)")
    parser.add_argument("--reserve-gib", type=float, default=None, help="kept free for step temporaries")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="results folder (default: benchmarks/results for qwen3-8b, "
                        "none for tiny)")
    parser.add_argument("--tag", default=None, help="file stem (default serve-<model>-<device>-<date>)")
    parser.add_argument("--append", action="store_true", help="add to the records at the same stem (formats run "
                        "again replace theirs): a sweep split over several commands")
    args = parser.parse_args(argv)
    base = PRESETS[args.model]
    if args.quick and args.points is None:
        args.points = 3
    for name in ("context", "output_len", "steps", "warmup", "points", "reserve_gib", "memory_gib"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(base, name))
    unknown = [f for f in args.formats.split(",") if f not in FORMATS]
    if unknown:
        parser.error(f"--formats: unknown {unknown}; known: {list(FORMATS)}")
    for name in ("context", "steps", "points"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    # every point appends 1 + warmup + steps tokens to sequence 0 (lengths keep growing across points)
    need = args.points * (1 + args.warmup + args.steps)
    if need > args.output_len:
        parser.error(f"--output-len {args.output_len} is less than the {need} tokens the sweep appends to a sequence "
                     f"({args.points} points x (1 + {args.warmup} warm-up + {args.steps} steps))")
    if args.out is None and args.model != "tiny":
        args.out = os.path.join(os.path.dirname(__file__), "results")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.model != "tiny" and device.type != "cuda":
        sys.exit(f"benchmarks.serve --model {args.model} needs a CUDA GPU (use --model tiny on the CPU)")
    preset = PRESETS[args.model]
    preset = Preset(preset.geometry, args.context, args.output_len, args.steps, args.warmup, args.points,
                    args.reserve_gib, args.memory_gib)
    t_start = time.perf_counter()

    def log(msg):
        print(f"[serve {time.perf_counter() - t_start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    model = Decoder(preset.geometry, device, seed=args.seed)
    log(f"model {args.model}: {model.nbytes() / GIB:.2f} GiB of random BF16 weights on {device}")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "device": device_name,
            "versions": _versions(), "command": "python -m benchmarks.serve " + " ".join(argv), "model": args.model,
            "geometry": asdict(preset.geometry), "context": preset.context, "output_len": preset.output_len,
            "steps": preset.steps, "warmup": preset.warmup, "reserve_gib": preset.reserve_gib,
            "workload": workload_note(preset, device)}
    stem = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        slug = device_name.split()[-1].lower() if device.type == "cuda" else "cpu"
        stem = os.path.join(args.out, args.tag or f"serve-{args.model}-{slug}-{datetime.date.today().isoformat()}")
    run_names = args.formats.split(",")
    earlier = []
    if args.append and stem and os.path.exists(stem + ".json"):
        with open(stem + ".json") as f:
            old = json.load(f)
        same = ("model", "device", "context", "output_len", "steps", "warmup")
        if any(old["meta"].get(k) != meta[k] for k in same):
            sys.exit(f"--append: {stem}.json was measured with other settings "
                     f"({ {k: old['meta'].get(k) for k in same} }); use another --tag")
        earlier = [r for r in old["formats"] if r["format"] not in run_names]
        meta["command"] = f"{old['meta']['command']}; then {meta['command']}"
    records = []

    def everything():  # earlier formats and this run's, in FORMATS order
        return sorted(earlier + records, key=lambda r: list(FORMATS).index(r["format"]))

    threads = torch.get_num_threads()
    if device.type == "cpu":  # the tiny model is all per-op overhead: a thread pool only adds contention
        torch.set_num_threads(1)
    try:
        for name in run_names:
            records.append(run_format(name, model, preset, device, log, args.seed, args.max_batch))
            if stem:  # results so far survive a run cut short
                write_records(everything(), meta, stem)
    finally:
        torch.set_num_threads(threads)
    records = everything()
    if stem:
        try:
            plot(records, meta, stem + ".png")
        except Exception as exc:  # the JSON and the table are the record
            log(f"plot failed: {exc}")
    print(summary_table(records))
    print(account_table(records))
    for x in peak_ratios(records):
        print(f"{x['format']} / {x['baseline']} peak aggregate: {_fmt(x['ratio'], '.2f')}x (target >= {x['target']}x)")
    if stem:
        print(f"records: {stem}.json .md .png")
    log("done")
    return records


if __name__ == "__main__":
    main()
