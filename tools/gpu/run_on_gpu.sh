#!/usr/bin/env bash
# Run ON the GPU machine, from the repository root (the device tool's working directory). See tools/gpu/README.md.
#
#   tools/gpu/run_on_gpu.sh receive .gpu-carry/upload/p1   keep a carried part in $RCSTAT_CARRY_DIR (sha256 checked)
#   tools/gpu/run_on_gpu.sh install [BUNDLE...]            join parts, check, untar, pip install --target $RCSTAT_SITE
#   tools/gpu/run_on_gpu.sh plugin                         install the plugin from this call's working tree
#   tools/gpu/run_on_gpu.sh status                         what is received / installed (JSON)
#   tools/gpu/run_on_gpu.sh checks [NAME...]               several checks with their defaults
#                                                          (default: env engine compress kernels smollm2)
#   tools/gpu/run_on_gpu.sh check NAME [ARGS...]           one check, ARGS passed to tools/gpu/check_NAME.py
#                                                          (NAME: env engine compress kernels smollm2 throughput
#                                                          serving)
#   eval "$(tools/gpu/run_on_gpu.sh env)"                  the environment the checks run in, for your own commands
#
# Every check writes $OUT/<name>.json (and keeps a copy in $RCSTAT_RESULTS, which lasts while the machine is held),
# continues past failures, and the call ends with a one-line-per-check summary; engine logs are packed into
# $OUT/logs.tar.gz. Modes can be chained in one call: `... receive X && ... install && ... checks`.
set -u
cd "$(dirname "$0")/../.." || exit 1

export RCSTAT_CARRY_DIR="${RCSTAT_CARRY_DIR:-/tmp/rcstat-carry}"
export RCSTAT_SITE="${RCSTAT_SITE:-/tmp/rcstat-vllm-site}"
export RCSTAT_PLUGIN_SITE="${RCSTAT_PLUGIN_SITE:-/tmp/rcstat-plugin-site}"
export RCSTAT_RESULTS="${RCSTAT_RESULTS:-/tmp/rcstat-results}"
export OUT="${OUT:-/tmp/rcstat-out}"
PY="${RCSTAT_PYTHON:-python3}"
export RCSTAT_PYTHON="$PY"
mkdir -p "$OUT" "$RCSTAT_RESULTS"

setup_env() {
    export PYTHONPATH="$RCSTAT_PLUGIN_SITE:$RCSTAT_SITE${PYTHONPATH:+:$PYTHONPATH}"
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
    export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
    # FlashInfer is not carried (JIT kernels, large): vLLM's sampler imports it unguarded unless this is 0
    # (first H200 run: "No module named 'flashinfer'" from TopKTopPSampler); vLLM then samples natively.
    export VLLM_USE_FLASHINFER_SAMPLER=0
}

# Default time limits (s) per check; a device call runs at most 600 s in all.
limit_for() {
    case "$1" in
        env) echo "${RCSTAT_LIMIT_ENV:-150}" ;;
        engine) echo "${RCSTAT_LIMIT_ENGINE:-540}" ;;
        compress) echo "${RCSTAT_LIMIT_COMPRESS:-300}" ;;
        kernels) echo "${RCSTAT_LIMIT_KERNELS:-540}" ;;  # (66 checks + live path: over 300 s on an H200, 2026-11-28)
        smollm2) echo "${RCSTAT_LIMIT_SMOLLM2:-300}" ;;
        throughput) echo "${RCSTAT_LIMIT_THROUGHPUT:-570}" ;;
        serving) echo "${RCSTAT_LIMIT_SERVING:-570}" ;;  # (resumable: rows that do not fit its --budget-s wait)
        *) echo 300 ;;
    esac
}

pack_logs() {
    if [ -d "$RCSTAT_RESULTS/logs" ]; then
        tar -czf "$OUT/logs.tar.gz" -C "$RCSTAT_RESULTS" logs 2>/dev/null || true
    fi
}

