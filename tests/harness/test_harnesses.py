"""The real harness programs against `loongsage serve`'s proxy (marker `harness`; `.ci/run` runs it).

Per harness: capture its first prompt, warm the tiny model to answer it with one tool call in the
harness's own tool and the tool's result with a final answer (stages/tasks/harness_sft.py), run the
program for real, then check: exit 0, no 4xx/5xx on any request, every model token the recording
holds is the engine's own, and the tool call and the answer are one segment (the history the
harness sent back extended the recorded tokens).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from stages.tasks.harness_sft import TOOL_OUTPUTS, call_json, examples, main_prompt, teach, turn_texts
from tests.harness import harnesses as H

pytestmark = pytest.mark.harness
RUN_TIMEOUT_S = 300
# Passed end to end on the 2-core development machine (pi since the proxy keeps tool-call arguments as the
# model wrote them, so its re-serialised history extends the recorded tokens; Claude Code with `--tools Bash`,
# since the proxy answers its keyless HEAD and capture and run share one HOME and working directory; Codex with
# its prompt trimmed through its own config.toml: warmed on its whole ~1.2k-token prompt, the model answers it
# at full length; opencode likewise through its opencode.json, ~1.5k tokens).
VERIFIED = {"openai-agents", "mini-swe-agent", "pi", "claude-code", "codex", "opencode-chat", "opencode-responses"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import ray

    from pipeline.serve import Server, serve_config

    # greedy whatever the harness asks (proxy.force_sampling): the warmed answers are argmax answers
    cfg = serve_config(os.environ.get("LOONGSAGE_HARNESS_MODEL", "builtin:qwen-vocab-tiny"),
                       ["sampling.max_new_tokens=96", "sampling.temperature=0", "proxy.force_sampling=true",
                        "engine.threads=1"], None, None)
    srv = Server(cfg, tmp_path_factory.mktemp("serve"), keep_engine_calls=True).start()
    srv.version = 0
    yield srv
    srv.stop()
    ray.shutdown()


def _launch(h: H.Harness, srv, home: Path) -> subprocess.Popen:
    home.mkdir(parents=True, exist_ok=True)
    for rel, text in h.files(srv.base_url, srv.key, home).items():
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text(text)
    work = home / "work"
    work.mkdir(exist_ok=True)
    env = H.base_env(home) | h.env(srv.base_url, srv.key, home)
    return subprocess.Popen(h.argv(srv.base_url, srv.key, home), cwd=work, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _home(name: str) -> Path:
    """The harness's HOME, the same path on every run from this checkout: Claude Code and opencode write their
    working directory into the system prompt, and a prompt that stays the same finds its warmed weights cached."""
    tag = hashlib.sha256(str(H.ROOT).encode()).hexdigest()[:8]
    home = Path(tempfile.gettempdir()) / f"loongsage-harness-{tag}" / name / "home"
    shutil.rmtree(home, ignore_errors=True)
    return home


def _kill(proc: subprocess.Popen) -> str:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.communicate()[0] or ""


def _capture(h: H.Harness, srv, home: Path) -> list[int]:
    """The harness's main prompt within its first calls (stages/tasks/harness_sft.py main_prompt)."""
    first = len(srv.engine.calls)
    proc = _launch(h, srv, home)
    deadline = time.time() + RUN_TIMEOUT_S
    while len(srv.engine.calls) == first and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(3 if h.side_calls else 0.5)      # the main call may follow a side call
    out = _kill(proc)
    srv.rotate(record=False)
    calls = srv.engine.calls[first:]
    assert calls, f"{h.name} made no model call:\n{out[-3000:]}"
    return main_prompt(srv.tok, [c["prompt_ids"] for c in calls])


WARM_CACHE = Path("~/.cache/loongsage/harness-warm").expanduser()


def _teach_cached(model_dir: str, pairs: list, log=print, **kw):
    """teach(), its result kept on disk under the hash of the model and the pairs: the same harness prompt
    (a rerun after a proxy change) is not warmed again (each warm costs minutes on a shared 2-core machine)."""
    key = hashlib.sha256(json.dumps([Path(model_dir).name, pairs, sorted(kw.items())]).encode()).hexdigest()[:24]
    path = WARM_CACHE / f"{key}.pt"
    if path.is_file():
        log(f"warmed weights from {path}", flush=True)
        return torch.load(path)
    state = teach(model_dir, pairs, log=log, **kw)
    WARM_CACHE.mkdir(parents=True, exist_ok=True)
    torch.save(state, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)
    return state


