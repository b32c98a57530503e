"""The memory floor of a run's process layout, with none of the run's own work in it.

    python benchmarks/ray_floor.py [--torch] [--hold 6]

Starts Ray as `loongsage run` does (pipeline.cluster.init_ray with configs/quickstart.yaml: a local head,
no dashboard, no autoscaler or log monitor), then the processes a 1-engine run has, each doing nothing:
an "engine" and a "trainer" actor, the window gate and span sink actors, and a Ray Data stream of 8 rows
through two actor stages ("rollout", "reward"), one actor each, read by the driver. With --torch, the
driver, engine and trainer import torch (as they do in a run) and nothing more. While the stream's
actors are alive, the script samples every process under it (psutil, 0.2 s) for `--hold` seconds and
prints the peak of the summed RSS and PSS and each process's share: what any run with this layout holds
before it loads a model, a tokenizer or a prompt.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.long_context import TreeWatch  # noqa: E402


class Idle:
    """An actor that holds nothing; with torch=True it imports torch, as the engine and trainer do."""

    def __init__(self, torch: bool):
        if torch:
            import torch  # noqa: F401

    def ping(self) -> int:
        return os.getpid()


class Stage:
    """A Ray Data actor stage that passes its batch on and reports its pid."""

    def __init__(self, hold: float):
        self.hold = hold

    def __call__(self, batch):
        time.sleep(self.hold)
        batch["pid"] = [os.getpid()] * len(batch["id"])
        return batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--torch", action="store_true", help="the driver, engine and trainer import torch")
    p.add_argument("--hold", type=float, default=6.0, help="seconds the stream's actors stay busy")
    a = p.parse_args()
    watch = TreeWatch(os.getpid(), every=0.2)
    import ray
    import ray.data

    from pipeline.cluster import init_ray, on_driver_node
    from pipeline.config import load_config

    if a.torch:
        import torch  # noqa: F401
    cfg = load_config(str(ROOT / "configs" / "quickstart.yaml"), [])
    init_ray(cfg, 2)
    actor = ray.remote(Idle)
    helpers = [actor.options(num_cpus=0).remote(a.torch) for _ in range(2)]                       # engine, trainer
    helpers += [actor.options(num_cpus=0, **on_driver_node()).remote(False) for _ in range(2)]   # gate, span sink
    ray.get([h.ping.remote() for h in helpers])
    ds = ray.data.range(8, override_num_blocks=2)
    ds = ds.map_batches(Stage, fn_constructor_args=(a.hold / 2,), batch_size=4, num_cpus=0.5,
                        compute=ray.data.ActorPoolStrategy(size=1))
    ds = ds.map_batches(Stage, fn_constructor_args=(a.hold / 2,), batch_size=4, num_cpus=0.5,
                        compute=ray.data.ActorPoolStrategy(size=1))
    rows = sum(len(b["id"]) for b in ds.iter_batches(batch_size=4))
    watch.stop()
    ray.shutdown()
    print(f"torch in driver, engine, trainer: {'yes' if a.torch else 'no'}; rows through the stream: {rows}")
    print(f"peak RSS sum {watch.rss / 2**30:.2f} GB, peak PSS sum {watch.pss / 2**30:.2f} GB, "
          f"{len(watch.at_pss_peak)} processes at the PSS peak")
    for rss, pss, name in watch.at_pss_peak:
        print(f"  {rss / 2**20:6.0f} MB RSS  {pss / 2**20:6.0f} MB PSS  {name[:90]}")


if __name__ == "__main__":
    main()
