#!/usr/bin/env python3
"""A process that looks like .NET to a profiler but does not behave like it.

It maps files named libcoreclr.so and System.Private.CoreLib.dll (what
profilers look for in /proc/PID/maps) and listens on a diagnostic socket named as CoreCLR names
it, then misbehaves in one of these ways (argv[1]):

  silent  never accepts a connection (its backlog fills up);
  mute    accepts, reads the request, never answers;
  junk    accepts and answers every request with random bytes, forever.

It prints PID and READY like the C# workloads, lives argv[2] seconds and
removes its socket when it ends.
"""

import mmap
import os
import random
import socket
import sys
import tempfile
import threading
import time


def serve(listener, mode):
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=answer, args=(conn, mode), daemon=True).start()


def answer(conn, mode):
    try:
        conn.recv(65536)
        if mode == "mute":
            time.sleep(3600)
        rng = random.Random(os.getpid())
        while True:
            conn.sendall(bytes(rng.getrandbits(8) for _ in range(4096)))
    except OSError:
        pass


def main():
    mode, seconds = sys.argv[1], float(sys.argv[2])
    workdir = tempfile.mkdtemp(prefix="fake-dotnet-")
    # libcoreclr.so says .NET; System.Private.CoreLib.dll says its runtime
    # has started (profilers wait for it before they talk to the runtime).
    mappings = []
    for name in ("libcoreclr.so", "System.Private.CoreLib.dll"):
        lib = os.path.join(workdir, name)
        with open(lib, "wb") as f:
            f.write(b"\0" * 4096)
        fd = os.open(lib, os.O_RDONLY)
        # Executable, as a runtime maps its code.
        mappings.append(mmap.mmap(fd, 4096, prot=mmap.PROT_READ | mmap.PROT_EXEC))
    stat = open("/proc/self/stat").read()
    start_ticks = stat.rsplit(")", 1)[1].split()[19]
    path = f"/tmp/dotnet-diagnostic-{os.getpid()}-{start_ticks}-socket"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(1)
    if mode != "silent":
        threading.Thread(target=serve, args=(listener, mode), daemon=True).start()
    print(f"PID {os.getpid()}", flush=True)
    print("READY", flush=True)
    try:
        time.sleep(seconds)
    finally:
        os.unlink(path)
        for mapping in mappings:
            mapping.close()


if __name__ == "__main__":
    main()
