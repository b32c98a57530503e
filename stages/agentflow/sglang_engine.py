"""Scale-out rollout engine: an SGLang server behind the HFEngine method surface, in a Ray actor.

The actor launches `python -m sglang.launch_server` on the GPUs Ray gave it (TP across
them) and speaks its HTTP API, as slime does: token ids in (`input_ids`), token ids,
log-probs and per-token weight versions out (`meta_info.output_token_logprobs`,
`meta_info.weight_versions`). A server process, not an in-process `sglang.Engine`:
the actor is threaded (many rollout workers call `generate` at once) and the Engine's
event loop is not; the server batches concurrent requests itself.
It serves the one engine contract (engine_contract.py) the HF and vLLM engines serve, with
the pieces they share: the hold/update gate, sampling seeds, statistics, the weight specs, and
the wait for weights in a restarted process.

Weights (TransferMesh drives them, as for HFEngine):
  load_weights            the Receiver landed a version in this process (CUDA IPC from a
                          colocated trainer, NCCL, or host memory): hand it to the server
                          with update_weights_from_tensor. CUDA tensors cross as IPC
                          handles (nothing is copied through HTTP); host tensors are
                          first copied to this actor's GPU in buckets.
  init_weight_group /     the direct NCCL path: the trainer joins SGLang's own weight
  load_weights_distributed  group (DistributedWeightSender) and broadcasts straight into
                          the server's TP workers (update_weights_from_distributed).
A version is applied atomically: generation is paused (`retract`: running requests go
back to the queue and continue under the new weights, each token tagged with the version
that produced it: partial rollout) or, while a `hold` request is in flight, the update
waits for it to finish. SGLang's logprobs are those of logits / temperature, the
distribution sampled from, as the trainer computes them.

LoRA (trainer.lora on): the server runs the base with SGLang's LoRA support (--enable-lora,
--max-lora-rank, --lora-target-modules) and a version is the adapter alone. The landed
adapter is written as a peft adapter directory (tmpfs) and loaded with
/load_lora_adapter under the name v<version>; from then on new requests name it
(`lora_path`), and the previous adapter is unloaded (/unload_lora_adapter) once the last
request bound to it returns. A request is bound to one adapter for its whole life, so its
tokens carry that adapter's version; updates never pause generation. The file route, not
/load_lora_adapter_from_tensors: the file API is the same across SGLang releases, the
tensor one changed its fields (serialized_tensors -> serialized_named_tensors); an
adapter is small, so the round trip through tmpfs costs little.

GPU only: SGLang's kernels need CUDA. Tests and benchmarks/gpu/sglang_check.py run it
where a GPU is lent.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import timedelta

import torch

from stages.agentflow import engine_contract as contract
from stages.agentflow.engine_config import SGLangConfig
from stages.agentflow.engine_contract import STATUS
from stages.agentflow.limits import failed_row, model_limits, room, row_error
from stages.lora import LoraConfig, meta_model, write_adapter
from stages.model import load_tokenizer


def versions_of(meta: dict, n: int) -> list[int]:
    """Per-token weight versions from SGLang's spans ([{version, start, end}, ...]);
    servers that report only one version get it for every token."""
    spans = meta.get("weight_versions")
    if not spans:
        return [int(meta["weight_version"])] * n
    out = []
    for span in spans:
        out += [int(span["version"])] * (min(span["end"], n) - span["start"])
    return out + [out[-1] if out else int(meta["weight_version"])] * (n - len(out))


def parse_output(out: dict, prefix: dict, version: int | None = None) -> dict:
    """One /generate result -> the engine contract (prefix of a resumed partial rollout first).
    `version`: every new token's version (a LoRA request, bound to one adapter); else the server's."""
    meta = out["meta_info"]
    pairs = meta.get("output_token_logprobs") or []         # [logprob, token_id, text] per token
    ids = [int(p[1]) for p in pairs]
    finish = (meta.get("finish_reason") or {}).get("type", "abort")
    versions = versions_of(meta, len(ids)) if version is None else [int(version)] * len(ids)
    return {"response_ids": list(prefix.get("prefix_ids", [])) + ids,
            "logprobs": list(prefix.get("prefix_logprobs", [])) + [float(p[0]) for p in pairs],
            "versions": list(prefix.get("prefix_versions", [])) + versions,
            "status": STATUS.get(finish, "aborted")}


# the module names SGLang's --lora-target-modules takes (it adapts every layer's module of a name)
SGLANG_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_lora_targets(lora: LoraConfig, model_path: str, targets: list[str]) -> list[str]:
    """The module names SGLang is launched with for these targets; ValueError naming the key when
    SGLang cannot serve them as the trainer trains them."""
    if lora.modules_to_save:
        raise ValueError("trainer.lora.modules_to_save: rollout.engine=sglang serves LoRA adapters only (no module "
                         "trained in full beside them); leave it empty")
    names = sorted({t.rsplit(".", 1)[-1] for t in targets})
    unknown = [n for n in names if n not in SGLANG_LORA_MODULES]
    if unknown:
        raise ValueError(f"{lora.targets_key}: rollout.engine=sglang serves LoRA on {', '.join(SGLANG_LORA_MODULES)} "
                         f"only, not {', '.join(unknown)}")
    every = [n for n, _ in meta_model(model_path).named_modules() if n.rsplit(".", 1)[-1] in names]
    if sorted(every) != sorted(targets):
        missing = sorted(set(every) - set(targets))
        raise ValueError(f"{lora.targets_key}: rollout.engine=sglang adapts every layer's {', '.join(names)}; the "
                         f"targets leave out {len(missing)} of them (e.g. {missing[0]}): use trainer.lora."
                         "target_modules names")
    return names


def lora_module_names(specs: dict) -> list[str]:
    """The module names (q_proj, ...) an adapter's saved-adapter keys cover."""
    return sorted({n.removeprefix("base_model.model.").split(".lora_")[0].rsplit(".", 1)[-1] for n in specs})


