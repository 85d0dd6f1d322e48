"""Issue 55, measured: the calibration's own numbers, then each scoring change alone and together, on held-out
synthetic prompts (transformers path) and on the served traces of benchmarks/attribution_contextcite.py.

Variants (:data:`VARIANTS`), each the served scoring (``report.score_spans``) on a copy of the same trace:
  * ``before``: the RC top k, every answer token alike (the served default before issue 55);
  * ``calibrated_uniform`` / ``calibrated_peak``: the model's calibrated heads, tokens uniform / ``peak``;
  * ``rc_peak``: the RC top k, tokens ``peak``;
  * ``*_echo``: the same, with the answer's tokens that echo the request outside the sources (the question, the
    instruction: ``report.echo_mask``) left out of the weighting.

Sections (each optional; the output JSON keeps the sections it already has):
  * ``--calibration-samples``: the samples file ``rcstat-vllm calibrate-attribution --samples-out`` wrote: how
    many prompts were answered and kept, the chosen heads' hit rates, and a split-half check of the head choice
    (heads chosen on the even-numbered kept prompts, their hit rate on the odd ones, and the other way round);
  * ``--synthetic N``: N calibration-style licence prompts of ``--synthetic-seed`` (not the calibration's seed),
    answered greedily on the transformers path (float32), documents scored with every variant against the planted
    document (answered prompts only). This is the held-out check the defaults are chosen on;
  * ``--traces DIR --raw FILE``: the served traces (``attribution_contextcite.py --save-traces``), every variant
    per family and level on the answered prompts, ContextCite (64 ablations) where it attributed the same answer,
    and each variant's results() time (document call, which finalizes the trace, then the sentence call), one
    thread.

    python benchmarks/attribution_issue55.py --calibration FILE --calibration-samples SAMPLES.pt \\
        --synthetic 48 --traces /tmp/traces --raw /tmp/raw.json --json benchmarks/results/attribution_issue55_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import result_files  # noqa: E402

#: name -> (heads, token_weighting, echo tokens left out)
VARIANTS = {
    "before": ("rc", "uniform", False),
    "calibrated_uniform": ("auto", "uniform", False),
    "calibrated_peak": ("auto", "peak", False),
    "rc_peak": ("rc", "peak", False),
    "rc_echo": ("rc", "uniform", True),
    "rc_peak_echo": ("rc", "peak", True),
    "calibrated_echo": ("auto", "uniform", True),
    "calibrated_peak_echo": ("auto", "peak", True),
}
LEVELS = ("document", "sentence")


def score_variant(trace, calibration, variant: str, prompt_ranges, gen_ranges, prompt_ids, gen_ids) -> dict:
    """One variant's scores on a copy of ``trace`` for each level's ranges: {level: (scores, seconds)}."""
    from rcstat_vllm.attribution.report import echo_mask, score_spans

    heads, weighting, echo = VARIANTS[variant]
    trace = copy.deepcopy(trace)
    trace.options = dataclasses.replace(trace.options, heads=heads, token_weighting=weighting)
    trace.calibration = calibration if heads == "auto" else None
    out = {}
    for level in prompt_ranges:
        masks = [echo_mask(prompt_ids, prompt_ranges[level], gen_ids, r) for r in gen_ranges[level]] if echo else None
        t = time.perf_counter()
        scored = score_spans(trace, prompt_ranges[level], gen_ranges[level], prune=False, token_masks=masks)
        seconds = time.perf_counter() - t
        out[level] = {
            "scores": [round(float(v), 6) for v in scored["scores"][0]],
            "s": round(seconds, 4),
            "calibrated": scored["calibrated"],
            "heads": scored["heads"],
        }
    return out


def top1(scores: Sequence[float], target: int) -> float:
    from attribution_contextcite import topk_hit

    return topk_hit(scores, target, 1)


def summarize_rows(rows: list[dict], key) -> dict:
    from attribution_contextcite import summarize

    return summarize([{"scores": key(r), "target": r["target"]} for r in rows])


# --------------------------------------------------------------------------------------------------------
# the calibration's own numbers
# --------------------------------------------------------------------------------------------------------


def calibration_section(calibration_file: Path, samples_file: Path) -> dict:
    import torch

    from rcstat_vllm.attribution.calibration import fit_head_weights

    data = json.loads(calibration_file.read_text())
    saved = torch.load(samples_file, weights_only=False)
    records = saved["records"]
    kept = [r for r in records if r["kept"]]
    k = len(data["heads"])
    out = {
        "file": data,
        "answered": len(records),
        "answered_multi": sum(r["multi"] for r in records),
        "kept": len(kept),
        "kept_multi": sum(r["multi"] for r in kept),
        "answers": [
            {k2: r[k2] for k2 in ("index", "multi", "target", "source", "kept", "answer", "drops")} for r in records
        ],
    }
    for weighting in ("uniform", "peak"):
        samples = [(r[f"scores_{weighting}"], r["target"]) for r in kept]
        weights, hits = fit_head_weights(samples, k)
        halves = {}
        for name, fit_on, check_on in (("even_to_odd", 0, 1), ("odd_to_even", 1, 0)):
            fit = [s for i, s in enumerate(samples) if i % 2 == fit_on]
            check = [s for i, s in enumerate(samples) if i % 2 == check_on]
            if not fit or not check:
                continue
            chosen, _ = fit_head_weights(fit, k)
            _, check_hits = fit_head_weights(check, k)
            halves[name] = {
                "heads": [list(h) for h in chosen.heads],
                "hit_rate_fit": chosen.meta["hit_rates"],
                "hit_rate_check": [round(float(check_hits[h]), 4) for h in chosen.heads],
                "n_fit": len(fit),
                "n_check": len(check),
            }
        best = torch.argsort(hits.flatten(), descending=True)[:10].tolist()
        out[f"fit_{weighting}"] = {
            "heads": [list(h) for h in weights.heads],
            "hit_rates": weights.meta["hit_rates"],
            "best_10": [[i // hits.shape[1], i % hits.shape[1], round(float(hits.flatten()[i]), 4)] for i in best],
            "split_half": halves,
        }
    return out


# --------------------------------------------------------------------------------------------------------
# held-out synthetic prompts (transformers path)
# --------------------------------------------------------------------------------------------------------


def synthetic_section(calibration, count: int, seed: int, max_new_tokens: int = 24) -> dict:
    import torch

    from rcstat_vllm.attribution.calibration import make_prompts, user_message
    from rcstat_vllm.attribution.hf import chat_prompt, generate, load_model, trace_sequence
    from rcstat_vllm.attribution.options import AttributionOptions
    from rcstat_vllm.attribution.spans import chunk_spans, prompt_offsets, token_spans

    model, tokenizer = load_model(dtype=torch.float32)
    rows = []
    started = time.perf_counter()
    for index, example in enumerate(make_prompts(tokenizer, count, seed)):
        prompt = chat_prompt(tokenizer, user_message(example["docs"], example["question"]))
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = generate(model, tokenizer, prompt_ids, max_new_tokens)
        answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
        answered = example["answer"].lower() in answer.lower()
        row = {"index": index, "multi": example["multi"], "target": example["target"], "answer": answer}
        row["answered"] = answered
        if answered:
            text, offsets = prompt_offsets(tokenizer, prompt, prompt_ids)
            spans = token_spans(text, offsets, chunk_spans(text, example["docs"]))
            trace = trace_sequence(model, prompt_ids, answer_ids, AttributionOptions(), calibration=None)
            ranges = {"document": [[s.token_start, s.token_end] for s in spans]}
            gen = {"document": [[0, len(answer_ids)]]}
            row["variants"] = {
                name: score_variant(trace, calibration, name, ranges, gen, prompt_ids, answer_ids)["document"]
                for name in VARIANTS
            }
        rows.append(row)
        print(f"[synthetic {time.perf_counter() - started:5.0f}s] {index + 1}/{count} answered={answered}", flush=True)
    answered_rows = [r for r in rows if r["answered"]]
    summary = {}
    for subset, pick in (
        ("all", lambda r: True),
        ("one_fact", lambda r: not r["multi"]),
        ("four_facts", lambda r: r["multi"]),
    ):
        chosen = [r for r in answered_rows if pick(r)]
        summary[subset] = {
            name: summarize_rows(chosen, lambda r, n=name: r["variants"][n]["scores"]) for name in VARIANTS
        }
    return {
        "prompts": count,
        "seed": seed,
        "dtype": "float32",
        "answered": len(answered_rows),
        "answered_four_facts": sum(r["multi"] for r in answered_rows),
        "summary_document": summary,
        "rows": [
            {k: v for k, v in r.items() if k != "variants"}
            | {"scores": {n: r["variants"][n]["scores"] for n in r.get("variants", {})}}
            for r in rows
        ],
        "seconds": round(time.perf_counter() - started, 1),
    }


# --------------------------------------------------------------------------------------------------------
# the served traces
# --------------------------------------------------------------------------------------------------------


def served_section(
    calibration,
    traces: Path,
    raw_file: Path,
    earlier: dict | None = None,
    families: Sequence[str] | None = None,
    answered_only: bool = False,
) -> dict:
    """``earlier``: a previous run's section: its variant scores and timings are kept (same prompt, same answer),
    only ContextCite's attributions are read again from ``raw_file`` (e.g. after ``--more-contextcite``)."""
    import torch
    from transformers import AutoTokenizer

    raw = json.loads(raw_file.read_text())
    prompts = raw["data"]["prompts"]
    tokenizer = AutoTokenizer.from_pretrained(raw["data"]["model"])
    done = {(r["family"], r["index"], tuple(r["answer_ids"])): r for r in (earlier or {}).get("rows", [])}
    rows = []
    for n, item in enumerate(prompts):
        if "trace_file" not in item or (families is not None and item["family"] not in families):
            continue
        if answered_only and not item["answered"]:
            continue
        previous = done.get((item["family"], item["index"], tuple(item["answer_ids"])))
        if previous is not None:
            row = {k: v for k, v in previous.items() if k != "contextcite"}
            for lvl in LEVELS:
                cc = item["levels"][lvl].get("contextcite")
                if cc is not None:
                    row.setdefault("contextcite", {})[lvl] = cc["fits"][str(cc["ablations"])]["scores"]
            rows.append(row)
            continue
        saved = torch.load(traces / item["trace_file"], weights_only=False)
        trace = saved["trace"]
        prompt_ids = tokenizer(item["prompt"], add_special_tokens=False)["input_ids"]
        if len(prompt_ids) != trace.num_prompt_tokens:
            prompt_ids = tokenizer(item["prompt"])["input_ids"]
        assert len(prompt_ids) == trace.num_prompt_tokens, (item["family"], item["index"])
        gen_ids = saved["answer_ids"]
        prompt_ranges = {lvl: saved["ranges"][lvl]["prompt"] for lvl in LEVELS}
        gen_ranges = {lvl: saved["ranges"][lvl]["generated"] for lvl in LEVELS}
        row = {
            "family": item["family"],
            "index": item["index"],
            "answered": item["answered"],
            "answer_ids": item["answer_ids"],
            "targets": {lvl: item["levels"][lvl]["target"] for lvl in LEVELS},
            "variants": {},
        }
        for name in VARIANTS:
            row["variants"][name] = score_variant(
                trace, calibration, name, prompt_ranges, gen_ranges, prompt_ids, gen_ids
            )
        for lvl in LEVELS:  # the copy scored as before issue 55 is the benchmark's own plugin_before
            before = item["levels"][lvl]["plugin_before"]["scores"]
            got = row["variants"]["before"][lvl]["scores"]
            assert max(abs(a - b) for a, b in zip(before, got)) < 1e-4, (item["family"], item["index"], lvl)
            cc = item["levels"][lvl].get("contextcite")
            if cc is not None:
                row.setdefault("contextcite", {})[lvl] = cc["fits"][str(cc["ablations"])]["scores"]
        row["served"] = {lvl: item["levels"][lvl]["plugin"]["scores"] for lvl in LEVELS}
        rows.append(row)
        print(f"[served {n + 1}/{len(prompts)}] {item['family']} #{item['index']}", flush=True)
    families = list(dict.fromkeys(r["family"] for r in rows))
    summary: dict = {}
    for family in families:
        items = [r for r in rows if r["family"] == family]
        answered = [r for r in items if r["answered"]]
        total = sum(1 for p in prompts if p["family"] == family)
        fam: dict = {"prompts": total, "answered": sum(1 for p in prompts if p["family"] == family and p["answered"])}
        assert fam["answered"] == len(answered), family
        for lvl in LEVELS:
            entry: dict = {}
            flat = [{"target": r["targets"][lvl], **r} for r in answered]
            for name in VARIANTS:
                entry[name] = summarize_rows(flat, lambda r, n=name: r["variants"][n][lvl]["scores"])  # noqa: B023
            shared = [r for r in flat if lvl in r.get("contextcite", {})]
            entry["contextcite_subset"] = {"n": len(shared)}
            if shared:
                entry["contextcite_subset"]["contextcite"] = summarize_rows(shared, lambda r: r["contextcite"][lvl])  # noqa: B023
                for name in VARIANTS:
                    entry["contextcite_subset"][name] = summarize_rows(
                        shared,
                        lambda r, n=name: r["variants"][n][lvl]["scores"],  # noqa: B023
                    )
            # results() as served: the document call finalizes the trace, the sentence call follows it
            entry["results_s_mean"] = {
                name: round(statistics.mean(r["variants"][name][lvl]["s"] for r in items), 4) for name in VARIANTS
            }
            fam[lvl] = entry
        summary[family] = fam
    return {"summary": summary, "rows": rows}


