"""foscar.chunk_attention (the blocked attention of ``attend_chunk`` on a kernel cache) on the CPU: cached tokens in
blocks of any length (empty ones included), a block cut into pieces, the chunk's own tokens, and the query rows
padded for cuDNN's bounded set of shapes, against float64 causal attention over the same values under the
project's rule. On the GPU the same code runs through the kernel cache's tests (tests/test_cache_chunk.py,
tests/test_batch.py) and, with cuDNN's full blocks, here."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cache_chunk import assert_within_the_rule

import foscar.chunk_attention as chunk_attention
from foscar.chunk_attention import CUDNN_TOKENS, Merged, padded_rows

SM_SCALE = 0.1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pieces", [1, 3])
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_blocks_pieces_and_own_tokens_against_float64(dtype, pieces, tokens, rng, monkeypatch):
    kv_heads, group, d = 2, 4, 64
    blocks = [0, 1501, 7, 0, 2050]  # cached tokens per block: empty, long (cut into pieces, a tail left), short
    monkeypatch.setattr(chunk_attention, "_pieces", lambda rows, heads, length, device: min(pieces, length // 8 or 1))
    k = torch.randn(kv_heads, sum(blocks) + tokens, d, generator=rng) + 2 * torch.randn(d, generator=rng)
    v = torch.randn(kv_heads, sum(blocks) + tokens, d, generator=rng)
    k, v = k.to(dtype), v.to(dtype)
    q = torch.randn(tokens, kv_heads * group, d, generator=rng).to(dtype)
    edges = torch.tensor([0] + blocks).cumsum(0).tolist()
    cached = [(k[:, a:b], v[:, a:b]) for a, b in zip(edges, edges[1:])]
    out, lse = chunk_attention.chunk_attention(q, k[:, -tokens:], v[:, -tokens:], cached, SM_SCALE)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (tokens, kv_heads * group)
    assert lse.dtype == torch.float32
    assert_within_the_rule(out, lse, q, k.float(), v.float(), SM_SCALE, (dtype, pieces, tokens),
                           rounded_partials=True)


@pytest.mark.parametrize("group, step", [(1, 1), (1, 3), (4, 4), (4, 1), (16, 1)])
@pytest.mark.parametrize("tokens", [1, 5, 70])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "unaligned"])
def test_packed_prefix_folds_the_chunk_into_query_heads(group, step, tokens, layout, rng):
    """``PackedPrefix``: the chunk's tokens as ``step`` more query heads per head of a decode over the prefix (here a
    float64 attention standing in for the kernel, rounded to q's dtype), unfolded into the blocks' rows and merged
    with a block of 16-bit slots and the chunk's own tokens: the chunk's attention over all of them. The kernel reads
    its q densely and 16-byte aligned: a contiguous one, also from a q transposed as transformers' attention gives it
    or starting 2 bytes into its storage."""
    kv_heads, d, prefix, slots = 2, 64, 300, 40
    k = (torch.randn(kv_heads, prefix + slots + tokens, d, generator=rng) + torch.randn(d, generator=rng))
    k, v = k.to(torch.bfloat16), torch.randn(kv_heads, prefix + slots + tokens, d, generator=rng).to(torch.bfloat16)
    q = torch.randn(tokens, kv_heads * group, d, generator=rng).to(torch.bfloat16)
    if layout == "transposed":  # [L, Hq, D] with the strides of [Hq, L, D]
        q = q.transpose(0, 1).contiguous().transpose(0, 1)
    elif layout == "unaligned":  # contiguous, one element into its storage
        q = torch.cat([q.new_zeros(1), q.flatten()])[1:].view(q.shape)
    seen = []

    def decode(folded):  # [n, kv_heads * group * step, D]: n sequences, each the whole prefix
        assert folded.is_contiguous() and folded.data_ptr() % 16 == 0
        seen.append(tuple(folded.shape))
        heads = folded.shape[1] // kv_heads
        scores = torch.einsum("nhd,htd->nht", folded.double(), k[:, :prefix].double().repeat_interleave(heads, 0))
        scores *= SM_SCALE
        values = v[:, :prefix].double().repeat_interleave(heads, 0)
        out = torch.einsum("nht,htd->nhd", torch.softmax(scores, -1), values)
        return out.to(q.dtype), torch.logsumexp(scores, -1).float()

    packed = chunk_attention.PackedPrefix(step, decode)
    cached = [(k[:, prefix:prefix + slots], v[:, prefix:prefix + slots])]
    out, lse = chunk_attention.chunk_attention(q, k[:, -tokens:], v[:, -tokens:], cached, SM_SCALE, packed)
    assert seen == [(-(-tokens // step), kv_heads * group * step, d)]
    assert out.shape == q.shape and lse.shape == (tokens, kv_heads * group)
    assert_within_the_rule(out, lse, q, k.float(), v.float(), SM_SCALE, (group, step, tokens), rounded_partials=True)


@pytest.mark.parametrize("splits", [1, 3])
def test_packed_prefill_merges_the_kernels_splits(splits, rng):
    """``PackedPrefill``: the prefill kernel's partials (here float64 attentions standing in for it, one per split of
    the prefix, rounded to q's dtype) over the chunk's query rows ``g * L + t`` of each KV head, merged with a block
    of 16-bit slots and the chunk's own tokens: the chunk's attention over all of them."""
    kv_heads, group, d, prefix, slots, tokens = 2, 4, 64, 300, 40, 9
    k = (torch.randn(kv_heads, prefix + slots + tokens, d, generator=rng) + 1).to(torch.bfloat16)
    v = torch.randn(kv_heads, prefix + slots + tokens, d, generator=rng).to(torch.bfloat16)
    q = torch.randn(tokens, kv_heads * group, d, generator=rng).to(torch.bfloat16)
    cuts = torch.linspace(0, prefix, splits + 1).long().tolist()

    def run(q_rows):  # [kv_heads, group * tokens, D] -> the splits' partials
        assert tuple(q_rows.shape) == (kv_heads, group * tokens, d)
        scores = torch.einsum("hrd,htd->hrt", q_rows.double(), k[:, :prefix].double()) * SM_SCALE
        parts = [(torch.softmax(scores[..., a:b], -1) @ v[:, a:b].double(), torch.logsumexp(scores[..., a:b], -1))
                 for a, b in zip(cuts, cuts[1:])]
        return torch.stack([o for o, _ in parts]).to(q.dtype), torch.stack([x for _, x in parts]).float()

    cached = [(k[:, prefix:prefix + slots], v[:, prefix:prefix + slots])]
    out, lse = chunk_attention.chunk_attention(q, k[:, -tokens:], v[:, -tokens:], cached, SM_SCALE,
                                               chunk_attention.PackedPrefill(run))
    assert_within_the_rule(out, lse, q, k.float(), v.float(), SM_SCALE, splits, rounded_partials=True)


def test_nothing_cached_is_causal_attention_of_the_chunk(rng):
    kv_heads, group, d, tokens = 1, 2, 32, 9
    k, v = (torch.randn(kv_heads, tokens, d, generator=rng).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(tokens, kv_heads * group, d, generator=rng).to(torch.bfloat16)
    out, lse = chunk_attention.chunk_attention(q, k, v, [], SM_SCALE)
    assert_within_the_rule(out, lse, q, k.float(), v.float(), SM_SCALE, "no cached tokens")


def test_merging_partials_equals_one_softmax(rng):
    """Merged.add over a split of the keys gives the softmax over all of them (float64: exactly up to rounding)."""
    scores = torch.randn(3, 50, generator=rng, dtype=torch.float64) * 4
    values = torch.randn(50, 8, generator=rng, dtype=torch.float64)
    merged = Merged()
    for a, b in ((0, 20), (20, 21), (21, 50)):
        lse = torch.logsumexp(scores[:, a:b], -1)
        merged.add((torch.softmax(scores[:, a:b], -1) @ values[a:b])[None], lse[None])
    out, lse = merged.result()
    assert torch.allclose(out.double(), torch.softmax(scores, -1) @ values, atol=1e-6)
    assert torch.allclose(lse.double(), torch.logsumexp(scores, -1), atol=1e-6)


@pytest.mark.parametrize("held_bytes", [1, 10**9])
def test_merging_batches_of_partials_in_any_grouping_equals_one_softmax(held_bytes, rng, monkeypatch):
    """Partials given as batches (pieces) and merged as they come (``HELD_BYTES`` = 1) or all at the end give the
    softmax over all keys."""
    monkeypatch.setattr(chunk_attention, "HELD_BYTES", held_bytes)
    scores = torch.randn(2, 3, 60, generator=rng, dtype=torch.float64) * 4
    values = torch.randn(60, 8, generator=rng, dtype=torch.float64)
    merged = Merged()
    for cuts in ([0, 10, 25], [25, 26], [26, 40, 50, 60]):  # a batch of len(cuts) - 1 attentions
        parts = [(torch.softmax(scores[..., a:b], -1) @ values[a:b], torch.logsumexp(scores[..., a:b], -1))
                 for a, b in zip(cuts, cuts[1:])]
        merged.add(torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts]))
    out, lse = merged.result()
    assert torch.allclose(out.double(), torch.softmax(scores, -1) @ values, atol=1e-6)
    assert torch.allclose(lse.double(), torch.logsumexp(scores, -1), atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(0, 300), min_size=0, max_size=5), tokens=st.integers(1, 6),
       pieces=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_any_cut_of_the_cached_tokens_gives_the_same_attention(cuts, tokens, pieces, seed):
    """However the cached tokens are cut into blocks (and blocks into pieces), the result is the same attention:
    FP32 merges of the same values (the CPU flash kernel's vectorized exp puts the lse ~1e-5 apart; a block merged
    with a wrong weight moves it by its share of the softmax, a tail or piece dropped by the tokens' share)."""
    rng = torch.Generator().manual_seed(seed)
    n = sum(cuts)
    k, v = (torch.randn(2, n + tokens, 32, generator=rng, dtype=torch.float64).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(tokens, 4, 32, generator=rng, dtype=torch.float64).to(torch.bfloat16)
    edges = torch.tensor([0] + cuts).cumsum(0).tolist()
    blocks = [(k[:, a:b], v[:, a:b]) for a, b in zip(edges, edges[1:])]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chunk_attention, "_pieces", lambda rows, heads, length, device: max(1, min(pieces, length)))
        out, lse = chunk_attention.chunk_attention(q, k[:, n:], v[:, n:], blocks, SM_SCALE)
    whole, whole_lse = chunk_attention.chunk_attention(q, k[:, n:], v[:, n:], [(k[:, :n], v[:, :n])], SM_SCALE)
    assert (lse - whole_lse).abs().max() < 1e-4
    # each partial output is rounded to BF16 before the merge: half an ulp of the largest partial, on either side
    partial = max((_attention(q, kb, vb).abs().max() for kb, vb in blocks if kb.shape[1]), default=0.0)
    bound = 2**-8 * (float(partial) + float(whole.float().abs().max())) + 1e-6
    assert (out.float() - whole.float()).abs().max() <= bound


def _attention(q, k, v):
    """float64 attention of every query row of ``q [L, Hq, D]`` over all of ``k, v [kvh, T, D]`` (no mask)."""
    group = q.shape[1] // k.shape[0]
    scores = torch.einsum("lhd,htd->lht", q.double(), k.double().repeat_interleave(group, 0)) * SM_SCALE
    return torch.einsum("lht,htd->lhd", torch.softmax(scores, -1), v.double().repeat_interleave(group, 0))


def test_a_block_is_cut_into_pieces_while_the_grid_stays_within_two_ctas_per_sm(monkeypatch):
    """``_pieces`` on a 132-SM GPU: 4096 rows per KV head at 8 KV heads (256 CTAs of 128 rows) stay one piece (rounded
    up it was 2, whose merge cost more than the attention gained: benchmarks/NOTES.md section 42); 512 rows (32 CTAs)
    take 8 pieces, at most one per ``MIN_PIECE`` tokens; the CPU one."""
    monkeypatch.setattr(chunk_attention, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert chunk_attention._pieces(4096, 8, 32768, cuda) == 1
    assert chunk_attention._pieces(512, 8, 32768, cuda) == 2 * 132 // 32 == 8
    assert chunk_attention._pieces(512, 8, 3 * chunk_attention.MIN_PIECE, cuda) == 3
    assert chunk_attention._pieces(512, 8, 32768, torch.device("cpu")) == 1


def test_padded_rows_are_four_sizes_per_octave_at_most_a_quarter_more():
    for octave in range(9, 16):
        sizes = {padded_rows(rows) for rows in range(1 << octave, 2 << octave)}
        assert sizes == {(4 + i) << (octave - 2) for i in range(5)}, (octave, sorted(sizes))  # 2^(k+1) is the next's
    for rows in range(1, 70000, 7):
        assert rows <= padded_rows(rows) <= 1.25 * rows


def test_padded_query_rows_are_attended_then_dropped(rng, monkeypatch):
    """The cuDNN path's padding (zero query rows past the chunk's) on the CPU's flash kernel, the block cut into
    2 pieces (a batch whose padded rows are dropped per piece): the same attention."""
    kv_heads, group, d, tokens = 2, 3, 64, 7  # 21 rows per KV head -> 24
    monkeypatch.setattr(chunk_attention, "_cudnn_rows", lambda rows, k: padded_rows(rows))
    monkeypatch.setattr(chunk_attention, "_pieces", lambda rows, heads, length, device: 2)
    rows_seen = []
    fused = chunk_attention.fused_attention
    monkeypatch.setattr(chunk_attention, "fused_attention", lambda q, k, v, s, causal, cudnn=False:
                        rows_seen.append(q.shape[:3:2]) or fused(q, k, v, s, causal))
    k = torch.randn(kv_heads, 900 + tokens, d, generator=rng).to(torch.bfloat16)
    v = torch.randn(kv_heads, 900 + tokens, d, generator=rng).to(torch.bfloat16)
    q = torch.randn(tokens, kv_heads * group, d, generator=rng).to(torch.bfloat16)
    out, lse = chunk_attention.chunk_attention(q, k[:, -tokens:], v[:, -tokens:], [(k[:, :900], v[:, :900])], SM_SCALE)
    assert (2, 24) in rows_seen  # the block was attended as 2 pieces with the padded rows
    assert_within_the_rule(out, lse, q, k.float(), v.float(), SM_SCALE, "padded rows", rounded_partials=True)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [5, 130, 1000])
def test_full_blocks_take_cudnn_with_padded_rows_the_rest_fa2(tokens, rng, monkeypatch):
    """On the GPU: a block of CUDNN_TOKENS keys goes to cuDNN (query rows padded), a shorter block and the chunk's own
    tokens to FA2 (rows as they are); every element within the rule against float64."""
    kv_heads, group, d = 2, 4, 128
    calls = []
    fused = chunk_attention.fused_attention
    monkeypatch.setattr(chunk_attention, "fused_attention",
                        lambda q, k, v, s, causal, cudnn=False: calls.append((cudnn, q.shape[2], k.shape[2]))
                        or fused(q, k, v, s, causal, cudnn))
    gen = torch.Generator("cuda").manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))  # fresh inputs
    n = CUDNN_TOKENS + 3000
    k = (torch.randn(kv_heads, n + tokens, d, device="cuda", generator=gen) + 1).to(torch.bfloat16)
    v = torch.randn(kv_heads, n + tokens, d, device="cuda", generator=gen).to(torch.bfloat16)
    q = torch.randn(tokens, kv_heads * group, d, device="cuda", generator=gen).to(torch.bfloat16)
    blocks = [(k[:, :CUDNN_TOKENS], v[:, :CUDNN_TOKENS]), (k[:, CUDNN_TOKENS:n], v[:, CUDNN_TOKENS:n])]
    out, lse = chunk_attention.chunk_attention(q, k[:, n:], v[:, n:], blocks, SM_SCALE)
    assert {rows for cudnn, rows, _ in calls if cudnn} == {padded_rows(tokens * group)}
    assert (False, tokens * group) in {(cudnn, rows) for cudnn, rows, _ in calls}  # the shorter block
    assert_within_the_rule(out, lse, q.cpu(), k.float().cpu(), v.float().cpu(), SM_SCALE, tokens)


