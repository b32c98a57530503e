"""Process groups for one trainer rank, and the collectives the trainer adds to megatron's.

`init` joins the trainer's own default group (NCCL on GPUs, gloo on CPU) and lets megatron's
`parallel_state` carve it into TP / PP / DP groups (rank order tp-dp-pp: global rank 0 is TP rank 0
of DP replica 0 of the first stage, the leader).
"""
from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from .config import MegatronConfig
from .convert import Arch, Replicated, hf_order, rule, to_hf


def free_address() -> tuple[str, int]:
    """This node's address and a free port for the rendezvous (asked of the leader)."""
    import ray

    host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    with socket.socket() as s:
        s.bind(("", 0))
        return host, s.getsockname()[1]


def init(rank: int, addr: str, port: int, mcfg: MegatronConfig, device: torch.device, seed: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():       # a second single-rank trainer in one process (tests, notebooks)
        if not (mcfg.world_size == dist.get_world_size() == 1 and ps.model_parallel_is_initialized()):
            raise RuntimeError(f"this process already joined a process group of {dist.get_world_size()} ranks; "
                               f"a trainer of {mcfg.world_size} ranks needs processes of its own")
        return
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://{addr}:{port}",
                            rank=rank, world_size=mcfg.world_size, timeout=timedelta(seconds=mcfg.timeout_s))
    ps.initialize_model_parallel(tensor_model_parallel_size=mcfg.tensor_parallel,
                                 pipeline_model_parallel_size=mcfg.pipeline_parallel,
                                 distributed_timeout_minutes=max(1, int(mcfg.timeout_s // 60)),
                                 order="tp-cp-ep-dp-pp")
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        from . import cpu_shim
        cpu_shim.install(seed)


def gather_hf_state(model, arch: Arch, layer_index) -> dict[str, torch.Tensor] | None:
    """Every rank of DP replica 0 calls this; the leader gets the whole model in HF names
    and layout, the others None. TP shards are gathered one parameter at a time (memory
    bounded by the largest parameter), then each pipeline stage hands its part over."""
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_rank() != 0:
        return None
    tp_group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    local = {n: t.detach() for n, t in model.state_dict().items() if not n.endswith("_extra_state")}
    shards: list[dict] = [{} for _ in range(tp)]
    for name, t in local.items():
        if rule(name, arch, layer_index)[1] is Replicated or tp == 1:
            parts = [t] * tp
        else:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
        for i, p in enumerate(parts):
            shards[i][name] = p
    if ps.get_tensor_model_parallel_rank() != 0:
        return None
    state = _gather_stages(to_hf(shards, arch, layer_index))
    return hf_order(state, arch) if state is not None else None


def _gather_stages(mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Over the pipeline group of TP rank 0: each stage broadcasts its tensors in turn."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return mine
    group = ps.get_pipeline_model_parallel_group()
    me, leader = ps.get_pipeline_model_parallel_rank(), dist.get_rank() == 0
    device = next(iter(mine.values())).device
    out = {}
    for stage, src in enumerate(dist.get_process_group_ranks(group)):
        meta = [{n: (t.shape, t.dtype) for n, t in mine.items()} if stage == me else None]
        dist.broadcast_object_list(meta, src=src, group=group, device=device)
        for name, (shape, dtype) in meta[0].items():
            t = mine[name] if stage == me else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(t, src=src, group=group)
            if leader:
                out[name] = t
    return out if leader else None
