#!/usr/bin/env python3
"""A process that looks like .NET to a profiler but does not behave like it.

It maps files named libcoreclr.so and System.Private.CoreLib.dll (what
profilers look for in /proc/PID/maps) and listens on a diagnostic socket named as CoreCLR names
it, then misbehaves in one of these ways (argv[1]):

  silent  never accepts a connection (its backlog fills up);
  mute    accepts, reads the request, never answers;
  junk    accepts and answers every request with random bytes, forever;
  metadata  answers a tracing request like a runtime, then streams a valid
          nettrace stream of nothing but metadata records, each with 256
          long field names and an id of its own (a few GB if all were kept).

It prints PID and READY like the C# workloads, lives argv[2] seconds and
removes its socket when it ends.
"""

import mmap
import os
import random
import socket
import struct
import sys
import tempfile
import threading
import time

from wire import utf16z, varuint


def serve(listener, mode):
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=answer, args=(conn, mode), daemon=True).start()


IPC_MAGIC = b"DOTNET_IPC_V1\0"
# (command set, command id) of CollectTracing 1-5.
COLLECT_TRACING = {(0x02, n) for n in range(0x02, 0x07)}


def ipc_ok(payload):
    return IPC_MAGIC + struct.pack("<HBBH", 20 + len(payload), 0xFF, 0x00, 0) + payload



class Nettrace:
    """A NetTrace V4 stream as a 64-bit Linux runtime writes one."""

    def __init__(self):
        self.written = 0

    def trace_header(self):
        out = b"Nettrace" + struct.pack("<i", 20) + b"!FastSerialization.1"
        out += bytes([5, 5, 1]) + struct.pack("<iii", 4, 4, 5) + b"Trace" + bytes([6])
        out += struct.pack("<8H", 2026, 11, 2, 17, 10, 30, 15, 250)
        out += struct.pack("<qqIIII", 1_000_000, 1_000_000_000, 8, os.getpid(), 2, 1_000_000)
        return self.emit(out + bytes([6]))

    def block(self, name, body):
        out = bytes([5, 5, 1]) + struct.pack("<iii", 2, 2, len(name)) + name + bytes([6])
        out += struct.pack("<i", len(body))
        # The body is aligned to 4 bytes from the start of the stream.
        out += b"\0" * ((4 - (self.written + len(out)) % 4) % 4)
        return self.emit(out + body + bytes([6]))

    def emit(self, data):
        self.written += len(data)
        return data



def metadata_record(metadata_id, fields_tail):
    return struct.pack("<I", metadata_id) + fields_tail


def metadata_flood(conn):
    """Metadata blocks of 32 records, each 256 Int32 fields with 200-character
    names (about 100 KB a record), with new ids, until the reader goes."""
    tail = utf16z("Flood-Provider") + struct.pack("<I", 1) + utf16z("FloodEvent")
    tail += struct.pack("<QIII", 0, 0, 4, 256)
    for field in range(256):
        tail += struct.pack("<I", 9) + utf16z(f"{field:03}" + "n" * 197)
    stream = Nettrace()
    conn.sendall(stream.trace_header())
    next_id = 1
    while True:
        body = bytearray(struct.pack("<HHqq", 20, 1, 0, 2**63 - 1))
        for _ in range(32):
            payload = metadata_record(next_id, tail)
            next_id += 1
            # Flags: payload size present; timestamp delta 0; the size.
            body += b"\x80" + varuint(0) + varuint(len(payload)) + payload
        conn.sendall(stream.block(b"MetadataBlock", bytes(body)))


def answer_like_a_runtime(conn):
    while True:
        header = conn.recv(20, socket.MSG_WAITALL)
        if len(header) < 20 or header[:14] != IPC_MAGIC:
            return
        size, command_set, command_id = struct.unpack("<HBB", header[14:18])
        if size > 20:
            conn.recv(size - 20, socket.MSG_WAITALL)
        if (command_set, command_id) in COLLECT_TRACING:
            conn.sendall(ipc_ok(struct.pack("<Q", 0x5E55)))
            metadata_flood(conn)
        elif (command_set, command_id) == (0x02, 0x01):
            conn.sendall(ipc_ok(struct.pack("<Q", 0x5E55)))
        else:
            conn.sendall(ipc_ok(struct.pack("<I", 0)))


def answer(conn, mode):
    try:
        if mode == "metadata":
            answer_like_a_runtime(conn)
            return
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
