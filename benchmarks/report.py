"""Plots, the generated results block of docs/benchmarks.md and the README's generated blocks, from the benchmarks'
JSON in benchmarks/results/, each number named with its file, its setting as it ran and how the file was made.

    python benchmarks/report.py                 # PNGs, the block into docs/benchmarks.md, the README's blocks
    python benchmarks/report.py --no-write      # PNGs only; the block is printed (--no-readme: the old name)
    python benchmarks/report.py --check         # write nothing; exit 1 naming what no longer matches its file
    python benchmarks/report.py --stale quality_cpu.json   # where a file was made, and each row that moved

The block replaces what lies between the ``<!-- results:start -->`` and ``<!-- results:end -->`` markers of
:data:`RESULTS_DOC`, the one file that holds them; links in it are relative to that file. Each part is drawn
from whichever JSON exists (quality_cpu.json, accuracy_cpu.json, kvpress_reference_cpu.json, throughput_cpu.json,
plugin_overhead_cpu.json, throughput_prefill_cpu.json), then a table of every result file's provenance. The other
generated blocks (:data:`README_BLOCKS`: "What you get" in the README; the side-by-side table and the value error at
0.8 in docs/benchmarks.md) are written between their ``<!-- name:start -->`` / ``<!-- name:end -->`` markers in
whichever of the README and :data:`RESULTS_DOC` holds them.

How each row ran: a row's config is what it recorded (``resolved``, with the engine's ``eviction``) or the plugin's
defaults at the file's commit (benchmarks/provenance.py: the file's recorded commit, else git history) merged with
its override; a row whose config as run differs from what its label gives today (a default changed since, or the
label's settings are pinned differently now) is marked † with the reason. Figures outside the generated
blocks (in the README or docs/*.md) are listed in :data:`FIGURES` with their files; ``--check`` (run by
tests/test_benchmark_provenance.py) fails when any of them, or any generated block, no longer matches.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import math
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import methods
import provenance
import result_files
from methods import FAMILY_LABELS

RESULTS = Path(__file__).resolve().parent / "results"
#: The document whose marked block this script writes (the README links to it).
RESULTS_DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
#: The README's side-by-side table of the plugin's methods and kvpress's presses (:func:`side_by_side_table`).
README = Path(__file__).resolve().parents[1] / "README.md"
SIDE_START, SIDE_END = "<!-- side-by-side:start -->", "<!-- side-by-side:end -->"
#: Figures outside the generated blocks are listed in :data:`FIGURES` (below) and checked by ``--check``.
#: The plugin's rows of that table (accuracy.py labels), in order; missing labels are skipped.
SIDE_BY_SIDE_PLUGIN = (
    "full",
    "default",
    "default_mean_contrast0",
    "rc_r0.5",
    "rc_r0.8",
    "rc_r0.8_mean_contrast0",
    "rc_r0.8_contrast0",
    "rc_r0.8_mean",
    "snapkv_w64_r0.5",
    "snapkv_w64_r0.8",
    "tova_w1_r0.5",
    "tova_w1_r0.8",
)
STYLE = {
    "full": ("black", "*"),
    "rc": ("tab:red", "o"),
    "rc_defaults": ("tab:orange", "*"),
    "rc_budget": ("tab:orange", "s"),
    "snapkv": ("tab:blue", "^"),
    "tova": ("tab:green", "v"),
    "knorm": ("tab:purple", "D"),
    "streaming": ("tab:brown", "P"),
    "random": ("tab:gray", "x"),
    "default": ("tab:orange", "*"),
    "rc_paper": ("tab:pink", "s"),
    "rc_carry0": ("tab:red", "x"),
    "rc_mean": ("tab:red", "+"),
    "rc_contrast0": ("tab:red", "1"),
    "rc_mean_contrast0": ("tab:red", "2"),
    "snapkv_rc_window": ("tab:cyan", "^"),
    "tova_rc_window": ("tab:olive", "v"),
}
HEADLINE = ("rc_defaults", "rc_budget", "snapkv", "tova", "knorm", "streaming", "random")


def stored_as(data: dict | None, name: str) -> str:
    """``benchmarks/results/FILE`` in backticks: the file ``data`` was read from (its stored form), else ``name``."""
    return f"`benchmarks/results/{(data or {}).get('_file', name)}`"


def load(name: str) -> dict | None:
    """The result ``name`` (``NAME.json``; read from ``NAME.json.gz`` when it is stored gzipped), or None."""
    path = result_files.find(RESULTS / name)
    if path is None:
        return None
    data = result_files.read(path)
    if isinstance(data, dict):
        data.setdefault("_file", path.name)  # the file a table is drawn from (for its provenance; never written back)
    return data


# ----------------------------------------------------------------------------------------------- provenance


def server_flag(data: dict) -> tuple[dict | None, str]:
    """The engine's ``rcstat`` flag a file's rows ran under, and where that comes from: the file's record
    (``engine``), or, for accuracy files before it was recorded, its records (a request skipped by lazy eviction
    means the engine ran lazy; otherwise eager: accuracy.py's engine default since lazy became the plugin's, and the
    plugin's own before). None for files without an engine (transformers)."""
    engine = data.get("engine")
    if isinstance(engine, dict) and "rcstat" in engine:
        return engine["rcstat"], "recorded"
    if data.get("benchmark") == "accuracy" or "accuracy" in data.get("_file", ""):
        lazy = any(str(r.get("skipped_reason") or "").startswith("lazy eviction") for r in data.get("records", []))
        return {"eviction": "lazy" if lazy else "eager"}, "from its records"
    return None, "no engine"


def _ratios(labels) -> tuple[float, ...]:
    out = set()
    for label in labels:
        if "_r" in label and "@" not in label:
            with contextlib.suppress(ValueError):
                out.add(float(label.rsplit("_r", 1)[1]))
    return tuple(sorted(out))


def current_overrides(data: dict) -> dict[str, dict] | None:
    """label -> the override the benchmark gives that label today, for files whose labels come from one of
    methods.py's generators (quality's build_settings, the cliff ablation's variants, the budget-scope study);
    None where no generator covers every label (the file's own overrides are then taken as today's)."""
    labels = {
        k
        for k, e in data.get("summary", {}).items()
        if e.get("family") != "full" and not str(e.get("family", "")).startswith("kvpress_")
    }
    if not labels:
        return None
    ratios = _ratios(labels) or (0.5, 0.8)
    candidates = []
    if any(label.rsplit("_r", 1)[0] in methods.CLIFF_VARIANTS for label in labels):
        candidates.append(methods.cliff_ablation_settings(ratios=ratios))
    if data.get("benchmark") == "quality" and data.get("preset") in methods.QUALITY_SETTINGS:
        candidates.append(methods.build_settings(**methods.QUALITY_SETTINGS[data["preset"]]))
    if any(label.startswith("rc_model_") for label in labels):
        candidates.append(
            methods.budget_scope_settings(ratios=ratios)
            + [
                methods.Setting(
                    f"rc_model_r{r:g}", "rc_model", {**methods.PAPER_RC, "target_ratio": r, "budget_scope": "model"}
                )
                for r in ratios
            ]
        )
    for settings in candidates:
        known = {s.label: dict(s.rcstat) for s in settings}
        if labels <= set(known):
            return known
    return None


def row_configs(data: dict) -> dict[str, dict]:
    """label -> {"ran", "now", "reasons"} for every row of a file whose override is known: the config the row ran
    with (its recorded ``resolved`` where it has one, else the defaults when the file was made merged with the
    engine's flag and its override), the one its label gives today, and why they differ
    (provenance.row_status)."""
    summary = data.get("summary") or {}
    settings = {s.get("label"): s for s in data.get("settings", []) if isinstance(s, dict)}
    o = provenance.origin(RESULTS / data.get("_file", ""), data)
    recorded = data.get("plugin_defaults") or (data.get("environment") or {}).get("plugin_defaults")
    then = provenance.defaults_at(o, recorded)
    server, server_source = server_flag(data)
    ignore = ("eviction",) if server is None else ()
    current = current_overrides(data) or {}
    out = {}
    for label, e in summary.items():
        family = str(e.get("family", ""))
        override = e.get("rcstat", settings.get(label, {}).get("rcstat"))
        if override is None or family.startswith("kvpress_"):
            continue
        ran = provenance.ran_config(then, server, override, o)
        if e.get("resolved") or settings.get(label, {}).get("resolved"):
            res = e.get("resolved") or settings[label]["resolved"]
            # A recorded resolved config is what ran; before the engine was recorded, its eviction was
            # RCStatConfig()'s, not the engine's (accuracy.py's engine compacts eagerly unless told otherwise).
            ran = {
                **ran,
                **res,
                **(
                    {}
                    if server_source == "recorded" or server is None
                    else {"eviction": server.get("eviction", res.get("eviction"))}
                ),
            }
        pinned = current.get(label)
        now_cfg = provenance.now_config(server, override if pinned is None else pinned)
        if e.get("matched_to"):  # the per-prompt ratio of the RC row it is matched to
            ran["target_ratio"] = now_cfg["target_ratio"] = e.get("ratio")
        reasons = provenance.row_status(ran, now_cfg, pinned, o, ignore)
        out[label] = {"ran": ran, "now": now_cfg, "reasons": reasons, "origin": o, "server_source": server_source}
    return out


def origin_words(data: dict) -> str:
    """Where a file comes from and which defaults changed after it (its runs that leave a field out ran with the
    older value): for files whose runs do not record their settings (throughput)."""
    o = provenance.origin(RESULTS / data.get("_file", ""), data)
    later = sorted(
        {c.words for c in provenance.changes_after(o)}, key=[c.words for c in provenance.DEFAULT_CHANGES].index
    )
    text = provenance.describe_origin(o)
    if later:
        text += (
            "; defaults changed since: " + ", ".join(later) + " (runs that leave a field out ran with the older one)"
        )
    return text


def stale_lines(data: dict, rows: dict[str, dict] | None = None, labels=None) -> list[str]:
    """A note naming the rows of a file that do not mean today what they meant when it was made, grouped by reason."""
    rows = row_configs(data) if rows is None else rows
    groups: dict[tuple, list[str]] = {}
    for label, info in rows.items():
        if info["reasons"] and (labels is None or label in labels):
            groups.setdefault(tuple(info["reasons"]), []).append(label)
    if not groups:
        return []
    o = next(iter(rows.values()))["origin"]
    parts = [f"{', '.join(f'`{label}`' for label in group)}: {'; '.join(reasons)}" for reasons, group in groups.items()]
    return [
        f"† Made under an older meaning (`{data.get('_file', '?')}`, {provenance.describe_origin(o)}): "
        + ". ".join(parts)
        + "."
    ]


def machine_words(data: dict) -> str:
    env = data.get("environment") or {}
    if "cuda" in str(env.get("torch_cuda") or "") or "NVIDIA" in str(env.get("device") or ""):
        return str(env["device"])  # tools/gpu's files: environment.machine is the architecture ("x86_64")
    m = env.get("machine") if isinstance(env.get("machine"), dict) else {}
    cpu = m.get("cpu") or env.get("cpu") or "?"
    cap = m.get("cpu_capability") or env.get("cpu_capability")
    isa = m.get("isa")
    bits = [cpu]
    if isa:
        bits.append(", ".join(f for f in isa if f in ("avx512_bf16", "amx_bf16")) or "no native bf16")
    elif cap:
        bits.append(cap)
    cores = m.get("cores") or env.get("cores")
    if cores:
        bits.append(f"{cores} cores")
    return ", ".join(bits)


def curves(summary: dict, y_key: str) -> dict[str, list[tuple[float, float]]]:
    """family -> [(achieved ratio, y)] sorted by ratio, from the fixed (not per-prompt matched) settings."""
    lines: dict[str, list[tuple[float, float]]] = {}
    for entry in summary.values():
        y = entry.get(y_key)
        if entry.get("matched_to") or y is None or (isinstance(y, float) and math.isnan(y)):
            continue
        lines.setdefault(entry["family"], []).append((entry["ratio"], y))
    return {family: sorted(points) for family, points in lines.items()}


def plot_lines(lines: dict, ylabel: str, title: str, path: Path, full_y: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for family, points in lines.items():
        if family == "full":
            continue
        color, marker = STYLE.get(family, ("k", "."))
        ax.plot(*zip(*points), marker=marker, color=color, label=FAMILY_LABELS.get(family, family))
    if full_y is not None:
        ax.axhline(full_y, color="black", linestyle="--", linewidth=1)
        ax.plot([0.0], [full_y], marker="*", color="black", markersize=12, linestyle="", label="full cache")
    ax.set_xlabel("achieved compression ratio (evicted / prompt KV entries)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for name, run in report["runs"].items():
        if "error" in run or "vs_vanilla" not in run:
            continue
        family = "full" if name in ("vanilla", "none") else name.split("@")[0].split("_c")[0]
        family = "rc_budget" if family.startswith("rc_budget") else family
        color, marker = STYLE.get(family, ("k", "."))
        x = run.get("mean_ratio", 0.0)
        for ax, key in zip(axes, ("output_tok_per_s", "mean_running")):
            ax.plot([x], [run["vs_vanilla"][key]], marker=marker, color=color, linestyle="", markersize=8)
            ax.annotate(name, (x, run["vs_vanilla"][key]), fontsize=7, xytext=(4, 3), textcoords="offset points")
    for ax, label in zip(axes, ("output tokens/s vs vanilla vLLM", "mean running requests vs vanilla vLLM")):
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_xlabel("achieved compression ratio")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    w = report["workload"]
    fig.suptitle(
        f"vLLM-CPU, KV pool of {w['kv_tokens']} tokens, {w['requests']} requests of "
        f"{w['min_len']}-{w['max_len']} prompt + {w['max_tokens']} output tokens",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------- table


def _f(value, digits=3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def quality_table(q: dict) -> list[str]:
    s = q["summary"]
    rows = row_configs(q)
    mark = lambda label: " †" if rows.get(label, {}).get("reasons") else ""  # noqa: E731
    ratios = sorted({round(e["ratio"], 2) for k, e in s.items() if e["family"] == "snapkv" and not e["matched_to"]})
    families = [f for f in HEADLINE if any(e["family"] == f for e in s.values())]
    env = q.get("environment") or {}
    where = f", {machine_words(q)}" if env else ""
    lines = [
        f"**Value error rate** (RCStat Eq. 8, last layer, lower is better; transformers, {len(q['samples'])} "
        f"prompts{where}, {stored_as(q, 'quality_cpu.json')}), budget mode at fixed ratios:",
        "",
        "| ratio | " + " | ".join(FAMILY_LABELS[f] for f in families) + " |",
        "|---|" + "---|" * len(families),
    ]
    for r in ratios:
        cells = [_f(s.get(f"{f}_r{r:g}", {}).get("ver")) + mark(f"{f}_r{r:g}") for f in families]
        lines.append(f"| {r:g} | " + " | ".join(cells) + " |")
    named = []
    for f in families:  # each column's setting as its rows ran (at the largest ratio; only the ratio differs)
        label = next((f"{f}_r{r:g}" for r in reversed(ratios) if f"{f}_r{r:g}" in rows), None)
        if label is not None:
            ran = rows[label]["ran"]
            words = describe(s[label], ran).replace(f"budget {ran.get('target_ratio') or 0:g} ", "budget ")
            named.append(f"{FAMILY_LABELS[f]}: {words}")
    if named:
        lines += ["", "Columns, as their rows ran: " + "; ".join(named) + "."]
    rc = [(k, e) for k, e in s.items() if e["family"] == "rc"]
    if rc:
        lines += [
            "",
            "RCStat threshold mode and the baselines at the ratio it achieved on each prompt:",
            "",
            "| setting | ratio | RCStat | RCStat budget | SnapKV | TOVA |",
            "|---|---|---|---|---|---|",
        ]
        for label, e in rc:
            matched = [
                _f(s.get(f"{f}@{label}", {}).get("ver")) + mark(f"{f}@{label}") for f in ("rc_budget", "snapkv", "tova")
            ]
            lines.append(f"| {label}{mark(label)} | {_f(e['ratio'])} | {_f(e['ver'])} | " + " | ".join(matched) + " |")
    stale = stale_lines(q, rows)
    if stale:
        lines += ["", *stale]
    return lines


def describe(entry: dict, config: dict | None = None, eviction: bool = False) -> str:
    """A setting in words from the config its requests ran with (``config``, else the entry's recorded
    ``resolved``), so a default row says what the default is; ``eviction``: say when it compacted."""
    c = config or entry.get("resolved")
    if entry.get("family") == "full" or not c:
        return "full cache" if entry.get("family") == "full" else ""
    if c["method"] == "none":
        return "none"
    mode = (
        f"budget {c['target_ratio']:g} ({'model-wide' if c['budget_scope'] == 'model' else 'per layer'})"
        if c.get("target_ratio") is not None
        else f"threshold c = {c['c']:g}"
    )
    parts = [
        c["method"].replace("snapkv", "SnapKV").replace("tova", "TOVA").replace("rc", "RC"),
        mode,
        f"window {c['window']}",
    ]
    if c.get("observation_window") is not None:
        parts.append(f"{c['observation_window']} queries observed")
    if c["method"] == "rc":
        parts.append(f"smoothing {c['smoothing']}")
        if c.get("carry_forward"):
            parts.append(f"scores carried {c['carry_forward']} tokens forward")
        # Older runs predate the knob: they scored with Eq. 6's mean.
        parts.append(
            "max over the window's queries"
            if c.get("query_reduction", "mean") == "max"
            else "mean over the window's queries (Eq. 6)"
        )
        # Older runs predate it too (no contrast); threshold mode does not apply it.
        if c.get("local_contrast") and c.get("target_ratio") is not None:
            parts.append(f"contrast {c['local_contrast']:g} over {c['contrast_radius']} tokens")
        # Budget mode only, and off in runs that predate them.
        if c.get("chunk", 1) > 1 and c.get("target_ratio") is not None:
            parts.append(f"chunks of {c['chunk']}")
        if c.get("value_weight") and c.get("target_ratio") is not None:
            parts.append(f"value weight {c['value_weight']:g}")
    if c.get("sink_tokens"):
        parts.append(f"{c['sink_tokens']} sink tokens")
    if c.get("target_ratio") is not None and c.get("budget_scope") == "model" and c.get("layer_floor"):
        parts.append(f"layer floor {c['layer_floor']:g}")
    if eviction and c.get("eviction"):
        parts.append(f"{c['eviction']} eviction")
    text = ", ".join(parts)
    return f"bare flag: {text}" if entry.get("family") == "default" else text


def engine_words(data: dict, evictions: set | None = None, with_machine: bool = True) -> str:
    """The engine options that shape an accuracy file's numbers, in words: where it ran, eviction (when every row
    shares it), prefix caching, dtype. Recorded in new files (``engine``); for older ones accuracy.py's own
    (prefix caching off since the benchmark began; eviction from the records)."""
    engine = data.get("engine") or {}
    env = data.get("environment") or {}
    bits = []
    if env and with_machine:
        bits.append(machine_words(data))
    if data.get("benchmark") in ("quality", "routes"):  # (the transformers reference, not an engine)
        return ", ".join([*bits, f"transformers, {data.get('dtype', 'float32')}"])
    if evictions and len(evictions) == 1:
        _server, source = server_flag(data)
        bits.append(f"`eviction: {next(iter(evictions))}`" + ("" if source == "recorded" else f" ({source})"))
    pc = engine.get(
        "enable_prefix_caching",
        False if data.get("benchmark") == "accuracy" or "accuracy" in data.get("_file", "") else None,
    )
    if pc is not None:
        bits.append(f"prefix caching {'on' if pc else 'off'}")
    dtype = (
        engine.get("dtype")
        if engine.get("dtype") and "own" not in str(engine.get("dtype"))
        else env.get("engine_dtype")
    )
    if dtype:
        bits.append(str(dtype))
    return (", " + ", ".join(bits)) if bits else ""


def _hits(e: dict, task: str) -> str:
    return f"{e[task + '_hits']}/{e[task + '_values']}" if e.get(task + "_values") else "-"


def _of_full(e: dict) -> str:
    """The share of the full cache's needle values a setting found too, with the count (a rounded share can read
    as a target met when it is not)."""
    share, full = e.get("needle_kept_of_full"), e.get("full_hits")
    if share is None or not full:
        return _f(share, 2)
    return f"{round(share * full)}/{full} ({100 * share:.1f}%)"


def accuracy_table(a: dict) -> list[str]:
    s = a["summary"]
    samples = a.get("samples", [])
    count = {
        t: sum(1 for x in samples if x.get("task") == t)
        for t in ("niah_single", "niah_multi", "niah_multikey", "niah_multivalue", "vt", "summ")
    }
    if not any("needle_hits" in e for e in s.values()):  # an older run: score columns only
        tasks = sorted({t for e in s.values() for t in e["by_task"]})
        lines = [
            f"**Task accuracy through vLLM with the plugin** (greedy; {stored_as(a, 'accuracy_cpu.json')}):",
            "",
            "| setting | ratio | " + " | ".join(tasks) + " | = full cache |",
            "|---|---|" + "---|" * (len(tasks) + 1),
        ]
        for label, e in s.items():
            cells = [_f(e["by_task"].get(t, {}).get("score")) for t in tasks]
            lines.append(f"| {label} | {_f(e['ratio'])} | " + " | ".join(cells) + f" | {_f(e['same_as_full'], 2)} |")
        return lines
    rows = row_configs(a)
    evictions = {info["ran"].get("eviction") for info in rows.values() if info["ran"].get("method") != "none"}
    lines = [
        f"**Task accuracy through vLLM with the plugin** (greedy, one engine, every setting side by side"
        f"{engine_words(a, evictions)}; "
        f"{count['niah_single']} single-needle, {count['niah_multi']} three-needle, {count['niah_multikey']} "
        f"multi-key (four keys, one asked) and {count['niah_multivalue']} multi-value (four values of one key) "
        f"prompts, "
        f"{count['vt']} variable-tracking, {count['summ']} summaries; needles: values found; *of full*: share "
        f"of the values the full cache found that the setting found too; vt: share of variables named; summ: "
        f"ROUGE-L F1 against the full-cache output; *= full*: outputs token-identical to the full cache; "
        f"{stored_as(a, 'accuracy_cpu.json')}):",
        "",
        "| setting | what | evicted | single needle | multi needle | multi-key | multi-value | of full | vt | summ "
        "| = full |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, e in s.items():
        task = lambda t: _f(e["by_task"].get(t, {}).get("score"))  # noqa: E731, B023
        info = rows.get(label, {})
        what = describe(e, info.get("ran"), eviction=len(evictions) > 1)
        what += f" (same run as `{e['same_run_as']}`)" if e.get("same_run_as") else ""
        what += " †" if info.get("reasons") else ""
        lines.append(
            f"| {label} | {what} | {_f(e['ratio'])} | {_hits(e, 'niah_single')} | {_hits(e, 'niah_multi')} "
            f"| {_hits(e, 'niah_multikey')} | {_hits(e, 'niah_multivalue')} | {_of_full(e)} | {task('vt')} "
            f"| {task('summ')} "
            f"| {_f(e['same_as_full'], 2)} |"
        )
    stale = stale_lines(a, rows)
    if stale:
        lines += ["", *stale]
    fid = a.get("fidelity", {}).get("by_setting")
    if fid:
        rates = ", ".join(f"{k} {v['exact_match_rate']:.2f}" for k, v in fid.items())
        n = max(v["n"] for v in fid.values())
        lines += [
            "",
            f"Fidelity, vLLM vs the transformers masked reference ({n} prompts, exact greedy match rate): {rates}.",
        ]
    return lines


KVPRESS_NAMES = {
    "snapkv": "SnapKV",
    "tova": "TOVA",
    "expected_attention": "ExpectedAttention",
    "adakv_expected_attention": "AdaKV(ExpectedAttention)",
    "kvzip": "KVzip",
    "knorm": "Knorm",
    "streaming_llm": "StreamingLLM",
}


def kvpress_rows(k: dict) -> list[tuple[str, str, str, str, str]]:
    """(press, ratio, evicted, needle values found, share of the full cache's values kept) per run of
    kvpress_reference.py, the full cache first."""
    rows = []
    for r in k["rows"]:
        t = r["totals"]
        press = "full cache" if r["press"] is None else KVPRESS_NAMES.get(r["press"], r["press"])
        kept = (
            f"{t['kept_of_full']}/{t['full_needle_hits']} ({100 * t['kept_of_full_share']:.1f}%)"
            if t.get("kept_of_full_share") is not None
            else "-"
        )
        rows.append((press, f"{r['ratio']:g}", _f(r.get("evicted")), f"{t['needle_hits']}/{t['needle_values']}", kept))
    return rows


def kvpress_table(k: dict) -> list[str]:
    env, prompts = k["environment"], k["prompts"]
    lines = [
        f"**kvpress {env['kvpress']} as the reference** (its own presses at their defaults, through transformers "
        f"{env['transformers']}, {env['dtype']}, sdpa; the accuracy benchmark's {prompts['n']} scored prompts "
        f"({', '.join(prompts['tasks'])}), each compressed whole, question included, then greedy; *of full*: "
        f"share of the needle values kvpress's full cache found that the press found too; "
        f"{stored_as(k, 'kvpress_reference_cpu.json')}):",
        "",
        "| press | ratio | evicted | needle values | of full |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {' | '.join(row)} |" for row in kvpress_rows(k)]
    if not k.get("complete", True):
        lines += [
            "",
            f"A partial run: {len(k['rows'])} of the {len(k.get('runs_planned', []))} planned press and ratio "
            f"runs finished.",
        ]
    return lines


def _plugin_row_name(label: str, e: dict) -> str:
    if e.get("family") == "full":
        return "full cache"
    c = e.get("resolved") or {}
    family = e.get("family", "")
    if family == "default":
        name = "bare flag `{}` (RC)"
    elif family.startswith("default_"):  # the bare flag's settings with one of its defaults undone (default_mean, ...)
        name = "bare flag's settings (RC)"
    else:
        name = {"rc": "RC", "snapkv": "SnapKV", "tova": "TOVA"}.get(c.get("method"), c.get("method", label))
    if c.get("method") == "rc" and c.get("query_reduction", "mean") == "mean":
        name += ", Eq. 6's mean over queries"
    # Runs before the local contrast have no such field (and no contrast); threshold mode never applies it.
    if c.get("method") == "rc" and c.get("local_contrast") == 0 and c.get("target_ratio") is not None:
        name += ", no local contrast"
    return name


def side_by_side_table(a: dict | None, k: dict | None) -> list[str]:
    """The README's quality table: the plugin's methods through vLLM (accuracy_cpu.json) beside kvpress's own
    presses through transformers (kvpress_reference_cpu.json), on the same prompts; each row's share is of its own
    engine's full cache (greedy decodes differ a little between vLLM bf16 and transformers float32)."""
    lines = []
    if a is None and k is None:
        return lines
    rows = []
    configs = row_configs(a) if a is not None else {}
    if a is not None:
        for label in SIDE_BY_SIDE_PLUGIN:
            e = a["summary"].get(label)
            if e is None or "needle_hits" not in e:
                continue
            of_full = "-" if e.get("family") == "full" else _of_full(e)
            mark = " †" if configs.get(label, {}).get("reasons") else ""
            rows.append(
                (
                    "plugin, vLLM",
                    _plugin_row_name(label, e) + mark,
                    _f(e["ratio"], 2),
                    f"{e['needle_hits']}/{e['needle_values']}",
                    of_full,
                )
            )
    if k is not None:
        engine = f"kvpress {k['environment']['kvpress']}"
        for press, ratio, evicted, found, kept in kvpress_rows(k):
            rows.append(
                (
                    engine,
                    press,
                    _f(float(evicted), 2) if evicted != "-" else ratio,
                    found,
                    "-" if press == "full cache" else kept,
                )
            )
    env = (a or {}).get("environment", {})
    kenv = (k or {}).get("environment", {})
    evictions = {c["ran"].get("eviction") for c in configs.values() if c["ran"].get("method") != "none"}
    engine_text = (
        engine_words(a, evictions, with_machine=True).replace(", " + str(env.get("engine_dtype")), "") if a else ""
    )
    lines += [
        f"Needle values found on the accuracy benchmark's prompts (generated by `./rcstat bench`: the plugin "
        f"through vLLM {env.get('vllm', '?')} in {env.get('engine_dtype', '?')}"
        f"{engine_text}, "
        f"{stored_as(a, 'accuracy_cpu.json')}; "
        f"kvpress's own presses at their defaults through transformers {kenv.get('transformers', '?')} in "
        f"{kenv.get('dtype', '?')}, {stored_as(k, 'kvpress_reference_cpu.json')}; "
        f"*of full*: of the values its own engine's full cache found):",
        "",
        "| engine | method | evicted | needle values | of full |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    if k is not None and not k.get("complete", True):
        planned = len(k.get("runs_planned", []))
        lines += ["", f"kvpress: a partial run, {len(k['rows'])} of {planned} press and ratio runs."]
    stale = stale_lines(a, configs, set(SIDE_BY_SIDE_PLUGIN)) if a is not None else []
    return lines + (["", *stale] if stale else [])


def throughput_table(t: dict) -> list[str]:
    w = t["workload"]
    lines = [
        f"**Throughput, KV-memory-bound** (vLLM-CPU, {machine_words(t)}, pool "
        f"of {w['kv_tokens']} tokens, {w['requests']} requests of {w['min_len']}-{w['max_len']} + "
        f"{w['max_tokens']} tokens, one run each, side by side; {stored_as(t, 'throughput_cpu.json')}; "
        f"{origin_words(t)}):",
        "",
        "| run | ratio | out tok/s | x vanilla | peak running | mean running | fragmentation | preemptions |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in t["runs"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | | | | |")
            continue
        vs = r.get("vs_vanilla", {}).get("output_tok_per_s")
        lines.append(
            f"| {name} | {_f(r.get('mean_ratio', 0.0))} | {r['output_tok_per_s']:.1f} | {_f(vs, 2)} | "
            f"{r['peak_running']:g} | {r['mean_running']:.1f} | {_f(r.get('mean_fragmentation'), 2)} | "
            f"{r['preemptions']:g} |"
        )
    over = {k: v for r in t["runs"].values() for k, v in r.get("prefill_overhead", {}).items()}
    if over:
        cells = ", ".join(f"{k} {v['tok_per_s']:.0f}" for k, v in over.items())
        lines += [
            "",
            f"Prefill (prompt tokens/s, median of rounds; `none`/`rc`/`snapkv`/`tova` in the plugin's "
            f"engine, `vanilla` in vLLM's): {cells}.",
        ]
    return lines


def overhead_line(o: dict) -> list[str]:
    """The plugin with method none vs vanilla vLLM, from interleaved rounds (throughput.py --repeat)."""
    runs = o["runs"]
    if "vanilla" not in runs or "none" not in runs or "error" in runs["vanilla"] or "error" in runs["none"]:
        return []
    rounds = lambda name: ", ".join(f"{x:.1f}" for x in runs[name].get("rounds_output_tok_per_s", []))  # noqa: E731
    ratio = runs["none"]["output_tok_per_s"] / runs["vanilla"]["output_tok_per_s"]
    return [
        f'**Plugin overhead, nothing evicted** (`{{"method": "none"}}` vs vanilla vLLM, same workload, '
        f"{o.get('repeat', 1)} interleaved rounds, {machine_words(o)}; {stored_as(o, 'plugin_overhead_cpu.json')}, "
        f"{origin_words(o)}): output tokens/s "
        f"vanilla {rounds('vanilla')}, plugin {rounds('none')}; median ratio {ratio:.2f}."
    ]


def prefill_line(p: dict) -> list[str]:
    """The prefill-only study (throughput.py --prefill-study): each run's prompt tokens/s against vanilla's in the
    same round."""
    runs = p.get("prefill", {})
    if "vanilla" not in runs:
        return []
    w = p["workload"]
    cells = []
    for name, e in runs.items():
        if name == "vanilla":
            continue
        rounds = ", ".join(f"{x:.2f}" for x in e.get("vs_vanilla_by_round", []))
        cells.append(f"{name} {rounds} (median {_f(e.get('median_vs_vanilla'), 2)})")
    speeds = ", ".join(f"{x:.0f}" for x in runs["vanilla"]["rounds_prompt_tok_per_s"])
    return [
        f"**Prefill only** ({w['requests']} prompts of {w['max_len']} tokens, {w['max_tokens']} output token, "
        f"KV pool of {w['kv_tokens']} tokens (never limiting), {p.get('repeat', 1)} interleaved rounds, "
        f"{machine_words(p)}; {stored_as(p, 'throughput_prefill_cpu.json')}, {origin_words(p)}): vanilla "
        f"{speeds} prompt tokens/s; prompt tokens/s "
        f"/ vanilla's in the same round: " + "; ".join(cells) + "."
    ]


def files_table() -> list[str]:
    """Every result file: where it was made, on what, with which engine options, and what moved since."""
    lines = [
        "**Result files and how they were made** (*made*: the commit the file records, or, marked *git "
        "history*, the last commit that wrote it, for files older than the record: the run came before that "
        "commit, and a default changed in that very commit is taken as after the run; *defaults changed since*: "
        "changes of the "
        "plugin's defaults after it, so a row that leaves such a field out ran with the older value; *rows †*: "
        "rows whose config as run differs from what their label gives today, named in the tables above or "
        "by `python benchmarks/report.py --stale FILE`):",
        "",
        "| file | made | machine | engine | defaults changed since | rows † |",
        "|---|---|---|---|---|---|",
    ]
    for path in result_files.all_results(RESULTS):
        data = load(path.name)
        if not isinstance(data, dict):
            continue
        o = provenance.origin(path, data)
        env = data.get("environment") or {}
        if env and ("machine" in env or "cpu" in env):
            machine = machine_words(data)
        else:
            machine = str(data.get("device") or data.get("device_name") or env.get("cpu") or "-")
        engine = data.get("engine") or {}
        if engine:
            engine_text = ", ".join(
                f"{k} {v}"
                for k, v in (
                    ("prefix caching", engine.get("enable_prefix_caching")),
                    ("dtype", engine.get("dtype")),
                    ("flag", json.dumps(engine.get("rcstat"))),
                )
                if v is not None
            )
        else:
            engine_text = engine_words(data, with_machine=False).lstrip(", ") if data.get("summary") else "-"
        later = sorted(
            {c.words for c in provenance.changes_after(o)}, key=[c.words for c in provenance.DEFAULT_CHANGES].index
        )
        stale = "-"
        if isinstance(data.get("summary"), dict):
            rows = row_configs(data)
            stale = f"{sum(1 for r in rows.values() if r['reasons'])} of {len(rows)}" if rows else "-"
        made = provenance.describe_origin(o).replace("last written by ", "")
        lines.append(
            f"| `{path.name}` | {made} | {machine} | {engine_text or '-'} | {', '.join(later) or '-'} | {stale} |"
        )
    return lines


# ----------------------------------------------------------------------------------------------- README

#: The generated blocks besides the results block, each in the README or RESULTS_DOC (:func:`block_documents`).
README_BLOCKS = ("side-by-side", "what-you-get", "value-error")
#: throughput.py's run names and the flag each ran with (its plan; files before runs recorded their flag).
THROUGHPUT_RUN_FLAGS = {
    "vanilla": None,
    "none": {"method": "none"},
    "default": {},
    "eager": {"eviction": "eager"},
    "rc_budget_r0.5": {"method": "rc", "target_ratio": 0.5, "eviction": "eager"},
}
#: The README's summary table: (accuracy labels, what the row is, throughput.py run or None).
WHAT_YOU_GET = (
    (("full",), "full cache", "vanilla"),
    (("default",), "bare flag", "default"),
    (("rc_r0.5",), "RC 0.5", "rc_budget_r0.5"),
    (("rc_r0.8",), "RC 0.8", None),
    (("rc_r0.8_mean_contrast0",), "RC 0.8 with RCStat's Eq. 6 scores", None),
    (("rc_paper_r0.5",), "RCStat as the paper runs it, 0.5", None),
    (("snapkv_w64_r0.5", "snapkv_w64_r0.8"), "SnapKV 0.5 / 0.8 at kvpress's defaults", None),
    (("tova_w1_r0.5", "tova_w1_r0.8"), "TOVA 0.5 / 0.8 at kvpress's defaults", None),
)


def flag_text(override: dict | None) -> str:
    """A setting as a user writes it: the override, RC's ``method`` left out (the default)."""
    if override is None:
        return "plugin not loaded"
    shown = {k: v for k, v in override.items() if not (k == "method" and v == "rc")}
    return "`" + json.dumps(shown) + "`"


def run_flag(t: dict, name: str) -> tuple[dict | None, str]:
    r = t.get("runs", {}).get(name, {})
    if "rcstat" in r:
        return r["rcstat"], "recorded"
    return THROUGHPUT_RUN_FLAGS.get(name), "throughput.py's plan"


def throughput_cell(t: dict, name: str) -> str:
    runs = t.get("runs", {})
    r, v = runs.get(name), runs.get("vanilla")
    if not r or not v or "error" in r:
        return ""
    rounds = [x / y for x, y in zip(r.get("rounds_output_tok_per_s", []), v.get("rounds_output_tok_per_s", []))]
    flag, _ = run_flag(t, name)
    peak = f"{r['peak_running']:g}"
    if name == "vanilla":
        return f"1.00 ({peak} requests running at most)"
    how = (
        "lazy: the bare flag as served"
        if not flag
        else f"{flag_text(flag)}"
        if flag.get("eviction")
        else flag_text(flag)
    )
    return f"{', '.join(f'{x:.2f}x' for x in rounds)} ({how}; up to {peak} running)"


def what_you_get(a: dict | None, t: dict | None) -> list[str]:
    """The README's summary: each setting's needle values and summaries (accuracy_cpu.json) and, where a
    throughput run has that setting, its output tokens/s against vanilla's in each round (throughput_default_cpu.json),
    every row named by the flag it ran with."""
    if a is None:
        return []
    s = a["summary"]
    rows = row_configs(a)
    full = s.get("full", {})
    samples = a.get("samples", [])
    count = lambda t_: sum(1 for x in samples if x.get("task") == t_)  # noqa: E731
    needle_prompts = sum(count(x) for x in ("niah_single", "niah_multi", "niah_multikey", "niah_multivalue"))
    evictions = {info["ran"].get("eviction") for info in rows.values() if info["ran"].get("method") != "none"}
    eviction = next(iter(evictions)) if len(evictions) == 1 else "mixed"
    env = a.get("environment", {})
    origin = rows["full"]["origin"] if "full" in rows else provenance.origin(RESULTS / a["_file"], a)
    lines = [
        f"Measured with SmolLM2-135M-Instruct through vLLM-CPU {env.get('vllm', '?')} "
        f"({machine_words(a)}, {env.get('engine_dtype', '?')}), greedy, every setting side by side in one engine "
        f"({stored_as(a, 'accuracy_cpu.json')}, {provenance.describe_origin(origin)}). "
        f"That engine runs `eviction: {eviction}` (every request is compacted right after its prefill; under "
        f"the default, lazy eviction, a request is compacted only when the pool runs short, and until then "
        f"it answers as the full cache does) and turns prefix caching off (every prompt runs under every "
        f"setting: a repeat would be served its prompt from the cache, and the plugin compresses only the "
        f"tokens a request computes). Needle values: {full.get('needle_values', '?')} in {needle_prompts} "
        f"prompts of 1-4k tokens cut from essays ({count('niah_single')} single needles, {count('niah_multi')} "
        f"three-needle prompts, {count('niah_multikey')} RULER multi-key: four keys, one asked; "
        f"{count('niah_multivalue')} multi-value: four values of one key); summaries: ROUGE-L of "
        f"{count('summ')} essay summaries against the full cache's own."
    ]
    if t is not None:
        w = t["workload"]
        lines[0] += (
            f" Throughput: output tokens/s against vanilla vLLM (plugin not loaded) in each of "
            f"{t.get('repeat', 1)} interleaved rounds, on a KV-bound workload of {w['requests']} requests of "
            f"{w['min_len']}-{w['max_len']} prompt + {w['max_tokens']} output tokens in a pool that holds "
            f"{w.get('vanilla_requests_that_fit', 0):.0f} of them, prefix caching off "
            f"({stored_as(t, 'throughput_cpu.json')}, {machine_words(t)}, "
            f"{provenance.describe_origin(provenance.origin(RESULTS / t['_file'], t))}); each run's flag "
            f"is in its cell."
        )
    n_full = full.get("needle_hits")
    lines += [
        "",
        f"| setting | evicted | needle values found | of the full cache's {n_full} | summaries | "
        "throughput vs vanilla vLLM |",
        "|---|---|---|---|---|---|",
    ]
    for labels, title, run in WHAT_YOU_GET:
        es = [s.get(label) for label in labels]
        if any(e is None for e in es):
            continue
        marks = " †" if any(rows.get(label, {}).get("reasons") for label in labels) else ""
        if labels == ("full",):
            name = 'full cache (`{"method": "none"}`)'
        elif len(labels) == 1:
            name = f"{title} ({flag_text(es[0].get('rcstat'))})" if es[0].get("rcstat") else f"{title} `{{}}`"
            if es[0].get("family") == "default":
                c = rows.get(labels[0], {}).get("ran", {})
                name = (
                    f"bare flag `{{}}` (RC, {c.get('target_ratio', 0):g} of the whole model)"
                    if c.get("budget_scope") == "model"
                    else name
                )
        else:  # one flag at several ratios: the flag without its ratio
            same = {k: v for k, v in (es[0].get("rcstat") or {}).items() if k != "target_ratio"}
            name = f"{title} ({flag_text(same)})"
        join = lambda f: " / ".join(f(e) for e in es)  # noqa: E731, B023
        evicted = join(lambda e: _f(e["ratio"], 2))
        found = join(lambda e: f"{e['needle_hits']}/{e['needle_values']}" if len(es) == 1 else f"{e['needle_hits']}")  # noqa: B023
        if labels == ("full",):
            kept = "-"
        else:
            kept = join(
                lambda e: (
                    f"{round(e['needle_kept_of_full'] * e['full_hits'])}"
                    + (f" ({100 * e['needle_kept_of_full']:.1f}%)" if len(es) == 1 else "")  # noqa: B023
                )
            )
        summ = join(lambda e: _f(e["by_task"].get("summ", {}).get("score")))
        tput = throughput_cell(t, run) if (t is not None and run) else ""
        lines.append(f"| {name}{marks} | {evicted} | {found} | {kept} | {summ} | {tput} |")
    stale = stale_lines(a, rows, {label for labels, _, _ in WHAT_YOU_GET for label in labels})
    return lines + (["", *stale] if stale else [])


#: The value-error sentence: (what, file, label); each row is named by its config as it ran.
VALUE_ERROR_ROWS = (
    ("RC with the defaults", "quality_local_contrast_cpu.json", "rc_model_w32_s3_k4_c8_max_lc0.5_r0.8"),
    (
        "with RCStat's Eq. 6 scores (the defaults with the mean over queries, no local contrast)",
        "quality_query_reduction_cpu.json",
        "rc_model_w32_s3_k4_c8_r0.8",
    ),
    ("kvpress's KVzip keep sets", "quality_local_contrast_cpu.json", "kvpress_kvzip_r0.8"),
    ("TOVA", "quality_sinks_cpu.json", "tova_r0.8"),
    ("SnapKV", "quality_sinks_cpu.json", "snapkv_r0.8"),
)


def value_error_line() -> list[str]:
    """The README's value error at 0.8, every number with its file and its setting as it ran; a row whose config as
    it ran is not what its words say (the defaults today, at 0.8) is marked."""
    cells, machines, prompts = [], set(), set()
    for what, name, label in VALUE_ERROR_ROWS:
        q = load(name)
        if q is None or label not in q.get("summary", {}):
            continue
        e = q["summary"][label]
        machines.add(machine_words(q).split(",")[0])
        prompts.add((len(q.get("samples", [])), q.get("seed")))
        info = row_configs(q).get(label)
        if info is None:  # kvpress's keep sets: no plugin config
            cells.append(f"{what} {_f(e['ver'])} (`{q['_file']}`)")
            continue
        ran = info["ran"]
        words = describe(e, ran).replace(f"budget {ran['target_ratio']:g} ", "budget ")
        if not ran.get("sink_tokens"):
            words += ", no sinks"
        if ran.get("method") == "snapkv" and ran.get("observation_window") is None:
            words += ", SnapKV's own observation window"
        if what == "RC with the defaults":
            now = provenance.now_config(None, {"target_ratio": 0.8})
            same = not provenance.row_status(ran, now, None, info["origin"], ("eviction",))
            what = what if same else "RC with the defaults when it ran †"
        cells.append(f"{what} {_f(e['ver'])} (`{q['_file']}`: {words}{' †' if info['reasons'] else ''})")
    if not cells:
        return []
    n = ", ".join(f"{p} prompts, seed {seed}" for p, seed in sorted(prompts))
    return [
        f"Value error at 0.8 (RCStat's Eq. 8, last layer; transformers, float32, the same {n}, "
        f"{' / '.join(sorted(machines))}): " + "; ".join(cells) + "."
    ]


def readme_blocks() -> dict[str, list[str]]:
    a, k = load("accuracy_cpu.json"), load("kvpress_reference_cpu.json")
    return {
        "side-by-side": side_by_side_table(a, k),
        "what-you-get": what_you_get(a, load("throughput_default_cpu.json")),
        "value-error": value_error_line(),
    }


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def render_block(text: str, lines: list[str], start: str, end: str) -> str:
    block = "\n".join([start, *lines, end])
    if start in text and end in text:
        return text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    return text.rstrip("\n") + "\n\n" + block + "\n"


def _rounds(d: dict, run: str, vanilla: str = "vanilla") -> list[float]:
    """A run's output tokens/s over vanilla's in the same round (rounds interleave every run)."""
    r, v = d["runs"][run], d["runs"][vanilla]
    return [x / y for x, y in zip(r["rounds_output_tok_per_s"], v["rounds_output_tok_per_s"])]


def _kept(d: dict, label: str, tasks: tuple[str, ...]) -> tuple[int, int]:
    """(values the full cache found that ``label`` found too, values the full cache found) on ``tasks``' prompts."""
    full = {r["sample_id"]: r["found"] for r in d["records"] if r["setting"] == "full" and "found" in r}
    rows = [r for r in d["records"] if r["setting"] == label and r["task"] in tasks]
    both = sum(a and b for r in rows for a, b in zip(r["found"], full[r["sample_id"]]))
    return both, sum(sum(full[r["sample_id"]]) for r in rows)


def _sci(x: float) -> str:
    """1.1e-7, as the README writes small numbers."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _kept_all(d: dict, label: str) -> int:
    e = d["summary"][label]
    return round(e["needle_kept_of_full"] * e["full_hits"])


def _contextcite_subset(family: dict) -> tuple[float, float, int]:
    """The default attribution's document top-1 (calibrated heads, uniform tokens) against ContextCite's on the
    answers both attributed, and how many (attribution_issue55_cpu.json)."""
    subset = family["document"]["contextcite_subset"]
    return subset["calibrated_uniform"]["top1"], subset["contextcite"]["top1"], subset["n"]


#: Figures outside the generated blocks: (file, values from it, the words with them). ``--check`` formats each and
#: finds the words in the README or a page of docs/ (:func:`figure_documents`; line breaks read as spaces), so a
#: figure that no longer matches its file, or whose words changed, is named. Each sentence also names its file.
FIGURES = (
    (
        "throughput_cpu.json",
        lambda d: (
            d["runs"]["rc_c1"]["vs_vanilla"]["output_tok_per_s"],
            d["runs"]["rc_c1"]["mean_ratio"],
            d["runs"]["tova@rc_c1"]["vs_vanilla"]["output_tok_per_s"],
            d["runs"]["snapkv@rc_c1"]["vs_vanilla"]["output_tok_per_s"],
        ),
        "{:.2f}x vanilla for RC (threshold mode, c = 1, ratio {:.3f}), {:.2f}x for TOVA and {:.2f}x for SnapKV",
    ),
    (
        "attribution_issue55_cpu.json",
        lambda d: (
            d["served_debfaq"]["summary"]["debfaq:c"]["document"]["before"]["top1"],
            d["served_debfaq"]["summary"]["debfaq:c"]["document"]["calibrated_uniform"]["top1"],
            d["served_debfaq"]["summary"]["debfaq:c"]["document"]["calibrated_uniform"]["n"],
            *_contextcite_subset(d["served_debfaq"]["summary"]["debfaq:c"]),
            d["served_debfaq"]["summary"]["debfaq:c"]["document"]["contextcite_subset"]["before"]["top1"],
            *_contextcite_subset(d["served"]["summary"]["short"]),
            *_contextcite_subset(d["served"]["summary"]["essays-b:b"]),
        ),
        "they take document top-1 from {:.2f} to {:.2f} over {} answered prompts; on the answers ContextCite also "
        "attributed, document top-1 is {:.2f} against its {:.2f} there ({} answers; {:.2f} before the calibration), "
        "{:.2f} against {:.2f} on the short facts ({}), {:.2f} against {:.2f} on the essays ({})",
    ),
    (
        "serving_cpu.json",
        lambda d: (
            d["summary"]["default"]["inf"]["vs_vanilla"]["p99_itl_ms"],
            d["summary"]["default"]["inf"]["vs_vanilla"]["request_throughput"],
        ),
        "It was {:.2f}x and {:.2f}x in `serving_cpu.json`",
    ),
    (
        "serving_amx_scored_ahead_cpu.json",
        lambda d: (
            d["summary"]["default"]["inf"]["vs_vanilla"]["request_throughput"],
            d["summary"]["default"]["inf"]["vs_vanilla"]["p99_itl_ms"],
            d["summary"]["rc_0.8"]["inf"]["vs_vanilla"]["request_throughput"],
        ),
        "the bare flag served {:.2f}x vanilla's requests per second with an inter-token p99 of {:.2f}x vanilla's, "
        "RC 0.8 {:.2f}x the requests",
    ),
    (
        "throughput_amx_rc08_cpu.json",
        lambda d: (
            d["runs"]["default"]["vs_vanilla"]["output_tok_per_s"],
            d["runs"]["rc_r0.8"]["vs_vanilla"]["output_tok_per_s"],
        ),
        "at {:.2f}x vanilla for the bare flag (it was 0.93x) and {:.2f}x for RC 0.8",
    ),
    (
        "throughput_prefix_caching_amx_cpu.json",
        lambda d: tuple(_rounds(d, "default+pc", "vanilla+pc")),
        "{:.2f}x / {:.2f}x vanilla with a shared prefix and prefix caching",
    ),
    (
        "throughput_noamx_imitation_cpu.json",
        lambda d: tuple(_rounds(d, "default")),
        "the bare flag {:.2f}x / {:.2f}x vanilla (`throughput_noamx_imitation_cpu.json`",
    ),
    (
        "serving_amx_below_saturation_cpu.json",
        lambda d: (
            d["summary"]["default"]["0.16"]["vs_vanilla"]["p99_ttft_ms"],
            d["summary"]["default"]["0.16"]["vs_vanilla"]["p50_ttft_ms"],
            d["summary"]["default"]["0.16"]["vs_vanilla"]["p99_itl_ms"],
        ),
        "the bare flag's TTFT p99 {:.2f}x vanilla's (p50 {:.2f}x), ITL p99 {:.2f}x",
    ),
    (
        "compaction_step_cpu.json",
        lambda d: tuple(
            d["results"][n][m]["copy_step_ms"] for n in ("320", "2000") for m in ("layer_by_layer", "scored_ahead")
        ),
        "| 320 | {:.1f} ms | 81.5 ms | {:.1f} ms",
    ),
    (
        "accuracy_summaries24_seed3_scoring_cpu.json",
        lambda d: (
            d["summary"]["rc_model_w32_s3_k4_c8_max_lc0.5_r0.4"]["by_task"]["summ"]["score"],
            d["summary"]["rc_model_w32_s3_k4_c8_r0.4"]["by_task"]["summ"]["score"],
        ),
        "the bare flag scored {:.3f} and its settings with Eq. 6's scores {:.3f}",
    ),
    (
        "accuracy_cpu.json",
        lambda d: (d["summary"]["rc_r0.8"]["needle_hits"],),
        "RC at 0.8 finds {} values through vLLM (`rc_r0.8` in `accuracy_cpu.json.gz`)",
    ),
    (
        "kvpress_reference_cpu.json",
        lambda d: tuple(r["totals"]["needle_hits"] for r in d["rows"] if r["press"] == "kvzip" and r["ratio"] == 0.8),
        "kvpress's KVzip at 0.8 finds {} through transformers",
    ),
    (
        "accuracy_cpu.json",
        lambda d: (
            _kept_all(d, "default"),
            d["summary"]["default"]["full_hits"],
            _kept_all(d, "default_mean_contrast0"),
        ),
        "({} of {} both: `default` and `default_mean_contrast0`",
    ),
    (
        "accuracy_cpu.json",
        lambda d: (
            *_kept(d, "default", ("niah_multivalue",)),
            _kept(d, "default_mean_contrast0", ("niah_multivalue",))[0],
            *_kept(d, "default", ("niah_multi", "niah_multikey")),
            _kept(d, "default_mean_contrast0", ("niah_multi", "niah_multikey"))[0],
        ),
        "({} of {} against {}), three-needle and multi-key prompts where it keeps more ({} of {} against {})",
    ),
    (
        "throughput_prefill_avx512_cpu.json",
        lambda d: (*d["prefill"]["lazy"]["vs_vanilla_by_round"], *d["prefill"]["default"]["vs_vanilla_by_round"]),
        "{:.2f}x and {:.2f}x vanilla's prompt tokens/s, where eager eviction (every prompt scored) ran {:.2f}x "
        "and {:.2f}x",
    ),
    (
        "throughput_lazy_avx512_cpu.json",
        lambda d: (*_rounds(d, "lazy"), *_rounds(d, "default")),
        "{:.2f}x and {:.2f}x vanilla, eager {:.2f}x and {:.2f}x (`throughput_lazy_avx512_cpu.json`)",
    ),
    (
        "throughput_prefix_caching_lazy_avx512_cpu.json",
        lambda d: (*_rounds(d, "lazy+pc", "vanilla+pc"), *_rounds(d, "default+pc", "vanilla+pc")),
        "{:.2f}x and {:.2f}x vanilla, eager {:.2f}x and {:.2f}x",
    ),
    (
        "throughput_prefix_caching_lazy_avx512_cpu_before.json",
        lambda d: tuple(_rounds(d, "lazy+pc", "vanilla+pc")),
        "which it keeps whole anyway: {:.2f}x and {:.2f}x",
    ),
    (
        "accuracy_lazy_pool_all_cpu.json",
        lambda d: (
            "nothing" if d["summary"]["default"]["ratio"] == 0 else f"{d['summary']['default']['ratio']:.2f}",
            "every needle value"
            if _kept_all(d, "default") == d["summary"]["default"]["full_hits"]
            else f"{_kept_all(d, 'default')} of the needle values",
        ),
        "the bare flag evicted {} and found {} the full cache found",
    ),
    (
        "accuracy_lazy_pool_quarter_cpu.json",
        lambda d: (
            sum(1 for r in d["records"] if r["setting"] == "default" and not r["skipped_reason"]),
            sum(1 for r in d["records"] if r["setting"] == "default"),
            d["summary"]["default"]["needle_hits"],
            d["summary"]["default"]["needle_values"],
            _kept_all(d, "default"),
            d["summary"]["default"]["full_hits"],
        ),
        "({} of {} requests compacted) it found {} of {} values, {} of the full cache's {}",
    ),
    (
        "accuracy_cpu.json",
        lambda d: (d["summary"]["default"]["needle_hits"], d["summary"]["default"]["needle_values"]),
        "eager eviction with today's defaults finds {} of {}",
    ),
    (
        "throughput_long_output_2048_avx512_cpu.json",
        lambda d: (
            d["runs"]["decode_rc"]["mean_running"],
            d["runs"]["vanilla"]["mean_running"],
            d["runs"]["vanilla"]["preemptions"],
            *_rounds(d, "decode_rc"),
            *_rounds(d, "decode_streaming"),
        ),
        "({:.1f} on average against {:.1f} for vanilla vLLM), none was preempted (vanilla: {:g}), and output tokens/s "
        "were {:.2f}x and {:.2f}x vanilla's with RC scoring, {:.2f}x and {:.2f}x with StreamingLLM's recency",
    ),
    (
        "throughput_long_output_2048_lazy_avx512_cpu.json",
        lambda d: (
            *_rounds(d, "decode_rc_lazy"),
            "no preemption"
            if not d["runs"]["decode_rc_lazy"]["preemptions"]
            else f"{d['runs']['decode_rc_lazy']['preemptions']:g} preemptions",
        ),
        "same date): {:.2f}x, {}",
    ),
    (
        "decode_quality_cpu.json",
        lambda d: (
            tuple(100 * d["summary"]["text"][f"{m}_b512_i128"]["top1"] for m in ("rc", "snapkv", "tova", "recent"))
            + tuple(d["summary"]["text"][f"{m}_b512_i128"]["ver"] for m in ("rc", "snapkv", "tova", "recent"))
        ),
        "{:.1f}% for RC, {:.1f}% SnapKV, {:.1f}% TOVA, {:.1f}% the recent window; "
        "value error {:.3f}, {:.3f}, {:.3f}, {:.3f}",
    ),
    (
        "gpu_check_h200.json",
        lambda d: (
            sum(c["passed"] for c in d["correctness"]),
            len(d["correctness"]),
            _sci(max(c["rel_l2"] for c in d["correctness"])),
        ),
        "passed {} of {} checks against float64 references at Llama-3.1-8B, Qwen2.5-7B, SmolLM2 and head-256 shapes in "
        "bf16, fp16 and fp32 (relative error <= {})",
    ),
    (
        "gpu_check_single_search_h200.json",
        lambda d: (
            len(d["correctness"]),
            sum(c["passed"] for c in d["correctness"]),
            len(d["correctness"]),
            _sci(max(c["rel_l2"] for c in d["correctness"])),
        ),
        "ran {} of those cases, Llama-3.1-8B shapes in bf16 only: {} of {} (relative error <= {}",
    ),
    (
        "throughput_lazy_cpu.json",
        lambda d: (
            d["runs"]["default"]["vs_vanilla"]["output_tok_per_s"],
            d["runs"]["lazy"]["vs_vanilla"]["output_tok_per_s"],
        ),
        "eager eviction ran {:.2f}x vanilla on the KV-bound workload (6 requests at once instead of 4), "
        "lazy eviction {:.2f}x",
    ),
    # throughput.py's own ratio: the median round of the run over vanilla's (the lower of two rounds each)
    (
        "throughput_prefix_caching_lazy_cpu.json",
        lambda d: tuple(
            d["runs"][n]["output_tok_per_s"] / d["runs"]["vanilla+pc"]["output_tok_per_s"]
            for n in ("default+pc", "lazy+pc")
        ),
        "and {:.2f}x / {:.2f}x with a shared prefix and prefix caching",
    ),
    (
        "throughput_prefill_amx_cpu.json",
        lambda d: tuple(d["prefill"][n]["median_vs_vanilla"] for n in ("default", "lazy", "none")),
        "eager eviction {:.2f}x vanilla, lazy eviction {:.2f}x (it scores nothing while memory suffices: "
        "the rest is the `vec` kernels), method `none` {:.2f}x",
    ),
    (
        "throughput_prefill_amx_kept_cpu.json",
        lambda d: tuple(d["prefill"][n]["median_vs_vanilla"] for n in ("default", "eager", "none")),
        "Prefill with a pool never short: the bare flag {:.2f}x, eager eviction {:.2f}x, method `none` {:.2f}x",
    ),
    (
        "throughput_amx_kept_cpu.json",
        lambda d: (d["runs"]["default"]["vs_vanilla"]["output_tok_per_s"],),
        "with two cores and no binding, before either, the bare flag measured {:.2f}x",
    ),
    (
        "throughput_prefill_cpu.json",
        lambda d: (d["prefill"]["default"]["median_vs_vanilla"],),
        "Eq. 6's mean) was {:.2f}x (`throughput_prefill_cpu.json`)",
    ),
    (
        "quality_local_contrast_cpu.json",
        lambda d: (
            d["summary"]["rc_model_w32_s3_k4_c8_max_r0.8"]["ver"],
            d["summary"]["rc_model_w32_s3_k4_c8_max_lc0.5_r0.8"]["ver"],
        ),
        "(value error at 0.8 {:.3f} -> {:.3f})",
    ),
    (
        "throughput_long_output_quick_lazy_avx512_cpu.json",
        lambda d: (
            d["runs"]["decode_rc_lazy"]["vs_vanilla"]["output_tok_per_s"],
            d["runs"]["decode_rc_lazy"]["decode_compactions"],
            d["runs"]["decode_rc"]["vs_vanilla"]["output_tok_per_s"],
            d["runs"]["decode_rc"]["decode_compactions"],
        ),
        "lazy {:.2f}x vanilla with {} decode compactions, eager {:.2f}x with {}",
    ),
    (
        "throughput_prefill_single_search_avx512_cpu.json",
        lambda d: tuple(d["prefill"]["eager"]["vs_vanilla_by_round"]),
        "its settings with eager eviction {:.2f}x / {:.2f}x",
    ),
)


def three_seed_figures() -> tuple[int, int]:
    """The bare flag's kept needle values of the full cache's over the three seeds the README sums."""
    files = ("accuracy_cpu.json", "accuracy_bare_scoring_seed1_cpu.json", "accuracy_bare_scoring_seed2_cpu.json")
    kept = full = 0
    for name in files:
        d = load(name)
        kept += _kept_all(d, "default")
        full += d["summary"]["default"]["full_hits"]
    return kept, full


def block_documents() -> list[Path]:
    """Where the generated blocks of :func:`readme_blocks` may live: the README and RESULTS_DOC."""
    return [README, RESULTS_DOC]


def figure_documents() -> list[Path]:
    """Where the figures of :data:`FIGURES` may be written: the README, RESULTS_DOC and the README's docs/ pages."""
    docs = sorted((README.parent / "docs").glob("*.md"))
    return list(dict.fromkeys(p for p in (README, RESULTS_DOC, *docs) if p.exists()))


def check() -> list[str]:
    """What is out of date: each generated block (docs/benchmarks.md's results, the others wherever they are) against
    what the files give now, and each figure of :data:`FIGURES` against its file. Empty when all match."""
    problems = []
    doc = RESULTS_DOC.read_text()
    if render_block(doc, build_table(), START, END) != doc:
        problems.append(
            f"{RESULTS_DOC.name}: the results block differs from what the files give (python benchmarks/report.py)"
        )
    texts = {path: path.read_text() for path in block_documents()}
    for name, lines in readme_blocks().items():
        start, end = markers(name)
        holders = [path for path, text in texts.items() if start in text]
        if lines and not holders:
            problems.append(f"no {name} block in {' or '.join(p.name for p in texts)}")
        for path in holders if lines else ():
            if render_block(texts[path], lines, start, end) != texts[path]:
                problems.append(f"{path.name}: the {name} block differs from what the files give")
    flat = " ".join(" ".join(path.read_text().split()) for path in figure_documents())
    figures = [(name, get, words) for name, get, words in FIGURES]
    figures.append(("accuracy_cpu.json", lambda d: three_seed_figures(), "{} of {} over three seeds"))
    for name, get, words in figures:
        data = load(name)
        try:
            shown = words.format(*get(data))
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            problems.append(f"figure from {name}: cannot read it ({type(exc).__name__}: {exc})")
            continue
        if shown not in flat:
            problems.append(f"figure from {name}: neither the README nor docs/ say {shown!r}")
    problems += missing_files()
    return problems


#: A result file named in prose: ``benchmarks/results/NAME`` (``.json``, ``.json.gz``, ``.png``), or a bare
#: ``NAME_cpu.json`` (``_h100``, ``_h200``; a suffix after them as in ``_cpu_before``) in backticks; ``*`` and
#: ``{a,b}`` stand for several files.
RESULT_REFERENCE = re.compile(
    r"benchmarks/results/([\w*{},.-]+\.(?:json(?:\.gz)?|png))|`([\w*{][\w*{},.-]*_(?:cpu|h100|h200)\w*\.json(?:\.gz)?)`"
)


def expand_braces(pattern: str) -> list[str]:
    """``a_{x,y}_b`` -> ``[a_x_b, a_y_b]`` (nested and repeated braces too)."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [name for alt in match.group(1).split(",") for name in expand_braces(head + alt + tail)]


def missing_files() -> list[str]:
    """Result files the README and docs/ name that do not exist under that name (a result gzipped or made plain by
    a rerun changes its name: result_files.py); a pattern must match at least one file."""
    names = [p.name for p in RESULTS.iterdir()] if RESULTS.is_dir() else []
    problems = []
    for doc in figure_documents():
        found = RESULT_REFERENCE.findall(doc.read_text())
        for reference in sorted({a or b for a, b in found}):
            for name in expand_braces(reference):
                if any(fnmatch.fnmatchcase(n, name) for n in names):
                    continue
                other = [
                    n for n in names if fnmatch.fnmatchcase(result_files.base_name(n), result_files.base_name(name))
                ]
                now = f" (stored as {', '.join(sorted(other)[:3])} now)" if other else ""
                problems.append(f"{doc.name} names {name}, which does not exist in benchmarks/results{now}")
    return problems


def build_table() -> list[str]:
    parts = []
    overhead = load("plugin_overhead_cpu.json")
    prefill = load("throughput_prefill_cpu.json")
    for name, make in (
        ("quality_cpu.json", quality_table),
        ("accuracy_cpu.json", accuracy_table),
        ("kvpress_reference_cpu.json", kvpress_table),
        ("throughput_cpu.json", throughput_table),
    ):
        data = load(name)
        if data is not None:
            parts += [*make(data), ""]
    if overhead is not None:
        parts += [*overhead_line(overhead), ""]
    if prefill is not None:
        parts += [*prefill_line(prefill), ""]
    if result_files.all_results(RESULTS):
        parts += [*files_table(), ""]
    images = [p.name for p in sorted(RESULTS.glob("*.png"))]
    if images:
        folder = Path(os.path.relpath(RESULTS, RESULTS_DOC.parent)).as_posix()  # links relative to the document
        parts.append("Plots: " + ", ".join(f"[{n}]({folder}/{n})" for n in images) + ".")
    return parts


def write_block(path: Path, lines: list[str], start: str = START, end: str = END) -> None:
    """Replace what lies between ``start`` and ``end`` in ``path`` (appended at the end when the markers are absent)."""
    text = path.read_text()
    block = "\n".join([start, *lines, end])
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def write_results_doc(lines: list[str]) -> None:
    write_block(RESULTS_DOC, lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--no-write",
        "--no-readme",
        dest="no_write",
        action="store_true",
        help=f"print the block instead of writing it into {RESULTS_DOC.name}",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 naming each generated block (docs/benchmarks.md, README) that "
        "differs from what the files give and each figure (README, docs/) that does not match its file",
    )
    parser.add_argument(
        "--stale",
        nargs="+",
        metavar="FILE",
        default=None,
        help="print, for these result files, where each was made and every row whose config as run "
        "differs from what its label gives today, with the reason",
    )
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for p in problems:
            print(p, file=sys.stderr)
        print(
            f"{len(problems)} out of date" if problems else "generated blocks and figures match the files",
            file=sys.stderr,
        )
        return 1 if problems else 0
    if args.stale:
        for name in args.stale:
            data = load(Path(name).name)
            if data is None:
                print(f"{name}: no such result file", file=sys.stderr)
                continue
            o = provenance.origin(RESULTS / data["_file"], data)
            print(f"{data['_file']}: {provenance.describe_origin(o)}; {machine_words(data)}")
            for label, info in row_configs(data).items():
                print(f"  {label}: " + ("; ".join(info["reasons"]) or "as its label means today"))
        return 0
    q, a, t = load("quality_cpu.json"), load("accuracy_cpu.json"), load("throughput_cpu.json")
    if q:
        full = q["summary"].get("full", {}).get("ver")
        plot_lines(
            curves(q["summary"], "ver"),
            "value error rate (last layer)",
            "Value error vs compression (SmolLM2-135M, transformers)",
            RESULTS / "ratio_vs_value_error.png",
            full,
        )
    if a:
        full = a["summary"].get("full", {}).get("needle_accuracy")
        plot_lines(
            curves(a["summary"], "needle_accuracy"),
            "needle accuracy",
            "Needle retrieval vs compression (vLLM + plugin)",
            RESULTS / "ratio_vs_needle_accuracy.png",
            full,
        )
    if t:
        plot_throughput(t, RESULTS / "ratio_vs_throughput.png")
    lines = build_table()
    if args.no_write:
        print("\n".join(lines))
    else:
        write_results_doc(lines)
        blocks = readme_blocks()
        written = []
        for path in block_documents():
            text = path.read_text() if path.exists() else ""
            new = text
            for name, block in blocks.items():
                start, end = markers(name)
                if block and start in new:  # the document holds the markers; nothing is appended to it
                    new = render_block(new, block, start, end)
                    written.append(f"{path.name}: {name}")
            if new != text:
                path.write_text(new)
        print(
            f"wrote the results block of {RESULTS_DOC}, the {', '.join(written) or 'no other'} block(s) and "
            f"{len(list(RESULTS.glob('*.png')))} plots",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
