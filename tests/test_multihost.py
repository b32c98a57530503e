"""The quickstart across two hosts that are network namespaces, then one host killed.

Hosts A and B are two network namespaces joined by a veth pair (10.231.0.1 and 10.231.0.2, no other
route: traffic stays between them and their loopbacks). A runs Ray's head and the driver (the real
CLI); B joins with `ray start --address`, as a second machine would, with the auth token Ray 2.60
wants on the head, every worker and the driver. Custom resources put one of the trainer and the
engine on B. After the first trained step every process of B is killed (the host is gone): the
terminal must name B and what ran there within 30 s (Ray's health checks find a killed host in
~15 s: docs/scale-out.md), and the run must stop resumable, with no traceback; with B back, `--resume`
must continue the data stream with nothing skipped or trained twice.

* the engine's host: the run waits run.node_wait_s for the engine to come back, then stops with a
  checkpoint of its last trained step;
* the trainer's host: its state went with it, so the run stops at once and names the newest
  intact checkpoint on disk (run.checkpoint_every=1 writes one after every step).

Needs root (`ip netns add`); skips saying why otherwise. Its own tier: `pytest -m multihost` (.ci/run).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.support.runs import assert_stream_resumed

pytestmark = pytest.mark.multihost

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
A_IP, B_IP, PORT = "10.231.0.1", "10.231.0.2", 6379
WAIT_S = 10             # run.node_wait_s
FAST = ["batcher.groups_per_step=2", "rollout.n_samples=4", "sampling.max_new_tokens=4", "eval.num_prompts=0",
        "trainer.mini_batch_size=0", "trainer.lr=0.001", "trackers.tensorboard=false",
        "reward.fn=stages.tasks.rewards:digit_match", f"run.node_wait_s={WAIT_S}",
        f"run.ray_address={A_IP}:{PORT}",
        "placement.mode=disaggregated", "placement.cpus=0.5", "placement.trainer_gpus=0", "placement.engine_gpus=0",
        "placement.timeout_s=120"]
ON_B = {"engine": ["placement.trainer_resources={node_a: 0.01}", "placement.engine_resources={node_b: 0.01}",
                   "run.checkpoint_every=0"],
        "trainer": ["placement.trainer_resources={node_b: 0.01}", "placement.engine_resources={node_a: 0.01}",
                    "run.checkpoint_every=1"]}


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


class Hosts:
    """Two namespaces, a veth pair between them, and the Ray nodes started in them."""

    def __init__(self, tag: str, env: dict, tmp: Path):
        self.a, self.b, self.env, self.tmp = f"lsA{tag}", f"lsB{tag}", env, tmp
        self.veth = (f"lsva{tag}", f"lsvb{tag}")
        self.made: list[str] = []

    def make(self) -> str:
        """Sets up the namespaces; returns why it could not ("" when it did)."""
        for ns in (self.a, self.b):
            r = _ip("netns", "add", ns)
            if r.returncode:
                return f"ip netns add failed: {r.stderr.strip()}"
            self.made.append(ns)
        steps = [("link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1]),
                 ("link", "set", self.veth[0], "netns", self.a), ("link", "set", self.veth[1], "netns", self.b)]
        for ns, dev, ip in ((self.a, self.veth[0], A_IP), (self.b, self.veth[1], B_IP)):
            steps += [("-n", ns, "addr", "add", f"{ip}/24", "dev", dev), ("-n", ns, "link", "set", dev, "up"),
                      ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            r = _ip(*step)
            if r.returncode:
                return f"ip {' '.join(step)} failed: {r.stderr.strip()}"
        return ""

    def run_in(self, ns: str, *cmd: str, **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=self.env, cwd=ROOT, text=True, **kw)

    def start_ray(self, ns: str, *args: str) -> None:
        temp = tempfile.mkdtemp(dir=self.tmp)        # short: Ray's socket paths must fit in 107 bytes
        proc = self.run_in(ns, RAY, "start", "--num-cpus=2", "--object-store-memory=200000000",
                           "--disable-usage-stats", f"--temp-dir={temp}", *args,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out[-3000:]

    def kill(self, ns: str) -> list[int]:
        """SIGKILL to every process in the namespace: the host is gone, nothing of it says goodbye."""
        pids = [int(p) for p in _ip("netns", "pids", ns).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def remove(self) -> None:
        for ns in self.made:
            self.kill(ns)
        time.sleep(0.5)
        for ns in self.made:
            _ip("netns", "del", ns)          # the veth pair goes with its ends
        _ip("link", "del", self.veth[0])     # unless it never left this namespace (a failed set-up)


@pytest.fixture
def hosts():
    if os.geteuid() != 0:
        pytest.skip("network-namespace hosts need root (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("network-namespace hosts need iproute2's `ip`")
    tmp = Path(tempfile.mkdtemp(prefix="lsnet"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               RAY_USAGE_STATS_ENABLED="0")
    h = Hosts(str(os.getpid() % 100000), env, tmp)
    try:
        why = h.make()
        if why:
            pytest.skip(f"network-namespace hosts unavailable: {why}")
        h.start_ray(h.a, "--head", f"--node-ip-address={A_IP}", f"--port={PORT}", "--include-dashboard=false",
                    '--resources={"node_a": 1}')
        h.start_ray(h.b, f"--address={A_IP}:{PORT}", f"--node-ip-address={B_IP}", '--resources={"node_b": 1}')
        yield h
    finally:
        h.remove()
        shutil.rmtree(tmp, ignore_errors=True)


class Terminal:
    """The CLI's output, line by line, each with the time it arrived."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            print(f"[{time.strftime('%X')}] {line}", end="")

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return rc

    def text(self) -> str:
        return "\n".join(m for _, m in self.lines)


