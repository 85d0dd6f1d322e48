#!/usr/bin/env python3
"""Which plan a lent GPU window runs next (issue 51), decided from the committed result files alone.

Reads ``benchmarks/results/*_h100.json`` and ``*_h200.json`` by their content (``check``, ``tag``, ``ok``, per-case
and per-run flags, ``dry_run``, the device in ``environment``; file names are not trusted beyond the device suffix),
and picks the first plan not yet done:

1. ``first``: ``check compress`` (RC 0.8, bare flag, method none; eager; blocks freed measured = predicted, Triton
   kernels on the live path, blocks returned) and ``throughput --tag first`` (vanilla vs bare flag, eager, the
   KV-bound workload), each done once on any device; while ``first`` is owed, the kernel checks fill what is left
   of the window.
2. ``defaults``: ``throughput --tag defaults`` at vLLM's defaults (no ``enforce_eager``), rows in the order of what
   they answer (:data:`DEFAULTS_ROWS`), one round; rows of this window's device already measured are not run again
   (the committed file is copied into ``$RCSTAT_RESULTS``, where ``throughput.py`` resumes its plan).
3. ``serving``: ``check serving`` (``vllm bench serve`` against ``vllm serve``, vLLM's defaults: graphs), rows in the
   order of :data:`SERVING_ROWS`; done when one device's ``serving`` file of that mode has every row ok with each of
   its bench runs complete (:func:`serving_row_done`); rows of this window's device already measured are not run
   again (the committed file is seeded, as for the defaults). Skipped while ``tools/gpu/check_serving.py`` does not
   exist (the decision says so).
4. ``kernels``: every part of ``check kernels``.
5. ``defaults2``: the defaults plan with a second round (``--rounds 2``), then ``done``.

Steps are what ``tools/gpu/window.sh run`` executes, one after the other, each bounded by ``cap_s`` and by what is left
of the call's budget; ``%L-N%`` in an argument is the step's limit minus N seconds. Stdlib only: it runs on the GPU
image too.

    python3 tools/gpu/window_plan.py                    # prints the decision (device: nvidia-smi's, else "cuda")
    python3 tools/gpu/window_plan.py --device h200 --json plan.json --seed-into /tmp/rcstat-results --steps
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO / "benchmarks"))

import result_files  # noqa: E402  (standard library only, as this script)

DEVICES = ("h100", "h200")

#: The KV-bound workload of plans first and defaults (16 x 4-8k random ids + 512 out, a pool for 4 of them)
WORKLOAD = ["--requests", "16", "--min-len", "4096", "--max-len", "8192", "--max-tokens", "512", "--fit", "4"]
#: The first plan's compress cases and throughput settings
COMPRESS_CASES = ("rc0.8", "bare", "none")
FIRST_SETTINGS = ("vanilla", "bare")
#: The defaults plan's rows (tools/gpu/gpu_common.py SETTINGS), first what the issue's targets ask: vanilla at its
#: defaults; the bare flag against it (>= 1.1x); vanilla with async scheduling off and PIECEWISE graphs (what the
#: plugin changes, isolated); RC 0.8 (>= 2x); method none (within 3%); TOVA 0.8; then issue 53's: full decode
#: graphs (RC 0.8, none) and the bare flag with async scheduling kept.
DEFAULTS_ROWS = (
    "vanilla",
    "bare",
    "vanilla-piecewise",
    "rc0.8",
    "none",
    "tova0.8",
    "rc0.8-graphs",
    "none-graphs",
    "bare-async",
)
#: The serving plan's rows (tools/gpu/check_serving.py ROWS), in the order of what they answer: vanilla at saturation
#: and half of it, the bare flag against it (window-3 targets), long outputs vanilla vs decode_budget 1024, RC 0.8.
SERVING_ROWS = ("sat:vanilla", "sat:bare", "long:vanilla", "long:decode1024", "sat:rc0.8")
SERVING_MODE = "graphs"
#: The bench runs each kind of serving row holds: saturation and half of vanilla's saturation rate; the long run
SERVING_RUNS = {"sat": ("sat", "half"), "long": ("long",)}
KERNEL_PARTS = ("live_path", "decode_speed", "kernels", "bench", "pytest")
#: Seconds a step may take at most (the call's budget cuts it further); "the rest" is 10000
CAPS = {"compress": 180, "throughput_first": 10000, "kernels": 10000, "defaults": 10000, "serving": 10000}
PLANS = ("first", "defaults", "serving", "kernels", "defaults2")


def device_tag(name: str | None) -> str | None:
    """``h100``/``h200`` from a device name ("NVIDIA H200", "NVIDIA H100 80GB HBM3"), else None."""
    for tag in DEVICES:
        if name and tag.upper() in name.upper():
            return tag
    return None


def detect_device() -> str:
    """This machine's GPU as a tag (nvidia-smi), or ``cuda`` when there is none (a dry run)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "cuda"
    return device_tag(out) or "cuda"