def _warm(h: H.Harness, srv, prompt: list[int]) -> None:
    import ray

    call = call_json(h.tool, h.args(f"echo {H.OUTPUT}"))
    answer = h.answer
    if h.final_call:
        answer = turn_texts(srv.tok, call_json(h.tool, h.args(h.final_call)), "")[0]
    # the widest window is the whole prompt: tokens the model never saw in training must not come first at inference
    more = {k: examples(srv.tok, prompt, call, answer, H.OUTPUT, getattr(h, k))[1:] for k in ("pool", "held")
            if getattr(h, k)}
    state = _teach_cached(srv.model_path, examples(srv.tok, prompt, call, answer, H.OUTPUT, h.outputs or TOOL_OUTPUTS),
                          windows=(256, 1024, max(2048, len(prompt))), **more, **({"per_step": 4} if h.pool else {}))
    srv.version += 1
    ray.get([e.load_weights.remote(state, srv.version) for e in srv.engines])


def _model_runs(row: dict) -> list[tuple[int, int]]:
    """(start, end) of each run of model tokens (loss_mask 1) in the row's full id list."""
    mask, p, runs, i = row["loss_mask"], len(row["prompt_ids"]), [], 0
    while i < len(mask):
        if mask[i]:
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            runs.append((p + i, p + j))
            i = j
        else:
            i += 1
    return runs


def _check_tokens(rows: list[dict], calls: list[dict]) -> None:
    """Every recorded model turn is an engine call's output on exactly the recorded context."""
    by_prompt = {}
    for c in calls:
        by_prompt.setdefault(tuple(c["prompt_ids"]), []).append(c["response_ids"])
    for r in rows:
        full = r["prompt_ids"] + r["response_ids"]
        for s, e in _model_runs(r):
            outs = by_prompt.get(tuple(full[:s]), [])
            assert any(o[: e - s] == full[s:e] for o in outs), f"segment {r['segment']}: tokens [{s}:{e}] are not " \
                                                                f"what the engine returned for that context"


# A harness that has not passed yet is skipped, not run as an expected failure, because warming the tiny
# model on its prompt costs minutes (LOONGSAGE_HARNESS_TRY=1 runs them as expected failures;
# LOONGSAGE_HARNESS_MODEL picks the model).
RUNS_AS_XFAIL: set[str] = set() if not os.environ.get("LOONGSAGE_HARNESS_TRY") else set(H.ALL) - VERIFIED


def _param(name: str):
    if name in VERIFIED:
        return name
    if name in RUNS_AS_XFAIL:
        return pytest.param(name, marks=pytest.mark.xfail(reason="not yet passed end to end", strict=False))
    return pytest.param(name, marks=pytest.mark.skip(reason="not yet passed end to end: agent-length prompt"))


@pytest.mark.parametrize("name", [_param(n) for n in H.ALL])
def test_harness_tool_loop(server, name):
    h = H.ALL[name]
    # captured and run from the same fresh HOME and working directory: Claude Code and opencode write both paths
    # into their system prompts, and the warmed answer must follow the prompt the run sends
    home = _home(name)
    _warm(h, server, _capture(h, server, home))
    shutil.rmtree(home)
    first_req, first_call = len(server.requests), len(server.engine.calls)
    proc = _launch(h, server, home)
    try:
        out = proc.communicate(timeout=RUN_TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        out = _kill(proc)
    step = server.rotate()
    reqs = server.requests[first_req:]
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{out[-4000:]}"
    bad = [r for r in reqs if r["status"] >= 400]
    assert not bad, f"{name}: error statuses {bad}\n{out[-3000:]}"
    assert step is not None
    rows = pq.read_table(step).to_pylist()
    _check_tokens(rows, server.engine.calls[first_call:])
    tok = server.tok
    cmd = f"echo {H.OUTPUT}"
    # a side call (opencode's title) is its own segment, not the trajectory's: the warmed model may echo the
    # command there too
    main = [r for r in rows if r["segment"]["kind"] != "side" and cmd in tok.decode(r["response_ids"])]
    assert len(main) == 1, f"{name}: the tool call is in {len(main)} segments: {[r['segment'] for r in rows]}"
    row = main[0]
    turns = [tok.decode((row["prompt_ids"] + row["response_ids"])[s:e]) for s, e in _model_runs(row)]
    assert len(turns) >= 2 and cmd in turns[0], f"{name}: model turns {turns}"
    end = h.final_call or h.answer
    assert end in turns[-1], f"{name}: the last turn {turns[-1]!r} is not the answer {end!r}"
    assert row["segment"]["kind"] == "main"
