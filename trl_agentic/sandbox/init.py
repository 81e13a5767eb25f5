"""The first process of a bubblewrap sandbox (run as a script by the sandbox's Python, standard library only).

`init.py PORT SOCKET -- COMMAND...`: listens on 127.0.0.1:PORT inside the sandbox's network namespace (where loopback
is the only interface) and forwards each connection to the Unix socket SOCKET, which the trainer side connects to the
endpoint; then runs COMMAND and exits with its status. When it exits the sandbox's PID namespace ends: the kernel kills
every process left in it (a `setsid` or double-forked child included). PORT `-`: no endpoint (a checker's command).
"""

import os
import socket
import subprocess
import sys
import threading


def pump(source: socket.socket, target: socket.socket) -> None:
    try:
        while data := source.recv(1 << 16):
            target.sendall(data)
    except OSError:
        pass
    try:
        target.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def forward(client: socket.socket, path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        client.close()
        return
    other = threading.Thread(target=pump, args=(client, upstream), daemon=True)
    other.start()
    pump(upstream, client)
    other.join()
    client.close()
    upstream.close()


def serve(listener: socket.socket, path: str) -> None:
    while True:
        client, _ = listener.accept()
        threading.Thread(target=forward, args=(client, path), daemon=True).start()


def main() -> int:
    port, path, separator, *command = sys.argv[1:]
    assert separator == "--" and command, "usage: init.py PORT SOCKET -- COMMAND..."
    if port != "-":
        listener = socket.create_server(("127.0.0.1", int(port)))
        threading.Thread(target=serve, args=(listener, path), daemon=True).start()
    try:
        child = subprocess.Popen(command)
    except OSError as error:
        print(f"sandbox: cannot run {command[0]!r}: {error}", file=sys.stderr)
        return 127
    code = child.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main())
