"""Past the cliff: values kept at high compression, with the KV-compression-physics paper's two structural measures
per request, through the transformers reference (hf_reference.py: the plugin's scorers and selection, float32).

Prompt families, reported per task:

* the project's needle families (``data.build_suite``: single, three-needle, RULER multi-key and multi-value);
* ``probe_*``: the physics paper's synthetic probes, slot-filled from a seeded generator and hidden, as facts about
  people, at random depths of an essay haystack as long as the needle prompts (``--people`` people per prompt,
  real-looking invented names, real city names, 4-digit codes): ``probe_entities`` (multi-entity tracking: each
  person's job and city, one person's city asked), ``probe_instances`` (instance disambiguation: each person's locker
  code, the asked person's changed later in the text; the new code asked, the first one a distractor),
  ``probe_coref`` (coreference: "X grew up by the sea. Years later, she moved to C ..."; where X moved asked: the
  city is bound to X only through the pronoun). SmolLM2-135M with the full cache answers the latter two most of the
  time; multi-entity tracking it answers with another person's city at 4 people (0 of 7 tried), so the recorded runs
  leave it out (``--tasks``).

Per setting and task: values found, and of the values the full cache finds, how many the setting finds too
(``kept_of_full``); per request and averaged: the achieved ratio, the global eviction ratio (prompt tokens evicted
from every KV head of every layer, as the plugin reports it), the paper's task-aware GER (the share of the asked
value's tokens evicted from every head: its Section 5.1 restricted to T_ans), its per-layer counterpart
(``answer_layer_ger``: the share of the value's tokens no head of a layer keeps, averaged over layers) and head
consensus (``rcstat_vllm.scoring.selection.head_consensus``: mean pairwise overlap of a layer's heads' kept sets);
per setting, what it wrote in place of each value it lost (``loss_kinds``: ``route_losses.py``).
Several seeds: ``--seeds``; ``--tuning-seeds`` splits the summary into the prompts that chose a rule and the held-out
rest. ``--write-prompts`` writes the prompts for ``kvpress_reference.py`` (kvpress's presses on the same prompts).
Each prompt is prefilled once and scored once per scorer configuration (settings that differ only in selection share
the scores); every setting's selection runs on its scores, then decodes greedily, stopping once every asked value
is in the output for good (``settled``).

    python benchmarks/routes.py --seed 5 --json benchmarks/results/routes_seed5_cpu.json
    python benchmarks/routes.py --seeds 5 6 7 --tuning-seeds 5 --tasks niah_single niah_multi niah_multikey \\
        niah_multivalue probe_instances probe_coref --probes 3 --probe-lengths 1024 --ratios --floors \\
        --default-floors --extra 'rc_r0.8_cf0.5={"method": "rc", "target_ratio": 0.8, "coverage_floor": 0.5}' ...
"""

from __future__ import annotations

import argparse
import json
import random
import re
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
import result_files
import route_losses
from common import environment, load_avg, resolved_config, write_report

from rcstat_vllm.config import RCStatConfig
from rcstat_vllm.scoring.selection import head_consensus
from rcstat_vllm.settings import scorer_options, window_queries

RESULTS_DIR = Path(__file__).resolve().parent / "results"
NEEDLE_FAMILIES = ("niah_single", "niah_multi", "niah_multikey", "niah_multivalue")
PROBES = ("probe_entities", "probe_instances", "probe_coref")

FIRST_NAMES = [
    "Nora",
    "Tomas",
    "Elena",
    "Marcus",
    "Ingrid",
    "Pavel",
    "Sofia",
    "Daniel",
    "Amira",
    "Jonas",
    "Clara",
    "Victor",
    "Hanna",
    "Felix",
    "Greta",
    "Oscar",
    "Lucia",
    "Anton",
    "Maya",
    "Henrik",
    "Rosa",
    "Emil",
    "Julia",
    "Stefan",
]
SURNAMES = [
    "Lindqvist",
    "Moreau",
    "Kowalski",
    "Brennan",
    "Castillo",
    "Novak",
    "Halvorsen",
    "Okafor",
    "Bauer",
    "Lombardi",
    "Sato",
    "Fischer",
    "Duarte",
    "Keller",
    "Andersen",
    "Petrov",
    "Whitaker",
    "Romano",
    "Haas",
    "Jansen",
]
CITIES = [
    "Porto",
    "Lyon",
    "Krakow",
    "Dublin",
    "Seville",
    "Bergen",
    "Turin",
    "Leipzig",
    "Utrecht",
    "Tampere",
    "Graz",
    "Bruges",
    "Malmo",
    "Valencia",
    "Gdansk",
    "Bologna",
    "Aarhus",
    "Basel",
    "Nantes",
    "Brno",
]
JOBS = ["baker", "pilot", "nurse", "carpenter", "chemist", "librarian", "tailor", "surveyor"]


