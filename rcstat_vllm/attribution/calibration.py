"""Per-model head calibration for attribution: which heads' RC finds the source, learned once, offline.

Today's served path ranks heads by their RC over the request (Step 1) and keeps the top 2%; on prompts whose
sources compete (four documents of one form) those heads are the same few on every family and pick the right
document little above chance (docs/benchmarks.md, "Attribution beside ContextCite"). Calibration learns, once per
model, a weight per (layer, head) from ablations on generated synthetic prompts:

* **Data** (:func:`make_prompts`): 4 documents cut from the software licences Debian ships
  (``/usr/share/common-licenses``: GPL-3, Apache-2.0, MPL-2.0, GFDL-1.3, LGPL-2.1, Artistic), each of 60-200 tokens.
  Half the prompts plant one fact in one document (the question asks for it); half plant a fact of one template in
  *every* document (four subjects, four values) and ask for one. The templates and word lists
  (:data:`TEMPLATES`: shelves, teachers, bicycles, gates, ferries) share no template, subject or value list with the
  benchmarks' fact families ``a``, ``b``, ``c`` or the ``short`` set, and the licences are none of the benchmarks'
  texts (Paul Graham essays, the Python reference, the Debian FAQ).
* **Target** (:func:`ablation_target`): the model answers greedily; on answers that contain the asked value, each
  document is removed in turn and the answer's log-probability measured (4 forward passes): the document whose
  removal costs most is the source. Prompts where that is not the planted document are dropped.
* **Fit** (:func:`fit_head_weights`): every head scores the 4 documents with the served span score (Eq. 10 terms,
  ``window`` of 8, answer tokens weighted as served: :func:`~rcstat_vllm.attribution.estimators.token_weights`);
  a head's hit rate is how often its best document is the source (ties split). The ``k`` heads of highest hit rate
  are kept, each weighted by its hit rate above chance over its mean span score (so that heads of large RC do not
  drown the others).

The file (:mod:`rcstat_vllm.attribution.head_weights`: its format, where it is looked for, written and read; JSON) is
written next to the model or in the cache dir; the served path uses it when present and today's RC ranking when not.
The embedded model's is shipped (:mod:`rcstat_vllm.attribution.embedded_calibration`) and placed by ``rcstat-vllm
fetch-model``.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rcstat_vllm.attribution.head_weights import HeadWeights, save_head_weights

__all__ = [
    "calibrate",
    "fit_head_weights",
    "make_prompts",
]

LICENCES = ("GPL-3", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "LGPL-2.1", "Artistic")
LICENCE_DIR = Path("/usr/share/common-licenses")

_NAMES = ["Ottilie", "Ruben", "Sigrun", "Thaddeus", "Ulla", "Viggo", "Wilma", "Xavier", "Yvonne", "Zeno"]
_SURNAMES = ["Ashdown", "Birkett", "Crowther", "Dunmore", "Elsworth", "Fairbairn", "Grimsby", "Hartnell"]
_INSTRUMENTS = ["cello", "oboe", "harp", "trombone", "clarinet", "accordion", "banjo", "flute"]
_COLOURS = ["teal", "maroon", "ochre", "silver", "navy", "olive", "amber", "violet"]
_EXHIBITS = ["fossil hall", "map room", "tapestry wing", "clock gallery", "coin cabinet", "glass annex"]
_ISLANDS = ["Skerra", "Holmvik", "Tarrow", "Eilean Mor", "Brisa", "Kelmsey", "Orla", "Fennick"]
_PORTS = ["Westhaven", "Dunmarsh", "Calloway", "Pemberly", "Strand Quay", "Ravenscar", "Lowmoor", "Ashport"]


def _shelf(rng, n):
    names, values = rng.sample(_NAMES, n), [str(v) for v in rng.sample(range(12, 96), n)]
    return [
        (f"The parcel for {s} is waiting on shelf {v}.", f"On which shelf is the parcel for {s}?", v)
        for s, v in zip(names, values)
    ]


def _teacher(rng, n):
    subjects, values = rng.sample(_INSTRUMENTS, n), rng.sample(_SURNAMES, n)
    return [
        (f"Lessons on the {s} are given by Mr {v}.", f"Who gives lessons on the {s}?", v)
        for s, v in zip(subjects, values)
    ]


def _bicycle(rng, n):
    subjects, values = rng.sample(_COLOURS, n), rng.sample(_NAMES, n)
    return [
        (f"The {s} bicycle in the yard belongs to {v}.", f"Who owns the {s} bicycle in the yard?", v)
        for s, v in zip(subjects, values)
    ]


def _gate(rng, n):
    subjects, values = rng.sample(_EXHIBITS, n), rng.sample("ABCDEFGHJK", n)
    return [
        (f"Guided tours of the {s} start at gate {v}.", f"At which gate do tours of the {s} start?", v)
        for s, v in zip(subjects, values)
    ]


def _ferry(rng, n):
    subjects, values = rng.sample(_ISLANDS, n), rng.sample(_PORTS, n)
    return [
        (f"The ferry to {s} leaves from {v}.", f"From where does the ferry to {s} leave?", v)
        for s, v in zip(subjects, values)
    ]


#: Calibration fact templates: each returns ``n`` facts of one form with distinct subjects and values.
TEMPLATES = (_shelf, _teacher, _bicycle, _gate, _ferry)


def licence_passages(directory: Path = LICENCE_DIR) -> list[list[str]]:
    """The licences' prose as passages (one per section) of sentences."""
    from rcstat_vllm.attribution.spans import split_sentences

    passages = []
    for name in LICENCES:
        path = directory / name
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for block in re.split(r"\n\s*\n", text):
            paragraph = re.sub(r"\s+", " ", block).strip()
            if len(paragraph) < 120 or "://" in paragraph or paragraph.isupper():
                continue
            sentences = [paragraph[a:b] for a, b in split_sentences(paragraph, markup=None)]
            sentences = [s for s in sentences if 20 <= len(s) <= 400 and not re.match(r"^[\d.()a-z]+\s*$", s)]
            if len(sentences) >= 2:
                passages.append(sentences)
    if len(passages) < 8:
        raise FileNotFoundError(f"the calibration text is missing: licences under {directory} ({', '.join(LICENCES)})")
    return passages


