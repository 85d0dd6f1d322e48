"""Resident head-page tables (rcstat_vllm.paging.page_tables) and the vectorised step plan built from them.

The plan must equal a straightforward per-row plan (the implementation it replaced, kept here as the reference)
over steps mixing compressed and uncompressed rows, prefill chunks, decode growth across page and block
boundaries, both page spaces, and requests finishing while others take over their slots; the device tables must
equal their host mirror after every commit, and a step that changes nothing must copy nothing.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from fake_vllm import fake_vllm_config
from worker_fixtures import compressed

from rcstat_vllm.attention.head_plan import (
    HeadSequencePlan,
    make_head_plan,
    plan_head_attention,
)
from rcstat_vllm.paging.compaction import assign_pages, blocks_needed
from rcstat_vllm.paging.head_pages import CompactedRequest
from rcstat_vllm.paging.page_space import (
    PageSpace,
    cdiv,
)
from rcstat_vllm.paging.page_tables import HeadPageTables
from rcstat_vllm.worker.step import BatchRequest, StepInfo

LAYERS, HEADS, BLOCK, NUM_BLOCKS = 2, 2, 16, 400


def reference_plan(query_start, seq_lens, compressed, space, resident) -> HeadSequencePlan:
    """The plan by a Python loop: one head sequence per (resident slot, head), the slots of rows in the batch with
    their queries and lengths (each compressed request's host table), the others empty; write slots row by row."""
    num_layers, num_heads = space.num_layers, space.num_heads
    by_slot = {state.table.slot: row for row, state in compressed.items()}
    token_index, head_index, starts = [], [], [0]
    lengths = torch.zeros((num_layers, resident.num_slots, num_heads), dtype=torch.int64)
    tables = torch.zeros((num_layers, resident.num_slots, num_heads, resident.width), dtype=torch.int32)
    for slot in range(resident.num_slots):
        row = by_slot.get(slot)
        for head in range(num_heads):
            tokens = torch.arange(0) if row is None else torch.arange(query_start[row], query_start[row + 1])
            token_index.append(tokens)
            head_index.append(torch.full_like(tokens, head))
            starts.append(starts[-1] + tokens.numel())
        if row is not None:
            state = compressed[row]
            lengths[:, slot] = state.lengths(seq_lens[row])
            tables[:, slot, :, : state.tables.shape[2]] = state.tables.clamp(min=0)
    write_tokens, write_slots = [], []
    for row in sorted(compressed):
        start, end = query_start[row], query_start[row + 1]
        positions = torch.arange(seq_lens[row] - (end - start), seq_lens[row])
        write_tokens.append(torch.arange(start, end))
        write_slots.append(compressed[row].slots(positions))  # [L, q, H]
    return HeadSequencePlan(
        token_index=torch.cat(token_index),
        head_index=torch.cat(head_index),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        block_tables=tables.view(num_layers, -1, resident.width),
        seq_lens=lengths.view(num_layers, -1).to(torch.int32),
        write_tokens=torch.cat(write_tokens),
        slots=torch.cat(write_slots, dim=1).reshape(num_layers, -1),
        num_heads=num_heads,
        max_query_len=max((query_start[r + 1] - query_start[r] for r in compressed), default=0),
        max_seq_lens=lengths.view(num_layers, -1).amax(dim=1).tolist(),
    )


def assert_plans_equal(got: HeadSequencePlan, expected: HeadSequencePlan) -> None:
    for name in ("token_index", "head_index", "query_start_loc", "seq_lens", "write_tokens", "slots"):
        a, b = getattr(got, name), getattr(expected, name)
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), name
    # Page tables: every page a head sequence reads (the columns up to its length) is the reference's.
    assert got.block_tables.dtype == torch.int32 and got.block_tables.shape == expected.block_tables.shape
    read = torch.arange(got.block_tables.shape[2]).view(1, 1, -1) < (
        (expected.seq_lens.long() + BLOCK - 1) // BLOCK
    ).unsqueeze(-1)
    assert torch.equal(got.block_tables[read], expected.block_tables[read])
    assert (got.num_heads, got.max_query_len, got.max_seq_lens) == (
        expected.num_heads,
        expected.max_query_len,
        expected.max_seq_lens,
    )


