"""benchmarks/routes.py (past the cliff): its probes hold what they ask, its early stop never changes what is found,
settings that differ in scoring are scored apart, and the summary splits tuning from held-out prompts."""

import random
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import data  # noqa: E402
import hf_reference  # noqa: E402
import methods  # noqa: E402
import routes  # noqa: E402
from test_benchmarks import _tokenizer, tiny_reference_model  # noqa: E402

from rcstat_vllm.config import RCStatConfig  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer()


@pytest.mark.parametrize("task", routes.PROBES)
def test_probes_hide_their_facts_in_a_haystack_and_ask_one(tokenizer, task):
    for i in range(3):
        sample = routes.probe_sample(tokenizer, task, random.Random(f"t-{task}-{i}"), "x", length=512, count=4)
        assert 400 <= sample.num_tokens <= 512
        facts = sample.meta["facts"]
        assert all(sample.prompt.count(f) == 1 for f in facts)
        (answer,) = sample.answers
        # The asked value is in the context, in one fact only; the distractors are there too and differ from it.
        assert sum(answer in f for f in facts) == 1
        assert answer not in sample.meta["distractors"]
        assert all(d in sample.prompt for d in sample.meta["distractors"])
        if task == "probe_instances":
            first = sample.meta["distractors"][sample.meta["asked_index"]]
            assert sample.prompt.index(first) < sample.prompt.index(answer)  # the first code, then the change
        assert data.found_answers(sample, f" {answer}.") == [True]


def test_same_seed_same_probes(tokenizer):
    a = routes.build_probes(tokenizer, 3, 2, 4, [512])
    b = routes.build_probes(tokenizer, 3, 2, 4, [512])
    assert [s.prompt_ids for s in a] == [s.prompt_ids for s in b]
    assert len({tuple(s.prompt_ids) for s in a}) == len(a) == 2 * len(routes.PROBES)


def test_settled_means_no_later_token_can_change_what_is_found():
    assert not routes.settled(["123"], " 123")  # "1234" could still follow
    assert routes.settled(["123"], " 123.")
    assert not routes.settled(["123"], " 1234.")
    assert not routes.settled(["123", "45"], " 123, 4")
    assert routes.settled(["123", "45"], " 123, 45 and")
    for text, answers in ((" 123.", ["123"]), (" 123, 45 and", ["123", "45"]), (" 123 x", ["123"])):
        assert routes.settled(answers, text)
        # Whatever follows, the whole-word match stays.
        assert all(all(data.answers_found(answers, text + more)) for more in ("9", "x", "0.5", ""))


def test_settings_that_score_differently_are_scored_apart():
    base = RCStatConfig().merged({"method": "rc", "target_ratio": 0.8})
    selection_only = [{"coverage_floor": 0.5}, {"layer_floor": 0.5}, {"target_ratio": 0.85}, {}]
    for change in selection_only:
        assert routes.scoring_key(base.merged(change)) == routes.scoring_key(base)
    # 0.9 smooths over 5 tokens by default (issue 56), so its scores are its own
    scoring = ({"smoothing": 5}, {"observation_window": 64}, {"carry_forward": 0}, {"local_contrast": 0.0})
    for change in (*scoring, {"target_ratio": 0.9}):
        assert routes.scoring_key(base.merged(change)) != routes.scoring_key(base)


def test_extra_settings_parse_and_labels_must_differ():
    settings = routes.settings_for([0.8], [], [], ['x={"target_ratio": 0.9, "coverage_floor": 0.5}'])
    assert [s.label for s in settings] == ["full", "default", "rc_r0.8", "x"]
    assert settings[-1].rcstat == {"target_ratio": 0.9, "coverage_floor": 0.5}
    with pytest.raises(SystemExit):
        routes.settings_for([0.8], [], [], ['rc_r0.8={"target_ratio": 0.8}'])


