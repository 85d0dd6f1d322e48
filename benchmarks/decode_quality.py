"""Decode-time compression quality (issue 26): does RC beat the simple baselines when it evicts *generated* KV,
and at which interval and budget? Measured in the transformers reference (decode_reference.py), not in vLLM.

For each span (prompt P, kept whole, and a "generated" span G), G is teacher-forced once with the full cache and
once per setting with eviction every ``interval`` generated tokens down to ``budget`` generated tokens per KV head
(a layer mean for RC, SnapKV, K-norm; exactly per head for TOVA and the recent window). Per setting:

* ``top1``: teacher-forced agreement of the next-token argmax with the full cache's, over all of G, and
  ``top1_after`` over the positions computed after the first eviction only (before it they agree trivially);
* ``ver``: value error (RCStat Eq. 8, as quality.py: ||v* - v^|| / ||v*|| of each query head's attention output
  before o_proj) at the last layer, mean over G's positions and heads; ``ver_all_layers`` over every layer;
  ``ver_after`` at the last layer after the first eviction;
* ``dnll``: mean negative log-likelihood of G's next tokens minus the full cache's (text spans: the real text);
* ``kept``: mean generated tokens per (layer, KV head) right after an eviction, and the per-head spread;
  ``visible``: generated tokens a query sees on average (budget + ~interval/2: what a longer interval costs).

Two sources of spans: ``text``: an essay's first 256 tokens as P, the next 2048 as G (natural text, not
degenerate: the primary measure); ``self``: the full cache's own greedy output (2048 tokens, EOS ignored) after a
256-token chat prompt (an essay excerpt and a request to continue it). A 135M model's long greedy output loops;
``distinct4`` (distinct 4-gram share of G) says how much. With ``greedy``, compressed greedy generations on the
self prompts are compared with the full cache's: common-prefix length and ROUGE-L.

    python benchmarks/decode_quality.py            # default (~30 min on 2 busy cores)
    python benchmarks/decode_quality.py --quick    # ~3 min
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

import data
import decode_reference as dr
import hf_reference as ref_lib
import result_files
from common import environment, load_avg, write_report

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PROMPT_TOKENS = 256

PRESETS = {
    "quick": dict(
        text_spans=1,
        self_spans=1,
        generated=512,
        budgets=(128, 256),
        interval=128,
        interval_study=(),
        interval_budget=256,
        greedy_tokens=0,
    ),
    "default": dict(
        text_spans=3,
        self_spans=1,
        generated=2048,
        budgets=(256, 512, 1024),
        interval=128,
        interval_study=(32, 512),
        interval_budget=512,
        greedy_tokens=1024,
    ),
}
#: Methods at every budget (interval ``interval``); name -> (scorer or "recent", selection). RC selects as the
#: plugin's decode-time compression does (rcstat_vllm/worker/decode_compression.py): each head's scores relative to its
#: own mean, then the layer's top entries.
METHODS = {
    "recent": ("recent", "head"),
    "rc": ("rc", "head_mean"),
    "snapkv": ("snapkv", "layer"),
    "tova": ("tova", "head"),
    "knorm": ("knorm", "layer"),
}


def label(name: str, budget: int, interval: int) -> str:
    return f"{name}_b{budget}_i{interval}"


def build_methods(budgets, interval: int, interval_study, interval_budget: int) -> list[dr.DecodeMethod]:
    """Every method at every budget; RC and the recent window at the other intervals; at ``interval_budget``, RC's
    threshold rule, RC with a uniform per-head budget (do uneven heads matter?) and RC's raw scores compared across
    the layer's heads (``rc_raw``, as its prompt budgets compare them)."""
    out = [
        dr.DecodeMethod(label(n, b, interval), m, b, interval, selection=s)
        for b in budgets
        for n, (m, s) in METHODS.items()
    ]
    for i in interval_study:
        out += [
            dr.DecodeMethod(label("rc", interval_budget, i), "rc", interval_budget, i, selection="head_mean"),
            dr.DecodeMethod(label("recent", interval_budget, i), "recent", interval_budget, i, selection="head"),
        ]
    out += [
        dr.DecodeMethod(
            label("rc_c1", interval_budget, interval), "rc", interval_budget, interval, selection="threshold", c=1.0
        ),
        dr.DecodeMethod(label("rc_head", interval_budget, interval), "rc", interval_budget, interval, selection="head"),
        dr.DecodeMethod(label("rc_raw", interval_budget, interval), "rc", interval_budget, interval, selection="layer"),
    ]
    return out


