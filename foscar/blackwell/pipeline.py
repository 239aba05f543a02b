"""The mbarrier handoffs of the sm_100a decode kernel (no cluster, one CTA): its channels
(``foscar.pipeline.Channel``, the ring's and the warpgroups' handoffs) and the tcgen05 fences around them.

Arrival counts: 1 where a ``tcgen05.commit`` or a single ``arrive.expect_tx`` thread arrives, 128 where a
whole warpgroup arrives.

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

from ..pipeline import Channel


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
