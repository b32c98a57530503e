"""LoRA adapters (`trainer.lora`): what the trainer, the engines and export share, on peft.

The trainer wraps its HF policy in peft's LoRA layers and trains only the adapters (output =
W x + (alpha / r) B A x). A version is the adapter alone under peft's saved-adapter names, so what
travels, and what a checkpoint holds, is a valid peft adapter. Engines apply a version as
LoraConfig.serve says: merged into their weights (MergedAdapter) or in peft's layers (PeftAdapter).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from stages.lora_config import LoraConfig

PREFIX = "base_model.model."         # peft's saved-adapter keys start with this, then the module path
ADAPTER_DTYPE = torch.float32        # peft keeps adapters in float32 even on a bf16 / fp16 base


def peft_config(cfg: LoraConfig, base_path: str = ""):
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                          target_modules=cfg.targets_spec, bias="none", task_type="CAUSAL_LM",
                          modules_to_save=list(cfg.modules_to_save) or None,
                          base_model_name_or_path=base_path or None)


def find_targets(model, cfg: LoraConfig) -> list[str]:
    """Paths of the linear modules `cfg` targets in a plain HF model, matched as peft matches
    them. Raises ValueError naming the key when they match nothing usable."""
    from peft.tuners.tuners_utils import check_target_module_exists

    pcfg = peft_config(cfg)
    modules = dict(model.named_modules())
    matched = [n for n in modules if n and check_target_module_exists(pcfg, n)]
    linear = [n for n in matched if isinstance(modules[n], torch.nn.Linear)]
    others = [n for n in matched if n not in linear]      # peft would refuse them (or we could not merge them)
    if others:
        raise ValueError(f"{cfg.targets_key}={cfg.targets_spec!r} matches modules that are not linear layers "
                         f"({', '.join(f'{n} ({type(modules[n]).__name__})' for n in others[:3])}); LoRA here "
                         f"adapts linear layers only; {_linear_names(modules)}")
    if not linear:
        raise ValueError(f"{cfg.targets_key}={cfg.targets_spec!r} matches no module of the model; "
                         f"{_linear_names(modules)}")
    out = model.get_output_embeddings()
    tied = [n for n in linear if modules[n] is out and _tied(model)]
    if tied:
        raise ValueError(f"{cfg.targets_key}={cfg.targets_spec!r} matches {tied[0]}, whose weight is the input "
                         "embedding's (tie_word_embeddings): merging an adapter into it would change the "
                         "embedding too; target the other linear layers")
    return linear


def find_saved(model, cfg: LoraConfig) -> list[str]:
    """Paths of the modules trained in full (trainer.lora.modules_to_save), matched as peft matches them
    (the path ends in the name). Refused: a name that matches nothing, or a module holding a tied weight
    (an engine writing it would change its twin too)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    out = []
    for name in cfg.modules_to_save:
        found = [n for n in modules if n and n.endswith(name)]
        if not found:
            example = next(n for n, m in modules.items() if n and not any(True for _ in m.children()))
            raise ValueError(f"trainer.lora.modules_to_save: {name!r} matches no module of the model "
                             f"(module paths look like {example})")
        out += [n for n in found if n not in out]
    tied = {id(model.get_input_embeddings().weight)} if _tied(model) else set()
    for n in out:
        if any(id(p) in tied for p in modules[n].parameters()):
            raise ValueError(f"trainer.lora.modules_to_save: {n} holds the embedding tied to the output layer "
                             "(tie_word_embeddings); training it in full is not supported here")
    return out


def _tied(model) -> bool:
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return bool(getattr(text, "tie_word_embeddings", False))


def _linear_names(modules: dict) -> str:
    names = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, torch.nn.Linear)))
    example = next((n for n, m in modules.items() if isinstance(m, torch.nn.Linear)), "")
    return f"its linear modules are named {', '.join(names[:12])} (e.g. {example})"


def meta_model(model_path: str):
    """The model's modules without its weights (the meta device: no memory, no load time)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))


def check_targets(cfg: LoraConfig, model_path: str) -> list[str]:
    """The start-time check of a recipe's targets and modules_to_save against its model: the targeted paths."""
    model = meta_model(model_path)
    find_saved(model, cfg)
    return find_targets(model, cfg)


def key(module: str, which: str) -> str:
    """The saved-adapter name of one adapter matrix (which: A or B) of a module."""
    return f"{PREFIX}{module}.lora_{which}.weight"


