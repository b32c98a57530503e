"""TransferMesh on real Ray actors: a two-raylet local cluster (two Ray node ids on one
machine), a toy trainer that also hosts a colocated engine, and toy engines on each node.

Routes are checked against the topology, every CPU transport must deliver bit-exact
weights, and the failure modes (corruption, a receiver dying mid-transfer) must surface
as TransferError within the timeout. GPU transports run only where CUDA is present."""
from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import sys
import threading
import time

import numpy as np
import pytest
import ray
import torch
from ray.cluster_utils import Cluster

import transfer
from stages.transfer_config import TransferConfig
from transfer import nccl
from transfer.staging import Board
from transfer.topology import Party

OWN_RAY = True      # a two-node Ray cluster of its own: it starts without the shared Ray

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET = 16 << 10          # small buckets: the toy model spans several, tensors straddle them
CFG = TransferConfig(bucket_bytes=BUCKET, timeout_s=10.0)
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

# The actor classes below live in this test module, which workers cannot import by name.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class ToyNet(torch.nn.Module):
    """Mixed dtypes and odd sizes, so layout alignment and byte views are exercised."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = torch.nn.Linear(64, 300)
        self.b = torch.nn.Linear(300, 33).to(torch.bfloat16)
        self.register_buffer("steps", torch.tensor(seed, dtype=torch.int64))    # 0-dim
        self.register_buffer("mask", torch.rand(7, generator=g) > 0.5)         # 7 bools
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))


class Engine:
    """A receiver target: holds a model, applies a version atomically under its lock."""

    def __init__(self, seed=1, device="cpu", receiver_cls=transfer.Receiver, **receiver_kw):
        torch.set_num_threads(1)
        self.model = ToyNet(seed).to(device)
        self.version = 0
        self.lock = threading.Lock()
        self.mesh_endpoint = receiver_cls(target=self, device=device, **receiver_kw)

    def mesh(self, method, *args, **kwargs):
        return getattr(self.mesh_endpoint, method)(*args, **kwargs)

    def weight_specs(self):
        return {n: (tuple(t.shape), t.dtype) for n, t in self.model.state_dict().items()}

    def load_weights(self, named_tensors, version):
        with self.lock, torch.no_grad():
            params = self.model.state_dict()
            for n, t in named_tensors.items():
                params[n].copy_(t)
            self.version = version

    def weight_version(self):
        return self.version

    def state(self):
        return {n: t.cpu().clone() for n, t in self.model.state_dict().items()}


class InPlaceEngine(Engine):
    """A target that lets the Receiver copy each verified bucket straight into its model
    (what the HF engine does); after a failed landing it serves nothing."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.complete = True

    @contextlib.contextmanager
    def weights_in_place(self, version):
        with self.lock, torch.no_grad():
            self.complete = False
            yield self.model.state_dict()
            self.version, self.complete = version, True

    def serving(self):
        return self.complete


class Trainer:
    """The sender, plus a colocated engine in the same process (the inproc route)."""

    def __init__(self, seed=0, device="cpu"):
        torch.set_num_threads(1)
        self.model = ToyNet(seed).to(device)
        self.mesh_endpoint = transfer.Sender(
            state_fn=lambda: {n: t.detach() for n, t in self.model.state_dict().items()},
            device=device)
        self.colocated = InPlaceEngine(seed=2, device=device)

    def mesh(self, method, *args, **kwargs):
        # Sender and Receiver method names never overlap, so one actor can host both.
        endpoint = self.mesh_endpoint
        if not hasattr(endpoint, method):
            endpoint = self.colocated.mesh_endpoint
        return getattr(endpoint, method)(*args, **kwargs)

    def step(self):
        """Stand-in for an optimizer step: every tensor changes."""
        with torch.no_grad():
            for t in self.model.state_dict().values():
                if t.dtype == torch.bool:
                    t.logical_not_()
                else:
                    t.add_(1)

    def state(self):
        return {n: t.cpu().clone() for n, t in self.model.state_dict().items()}

    def colocated_state(self):
        return self.colocated.state()

    def colocated_version(self):
        return self.colocated.version


