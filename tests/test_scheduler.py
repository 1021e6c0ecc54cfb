"""Scheduler units without a model: token budget, decode-first order, priorities, admission, preemption."""

import time

import pytest

from llmd.engine.block_manager import BlockManager
from llmd.engine.scheduler import Scheduler
from llmd.engine.sequence import Sequence, SeqStatus
from llmd.engine.types import Priority, RequestTimings, SamplingParams

BS = 4


def make_seq(rid: str, n_prompt: int, priority=Priority.INTERACTIVE, start=0) -> Sequence:
    return Sequence(rid, list(range(start, start + n_prompt)), SamplingParams(temperature=0), priority,
                    RequestTimings(arrival=time.monotonic()))


def run_step(sched: Scheduler, sampled_token: int = 1):
    """Apply a schedule as the engine would: mark tokens computed, append a token where the chunk completes."""
    out = sched.schedule()
    for s in out.scheduled:
        samples = s.samples
        s.seq.num_computed_tokens += s.num_new_tokens
        sched.bm.register_full_blocks(s.seq.block_ids, s.seq.block_hashes, s.seq.token_ids,
                                      s.seq.num_computed_tokens)
        if samples:
            s.seq.token_ids.append(sampled_token)
    return out


@pytest.fixture(autouse=True)
def _no_leaks(request):
    yield
    sched = request.node.funcargs.get("sched")
    if sched is not None:
        for seq in list(sched.running) + [s for q in sched.waiting.values() for s in q]:
            sched.remove(seq)
        sched.bm.check_idle()


@pytest.fixture
def sched():
    return Scheduler(BlockManager(64, BS), max_num_seqs=8, max_num_batched_tokens=16)


def test_chunked_prefill_respects_budget_and_decodes_go_first(sched):
    a = make_seq("a", 3)
    sched.add(a)
    run_step(sched)  # a prefilled, now decoding
    assert not a.is_prefilling
    long = make_seq("long", 40, start=100)
    sched.add(long)
    steps = 0
    while long.is_prefilling or long.num_output_tokens == 0:
        out = run_step(sched)
        steps += 1
        assert out.num_tokens <= 16
        assert out.scheduled[0].seq is a and out.scheduled[0].num_new_tokens == 1, "decode first in every step"
    assert steps == 3  # 15 + 15 + 10 tokens of prompt beside a's decode


def test_interactive_admitted_before_batch_fcfs_within(sched):
    sched.max_num_seqs = 2
    b1 = make_seq("b1", 2, Priority.BATCH)
    i1 = make_seq("i1", 2)
    i2 = make_seq("i2", 2)
    for s in (b1, i1, i2):
        sched.add(s)
    out = run_step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["i1", "i2"]
    assert b1.status is SeqStatus.WAITING


def test_admission_reserves_prompt_blocks_and_waits_when_full():
    sched = Scheduler(BlockManager(5, BS), max_num_seqs=8, max_num_batched_tokens=4)
    a = make_seq("a", 12)  # 3 blocks reserved at once though only 4 tokens fit this step
    b = make_seq("b", 12, start=50)
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["a"]
    assert len(a.block_ids) == 3 and b.status is SeqStatus.WAITING
    sched.remove(a)
    sched.remove(b)
    sched.bm.check_idle()


def test_preemption_picks_newest_lowest_priority_and_requeues_at_head():
    sched = Scheduler(BlockManager(4, BS), max_num_seqs=8, max_num_batched_tokens=64)
    old = make_seq("old", 4)
    new = make_seq("new", 4, start=10)
    batch = make_seq("batch", 3, Priority.BATCH, start=20)
    for s in (old, new, batch):
        sched.add(s)
    run_step(sched)  # 3 blocks used; each now has a sampled token, old and new need a second block
    out = run_step(sched)
    assert batch in out.preempted, "the batch-priority request goes first"
    assert sched.waiting[Priority.BATCH][0] is batch and batch.num_computed_tokens == 0
    assert batch.timings.num_preemptions == 1
    out = run_step(sched)
    # 'old' and 'new' each hold 2 blocks now; the pool is full; next block boundary preempts 'new'
    while not out.preempted:
        out = run_step(sched)
    assert out.preempted == [new] and old.status is SeqStatus.RUNNING
    assert sched.num_preemptions == 2
    sched.remove(old)
    sched.remove(new)
    sched.remove(batch)
    sched.bm.check_idle()


def test_recompute_after_preemption_reuses_cached_prefix():
    bm = BlockManager(4, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a = make_seq("a", 8)
    sched.add(a)
    run_step(sched)
    assert len(a.block_ids) == 2
    sched._preempt(a, type("O", (), {"preempted": []})())
    out = run_step(sched)
    assert out.scheduled[0].seq is a
    assert a.timings.num_cached_tokens == 0, "cached count is the first admission's"
    assert bm.hits_tokens == 8 and out.scheduled[0].num_new_tokens == 1
    sched.remove(a)
    bm.check_idle()


def test_abort_from_any_state_frees_blocks(sched):
    a, b = make_seq("a", 30), make_seq("b", 5, start=40)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # a mid-prefill (16 of 30), b waiting or running
    sched.remove(a)
    sched.remove(b)
    assert not sched.has_work()
    sched.bm.check_idle()
