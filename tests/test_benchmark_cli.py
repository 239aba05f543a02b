"""The benchmarks refuse what they cannot run before their slow part (CPU): no CUDA GPU, an unknown
choice. The message names what is missing or the choices."""

import importlib
import sys

import pytest
import torch


@pytest.mark.parametrize("name", ["decode", "generate", "ragged", "rows", "hopper_sweep", "pipeline_probe",
                                  "mma_rate", "verify", "extend", "fused_attention",
                                  "dequantize", "split_probe"])
def test_gpu_benchmarks_say_they_need_a_gpu_at_once(name, monkeypatch):
    module = importlib.import_module(f"benchmarks.{name}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a GPU machine
    if name == "generate":  # the 18 s of model building that used to come first
        monkeypatch.setattr(module, "build_model", lambda path: pytest.fail("built the model before the GPU check"))
    with pytest.raises(SystemExit, match=f"benchmarks.{name} needs a CUDA GPU"):
        module.main("before") if name == "rows" else module.main([])


def test_accuracy_names_the_formats_before_loading_the_model(monkeypatch, capsys):
    from benchmarks import accuracy

    monkeypatch.setattr(accuracy, "load_model", lambda: pytest.fail("loaded the model before checking --formats"))
    with pytest.raises(SystemExit) as exit_info:
        accuracy.main(["--formats", "int4", "int3"])
    assert exit_info.value.code == 2
    assert "argument --formats: invalid choice: 'int3' (choose from" in capsys.readouterr().err
    assert [c.fmt for c in accuracy.grid(["k4v2"])] == ["k4v2"] * 4  # a known subset still selects


@pytest.mark.parametrize("args,message", [(["--tokens", "2,4"], "--tokens must start with 1"),
                                          (["--methods", "int2-kt128+sw"], "--methods: 'int2-kt128+sw' is not"),
                                          (["--rollback", "-1"], "--rollback must be >= 0"),
                                          (["--rollback", "2", "--path", "paged"], "--path paged has none")])
def test_verify_names_a_bad_choice_before_the_gpu_check(args, message, capsys):
    from benchmarks import verify

    with pytest.raises(SystemExit):
        verify.main(args)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [(["--models", "tp9"], "--models: each one of"),
                                          (["--consumers", "5"], "--consumers: 1 to 4 warpgroups"),
                                          (["--splits", "0"], "--splits: positive counts"),
                                          (["--splits", "x"], "comma-separated integers"),
                                          (["--ctas-per-sm", "3"], "--ctas-per-sm: 1 or 2")])
def test_split_probe_names_a_bad_choice_before_the_gpu_check(args, message, capsys):
    from benchmarks import split_probe

    with pytest.raises(SystemExit):
        split_probe.main(args)
    assert message in capsys.readouterr().err


def test_flashinfer_missing_says_how_to_install_it(monkeypatch):
    import sys

    from benchmarks.decode import import_flashinfer

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # what an environment without it gives
    with pytest.raises(ImportError, match=r"pip install -e '\.\[bench\]' \(flashinfer-python\)"):
        import_flashinfer()


def test_xqa_baseline_missing_from_the_installed_flashinfer_stops_the_run(monkeypatch):
    import sys
    import types

    from benchmarks import decode

    old = types.SimpleNamespace(__version__="0.1.0", decode=types.SimpleNamespace())  # no XQA entry
    with pytest.raises(ImportError, match="flashinfer-fp8-xqa needs flashinfer.decode.xqa_batch_decode_with_kv_cache"
                                          ".*installed flashinfer 0.1.0"):
        decode.xqa_decode_of(old)
    monkeypatch.setitem(sys.modules, "flashinfer", old)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(decode, "read_ceiling_us", lambda: pytest.fail("measured before checking the baselines"))
    with pytest.raises(SystemExit, match="--methods flashinfer-fp8-xqa: .*installed flashinfer 0.1.0"):
        decode.main(["--methods", "flashinfer-fp8,flashinfer-fp8-xqa,int2-kt128"])
    decode.check_flashinfer_paths(["flashinfer-fp8", "int2-kt128"])  # without XQA asked for, nothing to check
    entry = object()
    assert decode.xqa_decode_of(types.SimpleNamespace(decode=types.SimpleNamespace(
        xqa_batch_decode_with_kv_cache=entry))) is entry


def test_xqa_names_the_kernel_it_runs_and_the_bundle_its_variants():
    from benchmarks.decode import xqa_kernel
    from benchmarks.fi_xqa_aot import xqa_variants

    assert xqa_kernel((9, 0), 128).startswith("XQA mha_sm90") and xqa_kernel((9, 0), 256).startswith("XQA mha_sm90")
    assert xqa_kernel((10, 0), 128) == xqa_kernel((9, 0), 512) == "XQA mha.cu (generic)"
    assert xqa_variants({"a": (32, 8, 128), "b": (64, 8, 128), "c": (16, 4, 256)}) == [(128, 4), (128, 8), (256, 4)]


