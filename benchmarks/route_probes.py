"""What the values RC loses past 0.8 are made of: selections that are not settings, beside RC's own, on the needle
prompts of ``routes.py`` (transformers reference, float32, the plugin's scorers and selection).

For each prompt: the full cache, RC at each ``--ratios`` and, at the same ratio and pooled budget, variants of its
keep sets that answer one question each:

* ``oracle_values`` / ``oracle_needles``: RC's keep sets plus the asked values' tokens (or the whole needle
  sentences: key and value) in every head of every layer, on the prompts where RC lost a value the full cache finds.
  More entries than the ratio allows (their count is recorded): whether the lost values come back once their own
  tokens (or their needles) are everywhere. If the values' tokens alone do not bring them back, what fails is not
  their coverage (the physics paper's erasure: a token no head keeps) but how the rest of the cache routes to them.
* ``oracle_layers_A_B`` (``--layer-bands B``, with the oracles): RC's keep sets with layers A to B kept whole, one
  band of B layers at a time, on the same prompts: where in depth the lost values' routes are cut.
* ``shared_max`` / ``shared_mean``: every head of a layer scores a token alike (the max or mean of its heads'
  scores), so the heads of a layer keep the same tokens: head consensus 1, the paper's rigidity at its extreme, at
  the same budget.
* ``copies_G``: a token's k-th best head of its layer counts ``G ** (k - 1)`` of its score (the paper's
  Proposition 1: a k-th copy of a token adds least), at the same budget: consensus discouraged, not forbidden.
* ``cross_layer_W`` (``--cross-layer W ...``): a token that many layers rank high is lifted in the layers that do
  not. Scores are not comparable across layers, so each head's scores become percentiles of its own (among the
  tokens every head scores: not the window); a token's consensus is the mean over layers of its best head's
  percentile in that layer (the mean, not the max: at 0.9 nearly every token is some layer's best somewhere), itself
  turned into a percentile over tokens. Each head then orders its tokens by ``(1 - W) * own + W * consensus`` and
  hands its own scores out again in that order: every head keeps its score distribution, so the model-wide
  selection keeps as many entries per head as RC (the budget exact by construction) and only which tokens changes;
  with ``W < 0.5`` the head's own order dominates, ``W = 0`` is RC exactly.
* ``chunk_C`` (``--chunk C ...``): ChunkKV's unit (Liu et al., 2025): each head's tokens in fixed chunks of ``C``
  (by position), every token of a chunk scored with the chunk's mean, then the same model-wide selection: a long
  value's digits kept or lost together, as smoothing does softly (the window's and sinks' +inf stay; a chunk that
  holds one is scored over its finite tokens).
* ``peaks_K`` (``--peaks K ...``): the ``K`` tokens the layers agree on most (the cross-layer consensus of
  ``cross_layer_W``) and the ``PEAK_REACH`` tokens after each, lifted to the top of every head of every layer: RC's
  ``carry_forward`` (what follows a found token is kept with it) made model-wide for the few tokens the whole model
  finds, since a lost value is one its key's layers find but most layers do not keep.
* ``value_norm_A`` (``--value-norm A ...``): each head's score times the norm of the token's value vector in that KV
  head to the power ``A`` (attention's output is ``sum_t a_t v_t``: a token's expected share is ``a_t * ||v_t||``,
  as VATP and CriticalKV weight it), then the same model-wide selection (layers compared by their means as ever).

* ``group_P`` (``--group-reduction P ...``): each KV head's score of a token from its G query heads' expected RC by
  their power mean of order ``P`` (``inf``: the max) instead of RC's mean, then the same model-wide selection. A KV
  head's entry is every one of its query heads' route to the token: evicting it closes the route the query head that
  reads it most uses, so one copy head of a group that reads a value's digits and G - 1 that do not should not
  score a third of it (as ``query_reduction: max`` does for the window's queries).

* ``separators_B`` (``--separators B ...``): the separator tokens (newlines and pieces of sentence or clause
  punctuation only: :func:`separator_mask`), into which SepLLM (Chen et al., 2024) finds a model packs the segment
  they end, have every head's finite scores times ``B`` (``inf``: kept by every head of every layer), then the same
  model-wide selection.

* ``focal_S`` (``--focal S ...``): each head's focal tokens, the ones its window queries put most softmax mass on
  (SnapKV's per-token mean: :func:`focal_lifted`), ``S`` of an average head's budget, lifted above every finite score
  in that head, then the same model-wide selection: the physics paper's rigidity (Proposition 3) says evicting the
  tokens a head reads most forces it to re-route, which RC's relative scores do not protect.

* ``jitter_E_sN`` (``--jitter E ... --jitter-seeds N``): RC's scores times ``1 + E * z`` (z standard normal, draw
  ``N``), then the same selection: keep sets changed near the budget's edge with no intent (:func:`jittered`), so
  the spread of their counts is the chance a rule's gain must beat on the same prompts.

* ``induction_SxB`` (``--induction S ... --induction-boost B ...``): the share ``S`` of KV heads (over the whole
  model) that act most as induction heads (:func:`induction_scores`: one 64-token calibration prefill per model, the
  way RazorAttention finds its retrieval heads) have their scores times ``B`` before the same model-wide selection:
  a copied value is read through such heads, so they keep more of the budget.

* ``summary_{how}`` (``--evicted-summary mass_mean merged``): RC's own keep sets, decoded with one more entry per
  head that stands for its evicted entries (:data:`hf_reference.EVICTED_SUMMARIES`): ``mass_mean`` their exact share
  of each query's softmax with their values' mean (an oracle), ``merged`` their keys' mean with a log-count bias.
  The plugin renormalises each query's softmax over what a head kept, so a kept value weighs more than it did; if
  the lost values come back with the evicted mass put back, what past 0.8 loses is that reweighting, not which
  tokens are kept. One entry more per head (``extra_entries``), on every prompt.

``--keep-masks PATH --prompts FILE`` instead: RC's and the variants' keep masks (no oracles) on the prompts of
``quality.py --write-prompts FILE``, for ``quality.py --given-masks PATH`` to measure their value error beside its own
rows (its RC row at a ratio must equal ``rc_r<ratio>`` here).

``--lookahead K ...`` instead: lazy eviction (the default) compacts a request when memory runs short, often some
tokens into its answer. Here each prompt is compacted ``K`` tokens into the full cache's answer, its prompt scored
either from the window the prefill kept (the prompt's last tokens: what the plugin does; the ``K`` generated tokens
kept by every head) or from the window of the most recent tokens at that point (the answer's first ``K`` queries
among them, the window's tokens kept), at the same ratio; then greedy decoding goes on from there. Values the full
cache finds that each keeps; a value already whole in the first ``K`` tokens counts for both.

    python benchmarks/route_probes.py --seeds 5 6 7 --json benchmarks/results/route_probes_seeds5_6_7_1k_cpu.json
    python benchmarks/route_probes.py --seeds 5 6 7 8 9 --lookahead 4 12 \
        --json benchmarks/results/route_probes_lookahead_seeds5_9_1k_cpu.json
    python benchmarks/route_probes.py --seeds 5 --lengths 1024 2048 --variants --cross-layer 0.1 0.25 0.5 \
        --value-norm 0.5 1 2 --json benchmarks/results/route_probes_issue56_crosslayer_valuenorm_seed5_1k2k_cpu.json
    python benchmarks/route_probes.py --seeds 8 9 10 11 --lengths 1024 2048 --variants --value-norm 1 \
        --json benchmarks/results/route_probes_issue56_valuenorm_seeds8_11_1k2k_cpu.json
    python benchmarks/route_probes.py --seeds 5 --lengths 1024 2048 --variants --copies --chunk 4 8 16 --threads 2 \
        --json benchmarks/results/route_probes_issue56_chunk_seed5_1k2k_cpu.json
    python benchmarks/route_probes.py --seeds 5 --lengths 1024 2048 --variants --copies --peaks 2 4 8 --threads 2 \
        --json benchmarks/results/route_probes_issue56_peaks_seed5_1k2k_cpu.json
    python benchmarks/route_probes.py --seeds 22 23 24 25 --lengths 1024 2048 --variants --copies --peaks 8 --chunk 4 \
        --threads 2 --json benchmarks/results/route_probes_issue56_heldout4_seeds22_25_1k2k_cpu.json
    python benchmarks/route_probes.py --seeds 50 51 52 53 --lengths 1024 2048 --variants --separators 1.5 3 \
        --threads 2 --json benchmarks/results/route_probes_issue56_separators_heldout_seeds50_53_1k2k_cpu.json
    python benchmarks/route_probes.py --seeds 5 --lengths 1024 2048 --variants --focal 0.1 0.3 --threads 2 \
        --json benchmarks/results/route_probes_issue56_focal_seed5_1k2k_cpu.json
    python benchmarks/route_probes.py --seeds 58 59 60 61 --lengths 1024 2048 --ratios 0.8 --variants --focal 0.1 \
        --threads 2 --json benchmarks/results/route_probes_issue56_focal_r0.8_seeds58_61_1k2k_cpu.json
    python benchmarks/route_probes.py --seeds 58 59 60 61 --lengths 1024 2048 --ratios 0.9 --variants \
        --jitter 0.05 0.1 --jitter-seeds 2 --threads 2 \
        --json benchmarks/results/route_probes_issue56_jitter_r0.9_seeds58_61_1k2k_cpu.json
    python benchmarks/route_probes.py --seeds 5 --lengths 1024 2048 --variants --copies --words max mean --threads 2 \
        --json benchmarks/results/route_probes_issue56_words_seed5_1k2k_cpu.json
    python benchmarks/route_probes.py --seeds 8 9 --ratios 0.9 --variants oracle --copies --layer-bands 5 --threads 2 \
        --json benchmarks/results/route_probes_issue56_layer_bands_seeds8_9_1k_cpu.json
    python benchmarks/route_probes.py --seeds 8 9 10 11 --ratios 0.8 0.9 --variants --copies \
        --evicted-summary mass_mean merged --threads 2 \
        --json benchmarks/results/route_probes_issue56_evicted_summary_seeds8_11_1k_cpu.json
    python benchmarks/quality.py --write-prompts /tmp/quality_prompts.json
    python benchmarks/route_probes.py --keep-masks /tmp/probe_masks.pt --prompts /tmp/quality_prompts.json \
        --ratios 0.8 0.9 --variants --copies --chunk 4 --peaks 8
    python benchmarks/quality.py --cliff-ablation --variants rc_model_w32_s3_k4_c8_max_lc0.5 \
        rc_model_w32_s5_k4_c8_max_lc0.5 --ratios 0.8 0.9 --given-masks /tmp/probe_masks.pt --threads 1 \
        --json benchmarks/results/quality_issue56_chunk_peaks_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

import data
import hf_reference as ref_lib
import routes
from common import environment, load_avg, write_report
from layer_budgets import layer_rank

from rcstat_vllm.config import RCStatConfig
from rcstat_vllm.scoring import get_scorer
from rcstat_vllm.scoring.rc import expected_rc_grouped
from rcstat_vllm.settings import scorer_options, window_queries

NEEDLES = ["niah_single", "niah_multi", "niah_multikey", "niah_multivalue"]


def shared(scores: list[torch.Tensor], how: str) -> list[torch.Tensor]:
    """Each layer's heads given one score per token: the max or mean over its heads."""
    if how == "max":
        return [x.max(dim=0, keepdim=True).values.expand_as(x).contiguous() for x in scores]
    return [x.mean(dim=0, keepdim=True).expand_as(x).contiguous() for x in scores]