def is_dry(result: dict) -> bool:
    runs = result.get("runs") if isinstance(result.get("runs"), list) else []
    return bool(result.get("dry_run")) or any(isinstance(r, dict) and r.get("dry_run") for r in runs)


def load_results(folder: Path) -> list[dict]:
    """Every ``*_h100.json`` / ``*_h200.json`` (or ``.json.gz``) that is a measurement: ``{"path", "device",
    "result"}``; dry runs and results whose own device is not that kind are left out."""
    found = []
    for path in result_files.all_results(folder):  # (large results are stored gzipped)
        match = re.search(r"_(h100|h200)\.json(\.gz)?$", path.name)
        if not match:
            continue
        try:
            result = result_files.read(path)
        except (OSError, ValueError):
            continue
        if not isinstance(result, dict) or is_dry(result):
            continue
        named = (result.get("environment") or {}).get("device")
        device = device_tag(named) if named else match.group(1)
        if device is None:  # e.g. "no CUDA device visible to torch"
            continue
        found.append({"path": path, "device": device, "result": result})
    return found


def case_fault(name: str, case: dict) -> str | None:
    """What keeps one compress case from counting, or None."""
    if case.get("error"):
        return str(case["error"])[:200]
    measured = case.get("measured_blocks_freed")
    if name != "none" and (measured is None or measured != case.get("predicted_blocks_freed")):
        return f"blocks freed {case.get('measured_blocks_freed')}, predicted {case.get('predicted_blocks_freed')}"
    if name == "rc0.8" and not case.get("triton_live_path"):
        return f"Triton kernels not on the live path ({case.get('kernel_launches')})"
    if not case.get("blocks_returned"):
        return "blocks not returned at the end"
    if not case.get("ok"):
        return "not ok"
    return None


def compress_done(result: dict) -> tuple[bool, str]:
    """check compress answered the first plan: eager, its three cases each ok (blocks freed measured = predicted for
    the compressing ones, Triton on the live path for RC, blocks returned), no leak."""
    if result.get("graphs"):
        return False, "ran with CUDA graphs (the first plan's is eager)"
    cases = result.get("cases") or {}
    missing = [c for c in COMPRESS_CASES if c not in cases]
    if missing:
        return False, f"cases missing: {missing}" + (f" ({str(result.get('error'))[:200]})" if not cases else "")
    bad = {name: fault for name in COMPRESS_CASES if (fault := case_fault(name, cases[name]))}
    if bad:
        return False, f"cases failed: {bad}"
    if not result.get("no_leak"):
        return False, "blocks leaked"
    return True, "ok"


def ok_runs(result: dict) -> set[tuple[str, int]]:
    return {
        (r["setting"], int(r["round"]))
        for r in result.get("runs") or []
        if isinstance(r, dict) and r.get("ok") and "setting" in r and "round" in r
    }


def throughput_files(results: list[dict], tag: str, mode: str) -> list[dict]:
    return [
        f
        for f in results
        if f["result"].get("check") == "throughput"
        and f["result"].get("tag") == tag
        and (f["result"].get("workload") or {}).get("mode") == mode
    ]


