"""torch internals (pinned in pyproject.toml; checked by tests/test_compat.py)."""
from __future__ import annotations


def set_native_threads(n: int) -> None:
    """`torch._C.set_num_threads`: the intra-op thread count of the calling native thread. vLLM's CPU
    worker replaces `torch.set_num_threads` with a no-op once it has started; its step thread still
    has to run with the count its attention kernels were planned for."""
    import torch

    torch._C.set_num_threads(n)


def gloo_group(store, rank: int, size: int, ip: str, timeout):
    """A standalone `ProcessGroupGloo` over `store` that talks through the interface of `ip`, with
    `timeout` (a timedelta). `ProcessGroupGloo._Options` (`_timeout`, `_devices`) is the only way to
    bind a gloo group to one address: the public constructor takes a timeout and picks the device
    from the hostname, which on a multi-homed host may be the wrong interface."""
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=ip)]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def device_constructors() -> set:
    """`torch.utils._device._device_constructors()`: the tensor factories that take `device=`, the set
    torch's own `with torch.device(...)` mode redirects; a TorchFunctionMode that moves CUDA requests
    to the CPU (stages/update/megatron/cpu_shim.py) redirects the same ones."""
    from torch.utils._device import _device_constructors

    return _device_constructors()
