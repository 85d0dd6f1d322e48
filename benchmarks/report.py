"""Plots and the generated results block of docs/benchmarks.md, from the benchmarks' JSON in benchmarks/results/.

    python benchmarks/report.py                 # PNGs into benchmarks/results/, block into docs/benchmarks.md
    python benchmarks/report.py --no-write      # PNGs only; the block is printed (--no-readme: the old name)

The block replaces what lies between the ``<!-- results:start -->`` and ``<!-- results:end -->`` markers of
:data:`RESULTS_DOC`, the one file that holds them; links in it are relative to that file. Each part is drawn
from whichever JSON exists (quality_cpu.json, accuracy_cpu.json, kvpress_reference_cpu.json, throughput_cpu.json,
plugin_overhead_cpu.json, throughput_prefill_cpu.json); the block says which file and run every number comes from.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from methods import FAMILY_LABELS  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: The document whose marked block this script writes (the README links to it).
RESULTS_DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
#: The README's side-by-side table of the plugin's methods and kvpress's presses (:func:`side_by_side_table`).
README = Path(__file__).resolve().parents[1] / "README.md"
SIDE_START, SIDE_END = "<!-- side-by-side:start -->", "<!-- side-by-side:end -->"
#: The plugin's rows of that table (accuracy.py labels), in order; missing labels are skipped.
SIDE_BY_SIDE_PLUGIN = ("full", "default", "default_mean_contrast0", "rc_r0.5", "rc_r0.8", "rc_r0.8_mean_contrast0",
                       "rc_r0.8_contrast0", "rc_r0.8_mean", "snapkv_w64_r0.5",
                       "snapkv_w64_r0.8", "tova_w1_r0.5", "tova_w1_r0.8")
STYLE = {"full": ("black", "*"), "rc": ("tab:red", "o"), "rc_budget": ("tab:orange", "s"), "snapkv": ("tab:blue", "^"),
         "tova": ("tab:green", "v"), "knorm": ("tab:purple", "D"), "streaming": ("tab:brown", "P"),
         "random": ("tab:gray", "x"), "default": ("tab:orange", "*"), "rc_paper": ("tab:pink", "s"), "rc_carry0": ("tab:red", "x"),
         "rc_mean": ("tab:red", "+"), "rc_contrast0": ("tab:red", "1"), "rc_mean_contrast0": ("tab:red", "2"),
         "snapkv_rc_window": ("tab:cyan", "^"), "tova_rc_window": ("tab:olive", "v")}
HEADLINE = ("rc_budget", "snapkv", "tova", "knorm", "streaming", "random")


def load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


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
    fig.suptitle(f"vLLM-CPU, KV pool of {w['kv_tokens']} tokens, {w['requests']} requests of "
                 f"{w['min_len']}-{w['max_len']} prompt + {w['max_tokens']} output tokens", fontsize=10)
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
    ratios = sorted({round(e["ratio"], 2) for k, e in s.items() if e["family"] == "snapkv" and not e["matched_to"]})
    families = [f for f in HEADLINE if any(e["family"] == f for e in s.values())]
    lines = [f"**Value error rate** (RCStat Eq. 8, last layer, lower is better; transformers, {len(q['samples'])} "
             f"prompts, `benchmarks/results/quality_cpu.json`), budget mode at fixed ratios:", "",
             "| ratio | " + " | ".join(FAMILY_LABELS[f] for f in families) + " |",
             "|---|" + "---|" * len(families)]
    for r in ratios:
        cells = [_f(s.get(f"{f}_r{r:g}", {}).get("ver")) for f in families]
        lines.append(f"| {r:g} | " + " | ".join(cells) + " |")
    rc = [(k, e) for k, e in s.items() if e["family"] == "rc"]
    if rc:
        lines += ["", "RCStat threshold mode and the baselines at the ratio it achieved on each prompt:", "",
                  "| setting | ratio | RCStat | RCStat budget | SnapKV | TOVA |", "|---|---|---|---|---|---|"]
        for label, e in rc:
            matched = [_f(s.get(f"{f}@{label}", {}).get("ver")) for f in ("rc_budget", "snapkv", "tova")]
            lines.append(f"| {label} | {_f(e['ratio'])} | {_f(e['ver'])} | " + " | ".join(matched) + " |")
    return lines


def describe(entry: dict) -> str:
    """A setting in words from the config its requests ran with (so a default row says what the default is)."""
    c = entry.get("resolved")
    if entry.get("family") == "full" or not c:
        return "full cache" if entry.get("family") == "full" else ""
    if c["method"] == "none":
        return "none"
    mode = (f"budget {c['target_ratio']:g} ({'model-wide' if c['budget_scope'] == 'model' else 'per layer'})"
            if c.get("target_ratio") is not None else f"threshold c = {c['c']:g}")
    parts = [c["method"].replace("snapkv", "SnapKV").replace("tova", "TOVA").replace("rc", "RC"), mode,
             f"window {c['window']}"]
    if c.get("observation_window") is not None:
        parts.append(f"{c['observation_window']} queries observed")
    if c["method"] == "rc":
        parts.append(f"smoothing {c['smoothing']}")
        if c.get("carry_forward"):
            parts.append(f"scores carried {c['carry_forward']} tokens forward")
        # Older runs predate the knob: they scored with Eq. 6's mean.
        parts.append("max over the window's queries" if c.get("query_reduction", "mean") == "max"
                     else "mean over the window's queries (Eq. 6)")
        # Older runs predate it too (no contrast); threshold mode does not apply it.
        if c.get("local_contrast") and c.get("target_ratio") is not None:
            parts.append(f"contrast {c['local_contrast']:g} over {c['contrast_radius']} tokens")
    if c.get("sink_tokens"):
        parts.append(f"{c['sink_tokens']} sink tokens")
    if c.get("target_ratio") is not None and c.get("budget_scope") == "model" and c.get("layer_floor"):
        parts.append(f"layer floor {c['layer_floor']:g}")
    text = ", ".join(parts)
    return f"bare flag: {text}" if entry.get("family") == "default" else text


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
    count = {t: sum(1 for x in samples if x.get("task") == t)
             for t in ("niah_single", "niah_multi", "niah_multikey", "niah_multivalue", "vt", "summ")}
    if not any("needle_hits" in e for e in s.values()):  # an older run: score columns only
        tasks = sorted({t for e in s.values() for t in e["by_task"]})
        lines = ["**Task accuracy through vLLM with the plugin** (greedy; `benchmarks/results/accuracy_cpu.json`):", "",
                 "| setting | ratio | " + " | ".join(tasks) + " | = full cache |",
                 "|---|---|" + "---|" * (len(tasks) + 1)]
        for label, e in s.items():
            cells = [_f(e["by_task"].get(t, {}).get("score")) for t in tasks]
            lines.append(f"| {label} | {_f(e['ratio'])} | " + " | ".join(cells) + f" | {_f(e['same_as_full'], 2)} |")
        return lines
    lines = [f"**Task accuracy through vLLM with the plugin** (greedy, one engine, every setting side by side; "
             f"{count['niah_single']} single-needle, {count['niah_multi']} three-needle, {count['niah_multikey']} "
             f"multi-key (four keys, one asked) and {count['niah_multivalue']} multi-value (four values of one key) "
             f"prompts, "
             f"{count['vt']} variable-tracking, {count['summ']} summaries; needles: values found; *of full*: share "
             f"of the values the full cache found that the setting found too; vt: share of variables named; summ: "
             f"ROUGE-L F1 against the full-cache output; *= full*: outputs token-identical to the full cache; "
             f"`benchmarks/results/accuracy_cpu.json`):", "",
             "| setting | what | evicted | single needle | multi needle | multi-key | multi-value | of full | vt | summ "
             "| = full |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, e in s.items():
        task = lambda t: _f(e["by_task"].get(t, {}).get("score"))  # noqa: E731
        what = describe(e) + (f" (same run as `{e['same_run_as']}`)" if e.get("same_run_as") else "")
        lines.append(f"| {label} | {what} | {_f(e['ratio'])} | {_hits(e, 'niah_single')} | {_hits(e, 'niah_multi')} "
                     f"| {_hits(e, 'niah_multikey')} | {_hits(e, 'niah_multivalue')} | {_of_full(e)} | {task('vt')} | {task('summ')} "
                     f"| {_f(e['same_as_full'], 2)} |")
    fid = a.get("fidelity", {}).get("by_setting")
    if fid:
        rates = ", ".join(f"{k} {v['exact_match_rate']:.2f}" for k, v in fid.items())
        n = max(v["n"] for v in fid.values())
        lines += ["", f"Fidelity, vLLM vs the transformers masked reference ({n} prompts, exact greedy match rate): "
                      f"{rates}."]
    return lines


KVPRESS_NAMES = {"snapkv": "SnapKV", "tova": "TOVA", "expected_attention": "ExpectedAttention",
                 "adakv_expected_attention": "AdaKV(ExpectedAttention)", "kvzip": "KVzip", "knorm": "Knorm",
                 "streaming_llm": "StreamingLLM"}


def kvpress_rows(k: dict) -> list[tuple[str, str, str, str, str]]:
    """(press, ratio, evicted, needle values found, share of the full cache's values kept) per run of
    kvpress_reference.py, the full cache first."""
    rows = []
    for r in k["rows"]:
        t = r["totals"]
        press = "full cache" if r["press"] is None else KVPRESS_NAMES.get(r["press"], r["press"])
        kept = (f"{t['kept_of_full']}/{t['full_needle_hits']} ({100 * t['kept_of_full_share']:.1f}%)"
                if t.get("kept_of_full_share") is not None else "-")
        rows.append((press, f"{r['ratio']:g}", _f(r.get("evicted")), f"{t['needle_hits']}/{t['needle_values']}", kept))
    return rows


def kvpress_table(k: dict) -> list[str]:
    env, prompts = k["environment"], k["prompts"]
    lines = [f"**kvpress {env['kvpress']} as the reference** (its own presses at their defaults, through transformers "
             f"{env['transformers']}, {env['dtype']}, sdpa; the accuracy benchmark's {prompts['n']} scored prompts "
             f"({', '.join(prompts['tasks'])}), each compressed whole, question included, then greedy; *of full*: "
             f"share of the needle values kvpress's full cache found that the press found too; "
             f"`benchmarks/results/kvpress_reference_cpu.json`):", "",
             "| press | ratio | evicted | needle values | of full |", "|---|---|---|---|---|"]
    lines += [f"| {' | '.join(row)} |" for row in kvpress_rows(k)]
    if not k.get("complete", True):
        lines += ["", f"A partial run: {len(k['rows'])} of the {len(k.get('runs_planned', []))} planned press and ratio "
                      f"runs finished."]
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
    if a is not None:
        for label in SIDE_BY_SIDE_PLUGIN:
            e = a["summary"].get(label)
            if e is None or "needle_hits" not in e:
                continue
            of_full = "-" if e.get("family") == "full" else _of_full(e)
            rows.append(("plugin, vLLM", _plugin_row_name(label, e), _f(e["ratio"], 2),
                         f"{e['needle_hits']}/{e['needle_values']}", of_full))
    if k is not None:
        engine = f"kvpress {k['environment']['kvpress']}"
        for press, ratio, evicted, found, kept in kvpress_rows(k):
            rows.append((engine, press, _f(float(evicted), 2) if evicted != "-" else ratio, found,
                         "-" if press == "full cache" else kept))
    env = (a or {}).get("environment", {})
    kenv = (k or {}).get("environment", {})
    lines += [f"Needle values found on the accuracy benchmark's prompts (generated by `./rcstat bench`: the plugin "
              f"through vLLM {env.get('vllm', '?')} in {env.get('engine_dtype', '?')}, "
              f"`benchmarks/results/accuracy_cpu.json`; "
              f"kvpress's own presses at their defaults through transformers {kenv.get('transformers', '?')} in "
              f"{kenv.get('dtype', '?')}, `benchmarks/results/kvpress_reference_cpu.json`; *of full*: of the values "
              f"its own engine's full cache found):", "",
              "| engine | method | evicted | needle values | of full |", "|---|---|---|---|---|"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    if k is not None and not k.get("complete", True):
        planned = len(k.get("runs_planned", []))
        lines += ["", f"kvpress: a partial run, {len(k['rows'])} of {planned} press and ratio runs."]
    return lines


def throughput_table(t: dict) -> list[str]:
    w = t["workload"]
    lines = [f"**Throughput, KV-memory-bound** (vLLM-CPU, {t.get('environment', {}).get('cores', '?')} cores, pool "
             f"of {w['kv_tokens']} tokens, {w['requests']} requests of {w['min_len']}-{w['max_len']} + "
             f"{w['max_tokens']} tokens, one run each, side by side; `benchmarks/results/throughput_cpu.json`):", "",
             "| run | ratio | out tok/s | x vanilla | peak running | mean running | fragmentation | preemptions |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in t["runs"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | | | | |")
            continue
        vs = r.get("vs_vanilla", {}).get("output_tok_per_s")
        lines.append(f"| {name} | {_f(r.get('mean_ratio', 0.0))} | {r['output_tok_per_s']:.1f} | {_f(vs, 2)} | "
                     f"{r['peak_running']:g} | {r['mean_running']:.1f} | {_f(r.get('mean_fragmentation'), 2)} | "
                     f"{r['preemptions']:g} |")
    over = {k: v for r in t["runs"].values() for k, v in r.get("prefill_overhead", {}).items()}
    if over:
        cells = ", ".join(f"{k} {v['tok_per_s']:.0f}" for k, v in over.items())
        lines += ["", f"Prefill (prompt tokens/s, median of rounds; `none`/`rc`/`snapkv`/`tova` in the plugin's "
                      f"engine, `vanilla` in vLLM's): {cells}."]
    return lines


def overhead_line(o: dict) -> list[str]:
    """The plugin with method none vs vanilla vLLM, from interleaved rounds (throughput.py --repeat)."""
    runs = o["runs"]
    if "vanilla" not in runs or "none" not in runs or "error" in runs["vanilla"] or "error" in runs["none"]:
        return []
    rounds = lambda name: ", ".join(f"{x:.1f}" for x in runs[name].get("rounds_output_tok_per_s", []))  # noqa: E731
    ratio = runs["none"]["output_tok_per_s"] / runs["vanilla"]["output_tok_per_s"]
    return [f"**Plugin overhead, nothing evicted** (`{{\"method\": \"none\"}}` vs vanilla vLLM, same workload, "
            f"{o.get('repeat', 1)} interleaved rounds; `benchmarks/results/plugin_overhead_cpu.json`): output tokens/s "
            f"vanilla {rounds('vanilla')}, plugin {rounds('none')}; median ratio {ratio:.2f}."]


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
    return [f"**Prefill only** ({w['requests']} prompts of {w['max_len']} tokens, {w['max_tokens']} output token, "
            f"KV pool of {w['kv_tokens']} tokens (never limiting), {p.get('repeat', 1)} interleaved rounds; "
            f"`benchmarks/results/throughput_prefill_cpu.json`): vanilla {speeds} prompt tokens/s; prompt tokens/s "
            f"/ vanilla's in the same round: " + "; ".join(cells) + "."]


def build_table() -> list[str]:
    parts = []
    overhead = load("plugin_overhead_cpu.json")
    prefill = load("throughput_prefill_cpu.json")
    for name, make in (("quality_cpu.json", quality_table), ("accuracy_cpu.json", accuracy_table),
                       ("kvpress_reference_cpu.json", kvpress_table), ("throughput_cpu.json", throughput_table)):
        data = load(name)
        if data is not None:
            parts += make(data) + [""]
    if overhead is not None:
        parts += overhead_line(overhead) + [""]
    if prefill is not None:
        parts += prefill_line(prefill) + [""]
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
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def write_results_doc(lines: list[str]) -> None:
    write_block(RESULTS_DOC, lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-write", "--no-readme", dest="no_write", action="store_true",
                        help=f"print the block instead of writing it into {RESULTS_DOC.name}")
    args = parser.parse_args(argv)
    q, a, t = load("quality_cpu.json"), load("accuracy_cpu.json"), load("throughput_cpu.json")
    if q:
        full = q["summary"].get("full", {}).get("ver")
        plot_lines(curves(q["summary"], "ver"), "value error rate (last layer)",
                   "Value error vs compression (SmolLM2-135M, transformers)", RESULTS / "ratio_vs_value_error.png", full)
    if a:
        full = a["summary"].get("full", {}).get("needle_accuracy")
        plot_lines(curves(a["summary"], "needle_accuracy"), "needle accuracy",
                   "Needle retrieval vs compression (vLLM + plugin)", RESULTS / "ratio_vs_needle_accuracy.png", full)
    if t:
        plot_throughput(t, RESULTS / "ratio_vs_throughput.png")
    lines = build_table()
    if args.no_write:
        print("\n".join(lines))
    else:
        write_results_doc(lines)
        side = side_by_side_table(a, load("kvpress_reference_cpu.json"))
        if side and SIDE_START in README.read_text():  # the README holds the markers; nothing is appended to it
            write_block(README, side, SIDE_START, SIDE_END)
        print(f"wrote the results block of {RESULTS_DOC}, the README's side-by-side table and "
              f"{len(list(RESULTS.glob('*.png')))} plots", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
