"""The one engine contract every rollout engine serves (HF: engine.py, vLLM: vllm_engine.py,
SGLang: sglang_engine.py), and the pieces of it the engines share.

The rollout stage, the proxy, evaluation, the controller and the TransferMesh call only the
methods of `RolloutEngine`; which engine answers is `rollout.engine`. What each call means:

* `generate(rows)`: each row has prompt_ids, max_new_tokens, temperature, top_p, [seed],
  [prefix_ids, prefix_logprobs, prefix_versions] (a resumed partial rollout), [hold] (the whole
  call under one weight version). Per row out: response_ids, logprobs (of each sampled token under
  logits / temperature, as the trainer computes them), versions (the weight version that produced
  each token), status completed | truncated | aborted | failed. A row that cannot be served (over
  the context, malformed, a setting the engine refuses) fails alone with `error` and `code`.
  A group's `n` samples are n rows. A row stops on the tokenizer's eos or its budget.
* `abort_all()`: every row in flight ends now, status aborted, with the tokens it has.
* `load_weights(named, version)` / `mesh(...)`: a version lands whole, between steps; rows in
  flight go on under it (their tokens carry both versions), `hold` rows finish first.
* `needs_sync()`: True in a process Ray restarted, until the current weights are re-sent; until
  then `generate` waits for them (RESTART_WAIT_S at most, then EngineRestarting: a proxy caller gets
  503, Anthropic 529) instead of serving initial weights.
* `info()` (engine_id, pid, host, version, incarnation: new in every process, needs_sync), `weight_version()`,
  `weight_specs()` (the HF names, shapes and dtypes a published version carries: the mesh checks
  them), `pop_stats()` (since the last call: requests, tokens, busy_s, decode_steps,
  running_rows_mean/max, queue_wait_s_mean/max).

Tests that hold every engine to it: tests/engine_contract.py (the HF engine in the default run, vLLM
in the `vllm` tier, SGLang in benchmarks/gpu/sglang_check.py).
"""
from __future__ import annotations

import os
import socket
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from stages.agentflow.client import EngineRestarting

