"""tools/gpu/window_plan.py (issue 51): which plan a lent GPU window runs next, decided from result files by their
content; and throughput.py resuming the rows the plan left owed (a dry run: no GPU)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_tools import GPU, REPO, load

COMMITTED = REPO / "benchmarks" / "results"


plan = load("window_plan")
NO_SERVING = Path("/nonexistent/check_serving.py")
H200 = {"device": "NVIDIA H200"}
H100 = {"device": "NVIDIA H100 80GB HBM3"}
#: the second window's files as committed (0ca00e8): throughput done, compress failed, kernels timed out
W2_FILES = ("gpu_compress_w2_h200.json", "throughput_first_w2_h200.json", "gpu_kernels_w2_h200.json")


def write(folder: Path, name: str, result: dict) -> Path:
    path = folder / name
    path.write_text(json.dumps(result))
    return path


def good_case(name: str) -> dict:
    freed = 0 if name == "none" else 200
    case = {"ok": True, "blocks_returned": True, "measured_blocks_freed": freed, "predicted_blocks_freed": freed}
    if name == "rc0.8":
        case["triton_live_path"] = True
    return case


def compress(env=H200, **changes) -> dict:
    result = {
        "check": "compress",
        "environment": env,
        "graphs": False,
        "ok": True,
        "no_leak": True,
        "cases": {name: good_case(name) for name in ("rc0.8", "bare", "none")},
    }
    result.update(changes)
    return result


def throughput(tag: str, mode: str, rows, env=H200, **changes) -> dict:
    """rows: (setting, round) pairs measured, or (setting, round, ok)."""
    runs = [{"setting": r[0], "round": r[1], "ok": r[2] if len(r) > 2 else True} for r in rows]
    result = {"check": "throughput", "tag": tag, "workload": {"mode": mode}, "environment": env, "runs": runs}
    result.update(changes)
    return result


def kernels(ok=True, parts=plan.KERNEL_PARTS) -> dict:
    parts = {p: {"ok": ok} for p in parts}
    return {"check": "kernels", "environment": H200, "ok": ok, "parts": parts}


def first_done(folder: Path) -> None:
    for name in W2_FILES:
        shutil.copyfile(COMMITTED / name, folder / name)
    write(folder, "gpu_compress_w3_h200.json", compress())


def defaults_rows(rounds=(1,)) -> list[tuple[str, int]]:
    return [(row, k) for k in rounds for row in plan.DEFAULTS_ROWS]


def names(decision: dict) -> list[str]:
    return [step["name"] for step in decision["steps"]]


def test_no_results_start_with_the_first_plan(tmp_path):
    decision = plan.decide(tmp_path, "h100", NO_SERVING)
    assert decision["plan"] == "first" and decision["files_read"] == []
    assert names(decision) == ["compress", "throughput_first", "kernels"]
    compress_step, throughput_step, kernels_step = decision["steps"]
    assert compress_step["args"] == ["compress", "--cases", "rc0.8,bare,none", "--timeout", "%L-25%"]
    assert compress_step["cap_s"] == 180 and compress_step["glob"] == "compress.json"
    args = throughput_step["args"]
    assert args[args.index("--settings") + 1] == "vanilla,bare" and args[args.index("--mode") + 1] == "eager"
    assert "--fresh" in args and args[args.index("--rounds") + 1] == "1"
    # the KV-bound workload: 16 x 4-8k + 512 out, a pool for 4
    assert args[args.index("--requests") :][:10] == plan.WORKLOAD
    parts = kernels_step["args"][kernels_step["args"].index("--parts") + 1]
    assert parts == "live_path,decode_speed,kernels,bench,pytest"  # observe_layer first: seconds


def test_the_second_window_as_committed_still_owes_compress_and_kernels(tmp_path):
    for name in W2_FILES:
        shutil.copyfile(COMMITTED / name, tmp_path / name)
    decision = plan.decide(tmp_path, "h200", NO_SERVING)
    assert decision["plan"] == "first"
    assert names(decision) == ["compress", "kernels"]  # the throughput half is done: not run again
    first = decision["status"]["first"]
    assert first["throughput_first"] == {
        "done": True,
        "files": ["throughput_first_w2_h200.json"],
        "done_in": "throughput_first_w2_h200.json",
    }
    assert not first["compress"]["done"] and "no compression result" in first["compress"]["last"]
    assert not decision["status"]["kernels"]["done"] and "timed out" in decision["status"]["kernels"]["last"]


def test_the_committed_results_today(tmp_path):
    """The same on the whole committed folder (the first window's failed files beside the second's)."""
    decision = plan.decide(COMMITTED, "h200", NO_SERVING)
    if decision["status"]["first"]["compress"]["done"]:  # a later window measured it: the rest is tested above
        return
    assert decision["plan"] == "first" and names(decision)[0] == "compress"


def test_a_compress_result_counts_only_when_every_case_is_measured_as_predicted(tmp_path):
    bad = {
        "graphs": compress(graphs=True),
        "leak": compress(no_leak=False),
        "case missing": compress(cases={"rc0.8": good_case("rc0.8"), "bare": good_case("bare")}),
        "freed off": compress(cases={**compress()["cases"], "bare": {**good_case("bare"), "measured_blocks_freed": 7}}),
        "no triton": compress(
            cases={**compress()["cases"], "rc0.8": {**good_case("rc0.8"), "triton_live_path": False}}
        ),
        "not returned": compress(
            cases={**compress()["cases"], "none": {**good_case("none"), "blocks_returned": False}}
        ),
        "dry": compress(dry_run=True),
        "no GPU": compress(env={"device": "no CUDA device visible to torch"}),
    }
    for why, result in bad.items():
        folder = tmp_path / why.replace(" ", "_")
        folder.mkdir()
        write(folder, "gpu_compress_h200.json", result)
        decision = plan.decide(folder, "h200", NO_SERVING)
        assert decision["plan"] == "first" and names(decision)[0] == "compress", why
    write(tmp_path, "gpu_compress_h200.json", compress())
    decision = plan.decide(tmp_path, "h200", NO_SERVING)
    assert names(decision) == ["throughput_first", "kernels"]


def test_files_are_read_by_content_not_by_name(tmp_path):
    # a throughput file with an unexpected name still counts; a defaults-tag file does not answer "first"
    write(tmp_path, "whatever_h100.json", compress(env=H100))
    write(tmp_path, "throughput_first_h100.json", throughput("defaults", "graphs", [("vanilla", 1), ("bare", 1)]))
    write(tmp_path, "notes.json", throughput("first", "eager", [("vanilla", 1), ("bare", 1)]))  # no device suffix
    decision = plan.decide(tmp_path, "h100", NO_SERVING)
    assert decision["plan"] == "first" and names(decision) == ["throughput_first", "kernels"]
    write(tmp_path, "t_h100.json", throughput("first", "eager", [("vanilla", 1), ("bare", 1, False)]))
    assert names(plan.decide(tmp_path, "h100", NO_SERVING)) == ["throughput_first", "kernels"]  # bare failed


def test_a_complete_first_moves_on_to_the_defaults_with_every_row(tmp_path):
    first_done(tmp_path)
    decision = plan.decide(tmp_path, "h200", NO_SERVING)
    assert decision["plan"] == "defaults" and "seed" not in decision
    assert decision["remaining_rows"] == [f"r1:{row}" for row in plan.DEFAULTS_ROWS]
    assert decision["remaining_rows"][:3] == ["r1:vanilla", "r1:bare", "r1:vanilla-piecewise"]
    (step,) = decision["steps"]
    args = step["args"]
    assert args[:3] == ["throughput", "--tag", "defaults"] and args[args.index("--mode") + 1] == "graphs"
    assert args[args.index("--settings") + 1] == ",".join(plan.DEFAULTS_ROWS) and "--fresh" not in args
    assert args[args.index("--rounds") + 1] == "1" and step["glob"] == "throughput_defaults_*.json"


def test_defaults_partly_done_resume_on_the_same_device_only(tmp_path):
    first_done(tmp_path)
    done = [("vanilla", 1), ("bare", 1), ("vanilla-piecewise", 1)]
    write(tmp_path, "throughput_defaults_w3_h200.json", throughput("defaults", "graphs", done[:2]))
    write(tmp_path, "throughput_defaults_w4_h200.json", throughput("defaults", "graphs", [*done, ("rc0.8", 1, False)]))
    decision = plan.decide(tmp_path, "h200", NO_SERVING)
    assert decision["plan"] == "defaults"
    assert decision["remaining_rows"] == [f"r1:{row}" for row in plan.DEFAULTS_ROWS[3:]]  # rc0.8 failed: owed
    assert decision["seed"] == {
        "from": str(tmp_path / "throughput_defaults_w4_h200.json"),
        "as": "throughput_defaults_h200.json",
    }
    # An H100 window cannot pair its rows with the H200's vanilla: it starts the rows on the H100
    other = plan.decide(tmp_path, "h100", NO_SERVING)
    assert other["plan"] == "defaults" and "seed" not in other and len(other["remaining_rows"]) == 9
    assert "partial on ['h200']" in other["why"]


def test_seeding_copies_the_committed_rows_unless_the_machine_holds_more(tmp_path):
    first_done(tmp_path)
    committed = throughput("defaults", "graphs", [("vanilla", 1), ("bare", 1)])
    write(tmp_path, "throughput_defaults_w3_h200.json", committed)
    results = tmp_path / "machine"
    decision = plan.decide(tmp_path, "h200", NO_SERVING)
    assert plan.seed(decision, results).startswith("copied")
    assert json.loads((results / "throughput_defaults_h200.json").read_text()) == committed
    more = throughput("defaults", "graphs", [("vanilla", 1), ("bare", 1), ("rc0.8", 1)])
    write(results, "throughput_defaults_h200.json", more)  # a first call 2 on this machine got further
    assert plan.seed(decision, results).startswith("kept")
    assert json.loads((results / "throughput_defaults_h200.json").read_text()) == more
    assert plan.seed(plan.decide(tmp_path, "h100", NO_SERVING), results) is None


def test_after_the_defaults_serving_is_skipped_while_unbuilt_then_kernels(tmp_path):
    first_done(tmp_path)
    write(tmp_path, "throughput_defaults_h100.json", throughput("defaults", "graphs", defaults_rows(), env=H100))
    decision = plan.decide(tmp_path, "h200", NO_SERVING)
    assert decision["plan"] == "kernels" and names(decision) == ["kernels"]
    assert [s["plan"] for s in decision["skipped_plans"]] == ["serving"]
    assert "check_serving.py" in decision["skipped_plans"][0]["why"]
    script = tmp_path / "check_serving.py"
    script.write_text("")
    built = plan.decide(tmp_path, "h200", script)
    assert built["plan"] == "serving" and names(built) == ["serving"] and not built["skipped_plans"]
    write(tmp_path, "serving_h100.json", serving(plan.SERVING_ROWS, env=H100))
    assert plan.decide(tmp_path, "h200", script)["plan"] == "kernels"


def serving(rows, env=H200, mode="graphs", failed=(), **changes) -> dict:
    """A check serving result: ``rows`` measured (each bench run complete); rows in ``failed`` lost a request."""
    runs = []
    for row in rows:
        kind = row.split(":")[0]
        run = {"row": row, "kind": kind, "ok": True}
        for name in plan.SERVING_RUNS[kind]:
            bench = {"ok": True, "completed": 16, "failed": 0, "request_throughput": 0.31}
            run[name] = dict(bench, p99_ttft_ms=9000.0, p99_itl_ms=31.0, failed=1 if row in failed else 0)
        runs.append(run)
    result = {"check": "serving", "workload": {"mode": mode}, "environment": env, "runs": runs}
    result.update(changes)
    return result


def test_serving_plan_steps_rows_owed_and_done_criterion(tmp_path):
    """After the defaults: check serving (the script is built), the rows owed on this window's device, the committed
    file of that device seeded; done only when one device's graphs file has every row with complete bench runs."""
    first_done(tmp_path)
    write(tmp_path, "throughput_defaults_h100.json", throughput("defaults", "graphs", defaults_rows(), env=H100))
    decision = plan.decide(tmp_path, "h200")  # the real tools/gpu/check_serving.py
    assert decision["plan"] == "serving" and not decision["skipped_plans"] and "seed" not in decision
    assert decision["remaining_rows"] == list(plan.SERVING_ROWS)
    assert decision["steps"] == [
        {
            "name": "serving",
            "cap_s": plan.CAPS["serving"],
            "glob": "serving_*.json",
            "args": ["serving", "--mode", "graphs", "--rows", ",".join(plan.SERVING_ROWS), "--budget-s", "%L-15%"],
        }
    ]
    assert plan.SERVING_ROWS[:2] == ("sat:vanilla", "sat:bare")  # the window-3 targets first
    # a partial file on the H200: the rest owed there, the file seeded; an H100 window starts its own
    write(tmp_path, "serving_w6_h200.json", serving(["sat:vanilla", "sat:bare"]))
    decision = plan.decide(tmp_path, "h200")
    assert decision["plan"] == "serving" and decision["remaining_rows"] == list(plan.SERVING_ROWS[2:])
    assert decision["seed"] == {"from": str(tmp_path / "serving_w6_h200.json"), "as": "serving_graphs_h200.json"}
    other = plan.decide(tmp_path, "h100")
    assert other["remaining_rows"] == list(plan.SERVING_ROWS) and "seed" not in other
    assert "partial on ['h200']" in other["why"]
    # every row, but not counting: a failed request, a row without its half-rate run, eager, a dry run
    bad = {
        "failed": serving(plan.SERVING_ROWS, failed=("sat:bare",)),
        "eager": serving(plan.SERVING_ROWS, mode="eager"),
        "dry": serving(plan.SERVING_ROWS, dry_run=True),
    }
    no_half = serving(plan.SERVING_ROWS)
    del no_half["runs"][0]["half"]
    bad["no_half"] = no_half
    owed = {"failed": ["sat:bare"], "no_half": ["sat:vanilla"]}  # the file with the most rows done is resumed
    for name, result in bad.items():
        write(tmp_path, f"serving_{name}_w7_h200.json", result)
        decision = plan.decide(tmp_path, "h200")
        assert decision["plan"] == "serving" and not decision["status"]["serving"]["done"], name
        assert decision["remaining_rows"] == owed.get(name, list(plan.SERVING_ROWS[2:])), name
        (tmp_path / f"serving_{name}_w7_h200.json").unlink()
    write(tmp_path, "serving_w7_h200.json", serving(plan.SERVING_ROWS))
    for device in ("h200", "h100"):  # done on one device: the next plan on both
        decision = plan.decide(tmp_path, device)
        assert decision["plan"] == "kernels" and decision["status"]["serving"]["done"]
    assert "serving: done" in plan.describe(decision)


