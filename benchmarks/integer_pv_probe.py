"""Would an integer PV accumulator meet the accuracy rule? A float64 emulation on the CPU (benchmarks/NOTES.md 52).

    python -m benchmarks.integer_pv_probe [--lengths 700,4097] [--seeds 1,2,3] [--span 8192] [--out DIR --tag NAME]

The operands-as-bytes candidate of NOTES 51-52 (INT8 ``mma.sync``: codes as u8, Q and P*s' as two bytes each) pays
only if O^T stays in the two int32 PV accumulators across tiles, so that nothing runs per output element per tile.
Every rescale is then an exact shift: the running max (log2 domain) is rounded up to an integer, and P' = round(P *
s' * 2^E) is a 16-bit integer whose exponent E is either fixed over a CTA's span (``span`` policy: lowered, never
raised, as larger V scales arrive) or chosen per tile from the tile's largest scale (``tile``: both accumulators
shifted left or right by the change). K token-wise, V token-wise, INT2 group 128 (``int2-kt128``); Q as a 16-bit
integer per row (exact in two bytes), its Q.K exact; the offsets' correction and the row sums from the unrounded P;
spans merged by their lse. Each case is compared with float64 dequantize-then-attend, with the emulated FP16 kernel
(``foscar.reference.attend_folded(operand_dtype=float16)``), and with the rule (2x a BF16 PyTorch computation's
error). Cases: a query channel ``--q-outlier`` times the others (peaked softmax), one token's V scale
``--v-outlier`` times the others.
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks.records import run_meta, write
from foscar import Scheme
from foscar.reference import attend_dequantized, attend_dequantized_torch, attend_folded
from foscar.testing import ATOL_FLOOR, random_problem

LOG2E = 1 / math.log(2)
P_MAX = 2**16 - 1  # P' in two bytes
POLICIES = ("span", "tile")


def int16_rows(x):
    """Round to 16-bit integers times one power of two per row (the last dim: a query row's channels, or its P over
    the tokens): the byte candidate's Q and P, each split exactly into two bytes (NOTES 51)."""
    amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-300)
    scale = torch.exp2(torch.ceil(torch.log2(amax)) - 15)
    return torch.round(x / scale).clamp(-32768, 32767) * scale


def _span_output(t, codes16, sv, zv, policy: str, tile: int):
    """One CTA span of one sequence: ``t [h, r, n]`` log2 scores, ``codes16 [h, n, D]`` the V byte operand (16c),
    ``sv, zv [h, n]``. Returns (O [h, r, D], lse2 [h, r], largest accumulator value)."""
    kvh, rows, n = t.shape
    hi = torch.zeros(kvh, rows, codes16.shape[-1], dtype=torch.int64)
    lo = torch.zeros_like(hi)
    lsum = torch.zeros(kvh, rows, dtype=torch.float64)
    corr, m = torch.zeros_like(lsum), torch.full_like(lsum, -math.inf)
    e, smax, largest = None, torch.zeros(kvh, dtype=torch.float64), 0
    for s0 in range(0, n, tile):
        sl = slice(s0, min(s0 + tile, n))
        m_new = torch.maximum(m, torch.ceil(t[:, :, sl].amax(-1)))
        rise = torch.where(torch.isfinite(m), m_new - m, torch.zeros_like(m))
        smax = sv[:, sl].amax(-1) if policy == "tile" else torch.maximum(smax, sv[:, sl].amax(-1))
        e_new = torch.floor(torch.log2(P_MAX / smax))
        shift = (rise + (torch.zeros_like(e_new) if e is None else e - e_new)[:, None]).long()[..., None]
        right, left = shift.clamp_min(0), (-shift).clamp_min(0)
        hi, lo = (hi >> right) << left, (lo >> right) << left
        lsum, corr = lsum * torch.exp2(-rise), corr * torch.exp2(-rise)
        m, e = m_new, e_new
        p = torch.exp2(t[:, :, sl] - m[..., None])  # <= 1: the max is rounded up
        pq = torch.round(p * sv[:, None, sl] * torch.exp2(e)[:, None, None]).long()
        hi = hi + torch.einsum("hrl,hld->hrd", pq >> 8, codes16[:, sl])
        lo = lo + torch.einsum("hrl,hld->hrd", pq & 255, codes16[:, sl])
        largest = max(largest, int(hi.max()), int(lo.max()))
        lsum, corr = lsum + p.sum(-1), corr + (p * zv[:, None, sl]).sum(-1)
    out = ((256 * hi + lo).double() * torch.exp2(-e)[:, None, None] / 16 + corr[..., None]) / lsum[..., None]
    return out, m + torch.log2(lsum), largest