@pytest.mark.parametrize("spec", ["x", "=1", 'x={"target_ratio": 0.9', "x=[1]"])
def test_a_malformed_extra_setting_is_refused_naming_it(spec):
    """--extra (routes.py, accuracy.py) takes label=JSON object; anything else stops the run before it starts."""
    with pytest.raises(SystemExit, match="--extra"):
        methods.extra_setting(spec)


def test_summary_splits_tuning_from_held_out_prompts():
    settings = routes.settings_for([], [], [], ['x={"target_ratio": 0.9}'])
    rows = []
    for seed, (full, x) in {5: ([True, True], [True, False]), 6: ([True, False], [True, True])}.items():
        for label, found in (("full", full), ("default", full), ("x", x)):
            rows.append({"sample": f"s{seed}", "task": "niah_multi", "label": label, "found": found, "seed": seed})
    summary = routes.split_summaries(rows, settings, [5])
    assert summary["all"]["x"]["totals"]["needles"] == {"full_found": 3, "kept_of_full": 2, "share": 2 / 3, "gained": 1}
    assert summary["tuning"]["x"]["totals"]["needles"]["kept_of_full"] == 1
    assert summary["heldout"]["x"]["totals"]["needles"] == {
        "full_found": 1,
        "kept_of_full": 1,
        "share": 1.0,
        "gained": 1,
    }
    assert summary["heldout"]["x"]["per_task"]["niah_multi"]["found"] == 2


def test_greedy_stops_where_asked_and_not_before():
    ref = tiny_reference_model()
    ids = torch.randint(3, 96, (50,), generator=torch.Generator().manual_seed(3)).tolist()
    prefill = ref.prefill(ids)
    full = ref.greedy(prefill, 8, stop_at_eos=False)
    assert len(full) == 8
    cut = ref.greedy(prefill, 8, stop_at_eos=False, stop=lambda tokens: len(tokens) >= 3)
    assert cut == full[:3]


def test_side_by_side_scores_kvpress_against_both_full_caches_on_the_prompts_both_ran():
    routes_report = {
        "rows": [
            {"sample": "a", "task": "niah_multi", "label": "full", "found": [True, True]},
            {"sample": "a", "task": "niah_multi", "label": "rc", "found": [True, False], "ratio": 0.8},
            {"sample": "b", "task": "probe_coref", "label": "full", "found": [True]},
            {"sample": "b", "task": "probe_coref", "label": "rc", "found": [True], "ratio": 0.8},
            {"sample": "c", "task": "probe_coref", "label": "full", "found": [True]},  # kvpress did not run it
        ]
    }
    kvpress_report = {
        "rows": [
            {
                "label": "full",
                "samples": [
                    {"sample_id": "a", "found": [True, False], "evicted": 0.0},
                    {"sample_id": "b", "found": [True], "evicted": 0.0},
                ],
            },
            {
                "label": "kvzip_r0.8",
                "samples": [
                    {"sample_id": "a", "found": [False, True], "evicted": 0.8},
                    {"sample_id": "b", "found": [True], "evicted": 0.8},
                ],
            },
        ]
    }
    table = routes.side_by_side(routes_report, kvpress_report)
    assert table["prompts"] == ["a", "b"]
    kvzip = table["settings"]["kvpress_kvzip_r0.8"]
    assert kvzip["per_task"]["all"] == {
        "values": 3,
        "found": 2,
        "full_found": 3,
        "kept_of_full": 2,
        "kvpress_full_found": 2,
        "kept_of_kvpress_full": 1,
    }
    assert kvzip["evicted"] == pytest.approx(0.8)
    assert table["settings"]["rc"]["per_task"]["niah_multi"]["kept_of_full"] == 1


