"""How a result file was made, and whether a row in it still means what its label says.

A setting that leaves a field out runs with the plugin's default for it, so a row's meaning moves when a default
moves. :data:`DEFAULT_CHANGES` lists every change of a default since the benchmarks began (from git history of
``rcstat_vllm/config.py``), with its commit. For a result file, :func:`origin` gives the commit it was made at: the
one the file records (``environment.git.commit``, written by ``benchmarks/common.py`` since 2026-11-26) or, for
older files, the last commit that wrote the file ("from git history": the run itself came before that commit, so
a change committed between the run and the commit is taken as in effect; the run's own record of the defaults,
``plugin_defaults``, wins where a file has one). :func:`defaults_at` undoes every later change;
:func:`row_status` compares the config a row ran with against the one its label gives today and names each field
that differs and why.
"""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import result_files

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class DefaultChange:
    commit: str
    date: str
    field: str
    before: Any
    after: Any
    words: str
    #: A default that depends on the budget (``Knob.by_ratio``): the ``[from, to)`` range of ``target_ratio`` it
    #: changed at (``to`` None: no end); None: the default at every ratio, the bare config's.
    ratios: tuple[float, float | None] | None = None

    def applies_at(self, target_ratio: Any) -> bool:
        if self.ratios is None:
            return True
        low, high = self.ratios
        return isinstance(target_ratio, (int, float)) and target_ratio >= low and (high is None or target_ratio < high)


#: Every change of a default of ``RCStatConfig`` (oldest first; ``git log -G<field> -- rcstat_vllm/config.py``). A
#: field that did not exist before its change has as ``before`` the value that behaves as the code did (no carrying,
#: Eq. 6's mean, no contrast, eager compaction).
DEFAULT_CHANGES = (
    DefaultChange("77911f5", "2026-11-23T21:31:09+00:00", "window", 8, 32, "window 8 -> 32"),
    DefaultChange("77911f5", "2026-11-23T21:31:09+00:00", "target_ratio", None, 0.5, "threshold mode -> budget 0.5"),
    DefaultChange(
        "77911f5", "2026-11-23T21:31:09+00:00", "budget_scope", "layer", "model", "per-layer budget -> model-wide"
    ),
    DefaultChange("77911f5", "2026-11-23T21:31:09+00:00", "smoothing", 1, 3, "no smoothing -> smoothing 3"),
    DefaultChange("38e8f59", "2026-11-24T04:00:25+00:00", "target_ratio", 0.5, 0.4, "budget 0.5 -> 0.4"),
    DefaultChange("38e8f59", "2026-11-24T04:00:25+00:00", "sink_tokens", 0, 4, "no sinks -> 4 sink tokens"),
    DefaultChange("cc0c99b", "2026-11-25T07:37:12+00:00", "carry_forward", 0, 8, "scores carried 8 tokens forward"),
    DefaultChange("0ab025b", "2026-11-25T15:14:19+00:00", "eviction", "eager", "lazy", "eager -> lazy eviction"),
    DefaultChange(
        "74f331a", "2026-11-25T21:25:17+00:00", "query_reduction", "mean", "max", "Eq. 6's mean over queries -> the max"
    ),
    DefaultChange("5ef548a", "2026-11-26T00:42:08+00:00", "local_contrast", 0.0, 0.5, "local contrast 0 -> 0.5"),
    # Defaults by budget (Knob.by_ratio): only rows whose target_ratio is in the range moved.
    DefaultChange("b1317ab", "2026-11-28T11:02:12+00:00", "smoothing", 3, 5, "smoothing 3 -> 5 from 0.9", (0.9, None)),
    DefaultChange(
        "0d7382a", "2026-11-28T16:46:16+00:00", "value_weight", 0.0, 1.0, "value weight 0 -> 1 from 0.9", (0.9, None)
    ),
    DefaultChange(
        "9918e28", "2026-11-28T16:54:43+00:00", "value_weight", 1.0, 0.0, "value weight 1 -> 0 again", (0.9, None)
    ),
    DefaultChange("533158e", "2026-11-29T03:35:15+00:00", "chunk", 1, 4, "chunks of 1 -> 4 at 0.8", (0.8, 0.9)),
    DefaultChange("77801a0", "2026-11-29T04:00:22+00:00", "chunk", 4, 1, "chunks of 4 -> 1 at 0.8 again", (0.8, 0.9)),
    DefaultChange(
        "3d665c9",
        "2026-12-06T04:26:58+00:00",
        "group_reduction",
        "mean",
        "max",
        "query heads' mean -> max from 0.8",
        (0.8, None),
    ),
    DefaultChange(
        "22ebcdd",
        "2026-12-06T04:58:57+00:00",
        "group_reduction",
        "max",
        "mean",
        "query heads' max -> mean from 0.8 again",
        (0.8, None),
    ),
    DefaultChange(
        "6e6dabb",
        "2026-12-06T05:16:36+00:00",
        "group_reduction",
        "mean",
        "max",
        "query heads' mean -> max from 0.9",
        (0.9, None),
    ),
)
#: Fields that exist only since a change (absent from an older record: read as the change's ``before``).
INTRODUCED = {
    "carry_forward": 0,
    "query_reduction": "mean",
    "group_reduction": "mean",
    "local_contrast": 0.0,
    "contrast_radius": 256,
    "eviction": "eager",
    "layer_floor": 0.0,
    "observation_window": None,
    "decode_budget": None,
    "decode_interval": 128,
    "smoothing": 1,
    "budget_scope": "layer",
    "chunk": 1,
    "value_weight": 0.0,
    "coverage_floor": 0.0,
}
#: Fields that do not change what a row measures when nothing reads them (threshold mode ignores the contrast, a
#: per-layer budget the floor, decode fields with no decode budget): left out of comparisons where unread.
COMPARED = (
    "method",
    "c",
    "window",
    "observation_window",
    "target_ratio",
    "sink_tokens",
    "budget_scope",
    "layer_floor",
    "smoothing",
    "carry_forward",
    "local_contrast",
    "contrast_radius",
    "query_reduction",
    "group_reduction",
    "chunk",
    "value_weight",
    "coverage_floor",
    "eviction",
    "decode_budget",
    "decode_interval",
)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


