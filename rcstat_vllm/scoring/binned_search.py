"""Counting how many sorted window self logits lie below each cross logit, by a lookup table instead of a binary
search: the CPU's faster way to :func:`torch.searchsorted` for RC's scores
(:meth:`rcstat_vllm.scoring.rc.WindowSelfLogits.count_below`)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["BinnedSearch", "bin_of"]


class BinnedSearch:
    """``searchsorted(sorted, x, side="left")`` for many x against a few sorted rows, by a lookup table.

    Each row's range ``[y_2, y_{m-3}]`` is cut into ``B = BINS_PER_VALUE * m`` equal bins, and y and x alike go to
    bin ``clamp(floor((v - y_2) * B / (y_{m-3} - y_2)), 0, B - 1)``. That map is non-decreasing in v under float
    rounding too, so every y in an earlier bin than x is below x and every y in a later bin is above it: the count is
    ``first[bin(x)]`` (the y in earlier bins) plus how many of the at most K y sharing x's bin are below x, K
    comparisons instead of a binary search's ~log2(m) dependent steps. Exact, not an approximation; used only
    while K is small (a row crowded into few bins, e.g. many equal logits, falls back to searchsorted).
    """

    BINS_PER_VALUE = 16
    MAX_PER_BIN = 8
    TRIM = 2

    def __init__(self, lowest: Tensor, scale: Tensor, first: Tensor, padded: Tensor | None, per_bin: int):
        self.lowest, self.scale, self.first, self.padded, self.per_bin = lowest, scale, first, padded, per_bin

    @property
    def usable(self) -> bool:
        return self.per_bin <= self.MAX_PER_BIN

    @classmethod
    def build(cls, sorted_values: Tensor) -> BinnedSearch:
        m = sorted_values.shape[-1]
        num_bins = cls.BINS_PER_VALUE * m
        # The range between the third-lowest and third-highest y: a few outliers land in the end bins instead of
        # stretching the range (and crowding every other y into a few bins).
        trim = cls.TRIM if m > 2 * cls.TRIM + 1 else 0
        lowest, highest = sorted_values[..., trim : trim + 1], sorted_values[..., m - 1 - trim : m - trim]
        spread = highest - lowest
        # NaN or infinite rows, or rows of equal values, get scale 0: one bin, then searchsorted (per_bin = m).
        scale = torch.where((spread > 0) & torch.isfinite(spread), num_bins / spread, torch.zeros_like(spread))
        bins = bin_of(sorted_values, lowest, scale, num_bins)
        # first[..., b] = the y in bins before b: a histogram shifted by one bin, summed (one pass over B, where a
        # searchsorted of every bin edge costs log2(m) steps per edge and dominated small decode-time scorings).
        counts = torch.zeros(*bins.shape[:-1], num_bins + 1, dtype=torch.int64, device=bins.device)
        counts.scatter_add_(-1, bins + 1, torch.ones_like(bins))
        per_bin = int(counts.max()) if m else 0
        first = counts.cumsum_(-1)  # [..., B + 1]
        padded = None
        if per_bin <= cls.MAX_PER_BIN:  # +inf after the last value: reading past a row's end never counts
            padded = torch.nn.functional.pad(sorted_values, (0, per_bin), value=float("inf"))
        return cls(lowest, scale, first, padded, per_bin)

    def count_below(self, x: Tensor) -> Tensor:
        start = torch.gather(self.first, -1, bin_of(x, self.lowest, self.scale, self.first.shape[-1] - 1))
        # The y in x's bin that are below x, counted in one byte (at most MAX_PER_BIN): adding comparisons into
        # int64 would convert each one first.
        in_bin = torch.zeros_like(x, dtype=torch.uint8)
        for k in range(self.per_bin):
            in_bin += torch.gather(self.padded, -1, start + k) < x  # type: ignore[arg-type]  # (per_bin > 0: padded)
        return start + in_bin


def bin_of(values: Tensor, lowest: Tensor, scale: Tensor, num_bins: int) -> Tensor:
    """:class:`BinnedSearch`'s bin of each value: non-decreasing in the value (float rounding included)."""
    bins = ((values - lowest) * scale).nan_to_num_(nan=0.0)  # NaN x: any bin (its score is NaN)
    return bins.floor_().clamp_(0, num_bins - 1).to(torch.int64)
