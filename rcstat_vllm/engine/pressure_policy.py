"""What the scheduler does when its block pool is about to run short: plain functions over a snapshot of the pool
and the running requests, returning decisions (no vLLM objects; ``patches/scheduler.py`` reads vLLM's scheduler into
a :class:`PoolSnapshot` and applies what comes back).

Two decisions:

- **Lazy eviction** (:func:`relief`, before each schedule): when the blocks the schedule is about to want (every
  running request up to its next token, the rest of a prompt in chunks, the first waiting prompt), or those the
  running requests will want within the decode-time lead, exceed the free ones, compact parked plans, those freeing
  most blocks first, until their blocks cover the shortfall.
- **Decode-time compactions brought forward** (:func:`decode_shortfall`, :func:`requests_to_hurry`, after each
  schedule): requests that start together grow together, and a pool can fill before their first decode-time
  compaction is due (vLLM would preempt some, each holding generated KV its ``decode_budget`` would evict). Looking
  ``lead`` steps ahead (a window of queries to save, the scoring step and the copy's), when the running requests'
  growth exceeds the free blocks, the requests holding most generated KV beyond their budget are asked to compact
  now, until what they are expected to free covers the shortfall.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from rcstat_vllm.config import RCStatConfig
from rcstat_vllm.reports import ANTICIPATE_STEPS, SCORE_AHEAD_STEPS
from rcstat_vllm.settings import decode_queries


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class RunningRequest:
    """What the pressure checks read of a running request."""

    req_id: str
    #: its tokens (in its cache, and the one it computes next)
    num_tokens: int
    #: entries of its block list (vLLM allocates by position: a compacted request's list keeps its length)
    blocks_held: int
    #: its config when its generated KV is compressed (``decode_budget``), else None
    config: RCStatConfig | None = None
    #: tokens when it started running (the workers count its generated KV from there; None: from now)
    started_at: int | None = None
    #: tokens in its cache at its last decode-time compaction
    compacted_at: int | None = None
    #: asked to compact early and not compacted yet: (the blocks it is expected to free, the check that asked)
    hurried: tuple[int, int] | None = None
    #: a hybrid model's other KV cache groups (sliding-window layers, ...): (block size, entries of its block list)
    #: each; they allocate from the same pool (vLLM sums every group's blocks), compaction never touches them
    other_groups: tuple[tuple[int, int], ...] = ()

    def growth(self, num_tokens: int, block_size: int) -> int:
        """The blocks it takes from the pool to hold ``num_tokens``, over every group (vLLM allocates by position:
        a group's list keeps its length, skipped blocks as null blocks)."""
        own = max(0, cdiv(num_tokens, block_size) - self.blocks_held)
        return own + sum(max(0, cdiv(num_tokens, size) - held) for size, held in self.other_groups)


@dataclass(frozen=True)
class ParkedPlan:
    """A running request's parked plan (lazy eviction) and the blocks compacting it would free now (its blocks that
    only it holds, less the fresh blocks its kept KV takes: fewer than when it was parked once other requests hit its
    prompt blocks; <= 0 when compacting it would take more than it gives back)."""

    req_id: str
    blocks_freed: int
    #: its copy only copies: scored at prefill, or scored and selected ahead of the copy (:func:`to_score_ahead`)
    ready: bool = True


@dataclass(frozen=True)
class PoolSnapshot:
    free_blocks: int
    block_size: int
    running: tuple[RunningRequest, ...] = ()
    #: the first waiting request's tokens (0: none waits); its prefix-cache hits are not counted
    first_waiting_tokens: int = 0
    #: parked plans of running requests, in the order they were parked
    parked: tuple[ParkedPlan, ...] = ()
    #: block sizes of a hybrid model's other KV cache groups (they share the pool)
    other_block_sizes: tuple[int, ...] = ()


def blocks_wanted(
    running: Sequence[RunningRequest],
    first_waiting_tokens: int,
    block_size: int,
    other_block_sizes: Sequence[int] = (),
    steps_ahead: int = 0,
) -> tuple[int, str]:
    """The blocks the coming schedule is about to take (an upper bound), and what wants them: each running request's
    blocks up to its next token (the rest of its prompt for a prefill in chunks), and the first waiting request's
    whole prompt; in every KV cache group, as vLLM's ``get_num_blocks_to_allocate`` sums them (a hybrid model's
    sliding-window group takes blocks from the same pool). ``steps_ahead``: once every running request has computed
    that many more tokens."""
    growth = sum(r.growth(r.num_tokens + steps_ahead, block_size) for r in running)
    waiting = cdiv(first_waiting_tokens, block_size) + sum(
        cdiv(first_waiting_tokens, size) for size in other_block_sizes
    )
    return growth + waiting, f"{growth} blocks for running requests' growth and {waiting} for the first waiting request"


def decode_shortfall(running: Sequence[RunningRequest], free_blocks: int, block_size: int) -> tuple[int, int, str]:
    """The blocks the running requests will lack within ``lead`` steps (a window of queries to save, the scoring
    step and the copy's; <= 0: none), the lead, and why; ``(0, 0, "")`` when none compresses generated KV."""
    watched = [r.config for r in running if r.config is not None]
    if not watched:
        return 0, 0, ""
    lead = max(decode_queries(config) for config in watched) + 2
    wanted = sum(r.growth(r.num_tokens + lead, block_size) for r in running)
    return wanted - free_blocks, lead, f"{wanted} blocks wanted within {lead} steps, {free_blocks} free"


def expected_gain(request: RunningRequest, lead: int, block_size: int) -> int:
    """Blocks a decode-time compaction ``lead`` tokens from now is expected to free: the generated entries per head
    beyond the budget then (after a compaction each head holds ``decode_budget`` on average), in whole blocks."""
    budget = None if request.config is None else request.config.decode_budget
    assert budget is not None  # (asked only of requests whose generated KV is compressed)
    due_at = request.num_tokens + lead
    start = request.num_tokens if request.started_at is None else request.started_at
    generated = due_at - start if request.compacted_at is None else budget + due_at - request.compacted_at
    return max(0, generated - budget) // block_size


@dataclass(frozen=True)
class Hurry:
    """The decode-time compactions to bring forward, and the earlier requests no longer counted on."""

    #: (request id, the blocks it is expected to free), most first
    chosen: tuple[tuple[str, int], ...] = ()
    #: asked more than ``2 * lead`` checks ago and not compacted (a worker declines when its heads hold too little)
    expired: tuple[str, ...] = ()


def requests_to_hurry(running: Sequence[RunningRequest], short: int, lead: int, block_size: int, check: int) -> Hurry:
    """The requests to compact now, given the :func:`decode_shortfall` within ``lead`` steps at the ``check``-th check:
    none when it is <= 0 or when the requests asked earlier are expected to cover it; else those expected to free
    most, until their gains cover it (none expected to free nothing)."""
    watched = [r for r in running if r.config is not None]
    expired = tuple(r.req_id for r in watched if r.hurried is not None and check - r.hurried[1] > 2 * lead)
    asked = {r.req_id: r.hurried[0] for r in watched if r.hurried is not None and r.req_id not in expired}
    covered = sum(asked.values())
    if short <= covered:
        return Hurry((), expired)
    chosen = []
    gains = [(expected_gain(r, lead, block_size), r.req_id) for r in watched if r.req_id not in asked]
    for gain, req_id in sorted(gains, key=lambda g: -g[0]):
        if gain <= 0 or covered >= short:
            break
        covered += gain
        chosen.append((req_id, gain))
    return Hurry(tuple(chosen), expired)


def parked_to_compact(short: int, parked: Sequence[ParkedPlan]) -> tuple[tuple[str, ...], tuple[ParkedPlan, ...]]:
    """The parked plans to compact for a shortfall of ``short`` blocks: those freeing most first (ties: parked
    first), until what they free covers it; and the others, in that order. A plan that frees nothing now (its blocks
    shared with requests that hit its prompt since it was parked) is never chosen: compacting it would take fresh
    blocks and release none."""
    ordered = sorted((p for p in parked if p.blocks_freed > 0), key=lambda p: -p.blocks_freed)
    covered, taken = 0, 0
    while taken < len(ordered) and covered < short:
        covered += ordered[taken].blocks_freed
        taken += 1
    return tuple(p.req_id for p in ordered[:taken]), tuple(ordered[taken:])


@dataclass(frozen=True)
class Relief:
    """Lazy eviction's decision before a schedule: the blocks short (<= 0: none), why, the parked requests to compact
    now, and the parked plans left."""

    short: int
    reason: str
    compact: tuple[str, ...] = ()
    rest: tuple[ParkedPlan, ...] = ()
    #: parked plans passed over because compacting them now frees nothing (logged with the reason)
    freeing_nothing: tuple[str, ...] = ()
    #: parked plans a waiting prompt's shortfall passed over while they are scored ahead (see :func:`cover`)
    scoring: tuple[str, ...] = ()

    def after(self, freed: int) -> Relief:
        """The relief still needed once :attr:`compact` freed ``freed`` blocks: fewer than their plans said when
        blocks became shared since, or a copy was refused."""
        compact, rest = parked_to_compact(self.short - freed, self.rest)
        return replace(self, short=self.short - freed, compact=compact, rest=rest)


def shortfall(snapshot: PoolSnapshot, decode: tuple[int, str] | None = None, steps_ahead: int = 0) -> tuple[int, str]:
    """The blocks short before a schedule (<= 0: none) and why: the larger of the schedule's own
    (:func:`blocks_wanted`, ``steps_ahead`` steps later) and ``decode``, the decode-time forecast's
    (:func:`decode_shortfall`'s shortfall and reason; None when no running request compresses generated KV)."""
    free = snapshot.free_blocks
    wanted, why = blocks_wanted(
        snapshot.running, snapshot.first_waiting_tokens, snapshot.block_size, snapshot.other_block_sizes, steps_ahead
    )
    short, reason = wanted - free, f"{wanted} blocks wanted, {free} free ({why})"
    if decode is not None and decode[0] > short:
        short, reason = decode[0], f"decode-time compression: {decode[1]}"
    return short, reason


def relief(snapshot: PoolSnapshot, decode: tuple[int, str] | None = None) -> Relief:
    """Lazy eviction before a schedule: the :func:`shortfall`, covered by parked plans (:func:`parked_to_compact`);
    its part the first waiting prompt wants only by ready plans (:func:`cover`)."""
    return cover(*shortfall(snapshot, decode), snapshot.parked, urgent_shortfall(snapshot, decode))


def urgent_shortfall(snapshot: PoolSnapshot, decode: tuple[int, str] | None = None) -> int:
    """The part of the :func:`shortfall` that cannot wait: the running requests' next tokens (and the decode-time
    forecast's), without the first waiting prompt."""
    return shortfall(replace(snapshot, first_waiting_tokens=0), decode)[0]


def cover(short: int, reason: str, parked: Sequence[ParkedPlan], urgent: int | None = None) -> Relief:
    """The relief for a shortfall of ``short`` blocks (none when <= 0) from the ``parked`` plans.

    ``urgent`` (<= ``short``): the part of it the running requests need for their next tokens (vLLM would preempt
    one), covered by any plan; the rest, what the first waiting prompt wants, only by plans that are ready (their
    copy scores nothing): a plan still being scored ahead is left parked and the prompt waits a few steps, as it waits
    in vLLM when blocks are short, instead of every running request waiting for a scoring in the copy's step. None:
    the whole shortfall is urgent."""
    idle = tuple(p.req_id for p in parked if p.blocks_freed <= 0) if short > 0 else ()
    if urgent is None or urgent >= short:
        compact, rest = parked_to_compact(short, parked)
        return Relief(short, reason, compact, rest, idle)
    now, others = parked_to_compact(urgent, parked)
    covered = sum(p.blocks_freed for p in parked if p.req_id in now)
    ready = [p for p in others if p.ready]
    more, rest = parked_to_compact(short - covered, ready)
    scoring = tuple(p.req_id for p in others if not p.ready and p.blocks_freed > 0) if short > covered else ()
    return Relief(short, reason, now + more, rest, idle, scoring)


def score_ahead_shortfall(
    snapshot: PoolSnapshot, decode: tuple[int, str] | None = None, anticipated_tokens: int = 0
) -> tuple[int, int]:
    """The blocks to score parked plans ahead for (<= 0: none), and over how many steps.

    ``SCORE_AHEAD_STEPS``: the :func:`shortfall` that many steps later (a waiting prompt, the running requests'
    growth): a copy is due within a few steps. Else ``ANTICIPATE_STEPS``, when a prompt of ``anticipated_tokens``
    (the scheduler passes the longest running prompt's: serving traffic's next prompt is most often like those it
    runs) would find the pool short: nothing waits yet, so the plans its copy would take are scored a layer or so per
    step, and a prompt that arrives finds them selected, waiting only for their copy. A pool that holds another such
    prompt scores nothing ahead (plans never compacted cost no scoring)."""
    short, _ = shortfall(snapshot, decode, SCORE_AHEAD_STEPS)
    if short > 0 or anticipated_tokens <= snapshot.first_waiting_tokens:
        return short, SCORE_AHEAD_STEPS
    anticipated = replace(snapshot, first_waiting_tokens=anticipated_tokens)
    return shortfall(anticipated, decode, ANTICIPATE_STEPS)[0], ANTICIPATE_STEPS


def to_score_ahead(short_ahead: int, parked: Sequence[ParkedPlan], compacted_now: Sequence[str]) -> tuple[str, ...]:
    """The parked plans to score ahead: those a relief would compact for ``short_ahead`` blocks (the
    :func:`shortfall` ``SCORE_AHEAD_STEPS`` steps later, :data:`rcstat_vllm.reports.SCORE_AHEAD_STEPS`; those freeing
    most first, as :func:`parked_to_compact` picks), less those compacted now. A plan scored ahead and never
    compacted (its request finished first) cost its scoring and nothing else."""
    chosen, _ = parked_to_compact(short_ahead, parked)
    return tuple(req_id for req_id in chosen if req_id not in compacted_now)