class DiesAtBucket(transfer.Receiver):
    """A receiver whose process exits in the middle of a transfer."""

    def __init__(self, target, device, die_at: int):
        super().__init__(target, device)
        self.die_at = die_at

    def verify_bucket(self, name, transport, version, i, got, expected):
        if i == self.die_at:
            os._exit(1)
        super().verify_bucket(name, transport, version, i, got, expected)


ActorOpts = dict(num_cpus=0.1, max_concurrency=4)
RemoteEngine = ray.remote(**ActorOpts)(Engine)
RemoteInPlace = ray.remote(**ActorOpts)(InPlaceEngine)
RemoteTrainer = ray.remote(**ActorOpts)(Trainer)
_versions = itertools.count(1)


def next_version() -> int:
    return next(_versions)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True,
                head_node_args={"num_cpus": 2, "num_gpus": GPUS, "resources": {"node_a": 100}})
    c.add_node(num_cpus=2, resources={"node_b": 100})
    ray.init(address=c.address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    yield c
    ray.shutdown()
    c.shutdown()


def on(node: str) -> dict:
    return {"resources": {node: 1}}


@pytest.fixture(scope="module")
def actors(cluster):
    trainer = RemoteTrainer.options(**on("node_a")).remote()
    local = RemoteEngine.options(**on("node_a")).remote(seed=3)
    remote = RemoteEngine.options(**on("node_b")).remote(seed=4)
    local_ip = RemoteInPlace.options(**on("node_a")).remote(seed=6)
    remote_ip = RemoteInPlace.options(**on("node_b")).remote(seed=7)
    everyone = {"trainer": trainer, "local": local, "remote": remote,
                "local_in_place": local_ip, "remote_in_place": remote_ip}
    ray.get([a.state.remote() for a in everyone.values()])
    return everyone


def assert_same_weights(expected: dict, got: dict) -> None:
    assert expected.keys() == got.keys()
    for name, t in expected.items():
        assert t.dtype == got[name].dtype and t.shape == got[name].shape, name
        # Compare raw bytes: bit-exact, and NaN-safe.
        assert np.array_equal(t.contiguous().view(-1).view(torch.uint8).numpy(),
                              got[name].contiguous().view(-1).view(torch.uint8).numpy()), name


def engine_state(handle, trainer, name):
    if name == "self":
        return ray.get(trainer.colocated_state.remote())
    return ray.get(handle.state.remote())


def receive_with_a_flipped_byte(trainer, engine, name, mesh, version, offset, bit):
    """Drive the two halves of a shm publish by hand (what publish does), flipping one bit
    of bucket 2 in the shared segment in between; return the receiver's TransferError."""
    layout, addresses = ray.get(trainer.mesh.remote("prepare", mesh.mesh_id, version,
                                                    {"shm": [name]}, CFG))
    ray.get(trainer.mesh.remote("send", mesh.mesh_id, version))
    start, _ = layout.span(2)
    with open(addresses["shm"]["path"], "r+b") as f:
        f.seek(Board.nbytes(layout.num_buckets) + start + offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ bit]))
    with pytest.raises(transfer.TransferError) as err:
        ray.get(engine.mesh.remote("receive", mesh.mesh_id, name, version, layout, "shm",
                                   addresses["shm"], CFG))
    return err.value.cause if hasattr(err.value, "cause") else err.value


# ---- pure units: no Ray ----------------------------------------------------------------