def _people(rng: random.Random, count: int) -> list[dict]:
    """``count`` people with distinct first names, surnames, cities and codes (real-looking, invented pairs)."""
    codes = rng.sample(range(1000, 10000), 2 * count)
    return [
        {
            "name": f"{first} {last}",
            "city": city,
            "job": rng.choice(JOBS),
            "code": str(codes[2 * i]),
            "code2": str(codes[2 * i + 1]),
            "pronoun": rng.choice(["he", "she"]),
        }
        for i, (first, last, city) in enumerate(
            zip(rng.sample(FIRST_NAMES, count), rng.sample(SURNAMES, count), rng.sample(CITIES, count))
        )
    ]


def probe_sample(
    tokenizer, task: str, rng: random.Random, sample_id: str, length: int = 1024, count: int = 4
) -> data.Sample:
    """One probe prompt (see the module doc): ``count`` people's records at random depths of an essay haystack of
    about ``length`` tokens (``data.Haystack``, as the needles), one person asked about."""
    people = _people(rng, count)
    asked = rng.randrange(count)
    person = people[asked]
    depths = [rng.uniform(0.05, 0.95) for _ in people]
    if task == "probe_entities":
        facts = [f"{p['name']} is a {p['job']} who lives in {p['city']}." for p in people]
        question = f"Where does {person['name']} live?"
        prefix = f"{person['name']} lives in"
        answer, distractors = person["city"], [p["city"] for p in people if p is not person]
    elif task == "probe_instances":
        facts = [f"{p['name']}'s locker code is {p['code']}." for p in people]
        depths[asked] = rng.uniform(0.05, 0.5)
        facts.append(f"Later, {person['name']}'s locker code was changed to {person['code2']}.")
        depths.append(rng.uniform(depths[asked] + 0.2, 0.95))
        question = f"{person['name']}'s locker code was changed. What is the new locker code?"
        prefix = f"{person['name']}'s new locker code is"
        answer, distractors = person["code2"], [p["code"] for p in people]
    elif task == "probe_coref":
        facts = [
            f"{p['name']} grew up by the sea. Years later, {p['pronoun']} moved to {p['city']} to work as a {p['job']}."
            for p in people
        ]
        question = f"Where did {person['name']} move to?"
        prefix = f"{person['name']} moved to"
        answer, distractors = person["city"], [p["city"] for p in people if p is not person]
    else:
        raise ValueError(f"unknown probe {task!r}")

    def build(sentences, counts):
        context = " ".join(data.insert_at_depths(sentences, counts, list(zip(depths, facts))))
        user = (
            "Some facts about people are hidden within the following text. Make sure to memorize them. I will "
            f"quiz you about them afterwards.\n{context}\n{question}"
        )
        return data.chat_prompt(tokenizer, user, prefix), context

    haystack = data.Haystack(tokenizer, rng)
    text, _context, _n, names, _ = data._fit_context(tokenizer, build, length, haystack, rng.randrange(0, 2000))
    return data.Sample(
        task=task,
        sample_id=sample_id,
        prompt=text,
        prompt_ids=data.encode(tokenizer, text),
        answers=[answer],
        max_new_tokens=16,
        meta={
            "asked_index": asked,
            "people": count,
            "depths": depths,
            "facts": facts,
            "distractors": distractors,
            "essays": sorted(names),
        },
    )


def build_probes(tokenizer, seed: int, per_task: int, count: int, lengths: list[int]) -> list[data.Sample]:
    samples = []
    for task in PROBES:
        for i in range(per_task):
            length = lengths[i % len(lengths)]
            rng = random.Random(f"{seed}-{task}-{i}")
            samples.append(probe_sample(tokenizer, task, rng, f"{task}-{length}-{i}", length, count))
    return samples


def answer_token_positions(tokenizer, sample: data.Sample) -> list[int]:
    """Prompt token positions of the asked values' characters (their first occurrence in the prompt's context)."""
    return token_positions(tokenizer, sample, sample.answers)


