"""Bubblewrap jails: the command lines that put one process tree in namespaces of its own, and its seccomp filter.

Why: a trajectory's code (the code sandbox, stages/agentflow/sandbox/pool.py) and a black-box agent
process (stages/agentflow/blackbox.py) run what a policy wrote; neither may see, or leave
anything for, another trajectory. Debian's `bubblewrap` (bwrap) builds that isolation from
kernel namespaces in one exec, without a daemon; we use it rather than our own unshare/mount
calls because it gets the order of mounts, capability drops and no_new_privs right, and it is
what Flatpak ships. Two jails: `code_argv` for the code sandbox, `agent_argv` for a black-box agent
(whose own loopback reaches its trajectory's proxy endpoint through jail_init.py).

bwrap always sets no_new_privs. The seccomp filter (`seccomp_bpf`, compiled once with libseccomp's
Python binding: Debian's python3-seccomp or PyPI's pyseccomp) lets everything through except what a
sandboxed program has no business doing (DENIED, ABSENT, new namespaces, sockets other than Unix/IP).
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path

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
        return "no bwrap on PATH"
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
    with contextlib.suppress(ImportError):
        import seccomp  # Debian's python3-seccomp (libseccomp's own binding)
        return seccomp
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
    for fam in range(max(SOCKET_FAMILIES)):
        if fam not in SOCKET_FAMILIES:
            _rule(f, sc.ERRNO(errno.EPERM), "socket", sc.Arg(0, sc.EQ, fam))
    _rule(f, sc.ERRNO(errno.EPERM), "socket", sc.Arg(0, sc.GT, max(SOCKET_FAMILIES)))
    with tempfile.TemporaryFile() as t:
        f.export_bpf(t)
        t.seek(0)
        return t.read()


def _rule(f, action, name: str, *args) -> None:
    with contextlib.suppress(RuntimeError, ValueError, OSError):
        f.add_rule(action, name, *args)     # fails for a syscall this kernel/libseccomp does not know: nothing to deny


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
    args = []
    for d in reversed(Path(prefix).parents[:-1]):       # outermost first, "/" left out
        args += ["--perms", "0755", "--dir", str(d)]
    return args + ["--ro-bind", prefix, prefix]


def code_argv(worker: str, python: str, tmp_bytes: int, seccomp: int | None, keep_setuid: bool) -> list[str]:
    """bwrap + the sandbox worker, as stages/agentflow/sandbox/pool.py starts it (one per trajectory)."""
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


def require_bwrap(key: str) -> None:
    """A ValueError naming `key` and what to do where bwrap cannot make a jail here."""
    why = probe()
    if why:
        raise ValueError(f"{key}=bwrap: cannot jail here: {why}. Install bubblewrap (Debian/Ubuntu: apt-get install "
                         f"bubblewrap; docs/sandbox.md), or set {key}=none to run unjailed")


def require(cfg) -> None:
    """A ValueError naming what to do where black-box agents cannot be jailed as the agent section `cfg` asks."""
    if cfg.jail == "none":
        return
    require_bwrap("agent.jail")
    missing = [b for b in cfg.binds if not os.path.exists(b)]
    if missing:
        raise ValueError(f"agent.binds: {missing[0]} does not exist")


IN_JAIL = "/loongsage"             # where jail_init.py (and zygote.py) are bound, read-only
HOME_IN_JAIL = "/tmp/home"
HERE = os.path.dirname(os.path.abspath(__file__))
# what an agent gets of the host's /etc: names, certificates, the linker's and the alternatives' links; no
# secrets (shadow, ssh host keys, machine-id...)
AGENT_ETC = ("passwd", "group", "hosts", "nsswitch.conf", "resolv.conf", "host.conf", "gai.conf", "ld.so.conf",
             "ld.so.conf.d", "alternatives", "ssl", "ca-certificates", "ca-certificates.conf", "os-release",
             "mime.types", "protocols", "services", "timezone")


def agent_argv(argv: list[str], port: int, ctl_fd: int, home: str | None, binds: tuple[str, ...], tmp_bytes: int,
               seccomp: int | None) -> list[str]:
    """bwrap + jail_init.py (which holds the proxy's port on the jail's loopback) + the agent's command."""
    return [*_agent_jail(argv, home, binds, tmp_bytes, seccomp, zygote=False), _python(), "-I", "-S",
            f"{IN_JAIL}/jail_init.py", str(port), str(ctl_fd), "--", *argv]


