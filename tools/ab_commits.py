"""Two commits of this repository timed with one benchmark, run after run, alternating, on this machine.

    python tools/ab_commits.py --before 3f93922 --after HEAD --rounds 4 \\
        --out benchmarks/results/NAME.json -- benchmarks/throughput.py --runs vanilla default --repeat 1

A change's cost is measured as a ratio to a baseline in the same run (vanilla in throughput.py), and a shared machine
drifts by more than most changes move that ratio: one run of the "before" code and one of the "after" code, an hour
apart, do not compare. So the benchmark runs ``--rounds`` times on each side, alternating ABBA (before, after, after,
before, ...) so that a drift through the session falls on both sides alike, and the result keeps every run.

Each side runs from a clone of its own (``--scratch``/before, /after) with a copy of this checkout's virtual
environment whose editable install points at that clone. A git worktree with ``PYTHONPATH`` is not enough: the
editable finder maps ``rcstat_vllm.kernels`` and ``rcstat_vllm.patches`` to this checkout's ``kernels/`` and
``patches/`` (they are not folders inside ``rcstat_vllm/``), so such a run would import them from the wrong tree.
Both sides share everything else (vLLM, the embedded model in ``~/.cache``), so only the repository's code differs.

Each run gets ``--json <scratch>/runs/<side>_<k>.json`` appended to the benchmark's arguments. The result
(written with benchmarks/result_files.py) holds both commits, the order, every run's report, and for reports with
ratios to vanilla (throughput.py's and serving.py's ``vs_vanilla``) each side's ratios in run order and their
medians. Give a benchmark that probes its own rate a fixed one (serving.py ``--rates 0.161``, not ``0.5x``), or
each run would measure at a rate of its own.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import result_files  # noqa: E402

SIDES = ("before", "after")
#: The name of setuptools' editable finder module in a venv's site-packages (one per editable project).
FINDER_GLOB = "__editable___rcstat_vllm_*_finder.py"


def abba(rounds: int) -> list[tuple[str, int]]:
    """The runs in order, (side, round): before/after in even rounds, after/before in odd ones."""
    order = []
    for k in range(rounds):
        pair = SIDES if k % 2 == 0 else SIDES[::-1]
        order.extend((side, k) for side in pair)
    return order


def repoint_editable(venv: Path, source: Path, target: Path) -> Path:
    """Rewrite the editable finder in ``venv`` so the packages it maps under ``source`` map under ``target``.

    Raises when the venv holds no such finder, or its mapping names nothing under ``source`` (the copy would still
    import ``source``'s code, which is what an A/B must never do silently)."""
    finders = sorted(venv.glob(f"lib/python*/site-packages/{FINDER_GLOB}"))
    if len(finders) != 1:
        raise SystemExit(f"expected one editable finder ({FINDER_GLOB}) in {venv}, found {len(finders)}")
    text = finders[0].read_text()
    new = text.replace(f"'{source}/", f"'{target}/").replace(f"'{source}'", f"'{target}'")
    if new == text:
        raise SystemExit(f"{finders[0]} maps nothing under {source}: was the venv installed from another checkout?")
    finders[0].write_text(new)
    return finders[0]


def prepare_side(rev: str, dest: Path, venv: Path) -> str:
    """A clone of this repository at ``rev`` in ``dest`` with a repointed copy of ``venv``; returns the full commit."""
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if dest.exists():
        shutil.rmtree(dest)
    subprocess.run(["git", "clone", "--quiet", "--no-checkout", str(REPO), str(dest)], check=True)
    subprocess.run(["git", "-C", str(dest), "checkout", "--quiet", commit], check=True)
    shutil.copytree(venv, dest / ".venv", symlinks=True)
    repoint_editable(dest / ".venv", REPO, dest)
    return commit


def vanilla_ratios(report: dict) -> dict[str, dict[str, float]]:
    """{row: {metric: its value over vanilla's in the same run}}, from the ``vs_vanilla`` the benchmarks record:
    throughput.py's per run (row = run name), serving.py's per setting and rate (row = ``setting@rate``, medians
    of that report's own rounds). Vanilla's own row, all ones, is left out; other reports give {}."""
    rows: dict[str, dict] = {}
    if isinstance(report.get("runs"), dict):
        rows = {name: run.get("vs_vanilla") for name, run in report["runs"].items() if isinstance(run, dict)}
    elif report.get("benchmark") == "serving" and isinstance(report.get("summary"), dict):
        rows = {
            f"{name}@{rate}": per.get("vs_vanilla")
            for name, per_rate in report["summary"].items()
            for rate, per in per_rate.items()
            if isinstance(per, dict)
        }
    return {
        row: {metric: float(value) for metric, value in ratios.items()}
        for row, ratios in rows.items()
        if isinstance(ratios, dict) and not row.startswith("vanilla")
    }


def summarize(runs: list[dict]) -> dict[str, dict[str, dict[str, dict]]]:
    """{side: {row: {metric: {"ratios": [in run order], "median": ...}}}} over ``runs`` ({"side", "report"} each)."""
    out: dict[str, dict[str, dict[str, dict]]] = {}
    for side in SIDES:
        collected: dict[str, dict[str, list[float]]] = {}
        for run in runs:
            if run["side"] != side:
                continue
            for row, ratios in vanilla_ratios(run["report"]).items():
                for metric, ratio in ratios.items():
                    collected.setdefault(row, {}).setdefault(metric, []).append(round(ratio, 4))
        out[side] = {
            row: {m: {"ratios": r, "median": round(statistics.median(r), 4)} for m, r in metrics.items()}
            for row, metrics in collected.items()
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the commit (or any git revision) without the change")
    parser.add_argument("--after", default="HEAD", help="the commit with the change (default HEAD)")
    parser.add_argument("--rounds", type=int, default=4, help="runs per side, alternating ABBA (default 4)")
    parser.add_argument("--out", required=True, help="the result file (benchmarks/results/NAME.json)")
    parser.add_argument(
        "--scratch",
        default="/tmp/rcstat-ab",
        help="where the two clones go: before/ and after/, replaced at the start, left on disk after (~4 GB each)",
    )
    parser.add_argument("--venv", default=str(REPO / ".venv"), help="the virtual environment to copy per side")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the benchmark script and its arguments")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("name the benchmark after --, e.g. -- benchmarks/throughput.py --runs vanilla default")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    scratch = Path(args.scratch)
    revs = dict(zip(SIDES, (args.before, args.after)))
    commits = {side: prepare_side(rev, scratch / side, Path(args.venv)) for side, rev in revs.items()}
    (scratch / "runs").mkdir(parents=True, exist_ok=True)

    runs = []
    started = time.monotonic()
    order = abba(args.rounds)
    for i, (side, k) in enumerate(order, 1):
        tree = scratch / side
        out = scratch / "runs" / f"{side}_{k}.json"
        print(f"[ab] {i}/{len(order)}: {side} ({commits[side][:7]}) round {k + 1}", flush=True)
        t0 = time.monotonic()
        subprocess.run([str(tree / ".venv" / "bin" / "python"), *command, "--json", str(out)], cwd=tree, check=True)
        report = result_files.read(out)
        runs.append({"side": side, "round": k, "wall_s": round(time.monotonic() - t0, 1), "report": report})
        print(f"[ab] {side} round {k + 1}: {vanilla_ratios(report)}", flush=True)

    summary = summarize(runs)
    after_env = next(r["report"].get("environment") for r in runs if r["side"] == "after")
    result = {
        "benchmark": "ab_commits",
        "command": command,
        "commits": commits,
        "order": [f"{side}_{k}" for side, k in order],
        "medians_x_vanilla": summary,
        "runs": runs,
        "wall_s": round(time.monotonic() - started, 1),
        # The machine and the "after" side's commit: the file is made by the change it measures.
        "environment": after_env,
    }
    path = result_files.write(result, args.out)
    for side in SIDES:
        for row, metrics in summary[side].items():
            for metric, s in metrics.items():
                print(f"{side:6} {commits[side][:7]} {row:16} {metric:18} x vanilla {s['ratios']} median {s['median']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