run_check() {  # NAME [ARGS...]: never fails the shell; a crash becomes $OUT/NAME.json with ok=false
    local name="$1"; shift
    local script="tools/gpu/check_${name}.py"
    [ "$name" = throughput ] && script="tools/gpu/throughput.py"
    if [ ! -f "$script" ]; then
        echo "{\"ok\": false, \"error\": \"no check named $name\"}" | tee "$RCSTAT_RESULTS/$name.json" >"$OUT/$name.json"
        return 0
    fi
    local limit; limit="$(limit_for "$name")"
    echo "=== check $name (limit ${limit}s) $(date -u +%H:%M:%S)" >&2
    local t0=$SECONDS
    # RCSTAT_CHECK_WRAP: a launcher before the script (window.sh dry: tools/gpu/gpu_image_guard.py run).
    # shellcheck disable=SC2086
    timeout --signal=TERM --kill-after=15 "$limit" "$PY" ${RCSTAT_CHECK_WRAP:-} "$script" "$@"
    local rc=$?
    if [ ! -f "$RCSTAT_RESULTS/$name.json" ] || [ "$RCSTAT_RESULTS/$name.json" -ot "$RCSTAT_RESULTS/.started-$name" ]; then
        "$PY" - "$name" "$rc" "$((SECONDS - t0))" <<'EOF'
import json, os, sys
name, rc, secs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
why = "timed out" if rc in (124, 137) else f"exited with {rc}"
result = {"ok": False, "check": name, "error": f"check_{name} {why} after {secs} s without writing its JSON",
          "hint": "see logs.tar.gz and the call's output_tail"}
for folder in (os.environ["RCSTAT_RESULTS"], os.environ["OUT"]):
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
EOF
    fi
    return 0
}

summary() {
    "$PY" - "$@" <<'EOF'
import json, os, sys
print("=== summary")
for name in sys.argv[1:]:
    path = os.path.join(os.environ["RCSTAT_RESULTS"], f"{name}.json")
    try:
        r = json.load(open(path))
    except Exception as exc:
        print(f"{name:11s} NO RESULT ({exc})")
        continue
    line = r.get("headline") or r.get("error") or ""
    print(f"{name:11s} {'ok  ' if r.get('ok') else 'FAIL'} {str(line)[:300]}")
    missing = r.get("missing_modules") or ([r["missing_module"]] if r.get("missing_module") else [])
    if missing:
        print(f"{'':11s} missing modules: {missing}")
EOF
}

mode="${1:-}"
[ $# -gt 0 ] && shift
case "$mode" in
    receive)
        "$PY" tools/gpu/carry.py receive "$@" | tee "$OUT/receive.json"
        exit "${PIPESTATUS[0]}"
        ;;
    install)
        "$PY" tools/gpu/carry.py install "$@" | tee "$OUT/install.json"
        rc=${PIPESTATUS[0]}
        "$PY" tools/gpu/carry.py plugin >"$OUT/plugin.json" || rc=1
        exit "$rc"
        ;;
    plugin)
        "$PY" tools/gpu/carry.py plugin | tee "$OUT/plugin.json"
        exit "${PIPESTATUS[0]}"
        ;;
    status)
        "$PY" tools/gpu/carry.py status
        ;;
    env)
        echo "export PYTHONPATH=\"$RCSTAT_PLUGIN_SITE:$RCSTAT_SITE\${PYTHONPATH:+:\$PYTHONPATH}\""
        echo "export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false VLLM_USE_FLASHINFER_SAMPLER=0"
        echo "export RCSTAT_RESULTS=\"$RCSTAT_RESULTS\""
        ;;
    check|checks)
        # The plugin is copied from this call's working tree every time: a fix made between calls is what runs.
        "$PY" tools/gpu/carry.py plugin >"$RCSTAT_RESULTS/plugin.json" || echo "plugin install failed: see $RCSTAT_RESULTS/plugin.json" >&2
        setup_env
        if [ "$mode" = check ]; then
            [ $# -ge 1 ] || { echo "usage: $0 check NAME [ARGS...]" >&2; exit 2; }
            names=("$1"); touch "$RCSTAT_RESULTS/.started-$1"; run_check "$@"
        else
            if [ $# -eq 0 ]; then names=(env engine compress kernels smollm2); else names=("$@"); fi
            for n in "${names[@]}"; do touch "$RCSTAT_RESULTS/.started-$n"; run_check "$n"; done
        fi
        pack_logs
        summary "${names[@]}"
        ;;
    *)
        sed -n '2,17p' "$0"
        exit 2
        ;;
esac