def token_positions(tokenizer, sample: data.Sample, texts: list[str]) -> list[int]:
    """Prompt token positions of each of ``texts``' characters (its first occurrence in the prompt); none when the
    prompt's text does not tokenize back to its ids."""
    enc = tokenizer(sample.prompt, add_special_tokens=False, return_offsets_mapping=True)
    if enc["input_ids"] != sample.prompt_ids:
        return []
    positions: set[int] = set()
    for text in texts:
        start = sample.prompt.find(text)
        if start < 0:
            continue
        end = start + len(text)
        positions.update(i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < end and b > start)
    return sorted(positions)


def settings_for(
    ratios: list[float], floors: list[float], default_floors: list[float], extra: list[str] = ()
) -> list[methods.Setting]:
    """The full cache, the bare flag (with each of ``default_floors``), RC with the defaults at each ratio (with each
    of ``floors``), then each of ``extra`` (``label=JSON``: the per-request override of a setting of its own)."""
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
    out += [methods.extra_setting(spec) for spec in extra]
    labels = [s.label for s in out]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"settings' labels repeat: {labels}")
    return out


def settled(answers: list[str], text: str) -> bool:
    """Whether ``text`` holds every answer as a whole word followed by another character: appending tokens cannot
    change :func:`data.found_answers` any more (a match at the very end could still grow into a longer word)."""
    return all(re.search(rf"(?<![0-9A-Za-z]){re.escape(a)}(?=[^0-9A-Za-z])", text) for a in answers)


def scoring_key(config: RCStatConfig) -> tuple:
    """What a setting's scores depend on: its method, its scorer's options and the queries it observes (settings
    equal in these differ only in selection and share one scoring of a prompt)."""
    return (config.method, window_queries(config), tuple(sorted(scorer_options(config).items())))


def evaluate(ref, tokenizer, sample: data.Sample, settings: list[methods.Setting]) -> list[dict]:
    """Every setting's row for one prompt. Decoding stops early once every value is :func:`settled` (what is found
    is then final; ``output`` is cut there)."""
    prefill = ref.prefill(sample.prompt_ids)
    n = prefill.n
    answer_pos = answer_token_positions(tokenizer, sample)

    def stop(tokens: list[int]) -> bool:
        return settled(sample.answers, tokenizer.decode(tokens, skip_special_tokens=True))

    cache: dict = {}  # scorer (method, options) -> the layers' scores: settings that score alike share them
    rows = []
    for setting in settings:
        config = RCStatConfig().merged(setting.rcstat)
        row: dict = {"sample": sample.sample_id, "task": sample.task, "label": setting.label, "n": n}
        masks = None
        if config.enabled:
            key = scoring_key(config)
            if key not in cache:
                t0 = time.perf_counter()
                cache[key] = ref_lib.score_layers(prefill, config)
                row["score_s"] = time.perf_counter() - t0
            scores = cache[key]
            t0 = time.perf_counter()
            keep = ref_lib.select_layers(scores, config)
            row["select_s"] = time.perf_counter() - t0
            masks = keep.masks
            visible = torch.stack([m.any(dim=0) for m in masks]).any(dim=0)  # [n]
            row["ratio"] = keep.ratio
            row["global_eviction_ratio"] = float((~visible).float().mean())
            row["answer_ger"] = float((~visible[answer_pos]).float().mean()) if answer_pos else None
            if answer_pos:
                # Per layer, the share of the answer's tokens no head of that layer keeps (a layer-level GER).
                per_layer = torch.stack([~m[:, answer_pos].any(dim=0) for m in masks]).float().mean(dim=1)
                row["answer_layer_ger"] = float(per_layer.mean())
            row["head_consensus"] = float(head_consensus(masks, config.window, config.sink_tokens))
        t0 = time.perf_counter()
        tokens = ref.greedy(prefill, sample.max_new_tokens, masks=masks, stop=stop)
        row["decode_s"] = time.perf_counter() - t0
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        row["output"] = text
        row["found"] = data.found_answers(sample, text)
        rows.append(row)
    return rows


METRICS = ("ratio", "global_eviction_ratio", "answer_ger", "answer_layer_ger", "head_consensus")


