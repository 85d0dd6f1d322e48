"""tools/ab_commits.py: the ABBA order, the editable finder repointed at a side's clone, the per-side medians."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

_TOOL = Path(__file__).resolve().parents[1] / "tools" / "ab_commits.py"
_spec = importlib.util.spec_from_file_location("ab_commits", _TOOL)
ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab)

FINDER = (
    "MAPPING: dict[str, str] = {'rcstat_vllm': '%(repo)s/rcstat_vllm', 'rcstat_vllm.kernels': '%(repo)s/kernels', "
    "'rcstat_vllm.patches': '%(repo)s/patches'}\nNAMESPACES: dict[str, list[str]] = {}\n"
)


def _venv(root: Path, repo: str) -> Path:
    site = root / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (site / "__editable___rcstat_vllm_0_1_0_finder.py").write_text(FINDER % {"repo": repo})
    return site / "__editable___rcstat_vllm_0_1_0_finder.py"


def test_abba_order_alternates_which_side_runs_first():
    assert ab.abba(3) == [("before", 0), ("after", 0), ("after", 1), ("before", 1), ("before", 2), ("after", 2)]


def test_repoint_editable_maps_every_package_to_the_clone(tmp_path):
    finder = _venv(tmp_path / "venv", "/work/main")
    ab.repoint_editable(tmp_path / "venv", Path("/work/main"), Path("/tmp/ab/before"))
    namespace: dict = {}
    exec(finder.read_text(), namespace)
    assert namespace["MAPPING"] == {
        "rcstat_vllm": "/tmp/ab/before/rcstat_vllm",
        "rcstat_vllm.kernels": "/tmp/ab/before/kernels",
        "rcstat_vllm.patches": "/tmp/ab/before/patches",
    }


def test_repoint_editable_refuses_a_venv_installed_elsewhere(tmp_path):
    # /work/main-old shares the prefix /work/main: only a whole path component may match.
    _venv(tmp_path / "venv", "/work/main-old")
    with pytest.raises(SystemExit, match="maps nothing under /work/main"):
        ab.repoint_editable(tmp_path / "venv", Path("/work/main"), Path("/tmp/ab/before"))
    with pytest.raises(SystemExit, match="expected one editable finder"):
        ab.repoint_editable(tmp_path / "empty", Path("/work/main"), Path("/tmp/ab/before"))


def _report(default: float, rc: float | None = None) -> dict:
    runs = {
        "vanilla": {"vs_vanilla": {"output_tok_per_s": 1.0}},
        "default": {"vs_vanilla": {"output_tok_per_s": default}},
    }
    if rc is not None:
        runs["rc_r0.8"] = {"vs_vanilla": {"output_tok_per_s": rc}}
    return {"benchmark": "throughput", "runs": runs}


def test_summarize_keeps_each_sides_ratios_in_run_order_and_their_median():
    runs = [
        {"side": "before", "report": _report(1.12)},
        {"side": "after", "report": _report(1.18, rc=1.6)},
        {"side": "after", "report": _report(1.20, rc=1.4)},
        {"side": "before", "report": _report(1.19)},
        {"side": "before", "report": _report(1.10)},
    ]
    tok = "output_tok_per_s"
    assert ab.summarize(runs) == {
        "before": {"default": {tok: {"ratios": [1.12, 1.19, 1.10], "median": 1.12}}},
        "after": {
            "default": {tok: {"ratios": [1.18, 1.2], "median": 1.19}},
            "rc_r0.8": {tok: {"ratios": [1.6, 1.4], "median": 1.5}},
        },
    }


def test_serving_reports_give_a_row_per_setting_and_rate():
    report = {
        "benchmark": "serving",
        "summary": {
            "vanilla": {"0.161": {"p99_itl_ms": 48.0}},
            "default": {"0.161": {"p99_itl_ms": 57.0, "vs_vanilla": {"p99_itl_ms": 1.19, "request_throughput": 1.0}}},
        },
    }
    assert ab.vanilla_ratios(report) == {"default@0.161": {"p99_itl_ms": 1.19, "request_throughput": 1.0}}
    # A report without ratios to vanilla (another benchmark's) adds nothing.
    assert ab.vanilla_ratios({"benchmark": "scoring", "summary": {"rc": 1.0}}) == {}


def test_prepare_side_clones_the_commit_with_its_own_venv(tmp_path):
    venv = tmp_path / "venv"
    _venv(venv, str(ab.REPO))
    head = subprocess.run(["git", "-C", str(ab.REPO), "rev-parse", "HEAD~1"], capture_output=True, text=True)
    commit = ab.prepare_side("HEAD~1", tmp_path / "before", venv)
    assert commit == head.stdout.strip()
    clone = tmp_path / "before"
    clone_head = subprocess.run(["git", "-C", str(clone), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert clone_head.stdout.strip() == commit
    copied = next((tmp_path / "before" / ".venv").rglob(ab.FINDER_GLOB)).read_text()
    assert f"'{tmp_path / 'before'}/kernels'" in copied and str(ab.REPO) + "/" not in copied
    # The original venv is untouched.
    assert f"'{ab.REPO}/kernels'" in next(venv.rglob(ab.FINDER_GLOB)).read_text()


def test_cli_requires_a_benchmark_command(capsys):
    with pytest.raises(SystemExit):
        ab.main(["--before", "HEAD~1", "--out", "/tmp/x.json"])
    assert "name the benchmark" in capsys.readouterr().err
