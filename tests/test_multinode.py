"""The quickstart on a real two-node Ray cluster, joined through run.ray_address.

Two raylets on this machine (ray.cluster_utils.Cluster), each carrying its own custom
resource; placement.trainer_resources / engine_resources pin the trainer to one node and
the engine to the other. The weights then cross nodes every step (gloo, or ZMQ/TCP), and
the engine must serve exactly what the trainer trained after each one.
"""
from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from ray.cluster_utils import Cluster
from safetensors.torch import load_file

from pipeline.config import load_config
from pipeline.controller import Controller
from tests.support.runs import assert_stream_resumed, served_weights

OWN_RAY = True      # a two-node Ray cluster of its own: it starts without the shared Ray

STEPS = 3
FAST = [f"run.steps={STEPS}", "batcher.groups_per_step=2", "rollout.n_samples=4", "sampling.max_new_tokens=4",
        "eval.num_prompts=0", "trainer.mini_batch_size=0", "trainer.lr=0.001", "trackers.tensorboard=false",
        "reward.fn=stages.tasks.rewards:digit_match",     # partial credit: a step with equal rewards has no update
        "run.checkpoint_every=1"]                         # the trainer's weights of every version, on disk
ACROSS = ["placement.mode=disaggregated", "placement.cpus=0.5", "placement.trainer_gpus=0",
          "placement.engine_gpus=0", "placement.timeout_s=60",
          "placement.trainer_resources={node_a: 0.01}", "placement.engine_resources={node_b: 0.01}"]


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1},
                                                      "include_dashboard": False})
    c.add_node(num_cpus=2, resources={"node_b": 1})
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


# ~40 s; the default tier covers multi-raylet placement (test_megatron_placement.py) and the cross-node gloo
# route (test_transfer.py)
@pytest.mark.slow
def test_quickstart_trains_on_one_node_and_serves_from_another(cluster, tiny_model_dir, tmp_path):
    cfg = load_config("configs/quickstart.yaml", FAST + ACROSS + [f"model.path={tiny_model_dir}",
                                                                 f"run.ray_address={cluster.address}"])
    served: dict[int, dict] = {}

    def on_step(line: dict) -> None:
        """After a step: the version the engine serves, and its weights (read between two
        version reads, so no update lands in between)."""
        if "train/loss" not in line:
            return
        engine = ctl.engines[0]
        before = ray.get(engine.weight_version.remote())
        state = ray.get(served_weights(engine))
        if ray.get(engine.weight_version.remote()) == before:
            served[before] = state

    run_dir = tmp_path / "run"
    ctl = Controller(cfg, run_dir, on_step=on_step, log=lambda *_: None)
    try:
        assert ctl.run()["version"] == STEPS
        trainer_node = ctl.mesh.sender_party.node_id
        engine_node = ctl.mesh.parties["engine0"].node_id
        trained = ray.get(ctl.trainer.state_dict.remote())
        final = ray.get(served_weights(ctl.engines[0]))
    finally:
        ctl.stop()

    (worker,) = cluster.worker_nodes
    assert (trainer_node, engine_node) == (cluster.head_node.node_id, worker.node_id)   # node_a, node_b
    route = re.search(r"^engine0: (\w+) \((.*)\)$", (run_dir / "topology.txt").read_text(), re.M)
    assert route and route[1] in ("gloo", "zmq") and "across nodes" in route[2], route

    assert sorted(served) == list(range(1, STEPS + 1)), sorted(served)     # every version was seen served
    for version, state in served.items():
        ckpt = load_file(str(run_dir / "checkpoints" / f"step_{version:06d}" / "model.safetensors"))
        assert ckpt and ckpt.keys() <= state.keys()         # (a tied lm_head is saved once, as the embedding)
        assert all(torch.equal(ckpt[n], state[n]) for n in ckpt), f"version {version}: engine != trainer"
    assert trained.keys() == final.keys() and all(torch.equal(trained[n], final[n]) for n in trained)
    first = load_file(str(run_dir / "checkpoints" / "step_000001" / "model.safetensors"))
    assert any(not torch.equal(first[n], trained[n]) for n in first)     # the weights did move


# ~60 s: node B (the engine's) is removed from the cluster mid-run
@pytest.mark.slow
def test_losing_the_engine_node_is_said_then_the_run_stops_resumable(cluster, tiny_model_dir, tmp_path):
    wait_s = 10
    over = FAST + ACROSS + [f"model.path={tiny_model_dir}", f"run.ray_address={cluster.address}",
                            "run.checkpoint_every=0", f"run.node_wait_s={wait_s}"]
    lines: list[tuple[float, str]] = []
    removed: list[float] = []
    (worker,) = cluster.worker_nodes

    def remove_b(line: dict) -> None:
        if line.get("train/loss") is not None and not removed:
            removed.append(time.monotonic())
            threading.Thread(target=cluster.remove_node, args=(worker,), daemon=True).start()

    run_dir = tmp_path / "run"
    ctl = Controller(load_config("configs/quickstart.yaml", over + ["run.steps=200"]), run_dir, on_step=remove_b,
                     log=lambda m: lines.append((time.monotonic(), m)) or print(f"[{time.strftime('%X')}] {m}"))
    try:
        stopped = ctl.run()
        t_end = time.monotonic()
    finally:
        ctl.stop()
    said = [(t, m) for t, m in lines if worker.node_id[:12] in m and "engine0" in m and "lost" in m]
    assert said and said[0][0] - removed[0] < 30, lines
    assert stopped["interrupted"] == "NODE_LOST" and worker.node_id[:12] in stopped["lost"], stopped
    assert t_end - removed[0] < wait_s + 30, (t_end - removed[0], lines)
    ckpt = Path(stopped["resume_from"])
    state = json.loads((ckpt / "controller.json").read_text())
    assert state["step"] == stopped["steps"] >= 1

    cluster.add_node(num_cpus=2, resources={"node_b": 1})      # capacity back: the resume places engine0 there
    cluster.wait_for_nodes()
    more = state["step"] + 2
    resumed = Controller(load_config("configs/quickstart.yaml", over + [f"run.steps={more}",
                                                                      f"run.resume_from={ckpt}"]),
                         run_dir, log=lambda *_: None)
    try:
        assert resumed.run()["steps"] == more
    finally:
        resumed.stop()
    assert_stream_resumed(run_dir, state, more)


def test_custom_resources_ride_in_each_bundle_and_bad_ones_fail_at_load():
    from pipeline.config import ConfigError
    from pipeline.placement import PlacementConfig, plan_pools

    trainer, rollout = plan_pools(PlacementConfig(mode="disaggregated", trainer_resources={"node_a": 0.01},
                                                  engine_resources={"node_b": 0.5}), 2, 2, 1)
    assert trainer.resources == {"node_a": 0.01} and rollout.resources == {"node_b": 0.5}
    for bad in ("{GPU: 1}", "{node_a: 0}", "{node_a: many}"):
        with pytest.raises(ConfigError, match="placement.trainer_resources"):
            load_config(None, [f"placement.trainer_resources={bad}"])
