"""LoRA RL against full fine-tuning on the quickstart, and how the HF engine should serve adapters.

Workload: configs/quickstart.yaml (full fine-tuning, lr 5e-5) and configs/quickstart_lora.yaml
(rank-8 LoRA on every decoder linear layer, alpha 16, the final norm trained in full, lr 5e-4),
run one after the other in this process with the same seed, steps and evaluation (default: the
recipes' 160 steps, 500 held-out prompts sampled at T=1 every 40 steps; --steps / --eval-every
shorten them). Prints:

  * the learning curve of each: eval/accuracy at every evaluation;
  * step time: median step wall time, trainer update time (train/seconds) and weight sync;
  * per weight sync: bytes sent to one engine (transfer/payload_bytes; state_bytes adds the
    alignment padding) and seconds (transfer/seconds, trainer prepare -> engine serving);
  * trainer memory: bytes of trained parameters, of their AdamW state, and the trainer
    process's peak RSS (ru_maxrss; on this tiny model mostly the Python / torch runtime);
  * the HF engine's two ways of serving an adapter (trainer.lora.serve): decode time of one
    rollout unit (16 prompts x 8 samples, 6 new tokens, the quickstart's shape; best of
    --rounds, one thread, the modes interleaved) with the LoRA run's final adapter merged into
    the weights vs applied by peft's layers, against the base model without LoRA; and the time
    to apply one version in each mode.

    python benchmarks/lora.py                       # the recipes as they are (~10 min on 2 cores)
    python benchmarks/lora.py --steps 40 --eval-every 20
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)     # the repository first; not this folder (its transfer.py names the package)

import ray  # noqa: E402
import torch  # noqa: E402

from pipeline.config import load_config  # noqa: E402
from pipeline.controller import Controller  # noqa: E402
from pipeline.metrics import read_metrics  # noqa: E402


def run_recipe(config: str, overrides: list[str], run_dir: Path) -> dict:
    ctl = Controller(load_config(config, overrides), run_dir, log=lambda *_: None)
    try:
        summary = ctl.run()
        memory = ray.get(ctl.trainer.memory.remote())
    finally:
        ctl.stop()
    lines = read_metrics(run_dir)
    steps = [m for m in lines if "train/loss" in m]
    med = lambda k: statistics.median(m[k] for m in steps if k in m)  # noqa: E731
    return {"summary": summary, "memory": memory, "model_path": ctl.model_path,
            "curve": [(m["step"], m["eval/accuracy"]) for m in lines if "eval/accuracy" in m],
            "step_s": med("step_wall_s"), "update_s": med("train/seconds"), "sync_s": med("transfer/seconds"),
            "sync_bytes": med("transfer/payload_bytes"), "sync_state_bytes": med("transfer/state_bytes"),
            "checkpoint": Path(summary["run_dir"]) / "checkpoints" / f"step_{summary['steps']:06d}"}


def decode_timings(model_path: str, adapter_dir: Path, lora, rounds: int) -> dict:
    """Seconds per rollout unit for base / merge / peft engines, and per version applied."""
    import dataclasses

    from safetensors.torch import load_file

    from stages.agentflow.engine import HFEngine

    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    engines = {"base (no LoRA)": HFEngine(model_path, seed=0)}
    apply_s = {}
    for serve in ("merge", "peft"):
        eng = HFEngine(model_path, seed=0, lora=dataclasses.replace(lora, serve=serve))
        t0 = time.perf_counter()
        for v in range(1, 11):
            eng.load_weights(adapter, v)
        apply_s[serve] = (time.perf_counter() - t0) / 10
        engines[f"{serve} (serve={serve})"] = eng
    prompts = [f"{a}+{b}=" for a, b in zip(range(10, 90, 5), range(3, 99, 6))][:16]
    best = {n: float("inf") for n in engines}
    outs = {}
    for _ in range(rounds):
        for name, eng in engines.items():
            reqs = [{"prompt_ids": eng.tok(p, add_special_tokens=False)["input_ids"], "max_new_tokens": 6,
                     "temperature": 1.0, "seed": 8 * i + k} for i, p in enumerate(prompts) for k in range(8)]
            torch.set_num_threads(1)
            t0 = time.perf_counter()
            outs[name] = eng.generate(reqs)
            best[name] = min(best[name], time.perf_counter() - t0)
    same = [o["response_ids"] for o in outs["merge (serve=merge)"]] == [o["response_ids"] for o in
                                                                       outs["peft (serve=peft)"]]
    return {"decode_s": best, "apply_s": apply_s, "same_samples": same}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=0, help="training steps (0: the recipes' 160)")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: the recipes' 40)")
    p.add_argument("--rounds", type=int, default=7, help="decode timing rounds (best of)")
    p.add_argument("--run-dir", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    root = Path(args.run_dir or tempfile.mkdtemp(prefix="lora-bench-"))
    over = ([f"run.steps={args.steps}"] if args.steps else []) + \
        ([f"eval.every={args.eval_every}"] if args.eval_every else [])
    runs = {}
    for name, config in (("full", "configs/quickstart.yaml"), ("lora", "configs/quickstart_lora.yaml")):
        t0 = time.time()
        runs[name] = run_recipe(str(ROOT / config), over, root / name)
        runs[name]["wall_s"] = time.time() - t0
    lora_cfg = load_config(str(ROOT / "configs/quickstart_lora.yaml")).trainer.lora

    print(f"quickstart, full fine-tuning vs LoRA (rank {lora_cfg.rank}, alpha {lora_cfg.alpha:g}, "
          f"{len(lora_cfg.target_modules)} module names, trained in full: {list(lora_cfg.modules_to_save)}); "
          f"run dirs under {root}")
    print("eval/accuracy (500 held-out prompts, T=1) by step:")
    steps = sorted({s for r in runs.values() for s, _ in r["curve"]})
    print("  step  " + "  ".join(f"{s:>6}" for s in steps))
    for name, r in runs.items():
        acc = dict(r["curve"])
        print(f"  {name:<5} " + "  ".join(f"{acc[s]:6.3f}" if s in acc else "     -" for s in steps))
    print(f"{'':<34}{'full':>14}{'lora':>14}{'lora/full':>11}")
    rows = [("step wall time (median, s)", "step_s", "{:.3f}"), ("trainer update (median, s)", "update_s", "{:.3f}"),
            ("weight sync (median, s)", "sync_s", "{:.4f}"), ("bytes per sync (tensors)", "sync_bytes", "{:,.0f}"),
            ("bytes per sync (with padding)", "sync_state_bytes", "{:,.0f}")]
    for label, k, fmt in rows:
        f, lo = runs["full"][k], runs["lora"][k]
        print(f"  {label:<32}{fmt.format(f):>14}{fmt.format(lo):>14}{lo / f:>11.3f}")
    for label, k in (("trained parameter bytes", "trainable_bytes"), ("optimizer state bytes", "optimizer_state_bytes"),
                     ("trainer peak RSS bytes", "peak_rss_bytes")):
        f, lo = runs["full"]["memory"][k], runs["lora"]["memory"][k]
        print(f"  {label:<32}{f:>14,}{lo:>14,}{lo / f:>11.3f}")
    print(f"  {'whole run (s)':<32}{runs['full']['wall_s']:>14.1f}{runs['lora']['wall_s']:>14.1f}")

    d = decode_timings(runs["lora"]["model_path"], runs["lora"]["checkpoint"], lora_cfg, args.rounds)
    base = d["decode_s"]["base (no LoRA)"]
    print(f"HF engine, one rollout unit (128 samples x 6 tokens, 1 thread, best of {args.rounds}), the LoRA run's "
          f"final adapter:")
    for name, s in d["decode_s"].items():
        print(f"  {name:<22} {1000 * s:8.1f} ms  ({s / base:.2f}x base)")
    apply_ms = {k: 1000 * v for k, v in d["apply_s"].items()}
    print(f"  applying one version: merge {apply_ms['merge']:.2f} ms, peft {apply_ms['peft']:.2f} ms; "
          f"same samples merged or peft: {d['same_samples']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
