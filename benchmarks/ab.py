"""Before / after in one process: the decode kernels of several git revisions of ``foscar`` timed side by side.

    python -m benchmarks.ab --revs e3a1692,worktree --methods int2-kt128,int4-kt128 --shapes 8x32768,128x8192
    python -m benchmarks.ab --revs e3a1692,worktree --tokens 4     # speculative verification: 4 query tokens each

(On a machine that gets the checkout without its history, e.g. the device machine, give each revision as a directory
holding its ``foscar/``, made here with ``git archive <rev> foscar | tar -x -C <dir>``: ``--revs <dir>/foscar,...``.)

Each revision's ``foscar/`` (``git archive``; ``worktree``: the package this process imports) is loaded as its own
package (``foscar_<rev>``, so its kernels compile under their own names and its compile cache entries are its own);
every revision attends the same caches (built by the working tree's ``foscar.testing``), each is first checked
(into NaN-poisoned outputs) against the float64 reference (ragged lengths, 1 and 3 splits), and the timings
interleave the revisions round by round (CUDA-graph replays over L2-cold copies, ``benchmarks.decode.time_layers``),
so that the machine's drift over the run falls on all of them alike. It spreads the drift, it does not remove it: on
the H200 one kernel's code in two packages of one run measured 84.3 and 91.7 us (benchmarks/NOTES.md section 36), so
repeat a run before trusting a few percent.

A method is ``benchmarks.decode``'s (``int2-kt128``: a built-in format, K token- or channel-wise, V token-wise in
groups of 128); a shape is ``<batch>x<context>`` of ``--model``'s attention (``benchmarks.decode.MODELS``; Qwen3-8B: 8
KV heads, 4 query heads each, head_dim 128). Each revision splits the KV range as its own ``plan_splits`` says (the
table's splits: first revision's / others' where they differ).
"""

from __future__ import annotations

import argparse
import importlib
import math
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
WORKTREE = "worktree"


def package_name(rev: str) -> str:
    """The module name a revision's package is loaded under."""
    return "foscar" if rev == WORKTREE else "foscar_" + re.sub(r"\W", "_", rev.rstrip("/"))


def materialize(rev: str, into: Path) -> str:
    """``rev``'s ``foscar/`` (a git revision, or a directory holding a copy of the package: a machine without the
    repository's history) as package :func:`package_name` under ``into``; returns its name. The package imports
    itself by relative imports; the two module paths it names as strings (the arch registry's kernel modules, the
    format registry's "built-in" test) are renamed with it."""
    name = package_name(rev)
    if Path(rev, "__init__.py").is_file():
        shutil.copytree(rev, into / name, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "foscar"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
        (into / "foscar").rename(into / name)
    archs = into / name / "archs.py"
    archs.write_text(re.sub(r'"foscar\.(\w+)\.decode"', rf'"{name}.\1.decode"', archs.read_text()))
    formats = into / name / "formats.py"
    formats.write_text(formats.read_text().replace('module.startswith("foscar.")',
                                                   f'module.startswith(("foscar.", "{name}."))'))
    return name


def load(revs, into: Path) -> list:
    """The packages of ``revs``, importable and checked to dispatch to their own kernels."""
    sys.path.insert(0, str(into))
    packages = []
    for rev in revs:
        pkg = importlib.import_module("foscar" if rev == WORKTREE else materialize(rev, into))
        for arch in importlib.import_module(pkg.__name__ + ".archs").ARCHS.values():
            if not arch.kernel_module.startswith(pkg.__name__ + "."):
                raise RuntimeError(f"revision {rev}: its arch {arch.name} dispatches to {arch.kernel_module}")
        packages.append(pkg)
    return packages


def scheme_for(pkg, method: str, model: str = "qwen3-8b"):
    """``method``'s scheme (``<format>-k<t|c><group>``, a built-in format) for ``model``'s geometry, built by package
    ``pkg``."""
    from .decode import MODELS

    q_heads, kv_heads, head_dim = MODELS[model]
    match = re.fullmatch(r"(?P<fmt>int[248])-k(?P<axis>[tc])(?P<group>\d+)", method)
    if match is None:
        raise ValueError(f"method {method!r}: expected int<bits>-k<t|c><group>, e.g. int2-kt128")
    return pkg.Scheme.make(int(match["fmt"][3:]), {"t": "token", "c": "channel"}[match["axis"]], int(match["group"]),
                           "token", 128, head_dim, q_heads // kv_heads)


def decode_call(pkg, scheme, q, cache, splits, **kw):
    return pkg.decode.decode_paged(q, cache.k_codes, cache.k_params, cache.v_codes, cache.v_params, cache.page_table,
                                   cache.lengths, scheme, 128, num_splits=splits, **kw)


def planned_splits(pkg, batch: int, kv_heads: int, max_tokens: int) -> int:
    """The split count ``pkg``'s ``decode_paged`` plans for the shape on this GPU."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return pkg.decode.plan_splits(batch, kv_heads, max_tokens, sms)


def queries(q, tokens: int):
    """``tokens`` fresh query tokens per sequence (``q [batch, tokens, q_heads, head_dim]``: the sequences' last
    tokens, speculative verification) in place of ``random_problem``'s one (``tokens == 1``: ``q`` itself)."""
    return q if tokens == 1 else torch.randn(q.shape[0], tokens, *q.shape[1:], device=q.device).to(q.dtype)


def checked(pkg, method: str, tokens: int, model: str, splits=(1, 3)) -> bool:
    """``pkg``'s decode of ``method`` (``tokens`` query tokens per sequence) against float64 (ragged lengths; 1 and 3
    splits, and the counts a timed shape plans). 48 sequences of 3 KV heads: one split is more than a wave of CTAs on
    an H200, where short rows take the two-CTA kernel (``foscar.hopper.decode``) that the timed many-sequence shapes
    run."""
    from foscar.testing import check_causal_output, check_output, random_problem

    ref_scheme = scheme_for(importlib.import_module("foscar"), method, model)
    q, cache = random_problem(ref_scheme, [tokens, 700, 4097, 129, 64, 65] * 8, kv_heads=3, page_size=128)
    q = queries(q, tokens)
    check = check_output if tokens == 1 else check_causal_output
    ok = True
    for n in sorted(set(splits)):
        out, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:-1], float("nan"), device=q.device)
        decode_call(pkg, scheme_for(pkg, method, model), q, cache, n, return_lse=True, out=out, lse=lse)
        acc = check(out, lse, q, cache, ref_scheme.head_dim**-0.5)
        if not acc.ok:
            print(f"{pkg.__name__} {method} splits={n}: {acc}", flush=True)
        ok = ok and acc.ok
    return ok


