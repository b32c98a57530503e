"""The step loop and what it overlaps, stepped on a fake window, trainer and sender (no Ray): each
appends what it does to one event log, and the tests read the order off it, as Ray Data's executor
tests do."""
from __future__ import annotations

import threading
import time

import pyarrow as pa
import pytest

from pipeline.loop import StepLoop


def table(groups: list[int]) -> pa.Table:
    return pa.table({"group_id": pa.array([g for g in groups for _ in range(2)], pa.int64())})


class FakeRun:
    """A window whose step tables come at once (or only when allowed to), a trainer whose updates
    finish when the loop asks for them, and a sender that is free at once."""

    def __init__(self, steps: int, gate: bool = False, sender_free: bool = True):
        self.events: list[str] = []
        self.steps, self.sender_free = steps, sender_free
        self.allowed = threading.Semaphore(0) if gate else None      # None: every batch is there at once
        self.closed = threading.Event()
        self.settled: list[int] = []
        self.taken = 0

    # the window
    def next_step(self, version):
        if self.taken >= self.steps or self.closed.is_set():
            return None
        if self.allowed is not None:
            while not self.allowed.acquire(timeout=0.05):
                if self.closed.is_set():
                    return None
        k, self.taken = self.taken, self.taken + 1
        self.events.append(f"take {k}")
        return table([2 * k, 2 * k + 1])

    def consumed(self, groups, version):
        self.settled += groups
        self.events.append(f"window v{version} {groups}")

    def close(self):
        self.events.append("closed")
        self.closed.set()

    def stop_reading(self):
        self.closed.set()

    # the trainer and the sender
    def train(self, t):
        g = t.column("group_id")[0].as_py() // 2
        self.events.append(f"submit {g}")
        time.sleep(0.05)                 # an update takes time: the next batch arrives meanwhile
        return {"train/tokens": 1, "train/loss": 0.5}

    def publish(self, version, sender_free):
        self.events.append(f"send v{version}")
        if self.sender_free:
            sender_free()
        self.events.append(f"landed v{version}")
        return {"transfer/version": version}

    def loop(self, steps: int, **kw) -> StepLoop:
        return StepLoop(self, self.train, lambda step, b, m: self.events.append(f"record {step}"), steps,
                        publish=self.publish, checkpoint=lambda: self.events.append(f"checkpoint {self.settled}"),
                        **kw)


def between(events: list[str], a: str, b: str) -> list[str]:
    """What the loop did between two events (the prefetch thread's takes left out)."""
    return [e for e in events[events.index(a) + 1:events.index(b)] if not e.startswith("take")]


def test_sync_loop_reads_as_the_algorithm_box():
    run = FakeRun(steps=3)
    loop = run.loop(3)
    assert loop.run() == 3 and loop.version == 3
    ev = [e for e in run.events if not e.startswith("take") and e != "closed"]
    assert ev == ["submit 0", "send v1", "landed v1", "window v1 [0, 1]",
                  "submit 1", "record 1", "send v2", "landed v2", "window v2 [2, 3]",
                  "submit 2", "record 2", "send v3", "landed v3", "window v3 [4, 5]", "record 3"]
    assert run.closed.is_set()


def test_update_overlaps_rollout_and_bookkeeping():
    """The next batch is taken while the trainer works (prefetch), and the previous step's
    bookkeeping runs after the next update was submitted."""
    run = FakeRun(steps=3, gate=True)
    took_during_update = []

    def train(t):
        run.allowed.release()            # the stream may produce the next batch only now...
        time.sleep(0.2)                  # ...while this update runs
        took_during_update.append(sum(e.startswith("take") for e in run.events))
        return FakeRun.train(run, t)

    run.allowed.release()
    run.train = train
    run.loop(3).run()
    assert took_during_update == [2, 3, 3]      # step k's update saw batch k+1 taken already
    assert run.events.index("record 1") > run.events.index("submit 1")


def test_next_update_queued_behind_the_send_in_async_mode():
    run = FakeRun(steps=3)
    run.loop(3, queue_next=True).run()
    # the next update goes in between the send starting and the engines landing
    assert between(run.events, "send v1", "landed v1") == ["submit 1"]
    assert between(run.events, "send v2", "landed v2") == ["submit 2"]
    assert between(run.events, "send v3", "landed v3") == []           # the final step: nothing after it


def test_nothing_queued_when_the_sender_reads_after_send_or_in_sync_mode():
    for kw, free in (({"queue_next": True}, False), ({"queue_next": False}, True)):
        run = FakeRun(steps=3, sender_free=free)
        run.loop(3, **kw).run()
        assert between(run.events, "send v1", "landed v1") == []