def attend_integer_pv(q, cache, sm_scale: float, policy: str, span: int, tile: int = 64):
    """The emulated kernel's output ``[B, Hq, D]`` (float64) and its largest int32 accumulator value."""
    ck, sk, zk, _ = cache.codes_and_params("k")
    cv, sv, zv, _ = cache.codes_and_params("v")
    sk, zk, sv, zv = (x.double()[..., 0] for x in (sk, zk, sv, zv))
    b, hq, d = q.shape
    kvh = ck.shape[1]
    qg = int16_rows(q.double().reshape(b, kvh, hq // kvh, d))
    out, largest = torch.zeros_like(qg), 0
    for bi in range(b):
        n = int(cache.lengths[bi])
        dot = torch.einsum("hrd,hld->hrl", qg[bi], ck[bi, :, :n].double())  # exact: integers below 2^53
        t = (sk[bi, :, None, :n] * dot + zk[bi, :, None, :n] * qg[bi].sum(-1)[..., None]) * sm_scale * LOG2E
        parts = []
        for a in range(0, n, span):
            sl = slice(a, min(a + span, n))
            o, lse2, big = _span_output(t[:, :, sl], 16 * cv[bi, :, sl].long(), sv[bi, :, sl], zv[bi, :, sl],
                                        policy, tile)
            parts.append((o, lse2))
            largest = max(largest, big)
        total = torch.logsumexp(torch.stack([lse2 for _, lse2 in parts]) / LOG2E, 0) * LOG2E
        out[bi] = sum(o * torch.exp2(lse2 - total)[..., None] for o, lse2 in parts)
    return out.reshape(q.shape), largest


def case(seed: int, length: int, q_outlier: float, v_outlier: float, span: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    scheme = Scheme.make(2, "token", 128, "token", 128, 128, 4)
    q, cache = random_problem(scheme, (length,), kv_heads=2, page_size=128, device="cpu", generator=gen)
    q = q.clone()
    q[..., 7] *= q_outlier
    cache.v_params[int(cache.page_table[0, 0]), :, 5, :, 0] *= v_outlier  # token 5's V scale
    sm_scale = scheme.head_dim**-0.5
    ref, _ = attend_dequantized(q, cache, sm_scale)
    rule = 2 * float((attend_dequantized_torch(q, cache, sm_scale).double() - ref).abs().max()) + ATOL_FLOOR
    outs = {"fp16 operands (today)": (attend_folded(q, cache, sm_scale, operand_dtype=torch.float16)[0], 0)}
    for policy in POLICIES:
        outs[f"integer PV, E per {policy}"] = attend_integer_pv(q, cache, sm_scale, policy, span)
    return [{"seed": seed, "length": length, "q_outlier": q_outlier, "v_outlier": v_outlier, "span": span,
             "method": name, "rule": rule, "max_err": float((out.to(q.dtype).double() - ref).abs().max()),
             "rel_err": float((out - ref).norm() / ref.norm()), "accumulator_log2": math.log2(max(big, 1))}
            for name, (out, big) in outs.items()]


def _int_list(parser, name: str, text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        parser.error(f"{name} must be comma-separated integers, got {text!r}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="700,4097")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--span", type=int, default=8192, help="tokens per CTA span")
    parser.add_argument("--q-outlier", type=float, default=30.0)
    parser.add_argument("--v-outlier", type=float, default=64.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--tag", default="integer-pv-probe-cpu")
    args = parser.parse_args(argv)
    lengths, seeds = _int_list(parser, "--lengths", args.lengths), _int_list(parser, "--seeds", args.seeds)
    if min(lengths) < 64:  # one whole tile, and token 5 (the V-scale outlier) inside it
        parser.error(f"--lengths must be >= 64 tokens each, got {args.lengths}")
    if args.span < 64 or args.span % 64:
        parser.error(f"--span must be a positive multiple of the 64-token tile, got {args.span}")
    rows = []
    for length in lengths:
        for seed in seeds:
            for q_out, v_out in ((1.0, 1.0), (args.q_outlier, 1.0), (1.0, args.v_outlier)):
                rows += case(seed, length, q_out, v_out, args.span)
                for r in rows[-1 - len(POLICIES):]:
                    print(f"{r['length']:>6} {r['seed']} q x{r['q_outlier']:<4g} v x{r['v_outlier']:<4g} "
                          f"{r['method']:<24} max {r['max_err']:.5f} (rule {r['rule']:.5f}) rel {r['rel_err']:.2e}",
                          flush=True)
    table = ["| length | seed | q outlier | V-scale outlier | method | max error (BF16 out) | rule | within | "
             "relative error (before rounding) |", "|---|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['length']} | {r['seed']} | {r['q_outlier']:g} | {r['v_outlier']:g} | {r['method']} | "
              f"{r['max_err']:.5f} | {r['rule']:.5f} | {'yes' if r['max_err'] <= r['rule'] else '**no**'} | "
              f"{r['rel_err']:.2e} |" for r in rows]
    if args.out:
        meta = run_meta("benchmarks.integer_pv_probe", argv, {}, device="CPU (float64 emulation)")
        print("wrote", write(args.out, args.tag, "Integer PV accumulators, emulated", meta, rows, "\n".join(table)))
    return rows


if __name__ == "__main__":
    main()
