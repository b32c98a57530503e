"""Specialist teachers for the built-in tasks, trained here, offline, on one shared vocabulary.

    loongsage make-teacher --task addition --out runs/opd/teacher-addition
    loongsage make-teacher --task addition,multiplication --steps 200 --out runs/opd/student
    loongsage make-teacher --task addition,multiplication --prompts runs/opd/data

A teacher scores the student's token ids, so teacher and student must share a vocabulary.
The built-in quickstart policy uses its own task's characters only (addition has no '*'),
so everything made here uses SHARED_VOCAB: every built-in task's characters, in a fixed
order that keeps addition's ids unchanged. A comma list of tasks trains one model on
their mixture: with few steps that is the partly-warmed student of the OPD recipe.
`--prompts DIR` writes the mixed prompt files (train/test JSONL with a data_source column)
that route each row to its teacher.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from stages.tasks import TASKS, get_task, models

# Every built-in task's characters, in registration order (addition first: its ids stay as the quickstart's).
SHARED_VOCAB = "".join(dict.fromkeys("".join(t.vocab for t in TASKS.values())))


def shared_tokenizer():
    return models.build_char_tokenizer(SHARED_VOCAB)


def tiny_qwen2(tok, hidden_size: int = 128, num_layers: int = 4, seed: int = 0):
    """The built-in quickstart policy's architecture (stages/tasks/models.py), on `tok`'s vocabulary."""
    torch.manual_seed(seed)
    return models.tiny_qwen2(tok, hidden_size, num_layers, heads=(4, 2))


def task_rows(tasks: list[str], split: str, size: int, digits: int = 2, seed: int = 0) -> list[dict]:
    """`size` rows of each task (each with its data_source), interleaved so every prefix is mixed."""
    per = [get_task(t, digits=digits).make_rows(split, size, seed=seed) for t in tasks]
    return [r for group in zip(*per) for r in group]


@torch.inference_mode()
def accuracy(model, tok, rows: list[dict], temperature: float = 0.0, seed: int = 0) -> float:
    """Fraction of rows answered exactly (answer then <eos>). Prompts of one length are decoded
    together, so no padding is involved; temperature 0 = greedy, 1 = what eval.temperature samples."""
    torch.manual_seed(seed)
    by_len: dict[int, list[dict]] = {}
    for r in rows:
        by_len.setdefault(len(r["prompt"]), []).append(r)
    right = 0
    for group in by_len.values():
        ids = torch.tensor([tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in group])
        width = max(len(r["answer"]) for r in group) + 1
        sample = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
            dict(do_sample=False)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=width,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **sample)
        for r, seq in zip(group, out[:, ids.shape[1]:].tolist()):
            right += tok.eos_token_id in seq and tok.decode(seq[: seq.index(tok.eos_token_id)]) == r["answer"]
    return right / max(len(rows), 1)


def make_teacher(task: str, out_dir: str | Path, steps: int = 1500, digits: int = 2, hidden_size: int = 128,
                 num_layers: int = 4, rows: int = 2000, lr: float = 1e-3, seed: int = 0, eval_n: int = 200,
                 log=print) -> dict:
    """SFT a tiny Qwen2 on `task` (one built-in task, or a comma list = their mixture) with the
    shared vocabulary; save it as an HF directory with its tokenizer and a teacher_card.json
    holding the final loss and greedy / sampled (T=1) test accuracy per task. Returns the card."""
    from stages.tasks.sft import sft

    names = [t.strip() for t in task.split(",") if t.strip()]
    for t in names:
        get_task(t)   # unknown task -> ValueError listing the built-in ones
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    out = Path(out_dir)
    tok = shared_tokenizer()
    model = tiny_qwen2(tok, hidden_size, num_layers, seed)
    train = task_rows(names, "train", rows, digits, seed)
    stats = sft(model, tok, train, steps=steps, lr=lr, seed=seed + 1, log=log) if steps else \
        {"loss": float("nan"), "seconds": 0.0}
    model.eval()
    card = {"task": ",".join(names), "steps": steps, "digits": digits, "hidden_size": hidden_size,
            "num_layers": num_layers, "vocab": SHARED_VOCAB, "sft_loss": stats["loss"], "sft_seconds": stats["seconds"]}
    for t in names:
        test = task_rows([t], "test", eval_n, digits)
        card[f"accuracy/{t}/greedy"] = accuracy(model, tok, test, 0.0)
        card[f"accuracy/{t}/sampled"] = accuracy(model, tok, test, 1.0, seed=seed)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "teacher_card.json").write_text(json.dumps(card, indent=1))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)   # a reader never sees a half-written directory
    log(f"{card['task']}: saved to {out}; " + ", ".join(f"{k} {v:.3f}" for k, v in card.items()
                                                         if k.startswith("accuracy/")))
    return card


def write_prompts(tasks: list[str], out_dir: str | Path, digits: int = 2, train_size: int = 2000,
                  test_size: int = 100, seed: int = 0) -> tuple[Path, Path]:
    """DIR/train.jsonl and DIR/test.jsonl: prompt, answer, data_source; tasks interleaved."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "test.jsonl"
    for path, split, size in zip(paths, ("train", "test"), (train_size, test_size)):
        path.write_text("".join(json.dumps(r) + "\n" for r in task_rows(tasks, split, size, digits, seed)))
    return paths


# ---- `loongsage make-teacher` -------------------------------------------------------------

def add_subcommand(sub) -> None:
    p = sub.add_parser("make-teacher", help="SFT a tiny specialist teacher on a built-in task (shared vocabulary)")
    p.add_argument("--task", required=True, help=f"built-in task ({', '.join(TASKS)}) or a comma list (a mixture)")
    p.add_argument("--out", help="output HF directory")
    p.add_argument("--steps", type=int, default=1500, help="SFT steps (batch 64)")
    p.add_argument("--digits", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", metavar="DIR", help="instead of a model: write DIR/train.jsonl and DIR/test.jsonl, "
                                                     "the tasks' prompts mixed, each row with its data_source")
    p.add_argument("--train-size", type=int, default=2000, help="with --prompts: train rows")
    p.add_argument("--test-size", type=int, default=100, help="with --prompts: test rows per task")
    p.set_defaults(fn=cmd_make_teacher)


def cmd_make_teacher(args) -> int:
    tasks = [t.strip() for t in args.task.split(",") if t.strip()]
    try:
        if args.prompts:
            train, test = write_prompts(tasks, args.prompts, digits=args.digits, train_size=args.train_size,
                                        test_size=args.test_size, seed=args.seed)
            print(f"wrote {train} and {test}")
            return 0
        if not args.out:
            print("error: make-teacher needs --out DIR (or --prompts DIR)", file=sys.stderr)
            return 2
        make_teacher(args.task, args.out, steps=args.steps, digits=args.digits, hidden_size=args.hidden_size,
                     num_layers=args.layers, seed=args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
