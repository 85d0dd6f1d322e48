"""Past the cliff: values kept at high compression, with the KV-compression-physics paper's two structural measures
per request, through the transformers reference (hf_reference.py: the plugin's scorers and selection, float32).

Prompt families, reported per task:

* the project's needle families (``data.build_suite``: single, three-needle, RULER multi-key and multi-value);
* ``probe_*``: the physics paper's synthetic probes, slot-filled from a seeded generator, on text no other
  benchmark uses (invented people, places and codes): ``probe_entities`` (multi-entity tracking: 24 people with
  4 attributes each, one attribute of one person asked), ``probe_instances`` (instance disambiguation: each
  person's locker code is given, then changed once; the current code asked, the first one a distractor),
  ``probe_coref`` (coreference: biographies whose later sentences name the person only by a pronoun; what such a
  sentence says is asked).

Per setting and task: values found, and of the values the full cache finds, how many the setting finds too
(``kept_of_full``); per request and averaged: the achieved ratio, the global eviction ratio (prompt tokens evicted
from every KV head of every layer, as the plugin reports it), the paper's task-aware GER (the share of the asked
value's tokens evicted from every head: its Section 5.1 restricted to T_ans), and head consensus
(``rcstat_vllm.scoring.selection.head_consensus``: mean pairwise overlap of a layer's heads' kept sets).
Each prompt is prefilled and scored once; every setting's selection runs on those scores (settings differ only in
selection), then decodes greedily.

    python benchmarks/routes.py --seed 5 --json benchmarks/results/routes_seed5_cpu.json
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
import hf_reference as ref_lib
import methods
from common import environment, load_avg, resolved_config, write_report

from rcstat_vllm.config import RCStatConfig
from rcstat_vllm.scoring.selection import head_consensus

RESULTS_DIR = Path(__file__).resolve().parent / "results"
NEEDLE_FAMILIES = ("niah_single", "niah_multi", "niah_multikey", "niah_multivalue")
PROBES = ("probe_entities", "probe_instances", "probe_coref")

SYLLABLES = ["ka", "lo", "mi", "ren", "tas", "vol", "dre", "qui", "zan", "pel", "mor", "sil", "bra", "tek", "wu", "nov"]
JOBS = ["glassblower", "cartographer", "beekeeper", "luthier", "surveyor", "ferrier", "bookbinder", "tanner"]
COLOURS = ["amber", "teal", "crimson", "ochre", "violet", "silver", "olive", "indigo"]


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(syllables)).capitalize()


def _people(rng: random.Random, count: int) -> list[dict]:
    names: set[str] = set()
    towns: set[str] = set()
    people = []
    while len(people) < count:
        name = f"{_word(rng, 2)} {_word(rng, 3)}"
        town = _word(rng, 3)
        if name in names or town in towns:
            continue
        names.add(name)
        towns.add(town)
        people.append(
            {
                "name": name,
                "town": town,
                "job": rng.choice(JOBS),
                "colour": rng.choice(COLOURS),
                "code": f"{rng.choice('BCDFGHKMPRTVXZ')}{rng.choice('BCDFGHKMPRTVXZ')}-{rng.randint(1000, 9999)}",
                "code2": f"{rng.choice('BCDFGHKMPRTVXZ')}{rng.choice('BCDFGHKMPRTVXZ')}-{rng.randint(1000, 9999)}",
                "pronoun": rng.choice(["He", "She"]),
            }
        )
    return people


def probe_sample(tokenizer, task: str, rng: random.Random, sample_id: str, count: int = 24) -> data.Sample:
    """One probe prompt (see the module doc); the asked person is drawn from the whole list (any depth)."""
    people = _people(rng, count)
    asked = rng.randrange(count)
    person = people[asked]
    if task == "probe_entities":
        lines = [
            f"{p['name']} lives in {p['town']}, works as a {p['job']}, paints with {p['colour']} and holds "
            f"badge {p['code']}."
            for p in people
        ]
        question = f"Which town does {person['name']} live in?"
        prefix = f"{person['name']} lives in"
        answer, distractors = person["town"], []
    elif task == "probe_instances":
        first = [f"{p['name']} was given locker code {p['code']}." for p in people]
        later = [f"Later, {p['name']}'s locker code was changed to {p['code2']}." for p in people]
        order = list(range(count))
        rng.shuffle(order)
        lines = first[: count // 2] + [later[i] for i in order[: count // 2]] + first[count // 2 :]
        lines += [later[i] for i in order[count // 2 :]]
        question = f"What is {person['name']}'s locker code now, after the change?"
        prefix = f"{person['name']}'s locker code now is"
        answer, distractors = person["code2"], [person["code"]]
    elif task == "probe_coref":
        lines = [
            f"{p['name']} grew up by the sea. {p['pronoun']} later moved to {p['town']}, where "
            f"{p['pronoun'].lower()} trained as a {p['job']}."
            for p in people
        ]
        question = f"Where did {person['name']} move to?"
        prefix = f"{person['name']} moved to"
        answer, distractors = person["town"], []
    else:
        raise ValueError(f"unknown probe {task!r}")
    context = "\n".join(lines)
    user = f"Read the following records carefully. I will ask about them afterwards.\n{context}\n{question}"
    text = data.chat_prompt(tokenizer, user, prefix)
    return data.Sample(
        task=task,
        sample_id=sample_id,
        prompt=text,
        prompt_ids=data.encode(tokenizer, text),
        answers=[answer],
        max_new_tokens=16,
        meta={"asked_index": asked, "people": count, "distractors": distractors},
    )


def build_probes(tokenizer, seed: int, per_task: int, count: int) -> list[data.Sample]:
    samples = []
    for task in PROBES:
        for i in range(per_task):
            rng = random.Random(f"{seed}-{task}-{i}")
            samples.append(probe_sample(tokenizer, task, rng, f"{task}-{i}", count))
    return samples


def answer_token_positions(tokenizer, sample: data.Sample) -> list[int]:
    """Prompt token positions of the asked values' characters (their first occurrence in the prompt's context)."""
    enc = tokenizer(sample.prompt, add_special_tokens=False, return_offsets_mapping=True)
    if enc["input_ids"] != sample.prompt_ids:
        return []
    positions: set[int] = set()
    for value in sample.answers:
        start = sample.prompt.find(value)
        if start < 0:
            continue
        end = start + len(value)
        positions.update(i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < end and b > start)
    return sorted(positions)


def settings_for(ratios: list[float], floors: list[float], default_floors: list[float]) -> list[methods.Setting]:
    """The full cache, the bare flag (with each of ``default_floors``), RC with the defaults at each ratio (with each
    of ``floors``)."""
    out = [methods.Setting("full", "full", {"method": "none"}), methods.Setting("default", "default", {})]
    out += [methods.Setting(f"default_cf{f:g}", "default", {"coverage_floor": f}) for f in default_floors]
    for r in ratios:
        out.append(methods.Setting(f"rc_r{r:g}", "rc_defaults", {"method": "rc", "target_ratio": r}))
        out += [
            methods.Setting(
                f"rc_r{r:g}_cf{f:g}", "rc_defaults", {"method": "rc", "target_ratio": r, "coverage_floor": f}
            )
            for f in floors
        ]
    return out


def evaluate(ref, tokenizer, sample: data.Sample, settings: list[methods.Setting]) -> list[dict]:
    prefill = ref.prefill(sample.prompt_ids)
    n = prefill.n
    answer_pos = answer_token_positions(tokenizer, sample)
    scores = None
    rows = []
    for setting in settings:
        config = RCStatConfig().merged(setting.rcstat)
        row: dict = {"sample": sample.sample_id, "task": sample.task, "label": setting.label, "n": n}
        masks = None
        if config.enabled:
            if scores is None:
                t0 = time.perf_counter()
                scores = ref_lib.score_layers(prefill, config)
                row["score_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            keep = ref_lib.select_layers(scores, config)
            row["select_s"] = time.perf_counter() - t0
            masks = keep.masks
            visible = torch.stack([m.any(dim=0) for m in masks]).any(dim=0)  # [n]
            row["ratio"] = keep.ratio
            row["global_eviction_ratio"] = float((~visible).float().mean())
            row["answer_ger"] = float((~visible[answer_pos]).float().mean()) if answer_pos else None
            row["head_consensus"] = float(head_consensus(masks, config.window, config.sink_tokens))
        tokens = ref.greedy(prefill, sample.max_new_tokens, masks=masks)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        row["output"] = text
        row["found"] = data.found_answers(sample, text)
        rows.append(row)
    return rows


def summarize(rows: list[dict], settings: list[methods.Setting]) -> dict:
    full = {r["sample"]: r["found"] for r in rows if r["label"] == "full"}
    out: dict = {}
    for setting in settings:
        mine = [r for r in rows if r["label"] == setting.label]
        per_task: dict = {}
        for task in sorted({r["task"] for r in mine}):
            task_rows = [r for r in mine if r["task"] == task]
            found = sum(sum(r["found"]) for r in task_rows)
            total = sum(len(r["found"]) for r in task_rows)
            full_found = sum(sum(full[r["sample"]]) for r in task_rows)
            kept = sum(sum(a and b for a, b in zip(full[r["sample"]], r["found"])) for r in task_rows)
            entry = {"values": total, "found": found, "full_found": full_found, "kept_of_full": kept}
            for key in ("ratio", "global_eviction_ratio", "answer_ger", "head_consensus"):
                vals = [r[key] for r in task_rows if r.get(key) is not None]
                if vals:
                    entry[key] = statistics.fmean(vals)
            per_task[task] = entry
        groups = {"needles": NEEDLE_FAMILIES, "probes": PROBES}
        totals = {}
        for name, tasks in groups.items():
            parts = [per_task[t] for t in tasks if t in per_task]
            if parts:
                full_found = sum(p["full_found"] for p in parts)
                kept = sum(p["kept_of_full"] for p in parts)
                totals[name] = {
                    "full_found": full_found,
                    "kept_of_full": kept,
                    "share": kept / full_found if full_found else None,
                }
        mean = {}
        for key in ("ratio", "global_eviction_ratio", "answer_ger", "head_consensus", "select_s"):
            vals = [r[key] for r in mine if r.get(key) is not None]
            if vals:
                mean[key] = statistics.fmean(vals)
        out[setting.label] = {"per_task": per_task, "totals": totals, "mean": mean}
    return out


def print_table(report: dict) -> None:
    summary = report["summary"]
    head = f"{'needles kept':>14} {'probes kept':>13} {'ratio':>6} {'GER':>6} {'ansGER':>7} {'cons':>6}"
    print(f"\n{'setting':<22} {head}")
    for label, entry in summary.items():
        cells = []
        for group in ("needles", "probes"):
            t = entry["totals"].get(group)
            cells.append(f"{t['kept_of_full']}/{t['full_found']}" if t else "-")
        m = entry["mean"]

        def fmt(key, m=m):
            return f"{m[key]:.3f}" if key in m else "-"

        print(
            f"{label:<22} {cells[0]:>14} {cells[1]:>13} {fmt('ratio'):>6} {fmt('global_eviction_ratio'):>6} "
            f"{fmt('answer_ger'):>7} {fmt('head_consensus'):>6}"
        )
    for label, entry in summary.items():
        tasks = ", ".join(f"{t} {e['kept_of_full']}/{e['full_found']}" for t, e in entry["per_task"].items())
        print(f"  {label}: {tasks}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=5, help="prompts' seed (the needle benchmarks use 0-3, 7, 11, 17)")
    parser.add_argument("--ratios", type=float, nargs="*", default=[0.8, 0.9])
    parser.add_argument("--floors", type=float, nargs="*", default=[0.5, 1.0], help="coverage floors at --ratios")
    parser.add_argument("--default-floors", type=float, nargs="*", default=[0.5], help="... and at the bare flag")
    parser.add_argument("--tasks", nargs="*", default=[*NEEDLE_FAMILIES, *PROBES])
    parser.add_argument("--lengths", type=int, nargs="*", default=[1024, 2048], help="needle prompts' lengths")
    parser.add_argument("--depths", type=float, nargs="*", default=[0.25, 0.75], help="needle depths")
    parser.add_argument("--probes", type=int, default=4, help="prompts per probe task")
    parser.add_argument("--people", type=int, default=24, help="people per probe prompt")
    parser.add_argument("--max-samples", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="output (default benchmarks/results/routes_seed<seed>_cpu.json)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = data.load_tokenizer()
    needles = [t for t in args.tasks if t in NEEDLE_FAMILIES]
    samples: list[data.Sample] = []
    if needles:
        overrides = {f"{t}_lengths": args.lengths for t in ("niah_multikey", "niah_multivalue")}
        overrides.update({f"{t}_depths": args.depths for t in ("niah_multikey", "niah_multivalue")})
        samples += data.build_suite(
            tokenizer,
            "default",
            seed=args.seed,
            tasks=needles,
            niah_lengths=args.lengths,
            niah_depths=args.depths,
            niah_multi_lengths=args.lengths,
            niah_multi_depths=args.depths,
            **overrides,
        )
    probes = [t for t in args.tasks if t in PROBES]
    samples += [s for s in build_probes(tokenizer, args.seed, args.probes, args.people) if s.task in probes]
    if args.max_samples:
        samples = samples[: args.max_samples]
    settings = settings_for(args.ratios, args.floors, args.default_floors)
    ref = ref_lib.ReferenceModel()
    rows: list[dict] = []
    started = time.time()
    load_before = load_avg()
    for sample in tqdm(samples, desc="prompts"):
        rows += evaluate(ref, tokenizer, sample, settings)
    report = {
        "benchmark": "routes",
        "environment": environment(load_avg_before=load_before, load_avg_after=load_avg()),
        "seed": args.seed,
        "path": "transformers reference (hf_reference.py)",
        "dtype": "float32",
        "settings": [
            {**s.to_dict(), "resolved": resolved_config(None, s.rcstat) if s.rcstat else {}} for s in settings
        ],
        "samples": [s.to_dict() for s in samples],
        "rows": rows,
        "summary": summarize(rows, settings),
        "wall_s": time.time() - started,
    }
    out = Path(args.json) if args.json else RESULTS_DIR / f"routes_seed{args.seed}_cpu.json"
    write_report(report, out, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