def test_checksum_sees_a_flipped_bit_and_swapped_blocks():
    buf = torch.randint(0, 256, (3 * 4096 + 100,), dtype=torch.uint8)
    base = transfer.checksum(buf)
    flipped = buf.clone()
    flipped[5000] ^= 1
    swapped = torch.cat([buf[4096:8192], buf[:4096], buf[8192:]])
    tail = buf.clone()
    tail[-1] ^= 0x80
    assert len({base, transfer.checksum(flipped), transfer.checksum(swapped),
                transfer.checksum(tail)}) == 4


def test_layout_round_trips_straddling_tensors():
    state = ToyNet(0).state_dict()
    layout = transfer.Layout.of(state, BUCKET)
    assert layout.num_buckets > 3
    flat = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    from transfer.layout import byte_views, pack_bucket
    for i in range(layout.num_buckets):
        start, end = layout.span(i)
        crc = pack_bucket(byte_views(state), layout, i, flat[start:end])
        assert crc == transfer.checksum(flat[start:end])    # packing sums as it copies
    assert_same_weights(dict(state), layout.unpack(flat))
    assert layout.mismatches({"a.weight": ((300, 64), torch.float32)}) == []
    assert "b.weight" in layout.mismatches({"b.weight": ((33, 300), torch.float32)})[0]


def test_tied_weights_travel_once_and_land_under_every_name():
    """A tensor published under two names (tied embeddings) takes bytes once; a receiver
    that holds the two apart gets both, in place or from the unpacked views."""
    from transfer.layout import byte_views, pack_bucket, unpack_bucket
    emb = torch.randn(100, 64)
    state = {"embed.weight": emb, "norm.weight": torch.randn(64), "lm_head.weight": emb}
    layout = transfer.Layout.of(state, BUCKET)
    assert [s.name for s in layout.slots] == ["embed.weight", "norm.weight"]
    assert layout.aliases == (("lm_head.weight", "embed.weight"),)
    assert layout.specs().keys() == state.keys()
    flat = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    untied = {n: torch.zeros_like(t) for n, t in state.items()}
    for i in range(layout.num_buckets):
        start, end = layout.span(i)
        crc = pack_bucket(byte_views(state), layout, i, flat[start:end])
        assert unpack_bucket(flat[start:end], layout, i, byte_views(untied)) == crc
    assert_same_weights(dict(state), untied)
    assert_same_weights(dict(state), layout.unpack(flat))



def test_a_bucket_lands_under_every_name_with_the_packed_checksum():
    """unpack_bucket lands the same bytes under every name, skips names the receiver lacks, and
    reports the checksum the sender packed with; a flipped byte changes it."""
    from transfer.layout import byte_views, pack_bucket, unpack_bucket
    emb = torch.randn(1000, 33)
    state = {"embed.weight": emb, "odd": torch.randn(77).to(torch.bfloat16), "big": torch.randn(70001),
             "lm_head.weight": emb}
    layout = transfer.Layout.of(state, BUCKET)
    assert layout.num_buckets > 10 and layout.total_bytes % 4096
    flat = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    got = {n: torch.zeros_like(t) for n, t in state.items() if n != "odd"}
    for i in range(layout.num_buckets):
        start, end = layout.span(i)
        crc = pack_bucket(byte_views(state), layout, i, flat[start:end])
        assert unpack_bucket(flat[start:end], layout, i, byte_views(got)) == crc
    assert all(torch.equal(got[n], state[n]) for n in got)
    start, end = layout.span(3)
    before = unpack_bucket(flat[start:end], layout, 3, byte_views(got))
    flat[start + 4097] ^= 1
    assert unpack_bucket(flat[start:end], layout, 3, byte_views(got)) != before


def test_config_rejects_unknown_transport_and_unaligned_buckets():
    with pytest.raises(ValueError, match="one of auto, inproc"):
        TransferConfig(transport="rdma")
    with pytest.raises(ValueError, match="multiple of 4096"):
        TransferConfig(bucket_bytes=1000)


def _party(name, node="n1", pid=1, device="cpu", uuid=""):
    return Party(name=name, role="receiver", node_id=node, ip="10.0.0.1",
                 pid=pid, device=device, device_uuid=uuid, transports=transfer.TRANSPORTS)