def copies_discounted(scores: list[torch.Tensor], g: float) -> list[torch.Tensor]:
    """A token's k-th best head (by score, within its layer) keeps ``g ** (k - 1)`` of its score."""
    out = []
    for x in scores:
        order = x.argsort(dim=0, descending=True)
        rank = torch.empty_like(order)
        rank.scatter_(0, order, torch.arange(x.shape[0]).unsqueeze(1).expand_as(x).contiguous())
        out.append(x * g ** rank.to(x.dtype))
    return out


def cross_layer(scores: list[torch.Tensor], w: float, sinks: int = 0) -> list[torch.Tensor]:
    """Each head's tokens reordered by ``(1 - w) * own percentile + w * cross-layer consensus``, its own scores handed
    out again in that order (the module's docstring); the window and the first ``sinks`` tokens (kept anyway) keep
    their scores, so every head's scores that compete for the budget are the same as before."""
    scored = torch.stack([torch.isfinite(x).all(dim=0) for x in scores]).all(dim=0)  # not the window
    scored[:sinks] = False
    pct = [torch.stack([layer_rank(row[scored].unsqueeze(0), 0)[0] for row in x]) for x in scores]  # [H, m] each
    consensus = torch.stack([p.max(dim=0).values for p in pct]).mean(dim=0)  # best head's, mean over layers
    lift = layer_rank(consensus.unsqueeze(0), 0)[0]
    out = []
    for x, p in zip(scores, pct):
        order = ((1 - w) * p + w * lift).argsort(dim=1, stable=True)  # ascending mixed rank
        y = x.clone()
        sub = torch.empty_like(x[:, scored])
        sub.scatter_(1, order, x[:, scored].sort(dim=1, stable=True).values)  # k-th lowest mix gets k-th lowest score
        y[:, scored] = sub
        out.append(y)
    return out


