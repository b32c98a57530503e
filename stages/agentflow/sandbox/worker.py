"""One sandbox worker process: reads snippets on stdin, runs each, writes the result after a marker.

Started by stages/agentflow/sandbox/pool.py (`python -I worker.py SETUP_JSON`), one per trajectory,
inside a bubblewrap jail (stages/agentflow/sandbox/jail.py: it is then PID 1 of its own PID namespace, its
/tmp already private), or with sandbox.isolation: none in a directory the pool made. This file
imports only the standard library: it must start fast and owe nothing to the project.

`setup` runs once: preload, then its own uid (root only: RLIMIT_NPROC then counts this worker alone), then
rlimits. Per snippet, RLIMIT_CPU's soft limit is the CPU used so far + cpu_s (SIGXCPU -> an exception here,
or the hard limit's SIGKILL if C code never returns to Python).

Protocol: a request is one JSON line on stdin {"code", "cpu_s", "nonce"}. The snippet's stdout
and stderr are this process's fd 1/2, a pipe the pool reads with a size cap; after the snippet
the worker writes MARKER + nonce + one JSON line {"kind", "error", "forked"} to fd 1. kind is
ok | error (an exception in the snippet) | memory | cpu | fork | filesystem. The last statement
of a snippet, if it is an expression, is printed (as a REPL shows it).
"""
import ast
import contextlib
import errno
import json
import math
import os
import resource
import shutil
import signal
import sys
import traceback

MARKER = b"\x00\x1esandbox-end:"


class CPUTimeExceeded(BaseException):   # BaseException: a snippet's `except Exception` does not swallow it
    pass


def setup(cfg: dict) -> None:
    # imported while still able to read the interpreter's files: after the uid drop an interpreter
    # under a private home (here /root/.pyenv, mode 0700) can import nothing it has not loaded yet
    for name in cfg["preload"]:
        with contextlib.suppress(ImportError):
            __import__(name)
    os.chdir(cfg["workdir"])
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    mb = 2 ** 20
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_mb"] * mb, cfg["memory_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["file_mb"] * mb, cfg["file_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    if cfg["nproc"]:
        resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"]))
    # the whole life of the worker gets cpu_lifetime_s; each snippet a soft limit below it
    resource.setrlimit(resource.RLIMIT_CPU, (int(cfg["cpu_lifetime_s"]), int(cfg["cpu_lifetime_s"]) + 1))
    signal.signal(signal.SIGXCPU, _on_xcpu)
    # a write outside the sandbox fails with EACCES/EROFS: it breaches, the pool replaces us
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # file too large -> OSError EFBIG instead of death


def _on_xcpu(signum, frame):
    raise CPUTimeExceeded("CPU time limit exceeded")


def run_snippet(code: str) -> None:
    """exec the snippet in fresh globals; a final expression's value is printed."""
    tree = ast.parse(code, "<snippet>", "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    env = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(tree, "<snippet>", "exec"), env)
    if last is not None:
        value = eval(compile(last, "<snippet>", "eval"), env)
        if value is not None:
            print(repr(value))


def classify(e: BaseException) -> str:
    if isinstance(e, MemoryError):
        return "memory"
    if isinstance(e, CPUTimeExceeded):
        return "cpu"
    if isinstance(e, BlockingIOError) and e.errno == errno.EAGAIN:   # fork/thread refused: RLIMIT_NPROC
        return "fork"
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.EFBIG, errno.ENOSPC):
        return "filesystem"
    return "error"


def clean_cwd() -> None:
    """Nothing a snippet left in the private dir reaches the next one."""
    for name in os.listdir("."):
        with contextlib.suppress(OSError):
            if os.path.isdir(name) and not os.path.islink(name):
                shutil.rmtree(name, ignore_errors=True)
            else:
                os.unlink(name)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    setup(cfg)
    me = os.getpid()
    forked = []
    os.register_at_fork(after_in_parent=lambda: forked.append(1))
    out = os.fdopen(1, "wb", buffering=0, closefd=False)
    out.write(MARKER + b"ready\n")
    for line in sys.stdin:
        req = json.loads(line)
        forked.clear()
        kind, error = "ok", ""
        ru = resource.getrusage(resource.RUSAGE_SELF)
        soft = math.ceil(ru.ru_utime + ru.ru_stime + req["cpu_s"])   # whole seconds: the rlimit's unit
        resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.getrlimit(resource.RLIMIT_CPU)[1]))
        try:
            run_snippet(req["code"])
        except BaseException as e:  # noqa: BLE001 - every failure of the snippet is its result
            if os.getpid() != me:       # a child the snippet forked: never speak the protocol
                os._exit(1)
            kind = classify(e)
            tb = traceback.format_exception_only(type(e), e)
            error = "".join(tb).strip()[-500:]
        if os.getpid() != me:
            os._exit(0)
        with contextlib.suppress(BaseException):  # a broken stdout is the pool's to see
            sys.stdout.flush()
            sys.stderr.flush()
        if forked and kind == "ok":
            kind, error = "fork", "the snippet started a process"
        clean_cwd()
        res = json.dumps({"kind": kind, "error": error, "forked": bool(forked)}).encode()
        out.write(MARKER + req["nonce"].encode() + b" " + res + b"\n")


if __name__ == "__main__":
    main()
