"""The step loop and its overlap policy, stepped on fake parts (no Ray): each part appends what
it does to one event log, and the tests read the order off it, as Ray Data's executor tests do."""
from __future__ import annotations

import threading
import time

import pyarrow as pa
import pytest

from pipeline.loop import Overlap, Prefetch, StepLoop, StepParts


def table(groups: list[int]) -> pa.Table:
    return pa.table({"group_id": pa.array([g for g in groups for _ in range(2)], pa.int64())})


class FakeRun:
    """A trainer whose updates finish when the loop asks for them, a sender that is free at once,
    and a batch stream that yields step tables (optionally only when allowed to)."""

    def __init__(self, steps: int, gate: bool = False, sender_free: bool = True):
        self.events: list[str] = []
        self.steps, self.sender_free = steps, sender_free
        self.allowed = threading.Semaphore(0) if gate else None      # None: every batch is there at once
        self.closed = threading.Event()

    def batches(self):
        try:
            for k in range(self.steps):
                if self.allowed is not None:
                    self.allowed.acquire()
                self.events.append(f"take {k}")
                yield table([2 * k, 2 * k + 1]), 0.0
        finally:
            self.closed.set()

    def submit(self, ref):
        g = ref.column("group_id")[0].as_py() // 2
        self.events.append(f"submit {g}")
        time.sleep(0.05)                 # an update takes time: the next batch arrives meanwhile
        return {"train/tokens": 1, "train/loss": 0.5}

    def publish_begin(self, version):
        self.events.append(f"send v{version}")
        return type("P", (), {"sender_free": self.sender_free, "version": version})()

    def publish_end(self, p):
        self.events.append(f"landed v{p.version}")
        return {"transfer/version": p.version}

    def parts(self, **kw) -> StepParts:
        return StepParts(batches=self.batches(), submit=self.submit, publish_begin=self.publish_begin,
                         publish_end=self.publish_end,
                         record=lambda step, b, m: self.events.append(f"record {step}"),
                         window_moved=lambda b, v: self.events.append(f"window v{v} {b.groups}"),
                         checkpoint=lambda untrained: self.events.append(f"checkpoint {sorted(untrained)}"), **kw)


def between(events: list[str], a: str, b: str) -> list[str]:
    """What the loop did between two events (the prefetch thread's takes left out)."""
    return [e for e in events[events.index(a) + 1:events.index(b)] if not e.startswith("take")]


def test_sync_loop_reads_as_the_algorithm_box():
    run = FakeRun(steps=3)
    loop = StepLoop(run.parts(), steps=3)
    assert loop.run() == 3 and loop.version == 3
    ev = [e for e in run.events if not e.startswith("take")]
    assert ev == ["submit 0", "send v1", "landed v1", "window v1 [0, 1]",
                  "submit 1", "record 1", "send v2", "landed v2", "window v2 [2, 3]",
                  "submit 2", "record 2", "send v3", "landed v3", "window v3 [4, 5]", "record 3"]
    assert run.closed.is_set()


def test_update_overlaps_rollout_and_bookkeeping():
    """The next batch is taken while the trainer works (prefetch), and the previous step's
    bookkeeping runs after the next update was submitted."""
    run = FakeRun(steps=3, gate=True)
    took_during_update = []

    def submit(ref):
        run.allowed.release()            # the stream may produce the next batch only now...
        time.sleep(0.2)                  # ...while this update runs
        took_during_update.append(sum(e.startswith("take") for e in run.events))
        return run.submit(ref)

    run.allowed.release()
    parts = run.parts()
    parts.submit = submit
    StepLoop(parts, steps=3).run()
    assert took_during_update == [2, 3, 3]      # step k's update saw batch k+1 taken already
    assert run.events.index("record 1") > run.events.index("submit 1")


def test_next_update_queued_behind_the_send_in_async_mode():
    run = FakeRun(steps=3)
    StepLoop(run.parts(), steps=3, queue_next=True).run()
    # the next update goes in between the send starting and the engines landing
    assert between(run.events, "send v1", "landed v1") == ["submit 1"]
    assert between(run.events, "send v2", "landed v2") == ["submit 2"]
    assert between(run.events, "send v3", "landed v3") == []           # the final step: nothing after it


def test_nothing_queued_when_the_sender_reads_after_send_or_in_sync_mode():
    for kw, free in (({"queue_next": True}, False), ({"queue_next": False}, True)):
        run = FakeRun(steps=3, sender_free=free)
        StepLoop(run.parts(), steps=3, **kw).run()
        assert between(run.events, "send v1", "landed v1") == []


def test_checkpoint_step_keeps_its_weights_and_names_untrained_groups():
    """At a checkpoint the next update is not queued (the weights must stay put until saved), and
    the batch already taken for the next step is reported untrained, so a resume runs it again."""
    run = FakeRun(steps=4)
    StepLoop(run.parts(), steps=4, queue_next=True, checkpoint_every=2).run()
    assert between(run.events, "send v2", "landed v2") == []
    after = between(run.events, "window v2 [2, 3]", "submit 2")
    # step 3's batch (and step 4's, when the thread took it already): taken, not trained
    assert after in (["checkpoint [4, 5]"], ["checkpoint [4, 5, 6, 7]"])
    assert between(run.events, "send v1", "landed v1") == ["submit 1"]  # other steps still queue