def saved_params(model, cfg: LoraConfig) -> dict[str, torch.nn.Parameter]:
    """The parameters of the modules trained in full, in a plain HF model, under their saved-adapter names."""
    return {f"{PREFIX}{path}.{n}": p for path in find_saved(model, cfg)
            for n, p in model.get_submodule(path).named_parameters()}


def adapter_specs(model, cfg: LoraConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Names, shapes and dtypes of what a version carries: the adapter (and the modules trained in full)."""
    out = {}
    for path in find_targets(model, cfg):
        lin = model.get_submodule(path)
        out[key(path, "A")] = ((cfg.rank, lin.in_features), ADAPTER_DTYPE)
        out[key(path, "B")] = ((lin.out_features, cfg.rank), ADAPTER_DTYPE)
    out |= {n: (tuple(p.shape), p.dtype) for n, p in saved_params(model, cfg).items()}
    return out


# ---- the trainer's side ---------------------------------------------------------------

def wrap(model, cfg: LoraConfig, base_path: str = ""):
    """The HF model in peft's LoRA layers (only the adapters train); targets checked first so a
    bad pattern fails with our message, not peft's."""
    from peft import get_peft_model

    find_targets(model, cfg)
    find_saved(model, cfg)
    peft_model = get_peft_model(model, peft_config(cfg, os.path.abspath(base_path) if base_path else ""))
    for n, p in adapter_params(peft_model).items():
        if ".lora_" in n and p.dtype != ADAPTER_DTYPE:     # peft upcasts adapters by default; keep what engines expect
            p.data = p.data.to(ADAPTER_DTYPE)
    return peft_model


def adapter_params(peft_model) -> dict[str, torch.nn.Parameter]:
    """The trained parameters under their saved-adapter names, as peft saves them: the adapter's name
    dropped (`...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight`), and a module trained in
    full under its own path (`...norm.modules_to_save.default.weight` -> `...norm.weight`)."""
    saved = ".modules_to_save.default."
    return {n.replace(saved if saved in n else ".default.", ".", 1): p for n, p in peft_model.named_parameters()
            if saved in n or ".lora_A." in n or ".lora_B." in n}


def base_of(adapter_dir: str | Path) -> str:
    """The HF base model a peft adapter directory names (adapter_config.json)."""
    cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    return cfg.get("base_model_name_or_path") or ""


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def write_adapter(named: dict[str, torch.Tensor], cfg: LoraConfig, base_path: str, out: str | Path) -> None:
    """A peft adapter directory from a published version (what SGLang's load_lora_adapter reads)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().to("cpu", ADAPTER_DTYPE).contiguous() for n, t in named.items()},
              str(out / "adapter_model.safetensors"))
    peft_config(cfg, base_path).save_pretrained(str(out))


# ---- the engine's side ----------------------------------------------------------------

class MergedAdapter:
    """serve=merge: the engine's weights hold W0 + (alpha / r) B A for the current version. A version
    lands in `buffers` (modules trained in full: straight in the model's parameters); `apply()` then
    rewrites every targeted weight from its kept base copy, so each version replaces the last exactly."""

    def __init__(self, model, cfg: LoraConfig):
        self.model, self.scaling = model, cfg.scaling
        self.buffers: dict[str, torch.Tensor] = {}
        self._layers = []
        for path in find_targets(model, cfg):
            w = model.get_submodule(path).weight
            a = torch.zeros(cfg.rank, w.shape[1], dtype=ADAPTER_DTYPE, device=w.device)
            b = torch.zeros(w.shape[0], cfg.rank, dtype=ADAPTER_DTYPE, device=w.device)
            self.buffers[key(path, "A")], self.buffers[key(path, "B")] = a, b
            self._layers.append((w, w.detach().clone(), a, b))
        self.buffers |= {n: p.data for n, p in saved_params(model, cfg).items()}

    def apply(self) -> None:
        with torch.no_grad():
            for w, base, a, b in self._layers:
                if w.dtype == ADAPTER_DTYPE:
                    torch.addmm(base, b, a, alpha=self.scaling, out=w.data)
                else:       # a bf16 / fp16 engine: merged in float32, rounded once
                    w.copy_(torch.addmm(base.to(ADAPTER_DTYPE), b, a, alpha=self.scaling))


class PeftAdapter:
    """serve=peft: the engine's model wrapped in peft's LoRA layers (eval mode: no dropout);
    a version lands straight in their adapter parameters and nothing is merged."""

    def __init__(self, model, cfg: LoraConfig):
        self.model = wrap(model, cfg).eval()
        self.buffers = {n: p.data for n, p in adapter_params(self.model).items()}

    def apply(self) -> None:
        pass


SERVERS = {"merge": MergedAdapter, "peft": PeftAdapter}