def first_status(results: list[dict]) -> dict:
    """Per item of the first plan: done (where), or what its latest attempt said."""
    status: dict[str, dict] = {}
    attempts = [f for f in results if f["result"].get("check") == "compress"]
    done = []
    for f in attempts:
        if compress_done(f["result"])[0]:
            done.append(f)
    status["compress"] = {"done": bool(done), "files": [f["path"].name for f in attempts]}
    if done:
        status["compress"]["done_in"] = done[0]["path"].name
    elif attempts:
        status["compress"]["last"] = compress_done(attempts[-1]["result"])[1]
    attempts = throughput_files(results, "first", "eager")
    done = [f for f in attempts if {(s, 1) for s in FIRST_SETTINGS} <= ok_runs(f["result"])]
    status["throughput_first"] = {"done": bool(done), "files": [f["path"].name for f in attempts]}
    if done:
        status["throughput_first"]["done_in"] = done[0]["path"].name
    elif attempts:
        status["throughput_first"]["last"] = str(attempts[-1]["result"].get("headline"))[:300]
    return status


def kernels_status(results: list[dict]) -> dict:
    attempts = [f for f in results if f["result"].get("check") == "kernels"]
    done = [
        f
        for f in attempts
        if f["result"].get("ok") and all((f["result"].get("parts") or {}).get(p, {}).get("ok") for p in KERNEL_PARTS)
    ]
    status = {"done": bool(done), "files": [f["path"].name for f in attempts]}
    if done:
        status["done_in"] = done[0]["path"].name
    elif attempts:
        last = attempts[-1]["result"]
        status["last"] = str(last.get("headline") or last.get("error"))[:300]
    return status


def defaults_status(results: list[dict], rounds: int) -> dict:
    """Per device: the defaults file with the most rows measured, and the (round, row) pairs it still owes."""
    per_device = {}
    for f in throughput_files(results, "defaults", "graphs"):
        runs = ok_runs(f["result"])
        best = per_device.get(f["device"])
        if best is None or len(runs) > len(best["runs"]):
            per_device[f["device"]] = {"file": f["path"], "runs": runs}
    out: dict[str, dict] = {}
    for device, entry in per_device.items():
        owed = [f"r{k}:{row}" for k in range(1, rounds + 1) for row in DEFAULTS_ROWS if (row, k) not in entry["runs"]]
        out[device] = {"file": entry["file"].name, "path": str(entry["file"]), "remaining": owed}
    return out


def serving_row_done(run: dict) -> bool:
    """A serving row counts when it says ok and each of its bench runs completed every request, none failed, with
    a request rate and TTFT/ITL percentiles measured."""
    if not (isinstance(run, dict) and run.get("ok") and run.get("row") in SERVING_ROWS):
        return False
    for name in SERVING_RUNS[run["row"].split(":")[0]]:
        bench = run.get(name) or {}
        if not (bench.get("ok") and bench.get("completed") and not bench.get("failed")):
            return False
        if not all(bench.get(k) for k in ("request_throughput", "p99_ttft_ms", "p99_itl_ms")):
            return False
    return True


def serving_status(results: list[dict]) -> dict:
    """Per device: the serving file (mode :data:`SERVING_MODE`) with the most rows done, and the rows it still owes."""
    per_device: dict[str, dict] = {}
    for f in results:
        r = f["result"]
        if r.get("check") != "serving" or (r.get("workload") or {}).get("mode") != SERVING_MODE:
            continue
        rows = {run["row"] for run in r.get("runs") or [] if serving_row_done(run)}
        best = per_device.get(f["device"])
        if best is None or len(rows) > len(best["rows"]):
            per_device[f["device"]] = {"file": f["path"], "rows": rows}
    return {
        device: {
            "file": entry["file"].name,
            "path": str(entry["file"]),
            "remaining": [row for row in SERVING_ROWS if row not in entry["rows"]],
        }
        for device, entry in per_device.items()
    }


def serving_step() -> dict:
    return {
        "name": "serving",
        "cap_s": CAPS["serving"],
        "glob": "serving_*.json",
        "args": ["serving", "--mode", SERVING_MODE, "--rows", ",".join(SERVING_ROWS), "--budget-s", "%L-15%"],
    }


def arg_list(*parts) -> list[str]:
    return [str(p) for p in parts]


