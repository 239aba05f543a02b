"""The benchmarks refuse what they cannot run before their slow part (CPU): no CUDA GPU, an unknown
choice. The message names what is missing or the choices."""

import importlib

import pytest
import torch


@pytest.mark.parametrize("name", ["decode", "generate", "ragged", "rows", "hopper_sweep", "pipeline_probe",
                                  "mma_rate"])
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


def test_flashinfer_missing_says_how_to_install_it(monkeypatch):
    import sys

    from benchmarks.decode import import_flashinfer

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # what an environment without it gives
    with pytest.raises(ImportError, match=r"pip install -e '\.\[bench\]' \(flashinfer-python\)"):
        import_flashinfer()
