"""Shared by the GPU tests, ``python -m foscar`` and the benchmarks: random problems and the
accuracy gate.

Tolerance rule (FlashAttention's): a kernel's max error against the float64 dequantize-then-attend
reference may be at most twice the max error of what a PyTorch user would compute in BF16 on the
same cache (``attend_dequantized_torch``), plus a small absolute floor for outputs that happen to be
nearly exact in BF16 (a few BF16 ulps of an O(1) output).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from .archs import HOPPER, arch_of_device
from .formats import FORMATS, INT2, INT4, Unsupported
from .quantize import QuantizedKV, quantize_kv
from .reference import attend_dequantized, attend_dequantized_torch
from .scheme import Axis, Scheme

ATOL_FLOOR = 1e-3


def random_problem(scheme: Scheme, lengths, kv_heads=2, page_size=64, device="cuda", generator=None, shuffle=True,
                   layout=None):
    """Fresh random ``q`` and a paged cache of random K/V (a per-channel K bias, as real keys have).

    ``layout``: the cache's bit order; default: what the CUDA device's kernel reads ("hopper" on CPU).
    """
    if layout is None:
        layout = (arch_of_device(device) if torch.device(device).type == "cuda" else HOPPER).layout
    lengths = list(lengths)
    if generator is None:  # a fresh seed every call, drawn on the host, generated on the device
        generator = torch.Generator(device).manual_seed(int.from_bytes(os.urandom(4), "little"))
    shape = (len(lengths), kv_heads, max(lengths), scheme.head_dim)
    kw = dict(generator=generator, device=generator.device)
    k = torch.randn(shape, **kw) + 2 * torch.randn(scheme.head_dim, **kw)
    v = torch.randn(shape, **kw)
    q = torch.randn(len(lengths), kv_heads * scheme.gqa_ratio, scheme.head_dim, **kw)
    to = dict(device=device, dtype=scheme.q_dtype)
    cache = quantize_kv(k.to(**to), v.to(**to), scheme, page_size, torch.tensor(lengths, dtype=torch.int32, device=device),
                        layout=layout)
    del k, v
    if shuffle:
        cache = cache.shuffle_pages(torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little")))
    return q.to(**to), cache


@dataclass
class Accuracy:
    err: float  # max |out - ref|
    lse_err: float  # max |lse - ref_lse|
    bf16_err: float  # max |torch bf16 - ref|
    tol: float
    where: str = ""  # which part of the output these numbers are of, where the check names one

    @property
    def ok(self) -> bool:
        return self.err <= self.tol and self.lse_err <= max(self.tol, 1e-3)


def check_output(out, lse, q, cache: QuantizedKV, sm_scale: float) -> Accuracy:
    """Compare every element of ``out`` (and ``lse`` if not None) with the float64 reference."""
    ref, ref_lse = attend_dequantized(q, cache, sm_scale)
    bf16 = attend_dequantized_torch(q, cache, sm_scale, dtype=q.dtype)
    bf16_err = float((bf16.double() - ref).abs().max())
    err = float((out.double() - ref).abs().max()) if torch.isfinite(out).all() else float("inf")
    lse_err = 0.0 if lse is None else (float((lse.double() - ref_lse).abs().max()) if torch.isfinite(lse).all() else float("inf"))
    return Accuracy(err, lse_err, bf16_err, 2 * bf16_err + ATOL_FLOOR)


def causal_attention(q, k, v, sm_scale, dtype):
    """``(out [L, Hq, D], lse [L, Hq])`` of ``q [L, Hq, D]``, the last ``L`` of the tokens of ``k, v [kvh, n, D]``
    (causal), computed in ``dtype`` (the lse in float64)."""
    tokens, hq, d = q.shape
    kvh, n = k.shape[:2]
    later = torch.arange(n)[None, :] > torch.arange(n - tokens, n)[:, None]
    qg = q.to(dtype).reshape(tokens, kvh, hq // kvh, d)
    scores = (torch.einsum("lhrd,hnd->lhrn", qg, k.to(dtype)) * sm_scale).masked_fill(later[:, None, None], -math.inf)
    p = torch.softmax(scores.double() if dtype == torch.float64 else scores.float(), -1).to(dtype)
    out = torch.einsum("lhrn,hnd->lhrd", p, v.to(dtype)).reshape(tokens, hq, d)
    return out, torch.logsumexp(scores.double(), -1).reshape(tokens, hq)


def causal_references(q, k, v, sm_scale):
    """float64 ``(out, lse)`` of :func:`causal_attention` and the same attention in q's dtype (what a PyTorch user
    gets: the tolerance rule's yardstick)."""
    return (*causal_attention(q, k, v, sm_scale, torch.float64), *causal_attention(q, k, v, sm_scale, q.dtype))