RESYNC_TIMEOUT_S = 120.0      # a version that failed part-way in place waits for the next publish
RESTART_WAIT_S = 10.0         # a restarted engine's calls wait this long for the weights, then fail as restarting
# an engine's finish reason -> the row's status (vLLM's and SGLang's names are the same)
STATUS = {"stop": "completed", "length": "truncated", "abort": "aborted"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RolloutEngine(Protocol):
    """What every engine actor answers (see the module docstring)."""

    def generate(self, requests: list[dict]) -> list[dict]: ...
    def abort_all(self) -> None: ...
    def load_weights(self, named_tensors: dict, version: int) -> None: ...
    def mesh(self, method: str, *args, **kwargs): ...
    def needs_sync(self) -> bool: ...
    def info(self) -> dict: ...
    def weight_version(self) -> int: ...
    def weight_specs(self) -> dict: ...
    def pop_stats(self) -> dict: ...


# ---- restarts ----------------------------------------------------------------------------
def reconstructed() -> bool:
    """True in an actor process Ray restarted (it holds the initial weights, not the current ones)."""
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed
    except Exception:  # noqa: BLE001 - not in an actor (tests build engines in-process)
        return False


def wait_synced(synced: threading.Event, engine_id: str) -> None:
    """generate's first wait: a restarted engine serves only once the current weights are back. The
    controller's engine watch re-sends them within a second of the restart, or after the update in
    hand; a caller waits for them a little, then is told the engine is restarting (it may retry)."""
    if not synced.wait(timeout=RESTART_WAIT_S):
        raise EngineRestarting(f"{engine_id} restarted and was not re-sent the current weights within "
                               f"{RESTART_WAIT_S:.0f}s; retry")


def identity(engine, /, **more) -> dict:
    """info()'s answer: who serves, where, which version, and the process's incarnation (new in every
    process: the controller counts a restart when it changes) and whether it awaits the current weights
    (a process restarted before the controller first asked its incarnation has nothing else to tell)."""
    return {"engine_id": engine.engine_id, "pid": os.getpid(), "host": socket.gethostname(),
            "version": engine.version, "incarnation": engine.incarnation, "needs_sync": engine.needs_sync(), **more}


class LibraryWeights:
    """The contract's weight accessors for an engine around a library (vLLM, SGLang): it keeps the
    version it serves, the specs a version carries (`_specs`, published_specs) and an event set once
    it serves current weights (`_synced`: clear in a restarted process until they are re-sent)."""

    version: int
    mesh_endpoint: object
    _specs: dict
    _synced: threading.Event

    def weight_version(self) -> int:
        return self.version

    def needs_sync(self) -> bool:
        return not self._synced.is_set()

    def weight_specs(self) -> dict:
        return dict(self._specs)

    def mesh(self, method: str, *args, **kwargs):
        return mesh_call(self, method, *args, **kwargs)


def mesh_call(engine, method: str, *args, **kwargs):
    """An engine's `mesh` remote method: the TransferMesh's Receiver in this actor, made on first use."""
    if engine.mesh_endpoint is None:
        import transfer

        engine.mesh_endpoint = transfer.Receiver(target=engine)
    return getattr(engine.mesh_endpoint, method)(*args, **kwargs)


# ---- what a version carries -------------------------------------------------------------------
def weight_specs_of(model_path: str, dtype: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The HF state_dict names and shapes of the model (built on the meta device: no memory), in
    the dtype the trainer publishes; lm_head is listed even where it is tied, as HF lists it."""
    from stages.lora import meta_model

    return {n: (tuple(t.shape), DTYPES[dtype]) for n, t in meta_model(model_path).state_dict().items()}


def published_specs(model_path: str, dtype: str, lora) -> dict:
    """What the trainer publishes to an engine that is not the HF one: the whole model, or with
    trainer.lora the adapter alone."""
    if lora is None:
        return weight_specs_of(model_path, dtype)
    from stages.lora import adapter_specs, meta_model

    return adapter_specs(meta_model(model_path), lora)


def adapter_dir(engine_id: str) -> str:
    """Where an engine writes each LoRA version as a peft directory for its server to read: tmpfs
    where there is one (an adapter is read once, at load)."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return tempfile.mkdtemp(prefix=f"loongsage-lora-{engine_id}-", dir=shm)


# ---- sampling ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    seed: int | None


def sampling_of(r: dict) -> Sampling:
    """A row's sampling settings as a library engine takes them: top_p is moot when greedy; a seeded
    row's sampler is seeded with seed + tokens already in its response, so a resumed row draws a
    stream of its own too (the HF engine instead draws token t's uniform from (seed, t))."""
    temp = float(r.get("temperature", 1.0))
    top_p = float(r.get("top_p", 1.0)) if temp > 0 else 1.0
    seed = (int(r["seed"]) + len(r.get("prefix_ids", []))) % (2 ** 63) if r.get("seed") is not None else None
    return Sampling(temp, top_p, seed)


# ---- statistics -------------------------------------------------------------------------
def fresh_stats() -> dict:
    return {"requests": 0, "tokens": 0, "busy_s": 0.0, "decode_steps": 0, "_rows_sum": 0, "running_rows_max": 0,
            "_wait_sum": 0.0, "_waited": 0, "queue_wait_s_max": 0.0}


def summarize_stats(st: dict) -> dict:
    """pop_stats' answer from the counters fresh_stats started: the sums become means."""
    st = dict(st)
    rows, waited = st.pop("_rows_sum"), st.pop("_waited")
    st["running_rows_mean"] = rows / max(st["decode_steps"], 1)
    st["queue_wait_s_mean"] = st.pop("_wait_sum") / max(waited, 1)
    return st


# ---- versions against `hold` calls -------------------------------------------------------------
class VersionGate:
    """`hold` calls against weight updates: a version lands only when no hold call is in flight, and a
    hold call that arrives during an update waits for it to finish. Updates are counted, not flagged:
    two updates queued one behind the other keep hold calls out until the second has landed."""

    def __init__(self):
        self._cv = threading.Condition()
        self._holding = 0
        self._updating = 0

    def hold(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: not self._updating)
            self._holding += 1

    def unhold(self) -> None:
        with self._cv:
            self._holding -= 1
            self._cv.notify_all()

    @contextmanager
    def holding(self, hold: bool = True):
        """One call's whole life under one version (a no-op for an ordinary call)."""
        if not hold:
            yield
            return
        self.hold()
        try:
            yield
        finally:
            self.unhold()

    @contextmanager
    def updating(self):
        """An update: after the hold calls in flight; new hold calls wait until it is done."""
        with self._cv:
            self._updating += 1
            self._cv.wait_for(lambda: self._holding == 0)
        try:
            yield
        finally:
            with self._cv:
                self._updating -= 1
                self._cv.notify_all()
