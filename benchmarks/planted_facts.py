"""A cross-check on text and facts the main benchmarks do not use: door codes and passwords planted in Python
standard-library docstrings, asked for at the end, through vLLM with the plugin (one engine, every setting side
by side, greedy). The haystack is read from the installed Python's own modules, so it needs no data files.

Each seed gives 30 prompts: 1000/2000/3000 tokens x 5 depths x 2, half asking for a 6-digit code, half for a
word. Reported per setting: the share of prompts whose answer contains the planted value, and how many of the
prompts the full cache answers the setting answers too.

    .venv/bin/python benchmarks/planted_facts.py --seed 7     # ~3 min; benchmarks/results/planted_facts_seed7_cpu.json
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import data
import methods
from accuracy import engine_kwargs, resolved_config
from common import engine_options, environment, load_avg, write_report

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODULES = [
    "collections",
    "itertools",
    "functools",
    "json",
    "csv",
    "email.message",
    "http.client",
    "argparse",
    "logging",
    "pathlib",
    "shutil",
    "subprocess",
    "threading",
    "asyncio.tasks",
    "decimal",
    "fractions",
    "statistics",
    "textwrap",
    "difflib",
    "sqlite3",
    "zipfile",
    "tarfile",
    "urllib.parse",
    "heapq",
    "bisect",
    "calendar",
    "datetime",
    "string",
    "struct",
    "codecs",
    "unittest.case",
    "doctest",
    "pdb",
    "socket",
]
PLACES = [
    "north annex",
    "copper lab",
    "river depot",
    "glass tower",
    "old mill",
    "harbor office",
    "cedar hall",
    "east hangar",
    "salt warehouse",
    "quarry gate",
    "signal room",
    "orchard shed",
]
WORDS = [
    "Marigold",
    "Tamarind",
    "Obsidian",
    "Halcyon",
    "Juniper",
    "Vermilion",
    "Saffron",
    "Peregrine",
    "Lantern",
    "Cobalt",
    "Mistral",
    "Quartz",
]
#: label -> request override on the bare-flag engine (baselines at kvpress's published defaults).
SETTINGS = {
    "full": {"method": "none"},
    "default": {},
    "rc_r0.5": {"target_ratio": 0.5},
    "rc_r0.8": {"target_ratio": 0.8},
    "rc_paper_r0.5": {**methods.PAPER_RC, "target_ratio": 0.5},
    "tova_r0.5": methods.baseline("tova", 0.5, window=1),
    "snapkv_r0.5": methods.baseline("snapkv", 0.5, window=64),
}


def docstring_paragraphs() -> list[str]:
    """Long prose docstrings (no doctests) of the modules above and their public functions and classes."""
    paragraphs = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        members = [getattr(module, attr) for attr in sorted(dir(module)) if not attr.startswith("_")]
        for obj in [module] + [m for m in members if inspect.isfunction(m) or inspect.isclass(m)]:
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 200 and ">>>" not in doc:
                paragraphs.append(re.sub(r"\s+", " ", doc).strip())
    return list(dict.fromkeys(paragraphs))


def build_prompts(tokenizer, seed: int) -> list[tuple[str, list[int], str]]:
    """(id, prompt token ids, answer) for one seed."""
    rng = random.Random(seed)
    paragraphs = docstring_paragraphs()
    rng.shuffle(paragraphs)
    prompts, cursor = [], 0
    plan = [(length, depth) for length in (1000, 2000, 3000) for depth in (0.1, 0.3, 0.5, 0.7, 0.9)] * 2
    for i, (length, depth) in enumerate(plan):
        place = PLACES[i % len(PLACES)]
        if i % 2 == 0:
            answer = str(rng.randint(100000, 999999))
            fact, question = f"the door code for the {place} is {answer}", f"the door code for the {place}"
            reply = "the code only"
        else:
            answer = WORDS[(i // 2) % len(WORDS)]
            fact, question = f"the password for the {place} is {answer}", f"the password for the {place}"
            reply = "the password only"
        body = []
        while len(data.encode(tokenizer, " ".join(body))) < length:
            body.append(paragraphs[cursor % len(paragraphs)])
            cursor += 1
        # At the paragraph boundary nearest ``depth`` of the documentation's characters.
        ends = [sum(len(p) for p in body[: k + 1]) for k in range(len(body))]
        boundary = min(range(len(body) + 1), key=lambda k: abs((ends[k - 1] if k else 0) - depth * ends[-1]))
        body.insert(boundary, f"Operations memo: {fact}.")
        user = "Read the documentation below.\n\n" + "\n\n".join(body) + f"\n\nWhat is {question}? Reply with {reply}."
        prompts.append((f"{length}-{depth}-{i}", data.encode(tokenizer, data.chat_prompt(tokenizer, user)), answer))
    return prompts


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", default=None, help="default benchmarks/results/planted_facts_seed{seed}_cpu.json")
    args = parser.parse_args(argv)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rcstat_vllm.api import compression_results, match_outputs
    from rcstat_vllm.model import default_model_dir

    t_start, load_start = time.time(), load_avg()
    model_dir = str(default_model_dir())
    prompts = build_prompts(data.load_tokenizer(model_dir), args.seed)
    kwargs = engine_kwargs(model_dir, 4096, 2 << 30)
    llm = LLM(**kwargs)
    jobs = [(pid, ids, answer, label) for pid, ids, answer in prompts for label in SETTINGS]
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=ids) for _, ids, _, _ in jobs],
        [SamplingParams(temperature=0.0, max_tokens=16, extra_args={"rcstat": SETTINGS[label]}) for *_, label in jobs],
    )
    results = match_outputs(outputs, compression_results(llm))
    records = [
        {
            "prompt": pid,
            "setting": label,
            "answer": answer,
            "text": out.outputs[0].text,
            "found": answer.lower() in out.outputs[0].text.lower(),
            "ratio": (res or {}).get("compression_ratio") or 0.0,
        }
        for (pid, _, answer, label), out, res in zip(jobs, outputs, results)
    ]
    full = {r["prompt"] for r in records if r["setting"] == "full" and r["found"]}
    summary = {}
    for label in SETTINGS:
        mine = [r for r in records if r["setting"] == label]
        summary[label] = {
            "rcstat": SETTINGS[label],
            # as it ran: the engine's flag (eager eviction) merged with the override
            "resolved": resolved_config(methods.Setting(label, label, SETTINGS[label])),
            "ratio": sum(r["ratio"] for r in mine) / len(mine),
            "found": sum(r["found"] for r in mine),
            "prompts": len(mine),
            "found_of_full": sum(r["found"] for r in mine if r["prompt"] in full),
            "full": len(full),
        }
    report = {
        "benchmark": "planted_facts",
        "seed": args.seed,
        "settings": SETTINGS,
        "summary": summary,
        "records": records,
        "environment": environment(),
        "engine": engine_options(kwargs),
        "wall_s": round(time.time() - t_start, 1),
        "load_avg": [load_start, load_avg()],
    }

    def table(rep: dict) -> None:
        for label, s in rep["summary"].items():
            print(
                f"{label:14s} evicted {s['ratio']:.2f}  found {s['found']}/{s['prompts']}  "
                f"of the full cache's {s['found_of_full']}/{s['full']}"
            )

    write_report(
        report, Path(args.json) if args.json else RESULTS_DIR / f"planted_facts_seed{args.seed}_cpu.json", table
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