def check_causal_output(out, lse, q, cache: QuantizedKV, sm_scale: float) -> Accuracy:
    """:func:`check_output` of several query tokens per sequence (``q [batch, tokens, q_heads, head_dim]``, the
    sequences' last ``tokens`` tokens, causal), every element of every sequence (and of ``lse`` if not None); returns
    the worst sequence's numbers, ``where`` naming it."""
    k, v = cache.dequantize(torch.float64)
    per_sequence = []
    for b, n in enumerate(cache.lengths.tolist()):
        ref, ref_lse, low, _ = causal_references(q[b].cpu(), k[b, :, :n].cpu(), v[b, :, :n].cpu(), sm_scale)
        bf16_err = float((low.double() - ref).abs().max())
        err = float((out[b].cpu().double() - ref).abs().max()) if torch.isfinite(out[b]).all() else float("inf")
        lse_err = 0.0 if lse is None else (
            float((lse[b].cpu().double() - ref_lse).abs().max()) if torch.isfinite(lse[b]).all() else float("inf"))
        per_sequence.append(Accuracy(err, lse_err, bf16_err, 2 * bf16_err + ATOL_FLOOR, f"sequence {b} ({n} tokens)"))
    return max(per_sequence, key=lambda acc: (not acc.ok, acc.err / acc.tol))  # the worst sequence


def check_decode(scheme: Scheme, lengths=(1, 65, 1000, 4097), kv_heads: int = 2, page_size: int = 128) -> Accuracy:
    """``foscar.decode.decode`` of a fresh :func:`random_problem` into NaN-poisoned outputs, against float64
    (:func:`check_output`)."""
    from .decode import decode

    q, cache = random_problem(scheme, list(lengths), kv_heads=kv_heads, page_size=page_size)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=q.device)
    decode(q, cache, return_lse=True, out=out, lse=lse)
    return check_output(out, lse, q, cache, scheme.head_dim**-0.5)


def coverage_matrix(arch: str | None = None):
    """(scheme, page_size, lengths) covering the kernel issue's matrix without its full product; with
    ``arch``, only the schemes whose formats that arch builds operands for."""
    cases = []
    ragged = [1, 63, 65, 1000]
    for bits in (2, 4):
        for k_axis in Axis:
            for v_axis in Axis:
                cases.append((Scheme.make(bits, k_axis.value, 128, v_axis.value, 128, 128, 4), 128, ragged))
    for group in (32, 64):
        cases.append((Scheme.make(2, "token", group, "token", group, 128, 4), 64, ragged))
        cases.append((Scheme.make(4, "channel", group, "channel", group, 128, 4), 64, ragged))
        cases.append((Scheme.make(2, "channel", group, "token", group, 128, 6), 128, ragged))
        cases.append((Scheme.make(4, "token", group, "channel", group, 128, 5), 256, ragged))
    for head_dim in (64, 256):
        for bits in (2, 4):
            cases.append((Scheme.make(bits, "token", head_dim, "token", head_dim, head_dim, 7), 64, [129, 255, 2]))
            cases.append((Scheme.make(bits, "channel", 64, "channel", 64, head_dim, 2), 128, [129, 255, 2]))
    for ratio in (1, 2, 3, 5, 6, 7, 8, 16):
        cases.append((Scheme.make(2, "channel", 128, "token", 128, 128, ratio), 128, [300, 1]))
    # K and V of different widths, over the four fold cases (short sequences: the widths are what is new)
    for (k_bits, v_bits), (k_axis, v_axis) in zip([(4, 2), (2, 4), (4, 2), (2, 4)], [(a, b) for a in Axis for b in Axis]):
        scheme = Scheme.make(None, k_axis.value, 64, v_axis.value, 128, 128, 4, k_bits=k_bits, v_bits=v_bits)
        cases.append((scheme, 128, [1, 65, 300]))
    # every other registered format (foscar.formats; e.g. the INT8 of tests/user_formats.py): the four fold
    # cases, and as K next to INT4 V
    for fmt in FORMATS.values():
        if fmt in (INT2, INT4):
            continue
        for k_axis in Axis:
            for v_axis in Axis:
                cases.append((Scheme.make(None, k_axis.value, 128, v_axis.value, 128, 128, 4, format=fmt), 128,
                              [1, 65, 1000]))
        cases.append((Scheme.make(None, "channel", 128, "token", 128, 128, 4, k_format=fmt, v_bits=4), 128, [1, 300]))
    cases.append((Scheme.make(2, "token", 128, "token", 128, 128, 4), 256, [100_003]))
    cases.append((Scheme.make(4, "channel", 128, "token", 128, 128, 8), 128, [1 + (i * 37) % 300 for i in range(256)]))
    return cases if arch is None else [case for case in cases if _builds(case[0], arch)]


def _builds(scheme: Scheme, arch: str) -> bool:
    try:
        scheme.plan(arch)
    except Unsupported:
        return False
    return True
