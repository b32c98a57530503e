"""Agent-length prompts on Qwen's 151,669-token vocabulary: peak memory of a whole run, and the
prefill and update rates (issue 34, docs/long-context.md).

Workload, per cell (P prompt tokens, N trajectories):
* model: the `builtin:qwen-vocab-tiny-32k` shape (Qwen2, hidden 64, 2 layers, 2 heads of 32 dims,
  1 key/value head, 32,768 positions, RoPE base 1e6, tied 151,669 x 64 embeddings: 10.4M
  parameters), written once by this tree into --model-dir and passed as `model.path`, so a tree
  without the built-in (an older commit) runs the very same weights;
* prompt: one plain-text prompt of exactly P tokens (English words, one token each, checked with
  the model's tokenizer); P in 2048, 8192, 18825 (Claude Code's first request), 32700 (the
  context less room for the answer);
* run: `python -m pipeline.cli run RECIPE` with the recipe below, in a fresh process, 1 step:
  one group of N samples (single_turn agent, 16 new tokens, T=1), exact_match reward (0: the
  random model never says the answer), GRPO with trainer.skip_zero_advantage=false (so the
  update runs its forward and backward over every row although the advantages are 0), torch
  trainer, one HF engine, no eval, the final checkpoint written;
* memory: every 100 ms, psutil walks the run's process tree (the CLI driver and all below it:
  Ray's GCS and raylet, the engine, trainer, rollout and reward workers) and sums RSS and PSS
  (PSS splits shared pages, such as torch's libraries, between the processes that map them,
  so it adds up to what the tree holds; RSS counts them once per process). Peak of each sum,
  and the largest process's peak RSS with its name, are printed. A cell whose RSS sum passes
  --rss-limit-gb is killed and shown as "> LIMIT" (the old code's 19k prefill needs ~12 GB);
* prefill tok/s: a separate process loads the engine (HFEngine, 1 torch thread) and times
  generate() of the N rows with max_new_tokens=1 (the rows share one prompt: one prefill),
  P / seconds; its peak RSS is printed as "engine alone";
* update tok/s: (prompt + response tokens of the step's rows) / time/update_s of metrics.jsonl.

    python benchmarks/long_context.py                              # the whole grid (slow on 2 cores)
    python benchmarks/long_context.py --tokens 18825 --trajectories 2
    python benchmarks/long_context.py --tree /tmp/old --label before   # a checkout of another commit

The tree under test (--tree, default this one) is what every process imports (PYTHONPATH);
this script only drives and measures. Timings on a shared machine are noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
TOKENS = (2048, 8192, 18825, 32700)
TRAJECTORIES = (1, 2, 8)
WORDS = (" the of and to in is it that for on with as was at by be this from or an are not have but all"
         " they which one you were her there can more if will when what who so out up no time about").split(" ")[1:]

RECIPE = """\
run: {{steps: 1, seed: 0}}
model: {{path: {model}}}
data: {{path: {data}}}
rollout: {{n_samples: {n}}}
sampling: {{max_new_tokens: 16, temperature: 1.0}}
engine: {{count: 1}}
batcher: {{groups_per_step: 1}}
reward: {{fn: exact_match}}
algorithm: {{name: grpo}}
trainer: {{mini_batch_size: {n}, skip_zero_advantage: false}}
eval: {{every: 0}}
"""

PREFILL = """\
import json, sys, time
from stages.agentflow.engine import HFEngine
eng = HFEngine(sys.argv[1], num_threads=1)
ids = json.load(open(sys.argv[2]))["ids"]
t = time.perf_counter()
out = eng.generate([{"prompt_ids": ids, "max_new_tokens": 1, "seed": k} for k in range(int(sys.argv[3]))])
print(json.dumps({"seconds": time.perf_counter() - t, "status": [o["status"] for o in out]}))
"""


def model_dir(where: Path) -> Path:
    """The 32k built-in's shape, written by this tree's make_qwen_model_dir (once)."""
    sys.path.insert(0, str(ROOT))
    from stages.tasks.qwen_vocab import SHAPE_32K, make_qwen_model_dir

    if not (where / "model.safetensors").is_file():
        make_qwen_model_dir(where, **SHAPE_32K)
    return where


def prompt_text(tok, n: int) -> tuple[str, list[int]]:
    """A text of exactly n tokens: words that are each one token after a space."""
    text = "".join(" " + WORDS[i % len(WORDS)] for i in range(n)).lstrip(" ")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) != n:
        raise RuntimeError(f"the prompt text came to {len(ids)} tokens, wanted {n}")
    return text, ids


def title(p: psutil.Process) -> str:
    """What a process is: a Ray worker's title (ray::Class), else the program and its script or module."""
    cmd = p.cmdline()
    if not cmd:
        return p.name()
    if cmd[0].startswith("ray::"):
        return cmd[0].split(" ")[0]
    prog = Path(cmd[0]).name
    if prog.startswith("python"):
        rest = [c for c in cmd[1:] if not c.startswith("-") or c == "-m"]
        if rest[:1] == ["-m"]:
            return f"python -m {' '.join(rest[1:3])}"
        return f"python {Path(rest[0]).parent.name}/{Path(rest[0]).name}" if rest else prog
    return prog


