"""Megatron-core trainer backend: the torch trainer's update on a TP x PP x DP model.

  config.py    the `megatron:` recipe section (no megatron import: parses anywhere)
  convert.py   HF <-> Megatron weight layouts, TP sharding and merging (pure tensor code)
  model.py     GPTModel + TransformerConfig from an HF Qwen2/Llama config; lazy HF reader
  parallel.py  process groups (parallel_state) and gathering HF weights onto the leader
  logprobs.py  log-probs and entropy from vocab-parallel logits
  trainer.py   MegatronTrainer: one rank (a Ray actor); rank 0 leads, as TorchTrainer's stand-in
  launch.py    start the ranks and wire them together
  cpu_shim.py  CPU-only: lets megatron's CUDA-assuming code run on a CPU torch

Everything but config.py needs megatron-core (pip extra `megatron`).
"""
from .config import MegatronConfig

__all__ = ["MegatronConfig"]
