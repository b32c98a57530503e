"""Run megatron-core on a CPU-only torch (tests, laptops): the one place that papers over its CUDA calls.

megatron-core assumes a GPU where the maths does not: buffers made on `"cuda"` or
`torch.cuda.current_device()`, an assert that grads are `torch.cuda.FloatTensor`, and an RNG
tracker forking the CUDA generator. Nothing here changes a result: the same kernels run on the
same data, on the CPU.
"""
from __future__ import annotations

import contextlib

import torch
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
from torch.overrides import TorchFunctionMode

from transfer.compat.megatron_api import rng_state_names, set_rng_tracker
from transfer.compat.torch_api import device_constructors

_CPU = torch.device("cpu")
_FACTORIES = device_constructors()      # the tensor factories that take device=


def _to_cpu(device):
    """A CUDA device (an int index means one) as the CPU; anything else (None, a dtype, ...) as it is."""
    if isinstance(device, int) and not isinstance(device, bool) or \
            isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return _CPU
    return device


class CudaAsCpu(TorchFunctionMode):
    """Context in which megatron's CUDA device requests land on the CPU (thread-local)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and (func is torch.Tensor.to or func in _FACTORIES):
            kwargs["device"] = _to_cpu(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:     # t.to(device, ...): the device comes first
            args = (args[0], _to_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


def install(seed: int) -> None:
    """Process-wide part of the shim; call once after parallel_state is initialised."""
    if torch.cuda.is_available():
        raise RuntimeError("cpu_shim is for CPU-only processes; this one sees a GPU")
    torch.cuda.current_device = lambda: _CPU
    torch.cuda.synchronize = lambda device=None: None   # CPU ops are synchronous already
    from megatron.core import parallel_state

    tracker = _CpuRNGStatesTracker()
    data, model, expert = rng_state_names()
    # the same seeds model_parallel_cuda_manual_seed derives (2718: megatron's offset)
    tracker.add(data, seed)
    tracker.add(model, seed + 2718 + parallel_state.get_tensor_model_parallel_rank())
    tracker.add(expert, seed + 1024)
    set_rng_tracker(tracker)


class _CpuRNGStatesTracker(CudaRNGStatesTracker):
    """megatron's tracker, with named states of the CPU generator instead of the CUDA one."""

    def add(self, name, seed):
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)