def assert_device_equals_mirror(resident: HeadPageTables) -> None:
    for mirrored in (resident.pages, resident.length_base):
        assert not mirrored.dirty
        floor = mirrored.device_floor
        assert torch.equal(mirrored.on_device, mirrored.host if floor is None else mirrored.host.clamp(min=floor))


def _space(pooled: bool) -> PageSpace:
    if not pooled:
        return PageSpace.per_layer(LAYERS, HEADS, BLOCK)
    all_layers = torch.zeros(LAYERS * NUM_BLOCKS, HEADS, BLOCK, 2)
    return PageSpace.pooled(all_layers, [layer * NUM_BLOCKS * HEADS for layer in range(LAYERS)], HEADS, BLOCK)


class Engine:
    """Just enough of vLLM and the scheduler to drive the page bookkeeping: block rows that grow as requests do,
    compactions into fresh blocks (no KV is copied: the plan only needs the tables)."""

    def __init__(self, space: PageSpace, generator: torch.Generator):
        self.space, self.g = space, generator
        self.free = [int(b) for b in torch.randperm(NUM_BLOCKS - 1, generator=generator) + 1]
        self.rows: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}
        self.states: dict[str, CompactedRequest] = {}
        self.resident = HeadPageTables(LAYERS, HEADS, "cpu", slots=2, width=2)  # small: growth is exercised

    def add(self, req_id: str, num_tokens: int) -> None:
        self.rows[req_id], self.lengths[req_id] = [], 0
        self.grow(req_id, num_tokens)

    def grow(self, req_id: str, num_tokens: int) -> None:
        self.lengths[req_id] += num_tokens
        row = self.rows[req_id]
        while len(row) * BLOCK < self.lengths[req_id]:
            row.append(self.free.pop())

    def compact(self, req_id: str, keep_fraction: float) -> None:
        """Select random kept tokens (every head its own count), give the prompt blocks back, take fresh ones."""
        n = self.lengths[req_id]
        kept = ((torch.rand(LAYERS, HEADS, generator=self.g) * keep_fraction * n).long() + 8).clamp(max=n)
        keep_blocks = blocks_needed(kept, n, self.space)
        self.free.extend(self.rows[req_id])
        dest = torch.tensor([self.free.pop(0) for _ in range(keep_blocks)])
        tables, unused = assign_pages(kept, dest, self.space)
        state = CompactedRequest.from_compaction(n, self.space, kept, tables, unused, keep_blocks)
        state.attach_to(self.resident)
        self.states[req_id] = state
        # vLLM's row keeps its length; later positions get new blocks (the compacted prompt's are never read).
        self.rows[req_id] = list(dest.tolist()) + [0] * (cdiv(n, BLOCK) - keep_blocks)

    def finish(self, req_id: str) -> None:
        state = self.states.pop(req_id, None)
        if state is not None:
            self.resident.release(state.table)
        del self.rows[req_id], self.lengths[req_id]

    def step(self, scheduled: dict[str, int]) -> tuple[tuple, HeadSequencePlan]:
        """Grow every scheduled request, reserve the compressed ones' pages (host block ids, as the runner gives
        them), and plan the step both ways."""
        order = list(scheduled)
        for req_id in order:
            self.grow(req_id, scheduled[req_id])
        compressed = {}
        for row, req_id in enumerate(order):
            state = self.states.get(req_id)
            if state is not None:
                state.reserve(self.lengths[req_id], np.asarray(self.rows[req_id], dtype=np.int32))
                compressed[row] = state
        query_start = [0]
        for req_id in order:
            query_start.append(query_start[-1] + scheduled[req_id])
        seq_lens = [self.lengths[r] for r in order]
        width = max(len(self.rows[r]) for r in order) + 3  # vLLM's table is wider than any row
        block_table = torch.zeros(len(order), width, dtype=torch.int32)
        for i, req_id in enumerate(order):
            block_table[i, : len(self.rows[req_id])] = torch.tensor(self.rows[req_id], dtype=torch.int32)
        positions = torch.cat([torch.arange(self.lengths[r] - scheduled[r], self.lengths[r]) for r in order])
        rows = torch.repeat_interleave(torch.arange(len(order)), torch.tensor([scheduled[r] for r in order]))
        slot_mapping = block_table[rows, positions // BLOCK].long() * BLOCK + positions % BLOCK
        slot_mapping = torch.cat([slot_mapping, torch.full((3,), -1)])  # padded like vLLM's persistent buffer
        args = (query_start, seq_lens, compressed, self.space, torch.device("cpu"))
        return args, reference_plan(query_start, seq_lens, compressed, self.space, self.resident)


@pytest.mark.parametrize("f_tokens", [2, 1], ids=["a-row-of-2-tokens", "decode-only"])
@pytest.mark.parametrize("pooled", [True, False], ids=["pooled-pages", "per-layer-pages"])
def test_plan_equals_the_per_row_reference_and_device_tables_track_the_mirror(pooled, f_tokens):
    """With a compressed row of 2 tokens (speculative decoding) and with one token per compressed row (decode), the
    plan's write slots and tables equal the reference."""
    g = torch.Generator().manual_seed(5)
    engine = Engine(_space(pooled), g)
    for req_id, n in (("a", 150), ("b", 90), ("d", 70), ("f", 60)):
        engine.add(req_id, n)
        engine.compact(req_id, {"a": 0.5, "b": 0.1, "d": 0.9, "f": 0.3}[req_id])
    engine.add("c", 0)  # uncompressed, prefilled in chunks of 20 next to the compressed decodes
    copies_per_step, attached_slots = [], {"d": engine.states["d"].table.slot}
    for step in range(40):
        if step == 12:
            engine.add("e", 0)
        if step == 13:
            engine.finish("d")  # finished: its slot is free again
            engine.compact("e", 0.4)  # takes the slot "d" left
            assert engine.states["e"].table.slot == attached_slots["d"]
        scheduled = {"a": 1, "b": 1, "f": f_tokens}  # 2: "f" verifies 2 tokens a step (speculative decoding)
        if "d" in engine.states:
            scheduled["d"] = 1
        scheduled["c"] = 20 if engine.lengths["c"] < 100 else 1
        if "e" in engine.lengths:
            scheduled["e"] = 120 if step == 12 else 1  # its prefill (uncompressed), then compressed decode
        items = list(scheduled.items())
        order = [items[i] for i in torch.randperm(len(items), generator=g).tolist()]  # vLLM reorders its batch
        args, expected = engine.step(dict(order))
        tables = engine.resident
        dirty = tables.pages.dirty + tables.length_base.dirty
        before = engine.resident.copies
        plan = make_head_plan(*args)
        assert engine.resident.copies - before == dirty  # one copy per tensor that changed, none otherwise
        copies_per_step.append(dirty)
        assert_device_equals_mirror(engine.resident)
        assert_plans_equal(plan, expected)
    # The run grew the tables (slots and width), took pages in some steps and none in others.
    assert engine.resident.num_slots >= 4 and engine.resident.width > 2
    assert 0 in copies_per_step and any(copies_per_step)


def test_a_decode_step_copies_the_page_table_when_heads_take_pages_at_most_once_a_block_and_nothing_otherwise():
    """Heads keeping different numbers of tokens cross page boundaries at different steps, yet they take their pages
    of a block together, at the first step of the block where one of them needs one (one copy of the page lists);
    every other step copies nothing."""
    engine = Engine(_space(pooled=False), torch.Generator().manual_seed(6))
    engine.add("a", 64)
    engine.compact("a", 0.5)
    state = engine.states["a"]
    assert len(set((state.kept % BLOCK).flatten().tolist())) > 2  # heads at different offsets in their pages
    args, expected = engine.step({"a": 1})
    assert_plans_equal(make_head_plan(*args), expected)  # commits the compaction (pages and length bases)
    blocks_taking_pages = []
    for _ in range(80):
        room = state.room
        args, expected = engine.step({"a": 1})
        took_pages = engine.lengths["a"] - state.num_compacted_tokens > room
        if took_pages:
            blocks_taking_pages.append(cdiv(engine.lengths["a"], BLOCK))
        copies = engine.resident.copies
        assert_plans_equal(make_head_plan(*args), expected)
        assert engine.resident.copies - copies == took_pages
        make_head_plan(*args)  # planning the same step again: nothing new to copy
        assert engine.resident.copies - copies == took_pages
    assert len(blocks_taking_pages) >= 4 and len(set(blocks_taking_pages)) == len(blocks_taking_pages)


def test_reserve_takes_host_block_ids_and_refuses_device_tensors():
    engine = Engine(_space(pooled=False), torch.Generator().manual_seed(7))
    engine.add("a", 64)
    engine.compact("a", 0.5)
    state = engine.states["a"]
    assert not state.blocks_to_absorb(64)
    state.reserve(64)  # no new vLLM block: no ids needed
    engine.grow("a", 1)
    with pytest.raises(ValueError, match="on the host"):
        state.reserve(65)
    with pytest.raises(ValueError, match="would synchronise"):
        state.reserve(65, torch.zeros(8, dtype=torch.int32, device="meta"))
    pool_before, pages_before = len(state.pools[0]), int(state.page_counts[0].sum())
    state.reserve(65, np.asarray(engine.rows["a"], dtype=np.int32))
    taken = int(state.page_counts[0].sum()) - pages_before
    assert state.absorbed_blocks == 5 and len(state.pools[0]) == pool_before + HEADS - taken


def _worker_with(seed: int, space: PageSpace):
    """A worker with one compressed request ("a"), set up as a compaction leaves it."""
    from rcstat_vllm.paging.kv_layout import CPU_VEC
    from rcstat_vllm.worker.driver import WorkerCompression

    vllm_config = fake_vllm_config({"method": "rc"}, BLOCK)
    worker = WorkerCompression(vllm_config)
    worker.attach_layers([f"l{i}" for i in range(LAYERS)], num_kv_heads=HEADS, block_size=BLOCK, layout=CPU_VEC)
    engine = Engine(space, torch.Generator().manual_seed(seed))
    engine.resident = worker.pages.tables = HeadPageTables(LAYERS, HEADS, "cpu")
    engine.add("a", 64)
    engine.compact("a", 0.5)
    compressed(worker.requests, "a", engine.states["a"])
    return worker, engine


@pytest.mark.parametrize("host_ids", [True, False], ids=["host-block-ids", "no-host-block-ids"])
def test_worker_grows_from_the_step_infos_host_block_ids_and_reads_the_device_table_only_without_them(host_ids):
    worker, engine = _worker_with(8, _space(pooled=False))
    for _ in range(20):  # crosses into vLLM's next block (position 64)
        engine.grow("a", 1)
        n = engine.lengths["a"]
        row = np.asarray(engine.rows["a"], dtype=np.int32)
        request = BatchRequest("a", 64, n - 1, 1, block_ids=row if host_ids else None)
        worker.begin_step(StepInfo(requests=[request], block_size=BLOCK if host_ids else None))
        block_table = torch.tensor(row).view(1, -1)
        position = torch.tensor([n - 1])
        common = SimpleNamespace(
            num_reqs=1,
            block_table_tensor=block_table,
            query_start_loc_cpu=torch.tensor([0, 1]),
            slot_mapping=block_table[0, position // BLOCK].long() * BLOCK + position % BLOCK,
        )
        plan = worker.plan_step(common)
        plan_head_attention(plan, common)  # as the backends' builders do
        expected = reference_plan(
            [0, 1], [n], {0: worker.requests.compressed_state("a")}, worker.space, worker.pages.tables
        )
        assert_plans_equal(plan.head_plan, expected)
    state = worker.requests.compressed_state("a")
    assert state.absorbed_blocks == 6
    # Without host ids: one device read per vLLM block reached (positions 64 and 80), none in the other steps.
    assert worker.planner.device_block_row_reads == (0 if host_ids else 2)
    worker.begin_step(StepInfo(requests=[], dropped_req_ids={"a"}))
    assert worker.num_compressed_requests == 0 and state.table.released  # its slot is free for the next compaction


def test_step_info_carries_each_rows_host_block_ids_in_batch_order():
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    from rcstat_vllm.patches.model_runner import step_info

    tables = MultiGroupBlockTable(
        max_num_reqs=4,
        max_num_batched_tokens=64,
        pin_memory=False,
        device=torch.device("cpu"),
        block_sizes=[BLOCK],
        max_num_blocks=[8],
    )
    tables.add_row(([5, 6, 7],), 0)
    tables.add_row(([9],), 1)
    tables.append_row(([10],), 1)
    tables.swap_row(0, 1)  # vLLM reorders rows together with its request ids
    batch = SimpleNamespace(
        block_table=tables,
        req_ids=["y", "x"],
        num_reqs=2,
        num_prompt_tokens=np.array([20, 40]),
        num_computed_tokens_cpu=np.array([19, 40]),
    )
    # (a class of its own: the hooks find a runner's owner through a weak reference, which SimpleNamespace refuses)
    runner = type("Runner", (), {"input_batch": batch, "requests": {}, "vllm_config": None})()  # no owner: one group
    scheduler_output = SimpleNamespace(
        num_scheduled_tokens={"x": 1, "y": 1},
        finished_req_ids=set(),
        preempted_req_ids=None,
        scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=()),
        scheduled_new_reqs=[],
    )
    info = step_info(runner, scheduler_output)
    assert info.block_size == BLOCK
    assert [r.block_ids.tolist() for r in info.requests] == [[9, 10], [5, 6, 7]]
    assert not info.requests[0].block_ids.flags.writeable


def test_a_step_scheduling_no_tokens_still_ends_the_requests_it_names_finished(monkeypatch):
    """The engine core's last step before idling schedules nothing and only names the requests finished in the
    step before; vLLM's runner returns before ``_prepare_inputs`` then, so the ``execute_model`` hook must hand
    the worker those ids (else a server keeps their state and page-table slots for ever)."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    from rcstat_vllm import owners
    from rcstat_vllm.patches.model_runner import HOOKS

    worker, _ = _worker_with(3, _space(pooled=False))

    class Runner:  # a model runner: the worker's owner is found from it (weakly)
        vllm_config = worker.vllm_config

    runner = Runner()
    monkeypatch.setitem(owners._RUNNER_OWNERS, runner, worker)
    state = worker.requests.compressed_state("a")
    execute_model = HOOKS["execute_model"](lambda runner, scheduler_output: EMPTY_MODEL_RUNNER_OUTPUT)
    idle = SimpleNamespace(
        total_num_scheduled_tokens=0,
        num_scheduled_tokens={},
        finished_req_ids={"a"},
        preempted_req_ids=None,
        scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=()),
    )
    assert execute_model(runner, idle) is EMPTY_MODEL_RUNNER_OUTPUT
    assert worker.num_compressed_requests == 0 and state.table.released


def test_plain_rows_are_the_uncompressed_rows_own_vllm_metadata():
    """The uncompressed rows of a batch with compressed ones become a batch of their own for vLLM's builder: their
    tokens, offsets, lengths, block-table rows (cut to the longest of them) and slots, nothing of the other rows."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from rcstat_vllm.attention.head_plan import plain_rows

    starts, seq_lens = [0, 1, 21, 22, 25], [70, 40, 90, 30]  # rows 0 and 2 compressed (decode), 1 and 3 not
    block_table = torch.randint(1, 100, (4, 10), dtype=torch.int32)
    slot_mapping = torch.cat([torch.randint(0, 1600, (25,)), torch.full((3,), -1)])  # padded, as vLLM's buffer
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        query_start_loc_cpu=torch.tensor(starts),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=4,
        num_actual_tokens=25,
        max_query_len=20,
        max_seq_len=90,
        block_table_tensor=block_table,
        slot_mapping=slot_mapping,
        positions=torch.arange(28),
        is_prefilling=torch.tensor([False, True, False, True]),
    )
    plain = plain_rows(common, {0: "a", 2: "b"}, starts, seq_lens, BLOCK)
    tokens = [*range(1, 21), 22, 23, 24]
    assert plain.token_index.tolist() == tokens
    rows = plain.metadata
    assert rows.query_start_loc.tolist() == rows.query_start_loc_cpu.tolist() == [0, 20, 23]
    assert rows.seq_lens.tolist() == [40, 30] and rows.seq_lens_cpu_upper_bound.tolist() == [40, 30]
    assert (rows.num_reqs, rows.num_actual_tokens, rows.max_query_len, rows.max_seq_len) == (2, 23, 20, 40)
    assert torch.equal(rows.block_table_tensor, block_table[[1, 3], : cdiv(40, BLOCK)])
    assert torch.equal(rows.slot_mapping, slot_mapping[tokens])
    assert rows.positions.tolist() == tokens and rows.is_prefilling.tolist() == [True, True]
    assert plain_rows(common, {0: "a", 1: "b", 2: "c", 3: "d"}, starts, seq_lens, BLOCK) is None


