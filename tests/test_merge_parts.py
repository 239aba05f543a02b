"""The merge of a chunk's partial attentions (foscar.kernels.merge_parts): a float64 reference of its contract, the
chunk attention through it on the CPU (``MergedParts`` with the reference standing in for the kernel), the kernel
compiled for both arches, and the kernel against float64 on the GPU (parts of every view the chunk path makes, an
FP32 running part merged in place, NaN-poisoned outputs)."""

import math

import pytest
import torch

import foscar.chunk_attention as chunk_attention
from foscar.kernels.merge_parts import merge_parts, part_table


def merge_reference(parts, out, lse):
    """What ``merge_parts`` writes, in float64 rounded once to ``out``'s dtype: ``parts`` ``(o [kvh, gqa, L, D],
    lse [kvh, gqa, L])``."""
    lses = torch.stack([part_lse.double() for _, part_lse in parts])
    total = torch.logsumexp(lses, 0)
    merged = sum(torch.exp(part_lse.double() - total)[..., None] * o.double() for (o, _), part_lse in zip(parts, lses))
    out.copy_(merged.to(out.dtype))
    lse.copy_(total.float())


def random_parts(shapes, dtype, rng, device="cpu"):
    """Parts of shape ``(kvh, gqa, L, D)`` as the chunk path views them: contiguous, memory ``[L, kvh, gqa, D]``
    permuted (a fused attention's output), and rows sliced from a padded block."""
    kvh, gqa, tokens, d = shapes
    parts = []
    for layout in ("contiguous", "token-major", "padded"):
        lse = (torch.randn(kvh, gqa, tokens, generator=rng) * 3).to(device)
        if layout == "contiguous":
            o = torch.randn(kvh, gqa, tokens, d, generator=rng)
        elif layout == "token-major":
            o = torch.randn(tokens, kvh, gqa, d, generator=rng).permute(1, 2, 0, 3)
        else:
            o = torch.randn(kvh, gqa * tokens + 24, d, generator=rng)[:, :gqa * tokens].unflatten(1, (gqa, tokens))
        parts.append((o.to(device, dtype), lse))
    return parts


