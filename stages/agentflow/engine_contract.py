"""The one engine contract every rollout engine serves (HF: engine.py, vLLM: vllm_engine.py,
SGLang: sglang_engine.py), and the plumbing they share (EngineBase, VersionGate, AdapterSlots).

The rollout stage, the proxy, evaluation, the controller and the TransferMesh call only the
methods of `RolloutEngine`; which engine answers is `engine.kind`. What each call means:

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

Tests that hold every engine to it: tests/support/engine_checks.py (the HF engine in the default run, vLLM
in the `vllm` tier, SGLang in benchmarks/gpu/sglang_check.py).
"""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import uuid
from contextlib import contextmanager
from typing import Protocol

import torch

from stages.agentflow.client import EngineRestarting
from stages.agentflow.limits import failed_row, room, row_error

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


def reconstructed() -> bool:
    """True in an actor process Ray restarted (it holds the initial weights, not the current ones)."""
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed
    except Exception:  # noqa: BLE001 - not in an actor (tests build engines in-process)
        return False


def wait_synced(synced: threading.Event, engine_id: str) -> None:
    """generate's first wait: a restarted engine serves only once the controller's engine watch has
    re-sent the current weights; a caller waits a little, then is told the engine restarts (it may retry)."""
    if not synced.wait(timeout=RESTART_WAIT_S):
        raise EngineRestarting(f"{engine_id} restarted and was not re-sent the current weights within "
                               f"{RESTART_WAIT_S:.0f}s; retry")


def identity(engine, /, **more) -> dict:
    """info()'s answer: who serves, where, which version, the process's incarnation and whether it
    awaits the current weights."""
    return {"engine_id": engine.engine_id, "pid": os.getpid(), "host": socket.gethostname(),
            "version": engine.version, "incarnation": engine.incarnation, "needs_sync": engine.needs_sync(), **more}


def plan_rows(requests: list, context: int, vocab: int, eos_id: int, reserve: int = 0,
              refuse=None) -> tuple[list[dict], list]:
    """Split a generate call: rows answered here (refused: failed with error and code; or with nothing
    left to generate: a resumed row that had ended, no budget) and (index, row, budget) to decode, the
    budget clipped to the context. `reserve`: context tokens the engine keeps back (SGLang refuses
    input + max_new >= context); `refuse(row)`: the engine's own (code, message) or None."""
    out: list[dict] = [{}] * len(requests)
    todo = []
    for i, r in enumerate(requests):
        refused = row_error(r, context, vocab, reserve) or (refuse(r) if refuse else None)
        if refused:
            out[i] = failed_row(*refused)
            continue
        budget, prefix = room(r, context, reserve), list(r.get("prefix_ids", []))
        ended = bool(prefix) and prefix[-1] == eos_id
        if ended or budget <= 0:
            out[i] = {"response_ids": prefix, "logprobs": list(r.get("prefix_logprobs", [])),
                      "versions": list(r.get("prefix_versions", [])), "status": "completed" if ended else "truncated"}
        else:
            todo.append((i, r, budget))
    return out, todo


class EngineBase:
    """What every engine does alike: who it is, the version it serves and whether a restarted process
    still awaits it, the TransferMesh's endpoint, statistics, and generate's row planning."""

    engine_id: str
    context: int
    vocab: int
    eos_id: int
    _specs: dict

    def _start(self, engine_id: str) -> None:
        self.engine_id, self.version, self.mesh_endpoint = engine_id, 0, None
        self.incarnation = uuid.uuid4().hex     # new in every process: the controller counts a restart when it changes
        self._synced = threading.Event()        # clear in a restarted process until the current weights are re-sent
        if not reconstructed():
            self._synced.set()
        self._stats_lock = threading.Lock()
        self.stats = fresh_stats()

    def weight_version(self) -> int:
        return self.version

    def needs_sync(self) -> bool:
        return not self._synced.is_set()

    def weight_specs(self) -> dict:
        return dict(self._specs)

    def _landed(self, version: int) -> None:
        self.version = int(version)
        self._synced.set()

    def mesh(self, method: str, *args, **kwargs):
        """The TransferMesh's Receiver in this actor, made on first use."""
        if self.mesh_endpoint is None:
            import transfer

            self.mesh_endpoint = transfer.Receiver(target=self)
        return getattr(self.mesh_endpoint, method)(*args, **kwargs)

    def pop_stats(self) -> dict:
        with self._stats_lock:
            st, self.stats = self.stats, fresh_stats()
        return summarize_stats(st)

    def _count(self, **add) -> None:
        with self._stats_lock:
            for k, v in add.items():
                self.stats[k] += v

    def _count_step(self, rows: int) -> None:
        with self._stats_lock:
            self.stats["decode_steps"] += 1
            self.stats["_rows_sum"] += rows
            self.stats["running_rows_max"] = max(self.stats["running_rows_max"], rows)

    def _count_waits(self, waits: list[float]) -> None:
        with self._stats_lock:
            self.stats["_wait_sum"] += sum(waits)
            self.stats["_waited"] += len(waits)
            self.stats["queue_wait_s_max"] = max(self.stats["queue_wait_s_max"], *waits)

    def _plan(self, requests: list, reserve: int = 0, refuse=None) -> tuple[list[dict], list]:
        """plan_rows, once a restarted engine has the current weights."""
        if requests:
            wait_synced(self._synced, self.engine_id)
        return plan_rows(requests, self.context, self.vocab, self.eos_id, reserve, refuse)

    def _served(self, out: list[dict]) -> list[dict]:
        self._count(requests=len(out), tokens=sum(len(o["response_ids"]) for o in out))
        return out


