"""benchmarks/serve.py on the CPU: the tiny model's decode loop makes tokens and advances the cache,
the memory account adds up to the budget with max N the most that fits, formats that cannot run are
reported (never dropped), the decoder is Qwen3's (checked against transformers), and the FlashInfer
page plan and append rows address the right slots. No timings."""

import json

import pytest
import torch

from benchmarks import serve

MIB = 2**20


def test_tiny_run_makes_tokens_and_the_account_adds_up(tmp_path):
    records = serve.main(["--model", "tiny", "--device", "cpu", "--out", str(tmp_path), "--tag", "serve-test"])
    by = {r["format"]: r for r in records}
    assert list(by) == list(serve.FORMATS)  # every format has a record
    for name in ("bf16", "fp8", "fp8-xqa"):
        assert by[name]["status"] == "missing" and "CUDA" in by[name]["note"] and not by[name]["points"]
    assert by["k4v2"]["status"] == "ok" and by["int2-kivi"]["status"] == "ok"
    preset = serve.PRESETS["tiny"]
    budget = round(preset.memory_gib * serve.GIB)
    for name in ("int4", "int2"):
        r = by[name]
        assert r["status"] == "ok", r["note"]
        n = r["max_batch"]
        assert n >= 2 and [p["batch"] for p in r["points"]] == serve.concurrency_grid(n, preset.points)
        for p in r["points"]:  # greedy tokens written back, positions and every layer's cache length advanced
            assert p["tokens_in_range"] and p["tokens_changed"] and p["positions_advanced"] and p["cache_advanced"]
            assert p["steps"] == preset.steps
        account = r["account"]
        assert set(account) == set(serve.ACCOUNT_PARTS) and sum(account.values()) == budget
        assert 0 <= account["free"] < r["bytes_per_sequence"]  # one more sequence would not fit
        for part, per in r["per_sequence"].items():
            assert account[part] == r["fixed"].get(part, 0) + n * per
        assert account["workspace"] == round(preset.reserve_gib * serve.GIB)
        assert account["weights"] == serve.Decoder(preset.geometry, "cpu").nbytes()
    assert by["int2"]["per_sequence"]["kv_pages"] < by["int4"]["per_sequence"]["kv_pages"]
    record = json.loads((tmp_path / "serve-test.json").read_text())
    assert [r["format"] for r in record["formats"]] == list(serve.FORMATS)
    assert record["meta"]["command"].startswith("python -m benchmarks.serve --model tiny")
    assert all(x["ratio"] is None for x in record["peak_ratios"])  # no FlashInfer baseline on the CPU
    table = (tmp_path / "serve-test.md").read_text()
    assert "| bf16 | missing | 0 | - | - | - | - | FlashInfer runs on CUDA devices only |" in table
    assert (tmp_path / "serve-test.png").stat().st_size > 1000


def test_plan_capacity():
    per_seq, fixed = {"kv_pages": 100, "bf16_window": 20}, {"kv_pages": 7, "workspace": 50}
    n, account, per = serve.plan_capacity(2000, 30, 400, 100, per_seq, fixed)
    assert per == 120 and n == (2000 - 30 - 400 - 100 - 57) // 120 == 11
    assert account == {"other": 30, "weights": 400, "kv_pages": 7 + 1100, "bf16_window": 220, "metadata": 0,
                       "workspace": 150, "free": 2000 - 30 - 400 - 1107 - 220 - 150}
    assert account["free"] < per
    n, account, _ = serve.plan_capacity(2000, 30, 400, 100, per_seq, fixed, cap=4)
    assert n == 4 and account["kv_pages"] == 407 and sum(account.values()) == 2000
    assert serve.plan_capacity(500, 0, 400, 100, per_seq, fixed)[0] == 0


def test_concurrency_grid():
    assert serve.concurrency_grid(60, 6) == [1, 2, 5, 12, 26, 36, 45, 54, 60]
    assert serve.concurrency_grid(17, 6) == [1, 2, 3, 5, 10, 13, 15, 17]  # FP8's first run had only 10 and 17 up there
    assert serve.concurrency_grid(0, 6) == [] and serve.concurrency_grid(1, 6) == [1]
    for top in range(2, 80):
        for points in (2, 3, 6):
            grid = serve.concurrency_grid(top, points)
            assert grid[0] == 1 and grid[-1] == top and len(grid) <= points + len(serve.TOP_FRACTIONS)
            assert all(a < b for a, b in zip(grid, grid[1:]))


