"""Results that say how they were made (no vLLM engine): what every benchmark records, how report.py reads a row's
config as it ran against what its label means today, and that the README's figures and generated blocks match the
result files they name."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402
import methods  # noqa: E402
import provenance  # noqa: E402
import report  # noqa: E402


def _full_hash(short: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", short], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_environment_records_the_commit_the_machine_and_the_defaults():
    env = common.environment(extra_field=1)
    git = env["git"]
    assert len(git["commit"]) == 40 and isinstance(git["dirty"], bool)
    assert git["dirty"] == bool(git["dirty_files"])
    m = env["machine"]
    assert m["cores"] and m["cpu"] and isinstance(m["isa"], list) and "cpu_capability" in m
    assert env["plugin_defaults"] == methods.plugin_defaults()
    assert env["argv"] and env["recorded_at"] and env["extra_field"] == 1
    # The old top-level keys stay for older readers.
    assert {"cpu", "cores", "cpu_capability", "engine_dtype", "vllm"} <= set(env)


def test_accuracy_records_its_engine_and_the_engines_eviction():
    import accuracy

    kwargs = accuracy.engine_kwargs("/model", 4096, 1 << 30, "eager")
    options = common.engine_options(kwargs, env={})
    assert options["enable_prefix_caching"] is False and options["enforce_eager"] is True
    assert options["rcstat"] == {"eviction": "eager"} and options["plugin_loaded"]
    assert options["kv_cache_memory_bytes"] >= 1 << 30 and options["compilation_mode"] == 0
    assert common.engine_options({}, env={"VLLM_PLUGINS": "__none__"})["plugin_loaded"] is False
    # A request's config is the engine's flag merged with its override, as the plugin merges them.
    rc = methods.Setting("rc_r0.8", "rc_budget", {"method": "rc", "target_ratio": 0.8})
    assert accuracy.resolved_config(rc)["eviction"] == "eager"
    assert accuracy.resolved_config(rc, "lazy")["eviction"] == "lazy"
    assert common.resolved_config({"eviction": "eager"}, {"eviction": "lazy"})["eviction"] == "lazy"


def test_build_settings_pins_the_papers_scoring_and_the_baselines_budget():
    settings = methods.build_settings(**methods.QUALITY_SETTINGS["default"])
    changed = {c.field for c in provenance.DEFAULT_CHANGES} - {"target_ratio", "eviction"}
    for s in settings:
        if s.family in ("rc", "rc_budget"):  # the paper's RC: every field a default ever moved is pinned
            assert changed <= set(s.rcstat), s.label
            assert {k: s.rcstat[k] for k in methods.PAPER_RC if k != "window"} == {
                k: v for k, v in methods.PAPER_RC.items() if k != "window"
            }
        elif s.family in methods.BASELINES:
            assert (s.rcstat["budget_scope"], s.rcstat["sink_tokens"]) == ("layer", 0), s.label
    labels = {s.label: s for s in settings}
    # The defaults' own rows follow the defaults on purpose, at every ratio, and once with Eq. 6's scores.
    assert labels["rc_r0.8"].rcstat == {"method": "rc", "target_ratio": 0.8}
    assert labels["rc_r0.8_mean_contrast0"].rcstat["query_reduction"] == "mean"
    # Eq. 6's scores at any ratio: the GQA group's mean too, though the max is the default from 0.9 on.
    assert labels["rc_r0.8_mean_contrast0"].rcstat["group_reduction"] == "mean"
    for s in methods.budget_scope_settings():
        if s.family != "full":
            assert changed - {"budget_scope"} <= set(s.rcstat), s.label


def _quality(origin_commit: str, rows: dict) -> dict:
    summary = {
        label: {"family": family, "rcstat": override, "matched_to": None, "ratio": 0.8, "ver": 0.2}
        for label, (family, override) in rows.items()
    }
    return {
        "benchmark": "quality",
        "preset": "default",
        "_file": "quality_test.json",
        "summary": summary,
        "environment": {"git": {"commit": origin_commit, "dirty": False}},
    }


@pytest.mark.skipif(not provenance.history_available(), reason="needs the repository's git history")
def test_a_row_made_before_a_default_changed_says_so():
    before_contrast = _full_hash("74f331a")  # query_reduction max is the default, local contrast not yet
    data = _quality(
        before_contrast,
        {
            "rc_r0.8": ("rc_defaults", {"method": "rc", "target_ratio": 0.8}),
            "rc_budget_r0.8": (
                "rc_budget",
                {
                    "method": "rc",
                    "target_ratio": 0.8,
                    "window": 8,
                    "smoothing": 1,
                    "budget_scope": "layer",
                    "sink_tokens": 0,
                },
            ),
            "snapkv_r0.8": ("snapkv", {"method": "snapkv", "target_ratio": 0.8, "window": 8}),
        },
    )
    rows = report.row_configs(data)
    # Left to the defaults: ran with no contrast, which the default has been since.
    assert rows["rc_r0.8"]["ran"]["local_contrast"] == 0.0 and rows["rc_r0.8"]["ran"]["query_reduction"] == "max"
    assert rows["rc_r0.8"]["reasons"] == ["local_contrast 0.0 when it ran (default 0.5 since 5ef548a)"]
    # A label build_settings pins now: carried and max when it ran (the defaults of then), the paper's now.
    reasons = " ".join(rows["rc_budget_r0.8"]["reasons"])
    assert "carry_forward 8 when it ran, pinned to 0 now" in reasons
    assert "query_reduction 'max' when it ran, pinned to 'mean' now" in reasons
    assert "budget_scope 'model' when it ran, pinned to 'layer' now" in " ".join(rows["snapkv_r0.8"]["reasons"])
    note = " ".join(report.stale_lines(data, rows))
    assert "`quality_test.json`" in note and "74f331a" in note
    # The same rows made today mean what they say; and a file dated by git history in the commit that changed a
    # default is taken as made before it (results that motivated a change are committed with it).
    data["environment"]["git"]["commit"] = _full_hash("HEAD")
    assert not report.row_configs(data)["rc_r0.8"]["reasons"]
    o = {"commit": _full_hash("5ef548a"), "source": "git history"}
    assert provenance.defaults_at(o)["local_contrast"] == 0.0
    assert provenance.defaults_at({**o, "source": "recorded"})["local_contrast"] == 0.5


def test_an_accuracy_files_eviction_comes_from_its_engine_or_its_records():
    lazy = {"benchmark": "accuracy", "records": [{"skipped_reason": "lazy eviction: memory was not short"}]}
    assert report.server_flag(lazy) == ({"eviction": "lazy"}, "from its records")
    assert report.server_flag({"benchmark": "accuracy", "records": [{"skipped_reason": None}]})[0] == {
        "eviction": "eager"
    }
    assert report.server_flag({"engine": {"rcstat": {"eviction": "lazy"}}}) == ({"eviction": "lazy"}, "recorded")
    assert report.server_flag({"benchmark": "quality"}) == (None, "no engine")


@pytest.mark.skipif(not provenance.history_available(), reason="old result files are dated by git history")
def test_readme_figures_and_generated_blocks_match_their_files():
    """report.py --check: the generated blocks of docs/benchmarks.md and the README are what the result files give
    now, and every figure in report.FIGURES (README or docs/) is the number its file holds."""
    assert report.check() == []


def test_check_names_a_figure_that_no_longer_matches_its_file(tmp_path, monkeypatch):
    results = tmp_path / "results"
    results.mkdir()
    (results / "x.json").write_text(json.dumps({"summary": {"a": {"ver": 0.1234}}}))
    (tmp_path / "README.md").write_text("value error\n0.123 at 0.8\n")
    (tmp_path / "benchmarks.md").write_text(f"{report.START}\n{report.END}\n")
    monkeypatch.setattr(report, "RESULTS", results)
    monkeypatch.setattr(report, "README", tmp_path / "README.md")
    monkeypatch.setattr(report, "RESULTS_DOC", tmp_path / "benchmarks.md")
    monkeypatch.setattr(report, "build_table", lambda: [])
    monkeypatch.setattr(report, "readme_blocks", lambda: {})
    monkeypatch.setattr(report, "FIGURES", (("x.json", lambda d: (d["summary"]["a"]["ver"],), "error {:.3f} at 0.8"),))
    monkeypatch.setattr(report, "three_seed_figures", lambda: (0, 0))
    problems = report.check()
    assert problems == ["figure from accuracy_cpu.json: neither the README nor docs/ say '0 of 0 over three seeds'"]
    (tmp_path / "README.md").write_text("value error 0.124 at 0.8; 0 of 0 over three seeds\n")
    assert report.check() == ["figure from x.json: neither the README nor docs/ say 'error 0.123 at 0.8'"]


def test_the_table_of_default_changes_ends_at_todays_defaults():
    """A default changed without a row in provenance.DEFAULT_CHANGES would leave older rows unmarked: each field's
    last change must land on today's default (add a row, with its commit, when a default moves)."""
    from rcstat_vllm.config import KNOBS

    now = provenance.current_defaults()
    last, last_by_budget = {}, {}
    for change in provenance.DEFAULT_CHANGES:
        if change.ratios is None:
            last[change.field] = change.after
        else:
            last_by_budget[change.field, change.ratios] = change.after
    assert last == {field: now[field] for field in last}
    for field, (low, high) in last_by_budget:  # at every ratio a change covers, the last change there is today's
        for ratio in (low, (low + high) / 2 if high else 0.99):
            here = [c for c in provenance.DEFAULT_CHANGES if c.field == field and c.applies_at(ratio)]
            assert KNOBS[field].default_at(ratio) == here[-1].after, (field, ratio)
    dates = [c.date for c in provenance.DEFAULT_CHANGES]
    assert dates == sorted(dates)


