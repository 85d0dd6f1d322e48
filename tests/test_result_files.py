"""benchmarks/result_files.py: result files written compactly, gzipped when large (every GPU call sends the
working tree: tools/gpu/README.md), read by either name; and what reads them: report.py, the GPU window's plan,
provenance dated from the plain file's history."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from gpu_tools import load
from test_benchmark_provenance import scratch_git

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import provenance  # noqa: E402
import report  # noqa: E402
import result_files  # noqa: E402

SMALL = {"benchmark": "x", "rows": [1, 2, 3]}
LARGE = {"benchmark": "x", "rows": [{"prompt": i, "found": [True, False]} for i in range(5000)]}


def test_a_small_report_stays_plain_json_and_a_large_one_is_gzipped_one_file_each(tmp_path):
    path = tmp_path / "r_cpu.json"
    assert result_files.write(SMALL, path) == path
    assert path.read_text() == '{"benchmark":"x","rows":[1,2,3]}\n'  # compact
    assert len(json.dumps(LARGE, separators=(",", ":"))) > result_files.GZIP_OVER_BYTES
    zipped = result_files.write(LARGE, path)
    assert zipped == tmp_path / "r_cpu.json.gz" and not path.exists()  # the plain form is gone
    assert json.loads(gzip.decompress(zipped.read_bytes())) == LARGE
    assert zipped.stat().st_size < result_files.GZIP_OVER_BYTES / 4
    assert result_files.read(path) == result_files.read(zipped) == LARGE  # either name reads it
    assert result_files.write(SMALL, zipped) == path and not zipped.exists()  # and back, under either name
    assert result_files.all_results(tmp_path) == [path]


def test_writing_the_same_large_report_twice_gives_the_same_bytes(tmp_path):
    """No timestamp in the gzip header: a result written again unchanged is no change for git."""
    first = result_files.write(LARGE, tmp_path / "a.json").read_bytes()
    assert result_files.write(LARGE, tmp_path / "a.json").read_bytes() == first


def test_a_missing_result_is_named_with_both_forms(tmp_path):
    assert result_files.find(tmp_path / "none.json") is None
    try:
        result_files.read(tmp_path / "none.json")
    except FileNotFoundError as exc:
        assert "none.json (or .gz)" in str(exc)
    else:
        raise AssertionError("read of a missing result did not fail")


def test_report_reads_a_gzipped_result_by_its_plain_name_and_names_its_file(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    result_files.write(LARGE, tmp_path / "accuracy_cpu.json")
    data = report.load("accuracy_cpu.json")
    assert data["rows"] == LARGE["rows"] and data["_file"] == "accuracy_cpu.json.gz"
    assert report.load("other_cpu.json") is None


def test_check_names_a_doc_reference_to_a_result_that_changed_form(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    results = tmp_path / "results"
    result_files.write(LARGE, results / "big_cpu.json")
    result_files.write(SMALL, results / "a_seed1_cpu.json")
    readme = tmp_path / "README.md"
    readme.write_text(
        "see `benchmarks/results/big_cpu.json` and benchmarks/results/big_cpu.json.gz, `a_seed{1,2}_cpu.json`,\n"
        "`a_seed*_cpu.json`, `big_*.json.gz`, `config.json` (not a result) and `..._cpu.json` (an ellipsis)\n"
    )
    monkeypatch.setattr(report, "RESULTS", results)
    monkeypatch.setattr(report, "README", readme)
    monkeypatch.setattr(report, "RESULTS_DOC", tmp_path / "docs" / "benchmarks.md")
    assert report.missing_files() == [
        "README.md names a_seed2_cpu.json, which does not exist in benchmarks/results",
        "README.md names big_cpu.json, which does not exist in benchmarks/results (stored as big_cpu.json.gz now)",
    ]


def test_the_window_plan_reads_gzipped_gpu_results(tmp_path):
    plan = load("window_plan")
    result = {"environment": {"device": "NVIDIA H200"}, "runs": []}
    (tmp_path / "throughput_first_h200.json.gz").write_bytes(gzip.compress(json.dumps(result).encode()))
    (tmp_path / "gpu_env_h200.json").write_text(json.dumps(result))
    found = plan.load_results(tmp_path)
    assert sorted(f["path"].name for f in found) == ["gpu_env_h200.json", "throughput_first_h200.json.gz"]
    assert all(f["device"] == "h200" and f["result"] == result for f in found)


def test_a_result_gzipped_by_a_listed_rewrite_is_dated_by_its_plain_files_last_run(tmp_path, monkeypatch):
    git = scratch_git(tmp_path)
    plain = tmp_path / "r.json"
    plain.write_text(json.dumps(LARGE))
    git("add", "r.json")
    git("commit", "-qm", "run")
    made = git("rev-parse", "HEAD")
    zipped = result_files.write(json.loads(plain.read_text()), plain)
    git("add", "-A")
    git("commit", "-qm", "gzip large results")
    rewrite = git("rev-parse", "HEAD")
    rewrites = tmp_path / "REWRITES"
    rewrites.write_text(f"{rewrite}  # gzipped\n")
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    monkeypatch.setattr(provenance, "REWRITES_FILE", rewrites)
    for cached in (provenance._last_commit, provenance.rewrite_commits):
        cached.cache_clear()
    try:
        assert provenance.origin(zipped)["commit"] == made
    finally:
        for cached in (provenance._last_commit, provenance.rewrite_commits):
            cached.cache_clear()
