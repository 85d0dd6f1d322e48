"""The kvpress reference's pure parts (no kvpress, no model, no network: CI never sets up .venv-kvpress):
argument parsing, prompts loading, answer matching, totals against the full cache, and report.py's rows."""

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import kvpress_reference as kvr  # noqa: E402


def test_defaults_are_the_five_presses_at_both_ratios():
    args = kvr.parse_args(["--prompts", "p.json", "--model", "m"])
    assert args.presses == ["snapkv", "tova", "expected_attention", "adakv_expected_attention", "kvzip"]
    assert args.ratios == [0.5, 0.8]
    assert args.dtype == "float32"
    assert "summ" not in args.tasks and "niah_multivalue" in args.tasks
    assert args.json is None and args.limit is None


def test_arguments_are_checked():
    args = kvr.parse_args(
        [
            "--prompts",
            "p.json",
            "--model",
            "m",
            "--presses",
            "kvzip",
            "--ratios",
            "0.25",
            "--dtype",
            "bfloat16",
            "--json",
            "out.json",
        ]
    )
    assert (args.presses, args.ratios, args.dtype, args.json) == (["kvzip"], [0.25], "bfloat16", "out.json")
    for bad in (["--presses", "h2o"], ["--ratios", "1.0"], ["--ratios", "0"], ["--dtype", "float16"]):
        with pytest.raises(SystemExit):
            kvr.parse_args(["--prompts", "p.json", "--model", "m", *bad])
    with pytest.raises(SystemExit):
        kvr.parse_args(["--model", "m"])  # the prompts are required


def test_module_imports_nothing_heavy():
    """vllm and rcstat_vllm are never imported (the kvpress env can see them through the main site-packages);
    kvpress, torch and transformers only inside the runner, so the pure parts import anywhere."""
    lines = (BENCH / "kvpress_reference.py").read_text().splitlines()
    imports = [line for line in lines if line.strip().startswith(("import ", "from "))]
    assert not [line for line in imports if "vllm" in line or "rcstat" in line]
    top = [line for line in imports if line.startswith(("import ", "from "))]
    assert not [line for line in top if any(m in line for m in ("torch", "kvpress", "transformers"))]


def _sample(sample_id, task, answers):
    return {"task": task, "sample_id": sample_id, "prompt_ids": [1, 2, 3], "answers": answers, "max_new_tokens": 8}


def test_load_samples_reads_both_formats(tmp_path):
    samples = [_sample("a", "niah_single", ["123"]), _sample("b", "summ", []), _sample("c", "vt", ["XY"])]
    wrapped = tmp_path / "acc.json"
    wrapped.write_text(json.dumps({"benchmark": "accuracy", "preset": "quick", "seed": 0, "samples": samples}))
    header, got = kvr.load_samples(wrapped, kvr.SCORED_TASKS)
    assert header == {"benchmark": "accuracy", "preset": "quick", "seed": 0}
    assert [s["sample_id"] for s in got] == ["a", "c"]  # summaries are not scored by default
    bare = tmp_path / "data.json"
    bare.write_text(json.dumps(samples))
    assert [s["sample_id"] for s in kvr.load_samples(bare, [*kvr.SCORED_TASKS, "summ"], limit=2)[1]] == ["a", "b"]
    no_ids = tmp_path / "no_ids.json"
    no_ids.write_text(json.dumps([{k: v for k, v in samples[0].items() if k != "prompt_ids"}]))
    with pytest.raises(SystemExit):
        kvr.load_samples(no_ids, kvr.SCORED_TASKS)


def test_answers_match_whole_words_only():
    assert kvr.found_answers(["2279590", "44"], "The number is 2279590.") == [True, False]
    assert kvr.found_answers(["2279590"], "x22795901") == [False]  # a longer number does not count
    assert kvr.found_answers(["ABC"], "VAR ABC = 1, ABCD") == [True]
    assert kvr.found_answers(["a.b"], "axb") == [False]  # the value is literal, not a pattern
    assert kvr.found_answers([], "anything") == []


