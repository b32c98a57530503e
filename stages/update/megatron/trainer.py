"""Megatron-core trainer: the same update as the torch trainer, on a TP x PP x DP model.

Every rank is a Ray actor running this class. Rank 0, the leader, is the handle the controller and the
TransferMesh hold; its public methods run the matching `rank_*` method on every rank, since all ranks
join the same collectives. Each DP rank computes the old / reference log-probs of its rows, then they
are all-gathered. A micro-batch's loss goes to megatron's schedule as (loss x n, n), n what the loss
aggregation divides by; with calculate_per_token_loss megatron divides the gradients by the total n
over micro-batches and DP ranks: TorchTrainer's mini-batch loss.
"""
from __future__ import annotations

import contextlib
import os
from functools import partial

import numpy as np
import pyarrow as pa
import ray
import torch
from transformers import AutoConfig

from stages.tokenizer import save_tokenizer
from stages.update.config import AlgorithmConfig, TrainerConfig
from stages.update.losses import policy_loss
from stages.update.step import Batch, Trainer, corrected

from . import parallel
from .config import MegatronConfig
from .convert import Arch, to_megatron
from .logprobs import chunked_token_logprobs, defer_head, token_logprobs
from .model import build_gpt, hf_reader, layer_index, transformer_config


class MegatronTrainer(Trainer):
    def __init__(self, model_path: str, cfg: TrainerConfig, algo: AlgorithmConfig, temperature: float = 1.0,
                 max_new_tokens: int = 0, dtype: str = "float32", mcfg: MegatronConfig | None = None):
        super().__init__(cfg, algo, temperature, max_new_tokens)
        self.model_path, self.mcfg, self.dtype = model_path, mcfg or MegatronConfig(), dtype
        self.hf = AutoConfig.from_pretrained(model_path)
        self.arch = Arch.from_hf(self.hf)
        self.pad_id = self.hf.pad_token_id or 0
        self.peers: list = []

    # ---- start-up (launch.py calls these on every rank) -----------------------------
    def rendezvous(self) -> tuple[str, int]:
        return parallel.free_address()

    def setup(self, rank: int, addr: str, port: int) -> None:
        m = self.mcfg
        self.on_cpu = m.device == "cpu" or (m.device == "auto" and not torch.cuda.is_available())
        if not self.on_cpu and not torch.cuda.is_available():
            raise RuntimeError("megatron.device=cuda but this rank sees no GPU")
        # Ray gives each rank its own GPU
        self.device = torch.device("cpu") if self.on_cpu else torch.device("cuda", torch.cuda.current_device())
        parallel.init(rank, addr, port, self.mcfg, self.device, self.cfg.seed)
        with self._ctx():
            self._build()

    def connect(self, peers: list) -> None:
        """Leader only: the other ranks' actor handles, in rank order."""
        self.peers = list(peers)

    def _ctx(self):
        if self.on_cpu:
            from . import cpu_shim
            return cpu_shim.CudaAsCpu()
        return contextlib.nullcontext()

    def _build(self) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        m = self.mcfg
        self.config = transformer_config(self.arch, m.tensor_parallel, m.pipeline_parallel, self.dtype,
                                         self.on_cpu, m.recompute_activations)
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.module = self._load_gpt()
        self.ref = self._load_gpt().eval().requires_grad_(False) if self.algo.kl_coef > 0 else None
        # the last stage's models hand back hidden states; the loss applies their heads in chunks
        self._heads = {id(g): h for g in (self.module, self.ref) if g is not None and (h := defer_head(g))}
        self.model = DistributedDataParallel(
            self.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                       use_distributed_optimizer=m.use_distributed_optimizer),
            self.module)
        self.config.finalize_model_grads_func = finalize_model_grads
        c = self.cfg
        self.opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=c.lr, weight_decay=c.weight_decay, adam_beta1=c.betas[0], adam_beta2=c.betas[1],
            adam_eps=1e-8, clip_grad=c.grad_clip, bf16=self.config.bf16, fp16=self.config.fp16,
            params_dtype=self.config.params_dtype, use_distributed_optimizer=m.use_distributed_optimizer),
            [self.model])
        self.dp_rank, self.dp, self.dp_group = (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                                                ps.get_data_parallel_group())
        # the rank whose step metrics the leader hands back: the loss is on the last stage
        self.reports = self.last and ps.get_tensor_model_parallel_rank() == 0 and self.dp_rank == 0

    def _load_gpt(self):
        from megatron.core import parallel_state as ps

        gpt = build_gpt(self.arch, self.config, self.first, self.last).to(self.device)
        names = [n for n in gpt.state_dict() if not n.endswith("_extra_state")]
        state = to_megatron(names, hf_reader(self.model_path), self.arch, ps.get_tensor_model_parallel_rank(),
                            self.mcfg.tensor_parallel, layer_index(gpt))
        missing, unexpected = gpt.load_state_dict(state, strict=False)
        missing = [n for n in missing if not n.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"HF -> megatron load: missing {missing[:5]}, unexpected {unexpected[:5]}")
        return gpt

    # ---- the leader's interface (same as TorchTrainer's) ----------------------------
    def _everywhere(self, method: str, *args, peer_args: tuple | None = None):
        """Run `method` on every rank (peers with `peer_args`, default `args`); this rank's result first.
        When this rank fails, the peers' errors (by the collective timeout at the latest) are named too."""
        refs = [getattr(p, method).remote(*(args if peer_args is None else peer_args)) for p in self.peers]
        try:
            mine = getattr(self, method)(*args)
        except Exception as e:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=self.mcfg.timeout_s + 30)
            peers = [_error(r) for r in done]
            raise RuntimeError(f"rank 0 failed in {method}: {e!r}; peer ranks: {peers or 'no answer'}") from e
        return [mine, *ray.get(refs)]

    def train_step(self, table: pa.Table) -> dict:
        ref = (ray.put(table),) if self.peers else None       # one copy in the object store for all peers
        return next(r for r in self._everywhere("rank_train_step", table, peer_args=ref) if r is not None)

    def published(self) -> dict:
        return self._everywhere("rank_hf_state")[0]

    def info(self) -> dict:
        return super().info() | {"ranks": 1 + len(self.peers)}

    def save(self, path: str, tokenizer_dir: str = "", with_state: bool = True, tokenizer_staged: str = "") -> str:
        """HF format (config, safetensors with shared tensors once, tokenizer); with_state adds what
        resuming (with the same layout) needs: every rank's optimizer shard and RNGs, and the version."""
        from huggingface_hub import save_torch_state_dict

        os.makedirs(path, exist_ok=True)
        save_torch_state_dict({n: t.detach().cpu().contiguous() for n, t in self.published().items()
                               if not (self.arch.tied and n == "lm_head.weight")}, path)
        self.hf.save_pretrained(path)
        if tokenizer_dir:      # copied from tokenizer_staged where this host has it (stages/tokenizer.py)
            save_tokenizer(path, tokenizer_dir, tokenizer_staged)
        if with_state:
            self._everywhere("rank_save_state", path)
            torch.save({"backend": "megatron", "version": self.version, "layout": self._layout()},
                       os.path.join(path, "trainer_state.pt"))
        return path

    def load_state(self, path: str) -> int:
        """Resume: the weights were loaded from `path` at start; restore optimizer, RNGs, version."""
        saved = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
        if saved.get("backend") != "megatron" or saved["layout"] != self._layout():
            raise ValueError(f"{path} holds {saved.get('backend', 'torch')} trainer state for layout "
                             f"{saved.get('layout')}; this megatron trainer's layout is {self._layout()}")
        return self._everywhere("rank_load_state", path)[0]

    def _layout(self) -> dict:
        m = self.mcfg
        return {"tensor_parallel": m.tensor_parallel, "pipeline_parallel": m.pipeline_parallel,
                "data_parallel": m.data_parallel, "distributed_optimizer": m.use_distributed_optimizer}

    def _state_file(self, path: str) -> str:
        d = os.path.join(path, "megatron_state")
        os.makedirs(d, exist_ok=True)
        return os.path.join(d, f"rank{torch.distributed.get_rank():05d}.pt")

    def _inner_optimizers(self) -> list:
        return list(getattr(self.opt, "chained_optimizers", [self.opt]))

    def rank_save_state(self, path: str) -> None:
        """This rank's optimizer shard as its torch optimizer holds it: state (step, moments) and the fp32
        main parameters it updates (its slice, with the distributed optimizer). No gather, no resharding."""
        with self._ctx():
            shards = [{"inner": o.optimizer.state_dict(),
                       "main": [p.detach().clone() for g in o.optimizer.param_groups for p in g["params"]],
                       "scaler": o.grad_scaler.state_dict() if getattr(o, "grad_scaler", None) else None}
                      for o in self._inner_optimizers()]
            torch.save({"optimizer": shards} | self.clock_state(), self._state_file(path))

    def rank_load_state(self, path: str) -> int:
        with self._ctx(), torch.no_grad():      # fp32 main params may be views of the (grad-requiring) weights
            state = torch.load(self._state_file(path), weights_only=False)
            for o, shard in zip(self._inner_optimizers(), state["optimizer"], strict=True):
                o.optimizer.load_state_dict(shard["inner"])
                mains = [p for g in o.optimizer.param_groups for p in g["params"]]
                for p, saved in zip(mains, shard["main"], strict=True):
                    p.copy_(saved)
                if shard["scaler"] is not None:
                    o.grad_scaler.load_state_dict(shard["scaler"])
        return self.restore_clock(state)

    def shutdown(self) -> None:
        """Leader only: stop the peer ranks (their actors hold no state worth keeping)."""
        for p in self.peers:
            ray.kill(p)
        self.peers = []

    # ---- what every rank runs --------------------------------------------------------
    def rank_hf_state(self):
        with self._ctx():
            return parallel.gather_hf_state(self.module, self.arch, layer_index(self.module))

    def rank_train_step(self, table: pa.Table) -> dict | None:
        with self._ctx():
            return super().train_step(table)

    def _prepare(self, table: pa.Table, b: Batch, adv: torch.Tensor, mask: torch.Tensor):
        """Old / reference log-probs and the IS correction; the mini-batches run megatron's schedule."""
        recomputed = None if self.algo.decoupled else self.logprobs(self.module, b)
        ref_lp = self.logprobs(self.ref, b) if self.ref is not None else None
        metrics, fields = {}, self._inputs(b)
        if self.last:     # only the last stage sees logits, so only it computes the loss
            old, weights, mask, metrics = corrected(self.algo, b, recomputed, mask, self.version)
            fields |= {"old": old, "adv": adv, "mask": mask, "weights": weights, "ref": ref_lp}
        return metrics, adv, mask, {}, partial(self._optimizer_step, fields=fields)

    def _inputs(self, b: Batch) -> dict:
        L = b.input_ids.shape[1]
        return {"ids": b.input_ids, "pos": torch.arange(L).expand_as(b.input_ids), "resp_pos": b.resp_pos,
                "resp_ids": b.resp_ids, "mask": b.mask}

    # ---- forward / backward through megatron's schedules ------------------------------
    def _micro_batches(self, rows: list[int], fields: dict) -> list[dict]:
        """This DP rank's share of `rows` in micro-batches. With PP (fixed-shape activations) each is padded
        to the same size with copies of a row whose mask is zero (adding nothing to loss or counts)."""
        mine = rows[self.dp_rank::self.dp]
        size = self.mcfg.micro_batch_size or max(len(mine), 1)
        chunks = [mine[i:i + size] for i in range(0, len(mine), size)] or [[]]
        pad = self.mcfg.pipeline_parallel > 1
        out = []
        for c in chunks:
            fill = (size if pad else max(len(c), 1)) - len(c)
            idx = torch.tensor(c + [c[0] if c else rows[0]] * fill, dtype=torch.long)
            out.append({k: v[idx].to(self.device) for k, v in fields.items() if v is not None} | {"real": len(c)})
            out[-1]["mask"][len(c):] = 0        # the copies' (indexing made the item's own tensors)
        return out

    def _run(self, model, items: list[dict], loss_func, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        L = items[0]["ids"].shape[1]
        causal = torch.triu(torch.ones(L, L, dtype=torch.bool, device=self.device), 1)[None, None]

        def forward_step(data_iterator, model):
            item = next(data_iterator)
            out = model(item["ids"], item["pos"], attention_mask=causal)
            return out, partial(loss_func, item)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(items), model=[model], num_microbatches=len(items),
            seq_length=L, micro_batch_size=items[0]["ids"].shape[0], forward_only=forward_only)

    def _token_lp(self, out: torch.Tensor, item: dict, with_entropy: bool = False, model=None):
        """Log-probs [m, T] (and entropy) of the response tokens from the model's output: hidden states when
        its head was deferred (run on response positions, trainer.logprob_chunk at a time), else logits."""
        pos = item["resp_pos"]
        picked = out.gather(1, pos[..., None].expand(-1, -1, out.shape[-1]))   # [m, T, H] or [m, T, V/tp]
        head = self._heads.get(id(model if model is not None else self.module))
        if head is None:
            return token_logprobs(picked, item["resp_ids"], self.arch.vocab, self.temperature, with_entropy)
        m, T = pos.shape
        lp, ent = chunked_token_logprobs(picked.reshape(m * T, -1), head, item["resp_ids"].reshape(-1),
                                         self.arch.vocab, self.temperature, self.cfg.logprob_chunk, with_entropy)
        return lp.view(m, T), None if ent is None else ent.view(m, T)

    def logprobs(self, model, b: Batch) -> torch.Tensor | None:
        """No-grad log-probs [B, T] of every row on the last stage (None elsewhere), all-gathered over DP."""
        rows = list(range(b.input_ids.shape[0]))
        items = self._micro_batches(rows, self._inputs(b))

        def keep_lp(item, out):
            lp, _ = self._token_lp(out, item, model=model)
            return lp.sum() * 0, torch.tensor(0, dtype=torch.int, device=self.device), {"lp": lp.detach()}

        with torch.no_grad():
            out = self._run(model, items, keep_lp, forward_only=True)
        if not self.last:
            return None
        mine = torch.cat([o["lp"][: it["real"]] for o, it in zip(out, items)]).cpu()
        return self._gather_rows(mine, len(rows), b.resp_ids.shape[1])

    def _gather_rows(self, mine: torch.Tensor, n: int, T: int) -> torch.Tensor:
        """Rows r::dp live on DP rank r; put them back in row order on every DP rank."""
        if self.dp == 1:
            return mine
        buf = torch.zeros(-(-n // self.dp), T, dtype=mine.dtype, device=self.device)     # NCCL: device tensors
        buf[: len(mine)] = mine
        parts = [torch.empty_like(buf) for _ in range(self.dp)]
        torch.distributed.all_gather(parts, buf, group=self.dp_group)
        # rank r's j-th row is row j * dp + r: interleave the ranks' rows, then drop the padding
        return torch.stack(parts, 1).cpu().reshape(-1, T)[:n]

    def _optimizer_step(self, i: int, rows: np.ndarray, fields: dict) -> tuple:
        """One mini-batch: forward-backward, then the optimizer step unless a loss or gradient is NaN / inf
        on any rank (every rank agrees: the decision is all-reduced)."""
        items = self._micro_batches(rows.tolist(), fields)
        self.model.zero_grad_buffer()
        self.opt.zero_grad()
        part = self._reduce_reports(self._run(self.model, items, self._loss, forward_only=False))
        # fp16: megatron's own overflow check may still skip the step
        ok, gnorm, _ = (False, None, None) if self._nonfinite(part) else self.opt.step()
        failed = "" if ok else f"a non-finite loss or gradient (loss {part.get('loss', 'on the last stage')})"
        return part.get("loss"), part, float(gnorm if gnorm is not None else 0.0), failed

    def _nonfinite(self, part: dict) -> bool:
        """Any NaN / inf in a rank's gradient buffers or loss, checked before megatron's step (which with
        fp32 or bf16 would apply them)."""
        bad = torch.zeros(1, dtype=torch.float32, device=self.device)
        for buf in getattr(self.model, "buffers", []) + getattr(self.model, "expert_parallel_buffers", []):
            bad += (~torch.isfinite(buf.grad_data)).any()
        bad += not np.isfinite(part.get("loss", 0.0))
        torch.distributed.all_reduce(bad)      # all ranks: every one must skip the same steps
        return bad.item() > 0

    def _loss(self, item: dict, logits: torch.Tensor):
        algo = self.algo
        lp, ent = self._token_lp(logits, item, with_entropy=algo.entropy_coef != 0)
        mask = item["mask"]
        loss, m = policy_loss(algo, lp, item["old"], item["adv"], mask, ref_logprobs=item.get("ref"),
                              entropy=ent, is_weights=item["weights"])
        tokens = mask.sum()
        n = tokens if algo.loss_agg == "token_mean" else (mask.sum(1) > 0).sum()
        report = {"n": float(n), "tokens": float(tokens)} | m
        return loss * n, n.to(torch.int).reshape(()), report

    def _reduce_reports(self, reports: list[dict]) -> dict:
        """Micro-batch metrics -> the mini-batch's, weighted as its loss is (over DP too)."""
        if not self.last:
            return {}
        keys = [k for k in reports[0] if k not in ("n", "tokens")]
        sums = torch.zeros(len(keys) + 2, dtype=torch.float64)    # weighted sums, then n and tokens
        for r in reports:
            sums += torch.tensor([r[k] * r[_weight(k)] for k in keys] + [r["n"], r["tokens"]], dtype=torch.float64)
        if self.dp > 1:
            sums = sums.to(self.device)
            torch.distributed.all_reduce(sums, group=self.dp_group)
        totals = {"n": sums[-2].item(), "tokens": sums[-1].item()}
        return {k: sums[i].item() / max(totals[_weight(k)], 1.0) for i, k in enumerate(keys)}


def _error(ref) -> str:
    try:
        ray.get(ref)
        return "ok"
    except Exception as e:      # noqa: BLE001 - reported, not handled
        return repr(e)[:500]


def _weight(metric: str) -> str:
    """What a policy_loss metric is averaged over: tokens, or the loss's own normaliser."""
    return "tokens" if metric in ("clipfrac", "approx_kl") else "n"