@functools.cache
def _is_ancestor(older: str, newer: str) -> bool | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "merge-base", "--is-ancestor", older, newer], capture_output=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return {0: True, 1: False}.get(out.returncode)


#: Commits that rewrote result files without changing what they hold (the same JSON, written more compactly), one
#: sha per line, ``#`` comments: the last commit that *wrote* a file dates it, so these are skipped (as
#: ``git blame --ignore-revs-file`` skips formatting commits).
REWRITES_FILE = REPO / "benchmarks" / "results" / "REWRITES"


@functools.cache
def rewrite_commits() -> frozenset[str]:
    if not REWRITES_FILE.exists():
        return frozenset()
    lines = (line.split("#", 1)[0].strip() for line in REWRITES_FILE.read_text().splitlines())
    return frozenset(line for line in lines if line)


@functools.cache
def _last_commit(path: str) -> tuple[str, str] | None:
    """The last commit that wrote ``path``, in either of its forms (``NAME.json`` or ``NAME.json.gz``: a result
    gzipped by a rewrite keeps the history of its plain file), rewrites (:data:`REWRITES_FILE`) skipped."""
    skipped = rewrite_commits()
    out = _git("log", f"-{len(skipped) + 1}", "--format=%H %cI", "--", *map(str, result_files.forms(path)))
    for line in (out or "").splitlines():
        sha, date = line.split()
        if sha not in skipped:
            return sha, date
    return None


def history_available() -> bool:
    """Whether git history can date old result files (a checkout with its full history, not a shallow clone)."""
    return _git("rev-parse", "--is-shallow-repository") == "false"


def origin(path: Path, data: Mapping | None = None) -> dict:
    """``{"commit", "date", "source", "dirty"}``: the commit a result file was made at. ``source`` is ``recorded``
    (the file's ``environment.git``), ``git history`` (the last commit that wrote the file: the run came before
    it) or ``working tree`` (not committed and not recorded: taken as made now)."""
    env = (data or {}).get("environment") or {}
    git = env.get("git") or {}
    if git.get("commit"):
        return {
            "commit": git["commit"],
            "date": git.get("commit_date"),
            "source": "recorded",
            "dirty": git.get("dirty"),
        }
    if env.get("commit"):
        # tools/gpu's files: the commit the call was told (RCSTAT_COMMIT; the copy on the GPU machine has no .git)
        # and the time it ran; whether that tree was clean is not known there.
        return {"commit": env["commit"], "date": env.get("time_utc"), "source": "recorded", "dirty": None}
    try:
        rel = str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        rel = str(path)
    last = _last_commit(rel)
    if last is None:
        return {"commit": None, "date": None, "source": "working tree", "dirty": None}
    return {"commit": last[0], "date": last[1], "source": "git history", "dirty": None}


def describe_origin(o: Mapping) -> str:
    if o.get("commit") is None:
        return "not committed, no record: taken as made at the working tree"
    when = f"{o['commit'][:7]}, {(o.get('date') or '')[:10]}"
    if o["source"] == "recorded":
        return f"made at {when}" + (" (tree dirty)" if o.get("dirty") else "")
    return f"last written by {when} (git history)"


def in_effect(change: DefaultChange, o: Mapping) -> bool:
    """Whether ``change`` was in the code a file was made with. For a file dated by git history, a change made in
    the very commit that wrote the file is taken as after its run (results that motivated a change are committed
    with it: the cliff ablation with the window, smoothing and scope defaults)."""
    if o.get("commit") is None:
        return True
    if o.get("source") == "git history" and o["commit"].startswith(change.commit):
        return False
    anc = _is_ancestor(change.commit, o["commit"])
    if anc is not None:
        return anc
    return bool(o.get("date")) and change.date <= o["date"]