def make_prompts(tokenizer, count: int, seed: int = 0, min_tokens: int = 60, max_tokens: int = 200) -> list[dict]:
    """``count`` calibration examples: {docs, target, question, answer, fact, multi}; seeded."""
    rng = random.Random(f"{seed}-rcstat-calibration")
    passages = licence_passages()

    def ntok(text):
        return len(tokenizer(" " + text, add_special_tokens=False)["input_ids"])

    examples: list[dict] = []
    while len(examples) < count:
        multi = len(examples) % 2 == 0
        facts = rng.choice(TEMPLATES)(rng, 4)
        target = rng.randrange(4)
        docs = []
        for position, index in enumerate(rng.sample(range(len(passages)), 4)):
            passage = passages[index]
            budget = rng.randint(min_tokens, max_tokens)
            start, total = rng.randrange(len(passage)), 0
            sentences: list[str] = []
            for i in range(start, start + len(passage)):
                sentence = passage[i % len(passage)]
                if sentences and total + ntok(sentence) > budget:
                    break
                sentences.append(sentence)
                total += ntok(sentence)
            if multi or position == target:
                sentences.insert(rng.randint(0, len(sentences)), facts[position][0])
            docs.append(" ".join(sentences))
        fact, question, value = facts[target]
        if any(value.lower() in d.lower() for i, d in enumerate(docs) if i != target):
            continue
        examples.append(
            {"docs": docs, "target": target, "question": question, "answer": value, "fact": fact, "multi": multi}
        )
    return examples


def user_message(docs: Sequence[str], question: str) -> str:
    documents = "\n".join(f"Document {i + 1}: {doc}" for i, doc in enumerate(docs))
    return (
        f"Answer the question using the documents.\n\n{documents}\n\nQuestion: {question}\n"
        "Answer in one short sentence."
    )


