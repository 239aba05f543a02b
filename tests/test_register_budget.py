"""setmaxnreg within the launch's register allotment, both arches (CPU, compile only). A warpgroup's
``setmaxnreg.inc`` waits until the CTA's pool (the registers the CTA was launched with, not the SM's 64K) has what it
asks for, so roles that together ask for more hang the kernel: 4 Hopper consumer warpgroups once asked for 112
registers of a 96-register launch and hung on the H200 (benchmarks/NOTES.md section 38). And PTX leaves an ``.inc`` to
fewer registers than the warp holds (or a ``.dec`` to more) undefined."""

import re

import pytest

pytest.importorskip("cutlass")

from foscar.archs import get_arch  # noqa: E402
from foscar.device import check_register_budget, launch_regs  # noqa: E402
from foscar.inspect import artifacts  # noqa: E402
from foscar.scheme import Scheme  # noqa: E402

INT2 = Scheme.make(2, "token", 128, "token", 128, 128, 4)


def assert_setmaxnreg_within_launch(compiled):
    """The cubin's registers per thread are ``launch_regs`` of the kernel's ``.reqntid``; every setmaxnreg moves the
    way its qualifier says from there."""
    art = artifacts(compiled)
    threads = int(re.search(r"\.reqntid (\d+)", art.ptx).group(1))
    ctas = int(re.search(r"\.minnctapersm (\d+)", art.ptx).group(1))
    launch = art.resources().registers
    assert launch == launch_regs(threads, ctas), (threads, ctas, launch)
    moves = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);", art.ptx)
    assert moves, "no setmaxnreg: ptxas dropped the per-role registers"
    for action, target in moves:
        assert (int(target) >= launch) if action == "inc" else (int(target) <= launch), (action, target, launch)
    return threads, launch, {(a, int(t)) for a, t in moves}


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("kernel", ["split decode", "cache decode"])
def test_setmaxnreg_moves_from_the_launch_allotment(arch, kernel):
    target = get_arch(arch)
    compiled = (target.compile_decode(INT2, 128, True) if kernel == "split decode"
                else target.compile_cache_decode(INT2, 128))
    assert_setmaxnreg_within_launch(compiled)


def test_blackwell_roles_release_what_the_others_take():
    """sm_100a: 512 threads launch at 128 registers; the MMA (80) and prep (112) warpgroups release, the softmax and
    output warpgroups (160) take: the prep warpgroup's move is a decrease (it was an increase to fewer, undefined)."""
    from foscar.blackwell.kernel import REGS

    threads, launch, moves = assert_setmaxnreg_within_launch(get_arch("sm_100a").compile_decode(INT2, 128, True))
    assert (threads, launch) == (512, 128)
    assert moves == {("dec", 80), ("dec", 112), ("inc", 160)}
    assert sum(REGS.values()) <= launch * len(REGS)


@pytest.mark.parametrize("consumers", [1, 2, 3, 4])
def test_hopper_consumers_ask_for_no_more_than_the_producer_frees(consumers):
    """Hopper, 1-4 consumer warpgroups: the producer's decrease to PRODUCER_REGS frees what the consumers' increase
    takes (4: 104 registers; the SM's 64K over 5 warpgroups would have asked 112 and hung)."""
    from foscar.hopper.decode import KERNELS
    from foscar.hopper.kernel import PRODUCER_REGS, DecodeConfig

    cfg = DecodeConfig(INT2, 128, True, consumers)
    assert PRODUCER_REGS + consumers * cfg.consumer_regs <= cfg.launch_regs * (1 + consumers)
    _, launch, moves = assert_setmaxnreg_within_launch(KERNELS.compile_decode(INT2, 128, True, consumers=consumers))
    assert launch == cfg.launch_regs and moves == {("dec", PRODUCER_REGS), ("inc", cfg.consumer_regs)}


def test_two_ctas_per_sm_share_the_sm():
    """Hopper, one consumer warpgroup at two CTAs per SM (short sequences, ``HopperKernels.launch_options``): 256
    threads launch at 128 registers (``.minnctapersm 2``), the producer's decrease frees what the consumers' increase
    takes (216), no spill, and the CTA's shared memory is at most half the SM's."""
    from foscar.hopper.decode import KERNELS
    from foscar.hopper.kernel import PRODUCER_REGS, SM_SMEM_BYTES, DecodeConfig, HopperDecodeKernel, two_ctas_pipeline

    cfg = DecodeConfig(INT2, 128, False, 1, ctas_per_sm=2)
    compiled = KERNELS.compile_decode(INT2, 128, False, ctas_per_sm=2)  # (one consumer warpgroup: the default there)
    threads, launch, moves = assert_setmaxnreg_within_launch(compiled)
    assert (threads, launch, cfg.launch_regs) == (256, 128, 128) and cfg.PIPELINED
    assert moves == {("dec", PRODUCER_REGS), ("inc", cfg.consumer_regs)} and cfg.consumer_regs == 216
    assert artifacts(compiled).resources().local_bytes == 0
    for scheme in (INT2, Scheme.make(2, "channel", 128, "token", 128, 128, 8), Scheme.make(4, "token", 128, "channel",
                   128, 128, 1), Scheme.make(4, "channel", 64, "channel", 64, 64, 4)):  # the largest rings taken
        assert two_ctas_pipeline(scheme), scheme.name
        storage = HopperDecodeKernel(DecodeConfig(scheme, 128, False, 1, ctas_per_sm=2)).shared_storage()
        assert 2 * (storage.size_in_bytes() + 1024) <= SM_SMEM_BYTES, scheme.name  # (the driver's 1 KB per CTA)
    with pytest.raises(ValueError, match="ctas_per_sm must be 1, or 2 with one consumer warpgroup"):
        DecodeConfig(INT2, 128, False, 3, ctas_per_sm=2)


def test_an_over_budget_role_set_is_refused_by_name():
    check_register_budget("k", [40, 152, 152, 152], 128)
    with pytest.raises(ValueError, match=r"k: warpgroups of \[40, 112, 112, 112, 112\] registers per thread need"):
        check_register_budget("k", [40, 112, 112, 112, 112], 96)
