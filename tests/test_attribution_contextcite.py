"""The ContextCite comparison's metrics and sources (benchmarks/attribution_contextcite.py): top-k with ties, the
AUC over sources, the matched ablation count, the sources both methods score, and the family built from the Debian
FAQ (skipped where the debian-faq package is not installed). No engine, no ContextCite."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import attribution_contextcite as bench


def test_topk_hit_without_ties():
    scores = [0.1, 0.5, 0.3, 0.2]
    assert bench.topk_hit(scores, 1, 1) == 1.0
    assert bench.topk_hit(scores, 2, 1) == 0.0
    assert bench.topk_hit(scores, 2, 3) == 1.0
    assert bench.topk_hit(scores, 0, 3) == 0.0
    assert bench.topk_hit(scores, 0, 4) == 1.0


def test_topk_hit_splits_ties():
    assert bench.topk_hit([0.0, 0.0, 0.0, 0.0], 2, 1) == pytest.approx(0.25)  # all tied: chance
    assert bench.topk_hit([0.0, 0.0, 0.0, 0.0], 2, 3) == pytest.approx(0.75)
    assert bench.topk_hit([0.9, 0.4, 0.4, 0.1], 1, 1) == 0.0
    assert bench.topk_hit([0.9, 0.4, 0.4, 0.1], 1, 2) == pytest.approx(0.5)
    assert bench.topk_hit([0.9, 0.4, 0.4, 0.1], 2, 3) == 1.0
    with pytest.raises(IndexError):
        bench.topk_hit([0.1], 1, 1)


def test_source_auc():
    assert bench.source_auc([0.1, 0.9, 0.3], 1) == 1.0
    assert bench.source_auc([0.1, 0.9, 0.3], 0) == 0.0
    assert bench.source_auc([0.1, 0.9, 0.3], 2) == 0.5
    assert bench.source_auc([0.2, 0.2, 0.2, 0.2], 3) == 0.5  # uniform (degenerate) scores: chance
    assert bench.source_auc([0.5, 0.5, 0.1], 0) == pytest.approx(0.75)
    assert bench.source_auc([1.0], 0) is None


def test_summarize_skips_rows_without_a_target():
    rows = [
        {"scores": [0.1, 0.8, 0.1], "target": 1},
        {"scores": [0.6, 0.3, 0.1], "target": 1},
        {"scores": [0.3, 0.3, 0.4], "target": None},
    ]
    out = bench.summarize(rows)
    assert out["n"] == 2 and out["top1"] == 0.5 and out["top3"] == 1.0 and out["auc"] == 0.75
    assert bench.summarize([])["top1"] is None


def test_matched_ablations():
    assert bench.matched_ablations(0.05, 1.0) == 1  # less than a forward: one ablation
    assert bench.matched_ablations(5.0, 1.0) == 6  # nearest on a log scale (4 and 6 around 5)
    assert bench.matched_ablations(7.0, 1.0) == 8
    assert bench.matched_ablations(100.0, 1.0) == 64
    assert bench.matched_ablations(3.0, 1.0, [2, 4]) == 4  # 3 is nearer 4 than 2 on a log scale
    assert bench.matched_ablations(1.0, 0.0) == 1  # no forward time measured: one


def test_sources_tile_the_context_and_targets():
    docs = ["Anna has a cat. It is grey.", "The ferry leaves at seven. The trip is short."]
    context = bench.context_of(docs)
    assert (
        context == "Document 1: Anna has a cat. It is grey.\nDocument 2: The ferry leaves at seven. The trip is short."
    )
    documents = bench.sources_of(docs, "document")
    assert [context[a:b] for a, b in documents] == context.split("\n")
    sentences = bench.sources_of(docs, "sentence")
    assert [context[a:b] for a, b in sentences] == [
        "Document 1: Anna has a cat.",
        "It is grey.",
        "Document 2: The ferry leaves at seven.",
        "The trip is short.",
    ]
    example = {"docs": docs, "target": 1, "answer": "seven", "fact": "The ferry leaves at seven."}
    assert bench.target_source(example, context, documents, "document") == 1
    assert bench.target_source(example, context, sentences, "sentence") == 2
    by_value = {"docs": docs, "target": 0, "answer": "grey"}  # the short set: no fact, the value's sentence
    assert bench.target_source(by_value, context, sentences, "sentence") == 1
    assert bench.target_source({**by_value, "answer": "t"}, context, sentences, "sentence") is None  # ambiguous


def test_prompt_template_renders_the_plugin_benchmarks_message():
    import attribution

    example = {"docs": ["One fact.", "Another fact."], "question": "Which fact?"}
    rendered = bench.PROMPT_TEMPLATE.format(context=bench.context_of(example["docs"]), query=example["question"])
    assert rendered == attribution.user_message(example)


def test_fact_family_c_has_distinct_subjects_and_values():
    import random

    for seed in range(20):
        facts = bench.fact_family_c(random.Random(seed), 4)
        assert len({f[2] for f in facts}) == 4 and len({f[1] for f in facts}) == 4
        for fact, _question, value in facts:
            assert value in fact


@pytest.mark.skipif(not bench.DEBIAN_FAQ.exists(), reason="debian-faq not installed (apt-get install debian-faq)")
def test_debian_faq_family():
    from rcstat_vllm.model import default_model_dir

    if not (default_model_dir() / "tokenizer.json").exists():
        pytest.skip("embedded model not converted")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    passages = bench.debian_faq_passages()
    assert len(passages) >= 10 and all(not any("://" in s for s in p) for p in passages)
    examples = bench.make_multi_fact_examples(tokenizer, 3, seed=0)
    for example in examples:
        assert len(example["docs"]) == 4
        for doc, fact in zip(example["docs"], example["facts_in_prompt"]):
            assert fact in doc  # every document holds one fact of the template
        assert example["fact"] in example["docs"][example["target"]]
        others = [d for i, d in enumerate(example["docs"]) if i != example["target"]]
        assert not any(example["answer"].lower() in d.lower() for d in others)


def test_examples_per_family():
    families = ["short", "essays-b:b", "debfaq:c"]
    assert bench.examples_per_family("5", families) == {"short": 5, "essays-b:b": 5, "debfaq:c": 5}
    assert bench.examples_per_family(7, ["short"]) == {"short": 7}
    assert bench.examples_per_family("short=30,debfaq:c=90", families) == {"short": 30, "essays-b:b": 5, "debfaq:c": 90}
    assert bench.examples_per_family("12,debfaq:c=90", families) == {"short": 12, "essays-b:b": 12, "debfaq:c": 90}
    with pytest.raises(ValueError):
        bench.examples_per_family("nosuch=3", families)


def test_contextcite_units_round_robin_over_answered():
    prompts = [
        {"family": "a", "answered": True},
        {"family": "a", "answered": False},
        {"family": "a", "answered": True},
        {"family": "b", "answered": False},
        {"family": "b", "answered": True},
    ]
    # the j-th answered prompt of every family, document level before sentence level
    assert bench.contextcite_units(prompts, "answered") == [
        (0, "document"),
        (4, "document"),
        (0, "sentence"),
        (4, "sentence"),
        (2, "document"),
        (2, "sentence"),
    ]
    assert bench.contextcite_units(prompts, "all")[:4] == [
        (0, "document"),
        (3, "document"),
        (0, "sentence"),
        (3, "sentence"),
    ]
    assert len(bench.contextcite_units(prompts, "all")) == 10


def test_reuse_contextcite_only_on_identical_answers(tmp_path):
    import json

    def prompt(index, answer_ids, with_cc):
        level = {"ranges": [[0, 5], [5, 9]], "target": 1}
        if with_cc:
            level = {**level, "contextcite": {"ablations": 64, "fits": {}}}
        return {"family": "short", "seed": 1, "index": index, "answer_ids": answer_ids, "levels": {"document": level}}

    old = tmp_path / "old.json"
    old.write_text(json.dumps({"prompts": [prompt(0, [1, 2], True), prompt(1, [3], True), prompt(2, [4], False)]}))
    new = [prompt(0, [1, 2], False), prompt(1, [3, 4], False), prompt(2, [4], False), prompt(3, [5], False)]
    for item in new:
        item["levels"]["document"].pop("contextcite", None)
    assert bench.reuse_contextcite(new, old) == 1
    assert "contextcite" in new[0]["levels"]["document"]
    assert all("contextcite" not in item["levels"]["document"] for item in new[1:])
