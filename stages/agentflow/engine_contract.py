"""The one engine contract every rollout engine serves (HF: engine.py, vLLM: vllm_engine.py,
SGLang: sglang_engine.py), and the plumbing they share (EngineBase, VersionGate, AdapterSlots).

The rollout stage, the proxy, evaluation, the controller and the TransferMesh call only these
methods; which engine answers is `engine.kind`. What each call means:

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

from stages.agentflow.client import EngineRestarting
from stages.agentflow.limits import failed_row, model_limits, room, row_error
from stages.lora import adapter_specs, meta_model, write_adapter
from stages.model import DTYPES, load_tokenizer

RESTART_WAIT_S = 10.0         # a restarted engine's calls wait this long for the weights, then fail as restarting
# an engine's finish reason -> the row's status (vLLM's and SGLang's names are the same)
STATUS = {"stop": "completed", "length": "truncated", "abort": "aborted"}
# pop_stats' counters; the _sums become means
FRESH_STATS = {"requests": 0, "tokens": 0, "busy_s": 0.0, "decode_steps": 0, "_rows_sum": 0, "running_rows_max": 0,
               "_wait_sum": 0.0, "_waited": 0, "queue_wait_s_max": 0.0}


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
    still awaits it, the TransferMesh's endpoint, statistics, and generate's row planning. An engine sets
    context, vocab, eos_id and `about` (what info() adds: engine, the kind; threads or server)."""

    def _start(self, engine_id: str) -> None:
        self.engine_id, self.version, self.mesh_endpoint = engine_id, 0, None
        self.incarnation = uuid.uuid4().hex     # new in every process: the controller counts a restart when it changes
        self._synced = threading.Event()        # clear in a restarted process until the current weights are re-sent
        if not reconstructed():
            self._synced.set()
        self._stats_lock = threading.Lock()
        self.stats = dict(FRESH_STATS)
        self._gate = VersionGate()              # hold calls against updates

    def _start_library(self, model_path: str, dtype: str, engine_id: str, cfg, lora) -> None:
        """A library engine's (vLLM's, SGLang's) start: the tokenizer, the model's limits, what a version
        carries and, with trainer.lora, its adapter slots."""
        self._start(engine_id)
        self.model_path, self.dtype, self.cfg = model_path, dtype, cfg
        self.lora = lora if lora is not None and lora.enabled else None
        self.tok = load_tokenizer(model_path)
        self.eos_id = self.tok.eos_token_id
        self.context, self.vocab = model_limits(model_path)
        self.vocab = self.vocab or len(self.tok)
        self._specs = published_specs(model_path, dtype, self.lora)
        self._slots = AdapterSlots(engine_id) if self.lora is not None else None
        self._lora_files = self.lora        # the adapter as the engine reads its files

    def info(self) -> dict:
        return {"engine_id": self.engine_id, "pid": os.getpid(), "host": socket.gethostname(),
                "version": self.version, "incarnation": self.incarnation, "needs_sync": self.needs_sync(), **self.about}

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
            st, self.stats = self.stats, dict(FRESH_STATS)
        st["running_rows_mean"] = st.pop("_rows_sum") / max(st["decode_steps"], 1)
        st["queue_wait_s_mean"] = st.pop("_wait_sum") / max(st.pop("_waited"), 1)
        return st

    def _count(self, most: dict | None = None, **add) -> None:
        """Add to the counters; `most`: maxima to raise."""
        with self._stats_lock:
            for k, v in add.items():
                self.stats[k] += v
            for k, v in (most or {}).items():
                self.stats[k] = max(self.stats[k], v)

    def _count_step(self, rows: int) -> None:
        self._count({"running_rows_max": rows}, decode_steps=1, _rows_sum=rows)

    def _count_waits(self, waits: list[float]) -> None:
        self._count({"queue_wait_s_max": max(waits)}, _wait_sum=sum(waits), _waited=len(waits))

    def _plan(self, requests: list, reserve: int = 0, refuse=None) -> tuple[list[dict], list]:
        """plan_rows, once a restarted engine has the current weights."""
        if requests:
            wait_synced(self._synced, self.engine_id)
        return plan_rows(requests, self.context, self.vocab, self.eos_id, reserve, refuse)

    def _served(self, out: list[dict]) -> list[dict]:
        self._count(requests=len(out), tokens=sum(len(o["response_ids"]) for o in out))
        return out

    def _load_adapter(self, named: dict, version: int) -> None:
        """A LoRA version (vLLM, SGLang): adapter v<version>, bound by the requests that start from now on
        (those in flight keep theirs); the previous one goes once it is free. Empty: only the clock (a
        resumed run; the adapter itself follows in a publish)."""
        version = int(version)
        if named:
            write_adapter(named, self._lora_files, self.model_path, self._slots.path(version))
            self._add_adapter(version)
            self._unload(self._slots.advance(version))
        self._landed(version)

    def _unload(self, versions: list[int]) -> None:
        for v in versions:
            self._remove_adapter(v)
            self._slots.remove(v)


# ---- what a version carries -------------------------------------------------------------------
def published_specs(model_path: str, dtype: str, lora=None) -> dict:
    """What the trainer publishes to a library engine: the HF state_dict names and shapes of the model (built
    on the meta device: no memory) in the dtype it publishes, lm_head listed even where it is tied, as HF lists
    it; or with trainer.lora the adapter alone."""
    model = meta_model(model_path)
    if lora is not None:
        return adapter_specs(model, lora)
    return {n: (tuple(t.shape), DTYPES[dtype]) for n, t in model.state_dict().items()}


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
