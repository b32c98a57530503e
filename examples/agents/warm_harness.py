"""Warm the 32k tiny Qwen-vocabulary model to drive a real harness on the file task, half right.

    python examples/agents/warm_harness.py codex|opencode-chat|opencode-responses OUT_DIR [--steps 120]

The recipes configs/agent_codex.yaml and configs/agent_opencode.yaml train a harness on
examples/data/harness_files.jsonl ("Write the word W into the file answer.txt."); a randomly
initialised model would never call the harness's shell tool, so there would be nothing to learn from.
This script gives the model a start: it serves the built-in model (pipeline/serve.py), runs the task
agent (examples/agents/harness_task.py) once per task, in the agent jail as a rollout runs it, to read
the harness's real first prompt, then fine-tunes (tests/harness/warm.py) on two demonstrations per task,
one right (`echo W > answer.txt`) and one wrong (`echo W > output.txt`), plus the short final answer
after the tool's result. The warmed model samples either call about equally often: the reward starts
near 0.5 and the RL run has to learn which file the checker reads. The model is written to OUT_DIR
(an HF directory: the recipe's model.path).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

DATA = ROOT / "examples" / "data" / "harness_files.jsonl"
MODEL = "builtin:qwen-vocab-tiny-32k"
# the harness's shell tool and how it is called; what it shows for a command that prints nothing
TOOLS = {"codex": ("exec_command", lambda cmd: {"cmd": cmd}),
         "opencode-chat": ("bash", lambda cmd: {"command": cmd, "description": "Write the answer file"}),
         "opencode-responses": ("bash", lambda cmd: {"command": cmd, "description": "Write the answer file"})}
EMPTY_OUTPUTS = {"codex": tuple(f"Chunk ID: {c}\nWall time: {w} seconds\nProcess exited with code 0\n"
                                "Original token count: 0\nOutput:\n" for c, w in (("3f9a1c", "0.0000"),
                                                                                   ("b07e52", "0.0013"))),
                 "opencode-chat": ("", "\n"), "opencode-responses": ("", "\n")}
ANSWER = "Done."


def capture(srv, name: str, sample: dict, wait_s: float = 4.0) -> list[int]:
    """The harness's main prompt for one task: its longest within its first calls, run as a rollout runs it."""
    from stages.agentflow import jail
    from stages.agentflow.blackbox import SHADOWED, agent_env

    argv = [sys.executable, str(ROOT / "examples" / "agents" / "harness_task.py"), name]
    if not jail.probe():        # bwrap runs here: the same jail (and so the same paths) as in training
        argv = jail.agent_argv(argv, os.getcwd(), None, (), None)
    env = {k: v for k, v in os.environ.items() if k not in SHADOWED} | agent_env(srv.base_url, srv.key, sample)
    first = len(srv.engine.calls)
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 180
    while len(srv.engine.calls) == first and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(wait_s)          # opencode's title call may come first
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    srv.rotate(record=False)
    calls = srv.engine.calls[first:]
    if not calls:
        raise SystemExit(f"{name} made no model call for {sample['prompt']!r}")
    return max((c["prompt_ids"] for c in calls), key=len)


def demonstrations(tok, name: str, prompt: list[int], word: str) -> list:
    """(prompt ids, target ids) pairs for one task: the right call, the wrong call, the answer after the right one."""
    from tests.harness.warm import call_json, examples

    tool, args = TOOLS[name]
    right = call_json(tool, args(f"echo {word} > answer.txt"))
    wrong = call_json(tool, args(f"echo {word} > output.txt"))
    shapes = tuple(s.replace("{", "{{").replace("}", "}}") + "{out}" for s in EMPTY_OUTPUTS[name])
    return examples(tok, prompt, right, ANSWER, "", shapes) + examples(tok, prompt, wrong, ANSWER, "", ())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("harness", choices=sorted(TOOLS))
    p.add_argument("out", help="where the warmed model is written (an HF directory)")
    p.add_argument("--steps", type=int, default=80, help="fine-tuning steps")
    p.add_argument("--windows", default="256,1024", help="prompt tails trained on, in tokens (tests/harness/warm.py)")
    args = p.parse_args()

    import ray
    import torch

    from pipeline.serve import Server, serve_config
    from stages.model import load_model
    from tests.harness.warm import teach

    cfg = serve_config(MODEL, ["rollout.max_new_tokens=8", "rollout.temperature=0", "rollout.engine_threads=1"],
                       None, None)
    # the engine's calls are kept: the prompts are read from them
    srv = Server(cfg, tempfile.mkdtemp(prefix="loongsage-warm-"), keep_engine_calls=True).start()
    try:
        rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
        pairs = []
        for row in rows:
            prompt = capture(srv, args.harness, row)
            print(f"captured {args.harness}'s prompt for {row['answer']!r}: {len(prompt)} tokens", flush=True)
            pairs += demonstrations(srv.tok, args.harness, prompt, row["answer"])
    finally:
        srv.stop()
        ray.shutdown()
    state = teach(srv.model_path, pairs, steps=args.steps, windows=tuple(int(w) for w in args.windows.split(",")))
    model = load_model(srv.model_path)
    model.load_state_dict(state)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float32).save_pretrained(out)
    srv.tok.save_pretrained(out)
    print(f"warmed model written to {out}", flush=True)


if __name__ == "__main__":
    main()