def zygote_argv(argv: list[str], ctl_fd: int, seccomp: int | None, home: str | None, binds: tuple[str, ...],
                tmp_bytes: int, modules: tuple[str, ...]) -> list[str]:
    """bwrap + the zygote (stages/agentflow/sandbox/zygote.py) that forks `argv`'s agents; it builds each agent's
    namespaces itself, so it keeps CAP_SYS_ADMIN and CAP_NET_ADMIN in this jail and applies the seccomp
    filter (read from the fd `seccomp`) to each agent. It runs the worker's own interpreter path (a virtual
    environment's python, not the file it links to), so what it preloads comes from the worker's packages."""
    return [*_agent_jail(argv, home, binds, tmp_bytes, None, zygote=True), sys.executable, "-s", f"{IN_JAIL}/zygote.py",
            str(ctl_fd), str(-1 if seccomp is None else seccomp), str(tmp_bytes), *modules]


def _agent_jail(argv: list[str], home: str | None, binds: tuple[str, ...], tmp_bytes: int, seccomp: int | None,
                zygote: bool) -> list[str]:
    """An empty root with the system's programs and libraries (/usr, /lib*, part of /etc), the interpreter,
    the command's own files and `binds`, read-only; a size-capped private /tmp and /dev/shm with a fresh HOME
    (`home`, a host directory, bound writable there; for the zygote, read-only as the template each agent's
    HOME is copied from); its own PID, network, IPC and UTS namespaces; no capabilities; the seccomp filter."""
    args = [bwrap(), *_base_root()]
    for name in AGENT_ETC:
        if os.path.exists(f"/etc/{name}"):
            args += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    for d in ("/tmp", "/dev/shm"):
        args += ["--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", d]
    for p in agent_paths(argv, binds):
        args += ["--ro-bind", p, p]
    args += ["--ro-bind", os.path.join(HERE, "jail_init.py"), f"{IN_JAIL}/jail_init.py"]
    if zygote:
        args += ["--ro-bind", os.path.join(HERE, "zygote.py"), f"{IN_JAIL}/zygote.py"]
        args += ["--ro-bind", home, f"{IN_JAIL}/home"] if home else []
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_NET_ADMIN", "--chdir", "/"]
    else:
        args += ["--bind", home, HOME_IN_JAIL] if home else ["--dir", HOME_IN_JAIL]
        args += ["--cap-drop", "ALL", "--chdir", HOME_IN_JAIL]
        args += ["--seccomp", str(seccomp)] if seccomp is not None else []
    return [*args, *UNSHARE_CODE, "--die-with-parent", "--setenv", "HOME", HOME_IN_JAIL, "--setenv", "TMPDIR",
            "/tmp", "--"]


def agent_paths(argv: list[str], binds: tuple[str, ...]) -> list[str]:
    """The host paths an agent command needs, outermost only: the interpreter's prefixes, the directory of
    each script or file on its command line, the executable's install (a node_modules tree as a whole),
    and `binds`. Nothing else of the host's (its home, run directories, data sets) is in the jail."""
    want = [sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(_python())), *binds]
    for a in argv:
        if os.path.isabs(a) and os.path.exists(a):
            want.append(os.path.dirname(a) if os.path.isfile(a) else a)
    exe = shutil.which(argv[0]) if argv else None
    for e in (exe, os.path.realpath(exe) if exe else None):
        if e and not e.startswith("/usr/"):
            parts = e.split(os.sep)
            want.append(os.sep.join(parts[:parts.index("node_modules") + 1]) if "node_modules" in parts
                        else os.path.dirname(e))
    out: list[str] = []
    for p in sorted({os.path.abspath(p) for p in want if p and os.path.exists(p)}, key=len):
        if not p.startswith("/usr/") and p != "/usr" and not any(p == q or p.startswith(q + "/") for q in out):
            out.append(p)
    return out