def time_side_by_side(packages, method: str, batch: int, context: int, tokens: int, rounds: int, reps: int,
                      model: str) -> dict:
    """Median microseconds per call of each package's decode (``tokens`` query tokens per sequence, as many splits
    as its plan says) of one cache set, rounds interleaved."""
    from foscar.testing import random_problem

    from .decode import MODELS, clones, copies_for, time_layers

    kv_heads = MODELS[model][1]
    q, cache = random_problem(scheme_for(importlib.import_module("foscar"), method, model), [context] * batch,
                              kv_heads=kv_heads, page_size=128, shuffle=False)
    q = queries(q, tokens)
    sets = clones(cache, copies_for(cache.nbytes()))
    splits = {pkg.__name__: planned_splits(pkg, batch, kv_heads, cache.max_tokens) for pkg in packages}
    fns = {pkg.__name__: [(lambda c=c, pkg=pkg, s=scheme_for(pkg, method, model):
                           decode_call(pkg, s, q, c, splits[pkg.__name__])) for c in sets] for pkg in packages}
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, layer_fns in fns.items():
            times[name].append(time_layers(layer_fns, reps=reps))
    return {"splits": "/".join(map(str, dict.fromkeys(splits.values()))),
            **{name: statistics.median(t) for name, t in times.items()}}


def table(revs, packages, rows) -> str:
    names = [pkg.__name__ for pkg in packages]
    lines = ["| model | method | shape | tokens | splits | " + " | ".join(f"{rev} (us, / first)" for rev in revs)
             + " |", "|---|---|---|---|---|" + "---|" * len(revs)]
    for row in rows:
        first = row[names[0]]
        lines.append(f"| {row['model']} | {row['method']} | {row['shape']} | {row['tokens']} | {row['splits']} | "
                     + " | ".join(f"{row[n]:.1f} ({row[n] / first:.3f})" for n in names) + " |")
    geo = [math.exp(statistics.fmean(math.log(row[n] / row[names[0]]) for row in rows)) for n in names]
    lines.append("| geo-mean | | | | | " + " | ".join(f"{g:.3f}" for g in geo) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--revs", required=True, help=f"git revisions, comma-separated ({WORKTREE}: this checkout)")
    parser.add_argument("--model", default="qwen3-8b", help="attention geometry, of benchmarks.decode.MODELS")
    parser.add_argument("--methods", default="int2-kt128,int2-kc128,int4-kt128")
    parser.add_argument("--shapes", default="8x32768,128x8192,1x32768")
    parser.add_argument("--tokens", type=int, default=1,
                        help="query tokens per sequence (speculative verification: the sequences' last tokens); "
                             "columns are 4 x tokens (Qwen3-8B's gqa): 2 tokens keep INT2's pipelined loop, 4 "
                             "(16 columns) run the sequential one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default=None, help="write <out>/<tag>.json and .md (benchmarks.records)")
    parser.add_argument("--tag", default="ab")
    args = parser.parse_args(argv)
    revs = args.revs.split(",")
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    methods = args.methods.split(",")
    from .decode import MODELS

    if args.model not in MODELS:
        parser.error(f"--model must be one of {sorted(MODELS)}, got {args.model!r}")
    for method in methods:
        scheme_for(importlib.import_module("foscar"), method, args.model)  # a bad name fails before anything compiles
    if not torch.cuda.is_available():
        sys.exit("benchmarks.ab needs a CUDA GPU")
    with tempfile.TemporaryDirectory(prefix="foscar-ab-") as tmp:
        packages = load(revs, Path(tmp))
        rows = []
        for method in methods:
            kv_heads = MODELS[args.model][1]
            timed = [planned_splits(pkg, b, kv_heads, -(-c // 128) * 128) for pkg in packages for b, c in shapes]
            ok = {pkg.__name__: checked(pkg, method, args.tokens, args.model, (1, 3, *timed)) for pkg in packages}
            for batch, context in shapes:
                row = {"model": args.model, "method": method, "shape": f"{batch}x{context}", "tokens": args.tokens,
                       "checked": ok, **time_side_by_side(packages, method, batch, context, args.tokens, args.rounds,
                                                          args.reps, args.model)}
                rows.append(row)
                print(row, flush=True)
                torch.cuda.empty_cache()
    text = table(revs, packages, rows)
    print(text)
    if args.out:
        from . import records

        meta = records.run_meta("benchmarks.ab", argv, {"revs": revs})
        records.write(args.out, args.tag, "Decode kernels of several revisions, side by side", meta, rows, text)


if __name__ == "__main__":
    main()