PEAK_REACH = 10


def peaks_lifted(scores: list[torch.Tensor], k: int, sinks: int = 0, reach: int = PEAK_REACH) -> list[torch.Tensor]:
    """``peaks_K`` above: the ``k`` highest-consensus tokens and the ``reach`` after each raised, in every head of
    every layer, just below the window's +inf (above every finite score)."""
    scored = torch.stack([torch.isfinite(x).all(dim=0) for x in scores]).all(dim=0)
    scored[:sinks] = False
    pct = [torch.stack([layer_rank(row[scored].unsqueeze(0), 0)[0] for row in x]) for x in scores]
    consensus = torch.full_like(scored, float("-inf"), dtype=torch.float32)
    consensus[scored] = torch.stack([p.max(dim=0).values for p in pct]).mean(dim=0).float()
    peaks = consensus.topk(k).indices
    lift = torch.zeros_like(scored)
    for start in peaks.tolist():
        lift[start : start + reach + 1] = True
    lift &= scored
    top = max(float(x[:, scored].max()) for x in scores) * 2 + 1
    return [x.masked_fill(lift, top) for x in scores]


def value_weighted(scores: list[torch.Tensor], values: dict, a: float) -> list[torch.Tensor]:
    """Each head's scores times ``||v_t|| ** a``, the norm of the token's value in that KV head (``values``: per
    layer [Hkv, n, d])."""
    return [x * values[i].float().norm(dim=-1).clamp_min(1e-12) ** a for i, x in enumerate(scores)]


