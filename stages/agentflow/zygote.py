"""Agent zygote: one Python process that has imported an agent's SDK, forking a process per trajectory.

A black-box agent runs once per trajectory (stages/agentflow/blackbox.py), and a Python agent
pays its interpreter start and SDK import each time: `import anthropic` is ~2.5 s of CPU,
`import openai` ~1.2 s on this project's 2-core machine, against milliseconds of model time
per call on a tiny model. With `rollout.agent_preload: [anthropic]` the rollout worker starts
this file once (`python zygote.py SOCKET anthropic`): it imports the named modules, then serves
a Unix socket. Each trajectory is still its own OS process running the unmodified script:

    worker                                   zygote
    pipes for stdout/stderr, /dev/null  -->  fork(); the child: setsid, the three fds as 0/1/2,
    + {"argv", "env", "cwd"} (SCM_RIGHTS)    chdir, os.environ = env, sys.argv, a fresh `random`
                                             seed, runpy.run_path(script, "__main__"), exit code
                                        <--  {"pid": N}
    reads the pipes, kills the group         waitpid
                                        <--  {"rc": code, or -signal}

so the worker's handling (process group kill, stderr tail, timeouts) is the same as for a spawned
process. With "private" in the request (the zygote runs in an agent jail that its children share),
the child makes itself non-dumpable first. What differs from a fresh interpreter: modules imported
by the zygote are not imported again, so whatever they read from the environment at import time is
the zygote's (the worker's) environment, not the trajectory's; `sys.modules` state they set at
import is shared by every child. The official SDKs read their base URL and key when a client is
made, which is after the fork. Only a `python SCRIPT.py ...` command can be preloaded.

Standard library only: it runs as a plain script, outside the project's packages.
"""
from __future__ import annotations

import importlib
import json
import os
import random
import selectors
import signal
import socket
import sys
import traceback

MAX_MSG = 1 << 20


def _child(req: dict, fds: list[int]) -> None:
    """In the forked child: become the agent process and run its script; never returns."""
    code = 1
    try:
        if req.get("private"):
            _undumpable()
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        random.seed()
        script = req["argv"][1]
        sys.argv = list(req["argv"][1:])
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        import runpy

        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:   # noqa: BLE001 - the script's crash, reported as Python would
        traceback.print_exc()
        code = 1
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF)


def _undumpable() -> None:
    """In a jail shared with its siblings (same uid, no capabilities): make this process's environment (its
    key) and memory unreadable to them (/proc/PID/environ and /mem need ptrace access, which a non-dumpable
    process grants only to CAP_SYS_PTRACE)."""
    import ctypes

    PR_SET_DUMPABLE = 4
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def serve(path: str, modules: list[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as e:  # noqa: BLE001 - any failure to import is the user's preload list
            print(f"rollout.agent_preload: module {name!r} does not import: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
            sys.exit(2)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(256)
    parent = os.getppid()
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        for _key, _ev in sel.select(timeout=0.02):
            conn, _ = srv.accept()
            try:
                msg, fds, _flags, _addr = socket.recv_fds(conn, MAX_MSG, 3)
                req = json.loads(msg)
                if len(fds) != 3 or len(req.get("argv", ())) < 2:
                    raise ValueError("a spawn request needs argv [python, script, ...] and three fds")
            except (OSError, ValueError) as e:
                conn.sendall(json.dumps({"error": str(e)}).encode())
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                sel.close()
                for other in (srv, conn, *waiting.values()):
                    other.close()
                _child(req, fds)
            for fd in fds:
                os.close(fd)
            waiting[pid] = conn
            try:
                conn.sendall(json.dumps({"pid": pid}).encode())
            except OSError:
                pass
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                try:
                    conn.sendall(json.dumps({"rc": rc}).encode())
                except OSError:
                    pass
                conn.close()
        if os.getppid() != parent:   # the rollout worker is gone: so is its zygote
            for pid in waiting:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
            return


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: zygote.py SOCKET [MODULE ...]")
    serve(sys.argv[1], sys.argv[2:])
