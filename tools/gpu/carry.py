#!/usr/bin/env python3
"""Receive, reassemble and install the carry on the GPU machine; install the plugin from the working tree.

Stdlib only (it runs before anything is installed). Called by ``tools/gpu/run_on_gpu.sh``; every command prints one
JSON object and exits non-zero on a failure.

    carry.py receive UPLOAD_DIR...  copy each folder's parts and manifest.json into $RCSTAT_CARRY_DIR, check sha256
    carry.py install [BUNDLE...]    join the parts, check the whole's sha256, untar, pip-install its wheels into
                                    $RCSTAT_SITE (default: every bundle whose parts are all here; skipped when the
                                    same archive is installed already)
    carry.py plugin                 copy rcstat_vllm (+ kernels/, patches/ as rcstat_vllm.kernels/.patches) and a
                                    dist-info with the vllm.general_plugins entry point into $RCSTAT_PLUGIN_SITE
    carry.py status                 what is received and installed
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CARRY = Path(os.environ.get("RCSTAT_CARRY_DIR", "/tmp/rcstat-carry"))
SITE = Path(os.environ.get("RCSTAT_SITE", "/tmp/rcstat-vllm-site"))
PLUGIN_SITE = Path(os.environ.get("RCSTAT_PLUGIN_SITE", "/tmp/rcstat-plugin-site"))
PYTHON = os.environ.get("RCSTAT_PYTHON", sys.executable)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(4 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_manifest() -> dict:
    path = CARRY / "manifest.json"
    if not path.exists():
        raise SystemExit(json.dumps({"ok": False, "error": f"no {path}: receive a part first"}))
    return json.loads(path.read_text())


def part_index(manifest: dict) -> dict[str, tuple[str, dict]]:
    return {p["name"]: (bundle, p) for bundle, e in manifest["bundles"].items() for p in e["parts"]}


def receive(folders: list[str]) -> dict:
    CARRY.mkdir(parents=True, exist_ok=True)
    report = {"ok": True, "carry_dir": str(CARRY), "received": [], "errors": []}
    for folder in map(Path, folders):
        if not folder.is_dir():
            report["errors"].append(f"{folder}: not a folder (was it named in the call's carry?)")
            continue
        incoming = folder / "manifest.json"
        if incoming.exists():
            current = CARRY / "manifest.json"
            if current.exists() and current.read_bytes() != incoming.read_bytes():
                # A rebuilt carry: parts of the old one must not be mixed in.
                stale = [p for p in CARRY.glob("*.part-*")]
                for p in stale:
                    p.unlink()
                report["replaced_manifest"] = {"removed_parts": [p.name for p in stale]}
            shutil.copyfile(incoming, current)
        index = part_index(load_manifest())
        for part in sorted(folder.glob("*.part-*")):
            if part.name not in index:
                report["errors"].append(f"{part.name}: not in the manifest")
                continue
            bundle, entry = index[part.name]
            target = CARRY / part.name
            shutil.copyfile(part, target)
            digest = sha256_of(target)
            good = digest == entry["sha256"] and target.stat().st_size == entry["bytes"]
            if not good:
                target.unlink()
                report["errors"].append(f"{part.name}: sha256 {digest} != manifest {entry['sha256']}")
            report["received"].append({"part": part.name, "bundle": bundle, "bytes": entry["bytes"], "sha256_ok": good})
    report.update(status())
    report["ok"] = not report["errors"]
    return report


def status() -> dict:
    if not (CARRY / "manifest.json").exists():
        return {"bundles": {}, "note": "nothing received"}
    manifest = load_manifest()
    bundles = {}
    for bundle, entry in manifest["bundles"].items():
        have = [p["name"] for p in entry["parts"] if (CARRY / p["name"]).exists()]
        stamp = SITE / f".installed-{bundle}.json"
        installed = json.loads(stamp.read_text()) if stamp.exists() else None
        bundles[bundle] = {
            "parts_total": len(entry["parts"]),
            "parts_here": have,
            "missing": [p["name"] for p in entry["parts"] if p["name"] not in have],
            "installed": bool(installed and installed.get("sha256") == entry["sha256"]),
        }
    return {"bundles": bundles}


def install(names: list[str]) -> dict:
    manifest = load_manifest()
    state = status()["bundles"]
    if not names:
        names = [b for b, s in state.items() if not s["missing"]]
    report = {"ok": True, "site": str(SITE), "python": PYTHON, "installs": {}}
    for bundle in names:
        if bundle not in manifest["bundles"]:
            report["installs"][bundle] = {"ok": False, "error": "not in the manifest"}
            continue
        entry = manifest["bundles"][bundle]
        result = report["installs"][bundle] = {"ok": False}
        if state[bundle]["installed"]:
            result.update(ok=True, skipped="installed already (same sha256)")
            continue
        if state[bundle]["missing"]:
            result["error"] = f"parts not received yet: {state[bundle]['missing']}"
            continue
        t0 = time.perf_counter()
        archive = CARRY / entry["archive"]
        with open(archive, "wb") as out:
            for part in entry["parts"]:
                with open(CARRY / part["name"], "rb") as f:
                    shutil.copyfileobj(f, out, 16 << 20)
        digest = sha256_of(archive)
        if digest != entry["sha256"]:
            result["error"] = f"reassembled {archive.name}: sha256 {digest} != manifest {entry['sha256']}"
            archive.unlink()
            continue
        unpacked = CARRY / bundle
        if unpacked.exists():
            shutil.rmtree(unpacked)
        unpacked.mkdir()
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():  # our own archive, checked by sha256; still refuse odd paths
                if member.name.startswith("/") or ".." in Path(member.name).parts or not member.isfile():
                    raise SystemExit(json.dumps({"ok": False, "error": f"odd member {member.name}"}))
            try:
                tar.extractall(unpacked, filter="data")
            except TypeError:  # Python without extraction filters
                tar.extractall(unpacked)
        archive.unlink()  # the parts stay: a re-install needs no new upload
        wheels = [unpacked / w for w in entry["wheels"]]
        SITE.mkdir(parents=True, exist_ok=True)
        cmd = [
            PYTHON,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--disable-pip-version-check",
            "--target",
            str(SITE),
            *map(str, wheels),
        ]
        extra = os.environ.get("RCSTAT_PIP_EXTRA")  # e.g. "--python-version 3.12 --only-binary=:all:" (dry runs)
        if extra:
            cmd[4:4] = extra.split()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        result.update(
            wheels=len(wheels),
            pip_returncode=proc.returncode,
            pip_output_tail=(proc.stdout + proc.stderr)[-3000:],
            seconds=round(time.perf_counter() - t0, 1),
            sha256=digest,
        )
        if proc.returncode == 0:
            (SITE / f".installed-{bundle}.json").write_text(json.dumps({"sha256": digest, "wheels": entry["wheels"]}))
            result["ok"] = True
        bundle_json = unpacked / "bundle.json"
        if bundle_json.exists():
            shutil.copyfile(bundle_json, SITE / f".bundle-{bundle}.json")
    report["ok"] = bool(report["installs"]) and all(r.get("ok") for r in report["installs"].values())
    if not report["installs"]:
        report["error"] = "no bundle has all its parts here"
    report.update(status())
    return report


def plugin() -> dict:
    """The plugin as ``pip install .`` would lay it out (``[tool.setuptools]`` packages and package-dir of
    pyproject.toml: kernels/ and patches/ become rcstat_vllm.kernels and rcstat_vllm.patches), from the working tree
    of this call, plus the dist-info whose ``vllm.general_plugins`` entry point makes vLLM load it."""
    text = (REPO / "pyproject.toml").read_text()
    try:
        import tomllib

        data = tomllib.loads(text)
        version = data["project"]["version"]
        points = data["project"]["entry-points"]["vllm.general_plugins"]
        packages = data["tool"]["setuptools"]["packages"]
        package_dir = data["tool"]["setuptools"].get("package-dir", {})
    except ImportError:  # Python < 3.11: the same read by regular expressions
        version = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M).group(1)
        section = re.search(r'\[project\.entry-points\."vllm\.general_plugins"\]\s*\n([^\[]+)', text).group(1)
        points = dict(re.findall(r'^\s*([\w.-]+)\s*=\s*"([^"]+)"', section, re.M))
        packages = re.findall(r'"([\w.]+)"', re.search(r"^packages\s*=\s*\[([^\]]*)\]", text, re.M).group(1))
        dirs = re.search(r"\[tool\.setuptools\.package-dir\]\s*\n([^\[]+)", text)
        package_dir = dict(re.findall(r'^\s*"([\w.]+)"\s*=\s*"([^"]+)"', dirs.group(1), re.M)) if dirs else {}

    def source_of(package: str) -> Path:
        if package in package_dir:
            return REPO / package_dir[package]
        if "." in package:
            parent, leaf = package.rsplit(".", 1)
            return source_of(parent) / leaf
        return REPO / package

    if PLUGIN_SITE.exists():
        shutil.rmtree(PLUGIN_SITE)
    files = 0
    for package in packages:
        source, target = source_of(package), PLUGIN_SITE.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for path in sorted(source.glob("*.py")):
            shutil.copyfile(path, target / path.name)
            files += 1
    entry = "\n".join(f"{name} = {value}" for name, value in points.items())
    info = PLUGIN_SITE / f"rcstat_vllm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: rcstat-vllm\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{entry}\n")
    (info / "top_level.txt").write_text("rcstat_vllm\n")
    (info / "INSTALLER").write_text("tools/gpu/carry.py\n")
    return {
        "ok": True,
        "plugin_site": str(PLUGIN_SITE),
        "version": version,
        "entry_point": entry,
        "packages": packages,
        "python_files": files,
    }


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    command, args = argv[0], argv[1:]
    try:
        if command == "receive":
            report = receive(args)
        elif command == "install":
            report = install(args)
        elif command == "plugin":
            report = plugin()
        elif command == "status":
            report = {"ok": True, **status()}
        else:
            print(__doc__)
            return 2
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - one JSON line whatever happens
        report = {"ok": False, "command": command, "error_type": type(exc).__name__, "error": str(exc)}
    report["command"] = command
    print(json.dumps(report, indent=1))
    return 0 if report.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
