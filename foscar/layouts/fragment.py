"""Where every code of a KV tile lives in the packed bit stream.

A tile is ``TILE_TOKENS`` tokens x ``head_dim`` channels of one KV head. The kernels feed it to
the Tensor Cores as the *A* operand with tokens (K) or channels (V) on the MMA's M side
(``S^T = K Q^T``, ``O^T = V^T P^T``), taking A from registers (Hopper ``mma.sync.m16n8k16``). The
packed order is therefore the per-thread order of mma A fragments, so that one 16-byte
shared-memory load per thread gives whole fragments and one SHF + one LOP3 turn two codes into one
f16x2 register:

* 128 "virtual" threads ``T = 32*warp + 4*g + tq``; thread ``T`` of m64 row-tile ``mt`` owns
  rows ``mt*64 + 16*warp + g + 8*h_r`` and, in k16 block ``kb``, columns ``16*kb + 8*h_c + 2*tq + e``
  (``h_r, h_c, e`` in {0, 1}): the mma.m16n8k16 A layout of m16 block ``4*mt + warp`` (also the
  per-warp slice of an m64 wgmma A fragment). The Hopper kernel's warp that owns a tile reads the
  words of all four virtual warps: lane ``l`` reads those of threads ``32*u + l``.
* Its fragment registers are numbered ``n = (mt*KB + kb)*4 + (h_r + 2*h_c)``; register ``n`` holds
  the pair ``e = 0, 1`` of two neighbouring columns as an f16x2.
* A 32-bit word holds ``ppw = 16/bits`` registers' worth of codes (2, 4 or 8): register ``n`` has its ``e = 0``
  code at bit ``bits*(n % ppw)`` and its ``e = 1`` code ``16`` bits higher, so both land in the two
  FP16 halves with the same shift.
* Each thread's words come in vectors of ``cw = min(4, words per thread)`` words (16 bytes when
  possible); vector ``j`` of thread ``T`` is vector ``j*128 + T`` of the tile, so a warp's loads
  are contiguous.

Written as a bit stream: the code at linear position ``q`` sits in word ``q // cpw`` at bit
``(q % cpw) * bits`` (``cpw = 32/bits``). :func:`tile_position` gives ``q`` for (token, channel)
explicitly; :func:`tile_layout` gives the same map as a CuTe-style (shape, stride) layout, built
independently, which ``foscar.layouts.cute`` turns into a real CuTe layout.
"""

from __future__ import annotations

from dataclasses import dataclass

TILE_TOKENS = 64
THREADS = 128  # one warpgroup
ROLES = ("k", "v")


@dataclass(frozen=True)
class TileGeometry:
    """Sizes of one packed tile for ``role`` ('k': rows = tokens; 'v': rows = channels)."""

    role: str
    bits: int
    head_dim: int

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be 'k' or 'v', got {self.role!r}")
        if self.bits not in (2, 4, 8):
            raise ValueError(f"bits must be 2, 4 or 8, got {self.bits!r}")
        if self.head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim must be 64, 128 or 256, got {self.head_dim!r}")

    @property
    def rows(self):  # the MMA's M extent
        return TILE_TOKENS if self.role == "k" else self.head_dim

    @property
    def cols(self):  # the MMA's reduction extent
        return self.head_dim if self.role == "k" else TILE_TOKENS

    @property
    def m_tiles(self):
        return self.rows // 64

    @property
    def k_blocks(self):
        return self.cols // 16

    @property
    def codes_per_word(self):
        return 32 // self.bits

    @property
    def regs_per_word(self):
        return 16 // self.bits

    @property
    def words(self):
        return TILE_TOKENS * self.head_dim * self.bits // 32

    @property
    def words_per_thread(self):
        return self.words // THREADS

    @property
    def vector_words(self):
        return min(4, self.words_per_thread)

    @property
    def regs_per_thread(self):
        return self.m_tiles * self.k_blocks * 4


