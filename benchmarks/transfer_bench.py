"""How fast does the TransferMesh move a state dict, against the physical limit?

For each state-dict size and 1 or 2 receivers, prints GB/s for every CPU transport
beside the machine's memcpy for the same bytes (one thread, into memory already
touched: the limit for one copy) and a naive baseline (per-tensor ray.put in the
trainer, ray.get in each engine). GB/s is the state size over the time from publish
to every receiver having loaded it. All actors live on this one node; gloo and zmq
run over loopback.

    python benchmarks/transfer_bench.py                      # 64M, 256M, 1G
    python benchmarks/transfer_bench.py --sizes 16M,64M      # quicker

Target (issue 4): shm >= 0.5x memcpy and >= 2x naive at 1 GB."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))    # the repository's packages

import ray  # noqa: E402
import torch  # noqa: E402

import transfer  # noqa: E402
from stages.transfer_config import TransferConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TENSOR_BYTES = 16 << 20     # a state dict of 16 MiB matrices plus a few small vectors

# Rows per transport: (label, trainer keeps its weights in the shared segment, engines
# copy each bucket into the model as it lands). The first shm row is what the torch
# trainer and the HF engine do; the others show what each of the two saves.
VARIANTS = {"shm": [("shm", True, True),
                    ("shm, sender packs", False, True),
                    ("shm, land+load", False, False)]}


def make_state(nbytes: int, fill: float) -> dict[str, torch.Tensor]:
    state, left, i = {}, nbytes, 0
    while left > 0:
        n = min(TENSOR_BYTES, left)
        state[f"layers.{i}.weight"] = torch.full((n // 4,), fill, dtype=torch.float32)
        state[f"layers.{i}.bias"] = torch.full((1024,), fill, dtype=torch.float32)
        left -= n + 4096
        i += 1
    return state


class Engine:
    def __init__(self, nbytes: int):
        torch.set_num_threads(1)
        self.state = make_state(nbytes, 0.0)
        self.version = 0
        self.lock = threading.Lock()
        self.mesh_endpoint = transfer.Receiver(target=self)

    def mesh(self, method, *args, **kwargs):
        return getattr(self.mesh_endpoint, method)(*args, **kwargs)

    def weight_specs(self):
        return {n: (tuple(t.shape), t.dtype) for n, t in self.state.items()}

    def load_weights(self, named_tensors, version):
        with self.lock:
            for n, t in named_tensors.items():
                self.state[n].copy_(t)
            self.version = version

    @contextlib.contextmanager
    def weights_in_place(self, version):
        """What the HF engine offers: the live tensors, so each verified bucket is copied
        into them while the next one travels."""
        with self.lock:
            yield self.state
            self.version = version

    def weight_version(self):
        return self.version

    def load_refs(self, refs, version):
        """The naive baseline: fetch each tensor from the object store, then load."""
        self.load_weights(dict(zip(self.state, ray.get(refs))), version)

    def checksum(self):
        return sum(float(t[0]) for t in self.state.values())


class Trainer:
    def __init__(self, nbytes: int):
        torch.set_num_threads(1)
        self.state = make_state(nbytes, 1.0)
        self.mesh_endpoint = transfer.Sender(state_fn=lambda: self.state)
        self.colocated = Engine(nbytes)

    def share(self, on: bool):
        """on: keep the weights in the sender's shared segment from the next publish (what
        the torch trainer does); off: private weights again, so each version is packed."""
        self.mesh_endpoint.adopt_fn = self.state.update if on else None
        if not on:
            self.state = {n: t.clone() for n, t in self.state.items()}

    def mesh(self, method, *args, **kwargs):
        endpoint = self.mesh_endpoint
        if not hasattr(endpoint, method):
            endpoint = self.colocated.mesh_endpoint
        return getattr(endpoint, method)(*args, **kwargs)

    def put_state(self):
        return [ray.put(t) for t in self.state.values()]


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    torch.set_num_threads(1)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)     # touched: no page faults in the timing
    return nbytes / _best(lambda: dst.copy_(src), repeats) / 1e9


def _best(fn, repeats: int) -> float:
    fn()                                             # warm up (first touch, connections)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def run_size(nbytes: int, args, versions) -> list[tuple]:
    opts = dict(num_cpus=0.1, max_concurrency=4)
    trainer = ray.remote(**opts)(Trainer).remote(nbytes)
    engines = [ray.remote(**opts)(Engine).remote(nbytes) for _ in range(2)]
    ray.get([trainer.put_state.remote()] + [e.weight_version.remote() for e in engines])
    rows = [("memcpy", 1, memcpy_gbps(nbytes, args.repeats))]
    for n in (1, 2):
        picked = engines[:n]

        def naive():
            refs = ray.get(trainer.put_state.remote())
            ray.get([e.load_refs.remote(refs, 0) for e in picked])  # noqa: B023 - called within this iteration
        rows.append(("naive ray.put/get", n, nbytes / _best(naive, args.repeats) / 1e9))
        for t in args.transports:
            if t == "inproc" and n > 1:
                continue                 # only the colocated engine shares the process
            receivers = {"self": trainer} if t == "inproc" else {
                f"engine{i}": e for i, e in enumerate(picked)}
            for label, shared, in_place in VARIANTS.get(t, [(t, False, True)]):
                ray.get(trainer.share.remote(shared))
                cfg = TransferConfig(transport=t, bucket_bytes=args.bucket_bytes,
                                              timeout_s=120, apply_in_place=in_place)
                mesh = transfer.TransferMesh(trainer, receivers, cfg)
                mesh.plan()
                seconds = _best(lambda: mesh.publish(next(versions)), args.repeats)  # noqa: B023 - called now
                mesh.close()
                rows.append((label, n, nbytes / seconds / 1e9))
    for actor in [trainer, *engines]:
        ray.kill(actor)
    return rows


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64M,256M,1G")
    p.add_argument("--transports", default="inproc,shm,gloo,zmq")
    p.add_argument("--bucket-bytes", type=parse_size, default=16 << 20)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    args.transports = args.transports.split(",")
    ray.init(address="local", num_cpus=4, log_to_driver=False, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    versions = iter(range(1, 1 << 30))
    print(f"{os.cpu_count()} cores, torch {torch.__version__}, bucket "
          f"{args.bucket_bytes >> 20} MiB, best of {args.repeats}\n")
    print(f"{'size':>6} {'receivers':>9}  {'route':<18} {'GB/s':>7} {'x memcpy':>9} {'x naive':>8}")
    verdict = []
    for size in args.sizes.split(","):
        nbytes = parse_size(size)
        rows = run_size(nbytes, args, versions)
        memcpy = rows[0][2]
        naive = {n: g for r, n, g in rows if r.startswith("naive")}
        for route, n, gbps in rows:
            vs_naive = f"{gbps / naive[n]:8.1f}" if route != "memcpy" else f"{'':8}"
            print(f"{size:>6} {n:>9}  {route:<18} {gbps:7.2f} {gbps / memcpy:9.2f} {vs_naive}")
            if route == "shm" and n == 1 and nbytes >= 1 << 30:
                verdict.append((gbps / memcpy, gbps / naive[n]))
        print()
    for x_memcpy, x_naive in verdict:
        ok = x_memcpy >= 0.5 and x_naive >= 2
        print(f"target at 1 GB, shm to 1 receiver: {x_memcpy:.2f}x memcpy (>= 0.5), "
              f"{x_naive:.1f}x naive (>= 2): {'met' if ok else 'NOT met'}")
    ray.shutdown()


if __name__ == "__main__":
    main()
