"""Warm the tiny Qwen-vocabulary model, partially, to start Claude Code's shell task (configs/agent_claude_code.yaml).

    python examples/agents/claude_code_warm.py OUT_DIR [--steps 40] [--tasks examples/agents/claude_code_tasks.jsonl]

RL improves a policy that succeeds sometimes; a random model never calls a tool. So, as the quickstart
warms its model deliberately partially, this script teaches the tiny model a little of the task, on
Claude Code's real prompts:

1. serve `builtin:qwen-vocab-tiny` behind the proxy (pipeline/serve.py) and run the recipe's own agent
   (examples/agents/claude_code.py, which runs the real `claude -p`) once per task: the proxy's
   rendering of Claude Code's first request (its system prompt, its Bash tool, the task) is captured
   from the engine's calls;
2. SFT in code (tests/harness/warm.py) for a fixed number of steps on: that prompt -> the Bash call
   `echo WORD > answer.txt`; that prompt + the call + the tool's (empty) result -> a short answer;
3. print, per task, the probability that a sample at temperature 1 writes the demonstrated call
   exactly (a lower bound on the task's success rate at the start of RL), and save the model
   (weights, tokenizer, chat template) to OUT_DIR, the recipe's model.path.

Fewer --steps: a weaker start (success rarer); more: a stronger one, less for RL to do.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

AGENT = ROOT / "examples/agents/claude_code.py"
ANSWER = "Done."
EMPTY = "(Bash completed with no output)"     # what Claude Code sends back for a command that prints nothing


def capture(srv, row: dict) -> list[int]:
    """Claude Code's first prompt for this task, as the engine received it."""
    first = len(srv.engine.calls)
    env = os.environ | {"ANTHROPIC_BASE_URL": srv.base_url[: -len("/v1")], "ANTHROPIC_API_KEY": srv.key,
                        "LOONGSAGE_SAMPLE": json.dumps(row)}
    subprocess.run([sys.executable, str(AGENT), "--timeout", "120"], env=env, stdin=subprocess.DEVNULL,
                   capture_output=True, text=True, timeout=180)
    srv.rotate(record=False)
    calls = srv.engine.calls[first:]
    if not calls:
        sys.exit(f"Claude Code made no model call for {row['prompt']!r}")
    return calls[0]["prompt_ids"]          # its first call is the task's main call (-p makes no side call first)


def call_probability(model, prompt: list[int], target: list[int]) -> float:
    """P(a temperature-1 sample is exactly `target`) under the full softmax."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt + target[:-1]])
        hidden = model.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1:]
        logp = torch.log_softmax(model.lm_head(hidden).float(), -1)
        return float(logp[torch.arange(len(target)), torch.tensor(target)].sum().exp())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the warmed model's directory (the recipe's model.path)")
    ap.add_argument("--tasks", default=str(ROOT / "examples/agents/claude_code_tasks.jsonl"))
    ap.add_argument("--steps", type=int, default=40, help="SFT steps (deliberately partial)")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--model", default="builtin:qwen-vocab-tiny")
    args = ap.parse_args()
    import ray
    import torch

    from pipeline.serve import Server, serve_config
    from stages.model import load_model
    from tests.harness.warm import call_json, teach, turn_texts

    rows = [json.loads(line) for line in Path(args.tasks).read_text().splitlines() if line.strip()]
    cfg = serve_config(args.model, ["rollout.max_new_tokens=16", "rollout.engine_threads=1"], None, None)
    out = Path(args.out)
    srv = Server(cfg, out.with_name(out.name + ".capture"), keep_engine_calls=True, log=lambda *a, **k: None).start()
    try:
        t0 = time.time()
        prompts = [capture(srv, r) for r in rows]
        print(f"captured {len(rows)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
              f"({time.time() - t0:.0f}s)", flush=True)
        tok = srv.tok
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        first = lambda call: turn_texts(tok, call, ANSWER)[0]  # noqa: E731
        between = lambda call: turn_texts(tok, call, ANSWER)[1]  # noqa: E731
        pairs, calls = [], []
        for i, (row, prompt) in enumerate(zip(rows, prompts)):
            # half the demonstrations write another task's word: the format is taught, the choice is left to RL
            other = rows[(i + 1) % len(rows)]["answer"]
            for word in (row["answer"], other):
                call = call_json("Bash", {"command": f"echo {word} > answer.txt"})
                pairs.append((list(prompt), enc(first(call)) + [eos]))
                if word == row["answer"]:
                    calls.append(pairs[-1])
                    # the call's (empty) result, in Claude Code's words -> the answer
                    tail = enc(first(call)) + enc(between(call).replace("@@OUT@@", EMPTY))
                    pairs.append((list(prompt) + tail, enc(ANSWER) + [eos]))
        state = teach(srv.model_path, pairs, steps=args.steps, lr=args.lr,
                      windows=(256, 1024, max(map(len, prompts))))
    finally:
        srv.stop()
        ray.shutdown()
    model = load_model(srv.model_path)
    model.load_state_dict(state)
    model.eval()
    probs = [call_probability(model, p, t) for p, t in calls]
    print("P(sampled call is the demonstrated one) per task: " + ", ".join(f"{r['answer']} {p:.2f}"
                                                                          for r, p in zip(rows, probs)))
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(srv.model_path, out)
    model.to(torch.float32).save_pretrained(out)
    print(f"warmed model saved to {out} (mean P {sum(probs) / len(probs):.2f})")


if __name__ == "__main__":
    main()