# ---- what a version carries -------------------------------------------------------------------
def weight_specs_of(model_path: str, dtype: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The HF state_dict names and shapes of the model (built on the meta device: no memory), in
    the dtype the trainer publishes; lm_head is listed even where it is tied, as HF lists it."""
    from stages.lora import meta_model

    return {n: (tuple(t.shape), DTYPES[dtype]) for n, t in meta_model(model_path).state_dict().items()}


def published_specs(model_path: str, dtype: str, lora) -> dict:
    """What the trainer publishes to a library engine: the whole model, or with trainer.lora the adapter alone."""
    if lora is None:
        return weight_specs_of(model_path, dtype)
    from stages.lora import adapter_specs, meta_model

    return adapter_specs(meta_model(model_path), lora)


class AdapterSlots:
    """LoRA versions served as named adapters (vLLM, SGLang): each written as a peft directory (tmpfs
    where there is one: it is read once, at load); new requests are bound to the newest, and an adapter
    is freed once it is neither the newest nor bound to a request in flight."""

    def __init__(self, engine_id: str):
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.dir = tempfile.mkdtemp(prefix=f"loongsage-lora-{engine_id}-", dir=shm)
        self.current: int | None = None     # the adapter version new requests are bound to (None: the base)
        self._users: dict[int, int] = {}    # adapter version -> requests in flight bound to it
        self._lock = threading.Lock()

    def path(self, version: int) -> str:
        return os.path.join(self.dir, f"v{version}")

    def advance(self, version: int) -> list[int]:
        """Adapter `version` is loaded: new requests are bound to it. Returns the adapters now free."""
        with self._lock:
            self.current = int(version)
            self._users.setdefault(self.current, 0)
            return self._free()

    def bind(self) -> int | None:
        with self._lock:
            if self.current is not None:
                self._users[self.current] += 1
            return self.current

    def unbind(self, version: int | None) -> list[int]:
        if version is None:
            return []
        with self._lock:
            self._users[version] -= 1
            return self._free()

    def _free(self) -> list[int]:
        free = [v for v, n in self._users.items() if n == 0 and v != self.current]
        for v in free:
            del self._users[v]
        return free

    def remove(self, version: int | None = None) -> None:
        """An adapter's files, or (None) every one of them."""
        shutil.rmtree(self.dir if version is None else self.path(version), ignore_errors=True)


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


class VersionGate:
    """`hold` calls against weight updates: a version lands only when no hold call is in flight, and a
    hold call that arrives during an update waits for it. Updates are counted, not flagged: two updates
    queued one behind the other keep hold calls out until the second has landed, so a stream of hold
    calls never starves an update."""

    def __init__(self):
        self._cv = threading.Condition()
        self._holding = 0
        self._updating = 0

    @contextmanager
    def holding(self, hold: bool = True):
        """One call's whole life under one version (a no-op for an ordinary call)."""
        if hold:
            with self._cv:
                self._cv.wait_for(lambda: not self._updating)
                self._holding += 1
        try:
            yield
        finally:
            if hold:
                with self._cv:
                    self._holding -= 1
                    self._cv.notify_all()

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