def test_check_serving_resumes_the_seeded_rows_in_a_dry_run(tmp_path):
    """window.sh's serving step: check_serving.py continues the committed file, recording (no server: a dry run)
    the servers and bench runs of the rows owed, with the tokenizer unpacked from the carry."""
    serving_check = load("check_serving")
    local = serving_check.default_tokenizer_source()
    if not all((local / n).is_file() for n in serving_check.TOKENIZER_FILES):
        pytest.skip("SmolLM2 is not converted here (./rcstat test does it)")
    first_done(tmp_path)
    write(tmp_path, "throughput_defaults_h200.json", throughput("defaults", "graphs", defaults_rows()))
    workload = serving_check.workload_of(serving_check.build_parser().parse_args([]))
    # the pool of the KV-bound workload (throughput --tag first: 4 x (6144 + 512) tokens), 4-8k prompts + 512 out
    assert workload["kv_bytes"] == 3489660928 and workload["kv_tokens"] == 26624 and workload["mode"] == "graphs"
    assert workload["max_model_len"] >= 8192 + 512 and workload["long"]["output_len"] == 4096
    seeded = serving(["sat:vanilla"], workload=workload, calls=[{}])
    seeded["runs"][0].update(wall_s=200.0, setting="vanilla")
    write(tmp_path, "serving_w6_h200.json", seeded)
    decision = plan.decide(tmp_path, "h200")
    results = tmp_path / "machine"
    assert plan.seed(decision, results).startswith("copied serving_w6_h200.json")
    carry = tmp_path / "carry"
    serving_check.pack_tokenizer(local, carry / "core" / serving_check.CARRY_TOKENIZER)
    args = [a.replace("%L-15%", "500") for a in decision["steps"][0]["args"][1:]]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(RCSTAT_RESULTS=str(results), RCSTAT_DRY_RUN="1", RCSTAT_DEVICE_TAG="h200", OUT=str(tmp_path / "out"))
    env.update(RCSTAT_MODEL_ROOT=str(tmp_path / "models"), RCSTAT_CARRY_DIR=str(carry))
    proc = subprocess.run(
        [sys.executable, str(GPU / "check_serving.py"), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "serving_graphs_h200.json").read_text())
    assert report["workload"] == workload and report["dry_run"] and len(report["calls"]) == 2
    assert [r["row"] for r in report["runs"] if r.get("ok")] == ["sat:vanilla"]  # kept
    tried = [r for r in report["runs"] if r.get("dry_run")]
    assert [r["row"] for r in tried] == list(plan.SERVING_ROWS[1:]) and all(r["call"] == 1 for r in tried)
    assert report["remaining"] == list(plan.SERVING_ROWS[1:]) and not report["ok"]
    tokenizer = results / "tokenizer-smollm2"
    assert report["tokenizer"]["from"].startswith("carry") and report["tokenizer"]["path"] == str(tokenizer)
    assert (tokenizer / "tokenizer.json").read_bytes() == (local / "tokenizer.json").read_bytes()
    probe = report["dry_probe"]
    assert probe["ok"] and probe["vocab_size"] == 49152 and probe["parser_rejects_unknown"], probe
    # every server (4) and bench command (2 + 1 + 1 + 2) of the rows tried, through vLLM's own CLI parsers
    assert len(probe["parsed"]) == 4 + 6 and set(probe["parsed"].values()) == {"ok"}, probe["parsed"]
    assert all(4096 <= n <= 8192 for n in probe["sampled_prompt_lens"]), probe  # vLLM's random dataset, 4-8k
    by_row = {r["row"]: r for r in tried}
    for row, run in by_row.items():
        cmd = run["server_command"]
        assert cmd[cmd.index("serve") + 1] == str(tmp_path / "models" / "llama-3.1-8b-shape-vocab49152")
        assert cmd[cmd.index("--tokenizer") + 1] == str(tokenizer) and "--enforce-eager" not in cmd  # graphs
        assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(workload["kv_bytes"])
        assert cmd[cmd.index("--load-format") + 1] == "dummy" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
        rcstat = run["rcstat"]
        assert ("--additional-config" in cmd) == (rcstat is not None)
        if rcstat is not None:
            assert json.loads(cmd[cmd.index("--additional-config") + 1]) == {"rcstat": rcstat}
        benches = run["bench_commands"]
        assert sorted(benches) == (["long"] if row.startswith("long") else ["half", "sat"])
        for name, bench in benches.items():
            assert bench[bench.index("bench") + 1] == "serve"
            assert bench[bench.index("--tokenizer") + 1] == str(tokenizer)
            assert bench[bench.index("--request-rate") + 1] == ("0.5x" if name == "half" else "inf")
            assert bench[bench.index("--num-prompts") + 1] == str(workload[name]["prompts"])
    assert by_row["sat:bare"]["rcstat"] == {} and by_row["long:vanilla"]["env"] == {"VLLM_PLUGINS": "__none__"}
    assert by_row["long:decode1024"]["rcstat"] == {"decode_budget": 1024}
    assert by_row["sat:rc0.8"]["rcstat"] == {"method": "rc", "target_ratio": 0.8}
    config = json.loads((tmp_path / "models" / "llama-3.1-8b-shape-vocab49152" / "config.json").read_text())
    common = load("gpu_common")
    assert config == dict(common.LLAMA_31_8B, vocab_size=49152, bos_token_id=1, eos_token_id=2)
    pointer = json.loads((tmp_path / "out" / "serving.json").read_text())
    assert pointer["file"] == "serving_graphs_h200.json" and not pointer["ok"]


