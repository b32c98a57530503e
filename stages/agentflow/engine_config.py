"""The `engine:`, `vllm:` and `sglang:` recipe sections (stages/agentflow/engine.py, vllm_engine.py, sglang_engine.py).

Apart from the engines, which import torch, so a recipe is checked without torch.
"""
from __future__ import annotations

from stages.keys import NONNEG, POSITIVE, at_least, between, key, one_of, section


@section("engine")
class EngineConfig:
    kind: str = key("hf", "hf (embedded torch engine, any CPU) | vllm (`pip install .[vllm]`; `vllm:` section) | "
                          "sglang (GPU; `sglang:` section)", one_of("hf", "vllm", "sglang"))
    count: int = key(1, "rollout engine actors", POSITIVE)
    threads: int = key(0, "torch threads per engine; 0 = decided by pipeline/resources.py", NONNEG)
    max_rows: int = key(256, "hf engine: rows decoding at once (more wait in its queue)", at_least(1))
    kv_cache_mb: float = key(1024.0, "hf engine: its KV cache, the memory its running rows may hold (rows x the "
                                     "widest row's context + budget); a request that cannot fit alone fails", POSITIVE)
    restarts: int = key(3, "times Ray restarts a dead engine (its groups are re-run); -1 = always", at_least(-1))
    retries: int = key(3, "re-runs of a trajectory whose engine died under it", NONNEG)


@section("vllm")
class VLLMConfig:
    kv_cache_mb: int = key(256, "KV cache per engine, MiB (vLLM's default is most of the machine's memory)",
                           at_least(1))
    max_num_seqs: int = key(256, "rows decoding at once (more wait in vLLM's queue)", at_least(1))
    max_num_batched_tokens: int = key(16384, "tokens per engine step; large: vLLM 0.32 on CPU fails a seeded row "
                                             "that is prefilled in chunks", at_least(1))
    enforce_eager: bool = key(True, "no torch.compile / graphs (on CPU: +37 s of start, nothing gained here)")
    prefix_caching: bool = key(True, "share KV blocks of common prefixes (a group's prompt)")
    max_loras: int = key(2, "adapters resident at once with trainer.lora (the current and the previous)", at_least(1))
    engine_args: dict = key({}, "any other vllm.EngineArgs field")


@section("sglang")
class SGLangConfig:
    tp: int = key(1, "GPUs per engine (SGLang tensor parallel); Ray gives each engine this many", at_least(1))
    mem_fraction: float = key(0.7, "of each GPU for weights + KV cache (lower when colocated)",
                                   between(0, 1, lo_open=True, hi_open=True))
    pause_mode: str = key("retract", "how a weight update interrupts generation: retract | in_place | abort",
                                     one_of("retract", "in_place", "abort"))
    server_args: dict = key({}, "any other `sglang.launch_server` flag, without the dashes")
    startup_timeout_s: float = key(900.0, "seconds an engine may take to start its server", POSITIVE)
    request_timeout_s: float = key(3600.0, "seconds one generation request may take", POSITIVE)
    bucket_bytes: int = key(512 << 20, "weights handed to the server per update_weights_from_tensor call", POSITIVE)