@torch.no_grad()
def answer_logprob(model, prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> float:
    """log p(answer | prompt) under ``model`` (one forward pass)."""
    ids = torch.as_tensor(list(prompt_ids) + list(answer_ids), dtype=torch.long).reshape(1, -1)
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1 : -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return float(logp.gather(1, torch.as_tensor(list(answer_ids)).unsqueeze(1)).sum())


def ablation_target(model, tokenizer, example: dict, answer_ids: Sequence[int]) -> list[float]:
    """The answer's log-probability lost when each document is left out (one forward pass each)."""
    from rcstat_vllm.attribution.hf import chat_prompt

    def ids(docs):
        return tokenizer(chat_prompt(tokenizer, user_message(docs, example["question"])), add_special_tokens=False)[
            "input_ids"
        ]

    full = answer_logprob(model, ids(example["docs"]), answer_ids)
    drops = []
    for i in range(len(example["docs"])):
        rest = [d for j, d in enumerate(example["docs"]) if j != i]
        drops.append(full - answer_logprob(model, ids(rest), answer_ids))
    return drops


# --------------------------------------------------------------------------------------------------------
# the fit
# --------------------------------------------------------------------------------------------------------


def head_span_scores(trace, prompt_spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """[L, Hq, S]: every head's span scores over ``prompt_spans`` as the served path reads them (each head's own
    ``window`` over its RC per prompt token), the answer's tokens weighted as served
    (``options.token_weighting``), the weights read off the RC top-k heads (the fallback's heads)."""
    from rcstat_vllm.attribution.estimators import (
        query_token_relative_contextualization,
        select_span_tokens,
        selected_span_scores,
        token_weights,
        top_heads,
        weighted_token_relative_contextualization,
    )

    options = trace.options
    heads = [(layer, head) for layer in range(trace.num_layers) for head in range(trace.num_q_heads)]
    q, kp, kg = trace.head_tensors(heads, trace.num_generated)
    per_query = query_token_relative_contextualization(q, kp, kg, 0)
    rows = [layer * trace.num_q_heads + head for layer, head in top_heads(trace.rank_heads(), trace.k)]
    weights = token_weights(per_query[rows], prompt_spans, options.token_weighting, options.span_window)
    per_token = weighted_token_relative_contextualization(per_query, weights).float()
    out = torch.zeros(len(heads), len(prompt_spans))
    for row in range(len(heads)):
        chosen = select_span_tokens(per_token[row], prompt_spans, options.span_score, options.span_window)
        out[row] = selected_span_scores(per_token[row : row + 1], chosen, options.span_score)[0]
    return out.reshape(trace.num_layers, trace.num_q_heads, len(prompt_spans))


def _hit(scores: torch.Tensor, target: int) -> float:
    mine = scores[target]
    greater = int((scores > mine).sum())
    equal = int((scores == mine).sum())
    return 1.0 / equal if greater == 0 else 0.0


def fit_head_weights(
    samples: Sequence[tuple[torch.Tensor, int]], k: int, chance: float | None = None
) -> tuple[HeadWeights, torch.Tensor]:
    """Head weights from ``samples`` of ([L, Hq, S] per-head span scores, source index).

    A head's hit rate is the share of samples where its best span is the source (ties split); the ``k`` heads of
    highest hit rate above chance (1 / S) are kept, weight = (hit rate - chance) / the head's mean span score.
    Returns (the weights, the [L, Hq] hit rates).
    """
    if not samples:
        raise ValueError("no calibration samples")
    shape = samples[0][0].shape
    hits = torch.zeros(shape[0], shape[1], dtype=torch.float64)
    scale = torch.zeros(shape[0], shape[1], dtype=torch.float64)
    for scores, target in samples:
        for layer in range(shape[0]):
            for head in range(shape[1]):
                hits[layer, head] += _hit(scores[layer, head], target)
        scale += scores.double().mean(dim=-1)
    hits /= len(samples)
    scale /= len(samples)
    chance = 1.0 / shape[2] if chance is None else chance
    flat = hits.flatten().clone()
    flat[scale.flatten() <= 0] = float("-inf")
    order = torch.argsort(flat, descending=True, stable=True)
    heads: list[tuple[int, int]] = []
    weights: list[float] = []
    for index in order.tolist():
        layer, head = divmod(index, shape[1])
        margin = float(hits[layer, head]) - chance
        if margin <= 0 or len(heads) >= k:
            break
        heads.append((layer, head))
        weights.append(margin / float(scale[layer, head]))
    if not heads:  # nothing beats chance: the single best head, weight 1 (the fallback would do as well)
        layer, head = divmod(int(order[0]), shape[1])
        heads, weights = [(layer, head)], [1.0]
    total = sum(weights)
    meta = {"shape": [shape[0], shape[1]], "hit_rates": [round(float(hits[h]), 4) for h in heads]}
    return HeadWeights(heads, [w / total for w in weights], meta), hits.float()


def calibrate(
    model_dir: str | Path | None = None,
    count: int = 48,
    seed: int = 0,
    k: int | None = None,
    max_new_tokens: int = 24,
    dtype: torch.dtype = torch.float32,
    out: str | Path | None = None,
    verbose: bool = True,
    token_weighting: str = "uniform",
    samples_out: str | Path | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Generate ``count`` synthetic prompts, answer them, ablate each document, fit the heads, write the file.

    ``token_weighting``: how the answer's tokens are weighted in the per-head span scores the fit reads (as served
    with that option). ``samples_out``: also write every kept prompt's per-head span scores under both token
    weightings, its source and its ablation drops (``torch.save``), so that fits can be redone without the model.
    """
    import dataclasses

    from rcstat_vllm.attribution.hf import chat_prompt, generate, load_model, trace_sequence
    from rcstat_vllm.attribution.options import AttributionOptions, num_top_heads
    from rcstat_vllm.attribution.spans import chunk_spans, prompt_offsets, token_spans

    if model_dir is None:
        from rcstat_vllm.model import default_model_dir

        model_dir = default_model_dir()
    started = time.perf_counter()
    model, tokenizer = load_model(model_dir, dtype=dtype)
    options = AttributionOptions(token_weighting=token_weighting)
    samples, kept, answered = [], 0, 0
    records: list[dict[str, Any]] = []
    for index, example in enumerate(make_prompts(tokenizer, count, seed)):
        prompt = chat_prompt(tokenizer, user_message(example["docs"], example["question"]))
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = generate(model, tokenizer, prompt_ids, max_new_tokens)
        answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
        if example["answer"].lower() not in answer.lower():
            continue
        answered += 1
        drops = ablation_target(model, tokenizer, example, answer_ids)
        source = max(range(len(drops)), key=lambda i: drops[i])
        record = {
            "index": index,
            "multi": example["multi"],
            "target": example["target"],
            "answer": answer,
            "drops": [round(d, 4) for d in drops],
            "source": source,
            "kept": source == example["target"],
        }
        records.append(record)
        if source != example["target"]:
            continue
        text, offsets = prompt_offsets(tokenizer, prompt, prompt_ids)
        spans = token_spans(text, offsets, chunk_spans(text, example["docs"]))
        ranges = [(s.token_start, s.token_end) for s in spans]
        trace = trace_sequence(model, prompt_ids, answer_ids, options, calibration=None)
        samples.append((head_span_scores(trace, ranges), source))
        if samples_out is not None:
            for weighting in ("uniform", "peak"):
                trace.options = dataclasses.replace(options, token_weighting=weighting)
                record[f"scores_{weighting}"] = head_span_scores(trace, ranges)
            trace.options = options
        kept += 1
        if verbose:
            print(f"[calibrate {time.perf_counter() - started:5.0f}s] {index + 1}/{count} kept {kept}", flush=True)
    config = model.config
    total_heads = config.num_hidden_layers * config.num_attention_heads
    k = num_top_heads(options, total_heads) if k is None else k
    weights, _hits = fit_head_weights(samples, k)
    weights.meta.update(
        {
            "model": Path(model_dir).name,
            "data": f"{count} synthetic prompts (licence text, templates "
            f"{', '.join(t.__name__[1:] for t in TEMPLATES)}), seed {seed}",
            "answered": answered,
            "samples": kept,
            "samples_multi": sum(1 for r in records if r["kept"] and r["multi"]),
            "dtype": str(dtype).replace("torch.", ""),
            "token_weighting": options.token_weighting,
            "seconds": round(time.perf_counter() - started, 1),
        }
    )
    if samples_out is not None:
        torch.save({"meta": dict(weights.meta), "records": records}, samples_out)
    path = save_head_weights(weights, model_dir, out)
    return path, weights.to_dict()