class TreeWatch:
    """Peak of the summed RSS and PSS over a process and its descendants, sampled every `every` s;
    `at_peak` / `at_pss_peak`: each process's (rss, pss, title) when the RSS / PSS sum peaked;
    `timeline`: a file that gets one JSON line a sample (seconds since start, the sums, and each
    process's RSS/PSS/title)."""

    def __init__(self, pid: int, every: float = 0.1, timeline: Path | None = None):
        self.root, self.every = psutil.Process(pid), every
        self.timeline = open(timeline, "w") if timeline else None
        self.t0 = time.time()
        self.rss = self.pss = 0
        self.largest: tuple[int, str] = (0, "")
        self.at_peak: list[tuple[int, int, str]] = []
        self.at_pss_peak: list[tuple[int, int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                return
            now = []
            for p in procs:
                try:
                    m = p.memory_full_info()
                    now.append((m.rss, m.pss, title(p)))
                except psutil.Error:
                    continue
            rss, pss = sum(x[0] for x in now), sum(x[1] for x in now)
            if self.timeline:
                self.timeline.write(json.dumps({"t": round(time.time() - self.t0, 2), "rss": rss, "pss": pss,
                                                "each": now}) + "\n")
            if rss > self.rss:
                self.rss, self.at_peak = rss, sorted(now, reverse=True)
            if pss > self.pss:
                self.pss, self.at_pss_peak = pss, sorted(now, key=lambda x: -x[1])
            self.largest = max([self.largest, *((r, n) for r, _, n in now)])
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.timeline:
            self.timeline.close()


def watched(cmd: list[str], env: dict, cwd: Path, limit: float, timeout: float,
            timeline: Path | None = None) -> tuple[int, str, TreeWatch, bool]:
    """Run cmd, watching its tree; kill the tree if its RSS sum passes `limit` bytes or time runs out."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    watch, killed = TreeWatch(proc.pid, timeline=timeline), False
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    t0 = time.time()
    while proc.poll() is None:
        if watch.rss > limit or time.time() - t0 > timeout:
            killed = True
            os.killpg(proc.pid, 9)      # its own session: the driver, Ray and the workers it started
        time.sleep(0.05)
    reader.join(5)
    watch.stop()
    return proc.returncode, "".join(out), watch, killed


def update_rate(run_dir: Path) -> float | None:
    import pyarrow.parquet as pq

    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    secs = sum(m.get("time/update_s", 0.0) for m in steps if "train/loss" in m)
    rows = pq.read_table(run_dir / "rollouts").to_pylist()
    tokens = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
    return tokens / secs if secs else None


def cell(args, model: Path, tok, n_tokens: int, n_traj: int, work: Path) -> dict:
    env = os.environ | {"PYTHONPATH": str(args.tree), "RAY_DEDUP_LOGS": "0", "TOKENIZERS_PARALLELISM": "false"}
    limit = args.rss_limit_gb * 2 ** 30
    d = work / f"p{n_tokens}-n{n_traj}"
    d.mkdir(parents=True, exist_ok=True)
    text, ids = prompt_text(tok, n_tokens)
    (d / "data.jsonl").write_text(json.dumps({"prompt": text, "answer": "42"}) + "\n")
    (d / "ids.json").write_text(json.dumps({"ids": ids}))
    (d / "recipe.yaml").write_text(RECIPE.format(model=model, data=d / "data.jsonl", n=n_traj))
    (d / "prefill.py").write_text(PREFILL)
    res = {"tokens": n_tokens, "trajectories": n_traj, "engine_rss": None, "prefill_tok_s": None}
    if args.no_prefill:
        res["engine_rss"] = "-"
    else:
        res |= prefill(args, model, d, n_tokens, n_traj, env, limit)
    if args.engine_only:
        return res
    run_dir = d / "run"
    rc, out, w, killed = watched([sys.executable, "-m", "pipeline.cli", "run", str(d / "recipe.yaml"),
                                  "--run-dir", str(run_dir)], env, args.tree, limit, args.timeout,
                                 d / "timeline.jsonl" if args.timeline else None)
    res |= {"killed": killed, "rss": w.rss, "pss": w.pss, "largest": w.largest,
            "each": w.at_peak, "each_pss": w.at_pss_peak}
    if rc == 0:
        res["update_tok_s"] = update_rate(run_dir)
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        res["wall_s"] = sum(m.get("step_wall_s", 0.0) for m in rows)
    elif not killed:
        res["error"] = out[-2000:]
    return res


def prefill(args, model: Path, d: Path, n_tokens: int, n_traj: int, env: dict, limit: float) -> dict:
    """The engine alone: its peak RSS and prefill tokens/s on the cell's prompt."""
    res = {}
    rc, out, w, killed = watched([sys.executable, str(d / "prefill.py"), str(model), str(d / "ids.json"), str(n_traj)],
                                 env, args.tree, limit, args.timeout)
    res["engine_rss"] = None if killed else w.rss
    res["prefill_tok_s"] = n_tokens / json.loads(out.strip().splitlines()[-1])["seconds"] if rc == 0 else None
    if rc and not killed:
        res["error"] = out[-2000:]
    return res


def fmt(res: dict, limit_gb: float) -> str:
    def gb(x):
        return x if isinstance(x, str) else f"> {limit_gb:g} (killed)" if x is None else f"{x / 2 ** 30:.2f}"

    def rate(x):
        return "-" if x is None else f"{x:,.0f}"

    if "rss" not in res:
        run = "- | - | -"
    elif res["killed"]:
        run = f"> {limit_gb:g} (killed) | - | -"
    else:
        run = f"{gb(res['rss'])} | {gb(res['pss'])} | {res['largest'][1].strip()} {gb(res['largest'][0])}"
    return (f"| {res['tokens']:>6} | {res['trajectories']} | {gb(res['engine_rss'])} | {rate(res['prefill_tok_s'])} "
            f"| {run} | {rate(res.get('update_tok_s'))} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="prompt lengths, comma-separated")
    p.add_argument("--trajectories", default=",".join(map(str, TRAJECTORIES)), help="samples of the prompt")
    p.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose code runs (PYTHONPATH)")
    p.add_argument("--label", default="", help="a name for the tree in the output")
    p.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "loongsage-long-context-model")
    p.add_argument("--engine-only", action="store_true", help="only the engine-alone prefill, no whole run")
    p.add_argument("--no-prefill", action="store_true", help="only the whole run, no engine-alone prefill")
    p.add_argument("--timeline", action="store_true",
                   help="write each cell's samples (sums and every process) to CELL/timeline.jsonl")
    p.add_argument("--rss-limit-gb", type=float, default=8.0, help="kill a cell whose RSS sum passes this")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per process")
    p.add_argument("--detail", action="store_true", help="each process's RSS and PSS when the RSS sum peaked")
    p.add_argument("--work", type=Path, default=None, help="where cells write (default: a temporary dir)")
    args = p.parse_args(argv)
    args.tree = args.tree.resolve()
    model = model_dir(args.model_dir)
    from stages.model import load_tokenizer

    tok = load_tokenizer(str(model))
    work = args.work or Path(tempfile.mkdtemp(prefix="long-context-"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.tree, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=args.tree,
                           capture_output=True, text=True).stdout.strip()
    print(f"tree {args.tree} ({args.label or 'under test'}: {commit}{' + changes' if dirty else ''}); "
          f"model {model}; cells in {work}")
    print("| prompt tokens | trajectories | engine alone: peak RSS GB | prefill tok/s | whole run: peak RSS sum GB "
          "| peak PSS sum GB | largest process, peak RSS GB | update tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for n_tokens in map(int, args.tokens.split(",")):
        for n_traj in map(int, args.trajectories.split(",")):
            res = cell(args, model, tok, n_tokens, n_traj, work)
            print(fmt(res, args.rss_limit_gb), flush=True)
            if args.detail:
                for label, key in (("RSS", "each"), ("PSS", "each_pss")):
                    print(f"  each process when the {label} sum peaked:")
                    for rss, pss, name in res.get(key, []):
                        print(f"    {rss / 2 ** 20:7.0f} MB RSS {pss / 2 ** 20:7.0f} MB PSS  {name.strip()}")
            if res.get("error"):
                print(f"  failed: {res['error'][-600:]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