def chunked(scores: list[torch.Tensor], c: int) -> list[torch.Tensor]:
    """Each head's finite scores replaced by the mean of their chunk of ``c`` positions (``chunk_C`` above)."""
    out = []
    for x in scores:
        finite = torch.isfinite(x)
        chunk = torch.arange(x.shape[1]) // c
        total = x.new_zeros(x.shape[0], int(chunk[-1]) + 1).index_add_(1, chunk, torch.where(finite, x, 0.0))
        count = x.new_zeros(total.shape).index_add_(1, chunk, finite.to(x.dtype))
        out.append(torch.where(finite, (total / count.clamp_min(1))[:, chunk], x))
    return out


SPACE_MARKS = ("Ġ", "▁", "Ċ")  # byte-level BPE's space and newline, sentencepiece's space
MAX_WORD_TOKENS = 16  # a longer run of continuation tokens (a hash, a URL) is cut into units of this many


def word_units(tokenizer, ids: list[int]) -> torch.Tensor:
    """[n] int64 unit index per position: a unit is a word as the tokenizer split it. A token that starts with a
    letter or digit continues the unit before it when that one ends in a letter or digit or is a bare space (the
    space before a number whose digits are tokens of their own); spaced and punctuation tokens start units."""
    pieces = tokenizer.convert_ids_to_tokens(ids)
    starts, run, previous = [], 0, ""

    def plain(text: str) -> bool:  # letters or digits, not a byte-level space or newline marker
        return text.isalnum() and not any(mark in text for mark in SPACE_MARKS)

    for piece in pieces:
        after = previous in SPACE_MARKS[:2] or plain(previous[-1:])
        joins = plain(piece[:1]) and after and run < MAX_WORD_TOKENS
        starts.append(not joins)
        run = run + 1 if joins else 1
        previous = piece
    return torch.tensor(starts).cumsum(0) - 1


def by_words(scores: list[torch.Tensor], units: torch.Tensor, how: str) -> list[torch.Tensor]:
    """``words_{how}``: each head's finite scores replaced by the max (or mean) of their word's finite scores (the
    window's and sinks' +inf stay), then the same model-wide selection: a word, and a number whose digits are tokens
    of their own, kept or evicted whole in each head."""
    out = []
    count = int(units[-1]) + 1
    for x in scores:
        finite = torch.isfinite(x)
        index = units.unsqueeze(0).expand_as(x)
        if how == "max":
            pooled = x.new_full((x.shape[0], count), float("-inf"))
            pooled.scatter_reduce_(1, index, torch.where(finite, x, float("-inf")), reduce="amax")
        else:
            total = x.new_zeros(x.shape[0], count).index_add_(1, units, torch.where(finite, x, 0.0))
            pooled = total / x.new_zeros(total.shape).index_add_(1, units, finite.to(x.dtype)).clamp_min(1)
        out.append(torch.where(finite, pooled[:, units], x))
    return out


SEPARATOR_CHARS = frozenset(".!?;:")  # sentence and clause ends; a newline (Ċ) counts too


def separator_mask(tokenizer, ids: list[int]) -> torch.Tensor:
    """[n] bool: the tokens SepLLM (Chen et al., 2024) finds the model packs its segments into: a piece that is a
    newline or only sentence and clause punctuation (after its byte-level space mark, if any)."""
    out = []
    for piece in tokenizer.convert_ids_to_tokens(ids):
        bare = piece.lstrip("Ġ▁")
        out.append(bool(bare) and ("Ċ" in bare or set(bare) <= SEPARATOR_CHARS))
    return torch.tensor(out)


def above_every_finite(scores: list[torch.Tensor]) -> float:
    """A score above every finite score of every layer: what a lifted token gets, so every head selects it."""
    return max(float(x[torch.isfinite(x)].max()) for x in scores) * 2 + 1


def separators_boosted(scores: list[torch.Tensor], separators: torch.Tensor, boost: float) -> list[torch.Tensor]:
    """``separators_B``: every head's finite scores of the separator tokens times ``boost`` (``inf``: lifted above
    every finite score, in every head of every layer), then the same model-wide selection."""
    if boost == float("inf"):
        top = above_every_finite(scores)
        return [torch.where(torch.isfinite(x) & separators, top, x) for x in scores]
    return [torch.where(torch.isfinite(x) & separators, x * boost, x) for x in scores]


def focal_lifted(scores: list[torch.Tensor], mass: list[torch.Tensor], share: float, keep: float) -> list[torch.Tensor]:
    """``focal_S``: each head's focal tokens (the physics paper's Proposition 3: the tokens a head's window queries
    put most of their softmax on, which evicting forces the head to re-route) lifted above every finite score in
    that head: its ``share * keep * n`` tokens of most window attention (``mass``: SnapKV's per-token mean, finite
    outside the window), then the same model-wide selection (the budget exact; the lifted tokens are paid for by
    the lowest scores anywhere)."""
    top = above_every_finite(scores)
    out = []
    for x, m in zip(scores, mass):
        count = max(1, round(share * keep * x.shape[1]))
        finite = torch.where(torch.isfinite(m) & torch.isfinite(x), m, torch.full_like(m, float("-inf")))
        focal = finite.topk(min(count, x.shape[1]), dim=1).indices
        lifted = x.clone()
        lifted.scatter_(1, focal, top)
        out.append(torch.where(torch.isfinite(x), lifted, x))
    return out


