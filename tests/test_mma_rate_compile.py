"""Compile-only checks of the MMA-rate microbenchmark (benchmarks/mma_rate.py) for sm_90a (no GPU).

Each variant must emit exactly UNROLL instructions of its intended MMA in the PTX, none of another
kind, and not spill. Where nvdisasm is available, the SASS main loop must hold exactly UNROLL
tensor-core instructions and, for wgmma, one WARPGROUP.ARRIVE / DEPBAR per issued group (ptxas did
not serialize the wgmmas), with at most a handful of other instructions (loop overhead only).
"""

import os
import re

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest

pytest.importorskip("cutlass")

from benchmarks.mma_rate import KINDS, MODES, UNROLL, VARIANTS, compile_variant  # noqa: E402

MMA_RE = re.compile(r"\b(wgmma\.mma_async\.\S+|mma\.sync\.\S+)")
SASS_MMA = {"wgmma": ("HGMMA", "QGMMA"), "mma.sync": ("HMMA", "IMMA")}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_compiles_with_intended_mma(name):
    from foscar import inspect as fi

    kind_name, mode = VARIANTS[name]
    kind = KINDS[kind_name]
    compiled = compile_variant(name, "sm_90a")
    ptx = compiled.__ptx__
    assert ".target sm_90a" in ptx
    found = [m.rstrip(";") for m in MMA_RE.findall(ptx)]
    assert found, "no MMA instruction in the PTX"
    assert all(f.startswith(kind.ptx) for f in found), sorted(set(found))
    assert len(found) == UNROLL, (len(found), UNROLL)
    if kind.family == "wgmma":
        # RS: the A operand is a register vector `{...}`; SS: a 64-bit descriptor
        first = ptx[ptx.index(kind.ptx):]
        first = first[: first.index(";")]
        braces = re.findall(r"\{[^}]*\}", first)
        assert len(braces) == (2 if kind.a_src == "RS" else 1), first  # D regs (+ A regs for RS)
        assert len(braces[0].split(",")) == kind.m * kind.n // 128  # fp32 accumulator registers
        if kind.a_src == "RS":
            assert len(braces[1].split(",")) == 4  # 64 x 16 fp16 (or 64 x 32 fp8) A per 128 threads
        group, depth = MODES[mode]
        assert ptx.count("wgmma.commit_group.sync.aligned") >= UNROLL // group
        assert re.search(rf"wgmma\.wait_group\.sync\.aligned\s+{depth};", ptx)
    res = fi.kernel_resources(compiled.__cubin__)
    assert all(r.local_bytes == 0 for r in res.values()), res

    try:
        sass = fi.disassemble(compiled.__cubin__)
    except Exception as e:  # no nvdisasm on this machine: PTX checks only
        pytest.skip(f"SASS not checked: {e}")
    (body,) = fi.split_functions(sass).values()
    mix = fi.instruction_mix(body, loop_only=True, full_opcodes=True)
    mma = sum(c for op, c in mix.items() if op.split(".")[0] in SASS_MMA[kind.family])
    assert mma == UNROLL, dict(mix)
    other = sum(mix.values()) - mma
    if kind.family == "wgmma":
        group, _ = MODES[mode]
        assert mix["WARPGROUP.ARRIVE"] == UNROLL // group, dict(mix)
        assert mix["WARPGROUP.DEPBAR.LE"] == UNROLL // group, dict(mix)
        other -= 2 * UNROLL // group
    assert other <= 4, dict(mix)  # counter, compare, branch