def markdown_tables(result: dict, sections: Sequence[str] = ("served",)) -> str:
    """The docs' tables: top-1 of every variant per family and level (answered prompts), then the same on the
    prompts ContextCite attributed, beside it, and each variant's results() time."""
    names = list(VARIANTS)
    lines = []
    for key in sections:
        summary = result.get(key, {}).get("summary", {})
        if not summary:
            continue
        lines.append(f"`{key}`: top-1 on the answered prompts")
        lines.append("")
        lines.append("| family | level | answered | " + " | ".join(names) + " |")
        lines.append("|---|---|---|" + "---|" * len(names))
        for family, fam in summary.items():
            for lvl in LEVELS:
                cells = [f"{fam[lvl][n]['top1']:.2f}" for n in names]
                lines.append(
                    f"| {family} | {lvl} | {fam['answered']} of {fam['prompts']} | " + " | ".join(cells) + " |"
                )
        lines.append("")
        lines.append("top-1 where ContextCite (64 ablations) attributed the same answer")
        lines.append("")
        lines.append("| family | level | n | ContextCite | " + " | ".join(names) + " |")
        lines.append("|---|---|---|---|" + "---|" * len(names))
        for family, fam in summary.items():
            for lvl in LEVELS:
                sub = fam[lvl]["contextcite_subset"]
                if not sub["n"]:
                    continue
                cells = [f"{sub[n]['top1']:.2f}" for n in names]
                lines.append(
                    f"| {family} | {lvl} | {sub['n']} | {sub['contextcite']['top1']:.2f} | " + " | ".join(cells) + " |"
                )
        lines.append("")
        lines.append("results() seconds per answer (mean; document call with the trace's finalization, then sentences)")
        lines.append("")
        lines.append("| family | level | " + " | ".join(names) + " |")
        lines.append("|---|---|" + "---|" * len(names))
        for family, fam in summary.items():
            for lvl in LEVELS:
                cells = [f"{fam[lvl]['results_s_mean'][n]:.3f}" for n in names]
                lines.append(f"| {family} | {lvl} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibration", help="the calibration file (rcstat_attribution_heads.json)")
    parser.add_argument("--calibration-samples", help="the samples file of calibrate-attribution --samples-out")
    parser.add_argument("--synthetic", type=int, default=0, help="held-out licence prompts (0: skip)")
    parser.add_argument("--synthetic-seed", type=int, default=1)
    parser.add_argument("--traces")
    parser.add_argument("--raw")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--families", default="", help="served section: only these families (comma-separated)")
    parser.add_argument(
        "--answered-only", action="store_true", help="served section: score only the answered prompts (the metrics')"
    )
    parser.add_argument("--section", default="served", help="the served section's key in the output JSON")
    parser.add_argument("--json", default=str(HERE / "results" / "attribution_issue55_cpu.json"))
    parser.add_argument("--table", metavar="JSON", help="print the docs' tables of a result file and exit")
    args = parser.parse_args(argv)
    if args.table:
        data = result_files.read(args.table)
        print(markdown_tables(data, [k for k in data if k.startswith("served")]))
        return 0

    import torch
    from common import environment, load_avg

    from rcstat_vllm.attribution.head_weights import HeadWeights

    torch.set_num_threads(args.threads)
    path = Path(args.json)
    result = result_files.read(path) if result_files.find(path) else {"benchmark": "attribution_issue55"}
    if not args.calibration:
        parser.error("--calibration is needed (except with --table)")
    calibration = HeadWeights.from_dict(json.loads(Path(args.calibration).read_text()))
    result["variants"] = {
        name: dict(zip(("heads", "token_weighting", "echo_left_out"), v)) for name, v in VARIANTS.items()
    }
    env = environment(load_avg_start=load_avg(), torch_threads=args.threads)
    if args.calibration_samples:
        result["calibration"] = calibration_section(Path(args.calibration), Path(args.calibration_samples))
        result["calibration"]["environment"] = env
    if args.synthetic:
        result["synthetic_heldout"] = synthetic_section(calibration, args.synthetic, args.synthetic_seed)
        result["synthetic_heldout"]["environment"] = env
    if args.traces:
        families = args.families.split(",") if args.families else None
        result[args.section] = served_section(
            calibration, Path(args.traces), Path(args.raw), result.get(args.section), families, args.answered_only
        )
        result[args.section]["environment"] = env
    print(f"wrote {result_files.write(result, path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