def test_the_reference_is_one_softmax_over_the_parts_keys(rng):
    kvh, gqa, tokens, d, keys = 2, 3, 5, 8, 40
    scores = torch.randn(kvh, gqa, tokens, keys, generator=rng, dtype=torch.float64) * 3
    values = torch.randn(keys, d, generator=rng, dtype=torch.float64)
    parts = [(torch.softmax(scores[..., a:b], -1) @ values[a:b], torch.logsumexp(scores[..., a:b], -1))
             for a, b in ((0, 9), (9, 10), (10, 40))]
    out, lse = torch.empty(kvh, gqa, tokens, d, dtype=torch.float64), torch.empty(kvh, gqa, tokens)
    merge_reference(parts, out, lse)
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ values)
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("held_bytes", [1, 10**9])
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_chunk_attention_through_merged_parts(held_bytes, tokens, rng, monkeypatch):
    """``chunk_attention`` with a merge (the GPU's ``MergedParts``; the reference standing in for the kernel): the
    same attention as the torch merge, whether every partial merges into the FP32 running part as it comes
    (``HELD_PART_BYTES`` = 1) or all at the end."""
    from test_cache_chunk import assert_within_the_rule

    monkeypatch.setattr(chunk_attention, "HELD_PART_BYTES", held_bytes)
    monkeypatch.setattr(chunk_attention, "_pieces", lambda rows, heads, length, device: min(3, length // 8 or 1))
    kv_heads, group, d, blocks = 2, 4, 64, [1501, 7, 0, 300]
    k = torch.randn(kv_heads, sum(blocks) + tokens, d, generator=rng) + 2 * torch.randn(d, generator=rng)
    k, v = k.bfloat16(), torch.randn(kv_heads, sum(blocks) + tokens, d, generator=rng).bfloat16()
    q = torch.randn(tokens, kv_heads * group, d, generator=rng).bfloat16()
    edges = torch.tensor([0] + blocks).cumsum(0).tolist()
    cached = [(k[:, a:b], v[:, a:b]) for a, b in zip(edges, edges[1:])]
    merges = []

    def merge(parts, out, lse):
        merges.append((len(parts), out.dtype))
        merge_reference(parts, out, lse)

    out, lse = chunk_attention.chunk_attention(q, k[:, -tokens:], v[:, -tokens:], cached, 0.1, merge=merge)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (tokens, kv_heads * group)
    assert_within_the_rule(out, lse, q, k.float(), v.float(), 0.1, (held_bytes, tokens), rounded_partials=True)
    torch_out, torch_lse = chunk_attention.chunk_attention(q, k[:, -tokens:], v[:, -tokens:], cached, 0.1)
    assert (out.float() - torch_out.float()).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps
    assert (lse - torch_lse).abs().max() < 1e-4
    # the blocks' 3 pieces + a rest, 1, 3 pieces and the chunk's own attention: one merge, or each part into the
    # running one as it comes, then the running one into the output
    assert merges == ([(9, torch.bfloat16)] if held_bytes > 1 else [(1, torch.float32)] + [(2, torch.float32)] * 8
                      + [(1, torch.bfloat16)])


def test_a_view_the_kernel_cannot_load_is_named():
    o = torch.zeros(2, 3, 4, 64)
    lse = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match=r"parts\[1\]: o of strides .* is not a view the merge kernel loads 2"):
        part_table([(o, lse), (o.transpose(-1, -2).contiguous().transpose(-1, -2), lse)], "cpu")


def test_an_output_or_part_the_kernel_cannot_take_is_named():
    o, lse = torch.zeros(2, 3, 4, 64, dtype=torch.bfloat16), torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match=r"out: channels contiguous and strides .* multiples of 2, and an fp32 lse"):
        merge_parts([(o, lse)], torch.zeros(2, 3, 64, 4, dtype=torch.bfloat16).transpose(-1, -2), lse)
    with pytest.raises(ValueError, match=r"out: .* an fp32 lse"):
        merge_parts([(o, lse)], o.clone(), lse.half())
    with pytest.raises(ValueError, match=r"out: .* an fp32 lse of shape \(2, 3, 4\)"):
        merge_parts([(o, lse)], o.clone(), lse[:, :2].clone())
    part = r"parts\[1\]: need o of out's shape \(2, 3, 4, 64\) in fp32 or torch.bfloat16 and an fp32 lse of shape"
    with pytest.raises(ValueError, match=part):
        merge_parts([(o, lse), (o[:, :2], lse[:, :2])], o.clone(), lse.clone())
    with pytest.raises(ValueError, match=part):  # one 16-bit dtype: out's
        merge_parts([(o, lse), (o.half(), lse)], o.clone(), lse.clone())
    with pytest.raises(ValueError, match=part):  # one 16-bit dtype: the first's, into an fp32 out
        merge_parts([(o, lse), (o.half(), lse)], o.float(), lse.clone())
    with pytest.raises(ValueError, match=part):
        merge_parts([(o, lse), (o, lse[..., :2])], o.clone(), lse.clone())


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_the_kernel_compiles_for_both_arches_without_spills(arch):
    import cutlass

    import foscar.inspect as fi
    from foscar.kernels.merge_parts import compile_merge_parts

    for d, part, out in ((128, cutlass.BFloat16, cutlass.BFloat16), (256, cutlass.Float16, cutlass.Float32),
                         (64, cutlass.BFloat16, cutlass.Float32)):
        resources = fi.artifacts(compile_merge_parts(d, part, out, arch)).resources()
        assert resources.local_bytes == 0 and resources.registers <= 64, (d, resources)


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_kernel_matches_float64(dtype, d, rng):
    """Every element of NaN-poisoned outputs, written to the chunk's ``[L, Hq, D]`` layout: the 16-bit parts of each
    view, then those with an FP32 running part merged in place (the running part is also the output)."""
    kvh, gqa, tokens = 3, 4, 37
    parts = random_parts((kvh, gqa, tokens, d), dtype, rng, "cuda")
    final = torch.full((tokens, kvh * gqa, d), torch.nan, dtype=dtype, device="cuda")
    final_lse = torch.full((tokens, kvh * gqa), torch.nan, device="cuda")
    out, lse = final.view(tokens, kvh, gqa, d).permute(1, 2, 0, 3), final_lse.view(tokens, kvh, gqa).permute(1, 2, 0)
    merge_parts(parts, out, lse)
    ref, ref_lse = torch.empty(out.shape, dtype=torch.float64), torch.empty(lse.shape)
    merge_reference([(o.cpu(), part_lse.cpu()) for o, part_lse in parts], ref, ref_lse)
    torch.cuda.synchronize()
    eps = torch.finfo(dtype).eps
    # one rounding to dtype of a float64 value (half an ulp) and the FP32 sum's rounding and ex2.approx
    assert (out.cpu().double() - ref).abs().le(eps / 2 * ref.abs() + 1e-5).all()
    assert (lse.cpu().double() - ref_lse.double()).abs().max() < 1e-5

    running = torch.full((kvh, gqa, tokens, d), torch.nan, device="cuda")
    running_lse = torch.full((kvh, gqa, tokens), torch.nan, device="cuda")
    merge_parts(parts[:2], running, running_lse)
    merge_parts([parts[2], (running, running_lse)], running, running_lse)  # in place
    ref32 = torch.empty(running.shape, dtype=torch.float64)
    merge_reference([(o.cpu(), part_lse.cpu()) for o, part_lse in parts], ref32, ref_lse)
    torch.cuda.synchronize()
    assert (running.cpu().double() - ref32).abs().le(1e-5 * ref32.abs() + 1e-5).all()
    assert (running_lse.cpu().double() - ref_lse.double()).abs().max() < 1e-5

    # a row no part has a token of (every lse -inf): the empty softmax, o = 0 and lse = -inf, not NaN
    empty = [(o, part_lse.clone()) for o, part_lse in parts]
    for _, part_lse in empty:
        part_lse[0, 0, 0] = -math.inf
    out.fill_(torch.nan), lse.fill_(torch.nan)
    merge_parts(empty, out, lse)
    torch.cuda.synchronize()
    assert (out[0, 0, 0] == 0).all() and lse[0, 0, 0] == -math.inf
    assert not out.isnan().any()


def test_tensors_off_the_gpu_are_refused_before_the_compiler(monkeypatch):
    """The kernel takes every part's address: a CPU part (or out) went to it unchecked (a helper's audit)."""
    import foscar.kernels.merge_parts as mp

    monkeypatch.setattr(mp, "cached_compile", lambda *a, **k: pytest.fail("reached the compiler"))
    o, lse = torch.zeros(2, 3, 4, 64, dtype=torch.bfloat16), torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="out: on cpu; the merge kernel needs every tensor on out's CUDA device"):
        mp.merge_parts([(o, lse)], o.clone(), lse.clone())