def test_side_by_side_refuses_prompts_that_differ_under_the_same_id():
    """An id does not fix a prompt (the build depends on the lengths asked for): answers or lengths that differ stop
    the join instead of scoring kvpress on other prompts."""
    routes_report = {
        "samples": [{"sample_id": "a", "answers": ["123"], "num_tokens": 1000}],
        "rows": [{"sample": "a", "task": "niah_single", "label": "full", "found": [True]}],
    }
    kvpress = {
        "rows": [
            {
                "label": "full",
                "samples": [
                    {"sample_id": "a", "answers": ["123"], "num_tokens": 1000, "found": [True], "evicted": 0.0}
                ],
            }
        ]
    }
    assert routes.side_by_side(routes_report, kvpress)["prompts"] == ["a"]
    kvpress["rows"][0]["samples"][0]["answers"] = ["456"]
    with pytest.raises(SystemExit, match="1 prompts differ between the two runs under the same id"):
        routes.side_by_side(routes_report, kvpress)


def test_route_probes_selections_keep_the_budget_and_do_what_they_say():
    """benchmarks/route_probes.py's variants: head-shared scores give every head of a layer the same keep set, and
    discounted copies scale a token's k-th best head by g**(k-1), both at the plugin's exact budget; the oracles add
    their tokens to every head, or keep a band of layers whole."""
    import route_probes

    gen = torch.Generator().manual_seed(0)
    scores = [torch.rand(3, 200, generator=gen) for _ in range(4)]
    config = RCStatConfig().merged({"method": "rc", "target_ratio": 0.8})
    want = hf_reference.select_layers(scores, config)
    for how in ("max", "mean"):
        keep = hf_reference.select_layers(route_probes.shared(scores, how), config)
        assert keep.ratio == pytest.approx(want.ratio, abs=1e-3)
        assert all(torch.equal(m[0], m[1]) and torch.equal(m[0], m[2]) for m in keep.masks)
    discounted = route_probes.copies_discounted(scores, 0.5)
    for x, y in zip(scores, discounted):
        ranked, _ = x.sort(dim=0, descending=True)
        torch.testing.assert_close(y.sort(dim=0, descending=True).values, ranked * torch.tensor([[1.0], [0.5], [0.25]]))
    assert hf_reference.select_layers(discounted, config).ratio == pytest.approx(want.ratio, abs=1e-3)
    added = route_probes.with_tokens(want.masks, [5, 6])
    assert all(m[:, [5, 6]].all() for m in added) and not all(m[:, [5, 6]].all() for m in want.masks)
    assert route_probes.layer_bands(30, 5)[-1] == range(25, 30) and len(route_probes.layer_bands(30, 5)) == 6
    assert route_probes.layer_bands(7, 3) == [range(0, 3), range(3, 6), range(6, 7)]
    assert route_probes.layer_bands(30, 0) == []
    banded = route_probes.with_layers(want.masks, range(1, 3))
    assert [bool(m.all()) for m in banded] == [False, True, True, False]
    assert torch.equal(banded[0], want.masks[0]) and torch.equal(banded[3], want.masks[3])


def test_route_probes_cross_layer_lifts_a_token_many_layers_keep_and_value_norm_weights_by_values():
    """cross_layer: a token every head of half the layers ranks first, and the other layers' heads rank just below
    what they keep, is kept by no head of those layers under RC and by some head of every layer with W = 0.5; each
    head keeps exactly as many entries as under RC, and W = 0 gives RC's scores. value_norm: all-equal value norms
    give RC's masks exactly; a token with a large value in one head is kept there."""
    import route_probes

    gen = torch.Generator().manual_seed(0)
    scores = [torch.rand(3, 1000, generator=gen) for _ in range(4)]
    for x in scores:
        x[:, -32:] = float("inf")  # RC marks its window kept
    t = 100
    for i, x in enumerate(scores):
        for h in range(3):
            x[h, t] = 10.0 if i < 2 else x[h, :-32].quantile(0.8)
    config = RCStatConfig().merged({"method": "rc", "target_ratio": 0.8})
    want = hf_reference.select_layers(scores, config)
    assert [bool(m[:, t].any()) for m in want.masks] == [True, True, False, False]
    assert all(torch.equal(x, y) for x, y in zip(route_probes.cross_layer(scores, 0.0, 4), scores))
    lifted = hf_reference.select_layers(route_probes.cross_layer(scores, 0.5, config.sink_tokens), config)
    assert all(bool(m[:, t].any()) for m in lifted.masks)
    assert lifted.kept == want.kept

    values = {i: torch.nn.functional.normalize(torch.randn(3, 1000, 8, generator=gen), dim=-1) * 2 for i in range(4)}
    same = hf_reference.select_layers(route_probes.value_weighted(scores, values, 1.0), config)
    assert all(torch.equal(m, w) for m, w in zip(same.masks, want.masks))
    values[2][1, t] *= 100
    weighted = hf_reference.select_layers(route_probes.value_weighted(scores, values, 1.0), config)
    assert bool(weighted.masks[2][1, t]) and weighted.ratio == pytest.approx(want.ratio, abs=1e-3)