def summarize(rows: list[dict], settings: list[methods.Setting]) -> dict:
    full = {r["sample"]: r["found"] for r in rows if r["label"] == "full"}
    out: dict = {}
    for setting in settings:
        mine = [r for r in rows if r["label"] == setting.label and r["sample"] in full]
        per_task: dict = {}
        for task in sorted({r["task"] for r in mine}):
            task_rows = [r for r in mine if r["task"] == task]
            found = sum(sum(r["found"]) for r in task_rows)
            total = sum(len(r["found"]) for r in task_rows)
            full_found = sum(sum(full[r["sample"]]) for r in task_rows)
            kept = sum(sum(a and b for a, b in zip(full[r["sample"]], r["found"])) for r in task_rows)
            # gained: values found that the full cache misses ("kept" counts a value found in place of another as
            # lost, so a family the full cache itself half answers shows swaps as losses)
            entry = {"values": total, "found": found, "full_found": full_found, "kept_of_full": kept}
            entry["gained"] = found - kept
            for key in METRICS:
                vals = [r[key] for r in task_rows if r.get(key) is not None]
                if vals:
                    entry[key] = statistics.fmean(vals)
            per_task[task] = entry
        groups = {"needles": NEEDLE_FAMILIES, "probes": PROBES, "all": (*NEEDLE_FAMILIES, *PROBES)}
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
                    "gained": sum(p["gained"] for p in parts),
                }
        mean = {}
        for key in (*METRICS, "select_s", "decode_s"):
            vals = [r[key] for r in mine if r.get(key) is not None]
            if vals:
                mean[key] = statistics.fmean(vals)
        out[setting.label] = {"per_task": per_task, "totals": totals, "mean": mean}
    return out


def split_summaries(rows: list[dict], settings: list[methods.Setting], tuning_seeds: list[int]) -> dict:
    """The summary over every prompt, over the tuning seeds' prompts and over the held-out seeds' (``seed`` of a
    row)."""
    out = {"all": summarize(rows, settings)}
    if tuning_seeds:
        out["tuning"] = summarize([r for r in rows if r["seed"] in tuning_seeds], settings)
        held = [r for r in rows if r["seed"] not in tuning_seeds]
        if held:
            out["heldout"] = summarize(held, settings)
    return out


def print_table(report: dict) -> None:
    for split, summary in report["summary"].items():
        head = f"{'needles kept':>16} {'probes kept':>12} {'ratio':>6} {'GER':>6} {'ansGER':>7} {'layGER':>7}"
        head += f" {'cons':>6}"
        print(f"\n[{split}] {'setting':<26} {head}")
        for label, entry in summary.items():
            cells = []
            for group in ("needles", "probes"):
                t = entry["totals"].get(group)
                cells.append(f"{t['kept_of_full']}/{t['full_found']} +{t['gained']}" if t else "-")
            m = entry["mean"]

            def fmt(key, m=m):
                return f"{m[key]:.3f}" if key in m else "-"

            print(
                f"{'':<{len(split) + 3}}{label:<26} {cells[0]:>16} {cells[1]:>12} {fmt('ratio'):>6} "
                f"{fmt('global_eviction_ratio'):>6} {fmt('answer_ger'):>7} {fmt('answer_layer_ger'):>7} "
                f"{fmt('head_consensus'):>6}"
            )
    for label, entry in report["summary"]["all"].items():
        tasks = ", ".join(
            f"{t} {e['kept_of_full']}/{e['full_found']} +{e['gained']}" for t, e in entry["per_task"].items()
        )
        print(f"  {label}: {tasks}")


def check_same_prompts(routes_report: dict, kvpress_report: dict) -> None:
    """Both runs must have seen the same prompt under each sample id: an id names a task, seed, length and depth, but
    the text also depends on which lengths the build was asked for (``--lengths 1024`` alone builds other 1k prompts
    than ``--lengths 1024 2048``), so ``--write-prompts`` must be given the routes run's own arguments."""
    mine = {s["sample_id"]: s for s in routes_report.get("samples", [])}
    differ = [
        s["sample_id"]
        for s in kvpress_report["rows"][0]["samples"]
        if s["sample_id"] in mine
        and any(k in s and mine[s["sample_id"]].get(k) != s[k] for k in ("answers", "num_tokens"))
    ]
    if differ:
        raise SystemExit(
            f"{len(differ)} prompts differ between the two runs under the same id ({', '.join(differ[:3])}...): "
            "write the kvpress prompts with the routes run's own --seeds/--tasks/--lengths/--probes"
        )