def greedy_methods(budget: int, interval: int) -> list[dr.DecodeMethod]:
    return [
        dr.DecodeMethod(label(n, budget, interval), m, budget, interval, selection=s)
        for n, (m, s) in METHODS.items()
        if n != "knorm"
    ]


# ----------------------------------------------------------------------------------------------- spans


def long_essays(tokenizer, min_tokens: int, seed: int) -> list[tuple[str, list[int]]]:
    """Essays with at least ``min_tokens`` tokens, in a seeded order: (name, ids)."""
    essays = [(name, data.encode(tokenizer, text)) for name, text in data.load_essays().items()]
    essays = [(n, ids) for n, ids in essays if len(ids) >= min_tokens]
    random.Random(f"{seed}-decode").shuffle(essays)
    return essays


def self_prompt(tokenizer, essay_ids: list[int], length: int = PROMPT_TOKENS) -> list[int]:
    """A chat prompt of exactly ``length`` tokens: an essay excerpt and a request to continue it at length."""
    marker = "\x00"
    text = data.chat_prompt(tokenizer, marker + "\n\nContinue this essay in the same style, at length.")
    head, tail = text.split(marker)
    head_ids, tail_ids = data.encode(tokenizer, head), data.encode(tokenizer, tail)
    return head_ids + essay_ids[: length - len(head_ids) - len(tail_ids)] + tail_ids


def distinct4(ids: list[int]) -> float:
    """Distinct 4-gram share: 1 = no 4-gram repeats, near 0 = one loop."""
    grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
    return len(set(grams)) / max(len(grams), 1)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ----------------------------------------------------------------------------------------------- one span


def evaluate_span(ref: dr.DecodeReference, prompt: list[int], tokens: list[int], methods, bar) -> dict:
    """Every setting against the full cache on one (P, G) span (metrics: module docstring)."""
    t0 = time.perf_counter()
    full = ref.replay(prompt, tokens, dr.FULL, all_layers=True)
    full_nll = -float(full.target_logprob[:-1].mean())
    bar.update(1)
    rows = {"full": {"nll": full_nll, "seconds": time.perf_counter() - t0}}
    for method in methods:
        bar.set_postfix_str(method.label)
        t0 = time.perf_counter()
        r = ref.replay(prompt, tokens, method, all_layers=True)
        err = ref_lib.value_error(full.attn, r.attn)  # [L, T, Hq]
        agree = (r.argmax == full.argmax).float()
        after = r.first_eviction if r.first_eviction is not None else len(tokens)
        last = r.evictions[-1][1] if r.evictions else None
        rows[method.label] = {
            "top1": float(agree.mean()),
            "top1_after": float(agree[after:].mean()) if after < len(tokens) else None,
            "ver": float(err[-1].mean()),
            "ver_all_layers": float(err.mean()),
            "ver_after": float(err[-1, after:].mean()) if after < len(tokens) else None,
            "nll": -float(r.target_logprob[:-1].mean()),
            "dnll": -float(r.target_logprob[:-1].mean()) - full_nll,
            "first_eviction": r.first_eviction,
            "evictions": len(r.evictions),
            "kept": r.kept_after_evictions(),
            "kept_head_min_max": [int(last.min()), int(last.max())] if last is not None else None,
            "peak_kept": r.peak_kept,
            "mean_visible": r.mean_visible,
            "seconds": time.perf_counter() - t0,
        }
        bar.update(1)
    return rows


