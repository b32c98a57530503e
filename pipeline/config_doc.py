"""`loongsage config`: the config reference, generated from the schema (stages/keys.py fields of `Config`), and
`--check` of a recipe. docs/config.md is its `--markdown` output; tests/test_config_doc.py fails when it is stale.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import sys
import textwrap
import types
import typing

from pipeline.config import Config, ConfigError, check_names, dump_yaml, load_config
from stages.keys import check_of, default_of, doc_of

REGENERATE = "python -m pipeline.config_doc > docs/config.md"


Row = collections.namedtuple("Row", "key type default accepts doc")      # key dotted: sandbox.workers


def sections(cls=Config, prefix: str = "") -> list[tuple[str, str, list[Row]]]:
    """(name, doc, the keys directly in it) for every section and nested section, in declaration order."""
    hints, out = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            name = prefix + f.name
            out += [(name, doc_of(f), _keys(hints[f.name], name + ".")), *sections(hints[f.name], name + ".")]
    return out


def _keys(cls, prefix: str) -> list[Row]:
    hints, out = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        typ, check = hints[f.name], check_of(f)
        if dataclasses.is_dataclass(typ):
            continue
        optional = typing.get_origin(typ) in (typing.Union, types.UnionType)
        finite = "finite" if typ is float or (optional and float in typing.get_args(typ)) else ""
        accepts = " ".join(x for x in (finite, str(check) if check else "") if x) or "any"
        name = typ.__name__ if isinstance(typ, type) else str(typ).replace("typing.", "")
        out.append(Row(prefix + f.name, name, json.dumps(default_of(f)), accepts, doc_of(f)))
    return out


def text(section: str | None = None) -> str:
    """The reference as the terminal shows it; one section (and its nested ones) or all."""
    lines = []
    for name, doc, keys in sections():
        if section is not None and name != section and not name.startswith(section + "."):
            continue
        lines.append(f"{name}: {doc}")
        for r in keys:
            lines.append(f"  {r.key}  ({r.type}, default {r.default}, accepts {r.accepts})")
            lines += textwrap.wrap(r.doc, width=100, initial_indent="      ", subsequent_indent="      ")
        lines.append("")
    return "\n".join(lines)


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("<", "&lt;")


def markdown() -> str:
    out = ["# Config reference", "",
           f"Generated from the config schema by `{REGENERATE}`; do not edit by hand.",
           "Every key can be set in a recipe's YAML (`section: {key: value}`) or on the command line",
           "(`section.key=value`). A value of the wrong type or out of its range is refused when the",
           "recipe is read, naming the key, the value and what it accepts. Float keys refuse NaN and",
           "infinities. `loongsage config [SECTION]` prints this reference; `loongsage config --check",
           "RECIPE [key=value ...]` validates a recipe as `loongsage run` does at start (its `reward.fn`",
           "imports, the paths it names exist) and prints the resolved config. A recipe file over 1 MiB,",
           "not UTF-8, nested over 64 levels or over 10,000 values with its aliases expanded is refused in",
           "one line.", ""]
    for name, doc, own in sections():
        if not own:
            continue
        out += [f"## `{name}`", "", doc[:1].upper() + doc[1:] + ".", "",
                "| key | type | default | accepts | doc |", "|---|---|---|---|---|"]
        out += [f"| `{r.key}` | {_cell(r.type)} | `{_cell(r.default)}` | {_cell(r.accepts)} | {_cell(r.doc)} |"
                for r in own]
        out.append("")
    return "\n".join(out)


def cmd_config(args) -> int:
    if args.markdown:
        sys.stdout.write(markdown())
        return 0
    if args.check:
        try:
            cfg = load_config(args.check, args.args)
            check_names(cfg)        # what the run checks at start: reward.fn imports, the paths exist
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
        sys.stdout.write(dump_yaml(cfg))
        print(f"# {args.check}: valid", file=sys.stderr)
        return 0
    if len(args.args) > 1:
        print("config: give one SECTION, or --check RECIPE [key=value ...]", file=sys.stderr)
        return 2
    section = args.args[0] if args.args else None
    known = [n for n, _, _ in sections()]
    if section is not None and section not in known:
        print(f"config: unknown section {section!r}; sections: {', '.join(known)}", file=sys.stderr)
        return 2
    sys.stdout.write(text(section))
    return 0


def add_subcommand(sub) -> None:
    c = sub.add_parser("config")
    c.add_argument("args", nargs="*", metavar="SECTION | key=value",
                   help="a section to print (e.g. rollout); with --check: section.key=value overrides")
    c.add_argument("--check", metavar="RECIPE", default=None, help="validate RECIPE and print the resolved config")
    c.add_argument("--markdown", action="store_true", help="print the reference as docs/config.md")
    c.set_defaults(fn=cmd_config)


if __name__ == "__main__":
    sys.stdout.write(markdown())
