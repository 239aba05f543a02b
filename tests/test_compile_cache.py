"""The on-disk compile cache (foscar.compile_cache): hits across processes, concurrent writers,
FOSCAR_CACHE=0, list/clear, no PTX/cubin files left behind, a damaged entry is recompiled and replaced.

Each scenario runs in fresh processes, since the in-memory cache would hide the disk cache (marked
slow: ~10 s each, mostly process start-up and imports).
"""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Compiles (or loads) the combine kernel, the smallest FOSCAR kernel, and prints what happened.
COMPILE_COMBINE = """
import cutlass
from foscar.inspect import artifacts
from foscar.jit import cached_compile, compile_count
from foscar.kernels.combine import compile_combine
compiled = cached_compile(("combine", 128, cutlass.BFloat16, "sm_90a"),
                          lambda: compile_combine(128, "sm_90a", cutlass.BFloat16))
art = artifacts(compiled)
print(type(compiled).__name__, compile_count(), art.resources().registers, len(art.cubin), len(art.sass))
"""


def _pythonpath():
    """The checkout first, then what the parent had (the GPU machine finds the DSL through PYTHONPATH)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def run_python(code, cache_dir, cwd, **env):
    environ = dict(os.environ, PYTHONPATH=_pythonpath(), FOSCAR_CACHE_DIR=str(cache_dir), **env)
    return subprocess.Popen([sys.executable, "-c", code], cwd=cwd, env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(process):
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err
    return out.split("\n")[-2].split(), err


def cache_tool(cache_dir, *args):
    env = dict(os.environ, PYTHONPATH=_pythonpath(), FOSCAR_CACHE_DIR=str(cache_dir))
    result = subprocess.run([sys.executable, "-m", "foscar.compile_cache", *args], env=env, capture_output=True,
                            text=True, check=True)
    return result.stdout


@pytest.mark.slow
def test_second_process_loads_instead_of_compiling(tmp_path):
    cache = tmp_path / "cache"
    first, said = finish(run_python(COMPILE_COMBINE, cache, tmp_path))
    second, said_again = finish(run_python(COMPILE_COMBINE, cache, tmp_path))
    assert first[:2] == ["CudaDialectJitCompiledFunction", "1"]
    assert second[:2] == ["LoadedKernel", "0"]
    # the compile is said on stderr (foscar.log), the load is not
    assert f"[foscar] compiling combine 128 BFloat16 for sm_90a (its first use; to be kept in {cache} for later " \
           "processes)" in said
    assert "[foscar] compiled combine 128 BFloat16 for sm_90a in" in said and "[foscar]" not in said_again
    assert first[2:] == second[2:]  # same registers, cubin and SASS sizes
    assert len(list((cache / "kernels").iterdir())) == 1
    assert len(list((cache / "sass").glob("*.sass"))) == 1
    # the DSL's --keep-ptx/--keep-cubin files went to a dump directory that was removed
    assert not list(tmp_path.glob("cutlass___call___*"))
    assert not list(cache.glob("dump-*"))


@pytest.mark.slow
def test_two_processes_compiling_at_once_both_succeed(tmp_path):
    cache = tmp_path / "cache"
    racers = [run_python(COMPILE_COMBINE, cache, tmp_path) for _ in range(2)]
    results = [finish(p)[0] for p in racers]
    assert results[0][2:] == results[1][2:]
    assert len(list((cache / "kernels").iterdir())) == 1  # one entry, no staging directory left behind
    third, _ = finish(run_python(COMPILE_COMBINE, cache, tmp_path))
    assert third[:2] == ["LoadedKernel", "0"]


@pytest.mark.slow
def test_cache_off_writes_nothing(tmp_path):
    cache = tmp_path / "cache"
    for _ in range(2):
        out, _ = finish(run_python(COMPILE_COMBINE, cache, tmp_path, FOSCAR_CACHE="0"))
        assert out[:2] == ["CudaDialectJitCompiledFunction", "1"]
    assert not cache.exists()  # not even the DSL's dump directories


@pytest.mark.slow
def test_list_and_clear(tmp_path):
    cache = tmp_path / "cache"
    assert "0 kernels" in cache_tool(cache, "list")
    finish(run_python(COMPILE_COMBINE, cache, tmp_path))
    listing = cache_tool(cache, "list")
    assert "'combine', 128" in listing and "1 kernels, 1 SASS" in listing
    assert cache_tool(cache, "path").strip() == str(cache)
    (cache / "notes.txt").write_text("a file of the user's")  # FOSCAR_CACHE_DIR may hold other things
    assert "removed" in cache_tool(cache, "clear")
    assert sorted(p.name for p in cache.iterdir()) == ["notes.txt"]


@pytest.mark.slow
def test_damaged_entry_warns_and_recompiles(tmp_path):
    cache = tmp_path / "cache"
    finish(run_python(COMPILE_COMBINE, cache, tmp_path))
    (obj,) = (cache / "kernels").glob("*/kernel.o")
    obj.write_bytes(b"not an object file")
    out, err = finish(run_python(COMPILE_COMBINE, cache, tmp_path))
    assert out[:2] == ["CudaDialectJitCompiledFunction", "1"]
    assert "cannot load" in err
    out, err = finish(run_python(COMPILE_COMBINE, cache, tmp_path))  # the entry was written anew
    assert out[:2] == ["LoadedKernel", "0"] and "cannot load" not in err


@pytest.fixture
def foscar_log(monkeypatch):
    """The "foscar" logger's records while the test runs, at its default level whatever FOSCAR_LOG_LEVEL the tests run
    under (its stderr handler stays; the level is restored after)."""
    from foscar.log import logger

    level = logger.level
    monkeypatch.delenv("FOSCAR_LOG_LEVEL", raising=False)
    monkeypatch.setenv("FOSCAR_CACHE", "0")
    logger.setLevel(logging.INFO)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_a_compile_is_said_before_and_after_and_a_kept_kernel_is_not(foscar_log, capsys):
    from foscar.jit import cached_compile

    key = ("log_probe", object(), 16, "sm_100a")  # a key no other test builds
    built = cached_compile(key, object)
    assert cached_compile(key, lambda: pytest.fail("compiled again")) is built
    said = [r.getMessage() for r in foscar_log]
    assert said[0] == ("compiling log_probe 16 for sm_100a (its first use; FOSCAR_CACHE=0: not kept for later "
                       "processes) ...")
    assert said[1].startswith("compiled log_probe 16 for sm_100a in ") and said[1].endswith(" s") and len(said) == 2
    # the default handler writes to the stderr of the moment (here pytest's capture), once per line
    assert capsys.readouterr().err.count("[foscar] compiling log_probe 16 for sm_100a") == 1


def test_foscar_log_level_silences_the_compile_lines_and_a_bad_one_warns(monkeypatch, foscar_log):
    from foscar import log
    from foscar.jit import cached_compile

    monkeypatch.setenv("FOSCAR_LOG_LEVEL", "warning")
    log._logger()
    cached_compile(("log_probe", object(), "sm_90a"), object)
    assert not foscar_log
    monkeypatch.setenv("FOSCAR_LOG_LEVEL", "10")
    assert log._logger().level == logging.DEBUG
    monkeypatch.setenv("FOSCAR_LOG_LEVEL", "LOUD")
    with pytest.warns(RuntimeWarning, match="FOSCAR_LOG_LEVEL must be a logging level .*got 'LOUD'"):
        log._logger()
    assert log.logger.level == logging.INFO


def test_key_must_name_the_arch():
    from foscar.jit import cached_compile

    with pytest.raises(ValueError, match="must name the arch"):
        cached_compile(("combine", 128), lambda: None)


def test_entry_key_covers_key_and_sources(monkeypatch):
    from foscar import compile_cache

    base = compile_cache.entry_key(("combine", 128, "sm_90a"))
    assert base != compile_cache.entry_key(("combine", 128, "sm_100a"))
    monkeypatch.setattr(compile_cache, "source_hash", lambda: "edited")
    assert base != compile_cache.entry_key(("combine", 128, "sm_90a"))
    monkeypatch.undo()
    monkeypatch.setattr(compile_cache, "_dsl_settings", lambda: "lineinfo=True")  # a CUTE_DSL_* build setting
    assert base != compile_cache.entry_key(("combine", 128, "sm_90a"))


# Runs the Hopper/Blackwell decode kernel of this GPU and checks it against the float64 reference.
RUN_DECODE = """
import torch
from foscar import Scheme
from foscar.decode import decode
from foscar.jit import compile_count
from foscar.testing import check_output, random_problem
scheme = Scheme.make(2, "channel", 128, "token", 128, 128, 4)
q, cache = random_problem(scheme, [1, 300, 4097], kv_heads=2, page_size=128)
out, lse = decode(q, cache, return_lse=True)
acc = check_output(out, lse, q, cache, scheme.head_dim**-0.5)
print(acc.ok, compile_count())
"""


@pytest.mark.gpu
def test_kernel_loaded_from_disk_runs_correctly(tmp_path):
    cache = tmp_path / "cache"
    first, _ = finish(run_python(RUN_DECODE, cache, tmp_path))
    second, _ = finish(run_python(RUN_DECODE, cache, tmp_path))
    assert first[0] == "True" and int(first[1]) >= 1
    assert second == ["True", "0"]  # nothing compiled: every kernel came from the disk cache
