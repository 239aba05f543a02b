"""The long-context accuracy benchmark (``benchmarks/accuracy_long.py``) on the CPU.

Without the model: answer scoring, the greedy-divergence report, the paired perplexity, the format table
(every entry builds a FoscarCache), the options and the report (its kernels-vs-torch table too, which only a
GPU run fills). With SmolLM2-135M (marked slow: 2 min 50 s in all on 2 shared cores at load ~4 -- model load
24 s, the retrieval test 99 s, the comparison 44 s; the decode steps dominate): the passkey task is honest --
BF16 retrieves the key from a short Genesis filler (a broken prompt, answer loop or scorer cannot pass), the
same prompts without the needle retrieve nothing (a scorer that matches anything cannot pass), every prompt of
a batch has the same length with the needle where it says; and the kernels-vs-torch comparison, run on the
torch path against itself, finds the two runs identical (a misaligned comparison would not).
"""

import json
import os

import pytest
import torch

from benchmarks import accuracy, accuracy_long

LENGTH = 384  # a short filler: ~300 tokens of Genesis around the needle
DEPTHS = (10, 50, 90)
TRIALS = 4
BF16_MIN_HITS = 11  # of 12; measured 12 (and 8 / 8 per depth with a 300-token filler, the question prefilled)


def test_exact_match_takes_the_first_run_of_digits_whole():
    answers = [" 68341.", " 6834", " 683411", " a door", "is 68341", " 12345 68341"]
    assert accuracy_long.exact_match(answers, [68341] * 6) == [True, False, False, False, True, False]


def test_first_divergence_reports_the_first_differing_step_and_both_margins():
    tokens_a = torch.tensor([[1, 2, 3], [1, 2, 3]])
    tokens_b = torch.tensor([[1, 2, 3], [1, 0, 2]])  # row 1 first differs at step 1 (not 2)
    logits_a = torch.zeros(2, 3, 4)
    logits_b = torch.zeros(2, 3, 4)
    logits_a[1, 1, 2], logits_a[1, 1, 0] = 5.0, 4.5  # a prefers its token 2 by 0.5
    logits_b[1, 1, 0], logits_b[1, 1, 2] = 3.0, 2.75  # b prefers its token 0 by 0.25
    rows = accuracy_long.first_divergence(tokens_a, logits_a, tokens_b, logits_b)
    assert rows[0] == {"step": None}
    assert rows[1] == {"step": 1, "margin_a": pytest.approx(0.5), "margin_b": pytest.approx(0.25)}


def test_paired_ppl_of_identical_runs_and_of_a_shift():
    nll = torch.tensor([[1.0, 2.0], [3.0, 0.5]])
    same = accuracy_long.paired_ppl(nll, nll)
    assert same["ppl_a"] == same["ppl_b"] == pytest.approx(torch.exp(nll.mean()).item())
    assert same["nll_diff"] == 0 and same["nll_diff_se"] == 0
    shifted = accuracy_long.paired_ppl(nll + 0.1, nll)
    assert shifted["nll_diff"] == pytest.approx(0.1) and shifted["nll_diff_se"] == pytest.approx(0, abs=1e-7)


def test_sentence_end_near_snaps_to_the_nearest_end():
    ends = {9}
    tokens = [1, 9, 1, 1, 1, 1, 9, 1]  # sentence ends after index 1 and index 6: boundaries j = 2, 7
    assert accuracy_long.sentence_end_near(tokens, 3, ends) == 2
    assert accuracy_long.sentence_end_near(tokens, 6, ends) == 7
    assert accuracy_long.sentence_end_near([1, 1], 1, ends) == 1  # no sentence end: the target itself


def test_every_format_builds_a_foscar_cache_and_bf16_is_the_baseline():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                      num_hidden_layers=1, vocab_size=64)
    assert accuracy_long.FORMATS[accuracy_long.BASELINE] is None
    from foscar.integrations.transformers import FoscarCache

    for name, kwargs in accuracy_long.FORMATS.items():
        if kwargs is not None:
            cache = FoscarCache(config, max_batch_size=1, max_seq_len=512, sink=accuracy_long.SINK,
                                window=accuracy_long.WINDOW, device="cpu", **kwargs)
            assert cache.kv.sink == 64 and cache.kv.window == 256, name


def test_options_put_the_baseline_first_and_refuse_unknown_formats():
    args = accuracy_long.parse_args(["--quick", "--formats", "int2,bf16,int2"])
    assert args.formats == ["bf16", "int2"] and args.lengths == accuracy_long.QUICK["lengths"]
    short = accuracy_long.parse_args(["--score", "4"])  # the greedy and compare defaults follow a short --score
    assert (short.greedy, short.compare) == (4, 4)
    for bad in (["--formats", "int3"], ["--depths", "120"], ["--greedy", "600"], ["--greedy", "0"], ["--trials", "0"]):
        with pytest.raises(SystemExit):
            accuracy_long.parse_args(bad)


