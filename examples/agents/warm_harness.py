"""Warm the 32k tiny Qwen-vocabulary model to drive a real harness on the file task, partly right.

    python examples/agents/warm_harness.py claude-code|codex|opencode-chat|opencode-responses OUT_DIR
        [--steps 40] [--wrong 2] [--temperature 1.0]

The recipes configs/agent_claude_code.yaml, configs/agent_codex.yaml and configs/agent_opencode.yaml
train a harness on examples/data/harness_files.jsonl ("Write the word W into the file answer.txt."); a
randomly initialised model would never call the harness's shell tool, so there would be nothing to
learn from. This script gives the model a start, as the quickstart warms its model deliberately partly:

1. serve the built-in model (pipeline/serve.py) and run the task agent (examples/agents/harness_task.py)
   once per task, in the agent jail as a rollout runs it (same paths, so the same prompt), to read the
   harness's real first prompt from the engine's calls;
2. fine-tune (stages/tasks/harness_sft.py; the last quarter of the steps with the full softmax) on, per
   task: the right call in the harness's own shell tool (`echo W > answer.txt`), `--wrong` copies of a
   wrong one (`echo W > output.txt`), and the short final answer after the tool's (empty) result;
3. print, per task, the probability that a sample at --temperature is exactly the right call and
   exactly the wrong one, and write the model (weights, tokenizer, chat template) to OUT_DIR, the
   recipe's model.path.

With --wrong 2 the warmed model writes output.txt about twice as often as answer.txt: the reward starts
near 0.3 and the two outcomes differ in one word, the file name, which is what the RL run learns.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

DATA = ROOT / "examples" / "data" / "harness_files.jsonl"
MODEL = "builtin:qwen-vocab-tiny-32k"
# the harness's shell tool and how it is called
_BASH = ("bash", lambda cmd: {"command": cmd, "description": "Write the answer file"})
TOOLS = {"claude-code": ("Bash", lambda cmd: {"command": cmd}),
         "codex": ("exec_command", lambda cmd: {"cmd": cmd}),
         "opencode-chat": _BASH, "opencode-responses": _BASH}
# what each shows the model for a command that prints nothing (Codex's chunk id and wall time vary per run)
EMPTY_OUTPUTS = {"claude-code": ("(Bash completed with no output)",),
                 "codex": tuple(f"Chunk ID: {c}\nWall time: {w} seconds\nProcess exited with code 0\n"
                                "Original token count: 0\nOutput:\n" for c, w in (("3f9a1c", "0.0000"),
                                                                                   ("b07e52", "0.0013"))),
                 "opencode-chat": ("", "\n"), "opencode-responses": ("", "\n")}
ANSWER = "Done."


def capture(srv, name: str, sample: dict, wait_s: float = 4.0) -> list[int]:
    """The harness's main prompt for one task, as its first model call sends it, run as a rollout runs it (in
    the same agent jail, so with the same paths, where bwrap runs)."""
    first = len(srv.engine.calls)
    asyncio.run(_run_until_first_call(srv, name, sample, wait_s))
    srv.rotate(record=False)
    calls = [c["prompt_ids"] for c in srv.engine.calls[first:]]
    if not calls:
        raise SystemExit(f"{name} made no model call for {sample['prompt']!r}")
    from stages.tasks.harness_sft import main_prompt

    return main_prompt(srv.tok, calls)


async def _run_until_first_call(srv, name: str, sample: dict, wait_s: float) -> None:
    from stages.agentflow.blackbox import agent_env
    from stages.agentflow.config import AgentConfig
    from stages.agentflow.sandbox import jail
    from stages.agentflow.sandbox.agent_jail import Jail, end

    argv = [sys.executable, str(ROOT / "examples" / "agents" / "harness_task.py"), name]
    env = agent_env(srv.base_url, srv.key, sample)
    port, first = urlsplit(srv.base_url).port, len(srv.engine.calls)

    async def connect():        # the jail's forwarder reaches the server's port on the host's loopback
        return socket.create_connection(("127.0.0.1", port))

    if jail.probe():            # no bwrap here: the harness runs unjailed, on the host's loopback
        proc = await asyncio.create_subprocess_exec(*argv, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
    else:
        proc = await Jail(AgentConfig(binds=(".cache/harness",))).spawn(argv, env, port, connect, None)
    deadline = time.time() + 180
    while len(srv.engine.calls) == first and proc.returncode is None and time.time() < deadline:
        await asyncio.sleep(0.2)
    await asyncio.sleep(wait_s)     # a side call (opencode's title) may come first
    end(proc)
    await proc.wait()


def demonstrations(tok, name: str, prompt: list[int], word: str, wrong: int) -> tuple[list, list]:
    """(pairs, [right call pair, wrong call pair]) for one task: the right call, `wrong` copies of the wrong
    call (SFT fits their ratio), the answer after the right call's result."""
    from stages.tasks.harness_sft import call_json, examples

    tool, args = TOOLS[name]
    right = call_json(tool, args(f"echo {word} > answer.txt"))
    bad = call_json(tool, args(f"echo {word} > output.txt"))
    shapes = tuple(s.replace("{", "{{").replace("}", "}}") + "{out}" for s in EMPTY_OUTPUTS[name])
    good = examples(tok, prompt, right, ANSWER, "", shapes)
    worse = examples(tok, prompt, bad, ANSWER, "", ())
    return good + worse * wrong, [good[0], worse[0]]


