"""``python -I -S fork_client.py -m MODULE [ARG...]``: run a module in a child of the fork server (fork_server.py)
instead of a new Python, as if ``python -m MODULE`` had been run here: same arguments, environment, working directory
and standard streams; exits with the child's code and passes on the signals it gets. When the server cannot take it,
it becomes that ordinary ``python -m``. Standard library only, and nothing Spark: it is on the path it saves time on."""

import contextlib
import json
import os
import signal
import socket
import struct
import sys

HEADER = struct.Struct("!I")


def plain_python() -> None:
    python = os.environ.get("STATEKEEPER_PYTHON") or sys.executable
    os.execv(python, [python, *sys.argv[1:]])


def received(conn: socket.socket) -> int | None:
    data = b""
    while len(data) < HEADER.size:
        chunk = conn.recv(HEADER.size - len(data))
        if not chunk:
            return None
        data += chunk
    return int(HEADER.unpack(data)[0])


def main() -> None:
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(os.environ["STATEKEEPER_FORK_SERVER"])
        body = json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(conn, [HEADER.pack(len(body))], [0, 1, 2])
        conn.sendall(body)
        pid = received(conn)
    except (OSError, KeyError, ValueError):
        pid = None
    if not pid:
        plain_python()
        return

    def pass_on(number: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, number)

    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(number, pass_on)
    code = received(conn)  # the child's exit code; nothing if the server went away
    sys.exit(1 if code is None else code)


main()
