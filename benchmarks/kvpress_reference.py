"""kvpress's own presses on the accuracy benchmark's prompts: the field's library as the reference for the plugin.

Runs in its own environment, ``.venv-kvpress`` (kvpress 0.5.5 needs transformers < 5.3; ``./rcstat`` sets it up
beside the main one and reuses its torch), and imports neither vllm nor rcstat_vllm:

    ./rcstat kvpress [--quick]              # set-up, the accuracy run's prompts, then this script
    .venv/bin/python benchmarks/accuracy.py --quick --write-prompts /tmp/prompts.json
    .venv-kvpress/bin/python benchmarks/kvpress_reference.py --prompts /tmp/prompts.json --model DIR [--json OUT]

The prompts JSON is written by the main environment (``accuracy.py --write-prompts`` or ``data.py --json``): its
samples carry task, sample_id, prompt_ids, answers and max_new_tokens. For every press and ratio (and the full
cache), each prompt is compressed WHOLE, the question included, as the plugin does in vLLM (the question sits at
the end of the prompt ids): one forward pass over the prompt inside ``with press(model):`` (kvpress's hooks
compress at prefill; KVzip's context manager runs its context-reconstruction passes when it exits), the first
token from that pass's logits (full attention, as vLLM samples it before the plugin compresses), then greedy
decoding on the compressed cache at the true positions, as kvpress's pipeline decodes (``generate_answer``).
kvpress's pipeline itself compresses only the context, never the question, so it is not used.

Presses at kvpress's defaults: SnapKV (window 64, kernel 5), TOVA, ExpectedAttention, AdaKV(ExpectedAttention)
(head-wise, by masking) and KVzip (query-agnostic, by masking). Attention is sdpa: AdaKV and KVzip refuse eager.
Scoring as data.found_answers: a value is found when the output holds it as a whole word. Totals: values found,
and how many of the values the full cache found the press found too (``kept_of_full``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from contextlib import nullcontext, suppress
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# The prompts' own module (pure Python here: no vLLM, no plugin): the same string match as the plugin's rows.
import data
import result_files
from data import answers_found as found_answers

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_JSON = RESULTS_DIR / "kvpress_reference_cpu.json"
#: Press names on the command line -> how each is built from a compression ratio (kvpress's defaults otherwise).
PRESSES = {
    "snapkv": lambda kvpress, r: kvpress.SnapKVPress(compression_ratio=r),
    "tova": lambda kvpress, r: kvpress.TOVAPress(compression_ratio=r),
    "expected_attention": lambda kvpress, r: kvpress.ExpectedAttentionPress(compression_ratio=r),
    "adakv_expected_attention": lambda kvpress, r: kvpress.AdaKVPress(
        kvpress.ExpectedAttentionPress(compression_ratio=r)
    ),
    "kvzip": lambda kvpress, r: kvpress.KVzipPress(compression_ratio=r),
    "knorm": lambda kvpress, r: kvpress.KnormPress(compression_ratio=r),
    "streaming_llm": lambda kvpress, r: kvpress.StreamingLLMPress(compression_ratio=r),
}
DEFAULT_PRESSES = ["snapkv", "tova", "expected_attention", "adakv_expected_attention", "kvzip"]
DEFAULT_RATIOS = [0.5, 0.8]
#: Tasks scored by string match; summaries (no reference answers offline) are left out unless asked for.
NEEDLE_TASKS = list(data.NEEDLE_TASKS)
#: routes.py's probes (the KV-compression-physics paper's synthetic tasks), scored the same way.
PROBE_TASKS = ["probe_entities", "probe_instances", "probe_coref"]
SCORED_TASKS = [*NEEDLE_TASKS, "vt", *PROBE_TASKS]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--prompts", required=True, help="prompts JSON from accuracy.py --write-prompts or data.py --json"
    )
    parser.add_argument("--model", required=True, help="the model folder (the converted SmolLM2-135M-Instruct)")
    parser.add_argument("--presses", nargs="+", default=DEFAULT_PRESSES, choices=sorted(PRESSES))
    parser.add_argument("--ratios", nargs="+", type=float, default=DEFAULT_RATIOS, help="kvpress compression_ratio")
    parser.add_argument("--tasks", nargs="+", default=SCORED_TASKS, choices=[*SCORED_TASKS, "summ"])
    parser.add_argument("--limit", type=int, default=None, help="the first N prompts only (a smoke run)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="model dtype (default float32: exact on every CPU; bfloat16 on CPUs with AVX512-BF16/AMX)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs the output JSON already holds for these prompts and dtype; run the rest",
    )
    parser.add_argument(
        "--json", default=None, help=f"output (default {DEFAULT_JSON.relative_to(RESULTS_DIR.parents[1])})"
    )
    parser.add_argument(
        "--keep-masks",
        metavar="PATH",
        default=None,
        help="instead of generating: prefill each prompt under each masking press (kvzip, adakv_*) "
        "and save what every (layer, KV head) keeps to PATH (torch), the input of "
        "quality.py --kvpress-masks (the value error of kvpress's presses)",
    )
    args = parser.parse_args(argv)
    if any(not 0 < r < 1 for r in args.ratios):
        parser.error("--ratios must lie in (0, 1)")
    return args


def load_samples(path: str | Path, tasks: list[str], limit: int | None = None) -> tuple[dict, list[dict]]:
    """(the file's header, its samples of ``tasks``): accepts accuracy.py's {..., "samples": [...]} and data.py's
    bare list."""
    raw = result_files.read(path)
    header, samples = (
        ({k: v for k, v in raw.items() if k != "samples"}, raw["samples"]) if isinstance(raw, dict) else ({}, raw)
    )
    missing = [s.get("sample_id") for s in samples if "prompt_ids" not in s]
    if missing:
        raise SystemExit(f"{path}: samples without prompt_ids ({missing[:3]}...): write them with ids")
    samples = [s for s in samples if s["task"] in tasks]
    return header, samples[:limit] if limit else samples


def totals(outputs: list[dict], full_found: dict[str, list[bool]] | None) -> dict:
    """Values found (all scored tasks, and needles alone, per task) and, against the full cache's outputs, how many
    of the needle values it found this run found too. ``outputs``: {"sample_id", "task", "found"} per sample."""
    needle = [o for o in outputs if o["task"] in NEEDLE_TASKS]
    out = {
        "prompts": len(outputs),
        "values": sum(len(o["found"]) for o in outputs),
        "hits": sum(sum(o["found"]) for o in outputs),
        "needle_values": sum(len(o["found"]) for o in needle),
        "needle_hits": sum(sum(o["found"]) for o in needle),
        "by_task": {},
    }
    for task in sorted({o["task"] for o in outputs}):
        rows = [o for o in outputs if o["task"] == task]
        out["by_task"][task] = {
            "values": sum(len(o["found"]) for o in rows),
            "hits": sum(sum(o["found"]) for o in rows),
        }
    if full_found is not None:
        full_hits = sum(sum(full_found.get(o["sample_id"], [])) for o in needle)
        kept = sum(a and b for o in needle for a, b in zip(o["found"], full_found.get(o["sample_id"], [])))
        out.update(
            full_needle_hits=full_hits, kept_of_full=kept, kept_of_full_share=kept / full_hits if full_hits else None
        )
    return out


def row_label(press: str | None, ratio: float) -> str:
    return "full" if press is None else f"{press}_r{ratio:g}"


def resumable_rows(previous: dict, samples: list[dict], dtype: str, kvpress_version: str) -> dict[str, dict]:
    """label -> row of an earlier output that ran these very prompts (ids and lengths, in order) with the same
    dtype and kvpress; {} when anything differs or its full-cache run (what the others are scored against) is
    missing."""
    env = previous.get("environment", {})
    rows = {r["label"]: r for r in previous.get("rows", [])}
    want = [(s["sample_id"], len(s["prompt_ids"])) for s in samples]
    if (env.get("dtype"), env.get("kvpress")) != (dtype, kvpress_version) or "full" not in rows:
        return {}
    if any([(o["sample_id"], o["num_tokens"]) for o in r["samples"]] != want for r in rows.values()):
        return {}
    return rows


# ----------------------------------------------------------------------------------------------- running


def load_model(model_dir: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()  # the weights' loading bar would drown the run's own
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    return model.eval(), AutoTokenizer.from_pretrained(model_dir)


def evicted_share(model, cache, prompt_len: int) -> float:
    """The share of the prompt's KV entries evicted: pruned from the cache (scorer presses) or masked per head
    (AdaKV, KVzip: ``masked_key_indices``, read before decoding)."""
    config = model.config
    total = config.num_hidden_layers * config.num_key_value_heads * prompt_len
    kept = 0
    for layer, block in zip(cache.layers, model.model.layers):
        kept += layer.keys.shape[2] * config.num_key_value_heads
        masked = getattr(block.self_attn, "masked_key_indices", None)
        if masked is not None:
            kept -= len(masked[0])
    return 1.0 - kept / total


def generate(model, tokenizer, prompt_ids: list[int], max_new_tokens: int, press=None) -> tuple[str, float]:
    """Greedy output of one prompt compressed whole by ``press`` (None: the full cache) and the evicted share."""
    import torch
    from transformers import DynamicCache

    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    cache = DynamicCache()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        with press(model) if press is not None else nullcontext():
            logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
        evicted = evicted_share(model, cache, len(prompt_ids))
        tokens = [int(logits[0, -1].argmax())]
        position = len(prompt_ids)  # true positions: a pruned cache is shorter than the prompt
        while len(tokens) < max_new_tokens and tokens[-1] not in eos:
            out = model(
                input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, position_ids=torch.tensor([[position]])
            )
            tokens.append(int(out.logits[0, -1].argmax()))
            position += 1
    return tokenizer.decode(tokens, skip_special_tokens=True), evicted


def run_press(model, tokenizer, kvpress, samples: list[dict], press_name: str | None, ratio: float, bar) -> dict:
    """One press at one ratio (None: the full cache) over every prompt: the row, totals still to add."""
    outputs, t0 = [], time.perf_counter()
    for s in samples:
        press = PRESSES[press_name](kvpress, ratio) if press_name else None
        t1 = time.perf_counter()
        text, evicted = generate(model, tokenizer, s["prompt_ids"], s["max_new_tokens"], press)
        outputs.append(
            {
                "sample_id": s["sample_id"],
                "task": s["task"],
                "num_tokens": len(s["prompt_ids"]),
                "text": text,
                "answers": s["answers"],
                "found": found_answers(s["answers"], text),
                "evicted": round(evicted, 4),
                "seconds": round(time.perf_counter() - t1, 2),
            }
        )
        bar.update()
    return {
        "label": row_label(press_name, ratio),
        "press": press_name,
        "ratio": ratio,
        "evicted": round(sum(o["evicted"] for o in outputs) / max(len(outputs), 1), 4),
        "seconds": round(time.perf_counter() - t0, 1),
        "samples": outputs,
    }


#: Presses that keep the whole prompt in the cache and mask evicted entries per head (``masked_key_indices``): what
#: they keep can be read back, so quality.py can measure their value error on its own reference decode.
MASKING_PRESSES = ("kvzip", "adakv_expected_attention")


def prefill_keep_mask(model, prompt_ids: list[int], press):
    """``[L, Hkv, n]`` bool: the prompt entries each (layer, KV head) keeps after a masking press's prefill (its
    context reconstruction included, for KVzip)."""
    import torch
    from transformers import DynamicCache

    cache, n = DynamicCache(), len(prompt_ids)
    with torch.inference_mode(), press(model):
        model(input_ids=torch.tensor([prompt_ids]), past_key_values=cache, logits_to_keep=1)
    config = model.config
    keep = torch.ones(config.num_hidden_layers, config.num_key_value_heads, n, dtype=torch.bool)
    for layer, (cache_layer, block) in enumerate(zip(cache.layers, model.model.layers)):
        if cache_layer.keys.shape[2] != n:
            raise SystemExit(
                f"--keep-masks: {press!r} pruned layer {layer}'s cache to {cache_layer.keys.shape[2]} "
                f"of {n} entries; only masking presses ({', '.join(MASKING_PRESSES)}) can be read back"
            )
        masked = getattr(block.self_attn, "masked_key_indices", None)
        if masked is not None:
            batch, heads, positions = (index.cpu() for index in masked)
            keep[layer, heads[batch == 0], positions[batch == 0]] = False
    return keep


def export_keep_masks(
    model, kvpress, samples: list[dict], presses: list[str], ratios: list[float], path: Path, env: dict
) -> None:
    """Save every masking press's keep masks per prompt: {"environment", "masks": {label: {sample_id: [L, H, n]
    bool}}, "prompt_lengths": {sample_id: n}}."""
    import torch
    from tqdm import tqdm

    unsupported = [p for p in presses if p not in MASKING_PRESSES]
    if unsupported:
        raise SystemExit(f"--keep-masks: {unsupported} prune the cache; choose among {list(MASKING_PRESSES)}")
    # Plain types only (torch's version string is a subclass of str), so torch.load(weights_only=True) reads it.
    env = {key: str(value) if isinstance(value, str) else value for key, value in env.items()}
    out = {"environment": env, "masks": {}, "prompt_lengths": {s["sample_id"]: len(s["prompt_ids"]) for s in samples}}
    with tqdm(total=len(presses) * len(ratios) * len(samples), unit="prompt") as bar:
        for press_name in presses:
            for ratio in ratios:
                label = row_label(press_name, ratio)
                bar.set_description(label)
                masks = out["masks"][label] = {}
                for s in samples:
                    masks[s["sample_id"]] = prefill_keep_mask(
                        model, s["prompt_ids"], PRESSES[press_name](kvpress, ratio)
                    )
                    bar.update()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, path)
    print(f"keep masks of {', '.join(out['masks'])} for {len(samples)} prompts written to {path}", file=sys.stderr)


def environment(dtype: str) -> dict:
    from importlib.metadata import version

    import kvpress
    import torch
    import transformers

    cpu = platform.processor()
    with suppress(OSError, StopIteration):
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    from common import git_state, machine

    return {
        "kvpress": version("kvpress"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": dtype,
        "attn_implementation": "sdpa",
        "cpu": cpu,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "kvpress_path": str(Path(kvpress.__file__).parent),
        # How it was made, as every result file records it (benchmarks/common.py): no plugin, no vLLM here.
        "machine": machine(),
        "git": git_state(),
        "argv": [Path(sys.argv[0]).name, *sys.argv[1:]],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import kvpress  # patches transformers' attention functions (head-wise masking for AdaKV and KVzip)
    import torch
    from tqdm import tqdm

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    header, samples = load_samples(args.prompts, args.tasks, args.limit)
    model, tokenizer = load_model(args.model, args.dtype)
    if args.keep_masks:
        export_keep_masks(
            model, kvpress, samples, args.presses, args.ratios, Path(args.keep_masks), environment(args.dtype)
        )
        return 0
    runs = [(None, 0.0)] + [(p, r) for p in args.presses for r in args.ratios]
    report = {
        "benchmark": "kvpress_reference",
        "environment": environment(args.dtype),
        "model": args.model,
        "prompts": {
            "path": str(args.prompts),
            **{k: header[k] for k in ("preset", "seed") if k in header},
            "n": len(samples),
            "tokens": sum(len(s["prompt_ids"]) for s in samples),
            "tasks": sorted({s["task"] for s in samples}),
        },
        "presses": {p: repr(PRESSES[p](kvpress, 0.5)) for p in args.presses},
        "rows": [],
    }
    print(
        f"{len(samples)} prompts ({report['prompts']['tokens']} tokens) x {len(runs)} runs, "
        f"kvpress {report['environment']['kvpress']}, transformers {report['environment']['transformers']}, "
        f"{args.dtype}",
        file=sys.stderr,
    )
    out = Path(args.json) if args.json else DEFAULT_JSON
    out.parent.mkdir(parents=True, exist_ok=True)
    report["runs_planned"] = [row_label(p, r) for p, r in runs]
    previous = {}
    if args.resume and result_files.find(out):
        previous = resumable_rows(result_files.read(out), samples, args.dtype, report["environment"]["kvpress"])
        print(
            f"resuming: {len(previous)} runs kept from {out}"
            if previous
            else f"--resume: {out} holds no runs of these prompts, dtype and kvpress; running all",
            file=sys.stderr,
        )
    full_found, full_texts = None, {}
    bar = tqdm(total=len(runs) * len(samples), unit="prompt")
    for press_name, ratio in runs:
        label = row_label(press_name, ratio)
        bar.set_description(label)
        row = previous.get(label)
        if row is not None:
            bar.update(len(samples))
        else:
            row = run_press(model, tokenizer, kvpress, samples, press_name, ratio, bar)
        if press_name is None:
            full_found = {o["sample_id"]: o["found"] for o in row["samples"]}
            full_texts = {o["sample_id"]: o["text"] for o in row["samples"]}
        for o in row["samples"]:
            o["same_as_full"] = o["text"] == full_texts.get(o["sample_id"])
        row["totals"] = totals(row["samples"], full_found)
        report["rows"].append(row)
        report["complete"] = len(report["rows"]) == len(runs)
        # After every run, with the earlier output's runs not reached yet: a long run cut short keeps what it did
        # and loses nothing it resumed from.
        done = {r["label"] for r in report["rows"]}
        result_files.write(
            {**report, "rows": report["rows"] + [r for label, r in previous.items() if label not in done]}, out
        )
        t = row["totals"]
        bar.write(
            f"{label}: needle values {t['needle_hits']}/{t['needle_values']}, of the full cache's "
            f"{t['kept_of_full']}/{t['full_needle_hits']}, evicted {row['evicted']:.3f}, {row['seconds']:.0f} s"
            + (" (kept from the earlier run)" if label in previous else "")
        )
    bar.close()
    print(f"wrote {result_files.find(out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