def test_route_probes_chunks_score_every_token_of_a_chunk_alike_and_leave_the_window_alone():
    """chunk_C: a chunk's finite tokens all get the chunk's mean (a chunk holding a window's +inf is averaged over
    the rest), +inf stays; the selection over them keeps the plugin's exact budget."""
    import route_probes

    inf = float("inf")
    x = torch.tensor([[inf, 1.0, 2.0, 3.0, 4.0, 5.0, inf], [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0]])
    (got,) = route_probes.chunked([x], 2)
    assert torch.equal(got, torch.tensor([[inf, 1.0, 2.5, 2.5, 4.5, 4.5, inf], [1.0, 1.0, 5.0, 5.0, 9.0, 9.0, 12.0]]))

    gen = torch.Generator().manual_seed(0)
    scores = [torch.rand(3, 200, generator=gen) for _ in range(4)]
    config = RCStatConfig().merged({"method": "rc", "target_ratio": 0.8})
    chunks = hf_reference.select_layers(route_probes.chunked(scores, 8), config)
    want = hf_reference.select_layers(scores, config)
    assert sum(map(sum, chunks.kept)) == sum(map(sum, want.kept)) and chunks.kept != want.kept


def test_route_probes_words_pool_a_numbers_digits_and_a_words_pieces_and_leave_the_window_alone(tokenizer):
    """words_{how}: units are words as the tokenizer split them (a number's digits after its bare space, a name's
    pieces), punctuation and spaced tokens start units; pooling gives a unit's finite tokens its max or mean, +inf
    stays, and the selection over them keeps the plugin's exact budget."""
    import route_probes

    ids = tokenizer("Grey Heron is 9056558. Mrs. Thistlewood\nNext")["input_ids"]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    units = route_probes.word_units(tokenizer, ids)
    groups: dict[int, str] = {}
    for piece, unit in zip(pieces, units.tolist()):
        groups[unit] = groups.get(unit, "") + piece
    assert [text.replace("Ġ", " ").replace("Ċ", "\\n") for text in groups.values()] == [
        "Grey",
        " Heron",
        " is",
        " 9056558",
        ".",
        " Mrs",
        ".",
        " Thistlewood",
        "\\n",
        "Next",
    ]

    inf = float("inf")
    x = torch.tensor([[inf, 1.0, 2.0, 6.0, 4.0, 5.0, inf], [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0]])
    units = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    (got,) = route_probes.by_words([x], units, "max")
    assert torch.equal(got, torch.tensor([[inf, 1.0, 6.0, 6.0, 6.0, 5.0, inf], [2.0, 2.0, 8.0, 8.0, 8.0, 12.0, 12.0]]))
    (got,) = route_probes.by_words([x], units, "mean")
    assert torch.equal(got, torch.tensor([[inf, 1.0, 4.0, 4.0, 4.0, 5.0, inf], [1.0, 1.0, 6.0, 6.0, 6.0, 11.0, 11.0]]))

    gen = torch.Generator().manual_seed(0)
    scores = [torch.rand(3, 200, generator=gen) for _ in range(4)]
    config = RCStatConfig().merged({"method": "rc", "target_ratio": 0.8})
    pooled = hf_reference.select_layers(route_probes.by_words(scores, torch.arange(200) // 3, "max"), config)
    want = hf_reference.select_layers(scores, config)
    assert sum(map(sum, pooled.kept)) == sum(map(sum, want.kept)) and pooled.kept != want.kept


def test_route_probes_peaks_lift_what_follows_the_tokens_every_layer_finds_in_every_head():
    """peaks_K: the token every head of every layer ranks first and the PEAK_REACH tokens after it are kept by every
    head of every layer (under RC one layer in four keeps them), the window stays +inf, the budget is exact."""
    import route_probes

    gen = torch.Generator().manual_seed(0)
    scores = [torch.rand(3, 400, generator=gen) for _ in range(4)]
    for x in scores:
        x[:, -32:] = float("inf")
        x[:, 100] = 10.0  # every head's best: the consensus peak
    scores[0][:, 101:111] = 5.0  # one layer finds what follows it
    config = RCStatConfig().merged({"method": "rc", "target_ratio": 0.8})
    want = hf_reference.select_layers(scores, config)
    reach = slice(100, 101 + route_probes.PEAK_REACH)
    assert [bool(m[:, reach].all()) for m in want.masks] == [True, False, False, False]
    lifted = route_probes.peaks_lifted(scores, 1, config.sink_tokens)
    assert all(torch.isinf(x[:, -32:]).all() for x in lifted)
    keep = hf_reference.select_layers(lifted, config)
    assert all(bool(m[:, reach].all()) for m in keep.masks)
    assert sum(map(sum, keep.kept)) == sum(map(sum, want.kept))


def test_route_probes_separators_are_newlines_and_sentence_ends_boosted_at_the_same_budget(tokenizer):
    """separators_B: the separator tokens are newlines and pieces of sentence or clause punctuation only (not a
    word's dot-less neighbours, not a number); their finite scores times B in every head (inf: above every finite
    score, so every head keeps them), the window's +inf stays and the selection keeps exactly as many entries."""
    import route_probes

    ids = tokenizer("Grey Heron is 9056558. Who?\nNext: a, b")["input_ids"]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    mask = route_probes.separator_mask(tokenizer, ids)
    assert [p.replace("Ġ", " ").replace("Ċ", "\\n") for p, m in zip(pieces, mask.tolist()) if m] == [
        ".",
        "?",
        "\\n",
        ":",
    ]

    gen = torch.Generator().manual_seed(0)
    scores = [torch.rand(3, 600, generator=gen) for _ in range(4)]
    for x in scores:
        x[:, -32:] = float("inf")
    separators = torch.zeros(600, dtype=torch.bool)
    separators[[10, 50, 90, 590]] = True  # 590: in the window
    doubled = route_probes.separators_boosted(scores, separators, 2.0)
    for x, y in zip(scores, doubled):
        torch.testing.assert_close(y[:, :-32], torch.where(separators[:-32], x[:, :-32] * 2, x[:, :-32]))
        assert torch.isinf(y[:, -32:]).all()
    config = RCStatConfig().merged({"method": "rc", "target_ratio": 0.9})
    want = hf_reference.select_layers(scores, config)
    keep = hf_reference.select_layers(route_probes.separators_boosted(scores, separators, float("inf")), config)
    assert all(bool(m[:, [10, 50, 90]].all()) for m in keep.masks)
    assert not all(bool(m[:, [10, 50, 90]].all()) for m in want.masks)
    assert sum(map(sum, keep.kept)) == sum(map(sum, want.kept))


def test_route_probes_focal_tokens_are_each_heads_own_most_attended_kept_at_the_same_budget():
    """focal_S: each head's share * keep * n tokens of most window attention (its own, not its layer's) are lifted
    above every finite score, so that head keeps them; the window's +inf stays and the selection keeps exactly as
    many entries as RC's."""
    import route_probes

    gen = torch.Generator().manual_seed(0)
    scores = [torch.rand(2, 600, generator=gen) for _ in range(3)]
    mass = [torch.rand(2, 600, generator=gen) * 0.01 for _ in range(3)]
    for x, m in zip(scores, mass):
        x[:, -32:] = m[:, -32:] = float("inf")
        x[:, [40, 41, 300, 301]] = 0.0  # RC's lowest: evicted by every head
        m[0, [40, 41]] = 1.0  # head 0's focal tokens
        m[1, [300, 301]] = 1.0  # head 1's
    config = RCStatConfig().merged({"method": "rc", "target_ratio": 0.9})
    want = hf_reference.select_layers(scores, config)
    assert not any(bool(m[:, [40, 41, 300, 301]].any()) for m in want.masks)
    lifted = route_probes.focal_lifted(scores, mass, 2 / 60, 0.1)  # 2 tokens a head
    keep = hf_reference.select_layers(lifted, config)
    for m, x in zip(keep.masks, lifted):
        assert m[0, [40, 41]].all() and m[1, [300, 301]].all()
        assert not m[0, [300, 301]].any() and not m[1, [40, 41]].any()
        assert torch.isinf(x[:, -32:]).all()
    assert sum(map(sum, keep.kept)) == sum(map(sum, want.kept))


def test_route_probes_kept_by_task_counts_each_familys_values_found_by_both_and_leaves_oracles_out():
    import route_probes

    rows = [
        {
            "task": "lists",
            "full": [True, True, False],
            "variants": {
                "rc_r0.9": {"found": [True, False, True]},  # the third is found in place of the second: not kept
                "oracle_values_r0.9": {"found": [True, True, True], "extra_entries": 9},
            },
        },
        {"task": "lists", "full": [True, False], "variants": {"rc_r0.9": {"found": [True, False]}}},
        {"task": "single", "full": [True], "variants": {"rc_r0.9": {"found": [False]}}},
    ]
    assert route_probes.kept_by_task(rows) == {"lists": {"full": 3, "rc_r0.9": 2}, "single": {"full": 1, "rc_r0.9": 0}}


def test_route_probes_jitter_swaps_about_its_spread_of_entries_at_the_same_budget_and_repeats_by_draw():
    """jitter_E_sN: finite scores times 1 + E z, the window's +inf untouched; the same draw gives the same scores,
    another draw others; the selection keeps exactly as many entries, some of them swapped for others."""
    import route_probes

    gen = torch.Generator().manual_seed(0)
    scores = [torch.rand(3, 2000, generator=gen) for _ in range(4)]
    for x in scores:
        x[:, -32:] = float("inf")
    assert all(
        torch.equal(a, b) for a, b in zip(route_probes.jittered(scores, 0.1, 0), route_probes.jittered(scores, 0.1, 0))
    )
    assert not torch.equal(route_probes.jittered(scores, 0.1, 0)[0], route_probes.jittered(scores, 0.1, 1)[0])
    assert all(torch.isinf(x[:, -32:]).all() for x in route_probes.jittered(scores, 0.1, 0))
    config = RCStatConfig().merged({"method": "rc", "target_ratio": 0.9})
    want = hf_reference.select_layers(scores, config)
    kept = sum(map(sum, want.kept))
    for spread in (0.0, 0.1):
        keep = hf_reference.select_layers(route_probes.jittered(scores, spread, 0), config)
        assert sum(map(sum, keep.kept)) == kept
        swapped = sum(int((m & ~k).sum()) for m, k in zip(keep.masks, want.masks))
        assert swapped == 0 if spread == 0 else 0.02 * kept < swapped < 0.5 * kept


def test_route_probes_induction_heads_are_measured_once_and_boosted_at_the_same_budget():
    """induction_SxB: induction_scores is one [layers, Hkv] table from a repeated random sequence (attention weights,
    so in [0, 1]); the top share of heads get their finite scores times B (the window's +inf stays), and the
    model-wide selection keeps exactly as many entries, more of them in the boosted heads."""
    import route_probes

    ref = tiny_reference_model()
    table = route_probes.induction_scores(ref)
    assert table.shape == (ref.num_layers, ref.num_kv_heads) and bool(((table >= 0) & (table <= 1)).all())
    assert torch.equal(table, route_probes.induction_scores(ref))  # the same calibration every time
    gen = torch.Generator().manual_seed(0)
    scores = [torch.rand(3, 300, generator=gen) for _ in range(4)]
    for x in scores:
        x[:, -32:] = float("inf")
    induction = torch.zeros(4, 3)
    induction[2, 1] = 0.9  # the one induction head
    boosted = route_probes.induction_boosted(scores, induction, share=1 / 12, boost=4.0)
    for layer, (x, y) in enumerate(zip(scores, boosted)):
        for head in range(3):
            factor = 4.0 if (layer, head) == (2, 1) else 1.0
            torch.testing.assert_close(y[head, :-32], x[head, :-32] * factor)
        assert torch.isinf(y[:, -32:]).all()
    config = RCStatConfig().merged({"method": "rc", "target_ratio": 0.8})
    want, keep = hf_reference.select_layers(scores, config), hf_reference.select_layers(boosted, config)
    assert sum(map(sum, keep.kept)) == sum(map(sum, want.kept))
    assert keep.kept[2][1] > want.kept[2][1]


def test_route_probes_group_reduction_is_rc_at_order_1_and_the_query_heads_max_at_inf():
    """group_P: order 1 is RC's own scores (the GQA mean) to float rounding; order inf scores each KV head's token
    by its strongest query head (against expected_rc_grouped's per-query-head RC); order 2 never scores a token below
    the mean (the finishing steps off, so raw scores compare), and the selection keeps the plugin's exact budget."""
    import route_probes

    from rcstat_vllm.scoring.rc import expected_rc_grouped

    ref = tiny_reference_model()
    prefill = ref.prefill(torch.randint(3, 96, (120,), generator=torch.Generator().manual_seed(2)).tolist())
    raw = {"method": "rc", "target_ratio": 0.8, "smoothing": 1, "carry_forward": 0, "local_contrast": 0}
    raw["group_reduction"] = "mean"  # (the default from 0.8 on is the max: group_P's order 1 is the mean)
    defaults_but_mean = {"method": "rc", "target_ratio": 0.8, "group_reduction": "mean"}
    for config in (RCStatConfig().merged(defaults_but_mean), RCStatConfig().merged(raw)):
        for x, y in zip(route_probes.group_reduced(prefill, config, 1.0), hf_reference.score_layers(prefill, config)):
            torch.testing.assert_close(x, y)
    config = RCStatConfig().merged(raw)
    mean = hf_reference.score_layers(prefill, config)
    for layer, (best, second) in enumerate(
        zip(route_probes.group_reduced(prefill, config, float("inf")), route_probes.group_reduced(prefill, config, 2.0))
    ):
        queries = prefill.queries[layer][:, -32:].float().reshape(2, 2, 32, -1)  # [Hkv, G, w, d]
        per_head = expected_rc_grouped(queries, prefill.keys[layer].float(), config.query_reduction)
        torch.testing.assert_close(best[:, :-32], per_head.amax(dim=1))
        assert torch.isinf(best[:, -32:]).all() and torch.isinf(second[:, -32:]).all()
        assert bool((second[:, :-32] >= mean[layer][:, :-32] - 1e-6).all())
    keep = hf_reference.select_layers(route_probes.group_reduced(prefill, config, 2.0), config)
    assert sum(map(sum, keep.kept)) == sum(map(sum, hf_reference.select_layers(mean, config).kept))


def test_route_losses_sorts_a_lost_value_by_what_was_written_in_its_place():
    """benchmarks/route_losses.py: a near miss of the value itself, another value of the prompt (or a near miss of
    one), or nothing of the prompt's; only values the full cache finds and the setting loses are counted."""
    import route_losses

    values = {"9056558", "1773034", "Graz", "Turin"}
    assert route_losses.loss_kind("9056558", " 90565.", values) == "near_miss"
    assert route_losses.loss_kind("Graz", " Grapeflemm to work", values) == "near_miss"
    assert route_losses.loss_kind("9056558", "1. 1773034\n2. 1773034", values) == "another_value"
    assert route_losses.loss_kind("9056558", "1. 17730341", values) == "another_value"  # another value, copied wrong
    assert route_losses.loss_kind("Graz", " Turin, where", values) == "another_value"
    assert route_losses.loss_kind("9056558", " 4242424.", values) == "absent"

    sample = {
        "sample_id": "s",
        "task": "niah_multivalue",
        "answers": ["9056558", "1773034"],
        "meta": {"needles": ["The number is: 9056558.", "The number is: 1773034."], "distractors": []},
    }
    report = {
        "samples": [sample],
        "rows": [
            {"sample": "s", "label": "full", "found": [True, False], "output": "9056558"},
            {"sample": "s", "label": "rc_r0.9", "found": [False, False], "output": "1. 1773034"},
            {"sample": "s", "label": "rc_r0.8", "found": [True, False], "output": "9056558"},
        ],
    }
    rows = route_losses.losses(report, ["rc_r0.8", "rc_r0.9"])
    assert rows == [{"sample": "s", "task": "niah_multivalue", "label": "rc_r0.9", "kind": "another_value"}]
    assert route_losses.losses(report) == rows  # every setting but the full cache
    counted = route_losses.count(rows, ["rc_r0.8", "rc_r0.9"])
    assert counted["kinds"] == {
        "rc_r0.8": {"near_miss": 0, "another_value": 0, "absent": 0},
        "rc_r0.9": {"near_miss": 0, "another_value": 1, "absent": 0},
    }
    assert counted["by_task"] == {"rc_r0.8": {}, "rc_r0.9": {"niah_multivalue": counted["kinds"]["rc_r0.9"]}}


def test_an_evicted_summary_carries_the_evicted_mass_and_is_exact_when_the_evicted_entries_are_alike():
    """route_probes' summary_{how}: ``mass_mean``'s one entry takes exactly the softmax share the evicted entries had;
    when a head's evicted entries are all one key and value, both summaries give the full cache's logits through
    the whole model, and renormalising over the kept entries (the plugin's attention) does not."""
    ref = tiny_reference_model()
    n = 120
    prefill = ref.prefill(torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(3)).tolist())
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[:, :8], mask[:, -24:] = True, True
    mask[0, 40:50] = True  # heads keep different entries
    masks = [mask] * 2

    g = torch.Generator().manual_seed(4)
    q, keys = torch.randn(2, 2, 3, 16, generator=g), torch.randn(2, n, 16, generator=g)
    logits = torch.einsum("hgtd,hsd->hgts", q, keys) * 0.25
    logit, _ = hf_reference.evicted_summary("mass_mean", q, logits, keys, keys, mask, 0.25)
    kept = torch.softmax(torch.cat([logits.masked_fill(~mask[:, None, None, :], float("-inf")), logit], -1), -1)
    full = torch.softmax(logits, -1)
    torch.testing.assert_close(kept[..., -1], full.masked_fill(mask[:, None, None, :], 0).sum(-1))
    torch.testing.assert_close(kept[..., :-1], full.masked_fill(~mask[:, None, None, :], 0))

    for layer in range(2):  # every evicted entry of a head becomes the head's first evicted one
        for h in range(2):
            evicted = (~mask[h]).nonzero().flatten()
            prefill.keys[layer][h, evicted] = prefill.keys[layer][h, evicted[0]]
            prefill.values[layer][h, evicted] = prefill.values[layer][h, evicted[0]]
    tokens = [5, 9, 11]
    full_logits, _ = ref.decode(prefill, tokens, None)
    for how in hf_reference.EVICTED_SUMMARIES:
        summary_logits, _ = ref.decode(prefill, tokens, masks, evicted=how)
        torch.testing.assert_close(summary_logits, full_logits, atol=1e-4, rtol=1e-4)
    renormalised, _ = ref.decode(prefill, tokens, masks)
    assert (renormalised - full_logits).abs().max().item() > 1e-2
    with pytest.raises(ValueError, match="evicted summary"):
        ref.decode(prefill, tokens, masks, evicted="median")