def report(model, calls: list, rows: list, temperature: float) -> float:
    """Print P(exactly the right call), P(exactly the wrong one) per task at `temperature`; the mean of the first."""
    from stages.tasks.harness_sft import sequence_probability

    right = []
    for row, (good, bad) in zip(rows, calls):
        right.append(sequence_probability(model, *good, temperature))
        print(f"  {row['answer']}: P(right call) {right[-1]:.2f}, "
              f"P(wrong call) {sequence_probability(model, *bad, temperature):.2f}", flush=True)
    return sum(right) / len(right)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("harness", choices=sorted(TOOLS))
    p.add_argument("out", help="where the warmed model is written (an HF directory: the recipe's model.path)")
    p.add_argument("--steps", type=int, default=40, help="fine-tuning steps")
    p.add_argument("--wrong", type=int, default=2, help="copies of the wrong call per right one")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--temperature", type=float, default=1.0, help="the recipe's rollout temperature (for the report)")
    p.add_argument("--tasks", type=int, default=0, help="warm on the first N tasks only (0: all)")
    p.add_argument("--init", default="", help="start from this model directory (a warm-up to continue)")
    args = p.parse_args()

    import ray
    import torch

    from pipeline.serve import Server, serve_config
    from stages.model import load_model
    from stages.tasks.harness_sft import teach

    cfg = serve_config(MODEL, ["sampling.max_new_tokens=8", "sampling.temperature=0", "engine.threads=1"],
                       None, None)
    # the engine's calls are kept: the prompts are read from them
    srv = Server(cfg, tempfile.mkdtemp(prefix="loongsage-warm-"), keep_engine_calls=True,
                 log=lambda *a, **k: None).start()
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    rows = rows[: args.tasks or len(rows)]
    try:
        pairs, calls = [], []
        for row in rows:
            prompt = capture(srv, args.harness, row)
            print(f"captured {args.harness}'s prompt for {row['answer']!r}: {len(prompt)} tokens", flush=True)
            more, call = demonstrations(srv.tok, args.harness, prompt, row["answer"], args.wrong)
            pairs, calls = pairs + more, calls + [call]
    finally:
        srv.stop()
        ray.shutdown()
    widest = max(len(p) for p, _ in pairs)
    start = args.init or srv.model_path
    state = teach(start, pairs, steps=args.steps, lr=args.lr, windows=(256, 1024, widest),
                  full_steps=args.steps // 4)
    model = load_model(start)
    model.load_state_dict(state)
    model.eval()
    mean = report(model, calls, rows, args.temperature)
    out = Path(args.out)
    shutil.copytree(srv.model_path, out, dirs_exist_ok=True)     # tokenizer, chat template, config
    model.to(torch.float32).save_pretrained(out)
    print(f"warmed model written to {out} (mean P(right call) {mean:.2f} at temperature {args.temperature})",
          flush=True)


if __name__ == "__main__":
    main()
