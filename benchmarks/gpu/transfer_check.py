"""GPU check for the TransferMesh: CUDA IPC (same GPU) and NCCL (GPU to GPU) routes.

On a CUDA machine: publishes bf16 state dicts from a trainer actor to an engine actor
over each GPU route the machine allows, verifies every tensor's bytes on the engine
against the trainer's (per-tensor checksums computed on the devices), and prints GB/s
beside a device-to-device copy of the same bytes (cudaMemcpy D2D via torch, the limit).

    python benchmarks/gpu/transfer_check.py [--sizes 256M,1G,4G] [--bucket-bytes 1G]

CUDA IPC needs one GPU (two actors share it); NCCL needs two and CuPy (the `cupy` extra).
Without CUDA it says so and exits with status 1."""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[0] = ROOT     # the repository first; not this folder
import transfer  # noqa: E402
from stages.transfer_config import TransferConfig  # noqa: E402
from transfer.layout import as_bytes  # noqa: E402

TENSOR_BYTES = 64 << 20


def make_state(nbytes: int, fill: float) -> dict[str, torch.Tensor]:
    n, state = max(1, nbytes // TENSOR_BYTES), {}
    for i in range(n):
        state[f"layers.{i}.weight"] = torch.full((TENSOR_BYTES // 2,), fill,
                                                 dtype=torch.bfloat16, device="cuda")
    return state


class GpuEngine:
    def __init__(self, nbytes: int):
        self.state = make_state(nbytes, 0.0)
        self.version = 0
        self.mesh_endpoint = transfer.Receiver(target=self, device="cuda")

    def mesh(self, method, *args, **kwargs):
        return getattr(self.mesh_endpoint, method)(*args, **kwargs)

    def weight_specs(self):
        return {n: (tuple(t.shape), t.dtype) for n, t in self.state.items()}

    def load_weights(self, named_tensors, version):
        for n, t in named_tensors.items():
            self.state[n].copy_(t)
        torch.cuda.synchronize()
        self.version = version

    def weight_version(self):
        return self.version

    def digest(self):
        return {n: transfer.checksum(as_bytes(t)) for n, t in self.state.items()}


class GpuTrainer(GpuEngine):
    def __init__(self, nbytes: int):
        self.state = make_state(nbytes, 1.0)
        for i, t in enumerate(self.state.values()):     # distinct bytes per tensor
            t.add_(torch.arange(t.numel(), device="cuda", dtype=torch.float32).remainder_(
                251 + i).to(torch.bfloat16))
        self.mesh_endpoint = transfer.Sender(state_fn=lambda: self.state, device="cuda")


def d2d_gbps(nbytes: int, repeats: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def check_route(ray, route: str, gpus_each: float, nbytes: int, args, versions) -> tuple:
    opts = dict(num_cpus=0.1, max_concurrency=4, num_gpus=gpus_each)
    trainer = ray.remote(**opts)(GpuTrainer).remote(nbytes)
    engine = ray.remote(**opts)(GpuEngine).remote(nbytes)
    cfg = TransferConfig(bucket_bytes=args.bucket_bytes, timeout_s=120)
    mesh = transfer.TransferMesh(trainer, {"engine": engine}, cfg)
    planned = mesh.plan()["engine"]
    print(mesh.topology_table())
    if planned.transport != route:
        raise SystemExit(f"expected the {route} route, planned {planned}")
    best = float("inf")
    for _ in range(args.repeats + 1):           # the first publish warms up
        t0 = time.perf_counter()
        mesh.publish(next(versions))
        best = min(best, time.perf_counter() - t0)
    same = ray.get(trainer.digest.remote()) == ray.get(engine.digest.remote())
    mesh.close()
    for actor in (trainer, engine):
        ray.kill(actor)
    return nbytes / best / 1e9, same


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="256M,1G,4G")
    p.add_argument("--bucket-bytes", type=parse_size, default=256 << 20)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("transfer_check: no CUDA GPU visible (torch.cuda.is_available() is False); "
                 "this check runs the CUDA IPC and NCCL routes and needs a GPU machine.")
    import ray
    gpus = torch.cuda.device_count()
    ray.init(address="local", num_gpus=gpus, log_to_driver=False, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    from transfer.nccl import available as nccl_available

    routes = [("cuda_ipc", 0.5)] + ([("nccl", 1)] if gpus >= 2 and nccl_available() else [])
    if gpus < 2:
        print(f"nccl: skipped, needs 2 GPUs (this machine has {gpus}); benchmarks/gpu/nccl_check.py checks the rest")
    elif not nccl_available():
        print("nccl: skipped, CuPy is not installed (pip install 'loongsage[cupy]')")
    print(f"{torch.cuda.get_device_name()} x{gpus}, torch {torch.__version__}, bucket "
          f"{args.bucket_bytes >> 20} MiB, best of {args.repeats}")
    versions = iter(range(1, 1 << 30))
    rows, ok = [], True
    for size in args.sizes.split(","):
        nbytes = parse_size(size)
        d2d = d2d_gbps(nbytes, args.repeats)
        rows.append((size, "d2d copy", d2d, 1.0, "-"))
        for route, gpus_each in routes:
            gbps, same = check_route(ray, route, gpus_each, nbytes, args, versions)
            ok &= same
            rows.append((size, route, gbps, gbps / d2d, "yes" if same else "NO"))
    print(f"\n{'size':>6}  {'route':<9} {'GB/s':>8} {'x d2d':>7}  bytes equal")
    for size, route, gbps, ratio, same in rows:
        print(f"{size:>6}  {route:<9} {gbps:8.1f} {ratio:7.2f}  {same}")
    ray.shutdown()
    sys.exit(0 if ok else "transfer_check: bytes differ after transfer")


if __name__ == "__main__":
    main()
