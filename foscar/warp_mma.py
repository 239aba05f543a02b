"""Per-warp ``mma.sync.m16n8k16`` geometry shared by the kernels that run Tensor Core MMAs one warp at a
time (the Hopper decode kernel, the 16-bit sink + window kernel): the warp's fragment shapes and lane
coordinates.

Fragment modes (one warp, FP16 in, FP32 accumulate), lane = 4*g + tq:

* A ``((2,2,2),1,1)`` fp16: value ``e + 2*h_r + 4*h_c``, row ``g + 8*h_r``, column ``2*tq + e + 8*h_c``;
* B ``((2,2),1,1)`` fp16: value ``e + 2*hh``, k ``2*tq + e + 8*hh``, n ``g``;
* C ``((2,2),1,1)`` fp32: value ``i = e + 2*h_r``, row ``g + 8*h_r``, column ``2*tq + e``.

Accumulator value ``i`` of n8 block ``nb`` sits in query column ``8*nb + 2*tq + e``: its *column
slot* is ``cs = e + 2*nb`` (NS = 2*NB slots per thread).
"""

from __future__ import annotations

import cutlass.cute as cute

__all__ = ["WarpMma"]


class WarpMma:
    """One consumer warp's MMA geometry: the tiled MMA, fragment shapes, the lane and its (g, tq)."""

    def __init__(self, tiled_mma: cute.TiledMma, lane, n_blocks: int):
        self.tiled_mma = tiled_mma
        self.lane = lane
        self.g = lane // 4  # accumulator row (and B column) group
        self.tq = lane % 4  # position in the row group
        thr = tiled_mma.get_slice(lane)
        self.shape_A = thr.partition_shape_A((16, 16))
        self.shape_B = thr.partition_shape_B((8, 16))
        self.shape_C = thr.partition_shape_C((16, 8))
        self.NB = n_blocks  # n8 blocks of query columns
        self.NS = 2 * n_blocks  # column slots per thread

    def column(self, cs: int):
        """Query column of column slot ``cs``."""
        return 8 * (cs // 2) + 2 * self.tq + (cs % 2)

    def fragment_B(self):
        return self.tiled_mma.make_fragment_B(self.shape_B)

    def zero_accumulator(self):
        acc = self.tiled_mma.make_fragment_C(self.shape_C)
        acc.fill(0.0)
        return acc

    def gemm(self, acc, a, b):
        """acc += a x b (in place)."""
        cute.gemm(self.tiled_mma, acc, a, b, acc)

    def chain(self, init, pairs):
        """init + sum of A x B over the (A, B) fragment ``pairs``, in a new accumulator.

        ``init`` is copied first (free: HMMA reads C and writes D in different registers): the DSL's
        warp-MMA gemm writes its result into C's registers when D and C differ, which would clobber
        ``init``."""
        acc = self.tiled_mma.make_fragment_C(self.shape_C)
        acc.store(init.load())
        for a, b in pairs:
            cute.gemm(self.tiled_mma, acc, a, b, acc)
        return acc

    def to_columns(self, per_head, e: int):
        """Value of accumulator column 2*tq + e (of an n8 block) from a per-lane value that lane 4*g
        holds for B-fragment column (query head) g of the same block."""
        return cute.arch.shuffle_sync(per_head, offset=4 * (2 * self.tq + e))

    @staticmethod
    def reduce_over_tq(x):
        """Sum over the 4 lanes of a row group (lane bits 0..1: the k pairs of a B fragment)."""
        for offset in (1, 2):
            x = x + cute.arch.shuffle_sync_bfly(x, offset=offset)
        return x
