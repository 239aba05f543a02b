"""Named-barrier ids of FOSCAR's kernels, one ``IntEnum`` per kernel (as flash_attn/cute's
``named_barrier.py``): ids never repeat within a kernel, and id 0 is ``sync_threads``'s. A barrier is
``cutlass.pipeline.NamedBarrier(id, threads)``; its ``arrive_and_wait`` is the ``bar.sync`` the kernels
wrote by hand before (SASS byte-identical)."""

from __future__ import annotations

import enum

__all__ = ["HopperDecodeBarrier", "PrefillBarrier", "WindowBarrier", "BlackwellDecodeBarrier"]


class HopperDecodeBarrier(enum.IntEnum):
    """``foscar.hopper``: the decode and cache-decode kernels."""

    CONSUMERS = 1  # all consumer warps: merging the warps' outputs, and the in-launch split merge


class PrefillBarrier(enum.IntEnum):
    """``foscar.hopper.prefill``."""

    CONVERTER = 1  # the converter warpgroup: a tile's packed words staged, then read
    CONSUMERS = 2  # both consumer warpgroups: the query rows in shared memory


class WindowBarrier(enum.IntEnum):
    """``foscar.kernels.sink_window``."""

    MERGE = 1  # all threads: the split merge


class BlackwellDecodeBarrier(enum.IntEnum):
    """``foscar.blackwell``: the decode kernel's warpgroups."""

    SOFTMAX = 3  # softmax warpgroup internal
    PREP = 4  # preparation warpgroup internal
    FINAL = 5  # softmax + output warpgroups: final reductions done
    WINDOW = 6  # the cache decode: softmax -> output warpgroup, the window blocks' (O, m, l) written
    MERGE = 7  # the cache decode: output warpgroup, the in-launch split merge
