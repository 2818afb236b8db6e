#!/bin/sh
# Rebuilds Names.dll, the metadata test assembly (Debian's mono-mcs).
set -e
cd "$(dirname "$0")"
mcs -target:library -out:Names.dll Names.cs