def test_route_rules_cover_gpu_topologies():
    gpu = _party("trainer", device="cuda:0", uuid="GPU-a")
    plan = transfer.plan_route
    assert plan(gpu, _party("e", pid=2, device="cuda:0", uuid="GPU-a")).transport == "cuda_ipc"
    assert plan(gpu, _party("e", pid=2, device="cuda:1", uuid="GPU-b")).transport == "nccl"
    assert plan(gpu, _party("e", node="n2", device="cuda:0", uuid="GPU-c")).transport == "nccl"
    assert plan(gpu, _party("e", pid=2)).transport == "shm"
    assert plan(gpu, _party("e", node="n2")).transport == "gloo"
    no_gloo = Party(**{**_party("e", node="n2").__dict__, "transports": ("zmq",)})
    assert plan(gpu, no_gloo).reason.startswith("fallback")


# ---- the nccl route up to the CUDA boundary (CuPy's NCCL communicator, transfer/nccl.py) ----------

HAVE_NCCL = nccl.available()


def _gpu_party(name, pid, transports, uuid):
    return Party(**{**_party(name, pid=pid, device="cuda:0", uuid=uuid).__dict__, "transports": transports})


def test_gpus_without_cupy_route_through_host_memory_and_say_why():
    """A GPU process without CuPy does not offer nccl: auto planning takes host memory and says what
    nccl would need; forcing nccl fails at planning, naming the side and the install."""
    plain = tuple(t for t in transfer.TRANSPORTS if t != "nccl")
    trainer = _gpu_party("trainer", 1, transfer.TRANSPORTS, "GPU-a")
    engine = _gpu_party("e", 2, plain, "GPU-b")
    route = transfer.plan_route(trainer, engine)
    assert route.transport == "shm" and "not nccl: the receiver lacks" in route.reason
    assert "pip install 'loongsage[cupy]'" in route.reason
    with pytest.raises(transfer.TransferError, match=r"receiver cannot run nccl: it needs a CUDA device and CuPy"):
        transfer.plan_route(trainer, engine, "nccl")
    assert transfer.plan_route(trainer, _gpu_party("e", 2, transfer.TRANSPORTS, "GPU-b")).transport == "nccl"


def test_a_process_offers_nccl_only_with_cuda_and_cupy():
    from transfer.topology import _available_transports

    assert "nccl" not in _available_transports("cpu")
    assert HAVE_NCCL == (torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None)
    if not HAVE_NCCL:
        with pytest.raises(RuntimeError, match="needs a CUDA device|needs CuPy with NCCL"):
            nccl.NcclSend("m", ["e"], CFG, _party("trainer", device="cuda:0"), None)


def _nccl_address(ranks: dict, uid=None) -> dict:
    uid = tuple(np.random.default_rng(0).integers(-128, 128, nccl.UNIQUE_ID_BYTES).tolist()) if uid is None else uid
    return {"unique_id": uid, "world": len(ranks) + 1, "ranks": ranks}


def test_the_nccl_handshake_takes_only_an_address_made_for_the_receiver():
    address = _nccl_address({"e0": 1, "e1": 2})
    world, uid, rank = nccl.handshake(address, "e1")
    assert (world, rank, uid) == (3, 2, address["unique_id"])
    for bad, match in [(_nccl_address({"e0": 1}, uid=(1, 2, 3)), "not 128 bytes"),
                       (_nccl_address({"e0": 1}), "no rank for 'e1'"),
                       ({**_nccl_address({"e1": 1}), "world": 5}, "do not make a world of 5"),
                       (_nccl_address({"e1": 1}, uid=(300,) * nccl.UNIQUE_ID_BYTES), "not 128 bytes")]:
        with pytest.raises(ValueError, match=match):
            nccl.handshake(bad, "e1")


