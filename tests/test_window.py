"""BF16 sink/window attention fused with the split-KV merge (foscar.kernels.window): a float64 torch
reference, checked on the CPU against attention over the concatenated valid tokens, and the CuTe
DSL kernel against it on the GPU."""

import math

import pytest
import torch

pytest.importorskip("cutlass")


def valid_slots(n, n_quant, sink, ring):
    """[B, sink + ring] bool: the slots of the BF16 part that hold tokens (foscar.cache's rule)."""
    j = torch.arange(sink + ring)[None, :]
    recent = (n - sink - n_quant).clamp(min=0)[:, None]
    in_ring = (j - sink - n_quant[:, None]) % ring < recent
    return torch.where(j < sink, j < n[:, None], in_ring)


def window_merge_reference(q, k_win, v_win, rows, n, n_quant, sink, o_part, lse_part, sm_scale):
    """float64 (o [B, Hq, D], lse [B, Hq]): attention over the valid BF16 slots merged with the
    quantized splits by log-sum-exp (splits ignored where n_quant == 0; empty splits have lse -inf)."""
    batch, hq, d = q.shape
    kvh, slots = k_win.shape[1], k_win.shape[2]
    r = hq // kvh
    k = k_win[rows].double().repeat_interleave(r, dim=1)  # [B, Hq, L, D]
    v = v_win[rows].double().repeat_interleave(r, dim=1)
    valid = valid_slots(n, n_quant, sink, slots - sink)[:, None, :]
    scores = torch.einsum("bhd,bhld->bhl", q.double(), k) * sm_scale
    scores = scores.masked_fill(~valid, -math.inf)
    lse_w = torch.logsumexp(scores, -1)
    o_w = torch.einsum("bhl,bhld->bhd", torch.softmax(scores, -1).nan_to_num(0.0), v)
    lse_s = torch.where((n_quant > 0)[:, None, None], lse_part.double(), -math.inf)
    lses = torch.cat([lse_s, lse_w[..., None]], -1)
    outs = torch.cat([o_part.double(), o_w[:, :, None, :]], 2)
    lse = torch.logsumexp(lses, -1)
    weights = torch.exp(lses - lse[..., None]).nan_to_num(0.0)
    outs = torch.where(torch.isinf(lses)[..., None], 0.0, outs)  # garbage behind empty splits
    return (weights[..., None] * outs).sum(2), lse


def test_reference_equals_attention_over_all_tokens(rng):
    """Splits of a quantized token set + the window == one softmax over every valid token."""
    batch, kvh, r, d, sink, ring, nq = 3, 2, 2, 16, 3, 10, 12
    q = torch.randn(batch, kvh * r, d, generator=rng, dtype=torch.float64)
    k_win = torch.randn(5, kvh, sink + ring, d, generator=rng, dtype=torch.float64)
    v_win = torch.randn(5, kvh, sink + ring, d, generator=rng, dtype=torch.float64)
    kq = torch.randn(batch, kvh * r, nq, d, generator=rng, dtype=torch.float64)
    vq = torch.randn(batch, kvh * r, nq, d, generator=rng, dtype=torch.float64)
    rows = torch.tensor([4, 0, 2])
    n = torch.tensor([2, sink + nq + 7, sink + nq + ring])
    n_quant = torch.tensor([0, nq, nq])
    scale = 0.3
    # split partials of the quantized tokens; the second split empty
    bounds = [(0, 5), (5, 5), (5, nq)]
    s_all = torch.einsum("bhd,bhld->bhl", q, kq) * scale
    o_part, lse_part = [], []
    for lo, hi in bounds:
        if lo == hi:
            o_part.append(torch.full_like(q, math.nan))
            lse_part.append(torch.full(q.shape[:2], -math.inf, dtype=torch.float64))
            continue
        lse_part.append(torch.logsumexp(s_all[..., lo:hi], -1))
        o_part.append(torch.einsum("bhl,bhld->bhd", torch.softmax(s_all[..., lo:hi], -1), vq[..., lo:hi, :]))
    o_part, lse_part = torch.stack(o_part, 2), torch.stack(lse_part, 2)
    out, lse = window_merge_reference(q, k_win, v_win, rows, n, n_quant, sink, o_part, lse_part, scale)

    valid = valid_slots(n, n_quant, sink, ring)
    for b in range(batch):
        kw = k_win[rows[b]].repeat_interleave(r, 0)[:, valid[b]]
        vw = v_win[rows[b]].repeat_interleave(r, 0)[:, valid[b]]
        kk = torch.cat([kq[b][:, : n_quant[b]], kw], 1)
        vv = torch.cat([vq[b][:, : n_quant[b]], vw], 1)
        s = torch.einsum("hd,hld->hl", q[b], kk) * scale
        torch.testing.assert_close(lse[b], torch.logsumexp(s, -1))
        torch.testing.assert_close(out[b], torch.einsum("hl,hld->hd", torch.softmax(s, -1), vv))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_window_merge_compiles(arch):
    from foscar.inspect import artifacts
    from foscar.kernels import compile_window_merge

    art = artifacts(compile_window_merge(128, 64 + 256 + 64, 4, arch))
    assert art.resources().local_bytes == 0
    try:
        mix = art.mix(full_opcodes=True)
    except Exception as exc:  # no nvdisasm: the cubin resources above still count
        pytest.skip(f"no SASS: {exc}")
    assert mix.get("LDG.E.128", 0) > 0  # K/V slots come in 16-byte vectors


