"""A rollout engine whose process dies (Ray's memory monitor, the OOM killer) is restarted by Ray; it
serves again only with the trainer's current weights, and callers meanwhile are told it restarts.

The faults are real: the engine actor's process is sent SIGKILL, found by its process title, which
Ray sets to `ray::HFEngine.__init__` while the constructor runs and `ray::HFEngine` after. Only
processes under this test's own process are looked at (other Ray instances may share the machine).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import anthropic
import openai
import pyarrow.parquet as pq
import pytest
import ray
import torch

from pipeline.config import load_config
from pipeline.controller import Controller
from stages.agentflow.client import EngineClient
from stages.agentflow.engine import HFEngine
from stages.agentflow.engine_contract import RESTART_WAIT_S
from stages.agentflow.proxy import Proxy
from stages.model import load_tokenizer
from tests.support.proxy import LoopThread
from tests.support.runs import served_weights

GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0}


def _ours_titled(title: str) -> list[int]:
    """Pids under this process whose title (argv[0]) is `title`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode() != title:
                continue
            p = int(pid)
            while p > 1 and p != os.getpid():
                p = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])   # the parent
        except (OSError, ValueError, IndexError):
            continue
        if p == os.getpid():
            found.append(int(pid))
    return found


class KillOnce(threading.Thread):
    """SIGKILL to the first process under this one titled `title`, as soon as it shows up."""

    def __init__(self, title: str, within_s: float = 120.0):
        super().__init__(daemon=True)
        self.title, self.within_s, self.killed = title, within_s, 0

    def run(self):
        deadline = time.monotonic() + self.within_s
        while not self.killed and time.monotonic() < deadline:
            for pid in _ours_titled(self.title):
                os.kill(pid, signal.SIGKILL)
                self.killed = pid
                break
            time.sleep(0.02)


@pytest.mark.e2e
def test_an_engine_killed_while_it_starts_is_sent_the_weights_and_serves_the_trainers_version(
        ray_session, tiny_model_dir, tmp_path):
    """Killed in its constructor, the engine comes back before the controller first asks its incarnation:
    the restart is only visible as an engine awaiting weights. It used to be never re-sent them, and
    every call waited 120 s for them and failed."""
    cfg = load_config("configs/quickstart.yaml", [
        f"model.path={tiny_model_dir}", "run.steps=3", "batcher.groups_per_step=2", "rollout.n_samples=4",
        "sampling.max_new_tokens=4", "eval.num_prompts=0", "engine.count=1", "trainer.mini_batch_size=0",
        "reward.fn=stages.tasks.rewards:digit_match", "trainer.lr=0.001"])
    killer = KillOnce("ray::HFEngine.__init__")
    logs: list[str] = []
    ctl = Controller(cfg, tmp_path / "run", log=logs.append)
    t0 = time.monotonic()
    killer.start()
    try:
        summary = ctl.run()
        took = time.monotonic() - t0
        assert killer.killed, "the engine's constructor was never seen running"
        info = ray.get(ctl.engines[0].info.remote())
        assert info["pid"] != killer.killed and not info["needs_sync"]
        assert ctl.faults.restarts == 1 and "engine0 restarted: re-sent weights version 0" in logs, logs
        # it serves the trainer's version, with the trainer's weights
        assert summary["version"] == 3 and ray.get(ctl.engines[0].weight_version.remote()) == 3
        trained = ray.get(ctl.trainer.state_dict.remote())
        served = ray.get(served_weights(ctl.engines[0]))
        assert all(torch.equal(trained[n], served[n]) for n in trained)
    finally:
        ctl.stop()
    for k in (1, 2, 3):
        rows = pq.read_table(tmp_path / "run" / "rollouts" / f"step={k:06d}").to_pylist()
        assert all(r["status"] != "failed" for r in rows), [r["error"] for r in rows if r["status"] == "failed"]
        assert all(v == k - 1 for r in rows for v in r["token_versions"])
    assert took < 100, took           # nothing waited out a restarted engine's old 120 s


@pytest.mark.e2e
def test_a_proxy_call_while_its_engine_restarts_is_503_or_529_at_once(ray_session, tiny_model_dir):
    """While Ray restarts the process, and then while it awaits the current weights, a black-box caller
    is told the engine is restarting (OpenAI: 503; Anthropic: 529 overloaded_error, which harnesses
    retry), not left waiting for a generic 500; with the weights landed it is served again."""
    eng = ray.remote(HFEngine).options(num_cpus=0.1, max_concurrency=16, max_restarts=1).remote(tiny_model_dir)
    first = ray.get(eng.info.remote())
    tok = load_tokenizer(tiny_model_dir)
    loop = LoopThread()
    proxy = Proxy(tok)
    loop.run(proxy.start())
    ep = loop.run(proxy.open(EngineClient(eng), dict(GREEDY)))
    chat = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0, timeout=60)
    ant = anthropic.Anthropic(base_url=ep.base_url.removesuffix("/v1"), api_key=ep.api_key, max_retries=0,
                              timeout=60)
    user = [{"role": "user", "content": "37+48="}]

    def chat_call():
        return chat.chat.completions.create(model="m", messages=user, max_tokens=2)

    def refused(call, error) -> tuple[int, str, float]:
        """(HTTP status, error type, seconds) of a call that must fail."""
        t = time.monotonic()
        with pytest.raises(error) as e:
            call()
        body = e.value.body
        return e.value.status_code, body.get("type") if "error" not in body else body["error"]["type"], \
            time.monotonic() - t

    def messages():
        return refused(lambda: ant.messages.create(model="m", max_tokens=2, messages=user), anthropic.APIStatusError)

    try:
        assert chat_call().choices[0].message.content is not None
        os.kill(first["pid"], signal.SIGKILL)
        # the process is being restarted
        code, kind, took = refused(chat_call, openai.APIStatusError)
        assert (code, kind) == (503, "server_error") and took < 5.0, (code, kind, took)
        code, kind, took = messages()
        assert (code, kind) == (529, "overloaded_error") and took < 5.0, (code, kind, took)
        # back, with the initial weights: it waits a little for the current ones, then says it restarts
        deadline = time.monotonic() + 120
        while True:
            try:
                info = ray.get(eng.info.remote(), timeout=10)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                assert time.monotonic() < deadline, "the engine was not restarted"
                time.sleep(0.2)
        assert info["incarnation"] != first["incarnation"] and info["needs_sync"]
        code, kind, took = messages()
        assert (code, kind) == (529, "overloaded_error") and took < RESTART_WAIT_S + 5, (code, kind, took)
        # the weights landed (what the controller's engine watch does): served again
        ray.get(eng.load_weights.remote({}, 0))
        assert chat_call().choices[0].message.content is not None
    finally:
        proxy.close(ep)
        loop.run(proxy.stop())
        loop.stop()
        ray.kill(eng)