def current_defaults() -> dict:
    from rcstat_vllm.config import RCStatConfig

    return RCStatConfig().to_dict()


def defaults_at(o: Mapping, recorded: Mapping | None = None) -> dict:
    """The plugin's defaults when a file was made: its own record where it has one (``plugin_defaults``; fields
    that did not exist yet read as :data:`INTRODUCED`), else today's with every later :data:`DEFAULT_CHANGES`
    undone."""
    now = current_defaults()
    if recorded:
        return {**now, **{k: v for k, v in INTRODUCED.items() if k not in recorded}, **recorded}
    then = dict(now)
    for change in reversed(DEFAULT_CHANGES):  # newest first, so the oldest undone change sets the value
        if change.ratios is None and not in_effect(change, o):
            then[change.field] = change.before
    return then


def ran_config(then: Mapping, server: Mapping | None, override: Mapping | None, o: Mapping) -> dict:
    """The config a row ran with, from the defaults when its file was made (:func:`defaults_at`), the engine's flag
    and the row's override: a default that depended on the budget then (a ratio-scoped change in effect) resolved
    at the row's ``target_ratio``, unless the flag or the override gave the field."""
    ran = merge(merge(then, server), override)
    given = set(server or {}) | set(override or {})
    for change in DEFAULT_CHANGES:  # oldest first: a later change of the same range wins
        scoped = change.ratios is not None and change.field not in given
        if scoped and in_effect(change, o) and change.applies_at(ran.get("target_ratio")):
            ran[change.field] = change.after
    return ran


def merge(base: Mapping, override: Mapping | None) -> dict:
    """``base`` with ``override`` applied as the plugin applies it (``c`` without ``target_ratio`` = threshold)."""
    out = dict(base)
    override = dict(override or {})
    if "c" in override and "target_ratio" not in override:
        override["target_ratio"] = None
    out.update(override)
    return out


def now_config(server: Mapping | None, override: Mapping | None) -> dict:
    """The config a row's flag and override give today, resolved as the plugin resolves them (``RCStatConfig``: a
    default that depends on ``target_ratio``, ``Knob.by_ratio``, follows the row's ratio); a plain :func:`merge` over
    today's defaults where today's plugin would not take the override (a field since renamed or removed)."""
    from rcstat_vllm.config import ConfigError, RCStatConfig

    try:
        return RCStatConfig.from_dict(server or {}).merged(override).to_dict()
    except (ConfigError, TypeError):
        return merge(merge(current_defaults(), server), override)


def changes_after(o: Mapping) -> list[DefaultChange]:
    return [c for c in DEFAULT_CHANGES if not in_effect(c, o)]


def _read(config: Mapping) -> set[str]:
    """The fields that change what a config does (unread ones left out: see :data:`COMPARED`)."""
    fields = set(COMPARED)
    if config.get("method") == "none":
        return {"method"}
    if config.get("method") != "rc":
        fields -= {"smoothing", "carry_forward", "local_contrast", "contrast_radius", "query_reduction"}
        fields -= {"group_reduction", "chunk", "value_weight"}
    if config.get("target_ratio") is None:
        fields -= {"local_contrast", "contrast_radius", "budget_scope", "layer_floor", "chunk", "value_weight"}
        fields.discard("coverage_floor")
    else:
        fields -= {"c"}
    if config.get("budget_scope") != "model":
        fields.discard("layer_floor")
    if not config.get("local_contrast"):
        fields.discard("contrast_radius")
    if config.get("decode_budget") is None:
        fields -= {"decode_interval"}
    return fields


def row_status(ran: Mapping, now: Mapping, pinned: Mapping | None, o: Mapping, ignore=()) -> list[str]:
    """Why a row does not mean today what it meant when it ran, one phrase per field: a default changed since the
    file (``field X when it ran, Y now (default since <commit>)``) or the label's settings changed (``pinned now``).
    Empty when the row still means the same."""
    reasons = []
    # the last change of each field after the file, among those at the row's own ratio (a default by budget moves
    # only the rows in its range)
    ratio = now.get("target_ratio")
    later = {c.field: c for c in changes_after(o) if c.applies_at(ratio)}
    for field in sorted((_read(ran) | _read(now)) - set(ignore)):
        a, b = ran.get(field), now.get(field)
        if a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and float(a) == float(b)):
            continue
        if pinned is not None and field in pinned:
            reasons.append(f"{field} {a!r} when it ran, pinned to {b!r} now")
        elif field in later:
            reasons.append(f"{field} {a!r} when it ran (default {b!r} since {later[field].commit})")
        else:
            reasons.append(f"{field} {a!r} when it ran, {b!r} now")
    return reasons
