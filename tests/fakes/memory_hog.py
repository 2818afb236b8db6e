#!/usr/bin/env python3
"""An unprivileged process that tries to make a profiler use gigabytes.

argv[1] is the attack, argv[2] its size, argv[3] how many seconds to live:

  maps MB     maps one page of a file with a path of about 4 KB again and
              again, until its /proc/PID/maps is about MB megabytes (every
              line repeats the path);
  sparse GIB  maps executable a sparse file of GIB GiB that starts with
              `MZ` (a PE image to a profiler; nothing on disk).

It then spins on the CPU (so a whole-host profiler samples it), printing PID
and READY like the C# workloads first. Its files are removed once mapped.
"""

import ctypes
import mmap
import os
import shutil
import sys
import tempfile
import time

PAGE = mmap.PAGESIZE


def long_path_file(workdir):
    """A one-page file whose path is just under PATH_MAX (4096)."""
    path = workdir
    while len(path) < 3800:
        path = os.path.join(path, "d" * 200)
        os.mkdir(path)
    path = os.path.join(path, "f" * min(250, 4000 - len(path)))
    with open(path, "wb") as f:
        f.write(b"\0" * PAGE)
    return path


def map_many(path, megabytes):
    # Python's mmap keeps a descriptor per mapping: call mmap(2) itself.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    fd = os.open(path, os.O_RDONLY)
    # One maps line: the path and about 75 bytes of fields.
    lines = megabytes * 1_000_000 // (len(path) + 75)
    maps = []
    for _ in range(lines):
        addr = libc.mmap(None, PAGE, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        maps.append(addr)
    os.close(fd)
    return maps


def map_sparse(workdir, gib):
    path = os.path.join(workdir, "sparse.dll")
    size = gib << 30
    with open(path, "wb") as f:
        f.write(b"MZ")
        f.truncate(size)
    fd = os.open(path, os.O_RDONLY)
    mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ | mmap.PROT_EXEC)
    os.close(fd)
    return [mapping]


def main():
    attack, size, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    workdir = tempfile.mkdtemp(prefix="memory-hog-")
    try:
        if attack == "maps":
            held = map_many(long_path_file(workdir), size)
        elif attack == "sparse":
            held = map_sparse(workdir, size)
        else:
            sys.exit(f"unknown attack {attack}")
        # The mappings keep the files; a test ends this process with
        # SIGKILL, which runs no cleanup. (Their maps lines end in
        # " (deleted)", which changes nothing for the attack.)
        shutil.rmtree(workdir, ignore_errors=True)
        print(f"PID {os.getpid()}", flush=True)
        print(f"MAPPINGS {len(held)}", flush=True)
        print("READY", flush=True)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
