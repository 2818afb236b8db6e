# syntax=docker/dockerfile:1
# The clrbpf image the Helm chart (deploy/helm/clrbpf) runs, made of the
# release binary: `cargo xtask dist` builds the static clrbpf (musl, eBPF
# object embedded), stages it with the CA bundle in target/dist/image-context
# and builds this file there with buildah. By hand, after `cargo xtask dist`:
#   docker build -f Dockerfile -t ghcr.io/clrbpf/clrbpf:0.1.0 target/dist/image-context
# The binary needs no libc, so the image holds nothing else: no shell, no
# package manager. The agent runs as uid 0 with the capabilities the chart
# adds (see values.yaml); the chart mounts an emptyDir at /tmp.

FROM scratch
# rustls reads the roots for the HTTPS sinks from here.
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY tmp /tmp
COPY clrbpf /usr/bin/clrbpf
ENTRYPOINT ["/usr/bin/clrbpf"]
CMD ["agent", "--listen", "0.0.0.0:7071"]
