"""Inside an agent jail: the trajectory's proxy endpoint on the jail's own loopback, then the agent.

    python -I -S jail_init.py PORT CTL_FD -- AGENT_ARGV...

An agent jail (stages/agentflow/sandbox/jail.py) has a network namespace of its own with nothing but
loopback, so neither the host's loopback services nor its abstract Unix sockets are reachable.
The agent still finds its proxy at the base URL it was given (http://127.0.0.1:PORT/t/ROUTE/v1):
this process listens on 127.0.0.1:PORT inside the jail and, for each connection, asks the rollout
worker for a connected socket over CTL_FD (a Unix socketpair the worker made for this trajectory
alone), then copies bytes both ways. The worker hands that socket's other end to the proxy bound
to this trajectory's route: a request for any other route on it is refused, so a key seen by one
jail is of no use from another. There is no socket file of the host in the jail.

The zygote (stages/agentflow/sandbox/zygote.py) uses `listen` and `serve` the same way for agents it
forks. Standard library only, started with -I -S: it runs before anything of the agent's.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading

CONNECT = b"c"          # a request on the control socket: one connected socket, please
CHUNK = 1 << 16


def listen(port: int) -> socket.socket:
    # no SO_REUSEPORT: nothing else in the jail can bind this port while it is held
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", port))
    s.listen(128)
    return s


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        with contextlib.suppress(OSError):
            while data := src.recv(CHUNK):
                dst.sendall(data)
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            with contextlib.suppress(OSError):
                s.shutdown(how)


def _connection(ctl: socket.socket, lock: threading.Lock) -> socket.socket | None:
    with lock:      # one request in flight on the control socket at a time
        try:
            ctl.send(CONNECT)
            _msg, fds, _flags, _addr = socket.recv_fds(ctl, 16, 1)
        except OSError:
            return None
    return socket.socket(fileno=fds[0]) if fds else None


def _forward(client: socket.socket, ctl: socket.socket, lock: threading.Lock) -> None:
    upstream = _connection(ctl, lock)
    if upstream is None:        # the trajectory has ended: nothing to reach
        client.close()
        return
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def serve(listener: socket.socket, ctl: socket.socket) -> threading.Thread:
    """Forward every connection to `listener` through the worker, on daemon threads."""
    lock = threading.Lock()

    def loop():
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=_forward, args=(client, ctl, lock), daemon=True).start()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def exit_code(status: int) -> int:
    """A wait status as a shell reports it (128 + signal for a killed process)."""
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def main(argv: list[str]) -> int:
    port, ctl_fd, cmd = int(argv[0]), int(argv[1]), argv[3:]
    ctl = socket.socket(fileno=ctl_fd)
    ctl.set_inheritable(False)      # the agent gets no way to the worker but its own connections
    serve(listen(port), ctl)
    try:
        pid = os.posix_spawnp(cmd[0], cmd, os.environ)
    except OSError as e:
        print(f"agent jail: cannot start {cmd[0]!r}: {e}", file=sys.stderr)
        return 127
    return exit_code(os.waitpid(pid, 0)[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
