"""The README stays true: every path it names exists, every config key it names exists, every extra it
names is in pyproject, and every `loongsage` command in its code blocks is accepted by the CLI's parser and,
for `run`, by the config loader (recipe + overrides), without running anything."""
from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest
import tomllib

from pipeline.config import Config, load_config

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PLACEHOLDER = re.compile(r"(/path/to/|\bDIR\b|\bRUN\b|\bOUT\b|\bCONFIG\b|\bN\b|mypkg|<|\.\.\.)")


def _code_spans() -> list[str]:
    return re.findall(r"`([^`\n]+)`", README)


def _links() -> list[str]:
    return [t for t in re.findall(r"\]\(([^)#]+)\)", README) if "://" not in t]


def _path_like(token: str) -> bool:
    """A file name, or a path under one of the repository's folders (not a metric such as `eval/accuracy`)."""
    if not re.fullmatch(r"[\w.\-/]+", token):
        return False
    return bool(re.search(r"\.(ya?ml|md|py|toml)$", token)) or (ROOT / token.split("/")[0]).is_dir()


def test_every_path_the_readme_names_exists():
    named = {t for t in _code_spans() if _path_like(t) and not PLACEHOLDER.search(t)} | set(_links())
    named |= {m for t in _code_spans() for m in re.findall(r"(?:configs|docs|benchmarks|examples)/[\w.\-/]+", t)}
    missing = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists() and not p.startswith("."))
    assert not missing, f"README names paths that do not exist: {missing}"
    assert "../" not in " ".join(named), "README names a path outside the repository"


def _keys(cls, prefix="") -> set[str]:
    out = set()
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        out.add(name)
        if dataclasses.is_dataclass(f.type) or (isinstance(f.type, type) and dataclasses.is_dataclass(f.type)):
            out |= _keys(f.type, name + ".")
    return out


def _all_keys() -> set[str]:
    cfg = Config()
    out = set()
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        out.add(f.name)
        out |= _keys(type(section), f.name + ".")
        for sub in dataclasses.fields(section):       # nested sections (trainer.lora, ...)
            v = getattr(section, sub.name)
            if dataclasses.is_dataclass(v):
                out |= _keys(type(v), f"{f.name}.{sub.name}.")
    return out


def test_every_config_key_the_readme_names_exists():
    sections = {f.name for f in dataclasses.fields(Config)}
    keys = _all_keys()
    named = set()
    for span in _code_spans() + re.findall(r"\b([a-z_]+\.[a-z_.]+)=", README):
        for token in re.findall(r"\b([a-z_]+(?:\.[a-z_]+)+)", span):
            if token.split(".")[0] in sections and not token.endswith((".yaml", ".py", ".md")):
                named.add(token)
    assert named, "no config key found in the README: the pattern is wrong"
    assert not sorted(named - keys), f"README names config keys that do not exist: {sorted(named - keys)}"


def test_every_extra_the_readme_names_is_in_pyproject():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = set(re.findall(r'\.\[([\w,]+)\]', README))
    named = {e for group in named for e in group.split(",")}
    table = re.search(r"\| extra \|.*?\n\n", README, re.S).group(0)
    named |= {e.strip() for row in re.findall(r"^\| ([`\w, ]+) \|", table, re.M)[1:]
              for e in row.replace("`", "").split(",")}
    assert {"cpu", "test", "profile", "agents", "qwen", "lora"} <= named
    assert not sorted(named - extras), f"README names extras pyproject lacks: {sorted(named - extras)}"


def _commands() -> list[list[str]]:
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0]
            for part in line.split("&&"):
                words = shlex.split(part)
                if words and words[0] == "loongsage":
                    out.append(words[1:])
    return out


@pytest.mark.parametrize("argv", _commands(), ids=lambda a: " ".join(a)[:60])
def test_readme_commands_parse(argv, tmp_path):
    from pipeline.cli import parse_argv

    args = parse_argv(argv)
    if args.cmd == "run":
        overrides = [o.replace("/path/to/hf_model_dir", str(tmp_path))
                     .replace("/path/to/train.parquet", str(tmp_path / "t.parquet"))
                     .replace("/path/to/test.parquet", str(tmp_path / "t.parquet")) for o in args.overrides]
        load_config(ROOT / args.config, overrides)       # the recipe and every override are valid