def greedy_compare(ref, tokenizer, prompt: list[int], full_tokens: list[int], methods, bar) -> dict:
    """Compressed greedy generations against the full cache's: common-prefix length and ROUGE-L."""
    rows, full_text = {}, tokenizer.decode(full_tokens)
    for method in methods:
        bar.set_postfix_str(f"greedy {method.label}")
        t0 = time.perf_counter()
        out = ref.generate(prompt, len(full_tokens), method)
        rows[method.label] = {
            "common_prefix": common_prefix(out, full_tokens),
            "rouge_l": data.rouge_l(full_text, tokenizer.decode(out)),
            "distinct4": distinct4(out),
            "seconds": time.perf_counter() - t0,
        }
        bar.update(1)
    return rows


# ----------------------------------------------------------------------------------------------- summary


def summarize(spans: list[dict], methods) -> dict:
    """Per source, per setting: means over spans (None-valued metrics over the spans that have them)."""
    out = {}
    for source in sorted({s["source"] for s in spans}):
        rows = [s["settings"] for s in spans if s["source"] == source]
        src = {
            "spans": len(rows),
            "nll_full": statistics.fmean(r["full"]["nll"] for r in rows),
            "distinct4": statistics.fmean(s["distinct4"] for s in spans if s["source"] == source),
        }
        for m in methods:
            per = [r[m.label] for r in rows if m.label in r]
            if not per:
                continue
            entry = {"method": m.method, "selection": m.selection, "budget": m.budget, "interval": m.interval}
            for key in ("top1", "top1_after", "ver", "ver_all_layers", "ver_after", "dnll", "kept", "mean_visible"):
                values = [p[key] for p in per if p[key] is not None]
                entry[key] = statistics.fmean(values) if values else None
            entry["kept_head_min_max"] = (
                [
                    min(p["kept_head_min_max"][0] for p in per if p["kept_head_min_max"]),
                    max(p["kept_head_min_max"][1] for p in per if p["kept_head_min_max"]),
                ]
                if any(p["kept_head_min_max"] for p in per)
                else None
            )
            src[m.label] = entry
        out[source] = src
    greedy = [s["greedy"] for s in spans if s.get("greedy")]
    if greedy:
        out["greedy"] = {
            k: {
                "common_prefix": statistics.fmean(g[k]["common_prefix"] for g in greedy),
                "rouge_l": statistics.fmean(g[k]["rouge_l"] for g in greedy),
                "distinct4": statistics.fmean(g[k]["distinct4"] for g in greedy),
            }
            for k in greedy[0]
        }
    return out


