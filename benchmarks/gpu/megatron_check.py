"""Check the Megatron-core trainer against HF / the torch trainer, and print the figures.

    python benchmarks/gpu/megatron_check.py                 # on a CUDA machine (NCCL, CUDA kernels)
    python benchmarks/gpu/megatron_check.py --device cpu    # the same checks on CPU (gloo): the CPU tier's numbers

  1. the built-in tiny Qwen2 in float32: logits vs HF, one GRPO step vs the torch trainer
     (loss, grad norm, weights after the step);
  2. two ranks against one: TP=2, DP=2, PP=2 (on CUDA: those that fit the GPUs present);
  3. CUDA only: throughput of a Qwen2.5-0.5B-shaped model (random weights, bf16 with
     megatron's fp32 master weights) on one GPU, and the time to gather its HF state.

Without CUDA (for the default --device cuda) or without megatron-core it says so and
exits with status 1.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[0] = ROOT     # the repository first; not this folder


def step_table(vocab: int, rows: int, prompt_len: int, resp_len: int, seed: int = 0) -> pa.Table:
    g = np.random.default_rng(seed)
    out = []
    for i in range(rows):       # uneven lengths: the token-mean loss is then not zero at ratio 1
        resp = g.integers(3, vocab, g.integers(max(1, resp_len // 2), resp_len + 1)).tolist()
        out.append(dict(prompt_ids=g.integers(3, vocab, prompt_len).tolist(), response_ids=resp,
                        response_logprobs=(-g.random(len(resp)) * 2).tolist(), loss_mask=[1] * len(resp),
                        token_versions=[0] * len(resp), reward=float(g.integers(0, 2)), group_id=i // 4,
                        status="completed"))
    return pa.Table.from_pylist(out)


def logits_in(leader, ids: torch.Tensor) -> torch.Tensor:
    """The leader's logits (one rank holds the whole vocabulary), computed in its actor."""
    import ray

    def forward(trainer, ids):
        with trainer._ctx(), torch.no_grad():
            ids = ids.to(trainer.device)
            L = ids.shape[1]
            causal = torch.triu(torch.ones(L, L, dtype=torch.bool, device=ids.device), 1)[None, None]
            return trainer.module(ids, torch.arange(L, device=ids.device).expand_as(ids),
                                  attention_mask=causal).float().cpu()
    return ray.get(leader.__ray_call__.remote(forward, ids))


def max_diff(a: dict, b: dict) -> float:
    return max((a[n].float().cpu() - b[n].float().cpu()).abs().max().item() for n in b)