# ---- on the two-node cluster -----------------------------------------------------------

def test_routes_follow_the_topology(actors):
    t = actors["trainer"]
    mesh = transfer.TransferMesh(t, {"self": t, "local": actors["local"],
                                     "remote": actors["remote"]}, CFG)
    parties = mesh.discover()
    assert len({p.node_id for p in parties}) == 2
    routes = mesh.plan()
    assert {n: r.transport for n, r in routes.items()} == {
        "self": "inproc", "local": "shm", "remote": "gloo"}
    assert "same process" in routes["self"].reason and "across nodes" in routes["remote"].reason
    table = mesh.topology_table()
    assert all(name in table for name in ("sender", "self", "local", "remote", "inproc"))
    forced = transfer.TransferMesh(t, {"local": actors["local"], "remote": actors["remote"]},
                                   TransferConfig(transport="shm"))
    with pytest.raises(transfer.TransferError, match="'remote' via shm"):
        forced.plan()


@pytest.mark.skipif(HAVE_NCCL, reason="checks the refusal where CUDA or CuPy is missing")
def test_the_nccl_route_through_ray_stops_at_the_cuda_boundary_with_a_clear_error(actors):
    """Forced nccl between CPU actors fails at planning, naming the install. A receiver actor handed an
    nccl link address through Ray (the handshake the sender's prepare makes) takes it, and then fails
    where it would join the communicator: the error names it, the transport and what is missing."""
    t, remote = actors["trainer"], actors["remote"]
    forced = transfer.TransferMesh(t, {"remote": remote}, TransferConfig(transport="nccl"))
    with pytest.raises(transfer.TransferError, match=r"sender and receiver cannot run nccl: it needs a CUDA device "
                                                     r"and CuPy with NCCL \(pip install 'loongsage\[cupy\]'\)"):
        forced.plan()
    layout = transfer.Layout.of(ToyNet(0).state_dict(), BUCKET)
    served = ray.get(remote.weight_version.remote())
    with pytest.raises(transfer.TransferError) as e:
        ray.get(remote.mesh.remote("receive", "m-nccl", "remote", served + 1, layout, "nccl",
                                   _nccl_address({"remote": 1}), CFG))
    assert (e.value.receiver, e.value.transport, e.value.version) == ("remote", "nccl", served + 1)
    assert "needs a CUDA device" in e.value.reason
    with pytest.raises(transfer.TransferError, match="no rank for 'remote'"):
        ray.get(remote.mesh.remote("receive", "m-nccl", "remote", served + 1, layout, "nccl",
                                   _nccl_address({"other": 1}), CFG))
    assert ray.get(remote.weight_version.remote()) == served


def test_auto_routes_deliver_bit_exact_weights_every_version(actors):
    t = actors["trainer"]
    receivers = {"self": t, "local": actors["local"], "remote": actors["remote"]}
    mesh = transfer.TransferMesh(t, receivers, CFG)
    for _ in range(2):
        ray.get(t.step.remote())
        version = next_version()
        metrics = mesh.publish(version)
        expected = ray.get(t.state.remote())
        for name, handle in receivers.items():
            assert_same_weights(expected, engine_state(handle, t, name))
        assert mesh.versions == {"self": version, "local": version, "remote": version}
        assert metrics["transfer/receivers"] == 3
        assert {"transfer/inproc/seconds", "transfer/shm/seconds",
                "transfer/gloo/seconds"} <= metrics.keys()
        assert metrics["transfer/gb_per_s"] > 0 and metrics["transfer/slowest_receiver"] in receivers
    assert ray.get(actors["local"].weight_version.remote()) == version
    assert mesh.publish(version)["transfer/receivers"] == 0      # nobody is behind
    mesh.close()


@pytest.mark.parametrize("transport,names", [
    ("inproc", ["self"]), ("shm", ["local", "local_in_place"]),
    ("gloo", ["local", "remote", "remote_in_place"]),
    ("zmq", ["local", "remote", "local_in_place", "remote_in_place"])])