def side_by_side(routes_report: dict, kvpress_report: dict) -> dict:
    """The routes run's settings and kvpress's presses (``kvpress_reference.py`` on the prompts ``--write-prompts``
    wrote) on the prompts both ran: per setting, the values found and how many of those the full cache found it found
    too, against this run's full cache (``kept_of_full``) and against kvpress's own (``kept_of_kvpress_full``), per
    task and in all."""
    ids = {s["sample_id"] for s in kvpress_report["rows"][0]["samples"]}
    check_same_prompts(routes_report, kvpress_report)
    found: dict[str, dict[str, list[bool]]] = {}
    tasks: dict[str, str] = {}
    evicted: dict[str, list[float]] = {}
    for r in routes_report["rows"]:
        if r["sample"] in ids:
            found.setdefault(r["label"], {})[r["sample"]] = r["found"]
            tasks[r["sample"]] = r["task"]
            if r.get("ratio") is not None:
                evicted.setdefault(r["label"], []).append(r["ratio"])
    for row in kvpress_report["rows"]:
        label = "full" if row["label"] == "full" else f"kvpress_{row['label']}"
        key = "kvpress_full" if label == "full" else label
        found[key] = {o["sample_id"]: o["found"] for o in row["samples"]}
        evicted[key] = [o["evicted"] for o in row["samples"]]
    if "full" not in found:
        raise SystemExit("the routes run holds none of the kvpress run's prompts")
    common = sorted(set.intersection(*(set(f) for f in found.values())))
    out: dict = {"prompts": common, "settings": {}}
    for label, mine in found.items():
        entry: dict = {"per_task": {}}
        for task in [*sorted({tasks[i] for i in common}), "all"]:
            chosen = [i for i in common if task in ("all", tasks[i])]
            cell = {"values": sum(len(mine[i]) for i in chosen), "found": sum(sum(mine[i]) for i in chosen)}
            for name, ref in (("full", found["full"]), ("kvpress_full", found["kvpress_full"])):
                cell[f"{name}_found"] = sum(sum(ref[i]) for i in chosen)
                kept = sum(a and b for i in chosen for a, b in zip(ref[i], mine[i]))
                cell["kept_of_full" if name == "full" else "kept_of_kvpress_full"] = kept
            entry["per_task"][task] = cell
        if evicted.get(label):
            entry["evicted"] = statistics.fmean(evicted[label])
        out["settings"][label] = entry
    return out


def print_side_by_side(report: dict) -> None:
    table = report["side_by_side"]
    print(f"{len(table['prompts'])} prompts both ran")
    for label, entry in table["settings"].items():
        a = entry["per_task"]["all"]
        tasks = ", ".join(
            f"{t} {c['kept_of_full']}/{c['full_found']}" for t, c in entry["per_task"].items() if t != "all"
        )
        print(
            f"{label:<28} kept {a['kept_of_full']}/{a['full_found']} of this full, {a['kept_of_kvpress_full']}/"
            f"{a['kvpress_full_found']} of kvpress's  evicted {entry.get('evicted', 0):.3f}  ({tasks})"
        )