def jittered(scores: list[torch.Tensor], spread: float, seed: int) -> list[torch.Tensor]:
    """``jitter_E_sN``: every finite score times ``1 + E * z`` (z standard normal, generator seeded ``N``), then the
    same model-wide selection: a change of keep sets no rule intends (entries near the budget's edge swap places), to
    show how far the count of values kept moves by chance, the yardstick for any rule's gain on the same prompts."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for x in scores:
        noise = 1.0 + spread * torch.randn(x.shape, generator=gen, dtype=x.dtype)
        out.append(torch.where(torch.isfinite(x), x * noise, x))
    return out


INDUCTION_LENGTH = 32  # random tokens, repeated once: the calibration sequence (MAX_WINDOW queries in all)


def induction_scores(ref, seed: int = 0) -> torch.Tensor:
    """[layers, Hkv]: how much each KV head acts as an induction head (Olsson et al.; RazorAttention's retrieval
    heads): on ``INDUCTION_LENGTH`` random tokens repeated once, the mean attention a query of the second copy pays
    to the token after its previous occurrence, the max over the KV head's query heads. One prefill of 64 tokens per
    model, not per prompt."""
    generator = torch.Generator().manual_seed(seed)
    vocab = ref.model.config.vocab_size
    low = min(100, vocab // 4)  # (past the special tokens at the vocabulary's start)
    first = torch.randint(low, vocab - low, (INDUCTION_LENGTH,), generator=generator).tolist()
    prefill = ref.prefill(first + first)
    n, length = prefill.n, INDUCTION_LENGTH
    group = ref.num_q_heads // ref.num_kv_heads
    rows = []
    for layer in range(prefill.num_layers):
        q = prefill.queries[layer][:, -n:].float()  # [Hq, n, d]
        k = prefill.keys[layer].float().repeat_interleave(group, dim=0)  # [Hq, n, d]
        logits = q @ k.transpose(1, 2) * prefill.scale
        logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        attn = logits.softmax(dim=-1)
        i = torch.arange(1, length - 1)
        per_q_head = attn[:, length + i, i + 1].mean(dim=-1)  # [Hq]
        rows.append(per_q_head.view(ref.num_kv_heads, group).max(dim=1).values)
    return torch.stack(rows)


def induction_boosted(scores: list[torch.Tensor], induction: torch.Tensor, share: float, boost: float):
    """The KV heads in the top ``share`` of ``induction`` (over the whole model) have their finite scores times
    ``boost``: in the model-wide selection they keep more of the budget, where a copied value is read."""
    flat = induction.flatten()
    top = flat.topk(max(1, round(share * flat.numel()))).indices
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    chosen[top] = True
    chosen = chosen.view_as(induction)
    out = []
    for layer, x in enumerate(scores):
        factor = torch.where(chosen[layer], boost, 1.0).to(x.dtype).unsqueeze(1)
        out.append(torch.where(torch.isfinite(x), x * factor, x))
    return out


def group_reduced(prefill, config: RCStatConfig, p: float) -> list[torch.Tensor]:
    """RC's per layer [Hkv, n] scores as :func:`hf_reference.score_layers` computes them, with each KV head's query
    heads combined by their power mean of order ``p`` (``inf``: the max) in place of the mean (``group_P`` above)."""
    scorer = get_scorer(config.method, **scorer_options(config))
    width = min(window_queries(config), prefill.n)
    out = []
    for layer in range(prefill.num_layers):
        keys, values = prefill.keys[layer].float(), prefill.values[layer].float()
        queries = scorer._trailing_window(prefill.queries[layer][:, -width:].float(), keys)
        per_head = expected_rc_grouped(queries, keys, scorer.query_reduction).clamp_min(0)  # [Hkv, G, n - w]
        reduced = per_head.amax(dim=1) if p == float("inf") else per_head.pow(p).mean(dim=1).pow(1 / p)
        out.append(scorer._finish(reduced, queries.shape[2], scorer._value_norms(values)))
    return out


def layer_bands(num_layers: int, size: int) -> list[range]:
    """The model's layers in consecutive bands of ``size`` (the last may be shorter); none for ``size`` 0."""
    return [range(start, min(start + size, num_layers)) for start in range(0, num_layers, size)] if size else []


def with_layers(masks: list[torch.Tensor], layers: range) -> list[torch.Tensor]:
    """Keep sets with every token kept in every head of ``layers`` (``oracle_layers_A_B``)."""
    return [torch.ones_like(m) if i in layers else m.clone() for i, m in enumerate(masks)]


def with_tokens(masks: list[torch.Tensor], positions: list[int]) -> list[torch.Tensor]:
    """Keep sets plus ``positions`` in every head of every layer."""
    out = [m.clone() for m in masks]
    for m in out:
        m[:, positions] = True
    return out


