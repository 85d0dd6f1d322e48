"""Value error rate (VER) of every compression method against the compression ratio it actually achieves.

VER as the RCStat paper defines it (Section 4.1, Eq. 7-8; Section 5.2 "Metrics"): for each prompt, the
full-cache greedy continuation g (up to ``--max-new-tokens`` tokens, stopping after EOS) is teacher-forced
once over the full prompt KV and once over the prompt KV that each (layer, KV head) keeps under a method;
at the LAST layer, for every query head h and generated token j, ``||v*_jh - v^_jh|| / ||v*_jh||`` where v is
the head's attention output (softmax-weighted value sum, before o_proj). VER = mean over heads and tokens
per prompt, then mean over prompts. Eviction touches prompt keys only (generated tokens always see each
other) and every layer is compressed, so v^ at the last layer carries the errors of the layers below it, as
in a real compressed decode. Also reported: the same error averaged over all layers (``ver_all_layers``) and
the teacher-forced next-token agreement with the full cache (``top1_agree``).

Keep sets come from the plugin's own scorers and selection (rcstat_vllm.scoring) on the plugin's inputs (see
hf_reference.py), per prompt: RC threshold mode at each c, RC budget mode and the baselines (SnapKV, TOVA,
K-norm, StreamingLLM, random) at each ratio, and SnapKV/TOVA/RC-budget at exactly the ratio RC's threshold
mode achieved on that prompt ("matched", labels like ``snapkv@rc_c1``). The ratio is the plugin's: evicted /
total prompt KV entries over all layers and KV heads.

    python benchmarks/quality.py                       # default, writes benchmarks/results/quality_cpu.json
    python benchmarks/quality.py --quick --json /tmp/q.json
    python benchmarks/quality.py --budget-scope-study  # per-layer vs model-wide budgets (how layers compare)
    python benchmarks/quality.py --page-alignment-study  # each keep set alone and on the engine's page boundaries
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

import data
import hf_reference as ref_lib
import methods
from common import environment, load_avg, resolved_config, write_report

from rcstat_vllm.config import RCStatConfig
from rcstat_vllm.settings import scorer_options, window_queries

RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: Which prompts, per preset (overrides of data.PRESETS), sized for the time budget on 2 CPU cores.
QUALITY_PRESETS = {
    "quick": dict(
        base="quick",
        niah_lengths=[1024],
        niah_depths=[0.5],
        niah_multi_lengths=[],
        vt_lengths=[1024],
        vt_per_length=1,
        summ=1,
        summ_tokens=1024,
    ),
    "default": dict(
        base="default",
        niah_lengths=[1024, 2048, 4096],
        niah_depths=[0.1, 0.5, 0.9],
        niah_multi_lengths=[2048],
        niah_multi_depths=[0.5],
        vt_lengths=[1024, 2048],
        vt_per_length=1,
        summ=4,
        summ_tokens=2048,
    ),
}
SETTINGS_PRESETS = methods.QUALITY_SETTINGS


def given_keep_set(mask: torch.Tensor, num_tokens: int, label: str) -> tuple[list, list, float]:
    """(per-layer masks, kept per (layer, head), evicted share) of ``[L, Hkv, n]`` keep masks made elsewhere."""
    if mask.shape[2] != num_tokens:
        raise SystemExit(f"{label}: keep masks for {mask.shape[2]} tokens, the prompt has {num_tokens}")
    return list(mask), mask.sum(dim=2).tolist(), 1.0 - float(mask.float().mean())


def given_settings(masks_file: dict) -> list[methods.Setting]:
    """One setting per selection and ratio of a keep-masks file: ``kvpress_reference.py --keep-masks``' (labels
    ``kvpress_<press>_r<ratio>``, family ``kvpress_<press>``) or ``route_probes.py --keep-masks``' (its ``source``,
    ``route_probes``, in their place)."""
    source = masks_file.get("source", "kvpress")
    settings = []
    for label in masks_file["masks"]:
        press, ratio = label.rsplit("_r", 1)
        settings.append(methods.Setting(f"{source}_{label}", f"{source}_{press}", {"target_ratio": float(ratio)}))
    return settings


def evaluate_sample(
    ref: ref_lib.ReferenceModel,
    ids: list[int],
    settings: list[methods.Setting],
    max_new_tokens: int = 24,
    given_masks: dict[str, torch.Tensor] | None = None,
) -> dict:
    """VER and achieved ratio of every setting on one prompt (see the module docstring). ``given_masks``: label ->
    ``[L, Hkv, n]`` keep masks chosen elsewhere (kvpress's presses), for the settings of those labels."""
    given_masks = given_masks or {}
    prefill = ref.prefill(ids)
    generated = ref.greedy(prefill, max_new_tokens)
    logits_full, attn_full = ref.decode(prefill, generated, None, all_layers=True)
    next_full = logits_full.argmax(-1)
    scores_cache: dict[tuple[str, int], list[torch.Tensor]] = {}
    results: dict[str, dict] = {}
    rc_ratios: dict[str, float] = {}
    # Settings that others are matched to go first.
    ordered = [s for s in settings if s.matched_to is None] + [s for s in settings if s.matched_to is not None]
    for setting in ordered:
        t0 = time.perf_counter()
        if setting.label in given_masks:
            masks, kept, ratio = given_keep_set(given_masks[setting.label], len(ids), setting.label)
            target = setting.rcstat["target_ratio"]
        else:
            config = RCStatConfig.from_dict(methods.resolve(setting, rc_ratios))
            target = config.target_ratio if config.enabled else None
            if not config.enabled:
                masks, kept, ratio = None, None, 0.0
            else:
                # Settings whose scorers are built alike share their scores (selection differs, scoring does not).
                key = (config.method, window_queries(config), tuple(sorted(scorer_options(config).items())))
                if key not in scores_cache:
                    scores_cache[key] = ref_lib.score_layers(prefill, config)
                keep = ref_lib.select_layers(scores_cache[key], config, setting.comparable, page_size=setting.page_size)
                masks, kept, ratio = keep.masks, keep.kept, keep.ratio
        logits, attn = ref.decode(prefill, generated, masks, all_layers=True)
        err = ref_lib.value_error(attn_full, attn)  # [L, T, Hq]
        results[setting.label] = {
            "family": setting.family,
            "ratio": ratio,
            "target_ratio": target,
            "ver": float(err[-1].mean()),
            "ver_all_layers": float(err.mean()),
            "top1_agree": float((logits.argmax(-1) == next_full).float().mean()),
            "kept_per_head_min_max": [min(map(min, kept)), max(map(max, kept))] if kept else None,
            "seconds": time.perf_counter() - t0,
        }
        if setting.family == "rc" and setting.matched_to is None:
            rc_ratios[setting.label] = ratio
    return {"num_tokens": len(ids), "generated": generated, "settings": results}


def summarize(samples: list[dict], settings: list[methods.Setting]) -> dict:
    summary = {}
    for setting in settings:
        rows = [s["settings"][setting.label] for s in samples if setting.label in s["settings"]]
        if not rows:
            continue
        vers = [r["ver"] for r in rows]
        entry = {
            "family": setting.family,
            "rcstat": setting.rcstat,
            "matched_to": setting.matched_to,
            "n": len(rows),
            "ratio": statistics.fmean(r["ratio"] for r in rows),
            "ratio_min": min(r["ratio"] for r in rows),
            "ratio_max": max(r["ratio"] for r in rows),
            "ver": statistics.fmean(vers),
            "ver_std": statistics.stdev(vers) if len(vers) > 1 else 0.0,
            "ver_all_layers": statistics.fmean(r["ver_all_layers"] for r in rows),
            "top1_agree": statistics.fmean(r["top1_agree"] for r in rows),
            "by_task": {},
        }
        for task in sorted({s["task"] for s in samples}):
            task_rows = [s["settings"][setting.label] for s in samples if s["task"] == task]
            entry["by_task"][task] = {
                "n": len(task_rows),
                "ratio": statistics.fmean(r["ratio"] for r in task_rows),
                "ver": statistics.fmean(r["ver"] for r in task_rows),
            }
        if setting.page_size:
            entry["vs_rule_alone"] = paired_difference(samples, setting.label.rsplit("_page", 1)[0], setting.label)
        summary[setting.label] = entry
    return summary


def paired_difference(samples: list[dict], before: str, after: str) -> dict:
    """``after`` minus ``before`` prompt by prompt (the same prompts, scores and generated tokens): mean differences
    of VER, top-1 agreement and the achieved ratio, and on how many prompts VER rose or fell."""
    pairs = [(s["settings"][before], s["settings"][after]) for s in samples if after in s["settings"]]
    ver = [b["ver"] - a["ver"] for a, b in pairs]
    return {
        "of": before,
        "n": len(pairs),
        "ver_diff": statistics.fmean(ver),
        "ver_all_layers_diff": statistics.fmean(b["ver_all_layers"] - a["ver_all_layers"] for a, b in pairs),
        "top1_agree_diff": statistics.fmean(b["top1_agree"] - a["top1_agree"] for a, b in pairs),
        "ratio_diff": statistics.fmean(b["ratio"] - a["ratio"] for a, b in pairs),
        "prompts_ver_higher": sum(d > 0 for d in ver),
        "prompts_ver_lower": sum(d < 0 for d in ver),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a ~3-minute smoke run")
    parser.add_argument("--seed", type=int, default=data.DEFAULT_SEED)
    parser.add_argument("--model", default=None, help="HF model folder; default: the embedded SmolLM2-135M")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-new-tokens", type=int, default=24, help="g: full-cache continuation length")
    parser.add_argument("--c", type=float, nargs="*", default=None, help="RC threshold multipliers")
    parser.add_argument("--ratios", type=float, nargs="*", default=None, help="budget-mode target ratios")
    parser.add_argument("--baselines", nargs="*", default=list(methods.BASELINES))
    parser.add_argument("--max-samples", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--budget-scope-study",
        action="store_true",
        help="RC budget per layer vs model-wide, with each way of comparing layers' scores "
        "(default output benchmarks/results/quality_budget_scope_cpu.json)",
    )
    parser.add_argument(
        "--page-alignment-study",
        action="store_true",
        help="the bare flag, RC at --ratios (default 0.8 0.9), TOVA and SnapKV, each with the selection rule alone "
        "and page-aligned as the engine aligns it (--page-size); default output "
        "benchmarks/results/quality_page_alignment_cpu.json",
    )
    parser.add_argument(
        "--page-size",
        type=int,
        default=32,
        help="--page-alignment-study: tokens per head page (the engine's block size)",
    )
    methods.add_cliff_arguments(parser, "quality_cliff_cpu.json")
    parser.add_argument(
        "--write-prompts",
        metavar="PATH",
        default=None,
        help="write this run's prompts (with token ids) as JSON to PATH and stop: the input of "
        "kvpress_reference.py --keep-masks",
    )
    parser.add_argument(
        "--kvpress-masks",
        "--given-masks",
        metavar="PATH",
        default=None,
        help="also measure keep sets chosen elsewhere on these prompts: kvpress's masking presses' "
        "(kvpress_reference.py --keep-masks on --write-prompts' file) or route_probes.py --keep-masks'",
    )
    parser.add_argument(
        "--json",
        default=None,
        help="output (default benchmarks/results/quality_cpu.json; quality_cpu_quick.json with --quick)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    preset = "quick" if args.quick else "default"
    sp = dict(SETTINGS_PRESETS[preset])
    if args.c is not None:
        sp["c_values"] = tuple(args.c)
        sp["matched_c"] = tuple(args.c)
    if args.ratios is not None:
        sp["ratios"] = tuple(args.ratios)
    if args.cliff_ablation:
        settings = methods.cliff_settings_from_args(args)
        default_name = "quality_cliff_cpu.json"
    elif args.budget_scope_study:
        settings = methods.budget_scope_settings(ratios=tuple(args.ratios or (0.5, 0.8)))
        default_name = "quality_budget_scope_cpu.json"
    elif args.page_alignment_study:
        settings = methods.page_alignment_settings(ratios=tuple(args.ratios or (0.8, 0.9)), page_size=args.page_size)
        default_name = "quality_page_alignment_cpu.json"
    else:
        settings = methods.build_settings(baselines=tuple(args.baselines), **sp)
        default_name = "quality_cpu_quick.json" if args.quick else "quality_cpu.json"
    out_path = Path(args.json) if args.json else RESULTS_DIR / default_name

    t_start = time.time()
    load_start = load_avg()
    tokenizer = data.load_tokenizer(args.model)
    qp = dict(QUALITY_PRESETS[preset])
    base = qp.pop("base")
    samples = data.build_suite(tokenizer, base, args.seed, **qp)
    if args.max_samples:
        samples = samples[: args.max_samples]
    if args.write_prompts:
        Path(args.write_prompts).write_text(
            json.dumps(
                {
                    "benchmark": "quality",
                    "preset": preset,
                    "seed": args.seed,
                    "model": str(args.model or ""),
                    "samples": [s.to_dict(with_ids=True) for s in samples],
                }
            )
        )
        print(f"{len(samples)} prompts written to {args.write_prompts}", file=sys.stderr)
        return 0
    kvpress_masks = {"masks": {}}
    given_labels: set[str] = set()
    if args.kvpress_masks:
        kvpress_masks = torch.load(args.kvpress_masks, weights_only=True)
        given = given_settings(kvpress_masks)
        settings += given
        given_labels = {s.label for s in given}
    source = kvpress_masks.get("source", "kvpress")
    ref = ref_lib.ReferenceModel(args.model, dtype=getattr(torch, args.dtype))
    print(
        f"{len(samples)} prompts ({sum(s.num_tokens for s in samples)} tokens), {len(settings)} settings",
        file=sys.stderr,
    )

    results = []
    bar = tqdm(samples, desc="VER", unit="prompt")
    for sample in bar:
        bar.set_postfix_str(f"{sample.sample_id} ({sample.num_tokens} tok)")
        t0 = time.perf_counter()
        given_masks = {f"{source}_{label}": masks[sample.sample_id] for label, masks in kvpress_masks["masks"].items()}
        row = evaluate_sample(ref, sample.prompt_ids, settings, args.max_new_tokens, given_masks)
        row.update(
            sample_id=sample.sample_id,
            task=sample.task,
            seconds=time.perf_counter() - t0,
            generated_text=tokenizer.decode(row["generated"]),
        )
        results.append(row)
    summary = summarize(results, settings)

    report = {
        "benchmark": "quality",
        "metric": "value error rate (RCStat Eq. 8, normalised by ||v*||): last layer, mean over query heads and "
        "generated tokens per prompt, then over prompts; every layer compressed",
        "preset": preset,
        "seed": args.seed,
        "model": str(args.model or "SmolLM2-135M-Instruct (embedded)"),
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        # Each setting as it ran (no engine: the transformers reference selects with this config; a matched
        # setting's target_ratio is set per prompt to the ratio its RC row achieved there).
        "settings": [
            {**s.to_dict(), "resolved": None if s.label in given_labels else resolved_config(None, s.rcstat)}
            for s in settings
        ],
        "engine": {
            "kind": "transformers reference (hf_reference.py), no vLLM",
            "dtype": args.dtype,
            "torch_threads": torch.get_num_threads(),
        },
        "kvpress_masks": {"path": args.kvpress_masks, "environment": kvpress_masks.get("environment")}
        if args.kvpress_masks
        else None,
        "environment": environment(torch_threads=torch.get_num_threads()),
        "wall_s": round(time.time() - t_start, 1),
        "load_avg": [load_start, load_avg()],
        "summary": summary,
        "samples": results,
    }
    write_report(report, out_path, lambda r: print_table(r["summary"]))
    return 0


def print_table(summary: dict) -> None:
    print(f"{'setting':28s} {'ratio':>6s} {'VER':>7s} {'VER(all L)':>10s} {'top1':>6s}")
    for label, e in summary.items():
        print(f"{label:28s} {e['ratio']:6.3f} {e['ver']:7.4f} {e['ver_all_layers']:10.4f} {e['top1_agree']:6.3f}")


if __name__ == "__main__":
    sys.exit(main())