class _SameDeviceIndexing(torch.overrides.TorchFunctionMode):
    """index_select with its input and index on different devices raises, as CUDA does (the CPU and meta devices
    let some such mixes through)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.index_select, torch.Tensor.index_select):
            tensor, index = args[0], args[2] if len(args) > 2 else kwargs["index"]
            if tensor.device != index.device:
                raise RuntimeError(f"index_select: input on {tensor.device}, index on {index.device}")
        return func(*args, **kwargs)


def test_plain_rows_index_each_field_on_its_own_device():
    """On the GPU runner vLLM keeps ``is_prefilling`` (and ``query_start_loc_cpu``) on the host while the block
    table, slots and positions live on the device: each field is indexed where it lives and stays there (the first
    H200 run stopped on "index is on cuda:0, different from other tensors on cpu"). 'meta' stands for the device."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from rcstat_vllm.attention.head_plan import plain_rows

    device = torch.device("meta")
    starts, seq_lens = [0, 1, 21, 22, 25], [70, 40, 90, 30]
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        query_start_loc_cpu=torch.tensor(starts),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        num_reqs=4,
        num_actual_tokens=25,
        max_query_len=20,
        max_seq_len=90,
        block_table_tensor=torch.zeros(4, 10, dtype=torch.int32, device=device),
        slot_mapping=torch.zeros(28, dtype=torch.int64, device=device),
        positions=torch.zeros(28, device=device),
        is_prefilling=torch.tensor([False, True, False, True]),
    )
    with _SameDeviceIndexing():
        rows = plain_rows(common, {0: "a", 2: "b"}, starts, seq_lens, BLOCK).metadata
    assert rows.is_prefilling.device.type == "cpu" and rows.is_prefilling.tolist() == [True, True]
    assert rows.query_start_loc_cpu.device.type == "cpu" and rows.seq_lens_cpu_upper_bound.device.type == "cpu"
    for name in ("block_table_tensor", "slot_mapping", "positions", "query_start_loc", "seq_lens"):
        assert getattr(rows, name).device == device, name
    assert rows.block_table_tensor.shape == (2, cdiv(40, BLOCK)) and rows.slot_mapping.shape == (23,)


