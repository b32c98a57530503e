"""The trainer's floor: the update as the pipeline runs it against a bare torch loop doing its work.

    python benchmarks/trainer_floor.py [--bench-dir ../shared/bench/add-tiny] [--rollouts RUN/rollouts]
                                       [--rounds 5] [--steps 4] [--profile] [key=value ...]

Workload: configs/add_tiny.yaml on the add-tiny model (987k parameters). The rows are a real
run's: the trained rows of `--rollouts` (a recorded dataset), or, without it, of a short run
this script makes first (`loongsage run configs/add_tiny.yaml run.steps=STEPS eval.every=0`,
same seed). Each recorded step is one update's input: the recipe's 128 samples (32 groups x 4), ~1,800 tokens.

Three ways to do the same updates, each from the same initial weights and optimizer, over
the same recorded steps (after one untimed warm-up update each), in alternating rounds
(bare, in-process, actor, bare, ...):

    bare        a plain loop written here: the step's tensors built once beforehand; per
                mini-batch (the trainer's own split and order) forward over the padded rows, or
                packed by prompt under trainer.share_prompts (only those with a nonzero advantage,
                under trainer.skip_zero_advantage and no entropy term on the others, as the trainer;
                every row on a decoupled update's first mini-batch, which the trainer forwards whole
                to measure the engine/trainer mismatch), the
                sampled tokens' log-probs, the clipped policy-gradient loss (decoupled: the engine's
                log-probs are the old policy), the entropy term of algorithm.entropy_coef, backward,
                grad clip, AdamW (the recipe's settings)
    in-process  TorchTrainer.train_step(table) called directly: Arrow -> tensors, advantages,
                metrics, the same mini-batches
    actor       the TorchTrainer Ray actor as the pipeline calls it: ray.get(train_step.remote(table))

Printed: per-update median seconds per way and round, and the ratios in-process/bare and
actor/bare (the issue's target: the pipeline's update within 1.3x of the bare loop), torch
threads of each. --profile adds torch.profiler's top operators for one in-process update.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)     # the repository first; not this folder (its transfer.py names the package)


def recorded_steps(path: Path) -> list:
    import pyarrow.parquet as pq

    steps = sorted(p for p in path.glob("step=*") if p.is_dir())
    if not steps:
        raise SystemExit(f"{path}: no step=* partitions (a run's RUN/rollouts directory)")
    return [pq.read_table(p) for p in steps]


def record(bench: Path, steps: int, overrides: list[str]) -> Path:
    run_dir = Path(tempfile.mkdtemp(prefix="trainer-floor-"))
    cmd = [sys.executable, "-m", "pipeline.cli", "run", str(ROOT / "configs/add_tiny.yaml"),
           f"model.path={bench}", f"data.path={bench / 'train.parquet'}", f"data.test_path={bench / 'test.parquet'}",
           f"run.steps={steps}", "eval.every=0", "eval.num_prompts=0", *overrides, "--run-dir", str(run_dir)]
    print("recording:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return run_dir / "rollouts"


def _equal_reward_rows(table) -> int:
    from collections import defaultdict

    groups = defaultdict(set)
    for g, r in zip(table.column("group_id").to_pylist(), table.column("reward").to_pylist()):
        groups[g].add(r)
    sizes = defaultdict(int)
    for g in table.column("group_id").to_pylist():
        sizes[g] += 1
    return sum(sizes[g] for g, rs in groups.items() if len(rs) == 1)


class Bare:
    """The update's arithmetic and nothing else, on tensors built before the clock starts."""

    def __init__(self, model_path: str, cfg, algo, threads: int):
        import torch

        from stages.model import load_model

        torch.set_num_threads(threads)
        torch.manual_seed(cfg.seed)
        self.torch, self.cfg, self.algo = torch, cfg, algo
        self.model = load_model(model_path, "float32")
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        import numpy as np

        self.rng = np.random.default_rng(cfg.seed)
        self.pad = self.model.config.pad_token_id or 0

    def prepare(self, table):
        """Everything the loop needs as tensors: ids, response positions/ids, mask, old log-probs, advantages."""
        from stages.update.step import task_advantages, to_batch

        b = to_batch(table, self.pad)
        adv, mask = task_advantages(self.algo, b)
        return b, adv, mask

    def step(self, prepared) -> None:
        import numpy as np

        from stages.update.step import mini_batches
        from stages.update.trainer import pack_shared_prompts

        torch = self.torch
        b, adv, mask = prepared
        lo, hi = 1 - self.algo.clip_low, 1 + self.algo.clip_high
        live = ((adv * mask) != 0).any(1)
        ent_coef = self.algo.entropy_coef
        # as the trainer: an entropy term reaches every row, so none is skipped then, unless
        # algorithm.entropy_rows=trained keeps it to the rows with a nonzero advantage
        trained_only = self.algo.entropy_rows == "trained"
        skip = self.cfg.skip_zero_advantage and (ent_coef == 0 or trained_only)
        for i, idx in enumerate(mini_batches(self.cfg, self.rng, b)):
            full = torch.as_tensor(np.sort(idx))
            # trainer.skip_zero_advantage: rows whose advantage is 0 everywhere add no gradient; their
            # tokens stay in the denominator. As the trainer, not on the first mini-batch of a decoupled
            # update: it forwards every row there, to measure the engine/trainer mismatch on them
            rows = full[live[full]] if skip and not (i == 0 and self.algo.decoupled) else full
            denom = mask[full].sum().clamp(min=1)
            self.opt.zero_grad(set_to_none=True)
            if len(rows) == 0:
                for q in self.params:
                    q.grad = torch.zeros_like(q)
                self.opt.step()
                continue
            ids, m = b.input_ids[rows], mask[rows]
            packed = pack_shared_prompts(b, rows, self.pad) if self.cfg.share_prompts else None
            if packed is not None:      # trainer.share_prompts: a group's prompt once, as the trainer does
                logits = self.model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                                    attention_mask=packed.mask, use_cache=False).logits
                picked = logits[packed.row[:, None], packed.pos]
            else:
                width = int(b.attn[rows].sum(1).max())
                logits = self.model(input_ids=ids[:, :width], use_cache=False).logits
                pos = b.resp_pos[rows]
                picked = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1]))
            logp = torch.log_softmax(picked, -1)
            lp = logp.gather(-1, b.resp_ids[rows][..., None])[..., 0]
            ratio = torch.exp(lp - b.engine_lp[rows])
            a = adv[rows]
            obj = torch.minimum(ratio * a, ratio.clamp(lo, hi) * a)
            loss = -(obj * m).sum() / denom
            if ent_coef:        # algorithm.entropy_coef: - coef x token-mean entropy
                em = m * live[rows][:, None] if trained_only else m
                loss = loss - ent_coef * ((-(logp.exp() * logp).sum(-1)) * em).sum() / denom
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip, foreach=True)
            self.opt.step()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bench-dir", type=Path, default=ROOT.parent / "shared/bench/add-tiny")
    p.add_argument("--rollouts", type=Path)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="recorded steps to make when --rollouts is not given")
    p.add_argument("--profile", action="store_true")
    a, overrides = p.parse_known_args()

    import ray
    import torch

    from pipeline.cluster import init_ray
    from pipeline.config import load_config
    from pipeline.resources import plan_resources
    from stages.update.trainer import TorchTrainer

    bench = a.bench_dir.resolve()
    cfg = load_config(str(ROOT / "configs/add_tiny.yaml"), [
        f"model.path={bench}", f"data.path={bench / 'train.parquet'}", f"data.test_path={bench / 'test.parquet'}",
        *overrides])
    tables = recorded_steps(a.rollouts or record(bench, a.steps, overrides))
    res = plan_resources(cfg)
    threads = res.trainer_threads
    tcfg = cfg.trainer.__class__(**{**cfg.trainer.__dict__, "num_threads": threads})
    algo = cfg.algorithm.resolved()
    tokens = [sum(len(x) for x in t.column("response_ids").to_pylist()) + sum(len(x) for x in t.column(
        "prompt_ids").to_pylist()) for t in tables]
    equal = [_equal_reward_rows(t) for t in tables]
    print(f"{len(tables)} recorded steps: {[t.num_rows for t in tables]} rows, {tokens} tokens, {equal} rows in "
          f"groups of equal rewards; mini_batch_size {tcfg.mini_batch_size} ({tcfg.mini_batch_split}), "
          f"skip_zero_advantage {tcfg.skip_zero_advantage}, share_prompts {tcfg.share_prompts}, "
          f"torch threads {threads} (pipeline/resources.py)", flush=True)

    init_ray(load_config(None, ["run.ray_num_cpus=2"]), 2)
    model = str(bench)
    times: dict[str, list[float]] = {"bare": [], "in-process": [], "actor": []}
    per_round: list[dict] = []
    for r in range(a.rounds):
        rnd = {}
        bare = Bare(model, tcfg, algo, threads)
        prepared = [bare.prepare(t) for t in tables]
        bare.step(prepared[0])      # warm-up, untimed (each way gets one: first calls allocate)
        t0 = time.perf_counter()
        for pr in prepared:
            bare.step(pr)
        rnd["bare"] = (time.perf_counter() - t0) / len(tables)
        del bare

        torch.set_num_threads(threads)
        local = TorchTrainer(model, tcfg, cfg.algorithm, cfg.sampling.temperature, cfg.sampling.max_new_tokens)
        if a.profile and r == 0:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                local.train_step(tables[0])
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), flush=True)
            local = TorchTrainer(model, tcfg, cfg.algorithm, cfg.sampling.temperature, cfg.sampling.max_new_tokens)
        local.train_step(tables[0])
        t0 = time.perf_counter()
        for t in tables:
            local.train_step(t)
        rnd["in-process"] = (time.perf_counter() - t0) / len(tables)
        del local

        actor = ray.remote(TorchTrainer).options(num_cpus=res.trainer_cpus).remote(
            model, tcfg, cfg.algorithm, cfg.sampling.temperature, cfg.sampling.max_new_tokens)
        ray.get(actor.info.remote())
        refs = [ray.put(t) for t in tables]
        ray.get(actor.train_step.remote(refs[0]))
        t0 = time.perf_counter()
        for ref in refs:
            ray.get(actor.train_step.remote(ref))
        rnd["actor"] = (time.perf_counter() - t0) / len(tables)
        ray.kill(actor)
        for k, v in rnd.items():
            times[k].append(v)
        per_round.append(rnd)
        print(f"round {r + 1}: " + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in rnd.items())
              + f"  in-process/bare {rnd['in-process'] / rnd['bare']:.2f}  actor/bare {rnd['actor'] / rnd['bare']:.2f}",
              flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = [x["actor"] / x["bare"] for x in per_round]
    print(f"median per update: bare {med['bare'] * 1e3:.1f} ms, in-process {med['in-process'] * 1e3:.1f} ms, "
          f"actor {med['actor'] * 1e3:.1f} ms; actor/bare per round {[round(x, 2) for x in ratios]}, "
          f"median {statistics.median(ratios):.2f} (target <= 1.3)")
    ray.shutdown()


if __name__ == "__main__":
    main()