# (head_dim, gqa, q dtype, sink, window + granule slots)
CASES = [
    (128, 4, torch.bfloat16, 4, 24),
    (64, 1, torch.float16, 0, 40),
    (256, 8, torch.bfloat16, 64, 320),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[f"d{c[0]}-r{c[1]}-{str(c[2])[6:]}-s{c[3]}-w{c[4]}" for c in CASES])
def test_window_merge_kernel_matches_reference(case):
    from foscar.kernels import window_merge

    d, r, dtype, sink, ring = case
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs every run
    batch, kvh, max_seqs, splits = 6, 2, 9, 3
    dev = "cuda"
    q = torch.randn(batch, kvh * r, d, generator=gen).to(dtype)
    k_win = torch.randn(max_seqs, kvh, sink + ring, d, generator=gen).to(dtype)  # the window holds the model's dtype
    v_win = torch.randn(max_seqs, kvh, sink + ring, d, generator=gen).to(dtype)
    rows = torch.randperm(max_seqs, generator=gen)[:batch]
    # n: a partial sink, a full sink with a partial ring, wrapped rings, no quantized tokens at all
    n_quant = torch.tensor([0, 0, 16, 48, 128, 8])
    n = torch.tensor([max(1, sink // 2), sink + ring // 2, sink + 16 + ring - 3, sink + 48 + ring, sink + 128 + 5, sink + 8 + 1])
    o_part = torch.randn(batch, kvh * r, splits, d, generator=gen)
    lse_part = torch.randn(batch, kvh * r, splits, generator=gen) * 3
    lse_part[:, :, 1] = -math.inf  # an empty split: its output is garbage
    o_part[:, :, 1] = math.nan
    o_part[:2] = math.nan  # no quantized tokens: the splits must be ignored
    scale = d**-0.5
    args = [t.to(dev) for t in (q, k_win, v_win, rows, n, n_quant)]
    out = torch.full_like(args[0], math.nan)
    lse = torch.full((batch, kvh * r), math.nan, device=dev)
    window_merge(*args, sink, o_part.to(dev), lse_part.to(dev), scale, out=out, lse=lse)
    ref_o, ref_lse = window_merge_reference(q, k_win, v_win, rows, n, n_quant, sink, o_part, lse_part, scale)
    # the kernel rounds an fp32 result to q's dtype once: allow two roundings of the reference
    rounding = (ref_o - ref_o.to(dtype).double()).abs().max().item()
    err = (out.cpu().double() - ref_o).abs().max().item()
    assert torch.isfinite(out).all() and err <= 2 * rounding + 1e-5, (err, rounding)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=1e-4, rtol=0)


def test_window_merge_names_the_bad_argument():
    from foscar.kernels import window_merge

    b, hq, kvh, d, slots, splits = 2, 4, 2, 64, 12, 1
    good = dict(q=torch.zeros(b, hq, d, dtype=torch.bfloat16), k_win=torch.zeros(3, kvh, slots, d, dtype=torch.bfloat16),
                v_win=torch.zeros(3, kvh, slots, d, dtype=torch.bfloat16), rows=torch.zeros(b, dtype=torch.int64),
                n_tokens=torch.ones(b, dtype=torch.int64), n_quant=torch.zeros(b, dtype=torch.int64), sink=4,
                o_part=torch.zeros(b, hq, splits, d), lse_part=torch.zeros(b, hq, splits), sm_scale=0.1)
    bad = {"rows": torch.zeros(b, dtype=torch.int32), "v_win": torch.zeros(3, kvh, slots + 1, d, dtype=torch.bfloat16),
           "lse_part": torch.zeros(b, hq, splits + 1), "q": torch.zeros(b, hq, d)}
    for name, value in bad.items():
        with pytest.raises(ValueError, match=name):
            window_merge(**{**good, name: value})
    with pytest.raises(ValueError, match="q:"):  # CPU tensors: the kernel needs CUDA ones
        window_merge(**good)