def test_each_cpu_transport_is_bit_exact(actors, transport, names):
    """Both ways of applying: land the version then load it, and copy each bucket into
    the live model as it is verified (the *_in_place receivers)."""
    t = actors["trainer"]
    handles = {"self": t, **{n: a for n, a in actors.items() if n != "trainer"}}
    mesh = transfer.TransferMesh(t, {n: handles[n] for n in names},
                                 TransferConfig(transport=transport,
                                                         bucket_bytes=BUCKET, timeout_s=10))
    assert {r.transport for r in mesh.plan().values()} == {transport}
    ray.get(t.step.remote())
    publishing = mesh.publish_begin(next_version())
    # Only the colocated receiver reads the sender's own tensors after its send: packed
    # copies (shm without adoption, gloo, zmq) leave the trainer free to step at once.
    assert publishing.sender_free is (transport != "inproc")
    metrics = mesh.publish_end(publishing)
    expected = ray.get(t.state.remote())
    for n in names:
        assert_same_weights(expected, engine_state(handles[n], t, n))
    assert metrics[f"transfer/{transport}/seconds"] > 0
    mesh.close()


def test_corrupt_bucket_is_rejected_and_the_receiver_catches_up_next_time(actors):
    """Flip one byte of the shared segment after the sender packed it: the receiver must
    refuse the version (naming the bucket), keep serving its old weights, and take the
    next publish."""
    t, local = actors["trainer"], actors["local"]
    mesh = transfer.TransferMesh(t, {"local": local}, CFG)
    mesh.plan()
    ray.get(t.step.remote())
    version, before = next_version(), ray.get(local.state.remote())
    old_version = ray.get(local.weight_version.remote())
    e = receive_with_a_flipped_byte(t, local, "local", mesh, version, offset=123, bit=0x10)
    assert (e.receiver, e.transport, e.version, e.bucket) == ("local", "shm", version, 2)
    assert "checksum mismatch" in str(e)
    assert ray.get(local.weight_version.remote()) == old_version      # nothing applied
    assert_same_weights(before, ray.get(local.state.remote()))
    mesh.publish(version)          # the same version again: local is behind, so it gets it
    assert_same_weights(ray.get(t.state.remote()), ray.get(local.state.remote()))
    assert ray.get(local.weight_version.remote()) == version
    mesh.close()


def test_corrupt_bucket_landed_in_place_stops_serving_until_the_next_version(actors):
    """In-place landing has already copied buckets 0-1 when bucket 2 fails its checksum:
    the error names bucket 2, the engine says it is not serving (half a version), keeps its
    old version number, and the next publish makes it whole."""
    t, ip = actors["trainer"], actors["local_in_place"]
    mesh = transfer.TransferMesh(t, {"local_in_place": ip}, CFG)
    assert mesh.plan()["local_in_place"].transport == "shm"
    mesh.publish(next_version())
    ray.get(t.step.remote())
    version, old_version = next_version(), ray.get(ip.weight_version.remote())
    e = receive_with_a_flipped_byte(t, ip, "local_in_place", mesh, version, offset=77, bit=0x01)
    assert (e.transport, e.version, e.bucket) == ("shm", version, 2)
    assert "checksum mismatch" in str(e)
    assert ray.get(ip.serving.remote()) is False
    assert ray.get(ip.weight_version.remote()) == old_version
    mesh.publish(version)
    assert ray.get(ip.serving.remote()) is True
    assert ray.get(ip.weight_version.remote()) == version
    assert_same_weights(ray.get(t.state.remote()), ray.get(ip.state.remote()))
    mesh.close()


