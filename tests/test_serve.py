"""`loongsage serve`: a real server process, a real request through each of the four APIs, and the
recording it writes trained by `loongsage replay`."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.recorder import Recording

ROOT = Path(__file__).resolve().parents[1]


def _start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", "builtin:qwen-vocab-tiny",
                             "rollout.max_new_tokens=6", "rollout.temperature=0", "rollout.proxy_force_sampling=true",
                             "rollout.engine_threads=1",
                             "--record", str(tmp_path / "rec"), *extra], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"OPENAI_BASE_URL=(\S+) OPENAI_API_KEY=(\S+)", line)
        if m:
            return proc, m.group(1), m.group(2)
    raise AssertionError("serve exited before printing its endpoint:\n" + "".join(lines))


@pytest.fixture
def served(tmp_path):
    proc, base, key = _start(tmp_path, "--key", "sk-test-serve")
    try:
        yield proc, base, key, tmp_path / "rec"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.e2e
def test_serve_all_four_apis_rotate_record_and_replay(served):
    import anthropic
    import openai

    proc, base, key, rec = served
    assert base.startswith("http://127.0.0.1:") and base.endswith("/t/serve/v1") and key == "sk-test-serve"
    oa = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
    msgs = [{"role": "user", "content": "say hi"}]
    chat = oa.chat.completions.create(model="m", messages=msgs, max_tokens=4)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1
    comp = oa.completions.create(model="m", prompt="once upon a time", max_tokens=4)
    assert comp.usage.completion_tokens >= 1
    resp = oa.responses.create(model="m", input="say hi", max_output_tokens=50)
    assert resp.usage.output_tokens >= 1
    an = anthropic.Anthropic(base_url=base[: -len("/v1")], api_key=key, max_retries=0)
    msg = an.messages.create(model="m", max_tokens=5, messages=msgs)
    assert msg.usage.output_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()

    proc.send_signal(signal.SIGUSR1)            # the next trajectory, same URL and key
    for line in proc.stdout:
        if "trajectory recorded" in line:
            break
    again = oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "two"}], max_tokens=3)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "recorded 2 trajectories" in out

    log = [json.loads(x) for x in (rec / "requests.jsonl").read_text().splitlines()]
    assert [(x["path"], x["status"]) for x in log] == [
        ("/v1/chat/completions", 200), ("/v1/completions", 200), ("/v1/responses", 200), ("/v1/messages", 200),
        ("/v1/models", 401), ("/v1/chat/completions", 200)]
    recording = Recording.open(rec / "rollouts")
    assert recording.steps == [1, 2] and recording.n_samples == 1
    assert sum(recording.read_step(2).column("loss_mask").to_pylist()[0]) == again.usage.completion_tokens
    rows = recording.read([1]).to_pylist()
    assert sum(sum(r["loss_mask"]) for r in rows) == (chat.usage.completion_tokens + comp.usage.completion_tokens
                                                      + resp.usage.output_tokens + msg.usage.output_tokens)
    assert {r["segment"]["kind"] for r in rows} == {"main"}

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    rp = subprocess.run([sys.executable, "-m", "pipeline.cli", "replay", str(rec / "rollouts"), "run.steps=1",
                         "--run-dir", str(rec.parent / "replayed")], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
    assert rp.returncode == 0, rp.stdout + rp.stderr
    assert "replayed 1 steps" in rp.stdout
    assert (rec.parent / "replayed" / "checkpoints" / "step_000001" / "config.json").is_file()
