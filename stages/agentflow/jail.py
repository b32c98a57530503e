"""Bubblewrap jails: the command lines that put one process tree in namespaces of its own, and its seccomp filter.

Why: a trajectory's code (the code sandbox, stages/agentflow/sandbox.py) and a black-box agent
process (stages/agentflow/blackbox.py) run what a policy wrote; neither may see, or leave
anything for, another trajectory. Debian's `bubblewrap` (bwrap) builds that isolation from
kernel namespaces in one exec, without a daemon; we use it rather than our own unshare/mount
calls because it gets the order of mounts, capability drops and no_new_privs right, and it is
what Flatpak ships. Two jails:

    code_argv   the code sandbox: an empty root with read-only binds of /usr (+ /lib, /bin links)
                and the interpreter's prefix, a fresh /proc of its own PID namespace, a minimal
                /dev, a size-capped private tmpfs /tmp (its cwd); no network namespace of the
                host's (so no abstract Unix sockets either), no host Unix socket files (nothing
                of the host's /tmp, /run or home is there), capabilities dropped but the two the
                worker needs to drop to its own uid (sandbox_worker.setup), the seccomp filter.
    agent_argv  a black-box agent: the host's file system read-only (an agent needs its install
                dir, node, its config), with /tmp, /run, /var/tmp, /dev/shm and the user's home
                hidden behind private tmpfs (so no host Unix socket files, no user credentials),
                the paths the command needs bound back read-only, a fresh writable HOME, its own
                PID namespace with its own /proc (another trajectory's processes, their environ
                and their keys are not there), IPC and UTS namespaces, no capabilities, the
                seccomp filter. The network namespace is the host's: the agent reaches its
                trajectory's proxy endpoint on loopback, and the proxy honours its key only on
                that endpoint (a netns would need a forwarder for every harness's HTTP client).

bwrap always sets no_new_privs. The seccomp filter (`seccomp_bpf`, compiled once with
libseccomp's Python binding: Debian's python3-seccomp or PyPI's pyseccomp) lets everything
through except what a sandboxed program has no business doing: debugging or reading other
processes (ptrace, process_vm_*), new namespaces (unshare, setns, clone with CLONE_NEW*),
mounts, kernel keyrings, bpf, perf, module loading, reboot/swap/clock changes, io_uring
(ENOSYS: libuv falls back), and sockets other than Unix, IPv4 and IPv6 (netlink, packet, ...).
"""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from functools import lru_cache

# denied with EPERM
DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
          "mount", "umount", "umount2", "pivot_root", "chroot", "unshare", "setns",
          "fsopen", "fsmount", "fsconfig", "fspick", "move_mount", "open_tree", "mount_setattr",
          "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "fanotify_init",
          "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
          "swapon", "swapoff", "acct", "quotactl", "syslog", "settimeofday", "clock_settime", "clock_adjtime",
          "adjtimex", "iopl", "ioperm", "open_by_handle_at", "name_to_handle_at", "lookup_dcookie", "vhangup")
# denied with ENOSYS, which callers treat as "this kernel lacks it" and fall back (glibc: clone3 -> clone)
ABSENT = ("clone3", "io_uring_setup", "io_uring_enter", "io_uring_register")
CLONE_NEW = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)
SOCKET_FAMILIES = (1, 2, 10)    # AF_UNIX, AF_INET, AF_INET6: the rest (netlink, packet, vsock...) is EPERM


# every namespace but the user namespace (bwrap makes one itself where it must: not root); as root, a user
# namespace would map only uid 0 and the worker could not drop to a uid of its own
UNSHARE_CODE = ("--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try")


def bwrap() -> str | None:
    return shutil.which("bwrap")


@lru_cache(maxsize=1)
def probe() -> str:
    """"" if bwrap runs a jail here (namespaces allowed: root, or unprivileged user namespaces), else why not."""
    exe = bwrap()
    if exe is None:
        return "no bwrap (apt-get install bubblewrap)"
    argv = [exe, *_base_root(), *UNSHARE_CODE, "--die-with-parent", "--as-pid-1", "--", _python(), "-I", "-c",
            "import os; print(os.getpid())"]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap fails here ({e})"
    if r.returncode != 0 or r.stdout.strip() != "1":
        return f"bwrap fails here ({(r.stderr or r.stdout).strip()[-200:]})"
    return ""


def _seccomp_module():
    try:
        import seccomp  # Debian's python3-seccomp (libseccomp's own binding)
        return seccomp
    except ImportError:
        pass
    try:
        import pyseccomp  # the same API over ctypes (PyPI)
        return pyseccomp
    except (ImportError, OSError):   # OSError: libseccomp.so.2 itself is missing
        return None