def test_late_receiver_catches_up(actors):
    t = actors["trainer"]
    mesh = transfer.TransferMesh(t, {"local": actors["local"]}, CFG)
    ray.get(t.step.remote())
    version = next_version()
    mesh.publish(version)
    route = mesh.add_receiver("remote", actors["remote"])
    assert route.transport == "gloo" and mesh.versions["remote"] < version
    metrics = mesh.publish(version)                    # only the late one is behind
    assert metrics["transfer/receivers"] == 1
    assert_same_weights(ray.get(t.state.remote()), ray.get(actors["remote"].state.remote()))
    assert mesh.versions == {"local": version, "remote": version}
    mesh.close()


def test_receiver_dying_mid_transfer_fails_within_the_timeout(actors):
    t, remote = actors["trainer"], actors["remote"]
    dying = RemoteEngine.options(**on("node_b")).remote(seed=5, receiver_cls=DiesAtBucket,
                                                          die_at=1)
    cfg = TransferConfig(bucket_bytes=BUCKET, timeout_s=4.0)
    mesh = transfer.TransferMesh(t, {"dying": dying, "remote": remote}, cfg)
    assert {r.transport for r in mesh.plan().values()} == {"gloo"}
    ray.get(t.step.remote())
    version = next_version()
    start = time.monotonic()
    with pytest.raises(transfer.TransferError) as err:
        mesh.publish(version)
    assert time.monotonic() - start < cfg.timeout_s + 3
    failure = err.value.failures["dying"]
    assert (failure.transport, failure.version) == ("gloo", version)
    assert "died" in str(failure) and "'dying' via gloo" in str(err.value)
    assert "dying" in mesh.dead
    # The survivors go on: the next publish rebuilds the group without the dead one.
    metrics = mesh.publish(version)
    assert mesh.versions["remote"] == version and metrics["transfer/receivers"] <= 1
    assert_same_weights(ray.get(t.state.remote()), ray.get(remote.state.remote()))
    # A restarted engine under the same name is rediscovered and catches up.
    restarted = RemoteEngine.options(**on("node_b")).remote(seed=8)
    assert mesh.add_receiver("dying", restarted).transport == "gloo"
    assert mesh.publish(version)["transfer/receivers"] == 1
    assert_same_weights(ray.get(t.state.remote()), ray.get(restarted.state.remote()))
    mesh.close()


# ---- GPU transports: real CUDA, skipped without it --------------------------------------

needs_gpu = pytest.mark.skipif(GPUS < 1, reason="CUDA IPC needs a CUDA GPU; none here")
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason="NCCL between GPUs needs 2 CUDA GPUs")


@needs_gpu
def test_cuda_ipc_same_gpu_is_bit_exact(cluster):
    gpu = dict(num_cpus=0.1, max_concurrency=4, num_gpus=0.5)
    trainer = ray.remote(**gpu)(Trainer).remote(device="cuda")
    engine = ray.remote(**gpu)(Engine).remote(seed=6, device="cuda")
    mesh = transfer.TransferMesh(trainer, {"engine": engine}, CFG)
    assert mesh.plan()["engine"].transport == "cuda_ipc"
    mesh.publish(next_version())
    assert_same_weights(ray.get(trainer.state.remote()), ray.get(engine.state.remote()))
    mesh.close()


@needs_two_gpus
@pytest.mark.skipif(not HAVE_NCCL, reason="the nccl route runs CuPy's NCCL: pip install 'loongsage[cupy]'")
def test_nccl_across_gpus_is_bit_exact(cluster):
    gpu = dict(num_cpus=0.1, max_concurrency=4, num_gpus=1)
    trainer = ray.remote(**gpu)(Trainer).remote(device="cuda")
    engine = ray.remote(**gpu)(Engine).remote(seed=7, device="cuda")
    mesh = transfer.TransferMesh(trainer, {"engine": engine}, CFG)
    assert mesh.plan()["engine"].transport == "nccl"
    mesh.publish(next_version())
    assert_same_weights(ray.get(trainer.state.remote()), ray.get(engine.state.remote()))
    mesh.close()