def throughput_step(tag: str, settings, rounds: int, mode: str, fresh: bool) -> dict:
    args = arg_list("throughput", "--tag", tag, "--settings", ",".join(settings), "--rounds", rounds, *WORKLOAD)
    args += ["--mode", mode, *(["--fresh"] if fresh else []), "--budget-s", "%L-15%", "--run-timeout", "%L-30%"]
    cap = CAPS["throughput_first" if tag == "first" else "defaults"]
    return {"name": f"throughput_{tag}", "cap_s": cap, "glob": f"throughput_{tag}_*.json", "args": args}


def kernels_step() -> dict:
    return {
        "name": "kernels",
        "cap_s": CAPS["kernels"],
        "glob": "kernels.json",
        "args": ["kernels", "--parts", ",".join(KERNEL_PARTS), "--timeout", "150"],
    }


def decide(folder: Path, device: str, serving_script: Path | None = None) -> dict:
    """The next plan for a window on ``device`` and the steps it runs."""
    results = load_results(folder)
    serving_script = serving_script or REPO / "tools" / "gpu" / "check_serving.py"
    first = first_status(results)
    kernels = kernels_status(results)
    defaults1 = defaults_status(results, rounds=1)
    defaults2 = defaults_status(results, rounds=2)
    serving = serving_status(results)
    status = {
        "first": first,
        "defaults": defaults1,
        "serving": {
            "done": any(not entry["remaining"] for entry in serving.values()),
            "built": serving_script.exists(),
            "by_device": serving,
            "files": [f["path"].name for f in results if f["result"].get("check") == "serving"],
        },
        "kernels": kernels,
        "defaults2": defaults2,
    }
    decision: dict = {
        "check": "window_plan",
        "device": device,
        "results_folder": str(folder),
        "files_read": [f["path"].name for f in results],
        "status": status,
        "skipped_plans": [],
        "steps": [],
    }

    def defaults_plan(name: str, rounds: int, by_device: dict) -> dict | None:
        if any(not entry["remaining"] for entry in by_device.values()):
            return None  # done on some device
        mine = by_device.get(device)
        remaining = (
            mine["remaining"] if mine else [f"r{k}:{row}" for k in range(1, rounds + 1) for row in DEFAULTS_ROWS]
        )
        why = (
            f"{len(remaining)} rows owed on {device} ({mine['file']})"
            if mine
            else f"no defaults rows measured on {device} yet"
            + (f" (partial on {sorted(by_device)}: rows compare within a device)" if by_device else "")
        )
        plan = {"plan": name, "why": why, "remaining_rows": remaining}
        plan["steps"] = [throughput_step("defaults", DEFAULTS_ROWS, rounds, "graphs", fresh=False)]
        if mine:
            plan["seed"] = {"from": mine["path"], "as": f"throughput_defaults_{device}.json"}
        return plan

    chosen = None
    if not (first["compress"]["done"] and first["throughput_first"]["done"]):
        owed = [k for k in ("compress", "throughput_first") if not first[k]["done"]]
        steps = []
        if not first["compress"]["done"]:
            steps.append(
                {
                    "name": "compress",
                    "cap_s": CAPS["compress"],
                    "glob": "compress.json",
                    "args": ["compress", "--cases", ",".join(COMPRESS_CASES), "--timeout", "%L-25%"],
                }
            )
        if not first["throughput_first"]["done"]:
            steps.append(throughput_step("first", FIRST_SETTINGS, 1, "eager", fresh=True))
        if not kernels["done"]:
            steps.append(kernels_step())  # what is left of the window: the kernel checks
        chosen = {"plan": "first", "why": f"owed: {owed}", "steps": steps}
    if chosen is None:
        chosen = defaults_plan("defaults", 1, defaults1)
    if chosen is None and not status["serving"]["done"]:
        if serving_script.exists():
            mine = serving.get(device)
            remaining = mine["remaining"] if mine else list(SERVING_ROWS)
            chosen = {
                "plan": "serving",
                "why": f"{len(remaining)} serving rows owed on {device}"
                + (f" ({mine['file']})" if mine else " (none measured on it yet)")
                + (f" (partial on {sorted(serving)}: rows compare within a device)" if serving and not mine else ""),
                "remaining_rows": remaining,
                "steps": [serving_step()],
            }
            if mine:
                chosen["seed"] = {"from": mine["path"], "as": f"serving_{SERVING_MODE}_{device}.json"}
        else:
            decision["skipped_plans"].append(
                {
                    "plan": "serving",
                    "why": f"not built: no {serving_script.name} (the GPU preset of `vllm bench serve` against "
                    "`vllm serve`, issue 51); the next plans go first",
                }
            )
    if chosen is None and not kernels["done"]:
        chosen = {"plan": "kernels", "why": "no complete kernels result yet", "steps": [kernels_step()]}
    if chosen is None:
        chosen = defaults_plan("defaults2", 2, defaults2)
    if chosen is None:
        chosen = {"plan": "done", "why": "every plan has a complete result; nothing owed", "steps": []}
    decision.update(chosen)
    return decision


