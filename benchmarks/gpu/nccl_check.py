"""GPU check for the nccl route: CuPy's NCCL communicator between a trainer and engines (transfer/nccl.py).

On a CUDA machine with CuPy (`pip install 'loongsage[cupy]'`), in Ray actors:
  1. handshake: the trainer's link makes NCCL's unique id; the driver carries it through Ray to
     an engine actor, which takes its rank from it (every GPU count);
  2. one rank: a communicator of the trainer alone forms, and one version's buckets go through its
     broadcasts and waits (what every publish runs, on any GPU count);
  3. with 2+ GPUs: the TransferMesh plans nccl between a trainer on GPU 0 and an engine on GPU 1,
     publishes bf16 states of each --sizes, and the engine's bytes equal the trainer's (checksums on
     the devices); GB/s beside a device-to-device copy of the same bytes;
  4. with 2+ GPUs: the trainer's own torch.distributed group (world 1, nccl) is the same group
     after the publishes and still all-reduces: the weight update never joined it.
It ends with one table (check, PASS/FAIL/skipped, what was seen); status 1 if a check failed.

    python benchmarks/gpu/nccl_check.py [--sizes 256M,1G] [--bucket-bytes 256M]

Without CUDA or CuPy it says which and exits with status 1."""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[0] = ROOT     # the repository first; not this folder
sys.path.insert(1, os.path.join(ROOT, "benchmarks", "gpu"))
from transfer_check import GpuEngine, GpuTrainer, d2d_gbps, parse_size  # noqa: E402

import transfer  # noqa: E402
from stages.transfer_config import TransferConfig  # noqa: E402


class GroupTrainer(GpuTrainer):
    """A trainer that runs a torch.distributed group of its own (as every trainer does), world 1."""

    def __init__(self, nbytes: int):
        super().__init__(nbytes)
        import torch.distributed as dist

        dist.init_process_group("nccl", store=dist.HashStore(), world_size=1, rank=0)
        self.group = dist.group.WORLD

    def own_group(self) -> tuple[int, float, bool]:
        """(its world size, an all-reduce of 1.0 on it): the trainer's group still works, unchanged."""
        import torch.distributed as dist

        t = torch.ones(1, device="cuda")
        dist.all_reduce(t, group=self.group)
        return dist.get_world_size(self.group), float(t.item()), dist.group.WORLD is self.group

    def one_rank(self, bucket_bytes: int) -> str:
        """A version through a communicator of this process alone (world 1: no peer to wait for)."""
        from transfer.layout import Layout
        from transfer.nccl import NcclSend
        from transfer.staging import Snapshot

        cfg = TransferConfig(bucket_bytes=bucket_bytes, timeout_s=60)
        party = self.mesh_endpoint.describe_sender()
        link = NcclSend("one-rank", [], cfg, party, None)
        layout = Layout.of(self.state, bucket_bytes)
        t0 = time.perf_counter()
        link.send(Snapshot(1, self.state, layout, None))
        link.close()
        return f"{layout.num_buckets} buckets in {time.perf_counter() - t0:.2f}s"

    def address(self, receivers: list[str]) -> dict:
        from transfer.nccl import NcclSend

        cfg = TransferConfig(timeout_s=60)
        link = NcclSend("handshake", receivers, cfg, self.mesh_endpoint.describe_sender(), None)
        return link.prepare(None)


class HandshakeEngine(GpuEngine):
    def take(self, address: dict, name: str) -> tuple[int, int]:
        from transfer.nccl import handshake

        world, _, rank = handshake(address, name)
        return world, rank


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="256M,1G")
    p.add_argument("--bucket-bytes", type=parse_size, default=256 << 20)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("nccl_check: no CUDA GPU visible; the nccl route needs one. Nothing was checked.")
        return 1
    if importlib.util.find_spec("cupy") is None:
        print("nccl_check: CuPy is not installed (pip install 'loongsage[cupy]'). Nothing was checked.")
        return 1
    import ray
    from cupy.cuda import nccl

    gpus = torch.cuda.device_count()
    ray.init(address="local", num_gpus=gpus, log_to_driver=False, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT + os.pathsep + os.path.join(ROOT, "benchmarks", "gpu")}})
    print(f"{torch.cuda.get_device_name()} x{gpus}, torch {torch.__version__}, NCCL {nccl.get_version()}, "
          f"bucket {args.bucket_bytes >> 20} MiB")
    table: list[tuple[str, str, str]] = []
    share = 1 if gpus >= 2 else 0.5
    opts = dict(num_cpus=0.1, max_concurrency=4, num_gpus=share)
    small = 64 << 20
    trainer = ray.remote(**opts)(GroupTrainer).remote(small)
    engine = ray.remote(**opts)(HandshakeEngine).remote(small)

    address = ray.get(trainer.address.remote(["engine0", "engine1"]))
    world, rank = ray.get(engine.take.remote(address, "engine1"))
    table.append(("handshake through Ray", "PASS" if (world, rank) == (3, 2) else "FAIL",
                  f"unique id of {len(address['unique_id'])} bytes; engine1 takes rank {rank} of {world}"))
    try:
        table.append(("one-rank communicator", "PASS", ray.get(trainer.one_rank.remote(args.bucket_bytes))))
    except Exception as e:  # noqa: BLE001 - reported in the table
        table.append(("one-rank communicator", "FAIL", repr(e)[:160]))
    for actor in (trainer, engine):
        ray.kill(actor)

    if gpus < 2:
        table.append(("nccl publish across GPUs", "skipped", f"needs 2 GPUs, this machine has {gpus}"))
    versions = iter(range(1, 1 << 30))
    for size in (args.sizes.split(",") if gpus >= 2 else []):
        nbytes = parse_size(size)
        trainer = ray.remote(**opts)(GroupTrainer).remote(nbytes)
        engine = ray.remote(**opts)(GpuEngine).remote(nbytes)
        mesh = transfer.TransferMesh(trainer, {"engine": engine},
                                     TransferConfig(bucket_bytes=args.bucket_bytes, timeout_s=120))
        route = mesh.plan()["engine"]
        best = float("inf")
        for _ in range(args.repeats + 1):          # the first publish forms the communicator
            t0 = time.perf_counter()
            mesh.publish(next(versions))
            best = min(best, time.perf_counter() - t0)
        same = ray.get(trainer.digest.remote()) == ray.get(engine.digest.remote())
        gbps, d2d = nbytes / best / 1e9, d2d_gbps(nbytes, args.repeats)
        table.append((f"nccl publish {size}", "PASS" if same and route.transport == "nccl" else "FAIL",
                      f"route {route.transport}; {gbps:.1f} GB/s ({gbps / d2d:.2f}x d2d {d2d:.0f} GB/s); "
                      f"bytes {'equal' if same else 'DIFFER'}"))
        size_, value, same_group = ray.get(trainer.own_group.remote())
        table.append((f"trainer's group after {size}", "PASS" if (size_, value, same_group) == (1, 1.0, True)
                      else "FAIL", f"world {size_}, all-reduce {value}, same group object {same_group}"))
        mesh.close()
        for actor in (trainer, engine):
            ray.kill(actor)
    ray.shutdown()
    width = max(len(n) for n, _, _ in table)
    print(f"\n{'check':<{width}}  {'result':<7}  seen")
    for name, result, seen in table:
        print(f"{name:<{width}}  {result:<7}  {seen}")
    failed = [n for n, r, _ in table if r == "FAIL"]
    print("nccl_check:", "OK" if not failed else f"FAILED {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