def test_final_step_then_bookkeeping_and_the_stream_closed():
    run = FakeRun(steps=10)
    loop = StepLoop(run.parts(), steps=2, queue_next=True)
    assert loop.run() == 2
    ev = [e for e in run.events if not e.startswith("take")]
    assert ev[-1] == "record 2" and "submit 2" not in ev
    assert run.closed.wait(5)


def test_stream_that_ends_early_ends_the_loop():
    run = FakeRun(steps=2)
    assert StepLoop(run.parts(), steps=5, queue_next=True).run() == 2


def test_stop_abandons_the_wait_but_finishes_a_queued_update():
    run = FakeRun(steps=5, gate=True)
    released = []
    def release():                       # as the gate's close does: the producer is no longer held
        released.append(1)
        for _ in range(10):
            run.allowed.release()

    loop = StepLoop(run.parts(release=release), steps=5)
    run.allowed.release()
    t = threading.Thread(target=loop.run)
    t.start()
    time.sleep(0.3)
    assert loop.last_step() == 1         # what the stop message names: the step already trained
    loop.stop.set()                      # the loop waits for batch 1, which never comes
    t.join(5)
    assert not t.is_alive() and loop.step == 1 and released == [1]
    assert [e for e in run.events if not e.startswith("take")][-1] == "record 1"

    run = FakeRun(steps=5)
    loop = StepLoop(run.parts(), steps=5, queue_next=True)
    parts_submit = run.submit

    def submit(ref):
        if "send v1" in run.events:
            loop.stop.set()              # stop arrives as update 2 is queued behind step 1's send
        return parts_submit(ref)

    loop.parts.submit = submit
    loop.overlap.parts.submit = submit
    loop.run()
    assert loop.step == 2 and "landed v2" in run.events    # the queued update was published, not dropped


def test_stop_during_an_update_names_that_step_as_the_last():
    run = FakeRun(steps=5)
    loop = StepLoop(run.parts(), steps=5)
    named = []

    def submit(ref):
        if not named:
            loop.stop.set()              # Ctrl-C while step 1 trains
            named.append(loop.last_step())
        return run.submit(ref)

    loop.parts.submit = loop.overlap.parts.submit = submit
    loop.run()
    assert named == [1] and loop.step == 1


def test_errors_in_the_stream_surface_in_the_loop():
    def broken():
        yield table([0, 1]), 0.0
        raise RuntimeError("rollout failed")

    run = FakeRun(steps=1)
    parts = run.parts()
    parts.batches = broken()
    with pytest.raises(RuntimeError, match="rollout failed"):
        StepLoop(parts, steps=3).run()


def test_prefetch_holds_at_most_one_table_and_tracks_untrained():
    taken = []

    def batches():
        for k in range(5):
            taken.append(k)
            yield table([k]), 0.0

    p = Prefetch(batches(), put=lambda t: t)
    time.sleep(0.3)
    assert taken == [0, 1] and p.untrained() == {0, 1}       # one in the queue, one waiting to go in
    p.get()
    p.trained()
    assert p.untrained() == {1} or p.untrained() == {1, 2}
    p.close()


def test_overlap_without_publish_is_a_plain_update_loop():
    run = FakeRun(steps=2)
    parts = run.parts()
    parts.publish_begin = parts.publish_end = None
    o = Overlap(parts, queue_next=True)
    o.start()
    b = o.next_batch()
    assert o.train(b)["train/loss"] == 0.5 and o.publish(1, may_queue_next=True) == {}
    o.close()


def test_steps_without_trainable_rows_are_skipped_and_the_loop_runs_to_its_end(tiny_model_dir):
    """The real trainer under the loop: every trajectory of every step failed before its first model
    call. Each step is skipped and counted, the version and the window still move on, the run ends."""
    from stages.update.losses import AlgorithmConfig
    from stages.update.trainer import TorchTrainer, TrainerConfig

    tr = TorchTrainer(tiny_model_dir, TrainerConfig(num_threads=1), AlgorithmConfig())
    failed = {"prompt_ids": [], "response_ids": [], "response_logprobs": [], "loss_mask": [], "token_versions": [],
              "reward": 0.0, "status": "failed"}
    tables = [pa.Table.from_pylist([failed | {"group_id": 2 * k + i % 2} for i in range(4)]) for k in range(3)]
    moved, lines = [], []
    parts = StepParts(batches=iter((t, 0.0) for t in tables), submit=tr.train_step,
                      record=lambda step, b, m: lines.append(m),
                      window_moved=lambda b, v: moved.append((b.groups, v)))
    loop = StepLoop(parts, steps=3)
    assert loop.run() == 3 and loop.version == 3 and tr.version == 3
    assert moved == [([0, 1], 1), ([2, 3], 2), ([4, 5], 3)]
    assert [m["train/skipped_steps"] for m in lines] == [1, 2, 3]
