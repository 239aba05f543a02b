"""Compile-only inspection of CuTe DSL kernels: PTX, cubin, SASS, resources, instruction mix.

FOSCAR's claims are about instructions (ALU work per INT2 element in the main loop) and resources
(registers, no spills), and CI machines have no GPU. So everything here works from a compiled
function's artifacts alone: compile with :func:`compile_for` (or ``cute.compile(...,
options="--gpu-arch sm_90a --keep-ptx --keep-cubin")``), then call :func:`artifacts`.

* Resources come from the cubin's ELF ``.nv.info`` attributes (what the driver itself reads), not
  from ptxas' verbose log, which the DSL compiles in-process and does not hand back.
* SASS comes from ``nvdisasm`` (PyPI wheel ``nvidia-cuda-nvdisasm``, or a CUDA toolkit).
* The main-loop heuristic is documented on :func:`loop_region`; :func:`role_loops` lists the loop
  of every warp role.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import struct
import subprocess
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field

from . import compile_cache
from .compile_cache import dump_dir, read_artifact
from .targets import TARGETS

__all__ = [
    "ARCHS",
    "KernelResources",
    "Artifacts",
    "compile_for",
    "artifacts",
    "find_nvdisasm",
    "disassemble",
    "split_functions",
    "parse_instructions",
    "loop_regions",
    "loop_region",
    "Loop",
    "role_loops",
    "instruction_mix",
    "SHIFT_LOGIC_OPS",
    "is_shift_logic",
    "decode_loop_stats",
]

ARCHS = TARGETS  # the compile targets (foscar.targets; foscar.archs registers their kernels)
_COMPILE_LOCK = threading.Lock()  # cute.compile is not thread-safe, and we swap the DSL's arch


# --------------------------------------------------------------------------------------------
# Compiling for an arch
# --------------------------------------------------------------------------------------------


def compile_for(arch: str, fn, *args, options: str = "", **kwargs):
    """``cute.compile(fn, *args)`` for ``arch`` (e.g. "sm_90a", "sm_100a"), keeping PTX and cubin.

    ``CUTE_DSL_ARCH`` is read once per process, and trace-time code (library helpers, our
    ``__init__``s) may read the DSL's ``envar.arch`` instead of the ``--gpu-arch`` option. So the
    arch is set both ways for the duration of the compile and restored afterwards: one process
    can compile for sm_90a and sm_100a one after the other (tests/test_inspect.py checks this).
    """
    import cutlass.cute as cute
    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    with _COMPILE_LOCK, dump_dir() as dump:
        # The PTX/cubin files the DSL writes are read into the compiled object; the directory
        # they go to is removed here, so they do not pile up in the working or temp directory.
        opts = f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir={dump} {options}".strip()
        previous = getattr(envar, "_arch", None)
        envar.arch = arch
        try:
            return cute.compile(fn, *args, options=opts, **kwargs)
        finally:
            if previous is None:
                del envar.arch  # back to CUTE_DSL_ARCH or lazy detection
            else:
                envar.arch = previous


# --------------------------------------------------------------------------------------------
# Cubin: per-kernel resources from ELF .nv.info
# --------------------------------------------------------------------------------------------

# EIATTR codes of the CUDA ELF .nv.info section (stable across CUDA 11-13).
_EIATTR_FRAME_SIZE = 0x11  # per-thread stack frame: local memory, spills included
_EIATTR_MAX_STACK_SIZE = 0x23
_EIATTR_REGCOUNT = 0x2F
_EIFMT_SVAL = 0x04  # (format, attr, u16 size, payload); other formats carry a u16 inline value


@dataclass(frozen=True)
class KernelResources:
    """Per-kernel resources read from the cubin.

    ``static_shared_bytes``: the ``.nv.shared.<kernel>`` section. CuTe DSL kernels allocate their
    shared memory dynamically (``SmemAllocator``, sized at launch), which no cubin records; what
    shows here is static shared memory only (seen: 1 KiB whenever a kernel declares the DSL's
    1024-byte-aligned dynamic area, 0 otherwise). ``local_bytes``: the per-thread stack frame
    (register spills and local arrays); a kernel that does not spill has 0.
    """

    name: str
    registers: int
    static_shared_bytes: int
    local_bytes: int
    max_stack_bytes: int


def _elf_sections(blob: bytes):
    if blob[:4] != b"\x7fELF" or blob[4] != 2 or blob[5] != 1:
        raise ValueError("not a little-endian ELF64 cubin")
    shoff = struct.unpack_from("<Q", blob, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize) for i in range(shnum)]
    strtab_off = headers[shstrndx][4]

    def name_at(table_off, idx):
        end = blob.index(b"\0", table_off + idx)
        return blob[table_off + idx : end].decode()

    sections = {}
    for index, (name, typ, _flags, _addr, off, size, link, _info, _align, entsize) in enumerate(headers):
        sections[name_at(strtab_off, name)] = dict(
            index=index, type=typ, offset=off, size=size, link=link, entsize=entsize
        )
    return sections, headers, name_at


def _nv_info_entries(data: bytes):
    """Yield (attr, payload-or-inline-value) of one .nv.info section."""
    off = 0
    while off + 4 <= len(data):
        fmt, attr, half = data[off], data[off + 1], struct.unpack_from("<H", data, off + 2)[0]
        if fmt == _EIFMT_SVAL:
            yield attr, data[off + 4 : off + 4 + half]
            off += 4 + half
        else:
            yield attr, half
            off += 4


def kernel_resources(cubin: bytes) -> dict[str, KernelResources]:
    """Registers, static shared memory and local (spill) bytes of every kernel in ``cubin``."""
    sections, headers, name_at = _elf_sections(cubin)
    symtab = sections[".symtab"]
    sym_strtab_off = headers[symtab["link"]][4]
    symbols = []
    for i in range(symtab["size"] // 24):
        st_name, st_info, _other, _shndx, _value, _size = struct.unpack_from(
            "<IBBHQQ", cubin, symtab["offset"] + 24 * i
        )
        symbols.append((name_at(sym_strtab_off, st_name), st_info & 0xF))

    per_symbol: dict[int, dict[int, int]] = {}
    info = sections.get(".nv.info")
    if info is not None:
        data = cubin[info["offset"] : info["offset"] + info["size"]]
        for attr, payload in _nv_info_entries(data):
            if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE, _EIATTR_MAX_STACK_SIZE) and len(payload) == 8:
                sym, value = struct.unpack("<II", payload)
                per_symbol.setdefault(sym, {})[attr] = value

    out = {}
    for index, (name, kind) in enumerate(symbols):
        if kind != 2 or f".text.{name}" not in sections:  # STT_FUNC with its own code section
            continue
        attrs = per_symbol.get(index, {})
        shared = sections.get(f".nv.shared.{name}")
        out[name] = KernelResources(
            name=name,
            registers=attrs.get(_EIATTR_REGCOUNT, 0),
            static_shared_bytes=shared["size"] if shared else 0,
            local_bytes=attrs.get(_EIATTR_FRAME_SIZE, 0),
            max_stack_bytes=attrs.get(_EIATTR_MAX_STACK_SIZE, 0),
        )
    return out


# --------------------------------------------------------------------------------------------
# SASS
# --------------------------------------------------------------------------------------------


@functools.cache
def find_nvdisasm() -> str:
    """Path of an ``nvdisasm`` binary: the PyPI wheel first, then PATH, then a CUDA toolkit."""
    from importlib import metadata

    try:
        for entry in metadata.distribution("nvidia-cuda-nvdisasm").files or ():
            if entry.name == "nvdisasm":
                path = str(entry.locate())
                if os.path.isfile(path) and os.access(path, os.X_OK):
                    return path
    except metadata.PackageNotFoundError:
        pass
    candidates = [shutil.which("nvdisasm")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvdisasm"))
    candidates.append("/usr/local/cuda/bin/nvdisasm")
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise RuntimeError(
        "SASS needs nvdisasm, which was not found. Install the PyPI package "
        "'nvidia-cuda-nvdisasm' (pip install nvidia-cuda-nvdisasm, or nvidia-cutlass-dsl[sass]), "
        "or put a CUDA toolkit's nvdisasm (>= 12.9 for sm_100a) on PATH or under CUDA_HOME."
    )


def disassemble(cubin: bytes) -> str:
    """SASS of every code section of ``cubin`` (``nvdisasm -c``), kept in the disk cache
    (:mod:`foscar.compile_cache`): a large kernel takes nvdisasm 1-2 s."""
    tool = find_nvdisasm()
    cached = compile_cache.load_sass(cubin, tool)
    if cached is not None:
        return cached
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        result = subprocess.run([tool, "-c", f.name], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"nvdisasm failed ({result.returncode}): {result.stderr.strip()}")
    compile_cache.store_sass(cubin, tool, result.stdout)
    return result.stdout


_FUNC_RE = re.compile(r"^\.text\.(\S+):\s*$")
_INSTR_RE = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/\s+(.*?)\s*;?\s*$")
_LABEL_RE = re.compile(r"^\s*(\.L\w+):\s*$")
_PRED_RE = re.compile(r"^@!?U?P\w+\s+")
_TARGET_RE = re.compile(r"`\((\.L\w+)\)")
_BRANCHES = ("BRA", "JMP", "BRX", "JMX")


def split_functions(sass: str) -> dict[str, str]:
    """SASS text of each function, keyed by kernel name."""
    out, name, lines = {}, None, []
    for line in sass.splitlines():
        m = _FUNC_RE.match(line.strip())
        if m:
            if name is not None:
                out[name] = "\n".join(lines)
            name, lines = m.group(1), []
        elif name is not None:
            lines.append(line)
    if name is not None:
        out[name] = "\n".join(lines)
    return out


@dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str  # full, with modifiers: "HGMMA.64x64x16.F32.BF16"
    text: str
    predicated: bool
    target: str | None  # branch target label, if any

    @property
    def base(self) -> str:
        """Opcode without modifiers: "HGMMA"."""
        return self.opcode.split(".")[0]


def parse_instructions(function_sass: str) -> tuple[list[Instruction], dict[str, int]]:
    """Instructions of one function and the address of each label."""
    instructions, labels, pending = [], {}, []
    for line in function_sass.splitlines():
        m = _LABEL_RE.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR_RE.match(line)
        if not m:
            continue
        address, text = int(m.group(1), 16), m.group(2)
        for label in pending:
            labels[label] = address
        pending = []
        body = _PRED_RE.sub("", text)
        opcode = body.split()[0] if body.split() else ""
        target = _TARGET_RE.search(body)
        instructions.append(
            Instruction(address, opcode, text, body != text, target.group(1) if target else None)
        )
    return instructions, labels


def loop_regions(function_sass: str) -> list[tuple[int, int]]:
    """(start, end) addresses of every loop: a backward branch at ``end`` to ``start < end``.

    Not loops: self-branches (the ``BRA`` trap after the last ``EXIT``), and backward branches
    from out-of-line blocks that ptxas places after the function's ``EXIT`` (e.g. the divergent
    fallback of a warp shuffle reduction jumping back into the main path). The latter are
    recognised by spanning an unpredicated ``EXIT``, which no loop body contains.
    """
    instructions, labels = parse_instructions(function_sass)
    exits = [i.address for i in instructions if i.base == "EXIT" and not i.predicated]
    regions = set()
    for ins in instructions:
        if ins.base in _BRANCHES and ins.target in labels:
            start = labels[ins.target]
            if start < ins.address and not any(start <= e <= ins.address for e in exits):
                regions.add((start, ins.address))
    return sorted(regions)


def _mma_count(instructions) -> int:
    return sum("MMA" in i.base for i in instructions)


def loop_region(function_sass: str) -> tuple[int, int] | None:
    """The main loop: the backward-branch region holding the most MMAs; among equals (e.g. no
    MMA at all), the one holding the most instructions. None for straight-line code.

    Why MMAs first: the KV loop of a decode kernel is the loop that holds the MMAs. In the Hopper
    kernel it also holds operand construction and softmax and is the largest loop; in the
    warp-specialized Blackwell kernel the softmax warps' loop is larger than the MMA warp's, so
    "largest" alone would pick a loop without MMAs (:func:`role_loops` lists every role's loop).
    Nested loops (e.g. an unrolled k-block loop the compiler kept rolled) lie inside and are
    counted with it.
    """
    instructions, _ = parse_instructions(function_sass)
    best, best_rank = None, (0, 0)
    for start, end in loop_regions(function_sass):
        body = [ins for ins in instructions if start <= ins.address <= end]
        rank = (_mma_count(body), len(body))
        if rank > best_rank:
            best, best_rank = (start, end), rank
    return best


_LOAD_OPS = ("UBLKCP", "UTMALDG", "LDGSTS", "UTMAPF")


@dataclass(frozen=True)
class Loop:
    """One outermost loop of a kernel (see :func:`role_loops`)."""

    start: int
    end: int
    instructions: int
    mma: int
    local_accesses: int  # LDL/STL: spills and local arrays touched on every trip
    role: str  # a guess from the opcodes: "mma", "load", "softmax", "operands" or "other"
    top: tuple[tuple[str, int], ...]  # the most frequent opcodes


def role_loops(function_sass: str, min_instructions: int = 32) -> list[Loop]:
    """The outermost loops with at least ``min_instructions`` instructions, in address order.

    In a warp-specialized kernel each warp role runs its own loop (load, MMA, softmax,
    operand conversion); the role is guessed from what the loop holds: MMAs -> "mma", bulk or
    TMA copies -> "load", max reductions (FMNMX) -> "softmax", shared-memory stores with >= 15%
    shift/logic -> "operands", else "other" (``top`` shows what it does). Small loops (mbarrier
    waits, retry loops) are left out.
    """
    instructions, _ = parse_instructions(function_sass)
    regions = loop_regions(function_sass)
    out = []
    for start, end in regions:
        if any(s <= start and end <= e and (s, e) != (start, end) for s, e in regions):
            continue  # nested: counted with the loop around it
        body = [i for i in instructions if start <= i.address <= end and i.base != "NOP"]
        if len(body) < min_instructions:
            continue
        bases = Counter(i.base for i in body)
        mma = _mma_count(body)
        if mma:
            role = "mma"
        elif any(op in bases for op in _LOAD_OPS):
            role = "load"
        elif "FMNMX" in bases:  # the running max of online softmax
            role = "softmax"
        elif "STS" in bases and sum(n for op, n in bases.items() if is_shift_logic(op)) >= 0.15 * len(body):
            role = "operands"  # codes -> MMA operands in shared memory
        else:
            role = "other"
        out.append(Loop(start, end, len(body), mma, bases["LDL"] + bases["STL"], role, tuple(bases.most_common(3))))
    return out


def instruction_mix(function_sass: str, loop_only: bool = False, full_opcodes: bool = False) -> Counter:
    """Counts of SASS opcodes (base names unless ``full_opcodes``), optionally in the main loop.

    NOPs are padding and are left out.
    """
    instructions, _ = parse_instructions(function_sass)
    if loop_only:
        region = loop_region(function_sass)
        if region is None:
            return Counter()
        instructions = [i for i in instructions if region[0] <= i.address <= region[1]]
    return Counter(i.opcode if full_opcodes else i.base for i in instructions if i.base != "NOP")


# --------------------------------------------------------------------------------------------
# The artifacts of one compiled function
# --------------------------------------------------------------------------------------------


@dataclass
class Artifacts:
    """PTX, cubin, resources and (lazily, via nvdisasm) SASS of one compiled function."""

    arch: str
    ptx: str
    cubin: bytes
    kernels: dict[str, KernelResources] = field(default_factory=dict)

    @functools.cached_property
    def sass(self) -> str:
        return disassemble(self.cubin)

    @functools.cached_property
    def sass_by_kernel(self) -> dict[str, str]:
        return split_functions(self.sass)

    def kernel(self, name: str | None = None) -> str:
        """Name of the kernel ``name`` selects (a substring); the only kernel when None."""
        names = [k for k in self.kernels if name is None or name in k]
        if len(names) != 1:
            raise KeyError(f"kernel selector {name!r} matches {names} of {list(self.kernels)}")
        return names[0]

    def resources(self, name: str | None = None) -> KernelResources:
        return self.kernels[self.kernel(name)]

    def mix(self, name: str | None = None, loop_only: bool = False, full_opcodes: bool = False) -> Counter:
        """Instruction mix of one kernel (see :func:`instruction_mix`)."""
        return instruction_mix(self.sass_by_kernel[self.kernel(name)], loop_only, full_opcodes)

    def loop_mix(self, name: str | None = None, full_opcodes: bool = False) -> Counter:
        return self.mix(name, loop_only=True, full_opcodes=full_opcodes)

    def loops(self, name: str | None = None, min_instructions: int = 32) -> list[Loop]:
        """The outermost loop of each warp role of one kernel (see :func:`role_loops`)."""
        return role_loops(self.sass_by_kernel[self.kernel(name)], min_instructions)


def artifacts(compiled) -> Artifacts:
    """Artifacts of a function compiled with ``--keep-ptx --keep-cubin`` (see :func:`compile_for`)."""
    ptx = read_artifact(compiled.__ptx__, "r")
    cubin = read_artifact(compiled.__cubin__, "rb")
    if not ptx or not cubin:
        raise ValueError("compile with options='--keep-ptx --keep-cubin' (or use compile_for)")
    m = re.search(r"^\s*\.target\s+(\w+)", ptx, re.M)
    return Artifacts(arch=m.group(1) if m else "", ptx=ptx, cubin=bytes(cubin), kernels=kernel_resources(cubin))


# Operand construction and bit plumbing in SASS: what "ALU instructions per KV element" counts (opcode bases, and
# the IMAD.SHL that ptxas issues for a shift left; a warp shuffle, SHFL, is none of them).
SHIFT_LOGIC_OPS = ("LOP3", "SHF", "IMAD.SHL", "PRMT", "SHL", "SHR")


def is_shift_logic(opcode: str) -> bool:
    """Whether a SASS opcode (``LOP3.LUT``, or its base ``LOP3``) is one of :data:`SHIFT_LOGIC_OPS`."""
    return opcode.split(".")[0] in SHIFT_LOGIC_OPS or opcode.startswith("IMAD.SHL")


def decode_loop_stats(loop: Counter, head_dim: int, tile_tokens: int = 64, threads: int = 32) -> dict:
    """Per-KV-element figures of a decode kernel's main loop (``Artifacts.loop_mix(full_opcodes=True)``).

    One loop trip handles ``tile_tokens`` tokens of K and V in ``threads`` threads (the Hopper
    kernel: one warp), i.e.
    ``2*tile_tokens*head_dim/threads`` elements per thread; SASS counts are per thread.
    """
    per_thread = 2 * tile_tokens * head_dim // threads
    shift_logic = sum(n for op, n in loop.items() if is_shift_logic(op))
    return {
        "instructions": sum(loop.values()),
        "mma": sum(n for op, n in loop.items() if "MMA" in op),
        "shift_logic_per_element": shift_logic / per_thread,
        "instructions_per_element": sum(loop.values()) / per_thread,
    }
