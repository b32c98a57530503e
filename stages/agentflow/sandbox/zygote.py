"""Agent zygote: one Python process that has imported an agent's SDK, forking each trajectory's agent from it.

A black-box agent runs once per trajectory (stages/agentflow/blackbox.py), and a Python agent
pays its interpreter start and SDK import (seconds of CPU) each time. With `agent.preload: [anthropic]`
the rollout worker starts this file once per worker in an agent jail (jail.py `zygote_argv`), with a
control socket inherited as a file descriptor (there is no socket file anyone could replace):

    python zygote.py CTL_FD SECCOMP_FD TMP_BYTES MODULE...

It imports the modules, prints "ready", then forks one supervisor per spawn request:

    worker                                   zygote / the trajectory's supervisor L
    {"argv", "env", "port"} + stdin,    -->  fork() L
    stdout, stderr, a socketpair end         L: "ready" (the worker reads L's pid from its credentials
                                                and puts it into the trajectory's cgroup)
    "go"                                -->  L: new mount, network, PID, IPC and UTS namespaces; a private
                                                size-capped /tmp and /dev/shm, HOME in it; loopback up; a
                                                forwarder process holds the proxy's port (jail_init.py)
                                             I = fork(): PID 1 of the new PID namespace, a /proc of its own;
                                                forks S and reaps until S exits; then every process left
                                                in the namespace dies with it
                                             S: no capabilities, the seccomp filter, a session of its own,
                                                the three fds, the env, runpy(script, "__main__")
    <-- one connected socket per request     L forwards connections (jail_init.serve)
    <-- {"rc": code}                         L, when I has exited

So each forked agent has what a spawned one has (its own processes, /proc, loopback, /tmp and
HOME; nothing it writes is seen by another trajectory, and nothing it starts outlives it), and only
the zygote and L, which run this file alone, hold the two capabilities (CAP_SYS_ADMIN and
CAP_NET_ADMIN, in the zygote's jail) that building those namespaces needs. What differs from a
fresh interpreter: modules imported by the zygote are not imported again, so what they read from
the environment at import time is the zygote's, not the trajectory's. The official SDKs read
their base URL and key when a client is made, after the fork. Only `python SCRIPT.py ...` agents.

Standard library only: it runs as a plain script, outside the project's packages.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib
import json
import os
import random
import shutil
import signal
import socket
import struct
import sys
import traceback

import jail_init

MAX_MSG = 1 << 20
HOME = "/tmp/home"
HOME_TEMPLATE = "/loongsage/home"      # agent.home, bound read-only by the jail when there is one
CLONE = {"ns": 0x00020000, "uts": 0x04000000, "ipc": 0x08000000, "pid": 0x20000000, "net": 0x40000000}
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_REC, MS_PRIVATE = 1 << 14, 1 << 18
PR_SET_PDEATHSIG, PR_SET_SECCOMP, SECCOMP_MODE_FILTER, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 1, 22, 2, 47, 4
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 1
_libc = ctypes.CDLL(None, use_errno=True)


def _ok(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _ok(_libc.mount(src.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                    data.encode() if data else None), f"mount {target}")


def _private(top: str, size: int) -> None:
    """A fresh tmpfs on `top`, with the jail's read-only binds under it (the agent's script directory may be
    in the host's /tmp) bound again on top of it."""
    points = []
    for line in open("/proc/self/mountinfo"):
        p = line.split()[4].replace("\\040", " ")
        if p.startswith(top + "/"):
            points.append((p, os.open(p, os.O_PATH), os.path.isdir(p)))
    _mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=1777")
    for p, fd, is_dir in points:
        if is_dir:
            os.makedirs(p, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(p), exist_ok=True)
            open(p, "a").close()
        _mount(f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC)
        _mount("none", p, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH", b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Filter(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _drop_privileges(bpf: bytes) -> None:
    """No capabilities (permitted, effective, inheritable, ambient; no_new_privs, which bwrap set, keeps an
    exec from gaining any), then the jail's seccomp filter."""
    _ok(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient capabilities")
    data = (ctypes.c_uint32 * 6)()
    _ok(_libc.capset(ctypes.byref(_CapHeader(0x20080522, 0)), data), "capset")
    if bpf:
        buf = ctypes.create_string_buffer(bpf, len(bpf))
        prog = _Filter(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
        _ok(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")


def _agent(req: dict, fds: list[int], bpf: bytes) -> None:
    """S: become the agent process and run its script; never returns."""
    code = 1
    try:
        _drop_privileges(bpf)
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(HOME)
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
    except BaseException:   # noqa: BLE001 - the script's crash, reported as Python would
        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF)


def _init(req: dict, fds: list[int], bpf: bytes) -> None:
    """I, PID 1 of the trajectory's PID namespace: a /proc of its own, S, and its exit status."""
    code = 1
    try:
        _ok(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")   # L gone: so is all of this
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        agent = os.fork()
        if agent == 0:
            _agent(req, fds, bpf)
        for fd in fds:
            os.close(fd)
        while True:
            pid, status = os.wait()
            if pid == agent:
                code = jail_init.exit_code(status)
                break
    except BaseException:   # noqa: BLE001 - reported as the trajectory's stderr would show it
        traceback.print_exc()
    os._exit(code)


def _trajectory(req: dict, fds: list[int], link: socket.socket, bpf: bytes, tmp_bytes: int) -> None:
    """L: the trajectory's namespaces, its PID 1, the proxy forwarder; reports the exit status; never returns."""
    try:
        for target in (1, 2):       # what goes wrong here is the trajectory's stderr
            os.dup2(fds[2], target)
        link.send(b"ready")
        if link.recv(16) != b"go":
            os._exit(1)
        _ok(_libc.unshare(sum(v for k, v in CLONE.items() if k != "pid")), "unshare")
        _mount("none", "/", None, MS_REC | MS_PRIVATE)
        for d in ("/tmp", "/dev/shm"):
            _private(d, tmp_bytes)
        if os.path.isdir(HOME_TEMPLATE):
            shutil.copytree(HOME_TEMPLATE, HOME, symlinks=True)
        else:
            os.mkdir(HOME)
        _loopback_up()
        listener = jail_init.listen(int(req["port"]))
        forwarder = os.fork()       # threads: a process that has unshared its PID namespace cannot make any
        if forwarder == 0:
            _ok(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
            for fd in fds:
                os.close(fd)
            jail_init.serve(listener, link).join()
            os._exit(0)
        listener.close()
        _ok(_libc.unshare(CLONE["pid"]), "unshare pid")
        init = os.fork()
        if init == 0:
            link.close()
            _init(req, fds, bpf)
        for fd in fds:
            os.close(fd)
        status = os.waitpid(init, 0)[1]
        os.kill(forwarder, signal.SIGKILL)
        os.waitpid(forwarder, 0)
        link.send(json.dumps({"rc": jail_init.exit_code(status)}).encode())
    except BaseException as e:  # noqa: BLE001 - the worker fails the trajectory with this
        traceback.print_exc()       # into the trajectory's stderr tail
        with contextlib.suppress(OSError):
            link.send(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
    os._exit(0)


def serve(ctl: socket.socket, bpf: bytes, tmp_bytes: int, modules: list[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as e:  # noqa: BLE001 - any failure to import is the user's preload list
            print(f"agent.preload: module {name!r} does not import: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
            sys.exit(2)
    print("ready", flush=True)
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(ctl, MAX_MSG, 4)
        except OSError:
            return
        if not msg:             # the rollout worker is gone: so is its zygote (and, with it, its jail)
            return
        link = socket.socket(fileno=fds.pop()) if len(fds) == 4 else None
        try:
            req = json.loads(msg)
            if link is None or len(req.get("argv", ())) < 2:
                raise ValueError("a spawn request needs argv [python, script, ...] and four fds")
            sys.stdout.flush()
            sys.stderr.flush()
            if os.fork() == 0:
                ctl.close()
                _trajectory(req, fds, link, bpf, tmp_bytes)
        except (OSError, ValueError) as e:
            if link is not None:
                link.send(json.dumps({"error": str(e)}).encode())
        for fd in fds:
            os.close(fd)
        if link is not None:
            link.close()
        # reap supervisors that have ended (their status went to the worker)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass


def _read_all(fd: int) -> bytes:
    if fd < 0:
        return b""
    with os.fdopen(fd, "rb") as f:
        return f.read()


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit("usage: zygote.py CTL_FD SECCOMP_FD TMP_BYTES [MODULE ...]")
    serve(socket.socket(fileno=int(sys.argv[1])), _read_all(int(sys.argv[2])), int(sys.argv[3]), sys.argv[4:])
