"""The compression settings the benchmarks compare, as plugin config dicts with a label and a family.

Families (one plot line each): ``full`` (no eviction), ``rc`` (RCStat threshold mode, Eq. 9, the ratio is an
outcome of c), ``rc_budget`` (RC scores, budget mode), and the budget-mode baselines ``snapkv``, ``tova``,
``knorm``, ``streaming``, ``random``. Budget mode evicts the same fraction of every layer's prompt entries for
every method, so the families are compared at matched ratios. ``matched`` entries put a baseline in budget
mode at the ratio RC's threshold mode achieved on the same prompt (filled in per prompt).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

BASELINES = ("snapkv", "tova", "knorm", "streaming", "random")
#: The defaults' later changes, each undone (suffix -> (override, in words)): carry0, RCStat's scores not carried
#: forward; mean, Eq. 6's mean over the window's queries (the default before max); contrast0, no local contrast (the
#: default before it); mean_contrast0, both scoring changes (each token scored as Eq. 6 scores it, then smoothed and
#: carried forward: the default before the two). The accuracy benchmark runs them at the bare flag and at RC budgets.
DEFAULTS_UNDONE = {
    "carry0": ({"carry_forward": 0}, "scores not carried forward"),
    "mean": ({"query_reduction": "mean"}, "Eq. 6's mean over the window's queries"),
    "contrast0": ({"local_contrast": 0.0}, "no local contrast"),
    # group_reduction pinned too: Eq. 6 scores per query head, and a KV head's are its query heads' mean (the max
    # is the default from 0.9 on), so the row keeps Eq. 6's scores at every ratio.
    "mean_contrast0": (
        {"query_reduction": "mean", "group_reduction": "mean", "local_contrast": 0.0},
        "Eq. 6's mean, no local contrast",
    ),
}
FAMILY_LABELS = {
    "full": "full cache",
    "default": "bare flag (defaults)",
    "rc": "RCStat (threshold c)",
    "rc_budget": "RCStat (budget)",
    "rc_paper": "RCStat (budget per layer, window 8, no smoothing)",
    "rc_defaults": "RC (the plugin's defaults)",
    "kvpress_kvzip": "KVzip (kvpress's keep sets)",
    "kvpress_adakv_expected_attention": "AdaKV(ExpectedAttention) (kvpress's keep sets)",
    "snapkv": "SnapKV",
    "tova": "TOVA",
    "snapkv_rc_window": "SnapKV (RC's window)",
    "tova_rc_window": "TOVA (RC's window)",
    "knorm": "K-norm",
    "streaming": "StreamingLLM",
    "random": "random",
    **{f"rc_{name}": f"RCStat (budget, {words})" for name, (_, words) in DEFAULTS_UNDONE.items()},
    **{f"default_{name}": f"bare flag, {words}" for name, (_, words) in DEFAULTS_UNDONE.items()},
}


@dataclass(frozen=True)
class Setting:
    label: str
    family: str
    rcstat: dict = field(default_factory=dict)  # the per-request override ({"method": ..., ...})
    #: for matched settings: the RC threshold label whose per-prompt ratio this one takes
    matched_to: str | None = None
    #: model-wide budgets: how layers' scores are made comparable (benchmarks/layer_budgets.LAYER_COMPARABLE_SCORES;
    #: None = the plugin's choice). Benchmarks only: the served plugin always uses its own choice.
    comparable: str | None = None
    #: the transformers reference only: each head's count moved to a page boundary of this many tokens, as the engine
    #: moves it (``hf_reference.select_layers(page_size=...)``); None = the selection rule alone.
    page_size: int | None = None

    def to_dict(self) -> dict:
        row = {
            "label": self.label,
            "family": self.family,
            "rcstat": dict(self.rcstat),
            "matched_to": self.matched_to,
            "comparable": self.comparable,
        }
        if self.page_size:
            row["page_size"] = self.page_size
        return row


def rc_label(c: float) -> str:
    return f"rc_c{c:g}"


#: The RCStat paper's scoring in budget mode, as RC was measured before the defaults changed (docs/defaults.md):
#: Eq. 6's mean over an 8-token window's queries, no smoothing, no carrying, no local contrast, no sinks, a per-layer
#: budget. Every field a default has ever changed is spelled out, so a row that pins it keeps its meaning.
PAPER_RC = {
    "method": "rc",
    "window": 8,
    "smoothing": 1,
    "carry_forward": 0,
    "budget_scope": "layer",
    "sink_tokens": 0,
    "query_reduction": "mean",
    "group_reduction": "mean",
    "local_contrast": 0.0,
    "chunk": 1,
    "value_weight": 0.0,
}
#: What kvpress's presses do beside their scoring, pinned for the baselines of build_settings: a per-layer budget,
#: no sink tokens (the plugin's defaults became model-wide with 4 sinks; a baseline row must not follow them).
KVPRESS_BUDGET = {"budget_scope": "layer", "sink_tokens": 0}


def build_settings(
    c_values=(0.05, 0.5, 1.0, 1.5),
    ratios=(0.5, 0.8),
    baselines=BASELINES,
    rc_budget: bool = True,
    matched_c=(),
    matched_methods=("rc_budget", "snapkv", "tova"),
    window: int = 8,
    default_ratios=(),
    undone_ratios=(),
) -> list[Setting]:
    """Full cache, the bare flag's default, RC at each c, and each budget family at each ratio; plus matched
    settings for matched_c. RC rows (``rc_c*``, ``rc_budget_*``, ``rc_budget@*``) pin the RCStat paper's own
    scoring (:data:`PAPER_RC` at ``window``: Eq. 6's mean, no smoothing, carrying or local contrast, no sinks,
    per-layer budgets) and the baselines a per-layer budget without sinks (:data:`KVPRESS_BUDGET`), so that their
    labels keep their meaning whatever the plugin's defaults are. Until 2026-11-26 these rows left
    ``carry_forward``, ``query_reduction`` and ``local_contrast`` (and the baselines ``budget_scope`` and
    ``sink_tokens``) to the defaults: files made before say so (``benchmarks/report.py`` reads what they ran with).

    ``default_ratios``: also RC with the plugin's defaults at these budgets (``rc_r<r>``, family ``rc_defaults``:
    these rows follow the defaults on purpose, as the accuracy benchmark's ``rc_r*``); ``undone_ratios``: also RC
    with the defaults but both scoring changes undone (``rc_r<r>_mean_contrast0``: Eq. 6's mean, no contrast)."""
    paper = {k: v for k, v in PAPER_RC.items() if k not in ("method", "window")}
    settings = [Setting("full", "full", {"method": "none"}), Setting("default", "default", {})]
    settings += [
        Setting(f"rc_r{r:g}", "rc_defaults", {"method": "rc", "target_ratio": float(r)}) for r in default_ratios
    ]
    undone, _ = DEFAULTS_UNDONE["mean_contrast0"]
    settings += [
        Setting(f"rc_r{r:g}_mean_contrast0", "rc_mean_contrast0", {"method": "rc", "target_ratio": float(r), **undone})
        for r in undone_ratios
    ]
    settings += [
        Setting(rc_label(c), "rc", {"method": "rc", "c": float(c), "window": window, **paper}) for c in c_values
    ]
    families = (["rc_budget"] if rc_budget else []) + list(baselines)
    for family in families:
        method = "rc" if family == "rc_budget" else family
        for r in ratios:
            extra = paper if method == "rc" else KVPRESS_BUDGET
            settings.append(
                Setting(
                    f"{family}_r{r:g}", family, {"method": method, "target_ratio": float(r), "window": window, **extra}
                )
            )
    for c in matched_c:
        for family in matched_methods:
            method = "rc" if family == "rc_budget" else family
            extra = paper if method == "rc" else KVPRESS_BUDGET
            settings.append(
                Setting(
                    f"{family}@{rc_label(c)}",
                    family,
                    {"method": method, "window": window, **extra},
                    matched_to=rc_label(c),
                )
            )
    return settings


#: quality.py's build_settings arguments per preset (here so that report.py knows what each label means today).
QUALITY_SETTINGS = {
    "quick": dict(c_values=(0.05, 1.0), ratios=(0.5, 0.8), matched_c=(1.0,), default_ratios=(0.8,)),
    # RC budget rows twice: with the paper's scoring (rc_budget_*, pinned) and with the plugin's defaults (rc_r*),
    # and at 0.8 with the defaults but Eq. 6's scores (rc_r0.8_mean_contrast0).
    "default": dict(
        c_values=(0.05, 0.5, 1.0, 1.5),
        ratios=(0.3, 0.5, 0.7, 0.8, 0.9),
        matched_c=(0.05, 0.5, 1.0, 1.5),
        default_ratios=(0.3, 0.5, 0.7, 0.8, 0.9),
        undone_ratios=(0.8,),
    ),
}


def plugin_defaults() -> dict:
    """What the bare flag (``{"rcstat": {}}``) means: the plugin's own defaults, read from ``RCStatConfig()``."""
    from rcstat_vllm.config import RCStatConfig

    return RCStatConfig().to_dict()


def kvpress_windows() -> dict[str, int]:
    """The baselines' published observation windows, as the plugin's method registry lines carry them (SnapKV 64 as
    kvpress's SnapKVPress, kernel 5; TOVA 1: the last token's attention, as kvpress's TOVAPress)."""
    from rcstat_vllm.scoring.registry import REGISTRY  # torch-free

    return {"snapkv": REGISTRY["snapkv"].window, "tova": REGISTRY["tova"].window}


def baseline(method: str, ratio: float, window: int, sinks: int = 0) -> dict:
    """A baseline's override: a per-layer budget (as kvpress compresses), the last ``window`` tokens kept and, for
    a method that observes a window (SnapKV), that many queries observed."""
    from rcstat_vllm.config import OBSERVING_METHODS

    observed = {"observation_window": window} if method in OBSERVING_METHODS else {}
    return {
        "method": method,
        "target_ratio": float(ratio),
        "window": window,
        **observed,
        "sink_tokens": sinks,
        "budget_scope": "layer",
    }


def accuracy_settings(
    rc_ratios=(0.5, 0.7, 0.8),
    baseline_ratios=(0.5, 0.8),
    paper_ratios=(0.5,),
    c_values=(1.0,),
    uncarried_ratios=(0.8,),
    mean_ratios=(0.8,),
    uncontrasted_ratios=(0.8,),
    mean_uncontrasted_ratios=(0.8,),
) -> list[Setting]:
    """The main accuracy benchmark's settings: full cache; the bare flag (``{}``, i.e. the plugin's defaults);
    RC at each budget in ``rc_ratios`` with its defaults otherwise, and at ``uncarried_ratios`` (and the bare flag,
    when any) also with its scores not carried forward (``carry_forward: 0``), and at ``mean_ratios`` (and the bare
    flag, when any) with Eq. 6's mean over the window's queries (``query_reduction: mean``), and at
    ``uncontrasted_ratios`` (and the bare flag, when any) without the local contrast (``local_contrast: 0``), and at
    ``mean_uncontrasted_ratios`` (and the bare flag, when any) with both undone (Eq. 6's mean, no contrast: RC's scores
    as the defaults had them before either, so one run shows before and after); RC with the paper's
    scoring (per-layer budget, window 8, no smoothing) at ``paper_ratios``; RC's threshold mode (Eq. 9, paper scoring)
    at ``c_values``; SnapKV and TOVA at each of ``baseline_ratios``, once at kvpress's published windows and once at
    RC's default window and sink tokens (SnapKV observing that many queries; both with a per-layer budget, as kvpress
    compresses). Windows and defaults are read from the plugin,
    so the settings follow its defaults."""
    defaults = plugin_defaults()
    rc_window = defaults["window"]
    published = kvpress_windows()
    settings = [Setting("full", "full", {"method": "none"}), Setting("default", "default", {})]
    # Each of DEFAULTS_UNDONE at the bare flag (when asked at any ratio) and at those ratios:
    # suffix -> (override, ratios).
    ratios_of = {
        "carry0": uncarried_ratios,
        "mean": mean_ratios,
        "contrast0": uncontrasted_ratios,
        "mean_contrast0": mean_uncontrasted_ratios,
    }
    ablations = {name: (override, ratios_of[name]) for name, (override, _) in DEFAULTS_UNDONE.items()}
    settings += [
        Setting(f"default_{name}", f"default_{name}", override)
        for name, (override, ratios) in ablations.items()
        if ratios
    ]
    settings += [Setting(f"rc_r{r:g}", "rc_budget", {"method": "rc", "target_ratio": float(r)}) for r in rc_ratios]
    settings += [
        Setting(f"rc_r{r:g}_{name}", f"rc_{name}", {"method": "rc", "target_ratio": float(r), **override})
        for name, (override, ratios) in ablations.items()
        for r in ratios
    ]
    settings += [Setting(f"rc_paper_r{r:g}", "rc_paper", {**PAPER_RC, "target_ratio": float(r)}) for r in paper_ratios]
    settings += [Setting(rc_label(c), "rc", {**PAPER_RC, "c": float(c)}) for c in c_values]
    for method in ("snapkv", "tova"):
        # kvpress's presses keep no sink tokens; at RC's window they also keep RC's sinks.
        for family, window, sinks in (
            (method, published[method], 0),
            (f"{method}_rc_window", rc_window, defaults["sink_tokens"]),
        ):
            settings += [
                Setting(f"{method}_w{window}_r{r:g}", family, baseline(method, r, window, sinks))
                for r in baseline_ratios
            ]
    return settings


def extra_setting(spec: str) -> Setting:
    """A setting of its own from the command line: ``label=JSON``, the JSON its per-request override
    (``'rc_r0.9_v1={"method": "rc", "target_ratio": 0.9, "value_weight": 1}'``); family ``extra``."""
    label, sep, override = spec.partition("=")
    if not sep or not label:
        raise SystemExit(f"--extra {spec!r}: expected label=JSON")
    try:
        rcstat = json.loads(override)
    except json.JSONDecodeError as error:
        raise SystemExit(f"--extra {label}: the override is not JSON ({error})") from None
    if not isinstance(rcstat, dict):
        raise SystemExit(f"--extra {label}: the override must be a JSON object")
    return Setting(label, "extra", rcstat)


def resolve(setting: Setting, rc_ratios: dict[str, float]) -> dict:
    """The override for one prompt: a matched setting takes RC's achieved ratio on that prompt."""
    if setting.matched_to is None:
        return dict(setting.rcstat)
    ratio = rc_ratios[setting.matched_to]
    # The plugin accepts target_ratio in [0, 1); RC never evicts the window, so its ratio is < 1.
    return {**setting.rcstat, "target_ratio": min(max(float(ratio), 0.0), 0.999)}


def page_alignment_settings(ratios=(0.8, 0.9), baselines=("tova", "snapkv"), page_size: int = 32) -> list[Setting]:
    """The full cache, the bare flag, RC with the defaults at each ratio and the baselines at kvpress's windows (as
    the cliff ablation runs them), each twice: the selection rule alone, and with each head's count moved to a page
    boundary as the engine moves it (labels ``<label>_page<N>``): what page alignment costs in quality, prompt by
    prompt, with the same scores."""
    chosen = [Setting("default", "default", {})]
    chosen += [Setting(f"rc_r{r:g}", "rc_defaults", {"method": "rc", "target_ratio": float(r)}) for r in ratios]
    chosen += [s for s in cliff_ablation_settings(ratios, variants=(), baselines=baselines) if s.family != "full"]
    settings = [Setting("full", "full", {"method": "none"})]
    for s in chosen:
        settings += [s, replace(s, label=f"{s.label}_page{page_size}", page_size=page_size)]
    return settings


def budget_scope_settings(
    ratios=(0.5, 0.8), comparables=("head_mean", "layer_mean", "layer_rank", "depthkv"), window: int = 8
) -> list[Setting]:
    """RC budget mode per layer vs over the whole model, the latter with each way of comparing layers; the paper's
    scoring otherwise (:data:`PAPER_RC`: pinned, so the rows keep their meaning when the defaults change)."""
    settings = [Setting("full", "full", {"method": "none"})]
    for r in ratios:
        base = {**PAPER_RC, "target_ratio": float(r), "window": window}
        settings.append(Setting(f"rc_budget_r{r:g}", "rc_budget", {**base, "budget_scope": "layer"}))
        settings += [
            Setting(f"rc_model_{name}_r{r:g}", "rc_model", {**base, "budget_scope": "model"}, comparable=name)
            for name in comparables
        ]
    return settings


def _rc_variant(
    window: int,
    scope: str,
    smoothing: int,
    sinks: int = 0,
    carry_forward: int = 0,
    query_reduction: str = "mean",
    local_contrast: float = 0.0,
    **extra,
) -> dict:
    """An RC variant's settings, every field the defaults have changed spelled out so a label keeps its meaning."""
    return {
        "window": window,
        "budget_scope": scope,
        "smoothing": smoothing,
        "sink_tokens": sinks,
        "carry_forward": carry_forward,
        "query_reduction": query_reduction,
        "local_contrast": local_contrast,
        **extra,
    }


#: The current defaults' knobs past the window, scope and smoothing (sinks, carrying, the max over queries, local
#: contrast), which the ``..._k4_c8_max_lc0.5`` variants share.
_CONTRASTED = dict(sinks=4, carry_forward=8, query_reduction="max", local_contrast=0.5, contrast_radius=256)


#: RC variants of the high-compression ablation (benchmarks/results/accuracy_cliff*.json): label -> settings on top of
#: {"method": "rc", "target_ratio": r}.
CLIFF_VARIANTS = {
    "rc_layer_w8": _rc_variant(8, "layer", 1),
    "rc_model_w8": _rc_variant(8, "model", 1),
    "rc_model_w16": _rc_variant(16, "model", 1),
    "rc_model_w32": _rc_variant(32, "model", 1),
    "rc_model_w16_s5": _rc_variant(16, "model", 5),
    "rc_model_w32_s3": _rc_variant(32, "model", 3),
    "rc_model_w32_s5": _rc_variant(32, "model", 5),
    # The 0.5 default's three changes one at a time (docs/defaults.md): rc_model_w32_s3 was that default,
    # rc_model_w32 drops the smoothing, these two drop the window and the model-wide budget.
    "rc_model_w8_s3": _rc_variant(8, "model", 3),
    "rc_layer_w32_s3": _rc_variant(32, "layer", 3),
    # Between the two scopes: each layer keeps at least this share of its equal part of the budget.
    "rc_model_w32_s3_f0.25": _rc_variant(32, "model", 3, layer_floor=0.25),
    "rc_model_w32_s3_f0.5": _rc_variant(32, "model", 3, layer_floor=0.5),
    # Attention sinks (StreamingLLM): the first tokens kept by every head.
    "rc_model_w32_s3_k1": _rc_variant(32, "model", 3, sinks=1),
    "rc_model_w32_s3_k4": _rc_variant(32, "model", 3, sinks=4),
    # Scores carried 8 tokens forward (a value kept with its key), with k4.
    "rc_model_w32_s3_k4_c8": _rc_variant(32, "model", 3, sinks=4, carry_forward=8),
    # ... and each token scored by the window query that reads it most.
    "rc_model_w32_s3_k4_c8_max": _rc_variant(32, "model", 3, sinks=4, carry_forward=8, query_reduction="max"),
    # ... and each score divided by the square root of its 256 neighbours' mean: the current default's settings.
    "rc_model_w32_s3_k4_c8_max_lc0.5": _rc_variant(32, "model", 3, **_CONTRASTED),
    # ... with smoothing over 5 tokens (issue 56: the candidate for the high ratios).
    "rc_model_w32_s5_k4_c8_max_lc0.5": _rc_variant(32, "model", 5, **_CONTRASTED),
    # ... and each score times its token's value norm (issue 56: value weighting, the candidate from 0.9 on).
    "rc_model_w32_s5_k4_c8_max_lc0.5_v1": _rc_variant(32, "model", 5, **_CONTRASTED, value_weight=1.0),
    # The 0.8 defaults with chunks of 4 (issue 56: ChunkKV's unit, the lead route_probes.py's held-out seeds left).
    "rc_model_w32_s3_k4_c8_max_lc0.5_ch4": _rc_variant(32, "model", 3, **_CONTRASTED, chunk=4),
    # The default with 8 observed queries (the chat template's tail) while keeping the last 32 tokens.
    "rc_model_w32_o8_s3_k4": _rc_variant(32, "model", 3, sinks=4, observation_window=8),
    "rc_layer_w8_k4": _rc_variant(8, "layer", 1, sinks=4),
}


def cliff_ablation_settings(ratios=(0.5, 0.8), variants=None, baselines=("tova", "snapkv")) -> list[Setting]:
    """The full cache, each RC variant (labels of ``CLIFF_VARIANTS``; None = all) and the baselines (at their
    published defaults) at each ratio."""
    settings = [Setting("full", "full", {"method": "none"})]
    for r in ratios:
        chosen = {k: v for k, v in CLIFF_VARIANTS.items() if variants is None or k in variants}
        for label, extra in chosen.items():
            settings.append(
                Setting(f"{label}_r{r:g}", "rc_budget", {"method": "rc", "target_ratio": float(r), **extra})
            )
        # The baselines' published scoring windows; the kept window is RC's 32 and, as in kvpress, no sinks.
        settings += [
            Setting(
                f"{b}_r{r:g}",
                b,
                {"method": b, "target_ratio": float(r), "window": 32, "sink_tokens": 0, "budget_scope": "layer"},
            )
            for b in baselines
        ]
    return settings


def add_cliff_arguments(parser, output_name: str) -> None:
    """``--cliff-ablation`` and ``--variants``, as accuracy.py and quality.py take them."""
    parser.add_argument("--variants", nargs="*", default=None, help="--cliff-ablation: only these RC variants")
    parser.add_argument(
        "--with-baselines",
        action="store_true",
        help="--cliff-ablation with --variants: also TOVA and SnapKV at their published windows",
    )
    parser.add_argument(
        "--cliff-ablation",
        action="store_true",
        help="RC variants (window, model-wide budget, smoothing) and baselines at --ratios "
        f"(default 0.5 0.8); writes benchmarks/results/{output_name}",
    )
    parser.add_argument(
        "--summaries",
        type=int,
        default=0,
        help="--cliff-ablation / --budget-scope-study: also this many essay summaries (1024 tokens, "
        "scored by ROUGE-L vs the full cache's output)",
    )


def cliff_settings_from_args(args) -> list[Setting]:
    """The ablation's settings for parsed ``add_cliff_arguments`` (baselines when every variant runs, or asked)."""
    baselines = ("tova", "snapkv") if args.variants is None or args.with_baselines else ()
    return cliff_ablation_settings(ratios=tuple(args.ratios or (0.5, 0.8)), variants=args.variants, baselines=baselines)
