"""The core's size: lines of Python in pipeline/ + stages/ + transfer/, the RL core without the optional
subpackages (planner, sandbox, tasks), per part, and every file over the per-file limit.

    python benchmarks/core_size.py [--base COMMIT]      # --base: the same table at COMMIT, beside it

Goals (docs/architecture.md): everything <= 19,000 lines, the RL core <= 14,000, no file over 500.
Lines are `wc -l` lines (blank and comment lines included).
"""
from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("pipeline", "stages", "transfer")
OPTIONAL = ("planner", "sandbox", "tasks")
GOALS = {"all": 19_000, "RL core": 14_000}
FILE_LIMIT = 500


def files_at(commit: str | None) -> dict[str, int]:
    """{path: lines} of the layers' .py files, in the work tree or at `commit`."""
    if commit is None:
        return {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
                for layer in LAYERS for p in (ROOT / layer).rglob("*.py")}
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", commit, *LAYERS],
                           capture_output=True, text=True, check=True).stdout.split()
    out = {}
    for n in names:
        if n.endswith(".py"):
            text = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{n}"], capture_output=True,
                                  text=True, check=True).stdout
            out[n] = len(text.splitlines())
    return out


def part(path: str) -> str:
    parts = Path(path).parts
    for opt in OPTIONAL:
        if opt in parts[:-1]:
            return f"{'/'.join(parts[:parts.index(opt) + 1])}/ (optional)"
    return "/".join(parts[:2]) + "/" if len(parts) > 2 else parts[0] + "/"


def table(files: dict[str, int]) -> dict[str, int]:
    rows: dict[str, int] = {}
    for path, n in files.items():
        rows[part(path)] = rows.get(part(path), 0) + n
    rows["all"] = sum(files.values())
    rows["RL core"] = rows["all"] - sum(v for k, v in rows.items() if k.endswith("(optional)"))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", help="a commit to compare with")
    args = p.parse_args()
    now = files_at(None)
    cols = {"now": table(now)} | ({args.base: table(files_at(args.base))} if args.base else {})
    keys = sorted({k for t in cols.values() for k in t if k not in GOALS}) + list(GOALS)
    print(f"| part | {' | '.join(cols)} | goal |")
    print("|---|" + "---:|" * len(cols) + "---:|")
    for k in keys:
        print(f"| {k} | {' | '.join(str(t.get(k, 0)) for t in cols.values())} | {GOALS.get(k, '')} |")
    big = sorted(((n, p) for p, n in now.items() if n > FILE_LIMIT), reverse=True)
    print(f"\nfiles over {FILE_LIMIT} lines: " + (", ".join(f"{p} ({n})" for n, p in big) or "none"))


if __name__ == "__main__":
    main()
