"""megatron-core internals (pinned by the `megatron` extra in pyproject.toml; checked by tests/test_compat.py)."""
from __future__ import annotations


def rng_state_names() -> tuple[str, str, str]:
    """The names megatron's RNG tracker keys its data-, model- and expert-parallel states by
    (`megatron.core.tensor_parallel.random._DATA_PARALLEL_RNG_TRACKER_NAME`, `_MODEL_...`, `_EXPERT_...`):
    a tracker standing in for megatron's must hold its states under the names megatron's layers fork."""
    from megatron.core.tensor_parallel import random as mrandom

    return (mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME,
            mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME)


def set_rng_tracker(tracker) -> None:
    """Make `tracker` the one megatron's `get_cuda_rng_tracker()` returns: its module-level
    `_CUDA_RNG_STATE_TRACKER`, marked initialised (`_CUDA_RNG_STATE_TRACKER_INITIALIZED`) so megatron
    does not build its own (CUDA) one. megatron has no public setter."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