class Cgroup:
    """One jail's own cgroup: its processes (and threads) and memory bounded, and every process in it killed
    at its end, wherever it went (setsid and double forks included). Made under the worker's own cgroup in
    the v1 `pids` and `memory` hierarchies or in cgroup v2, where this user may write there (root; or a v2
    cgroup delegated with both controllers enabled for its children); else `available()` says why not."""

    _count = 0

    def __init__(self, procs: int, memory_bytes: int):
        Cgroup._count += 1
        name = f"loongsage-{os.getpid()}-{Cgroup._count}"
        self.dirs = [os.path.join(root, name) for root in _cgroup_roots()[0].values()]
        limits = {"pids.max": procs, "memory.max": memory_bytes, "memory.limit_in_bytes": memory_bytes,
                  "memory.memsw.limit_in_bytes": memory_bytes}
        for d in self.dirs:
            os.mkdir(d, 0o700)
            for f, v in limits.items():
                if os.path.exists(os.path.join(d, f)):
                    _write(os.path.join(d, f), v)

    @staticmethod
    def available() -> str:
        """"" where jails get cgroups, else why not."""
        return _cgroup_roots()[1]

    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def add(self, pid: int) -> None:
        for f in self.procs_files():
            _write(f, pid)

    def oom_kills(self) -> int:
        """Processes the kernel killed in it for want of memory (its limit)."""
        for d in self.dirs:
            for name in ("memory.events", "memory.oom_control"):     # v2, v1
                with contextlib.suppress(OSError):
                    for line in Path(d, name).read_text().splitlines():
                        if line.startswith("oom_kill "):
                            return int(line.split()[1])
        return 0

    def close(self) -> None:
        """Kill everything in it (a pids limit bounds the forks racing the kill), then remove it."""
        for _ in range(200):
            pids = set()
            for f in self.procs_files():
                with contextlib.suppress(OSError):
                    pids |= {int(x) for x in Path(f).read_text().split()}
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)
        for d in self.dirs:
            for _ in range(100):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:         # EBUSY until the killed processes are reaped
                    time.sleep(0.01)


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


@lru_cache(maxsize=1)
def _cgroup_roots() -> tuple[dict[str, str], str]:
    """{controller: this process's cgroup directory} for pids and memory (v1: one hierarchy each; v2: one for
    both), checked by making and removing a child; ({}, why) where that fails."""
    mounts: dict[str, str] = {}
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            pre, _, post = line.partition(" - ")
            fstype, _src, opts = (post.split() + ["", ""])[:3]
            if fstype == "cgroup2":
                mounts.setdefault("", pre.split()[4])
            elif fstype == "cgroup":
                for c in ("pids", "memory"):
                    if c in opts.split(","):
                        mounts[c] = pre.split()[4]
        mine = {}
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _n, ctrls, path = line.split(":", 2)
            for c in ctrls.split(",") if ctrls else [""]:
                mine[c] = path
    except OSError as e:
        return {}, f"cannot read this process's cgroups ({e})"
    if "pids" in mounts and "memory" in mounts:
        roots = {c: mounts[c] + mine.get(c, "/").rstrip("/") for c in ("pids", "memory")}
    elif "" in mounts:
        d = mounts[""] + mine.get("", "/").rstrip("/")
        try:
            enabled = Path(d, "cgroup.subtree_control").read_text().split()
        except OSError:
            enabled = []
        if not {"pids", "memory"} <= set(enabled):
            return {}, f"the cgroup v2 group {d} does not delegate pids and memory to its children"
        roots = {"v2": d}
    else:
        return {}, "no cgroup hierarchy with the pids and memory controllers is mounted"
    probe = {c: os.path.join(r, f"loongsage-probe-{os.getpid()}") for c, r in roots.items()}
    try:
        for p in probe.values():
            os.mkdir(p)
    except OSError as e:
        return {}, f"cannot make a cgroup under {os.path.dirname(p)} ({e.strerror})"
    finally:
        for p in probe.values():
            with contextlib.suppress(OSError):
                os.rmdir(p)
    return roots, ""
