"""From token-level scores to what the user reads: spans with character offsets and their Eq. 10 scores.

Split in three so that the scoring can run where the q/k are (a vLLM worker) and the text work where the
tokenizer and the texts are (the client):

* :func:`plan_spans` (client): prompt spans and generated spans, each with character and token ranges;
* :func:`score_spans` (where the trace is): Eq. 10 for every generated span, JSON-able;
* :func:`assemble` (client): the :class:`AttributionResult`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rcstat_vllm.attribution.spans import (
    TextSpan,
    decode_offsets,
    prompt_offsets,
    spans_for,
    split_sentences,
    token_spans,
)
from rcstat_vllm.attribution.trace import AttributionTrace

__all__ = [
    "AttributionResult",
    "GeneratedAttribution",
    "assemble",
    "build_result",
    "echo_mask",
    "plan_spans",
    "score_spans",
]


@dataclass
class GeneratedAttribution:
    """One generated span (character offsets into the generated text, token range into the generation),
    the Eq. 10 score of every prompt span, and the best ones."""

    span: TextSpan
    scores: list[float]
    top: list[dict[str, Any]]
    degenerate: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"span": self.span.to_dict(), "scores": self.scores, "top": self.top, "degenerate": self.degenerate}


@dataclass
class AttributionResult:
    prompt: str
    generated_text: str
    prompt_spans: list[TextSpan]
    generated: list[GeneratedAttribution]
    heads: list[tuple[int, int]] = field(default_factory=list)
    head_scores: list[float] = field(default_factory=list)
    estimator: str = "exact"
    num_generated_tokens: int = 0
    span_score: str = "mean"
    span_window: int = 16
    #: the heads' weights (1 each for the RC ranking), whether they came from the model's calibration file, and how
    #: the answer's tokens were weighted (issue 55)
    head_weights: list[float] = field(default_factory=list)
    calibrated: bool = False
    token_weighting: str = "uniform"
    #: what may make the scores wrong (e.g. prompt tokens whose keys were never seen)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "prompt_spans": [s.to_dict() for s in self.prompt_spans],
            "generated": [g.to_dict() for g in self.generated],
            "heads": [list(h) for h in self.heads],
            "head_scores": self.head_scores,
            "estimator": self.estimator,
            "span_score": self.span_score,
            "span_window": self.span_window,
            "head_weights": self.head_weights,
            "calibrated": self.calibrated,
            "token_weighting": self.token_weighting,
            "num_generated_tokens": self.num_generated_tokens,
        }
        if self.warnings:
            out["warnings"] = list(self.warnings)
        return out


def plan_spans(
    tokenizer,
    prompt: str | None,
    prompt_ids: Sequence[int],
    generated_ids: Sequence[int],
    spans: str = "sentences",
    chunks: Sequence | None = None,
    generated_spans: str | Sequence[Sequence[int]] = "sentences",
) -> tuple[str, list[TextSpan], str, list[TextSpan]]:
    """(prompt text, prompt spans, generated text, generated spans) with character and token ranges.

    Prompt offsets index ``prompt`` (when re-tokenizing it gives ``prompt_ids``; else the decoded ids).
    Generated offsets index the decoded generation without special tokens (vLLM's ``output.text``).
    """
    prompt_text, p_offsets = prompt_offsets(tokenizer, prompt, prompt_ids)
    prompt_spans = spans_for(prompt_text, p_offsets, spans, chunks)
    # Offsets index the decoded text; vLLM's output.text is the same decoding (skip_special_tokens=True).
    gen_text, g_offsets = decode_offsets(tokenizer, generated_ids, skip_special_tokens=True)
    if generated_spans == "sentences":
        ranges = split_sentences(gen_text)
    elif generated_spans == "all":
        trimmed = gen_text.strip()
        start = gen_text.find(trimmed) if trimmed else 0
        ranges = [(start, start + len(trimmed))] if trimmed else []
    else:
        ranges = [(int(a), int(b)) for a, b in generated_spans]  # type: ignore[str-unpack]  # (other str refused)
    gen_spans = token_spans(gen_text, g_offsets, ranges)
    return prompt_text, prompt_spans, gen_text, gen_spans


def echo_mask(
    prompt_ids: Sequence[int],
    prompt_ranges: Sequence[Sequence[int]],
    generated_ids: Sequence[int],
    generated_range: Sequence[int],
) -> list[bool]:
    """One bool per generated token of ``generated_range``: False where the token's id occurs in the prompt outside
    every scored prompt range (the question, the instruction, the chat markup), i.e. the answer echoes the request
    rather than a source; True elsewhere (the answer's own words: the value that carries the provenance)."""
    inside = [False] * len(prompt_ids)
    for a, b in prompt_ranges:
        for t in range(max(0, int(a)), min(len(prompt_ids), int(b))):
            inside[t] = True
    outside = {int(token) for token, covered in zip(prompt_ids, inside) if not covered}
    a, b = int(generated_range[0]), int(generated_range[1])
    return [int(token) not in outside for token in generated_ids[a:b]]


def score_spans(
    trace: AttributionTrace,
    prompt_ranges: Sequence[Sequence[int]],
    generated_ranges: Sequence[Sequence[int]],
    prune: bool = True,
    token_masks: Sequence[Sequence[bool] | None] | None = None,
) -> dict[str, Any]:
    """Eq. 10 of every generated token range over the prompt token ranges (JSON-able); ``token_masks``: one
    per generated range (:meth:`AttributionTrace.span_scores`' ``token_mask``), or None."""
    heads = trace.finalize(prune=prune)
    prompt_pairs = [(int(a), int(b)) for a, b in prompt_ranges]
    scores, degenerate = [], []
    exact = trace.options.use_exact(trace.num_generated)
    masks = list(token_masks) if token_masks is not None else [None] * len(generated_ranges)
    for (a, b), mask in zip(generated_ranges, masks):
        result = trace.span_scores(
            prompt_pairs, (int(a), int(b)), heads, head_weights=trace.top_weights, token_mask=mask
        )
        scores.append(result.scores.tolist())
        degenerate.append(result.degenerate)
    head_scores = [float(trace.head_scores[layer, h]) for layer, h in heads] if trace.head_scores is not None else []
    return {
        "heads": [[layer, h] for layer, h in heads],
        "head_scores": head_scores,
        "head_weights": list(trace.top_weights),
        "calibrated": trace.calibrated,
        "token_weighting": trace.options.token_weighting if exact else "uniform",
        "estimator": "exact" if exact else "upper",
        "span_score": trace.options.span_score,
        "span_window": trace.options.span_window,
        "num_generated_tokens": trace.num_generated,
        "num_prompt_tokens": trace.num_prompt_tokens,
        "scores": scores,
        "degenerate": degenerate,
        "pruned": trace.pruned,
        "peak_bytes": trace.peak_bytes,
        "missing_prompt_tokens": trace.missing_prompt_tokens,
    }


def assemble(
    prompt_text: str,
    prompt_spans: list[TextSpan],
    gen_text: str,
    gen_spans: list[TextSpan],
    scored: dict[str, Any],
    top: int = 3,
) -> AttributionResult:
    generated = []
    for span, scores, degenerate in zip(gen_spans, scored["scores"], scored["degenerate"]):
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top]
        best = [
            {
                "index": i,
                "score": scores[i],
                "start": prompt_spans[i].start,
                "end": prompt_spans[i].end,
                "text": prompt_spans[i].text,
            }
            for i in order
        ]
        generated.append(GeneratedAttribution(span, scores, best, degenerate))
    return AttributionResult(
        prompt=prompt_text,
        generated_text=gen_text,
        prompt_spans=prompt_spans,
        generated=generated,
        heads=[tuple(h) for h in scored["heads"]],
        head_scores=scored["head_scores"],
        estimator=scored["estimator"],
        num_generated_tokens=scored["num_generated_tokens"],
        span_score=scored.get("span_score", "mean"),
        span_window=scored.get("span_window", 16),
        head_weights=scored.get("head_weights", [1.0] * len(scored["heads"])),
        calibrated=scored.get("calibrated", False),
        token_weighting=scored.get("token_weighting", "uniform"),
        warnings=_warnings(scored),
    )


def _warnings(scored: dict[str, Any]) -> list[str]:
    out = []
    missing = scored.get("missing_prompt_tokens", 0)
    if missing:
        out.append(
            f"the keys of the first {missing} prompt tokens were never recorded (computed before the request was "
            "traced, e.g. a prefix-cache hit): spans there are scored as if their keys were zero"
        )
    return out


def build_result(
    trace: AttributionTrace,
    tokenizer,
    prompt: str | None,
    prompt_ids: Sequence[int],
    generated_ids: Sequence[int],
    spans: str = "sentences",
    chunks: Sequence | None = None,
    generated_spans: str | Sequence = "sentences",
    top: int = 3,
) -> AttributionResult:
    """Plan, score and assemble in one process (the transformers path)."""
    prompt_text, prompt_spans, gen_text, gen_spans = plan_spans(
        tokenizer, prompt, prompt_ids, generated_ids, spans, chunks, generated_spans
    )
    scored = score_spans(
        trace,
        [(s.token_start, s.token_end) for s in prompt_spans],
        [(s.token_start, s.token_end) for s in gen_spans],
        prune=False,
    )
    return assemble(prompt_text, prompt_spans, gen_text, gen_spans, scored, top)


# --------------------------------------------------------------------------------------------------------
# Terminal rendering
# --------------------------------------------------------------------------------------------------------

#: Background colours of the 1st, 2nd, 3rd... best span (ANSI 256-colour codes), then the reset.
_STYLES = ("\x1b[1;30;48;5;46m", "\x1b[30;48;5;226m", "\x1b[30;48;5;214m", "\x1b[30;48;5;117m")
_RESET = "\x1b[0m"


def render_prompt(result: AttributionResult, generated_index: int, color: bool = True, hide_markup: bool = True) -> str:
    """The prompt with the best spans of one generated span highlighted (rank 1 green, 2 yellow, 3 orange,
    4 blue; ``[[1| ... ]]`` markers without colour); chat markup hidden."""
    from rcstat_vllm.attribution.spans import MARKUP

    text = result.prompt
    marks: dict[int, list[str]] = {}
    for rank, best in enumerate(result.generated[generated_index].top):
        if color:
            opening, closing = _STYLES[min(rank, len(_STYLES) - 1)], _RESET
        else:
            opening, closing = f"[[{rank + 1}|", "]]"
        marks.setdefault(best["start"], []).append(opening)
        marks.setdefault(best["end"], []).insert(0, closing)
    hidden: set[int] = set()
    if hide_markup:
        for match in MARKUP.finditer(text):
            hidden.update(range(match.start(), match.end()))
    out = []
    for i, char in enumerate(text):
        out.extend(marks.get(i, []))
        if i not in hidden:
            out.append(char)
    out.extend(marks.get(len(text), []))
    return "".join(out).strip()