def test_tables_stop_growing_at_max_num_seqs_and_max_model_len_within_their_stated_bound():
    """Slots double up to max_slots, widths up to max_width (not past them), the tables then take exactly the bound
    the worker logs at start-up, and a request past either limit is refused with the reason (a bookkeeping bug)."""
    engine = Engine(_space(pooled=True), torch.Generator().manual_seed(5))
    max_width = cdiv(300, BLOCK)  # max_model_len 300
    engine.resident = HeadPageTables(LAYERS, HEADS, "cpu", slots=2, width=2, max_slots=3, max_width=max_width)
    for i in range(3):
        engine.add(f"r{i}", 290)
        engine.compact(f"r{i}", keep_fraction=1.0)
    tables = engine.resident
    state = engine.states["r1"]
    grow = (torch.tensor([0]), torch.tensor([0]), torch.tensor([max_width - 1]), torch.tensor([7]))
    state.table.append(*grow)  # a head reaching the last page max_model_len allows
    assert tables.num_slots == 3 and tables.width == max_width  # slots 2 -> 3 (not 4); width -> 19 (not doubled)
    held = (tables.pages.host.numel() + tables.length_base.host.numel()) * 4
    assert held == HeadPageTables.bound_bytes(LAYERS, HEADS, 3, max_width)
    engine.add("r3", 100)
    with pytest.raises(RuntimeError, match="more than 3 compressed requests"):
        engine.compact("r3", keep_fraction=0.5)
    engine.finish("r0")  # its slot serves the next one
    engine.compact("r3", keep_fraction=0.5)
    with pytest.raises(RuntimeError, match="max_model_len"):
        state.table.append(torch.tensor([0]), torch.tensor([0]), torch.tensor([max_width]), torch.tensor([7]))


