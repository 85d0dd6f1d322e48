"""The embedded model's attribution calibration, shipped with the package; ``rcstat-vllm fetch-model`` writes it next
to the converted SmolLM2 (``rcstat_attribution_heads.json``) when no calibration file is there yet.

Made by ``rcstat-vllm calibrate-attribution --prompts 48`` (seed 0, float32, transformers on CPU; 737 s on one busy
core) at commit 1d607c3 plus the issue-55 working tree; its samples and numbers are in
``benchmarks/results/attribution_issue55_cpu.json`` (``calibration``). The data are synthetic licence prompts
(rcstat_vllm.attribution.calibration): none of the benchmarks' texts, templates, subjects or values.
"""

from __future__ import annotations

from typing import Any

#: The embedded model's calibration file, as ``HeadWeights.to_dict`` writes it.
EMBEDDED_CALIBRATION: dict[str, Any] = {
    "format": 1,
    "heads": [[14, 3], [22, 7], [23, 7], [18, 6], [20, 3]],
    "weights": [
        0.1686034792268546,
        0.21753327955901455,
        0.22753551590368584,
        0.19097723176854367,
        0.19535049354190134,
    ],
    "shape": [30, 9],
    "hit_rates": [1.0, 1.0, 1.0, 0.9412, 0.9412],
    "model": "SmolLM2-135M-Instruct",
    "data": "48 synthetic prompts (licence text, templates shelf, teacher, bicycle, gate, ferry), seed 0",
    "answered": 17,
    "samples": 17,
    "samples_multi": 5,
    "dtype": "float32",
    "token_weighting": "uniform",
    "seconds": 737.4,
    "shipped": "rcstat_vllm/attribution/embedded_calibration.py (placed by rcstat-vllm fetch-model)",
}
