"""End to end on local Ray: a few synchronous steps through the real pipeline."""
import json
import os
import signal

import pyarrow.parquet as pq
import pytest
import ray
import torch

from pipeline.config import ConfigError, load_config
from pipeline.controller import Controller
from pipeline.metrics import read_metrics
from tests.support.runs import FAST, served_weights


def test_three_steps_end_to_end(ray_session, tiny_model_dir, tmp_path):
    cfg = load_config("configs/quickstart.yaml", FAST + [f"model.path={tiny_model_dir}", "trainer.lr_schedule=linear"])
    ctl = Controller(cfg, tmp_path / "run", log=lambda *_: None)
    try:
        summary = ctl.run()
        assert summary["steps"] == 3 and summary["version"] == 3
        # every engine serves the trainer's last version, with the trainer's exact weights
        assert ray.get([e.weight_version.remote() for e in ctl.engines]) == [3, 3]
        trained = ray.get(ctl.trainer.state_dict.remote())
        served = ray.get(served_weights(ctl.engines[1]))
        assert all(torch.equal(trained[n], served[n]) for n in trained)
        initial = ray.get(ray.remote(lambda p: __import__("stages.model", fromlist=["x"]).load_model(p).state_dict())
                          .remote(tiny_model_dir))
        assert any(not torch.equal(initial[n], trained[n]) for n in trained)
    finally:
        ctl.stop()
    run = tmp_path / "run"
    lines = read_metrics(run)
    assert all("step" in m and "time_s" in m for m in lines)
    steps = [m for m in lines if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    # no fault injected: no engine restarted, and each step published its own version once
    assert ctl.faults.restarts == 0 and [m["engine_restarts"] for m in steps] == [0, 0, 0]
    assert [m["transfer/version"] for m in steps] == [1, 2, 3]
    assert all(m["train/loss"] is not None and abs(m["train/loss"]) < 1e3 for m in steps)
    # a linear schedule with no decay length given decays over the run's steps
    assert [m["train/lr"] for m in steps] == pytest.approx([cfg.trainer.lr * f for f in (1, 2 / 3, 1 / 3)])
    evals = [m for m in lines if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 2, 3] and all(0 <= m["eval/accuracy"] <= 1 for m in evals)
    # every trained row records the version that produced each of its tokens: step k trains version k-1
    from pipeline.planner.spans import load_spans

    spans = load_spans(run)
    eval0 = spans[(spans["stage"] == "eval") & (spans["step"] == 0)]["end"].item()
    first = pq.read_table(run / "rollouts" / "step=000001").column("t_dispatch").to_pylist()
    assert min(first) >= eval0            # nothing was generated before the step-0 evaluation had finished
    for k in (1, 2, 3):
        rows = pq.read_table(run / "rollouts" / f"step={k:06d}").to_pylist()
        assert len(rows) == 16 and len({r["group_id"] for r in rows}) == 4
        for r in rows:
            assert r["token_versions"] and set(r["token_versions"]) == {k - 1}
            assert r["version_start"] == r["version_end"] == k - 1
    assert (run / "config.yaml").is_file() and (run / "topology.txt").is_file()
    assert (run / "checkpoints" / "step_000003" / "model.safetensors").is_file()
    assert (run / "checkpoints" / "step_000003" / "tokenizer.json").is_file()


@pytest.mark.e2e
def test_a_run_whose_every_trajectory_fails_skips_every_step_and_goes_on_to_its_end(ray_session, tiny_model_dir,
                                                                                    tmp_path):
    """`cmd:false` exits before its first model call: no row has a token. Each step is skipped and
    counted (never a crash in the trainer), the version and the window still move on, the run ends."""
    cfg = load_config("configs/agent_blackbox.yaml", [
        f"model.path={tiny_model_dir}", "agent.name=cmd:false", "run.steps=3", "batcher.groups_per_step=2",
        "rollout.n_samples=2", "trainer.mini_batch_size=0", "eval.every=0", "eval.num_prompts=0"])
    ctl = Controller(cfg, tmp_path / "run", log=lambda *_: None)
    try:
        summary = ctl.run()
        assert summary["steps"] == 3 and summary["version"] == 3
        assert ray.get([e.weight_version.remote() for e in ctl.engines]) == [3]
    finally:
        ctl.stop()
    steps = [m for m in read_metrics(tmp_path / "run") if "train/samples" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert [m["train/skipped_steps"] for m in steps] == [1, 2, 3]
    assert all(m["rollout/failed"] == 4 and m["train/tokens"] == 0 and "train/loss" not in m for m in steps)


def test_an_engine_landing_weights_in_place_is_not_taken_for_a_restarted_one(tiny_model_dir):
    """The engine watch asked needs_sync() while an ordinary version landed in place, saw the serving
    flag cleared and counted a restart that never happened (issue 17.1). A restart is a new process."""
    import threading

    from stages.agentflow.engine import HFEngine

    eng = HFEngine(tiny_model_dir)
    landing, done = threading.Event(), threading.Event()

    def land():
        with eng.weights_in_place(1):
            landing.set()
            done.wait(5)

    t = threading.Thread(target=land)
    t.start()
    try:
        assert landing.wait(5)
        assert not eng.needs_sync()                 # mid-landing: not a restarted engine
        incarnation = eng.info()["incarnation"]
    finally:
        done.set()
        t.join()
    assert eng.info()["incarnation"] == incarnation and eng.weight_version() == 1
    assert HFEngine(tiny_model_dir).info()["incarnation"] != incarnation     # a new process would differ



@pytest.mark.e2e
def test_cli_run_and_unknown_key(ray_session, tiny_model_dir, tmp_path, capsys):
    from pipeline.cli import main

    assert main(["run", "configs/quickstart.yaml", "rollout.n_sample=3"]) == 2
    assert "valid keys of rollout" in capsys.readouterr().err
    rc = main(["run", "configs/quickstart.yaml", *FAST, "run.steps=1", "engine.count=1",
               f"model.path={tiny_model_dir}", "--run-dir", str(tmp_path / "cli")])
    assert rc == 0
    assert "eval/accuracy:" in capsys.readouterr().out
    assert json.loads((tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 1


@pytest.mark.parametrize("override,match", [
    ("model.path={nodir}", "is not a directory"),
    ("model.path={notok}", "has no tokenizer"),
    ("reward.fn=nope.mod:fn", "does not import"),
    ("trainer.mini_batch_size=3", "does not divide"),
    ("data.path={empty}", "dataset is empty"),
])
def test_bad_input_fails_at_start(tmp_path, tiny_model_dir, override, match):
    import shutil

    import pyarrow as pa

    notok = tmp_path / "notok"
    shutil.copytree(tiny_model_dir, notok)
    for f in notok.glob("tokenizer*"):
        f.unlink()
    (notok / "special_tokens_map.json").unlink(missing_ok=True)
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    o = override.format(nodir=tmp_path / "missing", notok=notok, empty=tmp_path / "empty.parquet")
    extra = [] if o.startswith("model.path") else [f"model.path={tiny_model_dir}"]
    with pytest.raises((ValueError, ConfigError), match=match):
        Controller(load_config("configs/quickstart.yaml", FAST + extra + [o]), tmp_path / "r", log=lambda *_: None)


@pytest.mark.e2e
def test_async_run_keeps_staleness_bound_and_trains_each_group_once(ray_session, tiny_model_dir, tmp_path):
    cfg = load_config("configs/quickstart_async.yaml", FAST + [
        f"model.path={tiny_model_dir}", "run.steps=4", "eval.num_prompts=0", "engine.count=1",
        "rollout.groups_per_batch=1", "rollout.partial_mask_old=true"])
    ctl = Controller(cfg, tmp_path / "async", log=lambda *_: None)
    try:
        assert ctl.run()["version"] == 4
    finally:
        ctl.stop()
    from ray.data._internal.execution import streaming_executor_state

    assert type(streaming_executor_state.ray).__name__ == "_WakeOnOutput"       # the executor wakes on output
    lines = [m for m in read_metrics(tmp_path / "async") if "train/loss" in m]
    assert all(m["staleness/max"] <= 1 for m in lines)
    assert all(m["pipeline_buf_size"] <= 8 for m in lines)          # C = B * (1 + stale_steps)
    seen = []
    for k in range(1, 5):
        rows = pq.read_table(tmp_path / "async" / "rollouts" / f"step={k:06d}").to_pylist()
        seen += sorted({r["group_id"] for r in rows})
        for r in rows:   # tokens of an older version than the row's newest carry no loss
            assert all(m == 0 for v, m in zip(r["token_versions"], r["loss_mask"]) if v != r["version_end"])
            assert all(k - 1 - v <= 1 for v in r["token_versions"])
    assert len(seen) == len(set(seen)) == 16


def _trained_prompts(run_dir, steps):
    return [pq.read_table(run_dir / "rollouts" / f"step={k:06d}").column("prompt_id").to_pylist()
            for k in steps]


@pytest.mark.e2e
def test_resume_continues_the_data_stream_without_loss(ray_session, tiny_model_dir, tmp_path):
    base = FAST + [f"model.path={tiny_model_dir}", "eval.num_prompts=0", "engine.count=1",
                   "batcher.groups_per_step=2", "data.train_size=5",   # 5 prompts: the stream crosses epochs
                   "trainer.lr_schedule=cosine", "trainer.lr_decay_steps=4", "trainer.lr_min_ratio=0.5"]
    full = Controller(load_config("configs/quickstart.yaml", base + ["run.steps=4"]), tmp_path / "full",
                      log=lambda *_: None)
    try:
        full.run()
    finally:
        full.stop()
    # Ctrl-C during step 2 (step 1's bookkeeping runs during step 2's update): step 2 finishes,
    # then a resumable checkpoint; the batch already taken for step 3 is not counted as trained
    logs = []

    def mine(*_):       # a caller's own handler (a notebook kernel's, an application's)
        pass

    before = signal.signal(signal.SIGINT, mine)
    first = Controller(load_config("configs/quickstart.yaml", base + ["run.steps=4"]), tmp_path / "a",
                       log=logs.append, on_step=lambda m: m["step"] == 1 and os.kill(os.getpid(), signal.SIGINT))
    try:
        stopped = first.run()
        assert signal.getsignal(signal.SIGINT) is mine        # the caller's handler is put back
    finally:
        first.stop()
        signal.signal(signal.SIGINT, before)
    ckpt = tmp_path / "a" / "checkpoints" / "step_000002"
    assert stopped["interrupted"] == "SIGINT" and stopped["steps"] == 2 and stopped["resume_from"] == str(ckpt)
    assert any("SIGINT" in x and "checkpoint" in x for x in logs), logs
    second = Controller(load_config("configs/quickstart.yaml", base + ["run.steps=4", f"run.resume_from={ckpt}"]),
                        tmp_path / "b", log=lambda *_: None)
    try:
        summary = second.run()
        assert summary["version"] == 4
        assert ray.get(second.engines[0].weight_version.remote()) == 4
    finally:
        second.stop()
    # same prompts, same order, none skipped or repeated across the stop
    assert _trained_prompts(tmp_path / "a", [1, 2]) + _trained_prompts(tmp_path / "b", [3, 4]) == \
        _trained_prompts(tmp_path / "full", [1, 2, 3, 4])
    resumed = [m for m in read_metrics(tmp_path / "b") if "train/loss" in m]
    assert [m["step"] for m in resumed] == [3, 4]
    # synchronous mode, per-sample sampling seeds, restored optimizer and RNGs: the same losses
    uninterrupted = [m for m in read_metrics(tmp_path / "full") if "train/loss" in m][2:]
    for a, b in zip(resumed, uninterrupted):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-3, abs=1e-5)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-3)
        assert a["train/lr"] == b["train/lr"]            # the lr schedule continues where it stopped
    assert resumed[0]["train/lr"] > resumed[1]["train/lr"]      # still decaying: decay ends at step 4


def test_resume_from_a_non_checkpoint_fails(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match="not a resumable checkpoint"):
        Controller(load_config("configs/quickstart.yaml", FAST + [f"model.path={tiny_model_dir}",
                                                                   f"run.resume_from={tiny_model_dir}"]),
                   tmp_path / "r", log=lambda *_: None)


# ~26 s; the default tier covers the teacher scoring stage as a Ray Data actor pool (test_teacher.py)
@pytest.mark.slow
def test_opd_recipe_scores_with_the_routed_teacher_and_trains_on_the_signal(ray_session, tmp_path):
    """configs/opd_multi_teacher.yaml as shipped, on tiny teachers: the teacher stage sits in the
    stream, each row is scored by its data source's teacher, the trainer logs the reverse KL."""
    from stages.tasks.make_teacher import make_teacher, write_prompts

    small = dict(steps=2, hidden_size=32, num_layers=1, eval_n=2, log=lambda *_: None)
    for name, task in (("teacher-addition", "addition"), ("teacher-multiplication", "multiplication"),
                       ("student", "addition,multiplication")):
        make_teacher(task, tmp_path / name, **small)
    write_prompts(["addition", "multiplication"], tmp_path / "data", train_size=40, test_size=8)
    cfg = load_config("configs/opd_multi_teacher.yaml", [
        "run.steps=2", "batcher.groups_per_step=4", "rollout.n_samples=2", "sampling.max_new_tokens=4",
        "eval.num_prompts=4", "eval.every=0", f"model.path={tmp_path / 'student'}",
        f"data.path={tmp_path / 'data' / 'train.jsonl'}", f"data.test_path={tmp_path / 'data' / 'test.jsonl'}",
        f"teacher.teachers.addition={tmp_path / 'teacher-addition'}",
        f"teacher.teachers.multiplication={tmp_path / 'teacher-multiplication'}"])
    ctl = Controller(cfg, tmp_path / "run", log=lambda *_: None)
    try:
        assert ctl.run()["version"] == 2
    finally:
        ctl.stop()
    lines = [m for m in read_metrics(tmp_path / "run") if "train/loss" in m]
    assert len(lines) == 2
    for m in lines:
        assert m["distill/rows_with_teacher"] == 8 and m["teacher/scored"] == 8 and m["teacher/failed"] == 0
        assert m["distill/reverse_kl/addition"] == m["distill/reverse_kl/addition"]    # logged per source, not nan
        assert "distill/reverse_kl/multiplication" in m
    assert lines[0]["teacher/swaps"] >= 1            # max_resident 1 with two teachers: they take turns
    rows = pq.read_table(tmp_path / "run" / "rollouts" / "step=000001").to_pylist()
    assert {r["teacher_id"] for r in rows} <= {"addition", "multiplication"}
    assert all(r["teacher_id"] == r["data_source"] for r in rows)
    assert all(len(r["teacher_logprobs"]) == len(r["response_ids"]) for r in rows)


def test_opd_recipe_without_teachers_fails_at_start(tmp_path):
    with pytest.raises(ValueError, match="teacher.routes.addition names teacher 'addition'"):
        load_config("configs/opd_multi_teacher.yaml", ["teacher.teachers={}"])
    cfg = load_config("configs/quickstart.yaml", ["algorithm.distill_coef=1.0"])
    with pytest.raises(ValueError, match="needs teachers"):
        Controller(cfg, tmp_path / "r", log=lambda *_: None)


# ~34 s; the default tier covers the Megatron trainer step against the torch trainer (test_megatron.py)
@pytest.mark.slow
def test_megatron_recipe_trains_through_the_same_pipeline(ray_session, tiny_model_dir, tmp_path):
    """configs/megatron_cpu_tiny.yaml: two tensor-parallel Megatron ranks replace the torch
    trainer; the leader gathers HF weights and the engines serve exactly them."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)")
    cfg = load_config("configs/megatron_cpu_tiny.yaml", FAST + [
        f"model.path={tiny_model_dir}", "run.steps=2", "eval.num_prompts=0", "engine.count=1"])
    ctl = Controller(cfg, tmp_path / "run", log=lambda *_: None)
    try:
        assert ctl.run()["version"] == 2
        assert ray.get(ctl.engines[0].weight_version.remote()) == 2
        trained = ray.get(ctl.trainer.state_dict.remote())
        served = ray.get(served_weights(ctl.engines[0]))
        assert set(trained) == set(served) and all(torch.equal(trained[n], served[n]) for n in trained)
        ranks = ray.get(ctl.trainer.info.remote())
    finally:
        ctl.stop()
    assert ranks["ranks"] == 2
    lines = [m for m in read_metrics(tmp_path / "run") if "train/loss" in m]
    assert len(lines) == 2 and all(m["train/loss"] == m["train/loss"] for m in lines)


@pytest.mark.e2e
def test_an_engine_killed_mid_run_is_restarted_and_its_groups_rerun(ray_session, tiny_model_dir, tmp_path):
    """ray.kill one of two engines after step 1: Ray restarts it, the controller re-sends the
    current weights, the trajectories it was generating run again; no group lost or doubled."""
    cfg = load_config("configs/quickstart.yaml", FAST + [
        f"model.path={tiny_model_dir}", "run.steps=4", "eval.num_prompts=0", "engine.count=2"])
    killed = []

    def kill_after_first(line):
        if line.get("step") == 1 and not killed:
            killed.append(ctl.engines[1])
            ray.kill(ctl.engines[1], no_restart=False)

    logs = []
    ctl = Controller(cfg, tmp_path / "run", on_step=kill_after_first, log=logs.append)
    try:
        assert ctl.run()["version"] == 4
        assert ctl.faults.restarts >= 1 and any("engine1 restarted" in str(x) for x in logs), logs
        assert ray.get([e.weight_version.remote() for e in ctl.engines]) == [4, 4]
        trained = ray.get(ctl.trainer.state_dict.remote())
        served = ray.get(served_weights(ctl.engines[1]))
        assert all(torch.equal(trained[n], served[n]) for n in trained)
    finally:
        ctl.stop()
    seen = []
    for k in range(1, 5):
        rows = pq.read_table(tmp_path / "run" / "rollouts" / f"step={k:06d}").to_pylist()
        seen += sorted({r["group_id"] for r in rows})
        assert all(r["status"] != "failed" for r in rows), [r["error"] for r in rows if r["status"] == "failed"]
        assert all(v == k - 1 for r in rows for v in r["token_versions"])   # synchronous: all on-policy
    assert seen == list(range(16))


def test_the_executor_wakes_on_the_first_output_and_never_spins_on_one_left_unread(ray_session):
    import time

    from ray.data._internal.execution import streaming_executor_state as state

    from pipeline.builder import set_stream_poll

    @ray_session.remote(num_cpus=0)
    def nap(s):
        time.sleep(s)
        return s

    try:
        assert set_stream_poll("event", 1.0)
        wait = state.ray.wait         # what Ray Data's executor calls, with its own arguments
        ray_session.get([nap.remote(0.01), nap.remote(0.01)])    # two warm workers
        t = time.monotonic()
        quick, slow = nap.remote(0.3), nap.remote(30)
        calls, ready = 0, []
        while not ready and calls < 20:     # each call returns within MAX_SLEEP_S (0.1 s)
            ready, rest = wait([quick, slow], num_returns=2, fetch_local=False, timeout=1.0)
            calls += 1
        # woken by the first task's output, not at the end of the poll period (1 s)
        assert ready == [quick] and rest == [slow] and 0.25 < time.monotonic() - t < 0.45 and calls <= 5
        t = time.monotonic()
        ready, _ = wait([quick, slow], num_returns=2, fetch_local=False, timeout=1.0)
        # the executor left `quick` unread: this loop polls (1 s) instead of returning at once
        assert ready == [quick] and 0.9 < time.monotonic() - t < 1.6
        t = time.monotonic()
        assert wait([slow], num_returns=1, fetch_local=False, timeout=5)[0] == []
        assert time.monotonic() - t < 0.5     # nothing ready: back within MAX_SLEEP_S, as Ray's loop would be
        assert not set_stream_poll("ray") and state.ray is ray_session     # the real module again
        assert state.WAIT_FOR_TASK_COMPLETION_TIMEOUT_S == 0.1
    finally:
        set_stream_poll("event")
