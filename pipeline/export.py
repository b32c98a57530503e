"""`loongsage export [--merge] RUN/checkpoints/step_N OUT`: a checkpoint as a plain HF model directory.

A LoRA checkpoint is a peft adapter naming its HF base: --merge merges it into the base's weights
(W + (alpha / r) B A), so OUT loads with `AutoModelForCausalLM.from_pretrained(OUT)` and no peft.
The tokenizer comes from the checkpoint or the base; training state is not exported.
"""
from __future__ import annotations

import sys
from pathlib import Path


class ExportError(ValueError):
    pass


def export(checkpoint: str, out: str, merge: bool = False, base: str = "", dtype: str = "float32") -> Path:
    """Write `checkpoint` to `out` as an HF model directory; returns `out`."""
    from stages.lora import base_of, is_adapter_dir
    from stages.model import load_model, load_tokenizer

    ckpt, dest = Path(checkpoint), Path(out)
    if dest.exists() and any(dest.iterdir()):
        raise ExportError(f"{dest} exists and is not empty")
    if is_adapter_dir(ckpt):
        if not merge:
            raise ExportError(f"{ckpt} holds a LoRA adapter: pass --merge to write base + adapter as one HF model "
                              "(or load the directory itself with peft)")
        base = base or base_of(ckpt)        # the HF base the adapter names, merged with it into a plain HF model
        if not base or not (Path(base) / "config.json").is_file():
            raise ExportError(f"{ckpt}: its base model {base!r} is not an HF directory here; "
                              "pass --base DIR (the model it was trained on)")
        from peft import PeftModel

        model = PeftModel.from_pretrained(load_model(base, dtype), str(ckpt)).merge_and_unload()
    elif (ckpt / "config.json").is_file():
        model = load_model(str(ckpt), dtype)        # full weights: nothing to merge
    else:
        raise ExportError(f"{ckpt} is not a checkpoint (no adapter_config.json or config.json)")
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(dest))
    try:
        tok = load_tokenizer(str(ckpt))
    except ValueError:
        tok = load_tokenizer(base or base_of(ckpt))
    tok.save_pretrained(str(dest))
    return dest


def cmd_export(args) -> int:
    try:
        dest = export(args.checkpoint, args.out, merge=args.merge, base=args.base, dtype=args.dtype)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {dest}" + (" (base + adapter merged)" if args.merge else ""))
    return 0


def add_subcommand(sub) -> None:
    p = sub.add_parser("export")
    p.add_argument("checkpoint", help="a checkpoint directory, e.g. RUN/checkpoints/step_000160")
    p.add_argument("out", help="the HF model directory to write")
    p.add_argument("--merge", action="store_true", help="merge a LoRA adapter into its base model")
    p.add_argument("--base", default="", help="the base model directory (default: the one the adapter names)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.set_defaults(fn=cmd_export)
