"""Start the Megatron trainer's ranks as Ray actors (`rank_options`: each one's actor options, in rank
order, pipeline/placement.py) and hand back the leader, which takes the same calls as a TorchTrainer
actor. Every rank is created, all join one process group at rank 0's address, then the leader learns
its peers.
"""
from __future__ import annotations

import ray

from stages.update.config import AlgorithmConfig, TrainerConfig

from .config import MegatronConfig


def launch(model_path: str, cfg: TrainerConfig, algo: AlgorithmConfig, mcfg: MegatronConfig,
           temperature: float = 1.0, max_new_tokens: int = 0, dtype: str = "float32",
           rank_options: list[dict] | None = None, num_cpus: float = 1.0):
    from .trainer import MegatronTrainer

    opts = rank_options or [{"num_cpus": num_cpus}] * mcfg.world_size
    if len(opts) != mcfg.world_size:
        raise ValueError(f"{len(opts)} rank placements for {mcfg.world_size} ranks "
                         f"(tensor x pipeline x data parallel)")
    cls = ray.remote(MegatronTrainer)
    ranks = [cls.options(**o).remote(model_path, cfg, algo, temperature, max_new_tokens, dtype, mcfg) for o in opts]
    addr, port = ray.get(ranks[0].rendezvous.remote())
    ray.get([r.setup.remote(i, addr, port) for i, r in enumerate(ranks)])
    ray.get(ranks[0].connect.remote(ranks[1:]))
    return ranks[0]
