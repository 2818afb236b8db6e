#!/bin/sh
# Builds chain.c (next to this script) into $1 without frame pointers, with
# its symbol table (the replay tests name frames with it).
set -eu
exec gcc -O2 -fomit-frame-pointer -fno-optimize-sibling-calls -o "$1" "$(dirname "$0")/chain.c"