def test_then_a_second_round_of_the_defaults_then_done(tmp_path):
    first_done(tmp_path)
    write(tmp_path, "throughput_defaults_h200.json", throughput("defaults", "graphs", defaults_rows()))
    write(tmp_path, "gpu_kernels_w5_h200.json", kernels(ok=False))
    assert plan.decide(tmp_path, "h200", NO_SERVING)["plan"] == "kernels"
    # every part ok but decode-time scoring never timed (a result from before the part existed): still owed
    write(tmp_path, "gpu_kernels_w5b_h200.json", kernels(parts=("live_path", "kernels", "bench", "pytest")))
    assert plan.decide(tmp_path, "h200", NO_SERVING)["plan"] == "kernels"
    write(tmp_path, "gpu_kernels_w6_h200.json", kernels())
    decision = plan.decide(tmp_path, "h200", NO_SERVING)
    assert decision["plan"] == "defaults2"
    assert decision["remaining_rows"] == [f"r2:{row}" for row in plan.DEFAULTS_ROWS]
    args = decision["steps"][0]["args"]
    assert args[args.index("--rounds") + 1] == "2" and decision["seed"]["as"] == "throughput_defaults_h200.json"
    write(tmp_path, "throughput_defaults_w7_h200.json", throughput("defaults", "graphs", defaults_rows((1, 2))))
    done = plan.decide(tmp_path, "h200", NO_SERVING)
    assert done["plan"] == "done" and done["steps"] == []