def print_table(report: dict) -> None:
    for source, src in report["summary"].items():
        if source == "greedy":
            print(f"\ngreedy generations vs the full cache's ({report['greedy_tokens']} tokens, self prompts)")
            print(f"{'setting':22s} {'prefix':>7s} {'ROUGE-L':>8s} {'dist4':>6s}")
            for k, e in src.items():
                print(f"{k:22s} {e['common_prefix']:7.1f} {e['rouge_l']:8.3f} {e['distinct4']:6.3f}")
            continue
        print(
            f"\n{source}: {src['spans']} span(s), {report['generated']} generated tokens, full-cache NLL "
            f"{src['nll_full']:.3f}, distinct 4-grams {src['distinct4']:.3f}"
        )
        print(
            f"{'setting':22s} {'kept':>6s} {'visible':>7s} {'head min-max':>12s} {'top1':>6s} {'top1 aft':>8s} "
            f"{'VER':>6s} "
            f"{'VER aft':>7s} {'VER allL':>8s} {'dNLL':>7s}"
        )
        for k, e in src.items():
            if not isinstance(e, dict):
                continue
            f = lambda x, w, p: f"{x:{w}.{p}f}" if x is not None else " " * (w - 1) + "-"  # noqa: E731
            spread = "{}-{}".format(*e["kept_head_min_max"]) if e["kept_head_min_max"] else "-"
            print(
                f"{k:22s} {f(e['kept'], 6, 0)} {f(e['mean_visible'], 7, 0)} {spread:>12s} {f(e['top1'], 6, 3)} "
                f"{f(e['top1_after'], 8, 3)} "
                f"{f(e['ver'], 6, 3)} {f(e['ver_after'], 7, 3)} {f(e['ver_all_layers'], 8, 3)} {f(e['dnll'], 7, 3)}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a ~3-minute smoke run")
    parser.add_argument("--seed", type=int, default=data.DEFAULT_SEED)
    parser.add_argument("--model", default=None, help="HF model folder; default: the embedded SmolLM2-135M")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a shared 2-core machine)")
    parser.add_argument("--text-spans", type=int, default=None)
    parser.add_argument("--self-spans", type=int, default=None)
    parser.add_argument("--no-greedy", action="store_true", help="skip the compressed greedy generations")
    parser.add_argument(
        "--json",
        default=None,
        help="output (default benchmarks/results/decode_quality_cpu.json; decode_quality_cpu_quick.json with --quick)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    preset = "quick" if args.quick else "default"
    cfg = dict(PRESETS[preset])
    for key in ("text_spans", "self_spans"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if args.no_greedy:
        cfg["greedy_tokens"] = 0
    out_path = (
        Path(args.json)
        if args.json
        else RESULTS_DIR / ("decode_quality_cpu_quick.json" if args.quick else "decode_quality_cpu.json")
    )
    t_start, load_start = time.time(), load_avg()
    tokenizer = data.load_tokenizer(args.model)
    ref = dr.DecodeReference(args.model)
    methods = build_methods(cfg["budgets"], cfg["interval"], cfg["interval_study"], cfg["interval_budget"])
    greedy = greedy_methods(cfg["budgets"][0], cfg["interval"]) if cfg["greedy_tokens"] else []
    n = cfg["generated"]
    essays = long_essays(tokenizer, PROMPT_TOKENS + n, args.seed)
    plan = [
        ("text", name, ids[:PROMPT_TOKENS], ids[PROMPT_TOKENS : PROMPT_TOKENS + n])
        for name, ids in essays[: cfg["text_spans"]]
    ]
    plan += [
        ("self", name, self_prompt(tokenizer, ids), None)
        for name, ids in essays[cfg["text_spans"] : cfg["text_spans"] + cfg["self_spans"]]
    ]
    steps = len(plan) * (1 + len(methods)) + cfg["self_spans"] * (1 + len(greedy))
    print(
        f"{len(plan)} spans ({PROMPT_TOKENS} + {n} tokens), {len(methods)} settings, {len(greedy)} greedy",
        file=sys.stderr,
    )

    report = {
        "benchmark": "decode_quality",
        "preset": preset,
        "seed": args.seed,
        "model": str(args.model or "SmolLM2-135M-Instruct (embedded)"),
        "dtype": "float32",
        "prompt_tokens": PROMPT_TOKENS,
        "generated": n,
        "greedy_tokens": cfg["greedy_tokens"],
        "settings": [m.to_dict() for m in methods],
        "greedy_settings": [m.to_dict() for m in greedy],
        "environment": environment(torch_threads=torch.get_num_threads()),
    }
    spans = []
    bar = tqdm(total=steps, desc="decode quality", unit="run")
    for source, name, prompt, tokens in plan:
        t0 = time.perf_counter()
        span = {"source": source, "essay": name}
        if tokens is None:  # self: the full cache's own greedy output, EOS ignored
            bar.set_postfix_str(f"{name}: full-cache greedy")
            tokens = ref.generate(prompt, n, dr.FULL)
            bar.update(1)
            span["eos_in_output"] = any(t in ref.eos_ids for t in tokens)
            span["text"] = tokenizer.decode(tokens)
        span["distinct4"] = distinct4(tokens)
        span["settings"] = evaluate_span(ref, prompt, tokens, methods, bar)
        if source == "self" and greedy:
            span["greedy"] = greedy_compare(ref, tokenizer, prompt, tokens[: cfg["greedy_tokens"]], greedy, bar)
        span["seconds"] = time.perf_counter() - t0
        spans.append(span)
        # Written after every span: a partial run still leaves its numbers.
        report.update(
            wall_s=round(time.time() - t_start, 1),
            load_avg=[load_start, load_avg()],
            complete=len(spans) == len(plan),
            summary=summarize(spans, methods),
            spans=spans,
        )
        result_files.write(report, out_path)  # each span's results kept as it goes
    bar.close()
    write_report(report, out_path, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