def selections(
    scores: list[torch.Tensor], prefill, config: RCStatConfig, args, units: torch.Tensor, separators: torch.Tensor
) -> dict[str, list[torch.Tensor]]:
    """The keep sets of every variant ``args`` asks for (not the oracles, which need the answers), by name, at
    ``config``'s ratio and pooled budget."""
    out: dict[str, list[torch.Tensor]] = {}
    if "shared" in args.variants:
        for how in ("max", "mean"):
            out[f"shared_{how}"] = ref_lib.select_layers(shared(scores, how), config).masks
    for g in args.copies if "copies" in args.variants else []:
        out[f"copies_{g:g}"] = ref_lib.select_layers(copies_discounted(scores, g), config).masks
    for w in args.cross_layer:
        out[f"cross_layer_{w:g}"] = ref_lib.select_layers(cross_layer(scores, w, config.sink_tokens), config).masks
    for k in args.peaks:
        out[f"peaks_{k}"] = ref_lib.select_layers(peaks_lifted(scores, k, config.sink_tokens), config).masks
    for c in args.chunk:
        out[f"chunk_{c}"] = ref_lib.select_layers(chunked(scores, c), config).masks
    for how in args.words:
        out[f"words_{how}"] = ref_lib.select_layers(by_words(scores, units, how), config).masks
    for a in args.value_norm:
        out[f"value_norm_{a:g}"] = ref_lib.select_layers(value_weighted(scores, prefill.values, a), config).masks
    if args.focal:
        snapkv = RCStatConfig().merged({"method": "snapkv", "target_ratio": config.target_ratio})
        mass = ref_lib.score_layers(prefill, snapkv)
        for share in args.focal:
            lifted = focal_lifted(scores, mass, share, 1.0 - config.target_ratio)
            out[f"focal_{share:g}"] = ref_lib.select_layers(lifted, config).masks
    for spread in args.jitter:
        for seed in range(args.jitter_seeds):
            out[f"jitter_{spread:g}_s{seed}"] = ref_lib.select_layers(jittered(scores, spread, seed), config).masks
    for b in args.separators:
        out[f"separators_{b:g}"] = ref_lib.select_layers(separators_boosted(scores, separators, b), config).masks
    for p in args.group_reduction:
        out[f"group_{p:g}"] = ref_lib.select_layers(group_reduced(prefill, config, p), config).masks
    for share in args.induction:
        for boost in args.induction_boost:
            boosted = induction_boosted(scores, args.induction_heads, share, boost)
            out[f"induction_{share:g}x{boost:g}"] = ref_lib.select_layers(boosted, config).masks
    return out


def export_keep_masks(ref, args) -> None:
    """``--keep-masks``: RC's and every variant's keep masks on the prompts of ``--prompts`` (``quality.py
    --write-prompts``' file), for ``quality.py --given-masks``: {"source": "route_probes", "environment", "masks":
    {label: {sample_id: [L, H, n] bool}}, "prompt_lengths"}, labels ``<variant>_r<ratio>`` (``rc_r0.8``: RC's own,
    which quality.py's RC row at that ratio must equal)."""
    samples = json.loads(Path(args.prompts).read_text())["samples"]
    env = {key: str(value) if isinstance(value, str) else value for key, value in environment().items()}
    out: dict = {"source": "route_probes", "environment": env, "masks": {}, "prompt_lengths": {}}
    tokenizer = data.load_tokenizer()
    for sample in tqdm(samples, desc="keep masks", file=sys.stderr):
        prefill = ref.prefill(sample["prompt_ids"])
        units = word_units(tokenizer, sample["prompt_ids"])
        out["prompt_lengths"][sample["sample_id"]] = len(sample["prompt_ids"])
        for ratio in args.ratios:
            config = RCStatConfig().merged({"method": "rc", "target_ratio": ratio})
            scores = ref_lib.score_layers(prefill, config)
            masks = {
                "rc": ref_lib.select_layers(scores, config).masks,
                **selections(scores, prefill, config, args, units, separator_mask(tokenizer, sample["prompt_ids"])),
            }
            for name, layers in masks.items():
                out["masks"].setdefault(f"{name}_r{ratio:g}", {})[sample["sample_id"]] = torch.stack(layers)
    Path(args.keep_masks).parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, args.keep_masks)
    print(f"keep masks of {', '.join(out['masks'])} for {len(samples)} prompts written to {args.keep_masks}")


def kept_by_task(rows: list[dict]) -> dict[str, dict[str, int]]:
    """Per task family, ``kept_of_full`` again: for each variant the values both it and the full cache find, beside
    the full cache's count (``full``). The families move apart (a rule that gains on the lists often loses on the
    three-needle prompts), so a rule for one family is judged on it. Oracle rows, which exist only where RC lost a
    value, are left out."""
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        family = out.setdefault(row["task"], {"full": 0})
        family["full"] += sum(row["full"])
        for label, result in row["variants"].items():
            if not label.startswith("oracle"):
                kept = sum(f and g for f, g in zip(row["full"], result["found"]))
                family[label] = family.get(label, 0) + kept
    return out


