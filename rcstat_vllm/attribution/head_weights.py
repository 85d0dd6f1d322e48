"""The attribution calibration file: a model's calibrated heads (:class:`HeadWeights`), where the file is looked for,
written and read. The served path reads it (:mod:`rcstat_vllm.attribution.capture`, the HF reference); ``rcstat-vllm
calibrate-attribution`` writes one (:mod:`rcstat_vllm.attribution.calibration`, the fit); ``rcstat-vllm fetch-model``
places the embedded model's shipped one (:func:`place_embedded_calibration`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rcstat_vllm.log import logger
from rcstat_vllm.storage import cache_dir

__all__ = [
    "CALIBRATION_FILE",
    "HeadWeights",
    "calibration_path",
    "load_head_weights",
    "place_embedded_calibration",
    "save_head_weights",
]

#: The calibration file's name (in the model folder, or in ``cache_dir()/attribution/<model folder name>/``).
CALIBRATION_FILE = "rcstat_attribution_heads.json"
FORMAT = 1


class HeadWeights:
    """Calibrated heads of one model: (layer, head) pairs, best first, and their weights (> 0)."""

    def __init__(self, heads: Sequence[Sequence[int]], weights: Sequence[float], meta: dict[str, Any] | None = None):
        if len(heads) != len(weights) or not heads:
            raise ValueError(f"need as many weights as heads (at least one), got {len(heads)} and {len(weights)}")
        if any(not w > 0 for w in weights):
            raise ValueError(f"head weights must be > 0, got {list(weights)}")
        self.heads = [(int(layer), int(head)) for layer, head in heads]
        self.weights = [float(w) for w in weights]
        self.meta = dict(meta or {})

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "heads": [list(h) for h in self.heads], "weights": self.weights, **self.meta}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadWeights:
        if data.get("format") != FORMAT:
            raise ValueError(f"calibration format {data.get('format')!r}, expected {FORMAT}")
        meta = {k: v for k, v in data.items() if k not in ("format", "heads", "weights")}
        return cls(data["heads"], data["weights"], meta)

    def fits(self, num_layers: int, num_heads: int) -> bool:
        shape = self.meta.get("shape")
        if shape is not None and list(shape) != [num_layers, num_heads]:
            return False
        return all(0 <= layer < num_layers and 0 <= head < num_heads for layer, head in self.heads)


def calibration_path(model_dir: str | Path) -> list[Path]:
    """Where a model's calibration file is looked for, in order: the model folder, then the cache dir."""
    model_dir = Path(model_dir)
    return [model_dir / CALIBRATION_FILE, cache_dir() / "attribution" / model_dir.name / CALIBRATION_FILE]


def save_head_weights(weights: HeadWeights, model_dir: str | Path, path: str | Path | None = None) -> Path:
    """Write the file next to the model when that folder is writable, else in the cache dir."""
    candidates = [Path(path)] if path is not None else calibration_path(model_dir)
    for target in candidates:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(weights.to_dict(), indent=1) + "\n")
            return target
        except OSError:
            continue
    raise OSError(f"cannot write the calibration file to any of {[str(c) for c in candidates]}")


def load_head_weights(model_dir: str | Path | None) -> HeadWeights | None:
    """The model's calibration, or None (no file, or one that cannot be read: logged, never an error)."""
    if model_dir is None:
        return None
    for path in calibration_path(model_dir):
        if not path.exists():
            continue
        try:
            return HeadWeights.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("rcstat: attribution calibration %s unreadable (%s): using the RC ranking", path, exc)
            return None
    return None


def place_embedded_calibration(model_dir: Path) -> Path | None:
    """Write the embedded model's shipped attribution calibration (rcstat_vllm.attribution.embedded_calibration)
    next to it, unless a calibration file is already there or in the cache dir (one made by
    ``rcstat-vllm calibrate-attribution`` is never replaced). Returns the file written, or None."""
    from rcstat_vllm.attribution.embedded_calibration import EMBEDDED_CALIBRATION  # (a large literal: when needed)

    if any(path.exists() for path in calibration_path(model_dir)):
        return None
    try:
        return save_head_weights(HeadWeights.from_dict(EMBEDDED_CALIBRATION), model_dir)
    except OSError as exc:  # the served path then uses the RC ranking: said, not fatal
        logger.warning("rcstat: could not write the attribution calibration next to %s (%s)", model_dir, exc)
        return None