def scratch_git(folder: Path):
    """``git(*args)`` in a new repository at ``folder``: its output."""

    def git(*args):
        return subprocess.run(
            ["git", "-C", str(folder), "-c", "user.name=t", "-c", "user.email=t@t", *args],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    git("init", "-q")
    return git


def test_a_file_is_dated_by_the_last_commit_that_wrote_it_rewrites_skipped(tmp_path, monkeypatch):
    """A result file without a recorded commit is dated by git history: the last commit that wrote it, skipping the
    commits benchmarks/results/REWRITES lists (the same JSON written again, e.g. compactly)."""
    git = scratch_git(tmp_path)
    result = tmp_path / "r.json"
    result.write_text(json.dumps({"rows": [1, 2]}, indent=1))
    git("add", "r.json")
    git("commit", "-qm", "run")
    made = git("rev-parse", "HEAD")
    result.write_text(json.dumps({"rows": [1, 2]}, separators=(",", ":")))
    git("commit", "-qam", "compact")
    rewrite = git("rev-parse", "HEAD")
    rewrites = tmp_path / "REWRITES"
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    monkeypatch.setattr(provenance, "REWRITES_FILE", rewrites)
    for cached in (provenance._last_commit, provenance.rewrite_commits):
        cached.cache_clear()
    try:
        assert provenance.origin(result)["commit"] == rewrite  # no REWRITES file: the rewrite dates it
        rewrites.write_text(f"# formatting only\n{rewrite}  # compact\n")
        for cached in (provenance._last_commit, provenance.rewrite_commits):
            cached.cache_clear()
        assert provenance.rewrite_commits() == {rewrite}
        assert provenance.origin(result) == {
            "commit": made,
            "date": provenance._last_commit("r.json")[1],
            "source": "git history",
            "dirty": None,
        }
    finally:
        for cached in (provenance._last_commit, provenance.rewrite_commits):
            cached.cache_clear()


def test_origin_reads_the_commit_a_gpu_call_records():
    """tools/gpu's files record ``environment.commit`` (the call's RCSTAT_COMMIT) and ``time_utc``, not
    ``environment.git``: that commit dates them, not the later commit that brought the file home."""
    data = {"environment": {"commit": "c7d17cd091feb4e6bee4c4b3d85ae3ecbe857c63", "time_utc": "2026-11-28T19:07:31Z"}}
    assert provenance.origin(Path("benchmarks/results/gpu_compress_w3_h200.json"), data) == {
        "commit": "c7d17cd091feb4e6bee4c4b3d85ae3ecbe857c63",
        "date": "2026-11-28T19:07:31Z",
        "source": "recorded",
        "dirty": None,
    }


def test_a_default_by_budget_is_resolved_at_the_rows_ratio_as_it_was_then():
    """Smoothing 5 from 0.9 (b1317ab) and chunks of 4 from 0.8 up to 0.9 (533158e, undone in 77801a0) moved only the
    rows at those budgets: a row left to the defaults ran with the schedule in the code that made its file."""
    before = {"commit": _full_hash("b1317ab~1"), "source": "recorded"}
    between = {"commit": _full_hash("533158e~1"), "source": "recorded"}
    chunked = {"commit": _full_hash("533158e"), "source": "recorded"}
    today = {"commit": _full_hash("HEAD"), "source": "recorded"}

    def ran(o, override):
        return provenance.ran_config(provenance.defaults_at(o), None, override, o)

    assert ran(before, {"target_ratio": 0.9})["smoothing"] == 3
    # value weighting from 0.9 on for one commit (0d7382a, undone in 9918e28)
    weighted = {"commit": _full_hash("0d7382a"), "source": "recorded"}
    assert (
        ran(weighted, {"target_ratio": 0.9})["value_weight"],
        ran(weighted, {"target_ratio": 0.8})["value_weight"],
    ) == (1.0, 0.0)
    assert ran(between, {"target_ratio": 0.9})["value_weight"] == 0.0
    assert ran(between, {"target_ratio": 0.9})["smoothing"] == 5
    assert ran(between, {"target_ratio": 0.8})["chunk"] == 1
    assert (ran(chunked, {"target_ratio": 0.8})["chunk"], ran(chunked, {"target_ratio": 0.9})["chunk"]) == (4, 1)
    assert ran(today, {"target_ratio": 0.8})["chunk"] == 1  # the change undone
    assert ran(chunked, {"target_ratio": 0.5})["chunk"] == 1 and ran(today, {"c": 1.0})["smoothing"] == 3
    assert ran(chunked, {"target_ratio": 0.8, "chunk": 2})["chunk"] == 2  # given: it stays
    for override in ({"target_ratio": 0.8}, {"target_ratio": 0.9}, {"target_ratio": 0.4}, {"c": 1.0}):
        assert ran(today, override) == provenance.now_config(None, override)
    # A row at 0.8 made while chunks of 4 were the default says why it no longer means what its label says.
    now = provenance.now_config(None, {"target_ratio": 0.8})
    assert provenance.row_status(ran(chunked, {"target_ratio": 0.8}), now, None, chunked) == [
        "chunk 4 when it ran (default 1 since 77801a0)"
    ]
    assert not provenance.row_status(ran(between, {"target_ratio": 0.8}), now, None, between)
    # the query heads' max from 0.8 on for two commits (3d665c9, undone in 22ebcdd): a row at 0.8 or 0.9 made then
    # ran with the max and says so; 0.4 and today's rows with the mean
    group_max = {"commit": _full_hash("3d665c9"), "source": "recorded"}
    assert [ran(chunked, {"target_ratio": r})["group_reduction"] for r in (0.4, 0.8, 0.9)] == ["mean"] * 3
    assert [ran(group_max, {"target_ratio": r})["group_reduction"] for r in (0.4, 0.8, 0.9)] == ["mean", "max", "max"]
    # and from 0.9 on since 6e6dabb: a row at 0.9 made with the max then means what it says today, one at 0.8 not
    assert [ran(today, {"target_ratio": r})["group_reduction"] for r in (0.4, 0.8, 0.9)] == ["mean", "mean", "max"]
    now_09 = provenance.now_config(None, {"target_ratio": 0.9})
    assert not provenance.row_status(ran(group_max, {"target_ratio": 0.9}), now_09, None, group_max)
    assert provenance.row_status(ran(group_max, {"target_ratio": 0.8}), now, None, group_max) == [
        "group_reduction 'max' when it ran (default 'mean' since 22ebcdd)"
    ]