def test_answers_match_as_data_does():
    data = pytest.importorskip("data")
    sample = data.Sample(
        task="niah_multi", sample_id="x", prompt="", prompt_ids=[], answers=["12", "345", "6"], max_new_tokens=4
    )
    for text in ("12 and 345", "612 3456", "(6)", ""):
        assert kvr.found_answers(sample.answers, text) == data.found_answers(sample, text)


def _outputs(found):
    tasks = {"s1": "niah_single", "s2": "niah_single", "m1": "niah_multi", "v1": "vt"}
    return [{"sample_id": sid, "task": tasks[sid], "found": f} for sid, f in found.items()]


def test_totals_against_the_full_cache():
    full = {"s1": [True], "s2": [False], "m1": [True, True, False], "v1": [True, True]}
    press = {"s1": [True], "s2": [True], "m1": [False, True, True], "v1": [False, True]}
    t = kvr.totals(_outputs(press), full)
    assert (t["prompts"], t["values"], t["hits"]) == (4, 7, 5)
    assert (t["needle_values"], t["needle_hits"]) == (5, 4)  # vt is not a needle task
    assert t["by_task"]["niah_multi"] == {"values": 3, "hits": 2} and t["by_task"]["vt"] == {"values": 2, "hits": 1}
    # the full cache found s1 and m1's first two: the press kept s1 and m1's second (s2, m1's third not counted)
    assert (t["full_needle_hits"], t["kept_of_full"]) == (3, 2)
    assert t["kept_of_full_share"] == pytest.approx(2 / 3)
    own = kvr.totals(_outputs(full), full)
    assert (own["kept_of_full"], own["full_needle_hits"], own["kept_of_full_share"]) == (3, 3, 1.0)


def test_totals_without_a_full_run_or_its_hits():
    t = kvr.totals(_outputs({"s1": [False]}), None)
    assert "kept_of_full" not in t and t["needle_hits"] == 0
    assert kvr.totals(_outputs({"s1": [True]}), {"s1": [False]})["kept_of_full_share"] is None


def test_row_labels():
    assert kvr.row_label(None, 0.0) == "full"
    assert kvr.row_label("adakv_expected_attention", 0.5) == "adakv_expected_attention_r0.5"


def _fake_reference():
    def row(press, ratio, hits, kept, evicted):
        totals = {
            "needle_hits": hits,
            "needle_values": 10,
            "full_needle_hits": 8,
            "kept_of_full": kept,
            "kept_of_full_share": kept / 8,
        }
        return {
            "label": kvr.row_label(press, ratio),
            "press": press,
            "ratio": ratio,
            "evicted": evicted,
            "totals": totals,
            "samples": [],
        }

    return {
        "benchmark": "kvpress_reference",
        "environment": {"kvpress": "0.5.5", "transformers": "5.2.0", "torch": "2.13.0+cpu", "dtype": "float32"},
        "prompts": {"n": 4, "tasks": ["niah_multi", "niah_single"]},
        "rows": [
            row(None, 0.0, 8, 8, 0.0),
            row("kvzip", 0.5, 8, 8, 0.5),
            row("adakv_expected_attention", 0.8, 3, 2, 0.8),
        ],
    }


def test_report_rows_and_table():
    report = pytest.importorskip("report")
    k = _fake_reference()
    assert report.kvpress_rows(k) == [
        ("full cache", "0", "0.000", "8/10", "8/8 (100.0%)"),
        ("KVzip", "0.5", "0.500", "8/10", "8/8 (100.0%)"),
        ("AdaKV(ExpectedAttention)", "0.8", "0.800", "3/10", "2/8 (25.0%)"),
    ]
    lines = report.kvpress_table(k)
    assert "kvpress 0.5.5" in lines[0] and "transformers 5.2.0" in lines[0] and "4 scored prompts" in lines[0]
    assert lines[2] == "| press | ratio | evicted | needle values | of full |"
    assert lines[-1] == "| AdaKV(ExpectedAttention) | 0.8 | 0.800 | 3/10 | 2/8 (25.0%) |"
    k.update(complete=False, runs_planned=["full", "kvzip_r0.5", "adakv_expected_attention_r0.8", "tova_r0.5"])
    assert report.kvpress_table(k)[-1] == "A partial run: 3 of the 4 planned press and ratio runs finished."


