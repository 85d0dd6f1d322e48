"""The compressed requests' head-page tables, resident on the cache's device and updated incrementally.

Head-as-sequence attention reads every compressed request's ``[L, H, P]`` page table each step. Rebuilding those
tables on the host and copying them over every step costs a transfer proportional to everything the requests hold;
instead one :class:`HeadPageTables` per worker keeps them on the device, like vLLM's own ``BlockTable``
(``vllm/v1/worker/block_table.py``: a host mirror, changes committed to the device in one copy):

- each compressed request has a *slot* (reused when requests finish), holding its page ids ``[L, H, P]`` (-1: no
  page) and its *length base* ``kept[l, h] - num_compacted_tokens`` ``[L, H]``: with ``n`` tokens a head attends
  over ``base + n`` tokens, and the token at position ``p`` is entry ``base + p`` of its page list;
- the tensors are layer-major, ``[L, S, H, P]``: layer l's ``[S * H, P]`` is a page table the attention kernels
  take as it is, one row per (slot, head) head sequence (:mod:`rcstat_vllm.attention.cpu_head_attention`); the device
  copy holds 0 where the host holds -1 (a page the kernels may name but never read past a head's length);
- writes (a compaction filling a slot, a head taking a page when it grows into a new one) land in the host mirror at
  once and are queued; :meth:`HeadPageTables.commit` ships the step's queued entries in one copy per tensor that
  changed and scatters them on the device (nothing when nothing changed);
- the step plan (:func:`rcstat_vllm.attention.head_plan.make_head_plan`) reads the device tensors as they are;
  nothing is read back from the device.

Memory: ``4 * L * S * H * P`` bytes on the host and as much on the device, ``S`` the slots (twice the most
compressed requests held at once, at most) and ``P`` the widest page list any of them held (doubling): Llama-3.1-8B
(32 layers, 8 KV heads, block 16), 256 slots of 32k-token pages lists: 2 x 256 MiB. Neither grows per step.

The host mirror is what the page bookkeeping (:class:`rcstat_vllm.paging.head_pages.CompactedRequest`) reads and writes;
it never waits on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def pinned_for(device: torch.device) -> bool:
    """Host staging memory is pinned when it feeds a CUDA device (asynchronous copies need it)."""
    return device.type == "cuda"


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """One asynchronous host-to-device copy of ``host`` (a fresh host tensor: PyTorch's pinned-memory allocator keeps
    it until the copy ran, so reusing memory cannot race the transfer)."""
    if device.type == "cpu":
        return host
    if pinned_for(device):
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class MirroredTensor:
    """An int32 host tensor and its device copy, kept equal by committing the host's writes in one copy.

    Writes are recorded as flat positions; at :meth:`commit` the values are read from the host (so a position written
    twice in a step ships its last value, once).
    """

    def __init__(self, shape: Sequence[int], device: torch.device, fill: int, device_floor: int | None = None):
        self.device = torch.device(device)
        self.fill = fill
        #: the device copy holds ``max(host, device_floor)`` (None: the host's values)
        self.device_floor = device_floor
        self.host = torch.full(tuple(shape), fill, dtype=torch.int32)
        self.on_device = to_device(self._for_device(self.host.clone()), self.device)
        self._written: list[Tensor] = []
        self._whole = False
        #: host-to-device copies made by :meth:`commit` (tests check that steps without changes make none)
        self.copies = 0

    @property
    def shape(self) -> torch.Size:
        return self.host.shape

    def _for_device(self, values: Tensor) -> Tensor:
        return values if self.device_floor is None else values.clamp_(min=self.device_floor)

    def write(self, coordinates: Sequence[Tensor], values: Tensor) -> None:
        """Set ``host[coordinates] = values`` (one broadcastable int64 index tensor per dimension) and queue it."""
        flat = sum(c.to(torch.int64) * stride for c, stride in zip(coordinates, self.host.stride()))
        flat, values = torch.broadcast_tensors(flat, values.to(torch.int32))
        self.host.view(-1)[flat.reshape(-1)] = values.reshape(-1)
        if not self._whole:
            self._written.append(flat.reshape(-1))

    def grow(self, shape: Sequence[int]) -> None:
        """A larger host tensor (new entries ``fill``), old entries kept; the next commit copies it whole."""
        grown = torch.full(tuple(shape), self.fill, dtype=torch.int32)
        grown[tuple(slice(0, n) for n in self.host.shape)] = self.host
        self.host = grown
        self._whole, self._written = True, []

    @property
    def dirty(self) -> bool:
        return self._whole or bool(self._written)

    def commit(self) -> None:
        """Bring the device copy up to date: the queued positions in one copy, or the whole tensor after a growth."""
        if self._whole:
            # a copy: later host writes wait for a commit
            self.on_device = to_device(self._for_device(self.host.clone()), self.device)
        elif self._written:
            positions = torch.unique(torch.cat(self._written))
            values = self._for_device(self.host.view(-1)[positions].to(torch.int64))
            packed = to_device(torch.stack([positions, values]), self.device)
            self.on_device.view(-1).index_copy_(0, packed[0], packed[1].to(torch.int32))
        else:
            return
        self._whole, self._written = False, []
        self.copies += 1


class HeadPageTables:
    """The page tables of one worker's compressed requests: a slot each, on the host and on the cache's device.

    Attributes:
        pages: ``[L, S, H, P]`` page ids of each slot's (layer, head)s, -1 where a head has no page (0 on the device).
        length_base: ``[L, S, H]`` ``kept - num_compacted_tokens`` of each slot's (layer, head)s.
        longest_base: host ``[S, L]``, per layer the largest length base (the plan's longest sequence, on the host).
    """

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        device: torch.device | str,
        *,
        slots: int = 4,
        width: int = 4,
        max_slots: int | None = None,
        max_width: int | None = None,
    ):
        """``max_slots`` / ``max_width``: the most compressed requests at once (vLLM's ``max_num_seqs``) and pages
        per head (``cdiv(max_model_len, N)``); growth stops there, so the tables never exceed
        :meth:`bound_bytes` (None: unbounded)."""
        self.device = torch.device(device)
        self.max_slots, self.max_width = max_slots, max_width
        slots, width = min(slots, max_slots or slots), min(width, max_width or width)
        self.pages = MirroredTensor((num_layers, slots, num_heads, width), self.device, fill=-1, device_floor=0)
        self.length_base = MirroredTensor((num_layers, slots, num_heads), self.device, fill=0)
        self.longest_base = torch.zeros(slots, num_layers, dtype=torch.int64)
        self._free_slots = list(range(slots - 1, -1, -1))

    @property
    def num_layers(self) -> int:
        return self.pages.shape[0]

    @property
    def num_slots(self) -> int:
        return self.pages.shape[1]

    @property
    def num_heads(self) -> int:
        return self.pages.shape[2]

    @property
    def width(self) -> int:
        return self.pages.shape[3]

    @property
    def copies(self) -> int:
        """Host-to-device copies committed so far, over both tensors."""
        return self.pages.copies + self.length_base.copies

    def attach(self, table: Tensor, base: Tensor) -> ResidentTable:
        """A slot for a freshly compacted request's page table ``[L, H, P]`` (-1 = no page) and length base ``[L, H]``;
        from now on its pages live here, read and grown through the returned handle (the request's ``table``)."""
        slot = self._take_slot()
        self._ensure_width(table.shape[2])
        layers, heads = self._layer_head_grid()
        columns = torch.arange(self.width).view(1, 1, -1)
        padded = torch.full((self.num_layers, self.num_heads, self.width), -1, dtype=torch.int64)
        padded[:, :, : table.shape[2]] = table
        self.pages.write((layers.unsqueeze(2), torch.tensor(slot), heads.unsqueeze(2), columns), padded)
        self.length_base.write((layers, torch.tensor(slot), heads), base)
        self.longest_base[slot] = base.amax(dim=1)
        return ResidentTable(self, slot)

    def release(self, table: ResidentTable) -> None:
        """The request is gone (finished, preempted): its slot serves the next compacted request."""
        if table.owner is self:
            self._free_slots.append(table.slot)
            table.owner, table.slot = None, -1

    def append_pages(self, slot: int, layers: Tensor, heads: Tensor, columns: Tensor, page_ids: Tensor) -> None:
        """Pages that (layer, head)s of ``slot`` took at these columns of their page lists (1-D, equal lengths)."""
        if not columns.numel():
            return
        self._ensure_width(int(columns.max()) + 1)
        slots = torch.full_like(layers, slot)
        self.pages.write((layers, slots, heads, columns), page_ids)

    def slot_pages(self, slot: int, width: int) -> Tensor:
        """Host view ``[L, H, width]`` of a slot's page ids."""
        return self.pages.host[:, slot, :, :width]

    def commit(self) -> None:
        """Ship this step's changes to the device (one copy per tensor that changed, none otherwise)."""
        self.pages.commit()
        self.length_base.commit()

    @staticmethod
    def bound_bytes(num_layers: int, num_heads: int, max_slots: int, max_width: int) -> int:
        """The most the page tables take on each side (host mirror, device copy): int32 pages and length bases."""
        return 4 * num_layers * max_slots * num_heads * (max_width + 1)

    def _take_slot(self) -> int:
        if not self._free_slots:
            used = self.num_slots
            grown = min(2 * used, self.max_slots or 2 * used)
            if grown == used:
                raise RuntimeError(f"rcstat: more than {used} compressed requests at once (max_num_seqs)")
            self.pages.grow((self.num_layers, grown, *self.pages.shape[2:]))
            self.length_base.grow((self.num_layers, grown, self.num_heads))
            longest = torch.zeros(grown, self.num_layers, dtype=torch.int64)
            longest[:used] = self.longest_base
            self.longest_base = longest
            self._free_slots = list(range(grown - 1, used - 1, -1))
        return self._free_slots.pop()

    def _ensure_width(self, width: int) -> None:
        """Room for ``width`` pages per head (doubling, so growth copies the tables whole only now and then; never
        past ``max_width``)."""
        if width > self.width:
            if self.max_width is not None and width > self.max_width:
                raise RuntimeError(f"rcstat: a head needs {width} pages, more than max_model_len allows")
            grown = max(width, 2 * self.width)
            self.pages.grow((*self.pages.shape[:3], grown if self.max_width is None else min(grown, self.max_width)))

    def _layer_head_grid(self) -> tuple[Tensor, Tensor]:
        layers = torch.arange(self.num_layers).view(-1, 1)
        heads = torch.arange(self.num_heads).view(1, -1)
        return layers, heads


class ResidentTable:
    """A compressed request's page table as a slot of the worker's :class:`HeadPageTables` (its ``table`` once
    attached): the request reads and grows it through here; only the owner changes the slots."""

    def __init__(self, owner: HeadPageTables, slot: int):
        self.owner: HeadPageTables | None = owner
        self.slot = slot

    # (``owner`` is None once released, and a released table is never read or grown)
    def pages(self, width: int) -> Tensor:
        return self.owner.slot_pages(self.slot, width).to(torch.int64)  # type: ignore[union-attr]

    def append(self, layers: Tensor, heads: Tensor, columns: Tensor, page_ids: Tensor) -> None:
        self.owner.append_pages(self.slot, layers, heads, columns, page_ids)  # type: ignore[union-attr]

    @property
    def released(self) -> bool:
        return self.owner is None