def test_flashinfer_page_plan_and_append_rows():
    batch, pages_per_seq, page, kv_heads, d = 3, 5, 64, 2, 8
    for length in (1, 64, 65, 257):
        indptr, indices, last = serve.FlashInferKV.page_plan(batch, pages_per_seq, length, page)
        assert indptr.dtype == indices.dtype == last.dtype == torch.int32
        used = indptr[1:] - indptr[:-1]
        assert ((used - 1) * page + last == length).all() and ((last >= 1) & (last <= page)).all()
        for s in range(batch):
            own = indices[indptr[s]:indptr[s + 1]]
            first = s * pages_per_seq
            assert torch.equal(own, torch.arange(first, first + int(used[s]), dtype=torch.int32))
    pool = torch.zeros(batch * pages_per_seq, 2, kv_heads, page, d)
    position = 130
    k_rows, v_rows = serve.FlashInferKV.token_rows(batch, pages_per_seq, position, kv_heads, page)
    k_new, v_new = torch.randn(batch, kv_heads, d), torch.randn(batch, kv_heads, d)
    rows = pool.view(-1, d)
    rows.index_copy_(0, k_rows, k_new.reshape(-1, d))
    rows.index_copy_(0, v_rows, v_new.reshape(-1, d))
    for s in range(batch):
        p = s * pages_per_seq + position // page
        assert torch.equal(pool[p, 0, :, position % page], k_new[s])
        assert torch.equal(pool[p, 1, :, position % page], v_new[s])
    assert torch.count_nonzero(pool.abs().sum(-1)) == 2 * batch * kv_heads  # nothing else written


def test_fill_random_in_chunks():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float8_e4m3fn, torch.bfloat16, torch.int32):
        t = torch.zeros(1000, dtype=dtype)
        serve.fill_random_(t, gen, chunk=64)
        x = t.double()
        assert x.isfinite().all() and (x[-40:] != 0).sum() > 30  # every chunk, the last partial one too
        if dtype.is_floating_point:
            assert 0.8 < x.std() < 1.2
        else:
            assert len(x.unique()) == 1000


class DenseKV:
    """The reference attention backend: every token's K/V kept in full, SDPA over them."""

    def __init__(self):
        self.k, self.v = {}, {}

    def append_attend(self, layer, q, k, v):
        self.k[layer] = torch.cat([self.k[layer], k[:, :, None]], 2) if layer in self.k else k[:, :, None]
        self.v[layer] = torch.cat([self.v[layer], v[:, :, None]], 2) if layer in self.v else v[:, :, None]
        out = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], self.k[layer], self.v[layer],
                                                               enable_gqa=True)
        return out[:, :, 0]


