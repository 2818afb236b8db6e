#!/bin/sh
# Builds chain.c (next to this script) into $1 without frame pointers, with
# its symbol table (the replay tests name frames with it). Further arguments
# go to gcc (the .debug_frame test adds -g -fno-asynchronous-unwind-tables).
set -eu
out=$1
shift
exec gcc -O2 -fomit-frame-pointer -fno-optimize-sibling-calls -o "$out" "$(dirname "$0")/chain.c" "$@"