def qwen_05b_shape(path: str) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)
    with torch.device("cuda"):
        Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per throughput step (CUDA)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("megatron_check: no CUDA device here. Nothing was checked (--device cpu runs the CPU figures).")
        return 1
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        print("megatron_check: megatron-core is not installed (pip install 'loongsage[megatron]').")
        return 1
    import ray

    from stages.model import ModelConfig, load_model, resolve_model_path
    from stages.update.losses import AlgorithmConfig
    from stages.update.megatron.config import MegatronConfig
    from stages.update.megatron.launch import launch
    from stages.update.trainer import TorchTrainer, TrainerConfig

    gpus = torch.cuda.device_count() if cuda else 0
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             **({} if cuda else {"num_cpus": 2}), runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    rank = {"num_gpus": 1, "num_cpus": 1} if cuda else {"num_cpus": 0.25}
    failures = []

    def check(name: str, ok: bool, detail: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if not ok:
            failures.append(name)

    tmp = tempfile.mkdtemp(prefix="megatron-check-")
    path = resolve_model_path(ModelConfig(warmup_steps=50, cache_dir=tmp), log=lambda *_: None)
    cfg, algo = TrainerConfig(lr=1e-3, num_threads=1), AlgorithmConfig()
    t = time.time()
    leader = launch(path, cfg, algo, MegatronConfig(), rank_options=[rank])
    print(f"one rank up in {time.time() - t:.1f}s")
    hf = load_model(path).to(args.device)
    ids = torch.randint(3, hf.config.vocab_size, (4, 24))
    with torch.no_grad():
        want = hf(input_ids=ids.to(args.device)).logits.float().cpu()
    diff = (logits_in(leader, ids) - want).abs().max().item()
    check("fp32 logits vs HF", diff < 1e-5 if not cuda else diff < 1e-4, f"max |diff| {diff:.2e}")
    table = step_table(hf.config.vocab_size, 16, 8, 6)
    del hf
    ref = TorchTrainer(path, cfg, algo)
    t = time.time()
    want_m = ref.train_step(table)
    t_torch = time.time() - t
    t = time.time()
    got_m = ray.get(leader.train_step.remote(table))
    print(f"tiny step: megatron {time.time() - t:.3f}s (torch trainer {t_torch:.3f}s)")
    check("GRPO loss vs torch", abs(got_m["train/loss"] - want_m["train/loss"]) < 1e-6,
          f"{got_m['train/loss']:.8f} vs {want_m['train/loss']:.8f}")
    check("grad norm vs torch", abs(got_m["train/grad_norm"] / want_m["train/grad_norm"] - 1) < 1e-5,
          f"{got_m['train/grad_norm']:.7f} vs {want_m['train/grad_norm']:.7f}")
    after = ray.get(leader.state_dict.remote())
    wdiff, moved = max_diff(after, ref.state_dict()), max_diff(after, load_model(path).state_dict())
    check("weights after one step vs torch", wdiff < 0.05 * moved, f"max |diff| {wdiff:.2e}, moved {moved:.2e}")
    ray.kill(leader)

    layouts = {"TP=2": dict(tensor_parallel=2), "DP=2": dict(data_parallel=2, micro_batch_size=4),
               "PP=2": dict(pipeline_parallel=2, micro_batch_size=4)}
    if cuda and gpus < 2:
        print(f"SKIP two-rank layouts: {gpus} GPU here, they need 2")
        layouts = {}
    single = launch(path, cfg, algo, MegatronConfig(), rank_options=[rank]) if layouts else None
    base = ray.get(single.train_step.remote(table)) if single else None
    base_w = ray.get(single.state_dict.remote()) if single else None
    for name, layout in layouts.items():
        pair = launch(path, cfg, algo, MegatronConfig(**layout), rank_options=[rank, rank])
        t = time.time()
        m = ray.get(pair.train_step.remote(table))
        dt = time.time() - t
        d_loss = abs(m["train/loss"] - base["train/loss"])
        d_norm = abs(m["train/grad_norm"] / base["train/grad_norm"] - 1)
        d_w = max_diff(ray.get(pair.state_dict.remote()), base_w)
        check(f"{name} vs one rank", d_loss < 1e-6 and d_norm < 1e-5 and d_w < 5e-5,
              f"|d loss| {d_loss:.1e}, rel d grad norm {d_norm:.1e}, max |d weight| {d_w:.1e}, step {dt:.3f}s")
        ray.get(pair.shutdown.remote())
        ray.kill(pair)

    if cuda:
        big = qwen_05b_shape(os.path.join(tmp, "qwen05b-shape"))
        leader = launch(big, TrainerConfig(lr=1e-6), algo, MegatronConfig(micro_batch_size=8), dtype="bfloat16",
                        rank_options=[rank])
        rows, plen, rlen = args.tokens // 512, 256, 256
        table = step_table(151936, rows, plen, rlen, seed=1)
        ray.get(leader.train_step.remote(table))          # warm-up: kernels, allocator
        t = time.time()
        m = ray.get(leader.train_step.remote(table))
        dt = time.time() - t
        print(f"Qwen2.5-0.5B shape, bf16, 1 GPU: {rows * (plen + rlen) / dt:,.0f} tokens/s per train_step "
              f"({dt:.2f}s for {rows} x {plen + rlen}: recompute + forward/backward + update), "
              f"loss {m['train/loss']:.4f}")
        t = time.time()
        state = ray.get(leader.state_dict.remote())
        gb = sum(v.numel() * v.element_size() for v in state.values()) / 1e9
        print(f"HF state gather + copy to the driver: {time.time() - t:.2f}s for {gb:.2f} GB (HF names, tied twice)")
    ray.shutdown()
    print("megatron_check:", "OK" if not failures else f"FAILED {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
