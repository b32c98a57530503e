"""One torch-trainer update on long-prompt rows: its seconds and the process's peak RSS.

    python benchmarks/trainer_long_prompt.py [--model builtin:qwen-vocab-tiny] [--prompt 19000]
        [--response 32] [--rows 2] [--short-rows 0] [key=value ...]   (trainer.* overrides, e.g.
        trainer.max_tokens_per_microbatch=20000 trainer.logprob_chunk=256)

Rows: `--rows` samples of one `--prompt`-token prompt (one group), plus `--short-rows` rows of a
short prompt (another group), each with `--response` random response tokens and mixed rewards.
Prints one JSON line: the settings, update seconds, peak RSS of this process (MB) and the RSS
before the update (model, optimizer, Python). Run it once per setting: ru_maxrss never falls.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)


def rows(args, vocab: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(0)
    long_p = torch.randint(10, vocab - 10, (args.prompt,), generator=g).tolist()
    short_p = torch.randint(10, vocab - 10, (16,), generator=g).tolist()
    out = []
    for i, (p, grp) in enumerate([(long_p, 0)] * args.rows + [(short_p, 1)] * args.short_rows):
        r = torch.randint(10, vocab - 10, (args.response,), generator=g).tolist()
        out.append({"prompt_ids": p, "response_ids": r, "response_logprobs": [-1.0] * len(r),
                    "loss_mask": [1] * len(r), "token_versions": [0] * len(r), "reward": float(i % 2),
                    "group_id": grp, "status": "completed"})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:qwen-vocab-tiny")
    p.add_argument("--prompt", type=int, default=19000)
    p.add_argument("--response", type=int, default=32)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--short-rows", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    import dataclasses

    import pyarrow as pa

    from pipeline.config import load_config
    from stages.model import load_model, resolve_model_path
    from stages.update.trainer import TorchTrainer

    cfg = load_config(None, [f"model.path={a.model}", *a.overrides])
    path = resolve_model_path(cfg.model, log=lambda *_: None)
    vocab = load_model(path).config.vocab_size
    tr = TorchTrainer(path, dataclasses.replace(cfg.trainer, num_threads=a.threads), cfg.algorithm)
    table = pa.Table.from_pylist(rows(a, vocab))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    t0 = time.time()
    tr.train_step(table)
    print(json.dumps({"prompt": a.prompt, "rows": a.rows, "short_rows": a.short_rows, "response": a.response,
                      "vocab": vocab, "overrides": a.overrides, "update_s": round(time.time() - t0, 2),
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                      "rss_before_update_mb": before}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
