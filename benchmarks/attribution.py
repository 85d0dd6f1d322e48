"""Attribution accuracy on a synthetic set built offline, on the embedded model (transformers path).

Each example: 4 short documents with distinct invented facts (people, towns, companies, animals; names and
values drawn from fixed lists with a seeded RNG, so nothing is downloaded), a question about one of them, and
the model's greedy answer. Prompt spans are the documents (chunks); the generated span is the whole answer.
A method is right when its best-scored document is the one the question asked about.

Methods (all on the same q/k of prompt + answer, RCStat paper Section 4.2 / 5.4):
  * ``rc_topk``:   Eq. 10 with the k heads of highest expected RC (Step 1), k = 2% of heads (5 of 270);
  * ``attn_all``:  softmax attention mass on each document, averaged over all heads and answer tokens;
  * ``rc_bottomk``: Eq. 10 with the k heads of lowest expected RC.
Accuracy is reported on all examples and on those whose answer contains the asked value ("answered").

    python benchmarks/attribution.py                    # writes benchmarks/results/attribution_cpu.json
    python benchmarks/attribution.py --examples 20 --json /tmp/a.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from rcstat_vllm.attribution.core import AttributionOptions, bottom_heads, num_top_heads, top_heads
from rcstat_vllm.attribution.hf import chat_prompt, generate, load_model, trace_sequence
from rcstat_vllm.attribution.spans import chunk_spans, prompt_offsets, token_spans

RESULTS_DIR = Path(__file__).resolve().parent / "results"

FIRST = ["Anna", "Boris", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ingrid", "Jonas", "Keiko",
         "Lars", "Mira", "Nikolai", "Olga", "Pavel", "Rosa", "Stefan", "Tamsin", "Umberto"]
LAST = ["Kowalski", "Brandt", "Okafor", "Lindqvist", "Moreau", "Haddad", "Novak", "Castillo", "Petrov",
        "Yamamoto", "Fischer", "Oduya", "Marchetti", "Svensson", "Dubois"]
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
    doc = (f"{name} works as a {job} in a small village. {name.split()[0]}'s favourite food is {food}. "
           f"{name.split()[0]} has a cat named {pet}.")
    questions = [(f"What is the name of {name}'s cat?", pet), (f"What is {name}'s favourite food?", food),
                 (f"What does {name} work as?", job)]
    return name, doc, questions


def _town(rng):
    town = rng.choice(TOWNS)
    famous, colour, bridges = rng.choice(FAMOUS), rng.choice(COLOURS), str(rng.randint(3, 19))
    doc = (f"The town of {town} is famous for its {famous}. Every house in {town} has a {colour} door. "
           f"There are {bridges} bridges in {town}.")
    questions = [(f"What is the town of {town} famous for?", famous), (f"What colour are the doors in {town}?", colour),
                 (f"How many bridges are there in {town}?", bridges)]
    return town, doc, questions


def _company(rng):
    company = rng.choice(COMPANIES)
    year, product, workers = str(rng.randint(1850, 1999)), rng.choice(PRODUCTS), str(rng.randint(20, 900))
    doc = (f"{company} is a company that was founded in {year}. It makes {product}. "
           f"{company} employs {workers} people.")
    questions = [(f"In which year was {company} founded?", year), (f"What does {company} make?", product),
                 (f"How many people does {company} employ?", workers)]
    return company, doc, questions


def _animal(rng):
    animal, pet = rng.choice(ANIMALS), rng.choice(PETS)
    weight, keeper = str(rng.randint(100, 4000)), rng.choice(FIRST)
    doc = (f"The zoo's {animal} is called {pet}. It weighs {weight} kilograms. "
           f"Its keeper is a woman named {keeper}.")
    questions = [(f"What is the zoo's {animal} called?", pet), (f"How much does the zoo's {animal} weigh?", weight),
                 (f"Who is the keeper of the zoo's {animal}?", keeper)]
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
                for name, heads in (("top", top_heads(sweep_scores, sweep_k)), ("bottom", bottom_heads(sweep_scores, sweep_k))):
                    with_heads = trace.span_scores(ranges, generated, heads).scores
                    row["sweep"][f"rc_{name}{sweep_k}_{estimator}"] = int(torch.argmax(with_heads))
        row["sweep"]["rc_all_heads"] = int(torch.argmax(trace.span_scores(ranges, generated, trace.stored_heads()).scores))
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    result = run(args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    keys = ("examples", "k", "accuracy", "answered_examples", "accuracy_answered", "sweep_accuracy", "seconds")
    summary = {key: result[key] for key in keys}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
