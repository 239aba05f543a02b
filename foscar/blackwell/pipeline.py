"""Hand-rolled mbarrier handoffs of the sm_100a decode kernel (no cluster, one CTA).

A *channel* is ``stages`` buffers, each guarded by a ``full`` and an ``empty`` mbarrier. Item ``i``
(a step or a tile) uses stage ``i % stages`` in phase parity ``(i // stages) % 2``; the producer
waits ``empty`` on the opposite parity (a fresh mbarrier counts as completed for parity 1, so the
first pass does not block). Arrival counts: 1 where a ``tcgen05.commit`` or a single
``arrive.expect_tx`` thread arrives, 128 where a whole warpgroup arrives.

Proxy rules the kernel follows (PTX ISA, tcgen05 memory consistency):
  * threads -> tcgen05 (smem operands): ``fence.proxy.async.shared::cta`` before the ``full`` arrive;
  * tcgen05.mma -> threads (TMEM): ``tcgen05.commit`` to ``full``, the reader waits, then
    ``tcgen05.fence::after_thread_sync`` before its ``tcgen05.ld``;
  * threads -> tcgen05.mma (TMEM buffer released): ``tcgen05.wait::ld`` +
    ``tcgen05.fence::before_thread_sync`` before the ``empty`` arrive; the MMA warp waits, then
    ``tcgen05.fence::after_thread_sync`` before the next ``tcgen05.mma`` into that buffer.

The 1-D bulk copy itself (``cp.async.bulk`` + ``complete_tx``) is ``foscar.pipeline``'s
(arch-neutral PTX).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def _asm(text: str, *, loc=None, ip=None):
    llvm.inline_asm(res=None, operands_=[], asm_string=text, constraints="~{memory}", has_side_effects=True,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def tcgen05_fence_after():
    """``tcgen05.fence::after_thread_sync``: order later tcgen05 ops after a preceding wait."""
    _asm("tcgen05.fence::after_thread_sync;")


def tcgen05_fence_before():
    """``tcgen05.fence::before_thread_sync``: order earlier tcgen05 ops before a following arrive."""
    _asm("tcgen05.fence::before_thread_sync;")


def stage(i, stages: int):
    return i % stages if stages > 1 else 0


def phase(i, stages: int):
    return (i // stages) % 2


@dataclass(frozen=True)
class Channel:
    """``stages`` (full, empty) mbarrier pairs from ``base``: full[s] = base + s, empty[s] = base + stages + s.
    (A frozen dataclass: the kernel may call its methods inside runtime loops and branches, docs/design.md
    section 3.)"""

    base: cute.Pointer
    stages: int

    def next(self, stages: int) -> Channel:
        """The channel of ``stages`` pairs right after this one."""
        return Channel(self.base + 2 * self.stages, stages)

    def init(self, full_count: int, empty_count: int):
        """Call from one thread (then mbarrier_init_fence + a CTA barrier)."""
        for s in range(self.stages):
            cute.arch.mbarrier_init(self.base + s, full_count)
            cute.arch.mbarrier_init(self.base + self.stages + s, empty_count)

    def stage(self, i):
        return stage(i, self.stages)

    def full(self, s):
        return self.base + s

    def empty(self, s):
        return self.base + self.stages + s

    def wait_full(self, i):
        """Consumer: item i is in its stage."""
        cute.arch.mbarrier_wait(self.base + stage(i, self.stages), phase(i, self.stages))

    def release(self, i):
        """Consumer: done with item i's stage (one arrival per thread)."""
        cute.arch.mbarrier_arrive(self.base + self.stages + stage(i, self.stages))

    def wait_empty(self, i):
        """Producer: item i - stages has been released (passes at once on the first pass)."""
        cute.arch.mbarrier_wait(self.base + self.stages + stage(i, self.stages), phase(i, self.stages) ^ 1)

    def publish(self, i):
        """Producer: item i is written (one arrival per thread)."""
        cute.arch.mbarrier_arrive(self.base + stage(i, self.stages))


@dataclass(frozen=True)
class Channels:
    """The decode kernel's channels, one after another in shared memory (arrival counts (full, empty) in
    ``BlackwellDecodeKernel.run``), and the ring's stages (int32 words) that ``ring`` guards."""

    ring: Channel  # producer (expect_tx) -> prep + softmax: the packed tiles
    opnd: Channel  # prep -> MMA: the A operands (and Q'^T)
    s: Channel  # MMA (commit) -> softmax: S in TMEM
    p: Channel  # softmax -> MMA: P'^T in smem
    st: Channel  # softmax -> output: alpha, P unscale, Psum
    o: Channel  # MMA (commit) -> output: O partials in TMEM
    ring_words: cute.Pointer
