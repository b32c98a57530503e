"""vLLM against the embedded HF engine: the same model, the same workloads, one invocation.

    python benchmarks/engines.py --bench-dir ../shared/bench/add-tiny            # needs `.[vllm]`
    python benchmarks/engines.py --bench-dir DIR --steps 0                       # engines only, no recipe runs

1. Rollout tokens/s at 1, 8 and 64 concurrent requests: that many client threads, each sending
   one-row generate calls (a test prompt, T=1, <= 6 new tokens, log-probs) to one engine actor
   until --seconds have passed; generated tokens over wall time.
2. Time to land one weight version: a TorchTrainer actor publishes a version over the
   TransferMesh (shared memory) to the engine, which loads it between two steps (median of 5).
3. End-to-end: configs/add_tiny.yaml with engine.kind=hf and =vllm for --steps steps each:
   samples/s of training wall time (evaluations excluded) and the training time to 0.6 accuracy.
Prints one table with the ratio vLLM / HF per row.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)     # the repository first; not this folder (its transfer.py names the package)

import pyarrow.parquet as pq  # noqa: E402
import ray  # noqa: E402

ENGINES = ("hf", "vllm")


def start_engine(kind: str, model: str, threads: int):
    from stages.agentflow.engine import HFEngine
    from stages.agentflow.vllm_engine import VLLMConfig, VLLMEngine

    cls, extra = {"hf": (HFEngine, ()), "vllm": (VLLMEngine, (VLLMConfig(),))}[kind]
    e = ray.remote(cls).options(num_cpus=0.1, max_concurrency=80).remote(model, "float32", 0, threads,
                                                                          "engine0", *extra)
    ray.get(e.info.remote())
    return e


def prompts(bench: Path, tok) -> list[list[int]]:
    texts = pq.read_table(bench / "test.parquet").column("prompt").to_pylist()
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def tokens_per_s(engine, ids: list[list[int]], clients: int, seconds: float) -> float:
    """`clients` threads, each sending one-row calls back to back until `seconds` are up."""
    counts, stop = [0] * clients, time.perf_counter() + seconds

    def client(k: int) -> None:
        i = k
        while time.perf_counter() < stop:
            row = {"prompt_ids": ids[i % len(ids)], "max_new_tokens": 6, "temperature": 1.0, "seed": i}
            counts[k] += len(ray.get(engine.generate.remote([row]))[0]["response_ids"])
            i += clients

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def land_seconds(engine, model: str, versions: int = 5) -> float:
    """Median wall time of mesh.publish(v): the trainer's snapshot, the copy, the engine's load."""
    import transfer
    from stages.transfer_config import TransferConfig
    from stages.update.losses import AlgorithmConfig
    from stages.update.trainer import TorchTrainer, TrainerConfig

    trainer = ray.remote(TorchTrainer).options(num_cpus=0.1, max_concurrency=2).remote(
        model, TrainerConfig(num_threads=1), AlgorithmConfig())
    mesh = transfer.TransferMesh(trainer, {"engine0": engine}, TransferConfig(transport="shm"))
    mesh.publish(1)     # the first sets up the links
    times = []
    for v in range(2, versions + 2):
        t = time.perf_counter()
        mesh.publish(v)
        times.append(time.perf_counter() - t)
    mesh.close()
    ray.kill(trainer)
    return statistics.median(times)


def recipe(kind: str, bench: Path, steps: int, extra: list[str]) -> tuple[float, float | None]:
    """(samples/s of training wall time, training seconds to 0.6) of add_tiny.yaml on `kind`."""
    from benchmarks.add_tiny import EARLY_ACC, accuracy_curve, bench_overrides
    from pipeline.config import load_config
    from pipeline.controller import run
    from pipeline.metrics import read_metrics

    cfg = load_config(str(ROOT / "configs" / "add_tiny.yaml"),
                      bench_overrides(bench) + [f"engine.kind={kind}", f"run.steps={steps}"] + extra)
    run_dir = Path(tempfile.mkdtemp(prefix=f"engines-{kind}-"))
    run(cfg, run_dir, log=lambda *_: None)
    curve = accuracy_curve(read_metrics(run_dir))
    per_step = cfg.batcher.groups_per_step * cfg.rollout.n_samples
    (s0, t0, _), (s1, t1, _) = curve[0], curve[-1]
    early = next((t for _, t, a in curve if a >= EARLY_ACC), None)
    print(f"  {kind}: run dir {run_dir}; curve " + ", ".join(f"{s}:{a:.3f}@{t:.0f}s" for s, t, a in curve),
          flush=True)
    return per_step * (s1 - s0) / max(t1 - t0, 1e-9), early


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bench-dir", default=str(ROOT.parent / "shared" / "bench" / "add-tiny"))
    p.add_argument("--seconds", type=float, default=10.0, help="per engine and concurrency")
    p.add_argument("--threads", type=int, default=2, help="torch threads per engine")
    p.add_argument("--steps", type=int, default=300, help="add_tiny.yaml steps per engine; 0 = skip")
    p.add_argument("overrides", nargs="*", help="section.key=value for both recipe runs")
    args = p.parse_args(argv)
    bench = Path(args.bench_dir).resolve()
    if not (bench / "test.parquet").is_file():
        print(f"error: {bench} is not the add-tiny folder (no test.parquet); pass --bench-dir", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from stages.model import load_tokenizer

    ids = prompts(bench, load_tokenizer(str(bench)))
    rows: dict[str, dict[str, float | None]] = {}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    for kind in ENGINES:
        t = time.perf_counter()
        engine = start_engine(kind, str(bench), args.threads)
        rows.setdefault("engine start (s)", {})[kind] = time.perf_counter() - t
        tokens_per_s(engine, ids, 64, 1.0)      # untimed: first calls build kernels for new batch shapes
        for c in (1, 8, 64):
            rows.setdefault(f"rollout tokens/s, {c} concurrent", {})[kind] = \
                tokens_per_s(engine, ids, c, args.seconds)
        rows.setdefault("land one version (s)", {})[kind] = land_seconds(engine, str(bench))
        ray.kill(engine)
        print(f"{kind}: " + ", ".join(f"{k} {v[kind]:.3g}" for k, v in rows.items()), flush=True)
    ray.shutdown()
    if args.steps:
        for kind in ENGINES:
            sps, early = recipe(kind, bench, args.steps, ["eval.every=25"] + args.overrides)
            rows.setdefault("add-tiny samples/s (training)", {})[kind] = sps
            rows.setdefault("add-tiny training s to 0.6", {})[kind] = early
    print(f"\n| {'measure':<34} | {'hf':>9} | {'vllm':>9} | vllm/hf |\n|{'-' * 36}|{'-' * 11}|{'-' * 11}|---------|")
    for name, v in rows.items():
        hf, vl = v.get("hf"), v.get("vllm")
        ratio = f"{vl / hf:.2f}" if hf and vl else "-"
        print(f"| {name:<34} | {_fmt(hf):>9} | {_fmt(vl):>9} | {ratio:>7} |")
    return 0


def _fmt(x: float | None) -> str:
    return "not hit" if x is None else f"{x:.3g}"


if __name__ == "__main__":
    sys.exit(main())