@lru_cache(maxsize=1)
def seccomp_bpf() -> bytes:
    """The compiled filter (classic BPF for this architecture), or b"" where no libseccomp binding is installed."""
    sc = _seccomp_module()
    if sc is None:
        return b""
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in DENIED:
        _rule(f, sc.ERRNO(errno.EPERM), name)
    for name in ABSENT:
        _rule(f, sc.ERRNO(errno.ENOSYS), name)
    for flag in CLONE_NEW:
        _rule(f, sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    allowed = sorted(SOCKET_FAMILIES)
    for fam in range(0, allowed[-1]):
        if fam not in allowed:
            _rule(f, sc.ERRNO(errno.EPERM), "socket", sc.Arg(0, sc.EQ, fam))
    _rule(f, sc.ERRNO(errno.EPERM), "socket", sc.Arg(0, sc.GT, allowed[-1]))
    import tempfile

    with tempfile.TemporaryFile() as t:
        f.export_bpf(t)
        t.seek(0)
        return t.read()


def _rule(f, action, name: str, *args) -> None:
    try:
        f.add_rule(action, name, *args)
    except (RuntimeError, ValueError, OSError):   # a syscall this kernel/libseccomp does not know: nothing to deny
        pass


def seccomp_fd() -> int | None:
    """A pipe's read end holding the filter, for `bwrap --seccomp FD` (bwrap reads it to EOF); the caller
    passes it to the child (pass_fds) and closes it after the spawn. None without a filter."""
    prog = seccomp_bpf()
    if not prog:
        return None
    r, w = os.pipe()
    os.write(w, prog)           # a few KiB: fits the pipe's buffer
    os.close(w)
    return r


def _python() -> str:
    return os.path.realpath(sys.executable)


def _base_root() -> list[str]:
    """An empty root with what a dynamically linked interpreter needs, read-only."""
    args = ["--ro-bind", "/usr", "/usr"]
    for d in ("bin", "lib", "lib64", "sbin"):
        p = f"/{d}"
        if os.path.islink(p):
            args += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            args += ["--ro-bind", p, p]
    for f in ("/etc/ld.so.cache", "/etc/localtime"):
        if os.path.exists(f):
            args += ["--ro-bind", f, f]
    prefix = os.path.dirname(os.path.dirname(_python()))      # .../bin/python3.x -> its prefix
    if not prefix.startswith("/usr"):
        args += _bind_prefix(prefix)
    return args + ["--proc", "/proc", "--dev", "/dev"]


def _bind_prefix(prefix: str) -> list[str]:
    """`prefix` read-only at its path, its parents made traversable (a home such as /root is 0700 on the host:
    the worker, once it has its own uid, could otherwise import nothing it had not imported before)."""
    parents, p = [], os.path.dirname(prefix)
    while p not in ("/", ""):
        parents.append(p)
        p = os.path.dirname(p)
    args = []
    for d in reversed(parents):
        args += ["--perms", "0755", "--dir", d]
    return args + ["--ro-bind", prefix, prefix]


def code_argv(worker: str, python: str, tmp_bytes: int, seccomp: int | None, keep_setuid: bool) -> list[str]:
    """bwrap + the sandbox worker, as stages/agentflow/sandbox.py starts it (one per trajectory)."""
    args = [bwrap(), *_base_root()]
    real = os.path.realpath(python)
    prefix = os.path.dirname(os.path.dirname(real))
    if prefix != os.path.dirname(os.path.dirname(_python())) and not prefix.startswith("/usr"):
        args += _bind_prefix(prefix)
    args += ["--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/tmp",
             "--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/dev/shm",
             "--ro-bind", worker, "/sandbox/worker.py",
             *UNSHARE_CODE, "--die-with-parent", "--as-pid-1", "--new-session", "--chdir", "/tmp",
             "--cap-drop", "ALL"]
    if keep_setuid:             # root: the worker itself drops to its own uid once it has imported its modules
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    if seccomp is not None:
        args += ["--seccomp", str(seccomp)]
    return [*args, "--", real, "-I", "/sandbox/worker.py"]


HIDDEN = ("/tmp", "/var/tmp", "/run", "/dev/shm")
HOME_IN_JAIL = "/tmp/home"


def agent_argv(argv: list[str], cwd: str, home: str | None, binds: tuple[str, ...], seccomp: int | None,
               rw: tuple[str, ...] = (), also: tuple[str, ...] = ()) -> list[str]:
    """bwrap around a black-box agent command (see the module docstring). `home`: a host directory bound
    writable as the agent's HOME (/tmp/home), or None for an empty one; `binds`: more host paths, read-only;
    `rw`: host directories bound writable at the same path (the zygote's socket directory); `also`: the
    command line of what will run in it besides `argv` (the zygote's agent), whose files are bound too."""
    real_home = os.path.expanduser("~")
    hidden = [*HIDDEN, *([real_home] if real_home not in ("/", "") else [])]
    args = [bwrap(), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    for d in hidden:
        if os.path.isdir(d) and not os.path.islink(d):
            args += ["--tmpfs", d]
    for p in _rebinds([*argv, *also], cwd, binds, hidden):
        args += ["--ro-bind", p, p]
    for p in rw:
        args += ["--bind", p, p]
    args += ["--bind", home, HOME_IN_JAIL] if home else ["--dir", HOME_IN_JAIL]
    args += ["--setenv", "HOME", HOME_IN_JAIL, "--setenv", "TMPDIR", "/tmp",
             "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
             "--die-with-parent", "--cap-drop", "ALL", "--chdir", cwd]
    if seccomp is not None:
        args += ["--seccomp", str(seccomp)]
    return [*args, "--", *argv]


def _rebinds(argv: list[str], cwd: str, binds: tuple[str, ...], hidden: list[str]) -> list[str]:
    """What the command needs from under the hidden directories: its interpreter, the project, its files, cwd."""
    want = [cwd, sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(_python())),
            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),   # the project root
            *[a for a in argv if os.path.isabs(a)], *os.environ.get("PYTHONPATH", "").split(os.pathsep),
            *binds]
    exe = shutil.which(argv[0]) if argv else None
    if exe:
        want += [exe, os.path.realpath(exe)]
    out: list[str] = []
    for p in want:
        if not p or not os.path.exists(p):
            continue
        p = os.path.abspath(p)
        under = any(p == h or p.startswith(h.rstrip("/") + "/") for h in hidden)
        if (under or p in binds) and not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out = [q for q in out if not q.startswith(p.rstrip("/") + "/")] + [p]
    return out