def ok_count(result: dict) -> int:
    """Runs (throughput) or rows (serving) a result file holds measured."""
    return sum(1 for r in result.get("runs") or [] if isinstance(r, dict) and r.get("ok"))


def seed(decision: dict, folder: Path) -> str | None:
    """Copy the committed file a resumable step continues from into ``folder`` (``$RCSTAT_RESULTS``), unless what is
    there already holds as many measured rows (a second call on the same machine)."""
    entry = decision.get("seed")
    if not entry:
        return None
    target = folder / entry["as"]
    source = Path(entry["from"])
    try:
        have = ok_count(json.loads(target.read_text()))
    except (OSError, ValueError):
        have = -1
    if have >= ok_count(json.loads(source.read_text())):
        return f"kept {target} ({have} rows measured)"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return f"copied {source.name} to {target}"


def describe(decision: dict) -> str:
    lines = [f"plan: {decision['plan']} on {decision['device']}: {decision['why']}"]
    if decision.get("remaining_rows"):
        lines.append(f"  rows owed: {', '.join(decision['remaining_rows'])}")
    for skipped in decision["skipped_plans"]:
        lines.append(f"  skipped {skipped['plan']}: {skipped['why']}")
    for step in decision["steps"]:
        lines.append(f"  step {step['name']} (cap {step['cap_s']} s): check {' '.join(step['args'])}")
    status = decision["status"]
    for item, entry in [*status["first"].items(), ("kernels", status["kernels"])]:
        where = entry.get("done_in") if entry["done"] else entry.get("last", "never ran")
        lines.append(f"  {item}: {'done in' if entry['done'] else 'owed, last attempt:'} {where}")
    serving = status["serving"]
    per_device = "; ".join(f"{d}: {e['file']} owes {e['remaining']}" for d, e in serving["by_device"].items())
    lines.append(f"  serving: {'done' if serving['done'] else 'owed'} ({per_device or 'no serving file'})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(RESULTS), help="the committed results folder")
    parser.add_argument("--device", default="auto", help="this window's device: h100, h200, cuda, or auto")
    parser.add_argument("--json", default=None, help="also write the decision here")
    parser.add_argument("--seed-into", default=None, help="copy the file a resumable step continues from here")
    parser.add_argument("--steps", action="store_true", help="print only the steps, tab-separated, for window.sh")
    args = parser.parse_args(argv)
    device = detect_device() if args.device == "auto" else args.device
    decision = decide(Path(args.results), device)
    if args.seed_into:
        try:
            decision["seeded"] = seed(decision, Path(args.seed_into))
        except (OSError, ValueError) as exc:  # the decision is still written: the step starts its rows afresh
            decision["seeded"] = f"failed: {exc!r}"
    if args.json:
        Path(args.json).write_text(json.dumps(decision, indent=1, default=str))
    if args.steps:
        print(describe(decision), file=sys.stderr)
        for step in decision["steps"]:
            print("\t".join([step["name"], str(step["cap_s"]), step["glob"], " ".join(step["args"])]))
    else:
        print(describe(decision))
    return 0


if __name__ == "__main__":
    sys.exit(main())
