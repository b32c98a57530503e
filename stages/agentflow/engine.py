"""Embedded rollout engine: an HF causal LM in a Ray actor, token ids in, token ids out.

Why our own decode loop instead of `model.generate`: we need, per token, the sampled id,
its log-probability under exactly the distribution sampled from (logits / temperature),
and the weight version that produced it. Weight updates take the same lock as a decode
step, so a step never sees half-loaded weights, and a sequence that spans an update
records both versions (partial rollout) unless the request asks to hold the lock.

With trainer.lora on, a version is the adapter alone: it lands in the engine's adapter
buffers under the same lock, then is merged into the weights from a kept base copy
(serve=merge) or served by peft's layers (serve=peft); see stages/lora.py.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import socket
import threading
import time
import uuid

import numpy as np
import torch

from stages.agentflow.limits import failed_row, row_error
from stages.lora import SERVERS, LoraConfig
from stages.model import load_model, load_tokenizer
from stages.priority import lower_priority

RESYNC_TIMEOUT_S = 120.0
CALIBRATE_MAX_PARAMS = 50_000_000   # larger models are matmul-bound: they keep every thread they are given
CALIBRATE_ROUNDS = 5                 # timings per thread setting; the best of each is compared
CALIBRATE_MARGIN = 0.9               # more threads are kept only when at least 10% faster


def _reconstructed() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed
    except Exception:  # noqa: BLE001 - not in an actor (tests build engines in-process)
        return False


class HFEngine:
    """Batched sampling with a KV cache. Runs as a threaded Ray actor (max_concurrency > 1)."""

    def __init__(self, model_path: str, dtype: str = "float32", seed: int = 0, num_threads: int = 1,
                 engine_id: str = "engine0", nice: int = 0, lora: LoraConfig | None = None):
        lower_priority(nice)
        torch.set_num_threads(num_threads)
        self.engine_id = engine_id
        self.model = load_model(model_path, dtype)
        # transformers 5.x renamed past_key_values -> cache; support both spellings (asked of the HF model:
        # a peft wrapper's forward takes **kwargs)
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        # LoRA: versions are adapters, applied to this base (which never changes)
        self.adapter = SERVERS[lora.serve](self.model, lora) if lora is not None and lora.enabled else None
        if self.adapter is not None:
            self.model = self.adapter.model
        self.tok = load_tokenizer(model_path)
        self.eos_id = self.tok.eos_token_id
        self.pad_id = self.tok.pad_token_id
        # a row over the context fails alone; every row's budget is clipped to the room it leaves
        text_cfg = self.model.config.get_text_config()
        self.context = int(getattr(text_cfg, "max_position_embeddings", 0) or 0)
        self.vocab = self.model.get_input_embeddings().num_embeddings
        self.version = 0
        self._lock = threading.Lock()
        self._gen = torch.Generator().manual_seed(seed)
        self._abort_before = -1.0           # requests dispatched before this time are aborted
        self.mesh_endpoint = None
        self.stats = {"requests": 0, "tokens": 0, "busy_s": 0.0}
        self._synced = threading.Event()
        self._synced.set()
        self.threads = self._pick_threads(num_threads)
        torch.set_num_threads(self.threads)
        # A restarted engine (Ray re-ran this constructor after the process died) holds the
        # initial weights: it serves nothing until the controller has re-sent the current version.
        # `incarnation` is new in every process: the controller counts a restart only when it changes.
        self.incarnation = uuid.uuid4().hex
        self._awaiting_resend = _reconstructed()
        if self._awaiting_resend:
            self._synced.clear()

    def _pick_threads(self, most: int) -> int:
        """`most` threads, or 1 where that generates faster: a small model's decode step is a
        few tiny matmuls, and splitting them costs more than it saves (quickstart: 64 rows in
        17 ms on 1 thread, 21 ms on 2). Timed once at start, on a batch shaped like a rollout
        unit (8 prompts x 8 samples), the two settings interleaved, best of CALIBRATE_ROUNDS each;
        a large model keeps `most` untimed."""
        if most <= 1 or sum(p.numel() for p in self.model.parameters()) > CALIBRATE_MAX_PARAMS:
            return max(1, most)
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, self.model.config.vocab_size, (8, 6), generator=g).tolist()
        reqs = [{"prompt_ids": p, "seed": k} for p in prompts for k in range(8)]

        best = {1: float("inf"), most: float("inf")}
        for _ in range(CALIBRATE_ROUNDS):     # interleaved: a burst of load at start-up hits both alike
            for threads in best:
                torch.set_num_threads(threads)
                t = time.perf_counter()
                self._decode(reqs, 6, 1.0, 1.0, False, time.time())
                best[threads] = min(best[threads], time.perf_counter() - t)
        # more threads must win clearly: one thread leaves the other cores to the rest of the pipeline
        return most if best[most] < CALIBRATE_MARGIN * best[1] else 1

    # ---- identity / weights --------------------------------------------------------
    def info(self) -> dict:
        return {"engine_id": self.engine_id, "pid": os.getpid(), "host": socket.gethostname(),
                "version": self.version, "threads": self.threads, "incarnation": self.incarnation}

    def weight_version(self) -> int:
        return self.version

    def needs_sync(self) -> bool:
        """True on a restarted engine until its first complete weight load. Not the serving flag:
        that one is also clear while an ordinary version lands in place (weights_in_place)."""
        return self._awaiting_resend

    def _landing(self) -> dict:
        """The tensors a version is written into: the model's, or the adapter's buffers."""
        return self.model.state_dict() if self.adapter is None else self.adapter.buffers

    def weight_specs(self) -> dict:
        return {n: (tuple(t.shape), t.dtype) for n, t in self._landing().items()}

    def load_weights(self, named_tensors: dict, version: int) -> None:
        """Apply one complete version atomically (between decode steps)."""
        with self._lock:
            if self.adapter is None:
                self.model.load_state_dict(named_tensors, strict=False)
            elif named_tensors:     # empty: only the clock (a resumed run)
                with torch.no_grad():
                    for n, t in self.adapter.buffers.items():
                        t.copy_(named_tensors[n])
                self.adapter.apply()
            self.version = int(version)
            self._awaiting_resend = False
        self._synced.set()

    @contextlib.contextmanager
    def weights_in_place(self, version: int):
        """The live tensors, for a Receiver to copy a version into bucket by bucket. The
        decode lock is held throughout, so no step sees a half-landed version; if landing
        fails part-way the engine serves nothing until a complete version arrives."""
        with self._lock, torch.no_grad():
            self._synced.clear()
            yield self._landing()
            if self.adapter is not None:
                self.adapter.apply()        # the landed adapter into the weights (merge) or nothing (peft)
            self.version = int(version)
            self._awaiting_resend = False
            self._synced.set()

    def _acquire_serving(self) -> None:
        """Take the decode lock on complete weights: a failed in-place load leaves half a
        version, and the step waits (bounded) for the next one rather than sample from it."""
        deadline = time.monotonic() + RESYNC_TIMEOUT_S
        while True:
            self._lock.acquire()
            if self._synced.is_set():
                return
            self._lock.release()
            if not self._synced.wait(timeout=max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"{self.engine_id} holds a partly loaded version and was not "
                                   f"re-sent weights within {RESYNC_TIMEOUT_S:.0f}s")

    def state_dict_ref(self):
        return {n: t.clone() for n, t in self.model.state_dict().items()}

    def mesh(self, method: str, *args, **kwargs):
        if self.mesh_endpoint is None:
            import transfer

            self.mesh_endpoint = transfer.Receiver(target=self)
        return getattr(self.mesh_endpoint, method)(*args, **kwargs)

    def abort_all(self) -> None:
        """Abort every request in flight now (used when a run stops or a window is closed)."""
        self._abort_before = time.time()

    def pop_stats(self) -> dict:
        out, self.stats = self.stats, {"requests": 0, "tokens": 0, "busy_s": 0.0}
        return out

    # ---- generation ----------------------------------------------------------------
    def generate(self, requests: list[dict]) -> list[dict]:
        """Each request: prompt_ids, max_new_tokens, temperature, top_p, [prefix_ids, prefix_logprobs,
        prefix_versions] (resume a partial rollout), [hold] (keep one version for the whole call).
        Returns per request: response_ids, logprobs, versions, status (completed|truncated|aborted|failed);
        a failed row (malformed, or its prompt does not fit the context) has `error` and `code`,
        and is not decoded: the other rows are served."""
        if not requests:
            return []
        if not self._synced.wait(timeout=RESYNC_TIMEOUT_S):
            raise RuntimeError(f"{self.engine_id} restarted and was not re-sent the current weights within "
                               f"{RESYNC_TIMEOUT_S:.0f}s")
        t0 = time.time()
        groups: dict[tuple, list[int]] = {}
        out: list[dict] = [{}] * len(requests)
        for i, r in enumerate(requests):  # one decode loop per sampling setting
            refused = row_error(r, self.context, self.vocab)
            if refused:
                out[i] = failed_row(*refused)
                continue
            key = (int(r["max_new_tokens"]), float(r.get("temperature", 1.0)), float(r.get("top_p", 1.0)),
                   bool(r.get("hold", False)))
            groups.setdefault(key, []).append(i)
        for (max_new, temp, top_p, hold), idx in groups.items():
            for i, res in zip(idx, self._decode([requests[i] for i in idx], max_new, temp, top_p, hold, t0)):
                out[i] = res
        self.stats["requests"] += len(requests)
        self.stats["tokens"] += sum(len(o["response_ids"]) for o in out)
        self.stats["busy_s"] += time.time() - t0
        return out

    def _decode(self, reqs, max_new, temp, top_p, hold, t_start):
        n = len(reqs)
        seqs = [list(r["prompt_ids"]) + list(r.get("prefix_ids", [])) for r in reqs]
        resp = [list(r.get("prefix_ids", [])) for r in reqs]
        lps = [list(r.get("prefix_logprobs", [])) for r in reqs]
        vers = [list(r.get("prefix_versions", [])) for r in reqs]
        done = [len(x) > 0 and x[-1] == self.eos_id for x in resp]
        # a request with its own seed samples token t from a uniform drawn by hash(seed, t): reproducible
        # whatever it is batched with, and a resumed partial rollout draws what an uninterrupted one would
        seeds = [int(r["seed"]) if "seed" in r else None for r in reqs]
        budget = [max_new - len(x) for x in resp]
        if self.context:    # prompt + response never outgrow the context: decode work per row is bounded
            budget = [min(b, self.context - len(s)) for b, s in zip(budget, seqs)]
        width = max(map(len, seqs))
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, s in enumerate(seqs):  # left padding keeps the newest token in the last column
            ids[i, width - len(s):] = torch.tensor(s)
            mask[i, width - len(s):] = 1
        # Rows with the same context (a group's N samples of one prompt) share one prefill: it runs
        # on one row per distinct context and the KV cache is then copied out to every row.
        first: dict[tuple, int] = {}
        inv = torch.tensor([first.setdefault(tuple(s), i) for i, s in enumerate(seqs)])
        shared = sorted(set(first.values())) if len(first) < n else None
        cache, step_ids = None, ids
        if hold:
            self._acquire_serving()
        try:
            for _ in range(max(budget + [0])):
                if all(d or b <= 0 for d, b in zip(done, budget)) or self._abort_before > t_start:
                    break
                pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
                with torch.no_grad():
                    if not hold:
                        self._acquire_serving()
                    try:
                        if cache is None and shared is not None:
                            logits, cache = self._shared_prefill(step_ids, mask, pos, shared, inv)
                        else:
                            o = self.model(input_ids=step_ids, attention_mask=mask, position_ids=pos,
                                           use_cache=True, **{self._cache_kw: cache})
                            logits, cache = o.logits[:, -1], o[self._cache_kw]
                        version = self.version
                    finally:
                        if not hold:
                            self._lock.release()
                tok, lp = self._sample(logits.float(), temp, top_p, seeds, [len(x) for x in resp])
                toks, lpl = tok.tolist(), lp.tolist()
                for i in range(n):
                    if done[i] or budget[i] <= 0:
                        continue
                    t = toks[i]
                    resp[i].append(t)
                    lps[i].append(lpl[i])
                    vers[i].append(version)
                    budget[i] -= 1
                    done[i] = t == self.eos_id
                alive = torch.tensor([not d and b > 0 for d, b in zip(done, budget)])
                step_ids = torch.where(alive, tok, torch.full_like(tok, self.pad_id)).unsqueeze(1)
                mask = torch.cat([mask, alive.long().unsqueeze(1)], dim=1)
        finally:
            if hold:
                self._lock.release()
        aborted = self._abort_before > t_start
        return [{"response_ids": resp[i], "logprobs": lps[i], "versions": vers[i],
                 "status": "completed" if done[i] else ("aborted" if aborted and budget[i] > 0 else "truncated")}
                for i in range(n)]

    def _shared_prefill(self, ids, mask, pos, rows: list[int], inv: torch.Tensor):
        """The prefill of `rows` only (one per distinct context); every row's last logits and KV cache."""
        sel = torch.tensor(rows)
        o = self.model(input_ids=ids[sel], attention_mask=mask[sel], position_ids=pos[sel], use_cache=True)
        cache = o[self._cache_kw]
        where = torch.full((int(inv.max()) + 1,), -1, dtype=torch.long)
        where[sel] = torch.arange(len(rows))
        cache.reorder_cache(where[inv])      # beam search's batch gather: row i gets its context's keys/values
        return o.logits[where[inv], -1], cache

    def _sample(self, logits: torch.Tensor, temp: float, top_p: float, seeds=None, steps=None):
        """Sample one token per row; logprob is under the tempered distribution (what the trainer computes).

        One uniform per row, then the inverse of the (top-p cut) CDF: the whole batch in a few
        vector ops. Rows with a seed take their uniform from `seeded_uniform(seed, step)` (step:
        the response token's index); the others from the engine's own generator."""
        if temp <= 0:  # greedy
            logp = torch.log_softmax(logits, -1)
            tok = logits.argmax(-1)
            return tok, logp.gather(-1, tok[:, None])[:, 0]
        logp = torch.log_softmax(logits / temp, -1)
        probs = logp.exp()
        if top_p < 1.0:
            sp, si = probs.sort(-1, descending=True)
            keep = sp.cumsum(-1) - sp < top_p
            probs = torch.zeros_like(probs).scatter(-1, si, sp * keep)
        seeds = seeds or [None] * probs.shape[0]
        u = torch.empty(probs.shape[0], dtype=torch.float64)
        own = [i for i, x in enumerate(seeds) if x is None]
        if own:     # in (0, 1]
            u[own] = 1.0 - torch.rand(len(own), generator=self._gen, dtype=torch.float64)
        if len(own) < len(seeds):
            rows = [i for i, x in enumerate(seeds) if x is not None]
            u[rows] = torch.from_numpy(seeded_uniform([seeds[i] for i in rows], [steps[i] for i in rows]))
        tok = inverse_cdf(probs, u)
        return tok, logp.gather(-1, tok[:, None])[:, 0]


_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit flips about half the output bits (uint64, wrapping)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def seeded_uniform(seeds, steps) -> np.ndarray:
    """A uniform in (0, 1] per (seed, step), a pure function of the pair (float64, 53 random bits)."""
    s = np.array([int(x) % 2 ** 64 for x in seeds], dtype=np.uint64)     # any int: an API caller's seed too
    t = np.asarray(steps, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = _mix(_mix(s * _GOLDEN + _GOLDEN) ^ (t * _GOLDEN))
    return ((z >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0 ** -53


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative probability reaches u x the row's total: a token of
    probability 0 is never chosen (u > 0), and rows need not sum to 1 (a top-p cut)."""
    cdf = probs.double().cumsum(-1)
    target = (u * cdf[:, -1])[:, None]
    return (cdf < target).sum(-1).clamp(max=probs.shape[-1] - 1)
