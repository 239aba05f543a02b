"""The decode benchmark's bookkeeping (CPU): geo-means over the standard sweep only, ceiling fractions,
missing baselines reported as missing, the JSON/markdown/PNG records. No timings here."""

import json
import math

import pytest

from benchmarks import decode as bench


def _rows():
    Row = bench.Row
    return [
        Row("qwen3-8b", 1, 32768, "flashinfer-bf16", 40.0, 134_000_000),
        Row("qwen3-8b", 1, 32768, "flashinfer-fp8", 30.0, 67_000_000),
        Row("qwen3-8b", 1, 32768, "int2-kc128", 10.0, 19_000_000),
        Row("qwen3-8b", 8, 32768, "flashinfer-bf16", 250.0, 1_070_000_000),
        Row("qwen3-8b", 8, 32768, "int2-kc128", 50.0, 151_000_000),
        Row("llama3-70b", 8, 32768, "flashinfer-bf16", 250.0, 1_070_000_000),
        Row("llama3-70b", 8, 32768, "int2-kc128", 25.0, 151_000_000),  # not in the standard sweep
        Row("qwen3-8b", 8, 32768, "sdpa-bf16", None, 0, note="missing: no module named x"),
    ]


def test_geomeans_cover_the_standard_sweep_only():
    table, geo = bench.summarize(_rows(), ceiling_tbps=4.5)
    assert geo["int2-kc128 vs flashinfer-bf16"] == pytest.approx(math.sqrt(4.0 * 5.0))  # not the 10x llama row
    assert geo["int2-kc128 vs flashinfer-fp8"] == pytest.approx(3.0)
    assert geo["int2-kc128 fraction of read ceiling"] == pytest.approx(
        math.sqrt((19e6 / 10.0 / 1e6 / 4.5) * (151e6 / 50.0 / 1e6 / 4.5)))
    assert "missing: no module named x" in table  # a missing baseline stays in the table


def test_save_and_plot_write_the_records(tmp_path):
    rows = _rows()
    meta = {"device": "test", "date": "today", "timing": "t", "versions": {}, "sass_main_loop": {
        "int2-kc128": {"shift_logic_per_element": 1.3, "instructions_per_element": 3.6}}}
    stem = str(tmp_path / "decode")
    table, geo = bench.save(rows, meta, 4.5, stem)
    record = json.loads((tmp_path / "decode.json").read_text())
    assert len(record["rows"]) == len(rows) and record["geomean"] == geo
    assert "SASS main loop" in (tmp_path / "decode.md").read_text()
    bench.plot(rows, 4.5, stem + ".png")
    assert (tmp_path / "decode.png").stat().st_size > 1000


def test_working_sets_exceed_four_times_l2():
    for nbytes in (1, 19_000_000, 134_000_000, 4_300_000_000):
        assert bench.copies_for(nbytes) * nbytes >= bench.WORKING_SET >= 4 * bench.L2_BYTES


def test_vs_fi_fp8_is_against_the_faster_fp8_baseline():
    Row = bench.Row
    rows = [Row("qwen3-8b", 1, 32768, "flashinfer-fp8", 36.0, 67_000_000, note="wrapper fa2"),
            Row("qwen3-8b", 1, 32768, "flashinfer-fp8-xqa", 24.0, 67_000_000, note="XQA mha_sm90"),
            Row("qwen3-8b", 1, 32768, "int2-kt128", 12.0, 19_000_000),
            Row("qwen3-8b", 8, 32768, "flashinfer-fp8", 200.0, 536_000_000),  # no XQA row: the wrapper's
            Row("qwen3-8b", 8, 32768, "flashinfer-fp8-xqa", None, 0, note="failed: RuntimeError: x"),
            Row("qwen3-8b", 8, 32768, "int2-kt128", 50.0, 151_000_000)]
    table, geo = bench.summarize(rows, ceiling_tbps=4.5)
    int2_b1, fp8_b1 = (next(line for line in table.splitlines() if f"| 1 | 32768 | {m} |" in line)
                       for m in ("int2-kt128", "flashinfer-fp8"))
    assert int2_b1.split(" | ")[8] == "2.00"  # 24 / 12, not 36 / 12
    assert fp8_b1.split(" | ")[8] == "0.67"  # the wrapper against XQA
    assert geo["int2-kt128 vs fastest FI fp8"] == pytest.approx(math.sqrt(2.0 * 4.0))
    assert geo["int2-kt128 vs flashinfer-fp8"] == pytest.approx(math.sqrt(3.0 * 4.0))
    assert geo["int2-kt128 vs flashinfer-fp8-xqa"] == pytest.approx(2.0)  # the one config it ran
    assert "int2-kt128 vs flashinfer-bf16" not in geo  # no BF16 rows here
    assert "XQA mha_sm90" in table and "failed: RuntimeError: x" in table


def test_compare_takes_ratios_of_times_per_method():
    """benchmarks.compare: the geo-mean of after / before times per method over the configs both timed, the
    slowest-moving row, and the serving shapes' rows (a missing or untimed row is left out)."""
    from benchmarks.compare import compare

    def record(times):
        return {"rows": [{"model": m, "batch": b, "context": c, "method": meth, "us": us}
                         for (m, b, c, meth), us in times.items()]}

    before = {("qwen3-8b", 1, 32768, "int2-kt128"): 10.0, ("qwen3-8b", 8, 32768, "int2-kt128"): 40.0,
              ("tp8-70b", 1, 131072, "int2-kt128"): 20.0, ("qwen3-8b", 1, 32768, "int4-kt128"): 30.0}
    after = {("qwen3-8b", 1, 32768, "int2-kt128"): 10.0, ("qwen3-8b", 8, 32768, "int2-kt128"): 44.0,
             ("tp8-70b", 1, 131072, "int2-kt128"): 20.0, ("qwen3-8b", 1, 32768, "int4-kt128"): None}
    text = compare(record(before), record(after))
    assert f"| int2-kt128 | {1.1 ** (1 / 3):.4f} | 1.100 (qwen3-8b 8 x 32768) | 3 |" in text
    assert "int4-kt128" not in text  # untimed after: no ratio
    assert "| tp8-70b 1 x 131072 | 20.0 -> 20.0 (+0.0%) |" in text