def tile_position(geom: TileGeometry, token: int, channel: int) -> int:
    """Linear code position ``q`` of (token, channel) in the packed tile; the explicit formulas."""
    row, col = (token, channel) if geom.role == "k" else (channel, token)
    mt, r = divmod(row, 64)
    warp, r = divmod(r, 16)
    h_r, g = divmod(r, 8)
    kb, c = divmod(col, 16)
    h_c, c = divmod(c, 8)
    tq, e = divmod(c, 2)
    thread = 32 * warp + 4 * g + tq
    n = (mt * geom.k_blocks + kb) * 4 + h_r + 2 * h_c
    k = n % geom.regs_per_word
    wi = (n // geom.regs_per_word) % geom.vector_words
    j = n // (geom.regs_per_word * geom.vector_words)
    word = (j * THREADS + thread) * geom.vector_words + wi
    return word * geom.codes_per_word + e * geom.regs_per_word + k


def _split_digits(sizes, radices):
    """Split a mixed-radix index into output digits.

    ``sizes`` are the extents of the input modes (fastest first, all powers of two) forming one
    linear index ``n``; ``radices`` are (extent, stride) of the output digits of ``n`` (fastest
    first, the last with extent None = unbounded). Returns, per input mode, its (shape, stride)
    as a flat tuple pair: the sub-modes it is cut into by the output digit boundaries.
    """
    out, digit, used = [], 0, 1  # used: how much of the current output digit is consumed
    for size in sizes:
        shapes, strides = [], []
        remaining = size
        while remaining > 1:
            extent, stride = radices[digit]
            room = None if extent is None else extent // used
            take = remaining if room is None else min(remaining, room)
            shapes.append(take)
            strides.append(stride * used)
            remaining //= take
            used *= take
            if room is not None and used == extent:
                digit, used = digit + 1, 1
        if not shapes:
            shapes, strides = [1], [0]
        out.append((tuple(shapes), tuple(strides)))
    return out


def tile_layout(geom: TileGeometry):
    """(shape, stride) of the map (token, channel) -> q, as a CuTe layout would write it.

    Modes: token first, channel second; each hierarchical (nested tuples, fastest first).
    """
    cpw, ppw, cw = geom.codes_per_word, geom.regs_per_word, geom.vector_words
    thread_stride = cw * cpw
    # register index n = h_r + 2*h_c + 4*(mt*KB + kb): the digits of n are
    # k (ppw, stride 1), wi (cw, stride cpw), j (unbounded, stride THREADS*cw*cpw)
    radices = [(ppw, 1), (cw, cpw), (None, THREADS * cw * cpw)]
    h_r, h_c, kb_modes, mt_modes = _split_digits([2, 2, geom.k_blocks, geom.m_tiles], radices)
    # h_r and h_c are one digit each (one bit of n): plain modes
    (h_r_stride,), (h_c_stride,) = h_r[1], h_c[1]
    rows_shape = (8, 2, 4, mt_modes[0])
    rows_stride = (4 * thread_stride, h_r_stride, 32 * thread_stride, mt_modes[1])
    cols_shape = (2, 4, 2, kb_modes[0])
    cols_stride = (ppw, thread_stride, h_c_stride, kb_modes[1])
    if geom.role == "k":
        return (rows_shape, cols_shape), (rows_stride, cols_stride)
    return (cols_shape, rows_shape), (cols_stride, rows_stride)


def evaluate_layout(shape, stride, coord):
    """Pure-Python CuTe ``crd2idx`` for a 1-D integer coordinate per top-level mode."""

    def flat(s, d):
        if isinstance(s, tuple):
            out = []
            for si, di in zip(s, d):
                out.extend(flat(si, di))
            return out
        return [(s, d)]

    index = 0
    for c, s, d in zip(coord, shape, stride):
        for size, st in flat(s, d):
            c, digit = divmod(c, size)
            index += digit * st
        if c:
            raise IndexError(f"coordinate {coord} out of the layout's shape {shape}")
    return index
