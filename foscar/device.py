"""Device-side helpers shared by the kernels of both arches (constants and tiny CuTe DSL functions)."""

from __future__ import annotations

import math

import cutlass
from cutlass import Float32, Int32
from cutlass.cutlass_dsl import T, dsl_user_op

from .checks import LOG2E  # noqa: F401  (softmax runs in the log2 domain: exp(x) = exp2(x * LOG2E))
LN2 = math.log(2.0)  # and reports natural-log lse: ln(x) = log2(x) * LN2
NEG_INF = float("-inf")
SM_REGISTERS = 64 * 1024  # 32-bit registers per SM (sm_90, sm_100)
MAX_THREAD_REGS = 240  # the most registers per thread ptxas allots a launch of the decode kernels (a multiple of 8)


def launch_regs(threads: int, ctas_per_sm: int = 1) -> int:
    """Registers per thread a CTA of ``threads`` threads is launched with at ``ctas_per_sm`` CTAs per SM (``reqntid``
    and ``.minnctapersm``: ``DecodeKernelBase.launch``): ptxas's cap, which the cubin records (CPU tests compare). The
    CTA's setmaxnreg pool holds ``threads`` times this, not the SM's 64K."""
    return min(MAX_THREAD_REGS, SM_REGISTERS // (threads * ctas_per_sm) // 8 * 8)


def check_register_budget(kernel: str, targets, launch: int) -> None:
    """A ValueError unless warpgroups at ``targets`` registers per thread (one entry per warpgroup) fit the CTA's
    launch allotment of ``launch`` per thread: a ``setmaxnreg.inc`` past it waits forever."""
    if sum(targets) > launch * len(targets):
        raise ValueError(f"{kernel}: warpgroups of {list(targets)} registers per thread need {128 * sum(targets)}, "
                         f"the launch holds {128 * launch * len(targets)}")


def set_warpgroup_registers(target: int, launch: int) -> None:
    """setmaxnreg of the executing warpgroup from the launch's ``launch`` registers per thread to ``target``: ``.dec``
    below it, ``.inc`` at or above it (PTX leaves an ``.inc`` to fewer registers than the warp holds, or a ``.dec`` to
    more, undefined). An ``.inc`` waits until the CTA's pool has the registers (:func:`check_register_budget`)."""
    import cutlass.cute as cute

    if target < launch:
        cute.arch.setmaxregister_decrease(target)
    else:
        cute.arch.setmaxregister_increase(target)


def fsel(cond, a, b):
    """Float32 select ``cond ? a : b``, branch-free."""
    return Float32(cutlass.select_(cond, Float32(a), Float32(b)))


def output_offsets(split_output: bool, hq, split, num_splits, head_dim: int):
    """(first ``o`` element, ``lse`` element) of global query row ``hq`` (``b * Hq + head``, Int64):
    fp32 partials ``o [B, Hq, S, D]``, ``lse [B, Hq, S]`` of split ``split`` when ``split_output``,
    else the final ``o [B, Hq, D]``, ``lse [B, Hq]``."""
    if split_output:
        return (hq * num_splits + split) * head_dim, hq * num_splits + split
    return hq * head_dim, hq


def group_scale(ptr, fold):
    """The fp16 params of the group at ``ptr`` (a tensor of ``fold.param_fields``) and its scale in fp32."""
    import cutlass.cute as cute

    fields = cute.make_tensor(ptr, cute.make_layout((fold.param_fields,)))
    return fields, fields[0].to(Float32)


def group_offset(fields, scale, fold):
    """The group's offset as the kernel folds it, in fp32 (``fields, scale``: :func:`group_scale`'s): the stored one,
    or ``fold.offset_per_scale * scale`` of a scale-only format, plus ``fold.offset_shift * scale`` (the
    construction's offset: centred codes); trace-time constants, no branch."""
    shift = fold.offset_shift
    if fold.param_fields == 2:
        offset = fields[1].to(Float32)
        return offset + scale * Float32(shift) if shift else offset
    return scale * Float32(float(fold.offset_per_scale) + shift)


def group_params(ptr, fold):
    """(scale, offset) in fp32 of the group whose params start at fp16 ``ptr``."""
    fields, scale = group_scale(ptr, fold)
    return scale, group_offset(fields, scale, fold)


def group_word(words, first, group, fold):
    """Group ``group``'s params as one int32 word, of a params run starting at int32 word ``first`` of ``words``: the
    (scale, offset) pair, or a scale-only format's scale in the low half (the high half zero), so a copy of it keeps
    one layout for both."""
    import cutlass.cute as cute
    from cutlass import Uint16

    if fold.param_fields == 2:
        return cute.make_tensor(words + (first + group), cute.make_layout((1,)))[0]
    scales = cute.recast_ptr(words, dtype=Uint16)
    return cute.make_tensor(scales + (2 * first + group), cute.make_layout((1,)))[0].to(Int32)


def reduce_over_rows(x, combine):
    """Combine ``x`` over the 8 lanes of a warp that hold one accumulator column (lane bits 2..4):
    the rows of an mma accumulator fragment. ``combine``: e.g. ``cute.arch.fmax`` or ``+``."""
    import cutlass.cute as cute

    for offset in (4, 8, 16):
        x = combine(x, cute.arch.shuffle_sync_bfly(x, offset=offset))
    return x


# ---------------------------------------------------------------------------------------------
# f16x2 registers and warp-level fragment moves (PTX the DSL does not wrap)
# ---------------------------------------------------------------------------------------------
def inline_ptx(res_type, operands, asm: str, constraints: str, side_effects: bool, loc, ip):
    """One inline-PTX statement over DSL values (``res_type`` None: no result)."""
    from cutlass._mlir.dialects import llvm

    return llvm.inline_asm(
        res_type,
        [x.ir_value(loc=loc, ip=ip) for x in operands],
        asm,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def pack_f16x2(lo, hi, *, loc=None, ip=None):
    """Int32 f16x2 (round to nearest) of two fp32: ``lo`` in bits 0..15, ``hi`` in bits 16..31."""
    return Int32(inline_ptx(T.i32(), [Float32(hi), Float32(lo)], "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", False, loc, ip))


@dsl_user_op
def pack_bf16x2(lo, hi, *, loc=None, ip=None):
    """Int32 bf16x2 (round to nearest) of two fp32: ``lo`` in bits 0..15, ``hi`` in bits 16..31."""
    return Int32(inline_ptx(T.i32(), [Float32(hi), Float32(lo)], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", False, loc,
                            ip))


@dsl_user_op
def unpack_16x2(word, bf16: bool, *, loc=None, ip=None):
    """The two fp32 values (bits 0..15, bits 16..31) of a bf16x2 (``bf16``) or f16x2 word, exactly."""
    if bf16:
        lo = inline_ptx(T.f32(), [Int32(word)], "shl.b32 $0, $1, 16;", "=f,r", False, loc, ip)
        hi = inline_ptx(T.f32(), [Int32(word)], "and.b32 $0, $1, 0xffff0000;", "=f,r", False, loc, ip)
    else:
        lo = inline_ptx(T.f32(), [Int32(word)], "{.reg .b16 l, h; mov.b32 {l, h}, $1; cvt.f32.f16 $0, l;}", "=f,r",
                        False, loc, ip)
        hi = inline_ptx(T.f32(), [Int32(word)], "{.reg .b16 l, h; mov.b32 {l, h}, $1; cvt.f32.f16 $0, h;}", "=f,r",
                        False, loc, ip)
    return Float32(lo), Float32(hi)


@dsl_user_op
def movmatrix_trans(x, *, loc=None, ip=None):
    """Transpose an 8x8 b16 matrix held as one register per lane in the mma fragment layout (lane
    4*r + c holds row r, columns 2c, 2c+1): afterwards lane 4*r + c holds column r, rows 2c, 2c+1.
    Turns an m16n8 accumulator quarter (rows = tokens) into the k16n8 B operand quarter of the next MMA."""
    return Int32(inline_ptx(T.i32(), [Int32(x)], "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r", True, loc, ip))


@dsl_user_op
def cp_async_16(dst, src, src_bytes=None, *, loc=None, ip=None):
    """``cp.async.cg`` of 16 bytes from global ``src`` to shared ``dst`` (LSU path, L2 only, no register
    staging); with ``src_bytes`` (Int32, 0..16) only that many are read and the rest of the 16 are zeros."""
    operands = [dst.toint(loc=loc, ip=ip), src.toint(loc=loc, ip=ip)]
    if src_bytes is None:
        inline_ptx(None, operands, "cp.async.cg.shared.global [$0], [$1], 16;", "r,l,~{memory}", True, loc, ip)
    else:
        inline_ptx(None, operands + [Int32(src_bytes)], "cp.async.cg.shared.global [$0], [$1], 16, $2;",
                   "r,l,r,~{memory}", True, loc, ip)


def divmod_nonnegative(i, n: int):
    """``(i // n, i % n)`` of an ``i >= 0`` and a constant ``n > 0``; an Int32 is divided as an unsigned number,
    which needs none of a signed division's fix-ups (a shift and a mask for a power of two). Its callers' counts
    (ring items, tiles, pages) start at 0: a negative one would come out wrong (-1 -> 2^32 - 1), not refused."""
    if isinstance(i, int):
        return divmod(i, n)
    if not isinstance(i, Int32):
        raise TypeError(f"divmod_nonnegative takes an Int32 (an unsigned Int64 division is another instruction), got "
                        f"{type(i).__name__}")
    u = cutlass.Uint32(i)
    return Int32(u // n), Int32(u % n)


def at(ptr, idx):
    """``ptr[idx]`` (a CuTe pointer: global or shared memory)."""
    import cutlass.cute as cute

    return cute.make_tensor(ptr + idx, cute.make_layout((1,)))[0]


def store(ptr, idx, value):
    """``ptr[idx] = value``."""
    import cutlass.cute as cute

    cute.make_tensor(ptr + idx, cute.make_layout((1,)))[0] = value