def summed_over_tasks(by_task: dict[str, dict[str, int]]) -> dict[str, int]:
    """``kept_of_full`` over every family (:func:`kept_by_task`), the full cache's count last."""
    out: dict[str, int] = {}
    for counts in by_task.values():
        for label, count in counts.items():
            if label != "full":
                out[label] = out.get(label, 0) + count
    out["full"] = sum(counts["full"] for counts in by_task.values())
    return out


def print_report(report: dict) -> None:
    print(report["kept_of_full"], report.get("found"), report["oracle_recovered"])
    for task, counts in report["kept_of_full_by_task"].items():
        print(f"  {task}: " + ", ".join(f"{label} {count}" for label, count in counts.items()))


def lookahead_row(ref, sample, prefill, full_tokens, ks, ratios, found_after) -> dict:
    """One prompt compacted ``k`` tokens into its answer, for each ``k`` and ratio: scored from the prefill's window
    or from the most recent tokens' (see the module's docstring)."""
    row: dict = {}
    for k in ks:
        generated = full_tokens[: min(k, len(full_tokens) - 1)]  # (an answer shorter than k: compacted before its end)
        at_compaction = ref.prefill(sample.prompt_ids + generated)
        for ratio in ratios:
            config = RCStatConfig().merged({"method": "rc", "target_ratio": ratio})
            prefill_window = ref_lib.select_layers(ref_lib.score_layers(prefill, config), config).masks
            prefill_window = [torch.cat([m, m.new_ones(m.shape[0], len(generated))], dim=1) for m in prefill_window]
            recent_window = ref_lib.select_layers(ref_lib.score_layers(at_compaction, config), config).masks
            for name, masks in (("prefill_window", prefill_window), ("recent_window", recent_window)):
                label = f"{name}_k{k}_r{ratio:g}"
                row[label] = {
                    "found": found_after(at_compaction, masks, sample, generated),
                    "kept_entries": sum(int(m.sum()) for m in masks),
                    "generated_before": len(generated),
                }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="*", default=[5, 6, 7])
    parser.add_argument("--ratios", type=float, nargs="*", default=[0.8, 0.9])
    parser.add_argument("--lengths", type=int, nargs="*", default=[1024])
    parser.add_argument("--copies", type=float, nargs="*", default=[0.7, 0.4], help="discounts G of copies_G")
    parser.add_argument("--cross-layer", type=float, nargs="*", default=[], help="weights W of cross_layer_W")
    parser.add_argument("--value-norm", type=float, nargs="*", default=[], help="powers A of value_norm_A")
    parser.add_argument("--peaks", type=int, nargs="*", default=[], help="counts K of peaks_K")
    parser.add_argument("--chunk", type=int, nargs="*", default=[], help="chunk sizes C of chunk_C")
    parser.add_argument(
        "--group-reduction", type=float, nargs="*", default=[], help="power-mean orders P of group_P (inf: the max)"
    )
    parser.add_argument(
        "--layer-bands", type=int, default=0, help="oracle_layers_A_B: bands of this many layers kept whole (0: none)"
    )
    parser.add_argument("--words", nargs="*", default=[], choices=["max", "mean"], help="poolings of words_{how}")
    parser.add_argument("--jitter", type=float, nargs="*", default=[], help="spreads E of jitter_E_sN")
    parser.add_argument("--jitter-seeds", type=int, default=2, help="draws N of each jitter_E_sN (0 .. N-1)")
    parser.add_argument("--focal", type=float, nargs="*", default=[], help="shares S of focal_S")
    parser.add_argument("--separators", type=float, nargs="*", default=[], help="boosts B of separators_B")
    parser.add_argument("--induction", type=float, nargs="*", default=[], help="shares S of induction_SxB")
    parser.add_argument("--induction-boost", type=float, nargs="*", default=[4.0], help="boosts B of induction_SxB")
    parser.add_argument(
        "--variants", nargs="*", default=["shared", "copies", "oracle"], choices=["shared", "copies", "oracle"]
    )
    parser.add_argument(
        "--evicted-summary",
        nargs="*",
        default=[],
        choices=ref_lib.EVICTED_SUMMARIES,
        help="what stands for a head's evicted entries in summary_{how} (see above)",
    )
    parser.add_argument("--lookahead", type=int, nargs="*", default=None, help="compaction points K (see above)")
    parser.add_argument("--keep-masks", metavar="PATH", default=None, help="write keep masks instead (see above)")
    parser.add_argument("--prompts", metavar="PATH", default=None, help="--keep-masks' prompts (quality.py's)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=str(routes.RESULTS_DIR / "route_probes_cpu.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.keep_masks:
        if not args.prompts:
            parser.error("--keep-masks needs --prompts (quality.py --write-prompts' file)")
        export_keep_masks(ref_lib.ReferenceModel(), args)
        return 0
    tokenizer = data.load_tokenizer()
    spec = types.SimpleNamespace(
        tasks=NEEDLES, lengths=args.lengths, depths=[0.25, 0.75], probes=0, people=4, probe_lengths=None
    )
    samples = [s for seed in args.seeds for s in routes.build_samples(tokenizer, spec, seed)]
    ref = ref_lib.ReferenceModel()
    args.induction_heads = induction_scores(ref) if args.induction else None
    started, load_before = time.time(), load_avg()

    def found_after(prefill, masks, sample, generated: list[int], evicted: str | None = None) -> list[bool]:
        """Values found when greedy decoding over ``masks`` goes on from ``generated`` (``prefill``: its end)."""

        def stop(tokens):
            return routes.settled(sample.answers, tokenizer.decode(generated + tokens, skip_special_tokens=True))

        tokens = ref.greedy(prefill, sample.max_new_tokens - len(generated), masks=masks, stop=stop, evicted=evicted)
        return data.found_answers(sample, tokenizer.decode(generated + tokens, skip_special_tokens=True))

    def found(prefill, masks, sample, evicted: str | None = None) -> list[bool]:
        return found_after(prefill, masks, sample, [], evicted)

    rows: list[dict] = []
    recovered: dict[str, int] = {}
    found_any: dict[str, int] = {}  # values each finds, whether the full cache finds them or not
    for sample in tqdm(samples, desc="prompts", file=sys.stderr):
        prefill = ref.prefill(sample.prompt_ids)
        units = word_units(tokenizer, sample.prompt_ids)
        separators = separator_mask(tokenizer, sample.prompt_ids)
        if args.lookahead:
            full_tokens = ref.greedy(prefill, sample.max_new_tokens)
            full = data.found_answers(sample, tokenizer.decode(full_tokens, skip_special_tokens=True))
            variants = lookahead_row(ref, sample, prefill, full_tokens, args.lookahead, args.ratios, found_after)
            rows.append({"sample": sample.sample_id, "task": sample.task, "full": full, "variants": variants})
            continue
        full = found(prefill, None, sample)
        row: dict = {"sample": sample.sample_id, "task": sample.task, "full": full, "variants": {}}
        for ratio in args.ratios:
            config = RCStatConfig().merged({"method": "rc", "target_ratio": ratio})
            scores = ref_lib.score_layers(prefill, config)
            keep = ref_lib.select_layers(scores, config)
            rc = found(prefill, keep.masks, sample)
            variants = {
                name: (masks, 0) for name, masks in selections(scores, prefill, config, args, units, separators).items()
            }
            if "oracle" in args.variants and any(f and not r for f, r in zip(full, rc)):
                kept = sum(int(m.sum()) for m in keep.masks)
                for name, texts in (("oracle_values", sample.answers), ("oracle_needles", sample.meta["needles"])):
                    masks = with_tokens(keep.masks, routes.token_positions(tokenizer, sample, texts))
                    variants[name] = (masks, sum(int(m.sum()) for m in masks) - kept)
                for band in layer_bands(len(keep.masks), args.layer_bands):
                    masks = with_layers(keep.masks, band)
                    variants[f"oracle_layers_{band.start}_{band.stop - 1}"] = (
                        masks,
                        sum(int(m.sum()) for m in masks) - kept,
                    )
            results = {"rc": {"found": rc}}
            for name, (masks, extra) in variants.items():
                results[name] = {"found": found(prefill, masks, sample), "extra_entries": extra}
                if not extra:  # the same budget: entries it keeps in place of RC's
                    results[name]["swapped_entries"] = sum(int((m & ~k).sum()) for m, k in zip(masks, keep.masks))
            heads = sum(m.shape[0] for m in keep.masks)  # a summary's extra entries: one per head of every layer
            for how in args.evicted_summary:  # RC's keep sets, one entry more per head
                results[f"summary_{how}"] = {"found": found(prefill, keep.masks, sample, how), "extra_entries": heads}
            lost = [f and not r for f, r in zip(full, rc)]
            for name, result in results.items():
                label = f"{name}_r{ratio:g}"
                row["variants"][label] = result
                if name.startswith("oracle"):  # of the values RC lost, how many come back
                    recovered[label] = recovered.get(label, 0) + sum(x and g for x, g in zip(lost, result["found"]))
                else:
                    found_any[label] = found_any.get(label, 0) + sum(result["found"])
            recovered[f"lost_by_rc_r{ratio:g}"] = recovered.get(f"lost_by_rc_r{ratio:g}", 0) + sum(lost)
        found_any["full"] = found_any.get("full", 0) + sum(full)
        rows.append(row)
    report = {
        "benchmark": "route_probes",
        "environment": environment(load_avg_before=load_before, load_avg_after=load_avg()),
        "path": "transformers reference (hf_reference.py)",
        "dtype": "float32",
        "seeds": args.seeds,
        "lengths": args.lengths,
        "rows": rows,
        "kept_of_full": summed_over_tasks(by_task := kept_by_task(rows)),
        **({"found": found_any} if found_any else {}),  # (not with --lookahead)
        "oracle_recovered": recovered,
        "kept_of_full_by_task": by_task,
        "notes": "oracle_* rows exist only for prompts where RC at that ratio lost a value the full cache finds; "
        "kept_of_full counts, per variant, the values both it and the full cache find (found: all it finds, the "
        "values the full cache misses too); oracle_recovered, of the "
        "values RC lost (lost_by_rc_*), those the oracle finds",
        "wall_s": time.time() - started,
    }
    write_report(report, Path(args.json), print_report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
