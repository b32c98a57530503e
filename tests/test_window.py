"""Window strategies under random completion orders (hypothesis), driving the real Gate and batcher."""
import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.window import STRATEGIES, Gate, capacity, make_strategy
from stages.batcher import BatcherConfig, WindowedBatcher
from stages.schema import table_from_columns

N = 2  # samples per group


def _group(seq, version):
    return table_from_columns({"group_id": [seq] * N, "sample_idx": list(range(N)), "status": ["completed"] * N,
                               "reward": [0.0, 1.0], "token_versions": [[version, version]] * N})


def simulate(strategy: str, B: int, stale: int, choices: list[int]):
    run = asyncio.new_event_loop().run_until_complete
    gate = Gate(B, stale, strategy)
    batcher = WindowedBatcher(BatcherConfig(groups_per_step=B), N, stale, gate.strategy)
    C = capacity(B, stale)
    next_seq, version, inflight = 0, 0, []   # inflight: (seq, version at dispatch)
    trained, dropped, dispatched = [], [], []

    def collect_and_train():
        nonlocal version
        while True:
            table, gone = batcher.take(version, gate.s)
            dropped.extend(gone)
            run(gate.release(gone))
            if table is None:
                return
            seqs = sorted(set(table.column("group_id").to_pylist()))
            if strategy == "windowed-fifo":
                assert all(q - gate.s.min_uncompleted(q) < B for q in seqs)
            for vv in table.column("token_versions").to_pylist():
                assert all(version - v <= stale for v in vv)   # the staleness bound holds for every trained token
            trained.extend(seqs)
            version += 1
            run(gate.consumed(seqs, version))

    for c in choices + [1] * 400:                  # the tail drains everything
        if c == 0 and gate.strategy.can_dispatch(gate.s, next_seq):
            assert run(gate.acquire([next_seq])) == version
            inflight.append((next_seq, version))
            dispatched.append(next_seq)
            next_seq += 1
        elif inflight:
            seq, v = inflight.pop(c % len(inflight))
            batcher.feed(_group(seq, v))
            run(gate.collected([seq]))
            collect_and_train()
        elif c != 0 and next_seq < 60 and gate.strategy.can_dispatch(gate.s, next_seq):
            inflight.append((next_seq, version))
            run(gate.acquire([next_seq]))
            dispatched.append(next_seq)
            next_seq += 1
        s = gate.s
        assert s.in_flight + s.buffered <= C                       # R + Q <= C
        if strategy == "window-gated" and s.dispatched:
            assert max(s.dispatched) - min(s.dispatched) < C
    left = set(batcher._ready)                                    # fewer than B groups left at the end
    assert len(left) < B
    assert sorted(trained + dropped + list(left)) == sorted(dispatched)   # each group exactly once
    return trained, dropped


@settings(max_examples=60, deadline=None)
@given(strategy=st.sampled_from(sorted(STRATEGIES)), B=st.integers(1, 4), stale=st.integers(0, 2),
       choices=st.lists(st.integers(0, 6), min_size=10, max_size=150))
def test_strategies_bound_staleness_and_train_each_group_once(strategy, B, stale, choices):
    simulate(strategy, B, stale, choices)


def test_synchronous_window_never_drops_and_trains_in_order():
    trained, dropped = simulate("no-window", 2, 0, [0, 0, 1, 1] * 10)
    assert dropped == [] and trained == sorted(trained)


def test_capacity_and_strategy_errors():
    assert capacity(4, 0) == 4 and capacity(4, 1) == 8 and capacity(3, 0.5) == 4
    with pytest.raises(ValueError, match="stale_steps must be >= 0"):
        capacity(4, -1)
    with pytest.raises(ValueError, match="unknown window strategy 'fifo'"):
        make_strategy("fifo")
    assert make_strategy("pipeline.window:WindowGated").name == "window-gated"


def test_gate_blocks_until_consumed_and_close_releases():
    async def scenario():
        gate = Gate(2, 0, "no-window")
        assert await gate.acquire([0, 1]) == 0
        waiter = asyncio.ensure_future(gate.acquire([2]))
        await asyncio.sleep(0.05)
        assert not waiter.done()                       # capacity 2 is full
        await gate.collected([0, 1])
        await asyncio.sleep(0.05)
        assert not waiter.done()                       # collected but not consumed still counts (Q)
        await gate.consumed([0, 1], 1)
        assert await asyncio.wait_for(waiter, 1) == 1   # dispatched under the new version
        blocked = asyncio.ensure_future(gate.acquire([3, 4]))
        await asyncio.sleep(0.05)
        await gate.close()
        assert await asyncio.wait_for(blocked, 1) == -1

    asyncio.new_event_loop().run_until_complete(scenario())


def test_gate_dispatches_in_stream_order_whichever_worker_asks_first():
    async def scenario():
        gate = Gate(groups_per_step=2, stale_steps=2)         # C = 6: room for every group asked
        await gate.expect([0, 1, 2, 3, 5])                     # 4 was consumed before a resume
        late = asyncio.ensure_future(gate.acquire([2, 3]))    # the second block's worker asks first
        await asyncio.sleep(0.05)
        assert not late.done()
        assert await asyncio.wait_for(gate.acquire([0, 1]), 1) == 0
        assert await asyncio.wait_for(late, 1) == 0
        assert await asyncio.wait_for(gate.acquire([7]), 1) == 0   # a seq the stream never announced: no order
        snap = await gate.snapshot()
        assert snap["in_flight"] == 4 + 1

    asyncio.new_event_loop().run_until_complete(scenario())


def test_gate_lets_a_group_go_out_of_order_when_the_head_never_comes(monkeypatch):
    import pipeline.window as window

    monkeypatch.setattr(window, "TURN_TIMEOUT_S", 0.2)

    async def scenario():
        gate = Gate(groups_per_step=2, stale_steps=1)
        await gate.expect([0, 1, 2, 3])
        assert await asyncio.wait_for(gate.acquire([2, 3]), 2) == 0    # 0 and 1 never asked for
        assert (await gate.snapshot())["out_of_order"] == 2
        assert await asyncio.wait_for(gate.acquire([0, 1]), 1) == 0      # the rest still go

    asyncio.new_event_loop().run_until_complete(scenario())
