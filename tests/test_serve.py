"""`loongsage serve`: a real server process, a real request through each of the four APIs, and the
recording it writes trained by `loongsage replay`; its key never on the command line, its recording
owner-only and never into a directory that holds a run or a live serve."""
from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.recorder import Recording

ROOT = Path(__file__).resolve().parents[1]


def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """A serve that is refused before it starts anything: its exit code and output."""
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "serve", "builtin:qwen-vocab-tiny", *args], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})), capture_output=True, text=True,
                          timeout=120)


def test_serve_refuses_a_key_on_the_command_line_or_in_a_file_others_can_read(tmp_path):
    r = _serve("--key", "sk-seen-in-proc-cmdline", "--record", str(tmp_path / "rec"))
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: --key puts the key on the command line, where any local user reads it (/proc/PID/cmdline); "
        "set LOONGSAGE_SERVE_KEY or pass --key-file FILE (mode 600)"]
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-a-file\n")
    key_file.chmod(0o640)
    r = _serve("--key-file", str(key_file), "--record", str(tmp_path / "rec"))
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"error: --key-file {key_file} is open to group or others (mode 640); chmod 600 it"]
    assert not (tmp_path / "rec").exists()          # refused before anything was written


def test_serve_refuses_a_directory_holding_a_run_or_a_live_serve(tmp_path):
    run = tmp_path / "run"                            # a finished run: serve used to overwrite these two files
    (run / "rollouts" / "step=000001").mkdir(parents=True)
    (run / "config.yaml").write_text("run: {steps: 3}\n")
    (run / "rollouts" / "step=000001" / "part-0.parquet").write_bytes(b"PAR1 the run's step 1 PAR1")
    r = _serve("--record", str(run))
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"error: --record {run} holds a run or recording (config.yaml, rollouts); choose another directory"]
    assert (run / "config.yaml").read_text() == "run: {steps: 3}\n"
    assert (run / "rollouts" / "step=000001" / "part-0.parquet").read_bytes() == b"PAR1 the run's step 1 PAR1"
    live = tmp_path / "live"                          # held by a live process (a run, or another serve)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pipeline.rundir import locked\n"
                               "with locked(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)", str(live)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        r = _serve("--record", str(live))
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1
        assert f"run directory {live} is in use by pid {holder.pid} on host" in r.stderr
    finally:
        holder.kill()
        holder.wait()


def _owner_only(root: Path) -> dict[str, str]:
    """Every path under root whose mode is not 0700 (directories) or 0600 (files), with its mode."""
    return {str(p.relative_to(root)): oct(p.stat().st_mode & 0o777) for p in [root, *root.rglob("*")]
            if p.stat().st_mode & 0o777 != (0o700 if stat.S_ISDIR(p.stat().st_mode) else 0o600)}


def _start(tmp_path: Path, *extra: str, env: dict | None = None) -> tuple[subprocess.Popen, str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", "builtin:qwen-vocab-tiny",
                             "sampling.max_new_tokens=6", "sampling.temperature=0", "proxy.force_sampling=true",
                             "engine.threads=1",
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
    key_file = tmp_path / "key"
    key_file.write_text("sk-test-serve\n")
    key_file.chmod(0o600)
    proc, base, key = _start(tmp_path, "--key-file", str(key_file), env={"LOONGSAGE_SERVE_KEY": "sk-not-this-one"})
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
    assert b"sk-test-serve" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    second = _serve("--record", str(rec))             # one serve per directory
    assert second.returncode == 2 and f"is in use by pid {proc.pid}" in second.stderr
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
    oa.chat.completions.create(model="m", max_tokens=3, messages=[   # opencode's title call: a `side` segment
        {"role": "system", "content": "You are a title generator. You output ONLY a thread title."},
        {"role": "user", "content": "two"}])
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "recorded 2 trajectories" in out

    log = [json.loads(x) for x in (rec / "requests.jsonl").read_text().splitlines()]
    assert [(x["path"], x["status"]) for x in log] == [
        ("/v1/chat/completions", 200), ("/v1/completions", 200), ("/v1/responses", 200), ("/v1/messages", 200),
        ("/v1/models", 401), ("/v1/chat/completions", 200), ("/v1/chat/completions", 200)]
    assert _owner_only(rec) == {}                    # every served prompt is in there
    step1 = (rec / "rollouts" / "step=000001" / "part-0.parquet").read_bytes()
    third = _serve("--record", str(rec))              # a finished recording is not overwritten
    assert third.returncode == 2 and "holds a run or recording (config.yaml, rollouts)" in third.stderr
    assert (rec / "rollouts" / "step=000001" / "part-0.parquet").read_bytes() == step1
    recording = Recording.open(rec / "rollouts")
    assert recording.steps == [1, 2] and recording.n_samples == 1
    assert sum(recording.read_step(2).column("loss_mask").to_pylist()[0]) == again.usage.completion_tokens
    rows = recording.read([1]).to_pylist()
    assert sum(sum(r["loss_mask"]) for r in rows) == (chat.usage.completion_tokens + comp.usage.completion_tokens
                                                      + resp.usage.output_tokens + msg.usage.output_tokens)
    assert {r["segment"]["kind"] for r in rows} == {"main"}
    assert [r["segment"]["kind"] for r in recording.read_step(2).to_pylist()] == ["main", "side"]

    # every row its own group of one with reward 0: nothing to train, said once a step; the title call is no step
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    rp = subprocess.run([sys.executable, "-m", "pipeline.cli", "replay", str(rec / "rollouts"),
                         "--run-dir", str(rec.parent / "replayed")], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
    assert rp.returncode == 0, rp.stdout + rp.stderr
    steps = len(rows) + 1
    assert [x for x in rp.stdout.splitlines() if x.startswith("step ")] == [
        f"step {k}: nothing to train (1 group of one sample: no advantage)" for k in range(1, steps + 1)]
    assert "nan" not in rp.stdout + rp.stderr and f"replayed {steps} steps ({steps} of them trained nothing)" \
        in rp.stdout
    assert (rec.parent / "replayed" / "checkpoints" / f"step_{steps:06d}" / "config.json").is_file()


@pytest.mark.e2e
def test_serve_takes_its_key_from_the_environment(tmp_path):
    import openai

    proc, base, key = _start(tmp_path, env={"LOONGSAGE_SERVE_KEY": "sk-from-env"})
    try:
        assert key == "sk-from-env" and b"sk-from-env" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert openai.OpenAI(base_url=base, api_key=key, max_retries=0).models.list().data
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0).models.list()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