def lora_server_args(lora: LoraConfig, names: list[str]) -> dict:
    """launch_server flags for serving adapters of this shape (two at once: the current version and
    the previous one, while requests bound to it finish)."""
    return {"enable-lora": True, "max-lora-rank": lora.rank, "lora-target-modules": list(names),
            "max-loras-per-batch": 2}


class SGLangEngine(contract.LibraryWeights):
    """HFEngine's surface over an SGLang server. Runs as a threaded Ray actor with
    num_gpus = cfg.tp (the server uses exactly the GPUs Ray assigned). The first five
    arguments are HFEngine's, so the controller builds either the same way."""

    def __init__(self, model_path: str, dtype: str = "bfloat16", seed: int = 0, num_threads: int = 1,
                 engine_id: str = "engine0", cfg: SGLangConfig | None = None, lora: LoraConfig | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("SGLangEngine needs a CUDA GPU (SGLang has no CPU path for this model); "
                               "use rollout.engine=hf on CPU")
        cfg = cfg or SGLangConfig()
        torch.set_num_threads(num_threads)
        self.engine_id, self.model_path, self.dtype, self.cfg, self.tp = engine_id, model_path, dtype, cfg, cfg.tp
        self.tok = load_tokenizer(model_path)
        self.eos_id = self.tok.eos_token_id
        self.version = 0
        self.incarnation = uuid.uuid4().hex      # new in every process: a changed one means restarted
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.mesh_endpoint = None
        self.lora = lora if lora is not None and lora.enabled else None
        self._specs = contract.published_specs(model_path, dtype, self.lora)
        self._adapter: str | None = None          # the adapter new requests are sent with (None: the base)
        self._bound: dict[str, int] = {}          # adapter -> requests in flight bound to it
        self._adapters = threading.Lock()
        if self.lora is not None:
            self._lora_dir = contract.adapter_dir(engine_id)
            # the module names SGLang adapts (every layer's; the controller checked the targets are those)
            self._lora_names = lora_module_names(self._specs)
            # the adapter files name their targets as SGLang reads them: a list of names, never a regex
            self._lora_files = dataclasses.replace(self.lora, target_regex="", target_modules=tuple(self._lora_names))
        # SGLang refuses a whole /generate batch if one row's input + max_new_tokens reaches its
        # context: rows are checked and clipped here instead, so one bad row fails alone
        self.context, self.vocab = model_limits(model_path)
        self.context = int(cfg.server_args.get("context-length") or cfg.server_args.get("context_length")
                           or self.context)
        self.vocab = self.vocab or len(self.tok)
        self._gate = contract.VersionGate()     # hold requests vs weight updates
        self._update_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self.stats = contract.fresh_stats()
        # a restarted engine's server holds the initial weights: it waits for the current version
        self._synced = threading.Event()
        if not contract.reconstructed():
            self._synced.set()
        self._launch(seed)

    # ---- the server ------------------------------------------------------------------
    def _launch(self, seed: int) -> None:
        c = self.cfg
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        args = {"model-path": self.model_path, "host": "127.0.0.1", "port": self.port, "tp-size": c.tp,
                "dtype": self.dtype, "random-seed": seed, "mem-fraction-static": c.mem_fraction,
                "weight-version": "0", "skip-tokenizer-init": True}
        if self.lora is not None:
            args |= lora_server_args(self.lora, self._lora_names)
        args |= dict(c.server_args)
        cmd = [sys.executable, "-m", "sglang.launch_server"]
        for k, v in args.items():
            if v is True:
                cmd.append(f"--{k}")
            elif isinstance(v, (list, tuple)):
                cmd += [f"--{k}", *map(str, v)]
            elif v is not False and v is not None:
                cmd += [f"--{k}", str(v)]
        self.log_path = os.path.join(tempfile.gettempdir(), f"loongsage-sglang-{self.engine_id}-{self.port}.log")
        log = open(self.log_path, "w")
        # its own session: the server and its TP workers are stopped as one group in close()
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + c.startup_timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang server exited with {self.proc.returncode}:\n{self._log_tail()}")
            try:
                if self._http("GET", "/health_generate", timeout=5).status_code == 200:
                    return
            except OSError:
                pass
            time.sleep(2)
        self.close()
        raise TimeoutError(f"SGLang server not ready after {c.startup_timeout_s:.0f}s:\n{self._log_tail()}")

    def _log_tail(self, n: int = 4000) -> str:
        with open(self.log_path) as f:
            return f.read()[-n:]

    def _http(self, method: str, path: str, payload: dict | None = None, timeout: float | None = None):
        import requests

        return requests.request(method, self.url + path, json=payload, timeout=timeout or self.cfg.request_timeout_s)

    def _post(self, path: str, payload: dict | None = None) -> dict:
        r = self._http("POST", path, payload or {})
        if r.status_code != 200:
            raise RuntimeError(f"SGLang {path} failed ({r.status_code}): {r.text[:2000]}")
        return r.json() if r.content else {}

    def close(self) -> None:
        if getattr(self, "proc", None) is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
        if getattr(self, "_lora_dir", None):
            shutil.rmtree(self._lora_dir, ignore_errors=True)

    # ---- identity / weights --------------------------------------------------------
    def info(self) -> dict:
        return contract.identity(self, server=self.url, engine="sglang")

    def load_weights(self, named_tensors: dict, version: int) -> None:
        """Apply one complete version (update_weights_from_tensor, bucket by bucket). Each
        bucket is first copied into memory this process owns on its GPU (the landed
        tensors may be views of another process's IPC buffer, or in host memory), then
        shared with the server's TP workers as CUDA IPC handles."""
        if self.lora is not None:
            return self._load_adapter(named_tensors, version)
        from sglang.srt.utils import MultiprocessingSerializer

        buckets = list(self._buckets(named_tensors))
        with self._exclusive():
            if not buckets:     # no weights, only the clock (a resumed run): the server tags tokens with it
                self._post("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
            for i, bucket in enumerate(buckets):
                owned = [(n, t.to(self.device, copy=True)) for n, t in bucket]
                torch.cuda.current_stream(self.device).synchronize()
                last = i == len(buckets) - 1
                blob = MultiprocessingSerializer.serialize(owned, output_str=True)
                self._post("/update_weights_from_tensor", {
                    "serialized_named_tensors": [blob] * self.tp,     # one payload per TP rank
                    "flush_cache": last, "weight_version": str(version) if last else None})
                del owned
            self.version = int(version)
        self._synced.set()

    def _load_adapter(self, named: dict, version: int) -> None:
        """A LoRA version: load it as adapter v<version>; new requests use it from the moment it is
        loaded (requests in flight finish on theirs), and the previous one goes when it is free."""
        if not named:       # only the clock (a resumed run): the adapter itself follows in a publish
            self.version = int(version)
            self._synced.set()
            return
        name = f"v{int(version)}"
        path = write_adapter(named, self._lora_files, self.model_path, os.path.join(self._lora_dir, name))
        self._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        with self._adapters:
            previous, self._adapter, self.version = self._adapter, name, int(version)
        self._synced.set()
        self._release(previous)

    @contextmanager
    def _bind_adapter(self):
        """(adapter name or None, its version) for one /generate call, held until the call returns."""
        with self._adapters:
            name, version = self._adapter, self.version
            if name is not None:
                self._bound[name] = self._bound.get(name, 0) + 1
        try:
            yield name, version
        finally:
            if name is not None:
                with self._adapters:
                    self._bound[name] -= 1
                self._release(name)

    def _release(self, name: str | None) -> None:
        """Unload an adapter that is neither current nor bound to a request in flight."""
        with self._adapters:
            if name is None or name == self._adapter or self._bound.get(name, 0) > 0:
                return
            self._bound.pop(name, None)
        self._post("/unload_lora_adapter", {"lora_name": name})
        shutil.rmtree(os.path.join(self._lora_dir, name), ignore_errors=True)

    def _buckets(self, named: dict):
        bucket, size = [], 0
        for n, t in named.items():
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > self.cfg.bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((n, t))
            size += nbytes
        if bucket:
            yield bucket

    def init_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                          group_name: str = "loongsage", backend: str = "nccl") -> None:
        """Join the trainer's NCCL group: this server's TP workers take ranks
        rank_offset .. rank_offset + tp - 1 (the trainer is rank 0)."""
        self._post("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    def load_weights_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                 version: int, group_name: str = "loongsage") -> None:
        """Receive one version broadcast by DistributedWeightSender, in `names` order."""
        with self._exclusive():
            self._post("/update_weights_from_distributed", {
                "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "flush_cache": True, "weight_version": str(version)})
            self.version = int(version)
        self._synced.set()

    @contextmanager
    def _exclusive(self):
        """Keep a version whole: one update at a time, after the `hold` requests in flight
        have finished, with generation paused (queued requests wait for resume)."""
        with self._update_lock, self._gate.updating():
            self.pause(self.cfg.pause_mode)
            try:
                yield
            finally:
                self.resume()

    # ---- partial rollout controls ----------------------------------------------------
    def pause(self, mode: str = "retract") -> None:
        self._post("/pause_generation", {"mode": mode})

    def resume(self) -> None:
        self._post("/continue_generation", {})

    def abort_all(self) -> None:
        """Abort every request in flight now; they return with status aborted."""
        self._post("/abort_request", {"abort_all": True})

    def pop_stats(self) -> dict:
        """The contract's figures; the server batches on its own, so decode_steps and the queue wait are 0."""
        with self._stats_lock:
            st, self.stats = self.stats, contract.fresh_stats()
        return contract.summarize_stats(st)

    # ---- generation ----------------------------------------------------------------
    def generate(self, requests: list[dict]) -> list[dict]:
        """Each request: prompt_ids, max_new_tokens, temperature, top_p, [prefix_ids,
        prefix_logprobs, prefix_versions] (resume), [hold] (one version for the whole call).
        Returns per request: response_ids, logprobs, versions, status; a row refused before
        decoding (malformed, or over the context) has status failed, `error` and `code`."""
        if not requests:
            return []
        contract.wait_synced(self._synced, self.engine_id)
        t0 = time.time()
        hold = any(isinstance(r, dict) and r.get("hold") for r in requests)
        out, todo = plan_rows(requests, self.context, self.vocab, self.eos_id, self.version)
        if todo:
            payload = {"input_ids": [list(r["prompt_ids"]) + list(r.get("prefix_ids", [])) for _, r, _ in todo],
                       "sampling_params": [self._sampling(r, b) for _, r, b in todo],
                       "return_logprob": True, "logprob_start_len": -1}
            with self._gate.holding(hold), self._bind_adapter() as (adapter, version):
                if adapter is not None:
                    payload["lora_path"] = [adapter] * len(todo)
                results = self._post("/generate", payload)
            results = results if isinstance(results, list) else [results]
            for (i, r, _), res in zip(todo, results):
                out[i] = parse_output(res, r, version if self.lora is not None else None)
        with self._stats_lock:
            self.stats["requests"] += len(requests)
            self.stats["tokens"] += sum(len(o["response_ids"]) for o in out)
            self.stats["busy_s"] += time.time() - t0
        return out

    @staticmethod
    def _sampling(r: dict, budget: int) -> dict:
        s = contract.sampling_of(r)
        params = {"max_new_tokens": budget, "temperature": s.temperature, "top_p": s.top_p,
                  "skip_special_tokens": False, "no_stop_trim": True}
        if s.seed is not None:     # the sample's own stream, advanced past a resumed prefix
            params["sampling_seed"] = s.seed
        return params


def plan_rows(requests: list, context: int, vocab: int, eos_id: int, version: int) -> tuple[list[dict], list]:
    """Split a generate call: rows answered here (refused, or with nothing left to generate) and
    (index, row, budget) for the server, each budget clipped so input + budget < context."""
    out: list[dict] = [{}] * len(requests)
    todo = []
    for i, r in enumerate(requests):
        refused = row_error(r, context, vocab, reserve=1)
        if refused:
            out[i] = failed_row(*refused)
            continue
        budget = room(r, context, reserve=1)
        done = bool(r.get("prefix_ids")) and r["prefix_ids"][-1] == eos_id
        if budget <= 0 or done:     # nothing left to generate: return the prefix as it is
            out[i] = parse_output({"meta_info": {"finish_reason": {"type": "stop" if done else "length"},
                                                 "weight_version": version}}, r)
        else:
            todo.append((i, r, budget))
    return out, todo


class DistributedWeightSender:
    """The trainer's side of SGLang's update_weights_from_distributed: rank 0 of one NCCL
    group whose other ranks are every engine's TP workers. Lives where the full HF
    weights are (the trainer's leader), on its GPU."""

    def __init__(self, engines: list, tp_sizes: list[int], master_address: str, master_port: int,
                 group_name: str = "loongsage", timeout_s: float = 600.0):
        import ray
        from sglang.srt.utils import init_custom_process_group

        self.engines, self.group_name = list(engines), group_name
        world = 1 + sum(tp_sizes)
        offsets = [1 + sum(tp_sizes[:i]) for i in range(len(engines))]
        refs = [e.init_weight_group.remote(master_address, master_port, off, world, group_name)
                for e, off in zip(engines, offsets)]
        # SGLang's own helper, the one its workers use: a group apart from any default group
        self.group = init_custom_process_group(backend="nccl", init_method=f"tcp://{master_address}:{master_port}",
                                               world_size=world, rank=0, group_name=group_name,
                                               timeout=timedelta(seconds=timeout_s))
        ray.get(refs)

    def send(self, state: dict[str, torch.Tensor], version: int) -> None:
        import ray
        import torch.distributed as dist

        names = list(state)
        dtypes = [str(state[n].dtype).removeprefix("torch.") for n in names]
        shapes = [list(state[n].shape) for n in names]
        refs = [e.load_weights_distributed.remote(names, dtypes, shapes, version, self.group_name)
                for e in self.engines]
        for n in names:         # the engines receive in this same order
            dist.broadcast(state[n].contiguous(), group=self.group, group_src=0)
        ray.get(refs)
