"""foscar.inspect: one process compiles for sm_90a and sm_100a; resources, SASS and loop mix."""

import re

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import pytest
from cutlass.cutlass_dsl import CuTeDSL
from cutlass.cute.runtime import make_ptr

from foscar import inspect as fi

SEEN_ARCH = []


@cute.kernel
def _scaled_sum(src: cute.Tensor, dst: cute.Tensor, n: cutlass.Int32, pick: cutlass.Int32):
    tidx, _, _ = cute.arch.thread_idx()
    acc = cutlass.Float32(0.0)
    for i in cutlass.range(n, unroll=1):
        acc = acc * 0.5 + src[i * 128 + tidx]
    spill = cute.make_rmem_tensor((256,), cutlass.Float32)  # dynamically indexed: local memory
    for i in cutlass.range(256, unroll_full=True):
        spill[i] = acc * src[i * 128 + tidx]
    spill[pick % 256] = acc
    dst[tidx] = spill[(pick * 7 + tidx) % 256]


@cute.jit
def _launch(src: cute.Pointer, dst: cute.Pointer, n: cutlass.Int32, pick: cutlass.Int32, stream: cuda.CUstream):
    SEEN_ARCH.append(CuTeDSL._get_dsl().envar.arch)  # what trace-time code sees
    mSrc = cute.make_tensor(src, cute.make_layout(n * 128))
    mDst = cute.make_tensor(dst, cute.make_layout(128))
    _scaled_sum(mSrc, mDst, n, pick).launch(grid=[1, 1, 1], block=[128, 1, 1], stream=stream)


def _compile(arch):
    ptr = make_ptr(cutlass.Float32, 16, cute.AddressSpace.gmem, assumed_align=16)
    return fi.compile_for(arch, _launch, ptr, ptr, cutlass.Int32(1), cutlass.Int32(0), cuda.CUstream(0))


@pytest.mark.sass
def test_one_process_compiles_both_arches():
    envar = CuTeDSL._get_dsl().envar
    before = envar.arch  # resolved (CUTE_DSL_ARCH or detection): the private _arch may still be unset
    SEEN_ARCH.clear()
    arts = {arch: fi.artifacts(_compile(arch)) for arch in ("sm_90a", "sm_100a")}
    assert SEEN_ARCH == ["sm_90a", "sm_100a"]
    assert envar.arch == before  # restored
    for arch, art in arts.items():
        assert art.arch == arch
        assert re.search(rf"^\.target {arch}$", art.ptx, re.M)
        assert set(art.sass_by_kernel) == set(art.kernels)
        res = art.resources()
        assert 0 < res.registers <= 255
        assert res.local_bytes >= 256 * 4  # the dynamically indexed array lives in local memory
        mix = art.mix()
        assert mix["STL"] > 0 and mix["LDL"] > 0 and mix["FFMA"] >= 1 and mix["EXIT"] >= 1
        loop = art.loop_mix()
        assert loop["FFMA"] == 1 and loop["LDG"] == 1 and loop["BRA"] == 1  # the n-loop alone
        assert "STL" not in loop


def test_missing_nvdisasm_names_the_package(monkeypatch):
    from importlib import metadata

    def no_dist(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", no_dist)
    monkeypatch.setattr(fi.shutil, "which", lambda name: None)
    monkeypatch.setattr(fi.os.path, "isfile", lambda path: False)
    with pytest.raises(RuntimeError, match="nvidia-cuda-nvdisasm"):
        fi.find_nvdisasm.__wrapped__()


SASS = """
.text.k:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, R8, gdesc[UR4], R24 ;
        /*0020*/                   LOP3.LUT R2, R3, 0xf, RZ, 0xc0, !PT ;
        /*0030*/               @P0 BRA `(.L_x_1) ;
        /*0040*/                   BRA.DIV UR4, `(.L_x_3) ;
.L_x_2:
        /*0050*/                   EXIT ;
.L_x_3:
        /*0060*/                   SHFL.BFLY PT, R2, R3, 0x1, 0x1f ;
        /*0070*/                   BRA `(.L_x_2) ;
.L_x_4:
        /*0080*/                   BRA `(.L_x_4);
        /*0090*/                   NOP;
"""


def test_loop_heuristic_on_handwritten_sass():
    fn = fi.split_functions(SASS)["k"]
    assert fi.loop_regions(fn) == [(0x10, 0x30)]  # not the out-of-line jump back, not the trap
    assert fi.instruction_mix(fn, loop_only=True) == {"HGMMA": 1, "LOP3": 1, "BRA": 1}
    assert fi.instruction_mix(fn, loop_only=True, full_opcodes=True)["HGMMA.64x64x16.F32.BF16"] == 1
    assert "NOP" not in fi.instruction_mix(fn)