def _records():
    """Synthetic results of every part (the kernels-vs-torch part runs on CUDA only: its report is checked here)."""
    meta = {"date": "today", "device": "test", "device_tag": "test", "path": "p", "versions": "v", "command": "c",
            "text_tokens": 1, "model_sha256": "x", "formats": ["bf16", "int4", "int2"], "minutes": 1.0,
            "compile_seconds": {"int4": 2.0}, "trials": 100, "ppl_rows": 4, "ppl_length": 8192, "score": 256,
            "greedy": 32}
    ppl = [{"format": f, "quantized_share": 0.9, "ppl": p, "ppl_delta": p - 10.0, "kl": 0.01, "top1_agreement": 0.9,
            "greedy_agreement": 0.5} for f, p in (("bf16", 10.0), ("int4", 10.1), ("int2", 11.0))]
    agreement = [{"format": "int4", "steps": 128, "greedy_steps": 32, "ppl_a": 10.1, "ppl_b": 10.1, "ppl_bf16": 10.0,
                  "nll_diff": 1e-5, "nll_diff_se": 2e-5, "kl": 1e-6, "top1_agreement": 1.0,
                  "divergence": [{"step": None}, {"step": 17, "margin_a": 0.01, "margin_b": 0.02}]}]
    accuracies = {"bf16": (0.90, 0.80), "int4": (0.90, 0.79), "int2": (0.80, 0.60)}  # int2: 15 points below
    retrieval = [{"format": f, "length": 8192, "depth": d, "trials": 100, "accuracy": a, "needle_quantized": 1.0}
                 for f, accs in accuracies.items() for d, a in zip((10, 90), accs)]
    return meta, ppl, agreement, retrieval


def test_save_writes_the_records_plot_and_verdict(tmp_path):
    meta, ppl, agreement, retrieval = _records()
    stem = str(tmp_path / "accuracy-long")
    text = accuracy_long.save(stem, meta, ppl, agreement, retrieval)
    assert json.load(open(stem + ".json"))["kernels_vs_torch"][0]["divergence"][1]["step"] == 17
    assert os.path.getsize(stem + ".png") > 0 and open(stem + ".md").read() == text
    row = "| int4 | 10.1000 | 10.1000 | 10.0000 | +0.00001 (+- 0.00002) | 1.00e-06 | 1.0000 | -, 17 (0.010 / 0.020) |"
    assert row in text
    assert "- int4: 84.5% vs BF16 85.0% at 8192 tokens (-0.5 points): within 2 points of BF16" in text
    assert "- int2: 70.0% vs BF16 85.0% at 8192 tokens (-15.0 points): NOT within 2 points of BF16" in text


@pytest.fixture(scope="module")
def model_and_text():
    accuracy.require_sources()
    tokenizer, model = accuracy.load_model()
    text_ids = torch.tensor(tokenizer(accuracy.load_text(), add_special_tokens=False).input_ids)
    return tokenizer, model, text_ids


@pytest.mark.slow
def test_prompts_of_a_batch_have_one_length_and_the_needle_where_it_says(model_and_text):
    tokenizer, _, text_ids = model_and_text
    batch = accuracy_long.passkey_batch(tokenizer, text_ids, 2048, 0.5, 16)
    context = batch.context.shape[1]
    assert context + batch.question.numel() + accuracy_long.ANSWER_TOKENS == 2048
    assert len(set(batch.keys)) > 1 and all(10_000 <= k <= 99_999 for k in batch.keys)
    for row, at, key in zip(batch.context, batch.needle_at, batch.keys):
        assert tokenizer.decode(row[at:at + batch.needle_len]) == accuracy_long.NEEDLE.format(key=key)
        assert abs(at / context - 0.5) < 0.05  # snapped to a sentence end near the middle


@pytest.mark.slow
def test_bf16_retrieves_the_key_from_a_short_filler_and_nothing_without_the_needle(model_and_text):
    tokenizer, model, text_ids = model_and_text
    rows = [row for depth in DEPTHS for row in accuracy_long.retrieval(
        model, tokenizer, text_ids, LENGTH, depth, TRIALS, ["bf16"], seed=0, log=print)]
    hits = sum(row["correct"].count("1") for row in rows)
    print(f"BF16: {hits} / {len(DEPTHS) * TRIALS} keys retrieved; e.g. {rows[0]['answers']} for {rows[0]['keys']}")
    assert hits >= BF16_MIN_HITS
    control = accuracy_long.passkey_batch(tokenizer, text_ids, LENGTH, 0.5, TRIALS, needle=False)
    pre = accuracy.prefill(model, control.context)
    cache = accuracy_long.make_cache(model, "bf16", pre.kv, LENGTH)
    answers = tokenizer.batch_decode(accuracy_long.answer(model, cache, control.question, TRIALS))
    print(f"no needle: {answers}")
    assert not any(accuracy_long.exact_match(answers, control.keys))


@pytest.mark.slow
def test_kernels_vs_torch_of_the_torch_path_against_itself_is_identical(model_and_text):
    """On the CPU both sides are the torch path: the comparison must find no difference at all."""
    _, model, text_ids = model_and_text
    score, steps, length = 4, 2, 452
    ids = accuracy.windows(text_ids, 1, length + 1)  # 448 prefilled > sink + window + granule: pages hold tokens
    pre = accuracy.prefill(model, ids[:, :-score - 1])
    targets = ids[:, -score - 1:]
    bf16 = accuracy_long.teacher_forced(model, accuracy_long.make_cache(model, "bf16", pre.kv, length), targets,
                                        keep=score)
    cache = accuracy_long.make_cache(model, "int2", pre.kv, length)
    assert cache.kv.quantized_tokens(pre.length + 1) > 0
    run = accuracy_long.teacher_forced(model, cache, targets, keep=steps)
    first = pre.last_logits.argmax(-1)
    tokens, logits = accuracy_long.greedy(model, accuracy_long.make_cache(model, "int2", pre.kv, length), first, steps)
    out = accuracy_long.kernels_vs_torch(model, "int2", pre, targets[:, :steps + 1], length, run, tokens, logits,
                                         first, bf16, print)
    assert out["nll_diff"] == 0 and out["kl"] == 0 and out["top1_agreement"] == 1
    assert out["divergence"] == [{"step": None}]
    assert out["ppl_a"] != out["ppl_bf16"]  # INT2 differs from BF16: the quantized pages were attended