def _cli(h: Hosts, *args: str) -> Terminal:
    return Terminal(h.run_in(h.a, sys.executable, "-m", "pipeline.cli", "run", "configs/quickstart.yaml", *args,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT))


def _trained_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum("train/loss" in json.loads(x) for x in path.read_text().splitlines() if x.strip())


def _kill_b_after_a_step(hosts: Hosts, args: list[str], run_dir: Path) -> tuple[Terminal, float, int]:
    """The run on both hosts until it trained a step, then every process of B killed; returns the
    terminal, when B was killed and the run's exit code."""
    term = _cli(hosts, *args, "run.steps=200", "--run-dir", str(run_dir))
    deadline = time.monotonic() + 400
    while _trained_steps(run_dir) < 1:
        assert term.proc.poll() is None, term.text()
        assert time.monotonic() < deadline, "no trained step in 400 s:\n" + term.text()
        time.sleep(0.2)
    topology = (run_dir / "topology.txt").read_text()
    assert "across nodes" in topology, topology          # the weights do cross between A and B
    killed_at = time.monotonic()
    assert hosts.kill(hosts.b)                           # B's raylet, what ran there, everything of it
    return term, killed_at, term.wait(timeout=WAIT_S + 180)


def _stopped_resumable(term: Terminal, killed_at: float, rc: int, lost: str, run_dir: Path) -> dict:
    """B and what ran there named within 30 s, exit 1 with no traceback, the resume command in the same
    run directory; returns the named checkpoint's controller.json."""
    said = [(t, m) for t, m in term.lines if "is lost" in m and B_IP in m and lost in m]
    assert said and said[0][0] - killed_at < 30, term.text()       # the node and what ran there, in 30 s
    assert rc == 1 and "Traceback" not in term.text(), term.text()
    resume = [m for _, m in term.lines if "resume with: loongsage run" in m and "--resume" in m]
    assert resume and f"--run-dir {run_dir} --resume" in resume[0], term.text()
    ckpt = Path(resume[0].split("; checkpoint ")[1].split(";")[0])
    state = json.loads((ckpt / "controller.json").read_text())
    assert state["step"] >= 1
    return state


def _b_back_and_resumed(hosts: Hosts, args: list[str], run_dir: Path, state: dict) -> None:
    """B is back (a fresh Ray node on it): the run resumes where it stopped, its actor placed on B again."""
    hosts.start_ray(hosts.b, f"--address={A_IP}:{PORT}", f"--node-ip-address={B_IP}", '--resources={"node_b": 1}')
    more = state["step"] + 2
    again = _cli(hosts, *args, f"run.steps={more}", "--run-dir", str(run_dir), "--resume")
    assert again.wait(timeout=600) == 0, again.text()
    assert f"done: {more} steps" in again.text(), again.text()
    assert_stream_resumed(run_dir, state, more)


def test_engine_host_killed_is_said_then_the_run_stops_resumable_and_resumes(hosts, tiny_model_dir, tmp_path):
    run_dir, args = tmp_path / "run", [*FAST, *ON_B["engine"], f"model.path={tiny_model_dir}"]
    term, killed_at, rc = _kill_b_after_a_step(hosts, args, run_dir)
    state = _stopped_resumable(term, killed_at, rc, "engine0", run_dir)
    _b_back_and_resumed(hosts, args, run_dir, state)


def test_trainer_host_killed_is_said_then_the_run_stops_at_its_newest_checkpoint_and_resumes(
        hosts, tiny_model_dir, tmp_path):
    run_dir, args = tmp_path / "run", [*FAST, *ON_B["trainer"], f"model.path={tiny_model_dir}"]
    term, killed_at, rc = _kill_b_after_a_step(hosts, args, run_dir)
    state = _stopped_resumable(term, killed_at, rc, "trainer", run_dir)
    # the trainer's state went with B: the checkpoint named is the newest intact one, written before
    newest = max((run_dir / "checkpoints").glob("step_*"))
    assert json.loads((newest / "controller.json").read_text()) == state
    _b_back_and_resumed(hosts, args, run_dir, state)
