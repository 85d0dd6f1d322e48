#!/usr/bin/env bash
# Every lent GPU window (issue 51): the same two device calls of tools/gpu/README.md each time; call 2 runs the next
# plan that the committed results in benchmarks/results/*_{h100,h200}.json do not hold yet (tools/gpu/window_plan.py
# decides: first -> defaults -> serving -> kernels -> defaults with a second round -> done). Run from the repository
# root (the device tool's working directory).
#
#   tools/gpu/window.sh part1 .gpu-carry/upload/p1   call 1: receive part 1; machine.json (the image's packages);
#                                                    plan.json (what call 2 will run, decided on this machine's GPU)
#   tools/gpu/window.sh run .gpu-carry/upload/p2     call 2: receive the last part, install, check env, decide the
#                                                    plan, then its steps: one after the other
#   tools/gpu/window.sh dry [UPLOAD_ROOT]            both calls here, without a GPU (see "Dry run" below)
#
# Call 2: each step writes its JSON into $OUT before the next starts, and each is bounded by its own cap and by what
# is left of WINDOW_BUDGET_S (default 510 s: give the call timeout_s B + 30), so a cut leaves the files of the steps
# that finished. $OUT ends with at most 8 files (8 come back): window.json (per step: exit code, seconds, limit, ok,
# headline; the plan decided, with why and the rows owed; rewritten after every step), receive.json, install.json,
# env.json, one JSON per plan step (compress.json, kernels.json, throughput_<tag>_<device>.json: 3 at most) and
# logs.tar.gz (each step's output, engine logs, plugin.json, plan.json; repacked after every step). The steps (caps
# in s, WINDOW_LIMIT_<STEP> to change the first three):
#   receive 60      the last part (sha256 checked)
#   install 120     join, check, pip install --target; the plugin from this call's working tree
#   env 90          check_env.py: vLLM, _C, FA3, the plugin import over the image's torch; missing modules named
#   plan 30         window_plan.py: reads WINDOW_RESULTS (default benchmarks/results) for this machine's GPU
#                   (WINDOW_DEVICE, else nvidia-smi's), copies the committed file a resumable step continues from
#                   into $RCSTAT_RESULTS; its steps then run with the caps it gives (first: compress 180, then the
#                   kernel checks with the rest; defaults: the throughput rows owed, with the rest; serving:
#                   check_serving.py's rows owed, with the rest)
#   (env, plan and its steps are skipped when install failed)
#
# Dry run (`dry`): both calls on this machine, in scratch folders under /tmp/rcstat-dry (WINDOW_DRY_DIR).
# receive and install are real (the carry's cp312 wheels pip-installed into a scratch --target by .venv's pip);
# env imports the CPU wheel (.venv) behind tools/gpu/gpu_image_guard.py (only the GPU image's packages and the
# carry's are importable) instead of the carried CUDA vLLM; the plan is decided as on the GPU (device "cuda" unless
# WINDOW_DEVICE), and its steps run their whole scripts but start no engine and launch no kernel (RCSTAT_DRY_RUN: it
# needs CUDA), recording the engine arguments and workload they would use (check serving also its dry_probe: the
# carried tokenizer, the server's and client's imports, their commands through vLLM's parsers; required by
# dry_run_ok). Every JSON of a dry run says dry_run.
set -u
cd "$(dirname "$0")/../.." || exit 1
mode="${1:-}"
[ $# -gt 0 ] && shift

if [ "$mode" = dry ]; then
    root="${1:-.gpu-carry/upload}"
    D="${WINDOW_DRY_DIR:-/tmp/rcstat-dry}"
    rm -rf "$D" && mkdir -p "$D/no-site"
    export RCSTAT_CARRY_DIR="$D/carry" RCSTAT_SITE="$D/site" RCSTAT_PLUGIN_SITE="$D/plugin"
    export RCSTAT_RESULTS="$D/results" RCSTAT_MODEL_ROOT="$D/models" WINDOW_DRY=1 WINDOW_NO_SITE="$D/no-site"
    export RCSTAT_PYTHON="${RCSTAT_PYTHON:-$PWD/.venv/bin/python}"
    # The carry holds cp312 wheels (the GPU machine's Python 3.12); pip installs them into --target from any Python.
    export RCSTAT_PIP_EXTRA="--python-version 3.12 --only-binary=:all:"
    mapfile -t parts < <(ls -d "$root"/p* 2>/dev/null | sort -V)
    [ "${#parts[@]}" -ge 1 ] || { echo "no upload folders under $root: build the carry first" >&2; exit 2; }
    OUT="$D/out1" "$0" part1 "${parts[0]}" || echo "dry call 1 failed: see $D/out1" >&2
    OUT="$D/out2" "$0" run "${parts[@]:1}"
    rc=$?
    echo "dry run: call 1's files in $D/out1, call 2's in $D/out2"
    exit "$rc"
fi

PY="${RCSTAT_PYTHON:-python3}"
export OUT="${OUT:-/tmp/rcstat-out}"
export RCSTAT_RESULTS="${RCSTAT_RESULTS:-/tmp/rcstat-results}"
export RCSTAT_COMMIT="${RCSTAT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
DRY="${WINDOW_DRY:-0}"
RESULTS_IN="${WINDOW_RESULTS:-benchmarks/results}"
DEVICE="${WINDOW_DEVICE:-auto}"
mkdir -p "$OUT" "$RCSTAT_RESULTS"

if [ "$mode" = part1 ]; then
    "$PY" tools/gpu/carry.py receive "$@" >"$OUT/receive.json"
    rc=$?
    # The image's Python packages and versions (the next carry depends on them), the device: seconds.
    timeout 60 "$PY" - >"$OUT/machine.json" <<'PYEOF'
import importlib.metadata as md, json, os, platform, subprocess, sys
info = {"python": sys.version, "executable": sys.executable, "dry_run": os.environ.get("WINDOW_DRY") == "1",
        "packages": dict(sorted({(d.metadata["Name"] or "?").lower(): d.version for d in md.distributions()}.items()))}
try:
    info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                         "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
except Exception as exc:
    info["nvidia_smi"] = repr(exc)
info["glibc"] = platform.libc_ver()
print(json.dumps(info, indent=1))
PYEOF
    "$PY" -c 'import json,sys; r=json.load(open(sys.argv[1])); print("receive", "ok" if r.get("ok") else "FAIL", r.get("errors") or "", json.dumps(r.get("bundles")))' "$OUT/receive.json"
    # What call 2 will run (the same files and the same GPU decide it again there).
    timeout 30 "$PY" tools/gpu/window_plan.py --results "$RESULTS_IN" --device "$DEVICE" --json "$OUT/plan.json" ||
        echo "window_plan.py failed" >&2
    exit "$rc"
fi
[ "$mode" = run ] || { sed -n '2,12p' "$0"; exit 2; }

T0=$SECONDS
BUDGET="${WINDOW_BUDGET_S:-510}"
RESERVE=10  # seconds kept for the last record and packing
STAGE="$RCSTAT_RESULTS/window_stage"  # the steps' own $OUT: only their main JSON is copied into the real $OUT
LOGDIR="$RCSTAT_RESULTS/logs/window"
rm -rf "$STAGE" "$LOGDIR" "$OUT/window.json"
mkdir -p "$STAGE" "$LOGDIR"

limit_of() {  # CAP: the cap, or what is left of the budget when less
    local left=$(( BUDGET - (SECONDS - T0) - RESERVE ))
    echo $(( $1 < left ? $1 : left ))
}

record() {  # NAME RC SECONDS LIMIT FILE_GLOB [SKIP_REASON]: copy the step's JSON into $OUT, update window.json
    "$PY" - "$@" <<'PYEOF'
import glob, json, os, shutil, sys, time
name, rc, secs, limit, pattern = sys.argv[1:6]
skip = sys.argv[6] if len(sys.argv) > 6 else ""
out, stage = os.environ["OUT"], os.environ["RCSTAT_RESULTS"] + "/window_stage"
summary_path = os.path.join(out, "window.json")
try:
    summary = json.load(open(summary_path))
except (OSError, ValueError):
    summary = {"check": "window", "dry_run": os.environ.get("WINDOW_DRY") == "1",
               "commit": os.environ.get("RCSTAT_COMMIT"), "budget_s": int(os.environ["WINDOW_BUDGET"]),
               "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - float(secs))),
               "steps": []}
    if summary["dry_run"]:
        summary["dry_run_note"] = ("no GPU: receive/install real into scratch folders; env imports the CPU wheel "
                                   "behind gpu_image_guard.py; the plan's steps start no engine, launch no kernel")
step = {"step": name, "rc": None if rc == "skipped" else int(rc), "seconds": int(secs), "limit_s": int(limit)}
files = sorted(glob.glob(os.path.join(stage, pattern)), key=os.path.getmtime)
if skip:
    step.update(ok=False, skipped=skip)
elif not files:
    step.update(ok=False, error="timed out" if rc in ("124", "137") else f"exited {rc} without writing {pattern}")
else:
    if name != "plan":  # the decision goes into window.json itself: $OUT keeps room for the plan's files
        shutil.copyfile(files[-1], os.path.join(out, os.path.basename(files[-1])))
        step["file"] = os.path.basename(files[-1])
    try:
        r = json.load(open(files[-1]))
    except ValueError as exc:
        r = {"ok": False, "error": f"unreadable JSON: {exc}"}
    step["ok"] = bool(r.get("ok"))
    step["headline"] = str(r.get("headline") or r.get("error") or "")[:500]
    if r.get("missing_modules"):
        step["missing_modules"] = r["missing_modules"]
    runs = r.get("runs") or [r]
    if any(x.get("dry_run") for x in runs):
        step["dry_run_stub"] = "no engine started, no kernel launched (needs CUDA)"
    if name == "install":
        step["headline"] = "; ".join(f"{b}: {'ok' if i.get('ok') else i.get('error') or 'pip ' + str(i.get('pip_returncode'))}"
                                     + (f" ({i.get('wheels')} wheels, {i.get('seconds')} s)" if i.get("wheels") else "")
                                     for b, i in (r.get("installs") or {}).items()) or r.get("error", "")
    if name == "receive":
        step["headline"] = json.dumps(r.get("bundles"))[:500] + (f" errors: {r['errors']}" if r.get("errors") else "")
    if name == "compress":
        step["engine_started"] = "engine_start_s" in r
    if name == "plan":
        step["ok"] = "plan" in r
        step["headline"] = f"{r.get('plan')} on {r.get('device')}: {r.get('why')}"[:500]
        summary["plan"] = r
    if r.get("remaining"):
        step["remaining"] = r["remaining"]
    if isinstance(r.get("dry_probe"), dict):  # check serving's dry run: imports, tokenizer, the dataset sampled
        step["dry_probe_ok"] = bool(r["dry_probe"].get("ok"))
summary["steps"] = [s for s in summary["steps"] if s["step"] != name] + [step]
summary["seconds"] = int(os.environ["WINDOW_ELAPSED"])
with open(summary_path + ".tmp", "w") as f:
    json.dump(summary, f, indent=1, default=str)
os.replace(summary_path + ".tmp", summary_path)
print(f"--- {name:16s} {'ok  ' if step.get('ok') else 'FAIL'} {step['seconds']:4d}s/{step['limit_s']}s "
      f"{step.get('skipped') or step.get('error') or step.get('headline', '')}"[:700], flush=True)
PYEOF
    tar -czf "$OUT/logs.tar.gz" -C "$RCSTAT_RESULTS" logs window_stage 2>/dev/null || true
}

step() {  # NAME LIMIT FILE_GLOB CMD...: run CMD bounded by LIMIT (its output in logs/window/NAME.log), record
    local name="$1" limit="$2" pattern="$3" t=$SECONDS rc=skipped
    shift 3
    if [ "$limit" -lt 15 ]; then
        WINDOW_ELAPSED=$((SECONDS - T0)) record "$name" skipped 0 "$limit" "$pattern" "no time left"
        return
    fi
    echo "=== $name (limit ${limit}s, at $((SECONDS - T0))s) $(date -u +%H:%M:%S)"
    OUT="$STAGE" timeout --signal=TERM --kill-after=8 "$limit" "$@" >"$LOGDIR/$name.log" 2>&1
    rc=$?
    WINDOW_ELAPSED=$((SECONDS - T0)) record "$name" "$rc" "$((SECONDS - t))" "$limit" "$pattern"
}

skip() {  # NAME FILE_GLOB REASON
    WINDOW_ELAPSED=$((SECONDS - T0)) record "$1" skipped 0 0 "$2" "$3"
}

ok_of() {  # FILE KEY: "1" when $OUT/FILE's KEY is truthy
    "$PY" -c 'import json,sys
try: print(1 if json.load(open(sys.argv[1])).get(sys.argv[2]) else 0)
except Exception: print(0)' "$OUT/$1" "$2"
}

export WINDOW_BUDGET="$BUDGET"
RUN="tools/gpu/run_on_gpu.sh"
if [ "$DRY" = 1 ]; then
    # The checks import the CPU wheel behind the GPU-image guard, not the carried CUDA vLLM (cp312, CUDA .so files);
    # throughput names its file after the device the plan was decided for (WINDOW_DEVICE), as a GPU would.
    CHECK_ENV=(env RCSTAT_SITE="$WINDOW_NO_SITE" RCSTAT_CHECK_WRAP="tools/gpu/gpu_image_guard.py run"
               RCSTAT_DRY_RUN=1 RCSTAT_DEVICE_TAG="${WINDOW_DEVICE:-}")
else
    CHECK_ENV=(env)
fi

L=$(limit_of "${WINDOW_LIMIT_RECEIVE:-60}")
step receive "$L" receive.json "$RUN" receive "$@"
L=$(limit_of "${WINDOW_LIMIT_INSTALL:-120}")
step install "$L" install.json "$RUN" install
# After a good install every step runs, whatever the one before found: a failed env or compress still leaves the
# next step something to show (vanilla vLLM needs neither the plugin nor FA3), and this window has nothing else to do.
if [ "$(ok_of install.json ok)" = 1 ]; then
    L=$(limit_of "${WINDOW_LIMIT_ENV:-90}")
    step env "$L" env.json "${CHECK_ENV[@]}" RCSTAT_LIMIT_ENV=$((L - 5)) "$RUN" check env
    L=$(limit_of 30)
    step plan "$L" plan.json "$PY" tools/gpu/window_plan.py --results "$RESULTS_IN" --device "$DEVICE" \
        --json "$STAGE/plan.json" --seed-into "$RCSTAT_RESULTS"
    mapfile -t plan_steps < <("$PY" -c 'import json, sys
for s in json.load(open(sys.argv[1])).get("steps", []):
    print("\t".join([s["name"], str(s["cap_s"]), s["glob"], " ".join(s["args"])]))' "$STAGE/plan.json" 2>/dev/null)
    for line in "${plan_steps[@]}"; do
        IFS=$'\t' read -r name cap pattern argline <<<"$line"
        L=$(limit_of "$cap")
        read -ra words <<<"$argline"
        args=()
        for w in "${words[@]}"; do  # %L-N%: this step's limit minus N seconds
            while [[ "$w" =~ ^(.*)%L-([0-9]+)%(.*)$ ]]; do
                w="${BASH_REMATCH[1]}$((L - BASH_REMATCH[2]))${BASH_REMATCH[3]}"
            done
            args+=("$w")
        done
        check="${args[0]}"
        step "$name" "$L" "$pattern" "${CHECK_ENV[@]}" "RCSTAT_LIMIT_${check^^}=$((L - 5))" "$RUN" check "${args[@]}"
    done
else
    for name in env plan; do skip "$name" "$name.json" "install failed"; done
fi

WINDOW_ELAPSED=$((SECONDS - T0)) "$PY" - <<'PYEOF'
import json, os, sys
out = os.environ["OUT"]
path = os.path.join(out, "window.json")
s = json.load(open(path))
s["finished"] = True
s["seconds"] = int(os.environ["WINDOW_ELAPSED"])
steps = {step["step"]: step for step in s["steps"]}
plan_steps = [step["name"] for step in (s.get("plan") or {}).get("steps", [])]
s["ok"] = all(step.get("ok") for step in s["steps"])
if s["dry_run"]:
    # What a dry run can show: the carry received and installed, the offline path and the plugin import behind
    # the GPU-image guard (only CUDA's own extensions fail here), the plan decided, and its steps ran up to their
    # engines and kernels.
    cuda_only = {"vllm._C_stable_libtorch", "vllm.vllm_flash_attn.flash_attn_interface"}
    try:
        env = json.load(open(os.path.join(out, "env.json")))
        failed = sorted(k for k, v in env["imports"].items() if not v.get("ok"))
        env_ok = set(failed) <= cuda_only and env.get("plugin_register", {}).get("ok")
    except (OSError, ValueError, KeyError):
        failed, env_ok = ["env.json unreadable"], False
    s["dry_run_env_failed_imports"] = failed
    s["dry_run_ok"] = bool(steps.get("receive", {}).get("ok") and steps.get("install", {}).get("ok") and env_ok
                           and steps.get("plan", {}).get("ok")
                           and all(steps.get(n, {}).get("dry_run_stub") and steps[n].get("dry_probe_ok", True)
                                   for n in plan_steps))
s["files_in_out"] = sorted(os.listdir(out))
s["files_in_out_ok"] = len(s["files_in_out"]) <= 8
json.dump(s, open(path, "w"), indent=1, default=str)
verdict = (s["dry_run_ok"] if s["dry_run"] else s["ok"]) and s["files_in_out_ok"]
plan = s.get("plan") or {}
print(f"=== window {'ok' if verdict else 'NOT ok'}{' (dry run)' if s['dry_run'] else ''}: plan {plan.get('plan')} on "
      f"{plan.get('device')}, {s['seconds']} s of {s['budget_s']}; $OUT: {s['files_in_out']}")
sys.exit(0 if verdict else 1)
PYEOF