def test_a_request_finishing_frees_its_slot_for_a_compaction_in_the_same_step(monkeypatch):
    """At max_num_seqs compressed requests, one finishing and another compacted in one step: the worker releases the
    finished one's slot before the compaction takes one (else the tables would need max_num_seqs + 1 slots)."""
    from rcstat_vllm.paging.kv_layout import CPU_VEC
    from rcstat_vllm.reports import Compaction
    from rcstat_vllm.worker.driver import WorkerCompression

    worker = WorkerCompression(fake_vllm_config({"method": "rc"}, BLOCK, max_num_seqs=1))
    worker.attach_layers([f"l{i}" for i in range(LAYERS)], num_kv_heads=HEADS, block_size=BLOCK, layout=CPU_VEC)
    engine = Engine(_space(pooled=True), torch.Generator().manual_seed(2))
    engine.resident = worker.pages.tables = HeadPageTables(LAYERS, HEADS, "cpu", slots=1, max_slots=1)
    engine.add("a", 64)
    engine.compact("a", 0.5)
    compressed(worker.requests, "a", engine.states["a"])
    engine.add("b", 80)

    def run_compaction(compaction):  # what _run_compaction does to the tables: attach the new state
        engine.compact(compaction.req_id, 0.5)
        compressed(worker.requests, compaction.req_id, engine.states[compaction.req_id])

    monkeypatch.setattr(worker, "_run_compaction", run_compaction)
    worker.begin_step(StepInfo(requests=[], dropped_req_ids={"a"}, compactions=[Compaction("b", [])]))
    assert worker.num_compressed_requests == 1 and worker.requests.compressed_state("b").table.slot == 0
    assert engine.states["a"].table.released
    # A request compacted in the very step it is dropped in gives its slot back too.
    engine.add("c", 64)
    worker.begin_step(StepInfo(requests=[], dropped_req_ids={"b", "c"}, compactions=[Compaction("c", [])]))
    assert worker.idle and worker.pages.tables._free_slots == [0]
