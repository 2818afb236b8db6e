# syntax=docker/dockerfile:1
# The clrbpf image the Helm chart (deploy/helm/clrbpf) runs:
#   docker build -t ghcr.io/clrbpf/clrbpf:0.1.0 .
# Stage 1 builds the binary with its eBPF object embedded (nightly rust-src
# and bpf-linker for the eBPF crate, stable for the rest, as
# `cargo xtask setup` + `cargo xtask build` do); stage 2 is a slim runtime
# with only glibc, libgcc and CA certificates.

FROM rust:1-bookworm AS build
# The eBPF object: nightly's rust-src (build-std for bpfel-unknown-none) and
# bpf-linker built against the nightly's own LLVM (DESIGN.md, verified).
RUN rustup toolchain install nightly --profile minimal --component rust-src
RUN set -eu; \
    NL="$(rustc +nightly --print sysroot)/lib"; \
    LLVM="$(basename "$(ls "$NL"/libLLVM-*.so | head -n 1)" .so | sed 's/^lib//')"; \
    MAJOR="$(rustc +nightly -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')"; \
    RUSTFLAGS="-L $NL -l dylib=$LLVM -C link-arg=-Wl,-rpath,$NL" \
      cargo +nightly install bpf-linker --version 0.13.0 --locked \
        --no-default-features --features "llvm-$MAJOR,no-llvm-linking"
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked --package clrbpf \
    && install -D -m 0755 target/release/clrbpf /out/clrbpf

# glibc + libgcc_s (all the binary links: `ldd target/release/clrbpf`) and
# CA certificates for HTTPS sinks; no shell, no package manager. The agent
# runs as uid 0 with the capabilities the chart adds (see values.yaml).
FROM gcr.io/distroless/cc-debian12
COPY --from=build /out/clrbpf /usr/bin/clrbpf
ENTRYPOINT ["/usr/bin/clrbpf"]
CMD ["agent", "--listen", "0.0.0.0:7071"]
