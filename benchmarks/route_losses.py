"""What a lost value became: each value the full cache finds and a setting does not, in ``routes.py`` results, sorted
by what the setting wrote instead (from the recorded outputs; nothing is run).

* ``near_miss``: the output holds a word that is not the value and shares its first characters (4 digits of a
  7-digit value, 3 letters of a 4-letter city: :func:`near`): the right fact read, copied wrong;
* ``another_value``: no such word, but the output holds another value of the prompt or a near miss of one (another
  asked value, a needle's, a distractor's, another person's city or code): the model read a fact, not this one (a
  list that skips it, a distractor key's value, another person's);
* ``absent``: neither: nothing of the prompt's values in its place.

    python benchmarks/route_losses.py benchmarks/results/routes_issue56_defaults_seeds8_11_cpu.json.gz \\
        --labels rc_r0.8 rc_r0.9 --json benchmarks/results/route_losses_issue56_cpu.json
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import result_files
from common import write_report

KINDS = ("near_miss", "another_value", "absent")
PREFIX = 4  # digits a near miss shares with the value
VALUE = re.compile(r"\d{5,}")  # a needle's value in its text (RULER's values have 7 digits)


def near(value: str, word: str) -> bool:
    """``word`` is ``value`` copied wrong: not equal, and they share their first ``min(PREFIX, len(value) - 1)``
    characters (7-digit values 4 digits, a 4-letter city 3 letters)."""
    k = max(1, min(PREFIX, len(value) - 1))
    return word != value and len(word) >= k and word[:k].lower() == value[:k].lower()


def loss_kind(value: str, output: str, prompt_values: set[str]) -> str:
    """Which of :data:`KINDS` a value the setting lost is, from the setting's output and the prompt's values."""
    words = re.findall(r"\w+", output)
    if any(near(value, word) for word in words):
        return "near_miss"
    others = prompt_values - {value}
    if any(word in others or any(near(other, word) for other in others) for word in words):
        return "another_value"
    return "absent"


def losses(report: dict, labels: list[str] | None = None) -> list[dict]:
    """One row per value the full cache finds and a setting loses (those of ``labels``; every setting when None), in
    one ``routes.py`` report (its ``samples`` and ``rows``)."""
    samples = {s["sample_id"]: s for s in report["samples"]}
    full = {row["sample"]: row["found"] for row in report["rows"] if row["label"] == "full"}
    out = []
    for row in report["rows"]:
        if row["label"] == "full" or row["sample"] not in full or (labels is not None and row["label"] not in labels):
            continue
        sample = samples[row["sample"]]
        meta = sample["meta"]
        texts = meta.get("needles", []) + meta.get("distractors", [])
        prompt_values = {v for text in texts for v in VALUE.findall(text)} | set(meta.get("distractors", []))
        prompt_values |= set(sample["answers"])
        for value, by_full, by_setting in zip(sample["answers"], full[row["sample"]], row["found"]):
            if by_full and not by_setting:
                kind = loss_kind(value, row["output"], prompt_values)
                out.append({"sample": row["sample"], "task": sample["task"], "label": row["label"], "kind": kind})
    return out


def count(rows: list[dict], labels: list[str]) -> dict:
    """``{"kinds": {label: {kind: n}}, "by_task": {label: {task: {kind: n}}}}`` of :func:`losses`' rows."""
    by_kind = Counter((row["label"], row["kind"]) for row in rows)
    by_task = Counter((row["label"], row["task"], row["kind"]) for row in rows)
    return {
        "kinds": {label: {kind: by_kind[(label, kind)] for kind in KINDS} for label in labels},
        "by_task": {
            label: {
                task: {kind: by_task[(label, task, kind)] for kind in KINDS}
                for task in sorted({row["task"] for row in rows if row["label"] == label})
            }
            for label in labels
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="routes.py result files")
    parser.add_argument("--labels", nargs="+", default=["rc_r0.8", "rc_r0.9"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = [row for path in args.results for row in losses(result_files.read(path), args.labels)]
    report = {
        "benchmark": "route_losses",
        "sources": [result_files.base_name(path) for path in args.results],
        "labels": args.labels,
        **count(rows, args.labels),
        "rows": rows,
    }

    def table(r: dict) -> None:
        for label, kinds in r["kinds"].items():
            print(label, kinds, r["by_task"][label])

    if args.json:
        write_report(report, Path(args.json), table)
    else:
        table(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