def test_main_prints_the_decision_and_the_steps_for_window_sh(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan.main(["--results", str(tmp_path), "--device", "h100", "--json", str(out), "--steps"]) == 0
    captured = capsys.readouterr()
    lines = [line.split("\t") for line in captured.out.splitlines()]
    assert [line[0] for line in lines] == ["compress", "throughput_first", "kernels"]
    assert lines[0] == ["compress", "180", "compress.json", "compress --cases rc0.8,bare,none --timeout %L-25%"]
    assert "plan: first on h100" in captured.err
    assert json.loads(out.read_text())["plan"] == "first"


def test_throughput_resumes_the_seeded_rows_in_a_dry_run(tmp_path):
    """window.sh's defaults step: throughput.py continues the committed file's plan, running only the rows owed."""
    first_done(tmp_path)
    args = plan.decide(tmp_path, "h200", NO_SERVING)["steps"][0]["args"]
    workload = {
        "requests": 16,
        "min_len": 4096,
        "max_len": 8192,
        "max_tokens": 512,
        "fit": 4.0,
        "kv_bytes": 3489660928,
        "kv_tokens": 26624,
        "max_model_len": 9216,
        "mode": "graphs",
        "seed": 0,
        "prompts": "uniform random token ids in [1000, 128000)",
        "max_num_seqs": 16,  # graphs: capped at the requests (the capture sizes; no step changes)
    }
    seeded = throughput("defaults", "graphs", [("vanilla", 1), ("bare", 1)], workload=workload, calls=[{}])
    for run in seeded["runs"]:
        run.update(process_wall_s=150.0, output_tok_per_s=100.0, peak_running=4, mean_running=4.0)
    write(tmp_path, "throughput_defaults_w3_h200.json", seeded)
    decision = plan.decide(tmp_path, "h200", NO_SERVING)
    results = tmp_path / "machine"
    plan.seed(decision, results)
    args = [a.replace("%L-15%", "500").replace("%L-30%", "480") for a in decision["steps"][0]["args"][1:]]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(RCSTAT_RESULTS=str(results), RCSTAT_DRY_RUN="1", RCSTAT_DEVICE_TAG="h200", OUT=str(tmp_path / "out"))
    env["RCSTAT_MODEL_ROOT"] = str(tmp_path / "models")
    proc = subprocess.run(
        [sys.executable, str(GPU / "throughput.py"), *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "throughput_defaults_h200.json").read_text())
    assert report["workload"] == workload  # the same workload: the seeded runs kept
    kept = [(r["setting"], r["round"]) for r in report["runs"] if r.get("ok")]
    tried = [r["setting"] for r in report["runs"] if r.get("dry_run")]
    assert kept == [("vanilla", 1), ("bare", 1)]
    assert tried == list(plan.DEFAULTS_ROWS[2:])  # only the rows owed, in the plan's order (a dry run takes no time)
    engines = {r["setting"]: r["spec"]["engine"] for r in report["runs"] if r.get("dry_run")}
    assert {e["max_num_seqs"] for e in engines.values()} == {16}  # capture capped at the workload's requests
    assert "enforce_eager" not in engines["rc0.8"]  # vLLM's defaults
    assert engines["vanilla-piecewise"]["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    assert all(r["call"] == 1 for r in report["runs"] if r.get("dry_run"))
    assert report["remaining"] == [f"r1:{row}" for row in plan.DEFAULTS_ROWS[2:]]
    piecewise = next(r for r in report["runs"] if r["setting"] == "vanilla-piecewise")
    engine = piecewise["spec"]["engine"]
    assert engine["async_scheduling"] is False and engine["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    assert "enforce_eager" not in engine and piecewise["env_extra"] == {"VLLM_PLUGINS": "__none__"}
