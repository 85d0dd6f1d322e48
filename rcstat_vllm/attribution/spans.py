"""Spans of text and of tokens: sentence splitting with character offsets, and the token range of each span.

A span is a character range [start, end) of a text plus the token range [token_start, token_end) covering it.
A token belongs to the span that holds its first non-space character (a leading space, as in " The", belongs
to the word after it); tokens with no such character (pure whitespace, chat markup) belong to no span.

Sentence rule (no model, no download): a sentence ends after ``.``, ``!`` or ``?`` (and any closing quotes or
brackets) followed by whitespace, at a line break, or at chat markup such as ``<|im_start|>`` (which is never
part of a sentence). A period after a common abbreviation (``Dr.``, ``e.g.``) or a single capital letter (an
initial) does not end a sentence; decimals (``3.5``) never do, as no space follows the point.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

__all__ = [
    "TextSpan",
    "assign_tokens",
    "chunk_spans",
    "decode_offsets",
    "prompt_offsets",
    "single_token_spans",
    "spans_for",
    "split_sentences",
    "token_spans",
]

#: Chat-template markup: ChatML / Llama-3 style special tokens.
MARKUP = re.compile(
    r"<\|im_start\|>[A-Za-z_]+\n?"  # ChatML role header
    r"|<\|start_header_id\|>[A-Za-z_]+<\|end_header_id\|>"  # Llama-3 role header
    r"|<\|[^|<>\s]{1,40}\|>|<s>|</s>"
)
_END = re.compile(r"[.!?]+[\"'”’)\]]*(?=\s)|\n")  # noqa: RUF001 - closing curly quotes end a sentence too
_ABBREVIATIONS = {
    "mr",
    "mrs",
    "ms",
    "dr",
    "prof",
    "st",
    "sr",
    "jr",
    "vs",
    "etc",
    "e.g",
    "i.e",
    "inc",
    "ltd",
    "co",
    "fig",
    "al",
    "approx",
    "dept",
    "est",
    "mt",
    "jan",
    "feb",
    "mar",
    "apr",
    "jun",
    "jul",
    "aug",
    "sep",
    "sept",
    "oct",
    "nov",
    "dec",
}


@dataclass(frozen=True)
class TextSpan:
    """Characters [start, end) of a text and the tokens [token_start, token_end) that cover them."""

    start: int
    end: int
    token_start: int = 0
    token_end: int = 0
    text: str = ""

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    def to_dict(self) -> dict:
        return asdict(self)


def _is_abbreviation(text: str, dot: int) -> bool:
    """Whether the period at ``dot`` closes an abbreviation or an initial rather than a sentence."""
    match = re.search(r"([A-Za-z][A-Za-z.]*)$", text[:dot])
    if match is None:
        return False
    word = match.group(1)
    if len(word) == 1 and word.isupper():
        return True
    return word.lower().rstrip(".") in _ABBREVIATIONS


def _trimmed(text: str, start: int, end: int) -> tuple[int, int] | None:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return (start, end) if end > start else None


def split_sentences(text: str, markup: re.Pattern | None = MARKUP) -> list[tuple[int, int]]:
    """Character ranges [start, end) of the sentences of ``text`` (trimmed, non-empty, in order)."""
    pieces: list[tuple[int, int]] = []
    cursor = 0
    regions = [(m.start(), m.end()) for m in markup.finditer(text)] if markup is not None else []
    regions.append((len(text), len(text)))
    for region_start, region_end in regions:
        segment_start = cursor
        for match in _END.finditer(text, cursor, region_start):
            if match.group(0) != "\n" and _is_abbreviation(text, match.start()):
                continue
            pieces.append((segment_start, match.end()))
            segment_start = match.end()
        pieces.append((segment_start, region_start))
        cursor = region_end
    spans = []
    for start, end in pieces:
        trimmed = _trimmed(text, start, end)
        if trimmed is not None:
            spans.append(trimmed)
    return spans


def chunk_spans(text: str, chunks: Sequence[str | Sequence[int]]) -> list[tuple[int, int]]:
    """Character ranges of user chunks: each is a string found in ``text`` (searched left to right, after
    the previous chunk) or an explicit [start, end) pair."""
    ranges: list[tuple[int, int]] = []
    cursor = 0
    for chunk in chunks:
        if isinstance(chunk, str):
            found = text.find(chunk, cursor)
            if found < 0:
                found = text.find(chunk)
            if found < 0:
                raise ValueError(f"chunk not found in the prompt: {chunk[:60]!r}")
            ranges.append((found, found + len(chunk)))
            cursor = found + len(chunk)
        else:
            start, end = int(chunk[0]), int(chunk[1])
            if not 0 <= start <= end <= len(text):
                raise ValueError(f"chunk range {chunk!r} is outside the prompt's {len(text)} characters")
            ranges.append((start, end))
    return ranges


def assign_tokens(text: str, offsets: Sequence[tuple[int, int]], ranges: Sequence[tuple[int, int]]) -> list[int]:
    """For every token, the index of the range holding its first non-space character, or -1."""
    owner = [-1] * (len(text) + 1)
    for index, (start, end) in enumerate(ranges):
        for c in range(start, min(end, len(text))):
            if owner[c] == -1:
                owner[c] = index
    result = []
    for start, end in offsets:
        found = -1
        for c in range(max(start, 0), min(end, len(text))):
            if not text[c].isspace():
                found = owner[c]
                break
        result.append(found)
    return result


def token_spans(text: str, offsets: Sequence[tuple[int, int]], ranges: Sequence[tuple[int, int]]) -> list[TextSpan]:
    """TextSpans of character ``ranges`` with the token range of each (empty range if no token maps to it;
    a span's tokens are those assigned to it, from the first to the last)."""
    owners = assign_tokens(text, offsets, ranges)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for token, owner in enumerate(owners):
        if owner >= 0:
            first.setdefault(owner, token)
            last[owner] = token
    spans = []
    for index, (start, end) in enumerate(ranges):
        t0 = first.get(index, 0)
        t1 = last[index] + 1 if index in last else t0
        spans.append(TextSpan(start, end, t0, t1, text[start:end]))
    return spans


def single_token_spans(text: str, offsets: Sequence[tuple[int, int]], skip_markup: bool = True) -> list[TextSpan]:
    """One span per token that has a non-space character outside chat markup."""
    hidden: set[int] = set()
    if skip_markup:
        for match in MARKUP.finditer(text):
            hidden.update(range(match.start(), match.end()))
    spans = []
    for token, (start, end) in enumerate(offsets):
        visible = [c for c in range(start, min(end, len(text))) if not text[c].isspace() and c not in hidden]
        if visible:
            spans.append(TextSpan(start, end, token, token + 1, text[start:end]))
    return spans


def decode_offsets(
    tokenizer, token_ids: Sequence[int], skip_special_tokens: bool = False
) -> tuple[str, list[tuple[int, int]]]:
    """The decoded text of ``token_ids`` and each token's character range in it.

    Decodes token by token when the pieces add up to the whole (the usual case); otherwise (a multi-byte
    character split across tokens) by prefixes, which is quadratic but exact.
    """
    ids = list(token_ids)
    full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    pieces = [tokenizer.decode([i], skip_special_tokens=skip_special_tokens) for i in ids]
    if "".join(pieces) == full:
        offsets, cursor = [], 0
        for piece in pieces:
            offsets.append((cursor, cursor + len(piece)))
            cursor += len(piece)
        return full, offsets
    offsets, previous = [], 0
    for i in range(len(ids)):
        length = len(tokenizer.decode(ids[: i + 1], skip_special_tokens=skip_special_tokens))
        length = max(length, previous)
        offsets.append((previous, length))
        previous = length
    return full, offsets


def prompt_offsets(tokenizer, text: str | None, token_ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]]:
    """Character ranges of the prompt tokens in the prompt text.

    Uses the tokenizer's offset mapping when re-tokenizing ``text`` gives exactly ``token_ids`` (with or
    without special tokens); otherwise falls back to decoding the ids (the text is then the decoded one).
    """
    ids = list(token_ids)
    if text is not None and getattr(tokenizer, "is_fast", False):
        for add_special in (False, True):
            encoded = tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)
            if list(encoded["input_ids"]) == ids:
                return text, [tuple(o) for o in encoded["offset_mapping"]]
    return decode_offsets(tokenizer, ids)


def spans_for(
    text: str,
    offsets: Sequence[tuple[int, int]],
    mode: str = "sentences",
    chunks: Iterable | None = None,
) -> list[TextSpan]:
    """Prompt spans by mode: ``sentences``, ``chunks`` (user chunks, strings or [start, end)) or ``tokens``."""
    if mode == "sentences":
        return token_spans(text, offsets, split_sentences(text))
    if mode == "chunks":
        if not chunks:
            raise ValueError("span mode 'chunks' needs the chunks")
        return token_spans(text, offsets, chunk_spans(text, list(chunks)))
    if mode == "tokens":
        return single_token_spans(text, offsets)
    raise ValueError(f"unknown span mode {mode!r}: sentences | chunks | tokens")
