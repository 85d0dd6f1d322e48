"""Task accuracy under compression, through vLLM with the plugin, and a fidelity check against transformers.

One vLLM-CPU engine (plugin on, server method ``rc``) runs every prompt under every setting side by side,
each request carrying its own ``SamplingParams.extra_args["rcstat"]`` override, greedy decoding:

* ``niah_single`` / ``niah_multi`` / ``vt``: fraction of the expected strings (needle values, variable names)
  found in the output (RULER's string match);
* ``summ``: ROUGE-L F1 of the compressed output against the full-cache (method ``none``) output of the same
  prompt, plus exact match of the two outputs' tokens.

The achieved ratio of every request is read from the plugin (``compression_results``). Settings
(``methods.accuracy_settings``): the full cache; the bare flag (the engine is started with ``{"rcstat":
{"eviction": "eager"}}`` and the request overrides nothing, so the row follows the plugin's defaults as they are
when a request is compacted: eager eviction compacts every request, where the default, lazy, compacts only under
memory pressure; ``--eviction lazy`` with a small ``--kv-cache-gib`` measures that); RC at budgets 0.5 / 0.7 / 0.8
with its defaults otherwise; the bare flag's settings and RC at 0.8 with each later change of the defaults undone
(``_carry0``, ``_mean``, ``_contrast0``, and ``_mean_contrast0``: both scoring changes); RC with the paper's
scoring (per-layer budget, window 8, no smoothing) at 0.5 and in threshold mode at c = 1; SnapKV and TOVA at
0.5 and 0.8, each at kvpress's published window (SnapKV 64, kernel 5; TOVA the last token) and at RC's default
window. Settings that resolve to the same config as an
earlier one (e.g. RC at the default's own ratio) are run once and reported under both labels (``same_run_as``).

SnapKV's rows name their observation window (``observation_window``: 64 is kvpress's, 32 RC's). TOVA's score is
the last token's attention whatever the window; at RC's window it keeps RC's 32 most recent tokens as well
(kvpress's TOVA keeps only the last one).

Needles are counted per value: single-needle prompts have one, multi-needle prompts three; ``needle_hits``
is the number of values found, ``needle_kept_of_full`` the share of the values the full cache found that the
setting also found.

Fidelity: for a subset of prompts and settings, the transformers reference (hf_reference.py: the plugin's
scorers and selection, uncompressed prefill, masked decode) decodes greedily; its tokens are compared with
vLLM's. The keep sets cannot be guaranteed equal on both paths: vLLM scores bf16 keys from its paged cache
with its own bf16 kernels, the reference its own forward, so near-ties in the scores can fall either way.
The check therefore reports (a) greedy token agreement (exact sequence match and common-prefix fraction)
and (b) how often the kept counts per (layer, KV head) agree exactly, with the full-cache row as the
numerical floor of the two implementations.

    python benchmarks/accuracy.py                     # default, writes benchmarks/results/accuracy_cpu.json
    python benchmarks/accuracy.py --quick --json /tmp/a.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import data
import methods
from common import engine_options, environment, load_avg, write_report
from common import resolved_config as merged_config

RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: default: 32 needle prompts (single: 3 lengths x 8 depths spread evenly over 5-95%; multi, three needles: 2
#: lengths x 4 depths of the queried needle), 2 variable-tracking prompts and 6 essay summaries.
ACCURACY_PRESETS = {
    "quick": dict(
        base="quick",
        niah_lengths=[1024, 2048],
        niah_depths=[0.1, 0.9],
        niah_multi_lengths=[1024],
        niah_multi_depths=[0.5],
        vt_lengths=[1024],
        vt_per_length=1,
        summ=1,
        summ_tokens=1024,
        niah_multikey_lengths=[1024],
        niah_multikey_depths=[0.5],
        niah_multivalue_lengths=[1024],
        niah_multivalue_depths=[0.3],
    ),
    "default": dict(
        base="default",
        niah_lengths=[1024, 2048, 4096],
        niah_depths=[0.05, 0.18, 0.31, 0.44, 0.56, 0.69, 0.82, 0.95],
        niah_multi_lengths=[1024, 2048],
        niah_multi_depths=[0.1, 0.4, 0.6, 0.9],
        vt_lengths=[1024],
        vt_per_length=2,
        summ=6,
        summ_tokens=1024,
        # RULER's multi-key (4 keys, 3 distractors, ask one) and multi-value (4 values, one key)
        niah_multikey_lengths=[1024, 2048],
        niah_multikey_depths=[0.1, 0.4, 0.6, 0.9],
        niah_multivalue_lengths=[1024, 2048],
        niah_multivalue_depths=[0.1, 0.5, 0.9],
    ),
}
#: --budget-scope-study: needles only, more of them (single: 3 lengths x 6 depths; multi: 2 lengths x 3 depths).
BUDGET_SCOPE_PRESET = dict(
    base="default",
    tasks=["niah_single", "niah_multi"],
    niah_lengths=[1024, 2048, 4096],
    niah_depths=[0.05, 0.25, 0.4, 0.6, 0.75, 0.95],
    niah_multi_lengths=[1024, 2048],
    niah_multi_depths=[0.1, 0.5, 0.9],
)


def study_preset(summaries: int = 0) -> dict:
    """build_suite arguments of the studies: BUDGET_SCOPE_PRESET's needles, plus ``summaries`` essay summaries
    (as the main run's, 1024 tokens) when asked. The summarised essays are kept out of the haystacks, so the
    needle prompts differ from a needles-only run with the same seed."""
    ap = dict(BUDGET_SCOPE_PRESET)
    if summaries > 0:
        ap["tasks"] = [*ap["tasks"], "summ"]
        ap.update(summ=summaries, summ_tokens=ACCURACY_PRESETS["default"]["summ_tokens"])
    return ap


#: methods.accuracy_settings arguments per preset.
SETTINGS_PRESETS = {
    "quick": dict(
        rc_ratios=(0.8,),
        baseline_ratios=(0.5,),
        paper_ratios=(0.5,),
        c_values=(),
        uncarried_ratios=(),
        mean_ratios=(),
        uncontrasted_ratios=(),
        mean_uncontrasted_ratios=(),
    ),
    "default": dict(rc_ratios=(0.5, 0.7, 0.8), baseline_ratios=(0.5, 0.8), paper_ratios=(0.5,), c_values=(1.0,)),
}
#: The transformers cross-check: the shortest retrieval prompts, a few settings (it is a check of the plugin's
#: path, not a measurement of the methods; settings missing from a run are skipped).
FIDELITY = {
    "quick": dict(samples=1, settings=("full", "default", "tova_w1_r0.5")),
    "default": dict(samples=2, settings=("full", "default", "rc_paper_r0.5", "tova_w1_r0.5")),
}


def engine_kwargs(model_dir: str, max_model_len: int, kv_bytes: int, eviction: str = "eager") -> dict:
    """The engine every setting runs in. ``eviction`` server-wide: ``eager`` (the default here) compacts every
    request right after its prefill, so each row shows what its setting keeps; under the plugin's default (``lazy``)
    a request is compacted only when the pool runs short, which would make a row depend on the pool and on which
    requests ran beside it."""
    from rcstat_vllm.model import with_embedded_dtype

    return with_embedded_dtype(
        dict(
            model=model_dir,
            enforce_eager=True,
            compilation_config={"mode": 0},
            max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_bytes,
            seed=0,
            # Every prompt runs under every setting: with prefix caching a repeat would be served its prompt
            # from the cache, and the plugin compresses only the tokens a request computes.
            enable_prefix_caching=False,
            # The bare flag but for when it compacts: the "default" setting's requests override nothing, the
            # others what they set.
            additional_config={"rcstat": server_flag(eviction)},
        )
    )


def server_flag(eviction: str = "eager") -> dict:
    """The engine's ``rcstat`` flag (:func:`engine_kwargs`): the bare flag but for when it compacts."""
    return {"eviction": eviction}


def resolved_config(setting: methods.Setting, eviction: str = "eager") -> dict:
    """The config a setting's requests run with on the benchmark's engine: its flag (``eviction``) merged with the
    setting's override, as the plugin merges them (so ``eviction`` is the engine's, not ``RCStatConfig()``'s)."""
    return merged_config(server_flag(eviction), setting.rcstat)


def run_plan(settings: list[methods.Setting]) -> dict[str, str]:
    """label -> the label of the earlier setting with the same resolved config (run once, reported twice)."""
    seen: dict[str, str] = {}
    same: dict[str, str] = {}
    for s in settings:
        if s.matched_to is not None:
            continue
        key = repr(sorted(resolved_config(s).items()))
        if key in seen:
            same[s.label] = seen[key]
        else:
            seen[key] = s.label
    return same


def run_wave(llm, jobs: list[tuple], desc: str) -> tuple[list[dict], float]:
    """jobs: (sample, setting, override). Returns one record per job with output and plugin result."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from rcstat_vllm.api import compression_results, match_outputs

    prompts = [TokensPrompt(prompt_token_ids=s.prompt_ids) for s, _, _ in jobs]
    params = [
        SamplingParams(temperature=0.0, max_tokens=s.max_new_tokens, extra_args={"rcstat": o}) for s, _, o in jobs
    ]
    t0 = time.perf_counter()

    def progress(*args, **kwargs):
        from tqdm import tqdm

        kwargs["desc"] = f"{desc}: {kwargs.get('desc', '')}".rstrip(": ")
        return tqdm(*args, **kwargs)

    outputs = llm.generate(prompts, params, use_tqdm=progress)
    wall = time.perf_counter() - t0
    matched = match_outputs(outputs, compression_results(llm))
    records = []
    for (sample, setting, override), out, res in zip(jobs, outputs, matched):
        records.append(
            {
                "sample_id": sample.sample_id,
                "task": sample.task,
                "setting": setting.label,
                "family": setting.family,
                "override": override,
                "num_tokens": sample.num_tokens,
                "token_ids": list(out.outputs[0].token_ids),
                "text": out.outputs[0].text,
                "ratio": None if res is None else res.get("compression_ratio"),
                "skipped_reason": None if res is None else res.get("skipped_reason"),
                "blocks_freed": None if res is None else res.get("blocks_freed"),
                "fragmentation": None if res is None else res.get("fragmentation"),
                "kept": None if res is None else res.get("kept"),
                "block_size": None if res is None else res.get("block_size"),
                "pooled_pages": None if res is None else res.get("pooled_pages"),
                "cached_tokens": out.num_cached_tokens or 0,
            }
        )
    return records, wall


def copy_records(records: list[dict], same: dict[str, str], settings: list[methods.Setting]) -> list[dict]:
    """Records of each setting that was run once under an earlier label, under its own label too."""
    by_label = {s.label: s for s in settings}
    extra = []
    for label, source in same.items():
        for r in records:
            if r["setting"] == source:
                extra.append(
                    {
                        **r,
                        "setting": label,
                        "family": by_label[label].family,
                        "override": dict(by_label[label].rcstat),
                        "same_run_as": source,
                    }
                )
    return extra


def score_records(records: list[dict], samples: dict[str, data.Sample]) -> None:
    full = {r["sample_id"]: r for r in records if r["setting"] == "full"}
    for r in records:
        sample = samples[r["sample_id"]]
        ref = full.get(r["sample_id"])
        if sample.task == "summ":
            r["score"] = data.rouge_l(ref["text"], r["text"]) if ref else float("nan")
        else:
            r["found"] = data.found_answers(sample, r["text"])
            r["score"] = data.score_output(sample, r["text"])
        r["same_as_full"] = ref is not None and ref["token_ids"] == r["token_ids"]
        if r["ratio"] is None:
            r["ratio"] = 0.0 if r["family"] == "full" else float("nan")


def summarize(records: list[dict], settings: list[methods.Setting], eviction: str = "eager") -> dict:
    summary = {}
    full_found = {r["sample_id"]: r["found"] for r in records if r["setting"] == "full" and "found" in r}
    for s in settings:
        rows = [r for r in records if r["setting"] == s.label]
        if not rows:
            continue
        entry = {
            "family": s.family,
            "rcstat": s.rcstat,
            "matched_to": s.matched_to,
            "n": len(rows),
            "ratio": _mean(r["ratio"] for r in rows),
            "skipped": sum(1 for r in rows if r["skipped_reason"] and s.family != "full"),
            "same_as_full": _mean(float(r["same_as_full"]) for r in rows),
            "by_task": {},
        }
        for task in sorted({r["task"] for r in rows}):
            t_rows = [r for r in rows if r["task"] == task]
            entry["by_task"][task] = {
                "n": len(t_rows),
                "score": _mean(r["score"] for r in t_rows),
                "ratio": _mean(r["ratio"] for r in t_rows),
            }
        needle = [r for r in rows if r["task"] in data.NEEDLE_TASKS]
        entry["needle_accuracy"] = _mean(r["score"] for r in needle)
        entry["needle_ratio"] = _mean(r["ratio"] for r in needle)
        entry.update(needle_counts(needle, full_found))
        entry["resolved"] = resolved_config(s, eviction)
        same_run = {r.get("same_run_as") for r in rows} - {None}
        entry["same_run_as"] = same_run.pop() if same_run else None
        summary[s.label] = entry
    return summary


def needle_counts(rows: list[dict], full_found: dict[str, list[bool]]) -> dict:
    """Needle values found (single and multi-key: one per prompt, multi: three, multi-value: four), per task and
    overall, and how many of the values the full cache found this setting found too."""
    out = {
        "needle_prompts": len(rows),
        "needle_values": sum(len(r["found"]) for r in rows),
        "needle_hits": sum(sum(r["found"]) for r in rows),
    }
    for task in data.NEEDLE_TASKS:
        t_rows = [r for r in rows if r["task"] == task]
        out[f"{task}_values"] = sum(len(r["found"]) for r in t_rows)
        out[f"{task}_hits"] = sum(sum(r["found"]) for r in t_rows)
    both = sum(a and b for r in rows for a, b in zip(r["found"], full_found.get(r["sample_id"], [])))
    full_hits = sum(sum(full_found.get(r["sample_id"], [])) for r in rows)
    out["full_hits"] = full_hits
    out["needle_kept_of_full"] = both / full_hits if full_hits else float("nan")
    out["needle_hits_vs_full"] = out["needle_hits"] / full_hits if full_hits else float("nan")
    return out


def _mean(values) -> float:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.fmean(values) if values else float("nan")


# ----------------------------------------------------------------------------------------------- fidelity


def fidelity_check(
    records: list[dict],
    samples: list[data.Sample],
    settings: list[methods.Setting],
    labels: tuple[str, ...],
    num_samples: int,
    dtype: str,
    model_dir: str | None,
) -> dict:
    import hf_reference as ref_lib
    import torch
    from tqdm import tqdm

    from rcstat_vllm.config import RCStatConfig

    torch.set_num_threads(os.cpu_count() or 1)
    by_label = {s.label: s for s in settings}
    labels = tuple(label for label in labels if label in by_label)
    # The shortest prompts of the retrieval tasks first (the reference runs on the CPU too).
    chosen = sorted((s for s in samples if s.task != "summ"), key=lambda s: s.num_tokens)[:num_samples]
    vllm_rec = {(r["sample_id"], r["setting"]): r for r in records}
    ref = ref_lib.ReferenceModel(model_dir, dtype=getattr(torch, dtype))
    rows = []
    for sample in tqdm(chosen, desc="fidelity (transformers)", unit="prompt"):
        prefill = ref.prefill(sample.prompt_ids)
        for label in labels:
            vr = vllm_rec.get((sample.sample_id, label))
            if vr is None:
                continue
            config = RCStatConfig.from_dict(vr["override"])
            if config.enabled:
                # (the pages the engine's heads were aligned to: its block size, one pool or one per layer)
                keep = ref_lib.keep_masks(prefill, config, vr.get("block_size"), vr.get("pooled_pages", True))
                masks, kept, ratio = keep.masks, keep.kept, keep.ratio
            else:
                masks, kept, ratio = None, None, 0.0
            hf_tokens = ref.greedy(prefill, sample.max_new_tokens, masks)
            v_tokens = vr["token_ids"]
            prefix = 0
            for a, b in zip(hf_tokens, v_tokens):
                if a != b:
                    break
                prefix += 1
            row = {
                "sample_id": sample.sample_id,
                "setting": label,
                "exact": hf_tokens == v_tokens,
                "prefix_fraction": prefix / max(len(hf_tokens), len(v_tokens), 1),
                "hf_tokens": hf_tokens,
                "vllm_tokens": v_tokens,
                "hf_ratio": ratio,
                "vllm_ratio": vr["ratio"],
            }
            if kept is not None and vr.get("kept"):
                pairs = [(a, b) for la, lb in zip(kept, vr["kept"]) for a, b in zip(la, lb)]
                row["kept_count_agreement"] = sum(a == b for a, b in pairs) / len(pairs)
                row["kept_count_mean_abs_diff"] = statistics.fmean(abs(a - b) for a, b in pairs)
            rows.append(row)
    summary = {}
    for label in labels:
        lr = [r for r in rows if r["setting"] == label]
        if lr:
            summary[label] = {
                "n": len(lr),
                "exact_match_rate": _mean(float(r["exact"]) for r in lr),
                "prefix_agreement": _mean(r["prefix_fraction"] for r in lr),
                "kept_count_agreement": _mean(r.get("kept_count_agreement") for r in lr),
                "ratio_abs_diff": _mean(
                    abs(r["hf_ratio"] - r["vllm_ratio"]) for r in lr if r["vllm_ratio"] is not None
                ),
            }
    overall = {
        "exact_match_rate": _mean(float(r["exact"]) for r in rows),
        "prefix_agreement": _mean(r["prefix_fraction"] for r in rows),
    }
    return {
        "dtype": dtype,
        "note": "keep-set equality between vLLM and transformers is not guaranteed (bf16 "
        "paged keys and different kernels; near-ties in scores); reported: greedy token agreement and "
        "per-(layer, KV head) kept-count agreement; the 'full' row is the numerical floor",
        "overall": overall,
        "by_setting": summary,
        "rows": rows,
    }


# ----------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # deterministic batches, results in-process
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a ~3-minute smoke run")
    parser.add_argument("--seed", type=int, default=data.DEFAULT_SEED)
    parser.add_argument("--model", default=None)
    parser.add_argument("--c", type=float, nargs="*", default=None, help="RC threshold mode (paper scoring) at these c")
    parser.add_argument(
        "--ratios",
        type=float,
        nargs="*",
        default=None,
        help="RC budgets with its defaults otherwise (default 0.5 0.7 0.8); the studies' ratios",
    )
    parser.add_argument(
        "--baseline-ratios",
        type=float,
        nargs="*",
        default=None,
        help="SnapKV and TOVA budgets, each at kvpress's window and RC's (default 0.5 0.8)",
    )
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument(
        "--eviction",
        choices=["eager", "lazy"],
        default="eager",
        help="server-wide eviction (default eager: every setting compacts; lazy: the plugin's "
        "default, compacting only when the pool is short, e.g. with a small --kv-cache-gib)",
    )
    parser.add_argument("--fidelity-samples", type=int, default=None)
    parser.add_argument(
        "--fidelity-dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="the transformers reference's dtype (default: the engine's: float32 on CPUs without bf16)",
    )
    parser.add_argument("--no-fidelity", action="store_true")
    parser.add_argument(
        "--budget-scope-study",
        action="store_true",
        help="needles only: RC budget per layer vs model-wide (the plugin's own comparison of layers) "
        "at --ratios (default 0.5 0.8); writes benchmarks/results/accuracy_budget_scope_cpu.json",
    )
    methods.add_cliff_arguments(parser, "accuracy_cliff_cpu.json")
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="LABEL",
        default=None,
        help="run only these settings (labels as the table prints them; the full cache always runs: "
        "the others are scored against it)",
    )
    parser.add_argument(
        "--extra",
        nargs="*",
        default=[],
        metavar="LABEL=JSON",
        help='more settings, each a label and its per-request override (\'rc_r0.9_v1={"method": "rc", '
        '"target_ratio": 0.9, "value_weight": 1}\'); run after --only\'s choice',
    )
    parser.add_argument("--json", default=None, help="output (default benchmarks/results/accuracy_cpu.json)")
    parser.add_argument(
        "--write-prompts",
        metavar="PATH",
        default=None,
        help="write this run's prompts (with token ids) as JSON to PATH and stop: the input of "
        "benchmarks/kvpress_reference.py, so kvpress runs on exactly these prompts",
    )
    args = parser.parse_args(argv)
    preset = "quick" if args.quick else "default"
    sp = dict(SETTINGS_PRESETS[preset])
    for key, value in (("c_values", args.c), ("rc_ratios", args.ratios), ("baseline_ratios", args.baseline_ratios)):
        if value is not None:
            sp[key] = tuple(value)
    if args.cliff_ablation:
        settings = methods.cliff_settings_from_args(args)
        args.no_fidelity = True
        default_name = "accuracy_cliff_cpu.json"
    elif args.budget_scope_study:
        settings = methods.budget_scope_settings(ratios=tuple(args.ratios or (0.5, 0.8)), comparables=())
        settings += [
            methods.Setting(
                f"rc_model_r{r:g}", "rc_model", {**methods.PAPER_RC, "target_ratio": float(r), "budget_scope": "model"}
            )
            for r in (args.ratios or (0.5, 0.8))
        ]
        args.no_fidelity = True
        default_name = "accuracy_budget_scope_cpu.json"
    else:
        settings = methods.accuracy_settings(**sp)
        default_name = "accuracy_cpu_quick.json" if args.quick else "accuracy_cpu.json"
    if args.only:
        unknown = sorted(set(args.only) - {s.label for s in settings})
        if unknown:
            parser.error(f"--only: no settings {unknown} (there are {[s.label for s in settings]})")
        settings = [s for s in settings if s.label in args.only or s.family == "full"]
    settings += [methods.extra_setting(spec) for spec in args.extra]
    labels = [s.label for s in settings]
    if len(set(labels)) != len(labels):
        parser.error(f"settings' labels repeat: {labels}")
    out_path = Path(args.json) if args.json else RESULTS_DIR / default_name

    from rcstat_vllm.model import default_model_dir

    model_dir = str(args.model or default_model_dir())
    t_start = time.time()
    load_start = load_avg()
    tokenizer = data.load_tokenizer(model_dir)
    ap = (
        study_preset(args.summaries)
        if args.budget_scope_study or args.cliff_ablation
        else dict(ACCURACY_PRESETS[preset])
    )
    samples = data.build_suite(tokenizer, ap.pop("base"), args.seed, **ap)
    if args.write_prompts:
        Path(args.write_prompts).write_text(
            json.dumps(
                {
                    "benchmark": "accuracy",
                    "preset": preset,
                    "seed": args.seed,
                    "model": model_dir,
                    "samples": [s.to_dict(with_ids=True) for s in samples],
                }
            )
        )
        print(f"{len(samples)} prompts written to {args.write_prompts}", file=sys.stderr)
        return 0
    by_id = {s.sample_id: s for s in samples}
    max_len = max(s.num_tokens + s.max_new_tokens for s in samples)
    max_model_len = max(2048, -(-max_len // 1024) * 1024)
    print(
        f"{len(samples)} prompts ({sum(s.num_tokens for s in samples)} tokens) x {len(settings)} settings",
        file=sys.stderr,
    )

    from vllm import LLM

    same = run_plan(settings)
    report: dict = {
        "benchmark": "accuracy",
        "preset": preset,
        "seed": args.seed,
        "model": model_dir,
        "plugin_defaults": methods.plugin_defaults(),
        "baseline_published_windows": methods.kvpress_windows(),
        "settings": [
            {**s.to_dict(), "resolved": resolved_config(s, args.eviction), "same_run_as": same.get(s.label)}
            for s in settings
        ],
        "samples": [s.to_dict() for s in samples],
    }
    kwargs = engine_kwargs(model_dir, max_model_len, int(args.kv_cache_gib * (1 << 30)), args.eviction)
    # How the numbers were made, before the run (a run cut short still says it): commit, machine, engine options.
    report["environment"] = environment()
    report["engine"] = engine_options(kwargs)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    report["engine_start_s"] = round(time.perf_counter() - t0, 1)
    first = [
        (s, st, methods.resolve(st, {}))
        for st in settings
        if st.matched_to is None and st.label not in same
        for s in samples
    ]
    records, wall1 = run_wave(llm, first, "vLLM wave 1 (fixed settings)")
    matched = [st for st in settings if st.matched_to is not None]
    wall2 = 0.0
    if matched:
        rc = {(r["sample_id"], r["setting"]): r["ratio"] for r in records if r["family"] == "rc"}
        second = []
        for st in matched:
            for s in samples:
                ratio = rc.get((s.sample_id, st.matched_to))
                if ratio is not None:
                    second.append((s, st, methods.resolve(st, {st.matched_to: ratio})))
        more, wall2 = run_wave(llm, second, "vLLM wave 2 (matched to RC)")
        records += more
    report["generate_s"] = round(wall1 + wall2, 1)
    report["prompt_tokens_processed"] = sum(r["num_tokens"] for r in records)
    report["cached_prompt_tokens"] = sum(r["cached_tokens"] for r in records)  # 0: prefix caching is off
    del llm
    records += copy_records(records, same, settings)
    score_records(records, by_id)
    report["summary"] = summarize(records, settings, args.eviction)
    report["records"] = [{k: v for k, v in r.items() if k != "kept"} for r in records]

    if not args.no_fidelity:
        fid = dict(FIDELITY[preset])
        if args.fidelity_samples is not None:
            fid["samples"] = args.fidelity_samples
        try:
            t0 = time.perf_counter()
            from rcstat_vllm.model import embedded_model_dtype

            dtype = args.fidelity_dtype or embedded_model_dtype() or "bfloat16"
            report["fidelity"] = fidelity_check(
                records, samples, settings, fid["settings"], fid["samples"], dtype, model_dir
            )
            report["fidelity"]["seconds"] = round(time.perf_counter() - t0, 1)
        except Exception:  # noqa: BLE001 - keep the vLLM results even if the reference fails
            report["fidelity"] = {"error": traceback.format_exc()}
            print(report["fidelity"]["error"], file=sys.stderr)

    report["wall_s"] = round(time.time() - t_start, 1)
    report["load_avg"] = [load_start, load_avg()]
    write_report(report, out_path, print_table)
    return 0


def print_table(report: dict) -> None:
    print(
        f"{'setting':18s} {'ratio':>6s} {'single':>7s} {'multi':>7s} {'m-key':>7s} {'m-value':>7s} {'of full':>7s} "
        f"{'vt':>6s} {'summ':>6s} {'=full':>6s}"
    )
    for label, e in report["summary"].items():
        task = lambda t: e["by_task"].get(t, {}).get("score", float("nan"))  # noqa: E731, B023
        count = lambda t: f"{e.get(t + '_hits', 0)}/{e.get(t + '_values', 0)}"  # noqa: E731, B023
        print(
            f"{label:18s} {e['ratio']:6.3f} {count('niah_single'):>7s} {count('niah_multi'):>7s} "
            f"{count('niah_multikey'):>7s} {count('niah_multivalue'):>7s} "
            f"{e.get('needle_kept_of_full', float('nan')):7.2f} {task('vt'):6.3f} {task('summ'):6.3f} "
            f"{e['same_as_full']:6.2f}"
        )
    fid = report.get("fidelity", {})
    if "by_setting" in fid:
        print("fidelity (vLLM vs transformers, greedy):")
        for label, f in fid["by_setting"].items():
            print(
                f"  {label:20s} exact {f['exact_match_rate']:.2f}  prefix {f['prefix_agreement']:.2f}  "
                f"kept-count agreement {f['kept_count_agreement']:.2f}"
            )


if __name__ == "__main__":
    sys.exit(main())