@pytest.mark.parametrize("kv_heads", [1, 2, 6, 8, 32])
@pytest.mark.parametrize("page_size", [64, 128, 256])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_full_blocks_are_whole_multiples_of_cudnn_tokens_within_block_bytes(kv_heads, page_size, head_dim,
                                                                           monkeypatch):
    """The cache's full prefix blocks are shapes cuDNN plans once: a multiple of CUDNN_TOKENS tokens where BLOCK_BYTES
    of K and V hold that many (else the blocks are smaller, and FA2 takes them), never past BLOCK_BYTES; a
    BLOCK_BYTES smaller than a page keeps one page."""
    import foscar.cache as cache

    pages = cache.block_pages(kv_heads, page_size, head_dim, torch.bfloat16)
    token_bytes = 2 * kv_heads * head_dim * 2
    assert pages * page_size * token_bytes <= cache.BLOCK_BYTES
    if CUDNN_TOKENS * token_bytes <= cache.BLOCK_BYTES:
        assert pages * page_size % CUDNN_TOKENS == 0
    else:
        assert pages == cache.BLOCK_BYTES // (page_size * token_bytes)
    monkeypatch.setattr(cache, "BLOCK_BYTES", 1)
    assert cache.block_pages(kv_heads, page_size, head_dim, torch.bfloat16) == 1
