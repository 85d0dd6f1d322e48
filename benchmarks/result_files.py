"""Result files on disk: compact JSON, gzipped when large.

Every call to a lent GPU machine sends the whole working tree beside half of vLLM's carry (tools/gpu/README.md,
64 MiB a call), and row-level results (per prompt, per request) are most of the tree. So a report whose compact JSON
is over :data:`GZIP_OVER_BYTES` is written as ``NAME.json.gz`` (about 7x smaller), a small one as ``NAME.json``
(summaries stay readable in a diff); writing one form removes the other, so a result has one file. Readers go
through :func:`read`, which takes either name. The gzip stream is written without a timestamp, so writing the same
report twice gives the same bytes (git sees no change). Read one by hand with ``zcat NAME.json.gz | python -m
json.tool``. Standard library only (tools/gpu's scripts import it on the GPU image).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

#: Reports whose compact JSON is larger than this are written gzipped.
GZIP_OVER_BYTES = 64 * 1024
SUFFIXES = (".json", ".json.gz")


def base_name(path: Path | str) -> str:
    """``NAME.json`` for ``NAME.json`` or ``NAME.json.gz``: the result's name whatever its form."""
    name = Path(path).name
    return name[: -len(".gz")] if name.endswith(".json.gz") else name


def forms(path: Path | str) -> tuple[Path, Path]:
    """The two files a result may be: ``NAME.json`` and ``NAME.json.gz``, beside each other."""
    plain = Path(path).with_name(base_name(path))
    return plain, plain.with_name(plain.name + ".gz")


def find(path: Path | str) -> Path | None:
    """The file that holds the result ``path`` names (either form given), or None when there is none."""
    given = Path(path)
    if given.exists():
        return given
    return next((p for p in forms(path) if p.exists()), None)


def read(path: Path | str) -> Any:
    """The JSON of the result ``path`` names, plain or gzipped (either form's name may be given)."""
    found = find(path)
    if found is None:
        raise FileNotFoundError(f"no result file {forms(path)[0]} (or .gz)")
    raw = found.read_bytes()
    return json.loads(gzip.decompress(raw) if found.name.endswith(".gz") else raw)


def write(report: Any, path: Path | str) -> Path:
    """Write ``report`` as compact JSON under the result name of ``path``, gzipped when over
    :data:`GZIP_OVER_BYTES`; the other form is removed. Returns the file written."""
    plain, zipped = forms(path)
    text = (json.dumps(report, separators=(",", ":")) + "\n").encode()
    target, other = (zipped, plain) if len(text) > GZIP_OVER_BYTES else (plain, zipped)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(gzip.compress(text, compresslevel=9, mtime=0) if target is zipped else text)
    other.unlink(missing_ok=True)
    return target


def all_results(folder: Path) -> list[Path]:
    """Every result file in ``folder`` (both forms), sorted by result name."""
    return sorted((p for s in SUFFIXES for p in folder.glob(f"*{s}")), key=base_name)
