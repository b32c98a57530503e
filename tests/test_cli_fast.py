"""The command line answers at once: -h, `config` and every refusal of `run` (a bad value, a run
directory in use, holding a run, holding a run that trained nothing) come before torch or Ray is
imported. Each command runs in a fresh interpreter, as a user's shell starts it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import json, resource, sys
from pipeline.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
use = resource.getrusage(resource.RUSAGE_SELF)
print("PROBE " + json.dumps({"code": code, "cpu_s": use.ru_utime + use.ru_stime,
                             "loaded": sorted({"torch", "ray", "transformers"} & set(sys.modules))}), file=sys.stderr)
"""


def probe(*argv: str) -> tuple[dict, str, str]:
    """(exit code, CPU seconds of the whole process, heavy modules loaded), its stdout and its other stderr."""
    r = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    err = r.stderr.splitlines()
    assert err and err[-1].startswith("PROBE "), r.stderr[-3000:]
    return json.loads(err[-1][6:]), r.stdout, "\n".join(err[:-1])


def test_help_lists_every_subcommand_in_under_a_second_of_cpu():
    got, out, _ = probe("--help")
    assert got["code"] == 0 and got["loaded"] == []
    assert got["cpu_s"] < 1.0, got
    for name in ("run", "replay", "profile", "make-teacher", "make-model", "export", "plan", "config", "serve"):
        assert f"    {name}" in out, out


def test_config_reference_loads_no_torch_or_ray():
    got, out, _ = probe("config", "rollout")
    assert got["code"] == 0 and got["loaded"] == [] and "rollout.n_samples" in out


def _run_dir(tmp_path, *files: str, metrics: list[dict] = ()) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.yaml").write_text("run: {}\n")
    for f in files:
        (d / f).mkdir(parents=True)
    if metrics:
        (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return d


EVAL_ONLY = [{"step": 0, "time_s": 1.0, "eval/accuracy": 0.25}]
TRAINED = EVAL_ONLY + [{"step": 1, "time_s": 2.0, "train/loss": 0.5}]


@pytest.mark.parametrize("case, says", [
    ("bad value", "config error: rollout.n_samples must be > 0, got 0"),
    ("finished run", "holds a finished run (config.yaml, metrics.jsonl, checkpoints); resume it with --resume"),
    ("trained run, no checkpoint", "holds a finished run (config.yaml, metrics.jsonl); resume it with --resume"),
    ("trained nothing", "holds a run that trained nothing (config.yaml, metrics.jsonl); start over in it with "
                        "--overwrite, or choose another --run-dir"),
    ("resume, nothing to resume", "holds no checkpoint to resume from (its run trained nothing); start over in it "
                                  "with --overwrite"),
    ("resume into a new directory", "holds no checkpoint to resume from; start over without --resume"),
])
def test_run_refusals_come_before_torch_and_ray(tmp_path, case, says):
    argv = ["run", "configs/quickstart.yaml"]
    if case == "bad value":
        argv.append("rollout.n_samples=0")
    elif case == "finished run":
        argv += ["--run-dir", str(_run_dir(tmp_path, "checkpoints/step_000002", metrics=TRAINED))]
    elif case == "trained run, no checkpoint":
        argv += ["--run-dir", str(_run_dir(tmp_path, metrics=TRAINED))]
    elif case == "trained nothing":
        argv += ["--run-dir", str(_run_dir(tmp_path, metrics=EVAL_ONLY))]
    elif case == "resume, nothing to resume":
        argv += ["--run-dir", str(_run_dir(tmp_path, metrics=EVAL_ONLY)), "--resume"]
    else:
        argv += ["--run-dir", str(tmp_path / "new"), "--resume"]
    got, _, err = probe(*argv)
    assert got["code"] == 2 and got["loaded"] == [], (got, err)
    assert len(err.splitlines()) == 1 and says in err, err


def test_a_run_dir_in_use_is_refused_before_torch_and_ray(tmp_path):
    hold = ("import sys, time; from pipeline.rundir import locked\n"
            "with locked(sys.argv[1], log=lambda _: None):\n"
            "    print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        got, _, err = probe("run", "configs/quickstart.yaml", "--run-dir", str(tmp_path))
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert got["code"] == 2 and got["loaded"] == [] and f"is in use by pid {holder.pid}" in err, (got, err)


def test_a_serve_refusal_comes_before_torch_and_ray(tmp_path):
    got, _, err = probe("serve", "builtin:qwen-vocab-tiny", "--key", "sk-x", "--record", str(tmp_path / "rec"))
    assert got["code"] == 2 and got["loaded"] == [] and "--key puts the key on the command line" in err, (got, err)