def test_decoder_is_qwen3():
    """Token-by-token decoding with the benchmark's decoder gives transformers' Qwen3 logits (fp32,
    same weights; the norm weights perturbed so that each one is seen to be used)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    geo = serve.PRESETS["tiny"].geometry
    model = serve.Decoder(geo, "cpu", seed=1, dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    for layer in model.layers:
        for t in (layer.attn_norm, layer.q_norm, layer.k_norm, layer.mlp_norm):
            t.add_(0.3 * torch.randn(t.shape, generator=gen))
    model.final_norm.add_(0.3 * torch.randn(model.final_norm.shape, generator=gen))
    config = transformers.Qwen3Config(
        vocab_size=geo.vocab, hidden_size=geo.hidden, intermediate_size=geo.mlp, num_hidden_layers=geo.layers,
        num_attention_heads=geo.q_heads, num_key_value_heads=geo.kv_heads, head_dim=geo.head_dim,
        rms_norm_eps=geo.eps, rope_parameters={"rope_type": "default", "rope_theta": geo.rope_theta},
        tie_word_embeddings=False, max_position_embeddings=4096)
    hf = transformers.Qwen3ForCausalLM(config).eval()
    q_rows, kv_rows = geo.q_heads * geo.head_dim, geo.kv_heads * geo.head_dim
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(model.embed)
        hf.model.norm.weight.copy_(model.final_norm)
        hf.lm_head.weight.copy_(model.lm_head)
        for ours, theirs in zip(model.layers, hf.model.layers):
            att = theirs.self_attn
            att.q_proj.weight.copy_(ours.qkv[:q_rows])
            att.k_proj.weight.copy_(ours.qkv[q_rows:q_rows + kv_rows])
            att.v_proj.weight.copy_(ours.qkv[q_rows + kv_rows:])
            att.o_proj.weight.copy_(ours.o)
            att.q_norm.weight.copy_(ours.q_norm)
            att.k_norm.weight.copy_(ours.k_norm)
            theirs.mlp.gate_proj.weight.copy_(ours.gate_up[:geo.mlp])
            theirs.mlp.up_proj.weight.copy_(ours.gate_up[geo.mlp:])
            theirs.mlp.down_proj.weight.copy_(ours.down)
            theirs.input_layernorm.weight.copy_(ours.attn_norm)
            theirs.post_attention_layernorm.weight.copy_(ours.mlp_norm)
        ids = torch.randint(0, geo.vocab, (2, 12), generator=gen)
        want = hf(input_ids=ids).logits  # [2, 12, vocab]
        kv = DenseKV()
        for t in range(ids.shape[1]):
            got = model.forward(ids[:, t], torch.full((2,), t), kv.append_attend)
            assert (got - want[:, t]).abs().max() < 1e-4 * want[:, t].abs().max(), t


class FakeDecodeWrapper:
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper contract (HND pages ``[pages, 2, kv_heads,
    page, D]``; indptr / indices / last_page_len; FP8 K/V scaled by k_scale / v_scale) in torch, to
    run the benchmark's FlashInfer backend on the CPU."""

    def __init__(self, workspace, layout, use_tensor_cores=False):
        assert layout == "HND" and workspace.dtype == torch.uint8

    def plan(self, indptr, indices, last_page_len, q_heads, kv_heads, head_dim, page, q_data_type, kv_data_type):
        self.plan_args = indptr, indices, last_page_len, q_heads, kv_heads, page, q_data_type, kv_data_type

    def run(self, q, cache, k_scale=None, v_scale=None):
        indptr, indices, last, q_heads, kv_heads, page, q_dtype, kv_dtype = self.plan_args
        assert q.dtype == q_dtype and cache.dtype == kv_dtype and q.shape[:2] == (len(last), q_heads)
        assert (k_scale is None) == (kv_dtype == torch.bfloat16)
        out = []
        for b in range(len(last)):
            pages = cache[indices[indptr[b]:indptr[b + 1]].long()].float()  # [used, 2, kvh, page, D]
            n = (len(pages) - 1) * page + int(last[b])
            k, v = (pages[:, i].permute(1, 0, 2, 3).reshape(kv_heads, -1, q.shape[-1])[:, :n] for i in (0, 1))
            out.append(torch.nn.functional.scaled_dot_product_attention(q[b, :, None].float(), k, v, enable_gqa=True))
        return torch.stack(out)[:, :, 0].to(q.dtype)


def fake_xqa(query, kv_cache, workspace, block_tables, seq_lens, max_seq_len, bmm1_scale, bmm2_scale, out,
             kv_layout):
    """FlashInfer's ``xqa_batch_decode_with_kv_cache`` contract (HND pages ``[pages, 2, kv_heads, page, D]``, a
    block table row and a uint32 length per sequence, scores scaled by bmm1_scale, out by bmm2_scale) in torch."""
    assert kv_layout == "HND" and workspace.dtype == torch.uint8 and kv_cache.dtype == torch.float8_e4m3fn
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.uint32
    assert block_tables.is_contiguous() and seq_lens.is_contiguous() and len(seq_lens) == len(block_tables)
    assert out.shape == query.shape and out.dtype == query.dtype == torch.bfloat16
    kv_heads, d = kv_cache.shape[2], query.shape[-1]
    for b, n in enumerate(seq_lens.view(torch.int32).tolist()):
        assert n <= max_seq_len and max_seq_len <= block_tables.shape[1] * kv_cache.shape[3]
        pages = kv_cache[block_tables[b].long()].float()
        k, v = (pages[:, i].permute(1, 0, 2, 3).reshape(kv_heads, -1, d)[:, :n] for i in (0, 1))
        o = torch.nn.functional.scaled_dot_product_attention(query[b, :, None].float(), k, v, scale=bmm1_scale,
                                                             enable_gqa=True)[:, 0]
        out[b] = (o * bmm2_scale).to(out.dtype)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    import sys
    import types

    fake = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=FakeDecodeWrapper,
                                 decode=types.SimpleNamespace(xqa_batch_decode_with_kv_cache=fake_xqa))
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(serve.FlashInferKV, "check", staticmethod(lambda device: None))
    monkeypatch.setattr(serve.FlashInferKV, "WORKSPACE", 2**20)  # the tiny model's budget is 6 MiB