def test_report_block_includes_the_reference(tmp_path, monkeypatch):
    report = pytest.importorskip("report")
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    (tmp_path / "kvpress_reference_cpu.json").write_text(json.dumps(_fake_reference()))
    block = "\n".join(report.build_table())
    assert "**kvpress 0.5.5 as the reference**" in block and "| KVzip | 0.5 |" in block


def test_resume_keeps_only_runs_of_the_same_prompts():
    samples = [_sample("a", "niah_single", ["1"]), _sample("b", "vt", ["X"])]

    def row(label, ids=("a", "b"), tokens=3):
        return {"label": label, "samples": [{"sample_id": i, "num_tokens": tokens} for i in ids]}

    previous = {"environment": {"dtype": "float32", "kvpress": "0.5.5"}, "rows": [row("full"), row("tova_r0.5")]}
    assert set(kvr.resumable_rows(previous, samples, "float32", "0.5.5")) == {"full", "tova_r0.5"}
    assert kvr.resumable_rows(previous, samples, "bfloat16", "0.5.5") == {}
    assert kvr.resumable_rows(previous, samples, "float32", "0.5.6") == {}
    assert kvr.resumable_rows(previous, samples[:1], "float32", "0.5.5") == {}  # other prompts
    assert (
        kvr.resumable_rows(
            {**previous, "rows": [row("full"), row("kvzip_r0.5", tokens=4)]}, samples, "float32", "0.5.5"
        )
        == {}
    )  # same ids, other lengths
    assert kvr.resumable_rows({**previous, "rows": [row("tova_r0.5")]}, samples, "float32", "0.5.5") == {}  # no full
    assert kvr.parse_args(["--prompts", "p", "--model", "m", "--resume"]).resume


class _FakeAttention:
    masked_key_indices = None


class _FakeMaskingModel:
    """Two layers, two KV heads: fills the cache with every prompt entry, as a masking press leaves it; the press
    (below) then names the evicted entries per head, as KVzip and AdaKV do."""

    def __init__(self, prune_to=None):
        from types import SimpleNamespace

        self.config = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2)
        self.model = SimpleNamespace(layers=[SimpleNamespace(self_attn=_FakeAttention()) for _ in range(2)])
        self.prune_to = prune_to

    def __call__(self, input_ids, past_key_values, logits_to_keep):
        import torch

        n = input_ids.shape[1] if self.prune_to is None else self.prune_to
        for layer in range(2):
            past_key_values.update(torch.zeros(1, 2, n, 4), torch.zeros(1, 2, n, 4), layer)


def _masking_press(model, evicted):
    """A press that, on exit, marks ``evicted`` ({layer: [(head, position)]}) as kvpress's masking presses do."""
    from contextlib import contextmanager

    import torch

    @contextmanager
    def press(_model):
        yield
        for layer, pairs in evicted.items():
            heads, positions = zip(*pairs)
            model.model.layers[layer].self_attn.masked_key_indices = (
                torch.zeros(len(pairs), dtype=torch.long),
                torch.tensor(heads),
                torch.tensor(positions),
            )

    return press


def test_keep_masks_read_back_what_a_masking_press_evicted():
    model = _FakeMaskingModel()
    keep = kvr.prefill_keep_mask(model, [1, 2, 3, 4, 5], _masking_press(model, {0: [(0, 1), (1, 3), (1, 4)]}))
    assert keep.shape == (2, 2, 5)
    assert keep[0].tolist() == [[True, False, True, True, True], [True, True, True, False, False]]
    assert bool(keep[1].all())  # a layer the press did not mask keeps everything


def test_keep_masks_refuse_a_press_that_pruned_the_cache():
    model = _FakeMaskingModel(prune_to=3)
    with pytest.raises(SystemExit, match="only masking presses"):
        kvr.prefill_keep_mask(model, [1, 2, 3, 4, 5], _masking_press(model, {}))
