"""The shared-memory ring of the decode kernels (Hopper and Blackwell): 1-D bulk copies (TMA
engine) into stages guarded by mbarriers.

Every (page, kv_head, 64-token tile) block of packed codes is contiguous in global memory, and so
are the tile's (scale, offset) rows, so a stage is filled by four plain ``cp.async.bulk`` copies
(no tensor map): K codes, V codes, K params, V params. Producer threads issue them (Hopper: lane 0
of each of the 4 producer warps, every 4th tile; Blackwell: one thread).

Barriers of stage ``s`` (``full[s]``, ``empty[s]``):

* ``full[s]``: arrival count 1. The producer arrives with ``expect_tx(stage bytes)``; the copies
  complete the transaction bytes. Consumers wait on its phase parity. (Hopper's cache decode, whose
  stages may instead hold a 16-bit window tile copied by 32 lanes' ``cp.async``, counts 32 arrivals:
  each lane's ``cp.async.mbarrier.arrive.noinc``, or a packed tile's producer arriving for all 32;
  ``foscar.hopper.fused``.)
* ``empty[s]``: arrival count = the threads that read stage ``s`` (Hopper: the one warp that owns
  the tile; Blackwell: the two warpgroups that read it). Each arrives after its last shared-memory
  read; the producer waits before overwriting the stage. A fresh barrier counts as completed for
  parity 1, so the producer's first pass over the ring waits on ``phase ^ 1`` and does not block.

Local tile ``i`` of a CTA uses stage ``i % stages`` in phase ``(i // stages) % 2``. A consumer must
never wait on a stage two phases ahead of its fill (the parity would read as complete): the Hopper
kernel makes every stage belong to one consumer warp, which waits on it right after its own
previous use.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32
from cutlass.cutlass_dsl import dsl_user_op

from .device import inline_ptx
from .layouts.fragment import TILE_TOKENS


@dsl_user_op
def bulk_copy_g2s(dst: cute.Pointer, src: cute.Pointer, nbytes: int, mbar: cute.Pointer, *, loc=None, ip=None):
    """``cp.async.bulk`` of ``nbytes`` (multiple of 16) from global ``src`` to shared ``dst``,
    completing its bytes on the mbarrier ``mbar``. Issue from one thread."""
    inline_ptx(None, [dst.toint(loc=loc, ip=ip), src.toint(loc=loc, ip=ip), Int32(nbytes), mbar.toint(loc=loc, ip=ip)],
               "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
               "r,l,r,r,~{memory}", True, loc, ip)


def stage_and_phase(i, stages: int):
    """(stage, phase parity) of local tile ``i`` in a ring of ``stages``."""
    return i % stages, (i // stages) % 2


def split_range(length, split, num_splits, align: int):
    """(n_tiles, t_begin, t_end) of split ``split``: the sequence's ``n_tiles`` 64-token tiles cut into
    ``num_splits`` ranges of whole runs of ``align`` tiles (a channel-wise K group, a Blackwell
    128-token step), so no run straddles two CTAs. The last splits may be empty (t_begin >= t_end).
    ``align`` is a power of two: rounding up is then one add and one AND."""
    import cutlass

    if align & (align - 1):
        raise ValueError(f"align must be a power of two, got {align}")
    n_tiles = (length + TILE_TOKENS - 1) // TILE_TOKENS
    per_split = ((n_tiles + num_splits - 1) // num_splits + align - 1) & -align
    t_begin = split * per_split
    return n_tiles, t_begin, cutlass.min(t_begin + per_split, n_tiles)