@pytest.mark.parametrize("backend_name,kv_dtype", [("flashinfer", "bfloat16"), ("flashinfer", "float8_e4m3fn"),
                                                    ("flashinfer-xqa", "float8_e4m3fn")])
def test_flashinfer_backend_attends_over_the_prefix_and_the_new_token(backend_name, kv_dtype, fake_flashinfer):
    geo = serve.PRESETS["tiny"].geometry
    fmt = serve.Format(backend_name, "test", kv_dtype=kv_dtype)
    context, gen = 130, torch.Generator().manual_seed(3)
    backend = serve.BACKENDS[backend_name](geo, fmt, 3, context, context + 64, torch.device("cpu"), gen)
    backend.prepare(2)
    q = torch.randn(2, geo.q_heads, geo.head_dim, generator=gen).bfloat16()
    k, v = (torch.randn(2, geo.kv_heads, geo.head_dim, generator=gen).bfloat16() for _ in range(2))
    out = backend.append_attend(1, q, k, v)
    dtype = getattr(torch, kv_dtype)
    for b in range(2):
        pages = backend.kv[1, b * backend.pages_per_seq:(b + 1) * backend.pages_per_seq].float()
        keys, values = (pages[:, i].permute(1, 0, 2, 3).reshape(geo.kv_heads, -1, geo.head_dim) for i in (0, 1))
        assert torch.equal(keys[:, context], k[b].to(dtype).float())
        assert torch.equal(values[:, context], v[b].to(dtype).float())
        want = torch.nn.functional.scaled_dot_product_attention(q[b, :, None].float(), keys[:, :context + 1],
                                                                values[:, :context + 1], enable_gqa=True)[:, 0]
        assert torch.allclose(out[b].float(), want, atol=1e-2, rtol=1e-2)


def test_tiny_run_with_flashinfer_formats(fake_flashinfer):
    records = serve.main(["--model", "tiny", "--device", "cpu", "--formats", "bf16,fp8,fp8-xqa,int2"])
    by = {r["format"]: r for r in records}
    for name in ("bf16", "fp8", "fp8-xqa"):
        r = by[name]
        assert r["status"] == "ok", r["note"]
        assert sum(r["account"].values()) == round(serve.PRESETS["tiny"].memory_gib * serve.GIB)
        reserve = round(serve.PRESETS["tiny"].reserve_gib * serve.GIB)
        assert r["account"]["workspace"] == serve.FlashInferKV.WORKSPACE + reserve
        for p in r["points"]:
            assert p["tokens_in_range"] and p["tokens_changed"] and p["positions_advanced"]
            assert p["cache_advanced"] is None  # FlashInfer's lengths are fixed by the plan
    assert by["fp8"]["max_batch"] >= by["bf16"]["max_batch"]
    assert by["fp8-xqa"]["max_batch"] == by["fp8"]["max_batch"]  # the same pages


def test_append_merges_a_split_sweep(tmp_path):
    common = ["--model", "tiny", "--device", "cpu", "--out", str(tmp_path), "--tag", "split", "--points", "2"]
    serve.main(common + ["--formats", "int2,int4"])
    first = json.loads((tmp_path / "split.json").read_text())
    serve.main(common + ["--formats", "bf16,int4", "--append"])
    record = json.loads((tmp_path / "split.json").read_text())
    assert [r["format"] for r in record["formats"]] == ["bf16", "int4", "int2"]
    assert record["formats"][2] == first["formats"][1]  # int2 kept as measured; int4 measured again
    assert record["meta"]["command"].count("python -m benchmarks.serve") == 2
    with pytest.raises(SystemExit):  # other settings do not merge
        serve.main(common + ["--formats", "int4", "--append", "--steps", "5"])