def build_samples(tokenizer, args, seed: int) -> list[data.Sample]:
    needles = [t for t in args.tasks if t in NEEDLE_FAMILIES]
    samples: list[data.Sample] = []
    if needles:
        overrides = {f"{t}_lengths": args.lengths for t in ("niah_multikey", "niah_multivalue")}
        overrides.update({f"{t}_depths": args.depths for t in ("niah_multikey", "niah_multivalue")})
        samples += data.build_suite(
            tokenizer,
            "default",
            seed=seed,
            tasks=needles,
            niah_lengths=args.lengths,
            niah_depths=args.depths,
            niah_multi_lengths=args.lengths,
            niah_multi_depths=args.depths,
            progress=False,
            **overrides,
        )
    probes = [t for t in args.tasks if t in PROBES]
    samples += [
        s
        for s in build_probes(tokenizer, seed, args.probes, args.people, args.probe_lengths or args.lengths)
        if s.task in probes
    ]
    for s in samples:
        s.sample_id = f"s{seed}-{s.sample_id}"
        s.meta["seed"] = seed
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=5, help="prompts' seed (the needle benchmarks use 0-3, 7, 11, 17)")
    parser.add_argument("--seeds", type=int, nargs="*", default=None, help="several seeds (overrides --seed)")
    parser.add_argument(
        "--tuning-seeds", type=int, nargs="*", default=[], help="seeds whose prompts choose; the rest are held out"
    )
    parser.add_argument("--ratios", type=float, nargs="*", default=[0.8, 0.9])
    parser.add_argument("--floors", type=float, nargs="*", default=[0.5, 1.0], help="coverage floors at --ratios")
    parser.add_argument("--default-floors", type=float, nargs="*", default=[0.5], help="... and at the bare flag")
    parser.add_argument(
        "--extra", nargs="*", default=[], help="more settings, each label=JSON override ('x={\"target_ratio\": 0.8}')"
    )
    parser.add_argument("--tasks", nargs="*", default=[*NEEDLE_FAMILIES, *PROBES])
    parser.add_argument("--lengths", type=int, nargs="*", default=[1024, 2048], help="needle prompts' lengths")
    parser.add_argument("--depths", type=float, nargs="*", default=[0.25, 0.75], help="needle depths")
    parser.add_argument("--probes", type=int, default=4, help="prompts per probe task")
    parser.add_argument("--people", type=int, default=4, help="people per probe prompt")
    parser.add_argument("--probe-lengths", type=int, nargs="*", default=None, help="(default: --lengths)")
    parser.add_argument("--max-samples", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--write-prompts", default=None, help="write the prompts (with ids) as JSON and stop")
    parser.add_argument(
        "--side-by-side",
        nargs=2,
        metavar=("ROUTES_JSON", "KVPRESS_JSON"),
        default=None,
        help="write (--json) this run's settings beside kvpress's presses on the prompts both ran, and stop",
    )
    parser.add_argument("--json", default=None, help="output (default benchmarks/results/routes_seed<seed>_cpu.json)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    seeds = args.seeds or [args.seed]
    if args.side_by_side:
        routes_path, kvpress_path = map(Path, args.side_by_side)
        report = {
            "benchmark": "routes_side_by_side",
            "sources": {"routes": routes_path.name, "kvpress": kvpress_path.name},
            "side_by_side": side_by_side(result_files.read(routes_path), result_files.read(kvpress_path)),
        }
        write_report(report, Path(args.json or RESULTS_DIR / "routes_side_by_side_cpu.json"), print_side_by_side)
        return 0
    tokenizer = data.load_tokenizer()
    samples = [s for seed in seeds for s in build_samples(tokenizer, args, seed)]
    if args.max_samples:
        samples = samples[: args.max_samples]
    if args.write_prompts:
        Path(args.write_prompts).write_text(json.dumps({"samples": [s.to_dict(with_ids=True) for s in samples]}))
        print(f"{len(samples)} prompts -> {args.write_prompts}")
        return 0
    settings = settings_for(args.ratios, args.floors, args.default_floors, args.extra)
    ref = ref_lib.ReferenceModel()
    rows: list[dict] = []
    started = time.time()
    load_before = load_avg()
    name = f"seed{seeds[0]}" if len(seeds) == 1 else "seeds" + "_".join(map(str, seeds))
    out = Path(args.json) if args.json else RESULTS_DIR / f"routes_{name}_cpu.json"

    sample_dicts = [s.to_dict() for s in samples]

    def report(done: bool) -> dict:
        return {
            "benchmark": "routes",
            "environment": environment(load_avg_before=load_before, load_avg_after=load_avg()),
            "seeds": seeds,
            "tuning_seeds": args.tuning_seeds,
            "complete": done,
            "path": "transformers reference (hf_reference.py)",
            "dtype": "float32",
            "settings": [
                {**s.to_dict(), "resolved": resolved_config(None, s.rcstat) if s.rcstat else {}} for s in settings
            ],
            "samples": sample_dicts,
            "rows": rows,
            "summary": split_summaries(rows, settings, args.tuning_seeds),
            "loss_kinds": route_losses.count(
                route_losses.losses({"samples": sample_dicts, "rows": rows}),
                [s.label for s in settings if s.label != "full"],
            ),
            "wall_s": time.time() - started,
        }

    for i, sample in enumerate(tqdm(samples, desc="prompts")):
        rows += [{**r, "seed": sample.meta["seed"]} for r in evaluate(ref, tokenizer, sample, settings)]
        if i % 4 == 3 and i + 1 < len(samples):  # a run cut short still leaves its prompts so far
            write_report(report(False), out, lambda _report: None)
    write_report(report(True), out, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