def test_checkpoint_step_keeps_its_weights_and_saves_only_trained_groups():
    """At a checkpoint the next update is not queued (the weights must stay put until saved), and
    the batch already taken for the next step is not among the groups it saves, so a resume runs it again."""
    run = FakeRun(steps=4)
    run.loop(4, queue_next=True, checkpoint_every=2).run()
    assert between(run.events, "send v2", "landed v2") == []
    assert run.events.index("take 2") < run.events.index("checkpoint [0, 1, 2, 3]")     # step 3's batch: taken
    assert between(run.events, "window v2 [2, 3]", "submit 2") == ["checkpoint [0, 1, 2, 3]"]     # not saved
    assert between(run.events, "send v1", "landed v1") == ["submit 1"]  # other steps still queue


def test_final_step_then_bookkeeping_and_the_stream_closed():
    run = FakeRun(steps=10)
    loop = run.loop(2, queue_next=True)
    assert loop.run() == 2
    ev = [e for e in run.events if not e.startswith("take") and e != "closed"]
    assert ev[-1] == "record 2" and "submit 2" not in ev and run.taken == 2     # nothing taken past the end
    assert run.closed.wait(5)


def test_stream_that_ends_early_ends_the_loop():
    run = FakeRun(steps=2)
    assert run.loop(5, queue_next=True).run() == 2


def test_stop_abandons_the_wait_but_finishes_a_queued_update():
    run = FakeRun(steps=5, gate=True)
    loop = run.loop(5)
    run.allowed.release()
    t = threading.Thread(target=loop.run)
    t.start()
    time.sleep(0.3)
    assert loop.last_step() == 1         # what the stop message names: the step already trained
    loop.stop.set()                      # the loop waits for batch 1, which never comes
    t.join(5)
    assert not t.is_alive() and loop.step == 1 and run.events.count("closed") >= 1   # the window released
    assert [e for e in run.events if not e.startswith("take") and e != "closed"][-1] == "record 1"

    run = FakeRun(steps=5)
    loop = run.loop(5, queue_next=True)

    def train(t):
        if "send v1" in run.events:
            loop.stop.set()              # stop arrives as update 2 is queued behind step 1's send
        return FakeRun.train(run, t)

    loop.train = train
    loop.run()
    assert loop.step == 2 and "landed v2" in run.events    # the queued update was published, not dropped


def test_stop_during_an_update_names_that_step_as_the_last():
    run = FakeRun(steps=5)
    loop = run.loop(5)
    named = []

    def train(t):
        if not named:
            loop.stop.set()              # Ctrl-C while step 1 trains
            named.append(loop.last_step())
        return FakeRun.train(run, t)

    loop.train = train
    loop.run()
    assert named == [1] and loop.step == 1


def test_errors_in_the_stream_surface_in_the_loop():
    run = FakeRun(steps=3)
    real = run.next_step

    def broken(version):
        if version == 1:
            raise RuntimeError("rollout failed")
        return real(version)

    run.next_step = broken
    with pytest.raises(RuntimeError, match="rollout failed"):
        run.loop(3).run()


def test_one_table_is_taken_ahead_and_none_past_the_run():
    run = FakeRun(steps=10)
    seen = []

    def train(t):
        time.sleep(0.1)                  # the take ahead ends meanwhile
        seen.append(run.taken)
        return FakeRun.train(run, t)

    run.train = train
    assert run.loop(4).run() == 4
    assert seen == [2, 3, 4, 4] and run.taken == 4 and run.closed.is_set()


def test_steps_without_trainable_rows_are_skipped_and_the_loop_runs_to_its_end(tiny_model_dir):
    """The real trainer under the loop, without a publish (as replay runs it): every trajectory of
    every step failed before its first model call. Each step is skipped and counted, the version and
    the window still move on, the run ends."""
    from stages.update.losses import AlgorithmConfig
    from stages.update.trainer import TorchTrainer, TrainerConfig

    tr = TorchTrainer(tiny_model_dir, TrainerConfig(num_threads=1), AlgorithmConfig())
    failed = {"prompt_ids": [], "response_ids": [], "response_logprobs": [], "loss_mask": [], "token_versions": [],
              "reward": 0.0, "status": "failed"}
    run = FakeRun(steps=3)
    run.next_step = lambda v: pa.Table.from_pylist([failed | {"group_id": 2 * v + i % 2} for i in range(4)])
    lines = []
    loop = StepLoop(run, tr.train_step, lambda step, b, m: lines.append(m), 3)
    assert loop.run() == 3 and loop.version == 3 and tr.version == 3
    assert [e for e in run.events if e.startswith("window")] == ["window v1 [0, 1]", "window v2 [2, 3]",
                                                                  "window v3 [4, 5]"]
    assert [m["train/skipped_steps"] for m in lines] == [1, 2, 3]