@pytest.mark.parametrize("spec", ["tests/user_formats.py", "user_formats"])
def test_user_formats_load_by_path_or_module_name(spec, monkeypatch):
    """``--user-formats`` takes a file path or a dotted module name (the module form raised UnboundLocalError:
    a function-local ``import importlib.util`` shadowed the module-level name)."""
    import pathlib
    import sys

    from benchmarks.decode import import_user_formats

    import foscar.formats

    root = pathlib.Path(__file__).parent
    monkeypatch.chdir(root.parent)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, "user_formats", raising=False)  # imported afresh, registered afresh:
    for name in ("int8", "sym-int4"):  # in a copy of the registry, the test's own
        monkeypatch.delitem(foscar.formats.FORMATS, name, raising=False)
    module = import_user_formats(spec)
    assert module.INT8.name == "int8"


def test_ab_loads_a_revision_as_its_own_package(tmp_path):
    """``benchmarks.ab`` loads a git revision's ``foscar/`` (and a directory's copy of it) under its own name: its
    schemes are its own classes and its arch registry dispatches to its own kernel modules; a bad method name fails
    before anything compiles; the table's geo-mean is that of the rows' ratios."""
    import subprocess

    from benchmarks import ab

    copy = tmp_path / "copy"
    copy.mkdir()
    tar = subprocess.run(["git", "-C", str(ab.ROOT), "archive", "HEAD", "foscar"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(copy)], input=tar.stdout, check=True)
    into = tmp_path / "pkgs"
    into.mkdir()
    try:
        packages = ab.load(["HEAD", str(copy / "foscar"), ab.WORKTREE], into)
        names = [pkg.__name__ for pkg in packages]
        assert names[0] == "foscar_HEAD" and names[1].startswith("foscar_") and names[2] == "foscar"
        for pkg in packages:
            scheme = ab.scheme_for(pkg, "int2-kc128")
            assert type(scheme).__module__ == pkg.__name__ + ".scheme" and scheme.name.startswith("int2-kc128")
            arch = importlib.import_module(pkg.__name__ + ".archs").HOPPER
            assert arch.kernel_module == pkg.__name__ + ".hopper.decode"
        with pytest.raises(ValueError, match="method 'int3-kt128'"):
            ab.scheme_for(packages[0], "int3-kt128")
        tp8 = ab.scheme_for(packages[0], "int4-kt128", "tp8-70b")  # --model's geometry: 8 query heads per KV head
        assert (tp8.gqa_ratio, tp8.head_dim) == (8, 128) and ab.scheme_for(packages[0], "int4-kt128").gqa_ratio == 4
        rows = [{"model": "x", "method": "m", "shape": "1x1", "tokens": 1, "splits": "1", names[0]: 10.0,
                 names[1]: 5.0, names[2]: 20.0},
                {"model": "x", "method": "m", "shape": "2x1", "tokens": 4, "splits": "64/128", names[0]: 10.0,
                 names[1]: 20.0, names[2]: 20.0}]
        lines = ab.table(["a", "b", "c"], packages, rows).splitlines()
        assert lines[3] == "| x | m | 2x1 | 4 | 64/128 | 10.0 (1.000) | 20.0 (2.000) | 20.0 (2.000) |"
        assert lines[-1] == "| geo-mean | | | | | 1.000 | 1.000 | 2.000 |"
    finally:
        sys.path.remove(str(into))
        for name in list(sys.modules):
            if name.startswith("foscar_"):
                del sys.modules[name]


def test_decode_rows_pick_shapes_and_name_a_bad_entry(capsys):
    """``--rows`` picks the benchmark's rows (model:batch x context); a bad entry fails before any GPU work, naming
    it."""
    from benchmarks import decode

    assert decode.parse_rows("qwen3-8b:256x2048,tp8-70b:1x131072") == [("qwen3-8b", 256, 2048), ("tp8-70b", 1, 131072)]
    for bad in ("qwen3:1x2", "qwen3-8b:1x", "qwen3-8b:0x2048", "qwen3-8b"):
        with pytest.raises(ValueError, match="is not <model>:<batch>x<context>"):
            decode.parse_rows(bad)
    with pytest.raises(SystemExit):
        decode.main(["--rows", "qwen3-8b:2x", "--methods", "int2-kt128"])
    assert "--rows: 'qwen3-8b:2x' is not" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [(["--lengths", "700,32"], "--lengths must be >= 64"),
                                          (["--seeds", "1,x"], "--seeds must be comma-separated integers"),
                                          (["--span", "100"], "--span must be a positive multiple of the 64-token")])
def test_integer_pv_probe_names_a_bad_argument(args, message, capsys):
    from benchmarks import integer_pv_probe

    with pytest.raises(SystemExit):
        integer_pv_probe.main(args)
    assert message in capsys.readouterr().err
