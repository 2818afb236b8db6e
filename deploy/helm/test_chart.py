#!/usr/bin/env python3
"""Tests of the clrbpf Helm chart, run by `cargo xtask test` (and `cargo xtask
chart-test [--update]`) in a venv holding the pinned PyPI packages
helm-python-sdk (Helm's own v4 engine, offline) and kubernetes-validate
(the Kubernetes OpenAPI schemas, offline).

For the default values and each ci/*-values.yaml:
  1. `helm lint --strict` finds nothing;
  2. the render equals the committed golden render in golden/<name>.yaml
     (`--update` rewrites them; review the diff);
  3. every object validates strictly against each Kubernetes version the
     render targets (1.28-1.34; renders for 1.30+ only from 1.30, since the
     AppArmor securityContext field appeared there); ServiceMonitor and
     PodMonitor are Prometheus Operator CRDs without bundled schemas and are
     checked by shape only;
  4. the security invariants hold: hostPID, no privileged container unless
     the values ask for it, capabilities drop ALL and add exactly
     values.yaml's list, allowPrivilegeEscalation false, read-only root
     filesystem, read-only host mounts, NODE_NAME from spec.nodeName;
  5. the pull endpoint is off unless the values turn it on, and then reads
     its token from a Secret mounted read-only (the chart's, with a random
     token: the golden render shows a placeholder for it); the
     NetworkPolicy, when on, opens the agent's port to the listed peers only;
  6. the common settings become the agent's flags (interval, log format,
     off-CPU, CLR events, selection, labels), and values.schema.json refuses
     misspelt keys and values the agent would refuse.
"""

import base64
import re

import sys
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import yaml

HERE = Path(__file__).resolve().parent
CHART = HERE / "clrbpf"
GOLDEN = HERE / "golden"
RELEASE = "clrbpf"
NAMESPACE = "clrbpf"
KUBE_VERSIONS = [f"1.{minor}.0" for minor in range(28, 35)]
CRD_KINDS = {"ServiceMonitor", "PodMonitor"}
PULL_TOKEN_SOURCE = "clrbpf/templates/pull-token.yaml"
# The generated token in golden renders (base64 of "GENERATED TOKEN").
TOKEN_PLACEHOLDER = "R0VORVJBVEVEIFRPS0VO"
TOKEN_LINE = re.compile(r"^(  token: )(\S+)$", re.MULTILINE)


def cases():
    """(name, values) for the defaults and each ci/*-values.yaml."""
    yield "default", {}
    for path in sorted((CHART / "ci").glob("*-values.yaml")):
        yield path.name.removesuffix("-values.yaml"), yaml.safe_load(path.read_text()) or {}


def render(values):
    """The render with the generated token replaced by TOKEN_PLACEHOLDER,
    its notes, and the generated token (None without one)."""
    chart = helm.Chart.load(str(CHART))
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    text = ""
    notes = ""
    token = None
    for path in sorted(manifests):
        body = manifests[path].strip()
        if path.endswith(PULL_TOKEN_SOURCE) and body:
            match = TOKEN_LINE.search(body)
            assert match, f"no token in {path}"
            token = match.group(2)
            body = TOKEN_LINE.sub(lambda m: m.group(1) + TOKEN_PLACEHOLDER, body)
        if path.endswith("NOTES.txt"):
            notes = body + "\n"
        elif body:
            text += f"---\n# Source: {path}\n{body}\n"
    return text, notes, token


def objects(text):
    docs = [d for d in yaml.safe_load_all(text) if d]
    return [d for d in docs if isinstance(d, dict) and "kind" in d]


def lint(name, values):
    kube = values.get("kubeVersionOverride") or None
    report = helm.lint(
        str(CHART), values, strict=True, namespace=NAMESPACE, kube_version=kube and f"v{kube}"
    )
    problems = [m for m in report.get("messages", []) if m.get("severity", 0) >= 2]
    problems += report.get("errors") or []
    assert not problems, f"{name}: helm lint --strict: {problems}"


def validate(name, values, objs):
    override = values.get("kubeVersionOverride")
    floor = tuple(int(p) for p in (override or "1.30.0").split(".")[:2])
    versions = [v for v in KUBE_VERSIONS if tuple(int(p) for p in v.split(".")[:2]) >= floor]
    if override:
        # Written for an old cluster: validate against the versions before 1.30.
        versions = [v for v in versions if tuple(int(p) for p in v.split(".")[:2]) < (1, 30)]
    assert versions, f"{name}: no Kubernetes version to validate against"
    for obj in objs:
        if obj["kind"] in CRD_KINDS:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1", obj
            assert obj["spec"]["selector"]["matchLabels"], obj
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                raise AssertionError(
                    f"{name}: {obj['kind']} {obj['metadata']['name']} is invalid for Kubernetes {version}: {e.message} at {list(e.path)}"
                ) from e
    return versions


def check_security(name, values, objs, capabilities):
    daemonsets = [o for o in objs if o["kind"] == "DaemonSet"]
    assert len(daemonsets) == 1, f"{name}: one DaemonSet"
    pod = daemonsets[0]["spec"]["template"]["spec"]
    assert pod.get("hostPID") is True, f"{name}: hostPID"
    assert not pod.get("hostNetwork"), f"{name}: no hostNetwork"
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True, f"{name}: readOnlyRootFilesystem"
    if values.get("privileged"):
        assert sc["privileged"] is True, f"{name}: privileged opt-in"
    else:
        assert sc["privileged"] is False, f"{name}: not privileged"
        assert sc["allowPrivilegeEscalation"] is False, f"{name}: allowPrivilegeEscalation"
        assert sc["capabilities"]["drop"] == ["ALL"], f"{name}: drop ALL"
        assert sc["capabilities"]["add"] == capabilities, f"{name}: add list is values.yaml's"
        assert sc["seccompProfile"]["type"] in ("Unconfined", "Localhost"), f"{name}: seccomp"
    for o in objs:
        if o is not daemonsets[0] and o["kind"] in ("Pod", "Deployment", "StatefulSet", "DaemonSet"):
            raise AssertionError(f"{name}: unexpected workload {o['kind']}")
    host_volumes = {v["name"] for v in pod["volumes"] if "hostPath" in v}
    for mount in container["volumeMounts"]:
        if mount["name"] in host_volumes and mount["mountPath"] != "/var/lib/clrbpf/profiles":
            assert mount.get("readOnly") is True, f"{name}: host mount {mount['mountPath']} read-only"
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName", name
    for e in env.values():
        assert "value" not in e or "PASSWORD" not in e["name"], f"{name}: credentials come from a Secret"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz", name
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz", name
    assert {"operator": "Exists"} in pod["tolerations"], f"{name}: tolerates every taint"
    check_pull(name, values, objs, container, pod)
    role = [o for o in objs if o["kind"] == "ClusterRole"]
    assert role and role[0]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ], f"{name}: ClusterRole pods get/list/watch only"


def check_pull(name, values, objs, container, pod):
    pull = values.get("pull") or {}
    args = container["args"]
    secrets = [o for o in objs if o["kind"] == "Secret"]
    if not pull.get("enabled"):
        assert "--enable-pull" not in args, f"{name}: the pull endpoint is off by default"
        assert "--http-token-file" not in args, name
        assert not secrets, f"{name}: no token Secret without the pull endpoint"
    else:
        assert "--enable-pull" in args, f"{name}: pull.enabled turns the endpoint on"
        token_file = args[args.index("--http-token-file") + 1]
        mount = next(m for m in container["volumeMounts"] if token_file.startswith(m["mountPath"] + "/"))
        assert mount.get("readOnly") is True, f"{name}: the token is mounted read-only"
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        secret_name = volume["secret"]["secretName"]
        if pull.get("existingSecret"):
            assert secret_name == pull["existingSecret"], name
            assert not secrets, f"{name}: no Secret of the chart's own with an existing one"
        else:
            (secret,) = secrets
            assert secret["metadata"]["name"] == secret_name, name
            assert set(secret["data"]) == {"token"}, name
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    network = values.get("networkPolicy") or {}
    assert len(policies) == (1 if network.get("enabled") else 0), f"{name}: NetworkPolicy"
    for policy in policies:
        selector = policy["spec"]["podSelector"]["matchLabels"]
        assert selector == pod_labels(objs, selector), f"{name}: the policy selects the agent's pods"
        assert policy["spec"]["policyTypes"] == ["Ingress"], name
        for rule in policy["spec"]["ingress"]:
            assert rule["from"], f"{name}: every rule names its peers"
            assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}], name
        if not network.get("from"):
            assert policy["spec"]["ingress"] == [], f"{name}: no peer, no ingress"


def pod_labels(objs, selector):
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    return {k: labels[k] for k in selector if k in labels}


def check_generated_token(name, values, token):
    """A chart-made token is 48 random characters, new at each render of a
    new release."""
    pull = values.get("pull") or {}
    if not pull.get("enabled") or pull.get("existingSecret"):
        assert token is None, name
        return
    decoded = base64.b64decode(token, validate=True).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", decoded), f"{name}: generated token {len(decoded)} characters"
    assert render(values)[2] != token, f"{name}: the generated token is random"


def daemonset(objs):
    return next(o for o in objs if o["kind"] == "DaemonSet")


def agent_args(objs):
    return daemonset(objs)["spec"]["template"]["spec"]["containers"][0]["args"]


def flag_values(args, flag):
    return [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == flag]


def check_settings(name, values, objs):
    """The agent's flags follow the values."""
    agent = {**{"logFormat": "json", "uploadInterval": "15s", "offCpu": False,
                "clrEvents": ["contention", "exceptions", "waits"]},
             **(values.get("agent") or {})}
    selection = values.get("selection") or {}
    args = agent_args(objs)
    assert flag_values(args, "--log-format") == [agent["logFormat"]], f"{name}: {args}"
    assert flag_values(args, "--upload-interval") == [str(agent["uploadInterval"])], f"{name}: {args}"
    assert ("--off-cpu" in args) == agent["offCpu"], f"{name}: {args}"
    if agent["clrEvents"]:
        assert flag_values(args, "--clr-events") == [",".join(agent["clrEvents"])], f"{name}: {args}"
    else:
        assert "--no-clr-events" in args, f"{name}: {args}"
    assert flag_values(args, "--k8s-namespace") == selection.get("namespaces", []), f"{name}: {args}"
    assert flag_values(args, "--exe") == selection.get("executables", []), f"{name}: {args}"
    labels = values.get("labels") or {}
    assert flag_values(args, "--label") == [f"{k}={v}" for k, v in sorted(labels.items())], f"{name}: {args}"
    symbols = values.get("symbols") or {}
    servers = symbols.get("symbolServers", [])
    debuginfod = symbols.get("debuginfodUrls", [])
    assert flag_values(args, "--symbol-server") == servers, f"{name}: {args}"
    assert flag_values(args, "--debuginfod-url") == debuginfod, f"{name}: {args}"
    cache_mb = symbols.get("cacheSizeMB", 1024)
    downloads = bool(servers or debuginfod)
    assert flag_values(args, "--symbol-cache-mb") == ([str(cache_mb)] if downloads else []), f"{name}: {args}"
    # The cache volume holds the unwind tables (320Mi) and the debug files.
    volumes = daemonset(objs)["spec"]["template"]["spec"]["volumes"]
    cache = next(v for v in volumes if v["name"] == "cache")
    want = f"{320 + cache_mb}Mi" if downloads else "320Mi"
    assert cache["emptyDir"]["sizeLimit"] == want, f"{name}: cache volume {cache}"


SCHEMA_REFUSES = [
    {"agent": {"logFormat": "xml"}},
    {"agent": {"uploadInterval": "soon"}},
    {"agent": {"uploadInterval": 2}},
    {"agent": {"clrEvents": ["gc"]}},
    {"agent": {"offCpu": "yes"}},
    {"agent": {"frequncy": 19}},
    {"selection": {"namespaces": ["Not_A_Namespace"]}},
    {"selection": {"pods": ["x"]}},
    {"sinks": {"pyroscope": {"url": "pyroscope:4040"}}},
    {"labels": {"Cluster": "x"}},
    {"labels": {"service_name": "x"}},
    {"labels": {"k8s.pod.name": "x"}},
    {"labels": {"cluster": ""}},
    {"labels": {f"l{i}": "x" for i in range(17)}},
    {"symbols": {"symbolServers": ["msdl.microsoft.com/download/symbols"]}},
    {"symbols": {"cacheSizeMB": 0}},
]


def check_schema():
    """Each of SCHEMA_REFUSES is refused at render, naming the value."""
    chart = helm.Chart.load(str(CHART))
    for values in SCHEMA_REFUSES:
        try:
            chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
        except Exception as e:  # the SDK raises its own error type
            assert "schema" in str(e), f"{values}: {e}"
            continue
        raise AssertionError(f"values.schema.json accepts {values}")
    print(f"chart schema: {len(SCHEMA_REFUSES)} bad values refused")


def main():
    update = "--update" in sys.argv[1:]
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    capabilities = defaults["securityContext"]["capabilities"]["add"]
    GOLDEN.mkdir(exist_ok=True)
    failures = []
    for name, values in cases():
        try:
            lint(name, values)
            text, notes, token = render(values)
            check_generated_token(name, values, token)
            for golden, rendered in ((GOLDEN / f"{name}.yaml", text), (GOLDEN / f"{name}.NOTES.txt", notes)):
                if update:
                    golden.write_text(rendered)
                    continue
                assert golden.exists(), f"{name}: no golden render {golden} (run `cargo xtask chart-test --update`)"
                assert rendered == golden.read_text(), (
                    f"{name}: render differs from {golden}; run `cargo xtask chart-test --update` and review the diff"
                )
            assert "kubectl" in notes, f"{name}: NOTES.txt says how to check the install"
            objs = objects(text)
            versions = validate(name, values, objs)
            check_security(name, values, objs, capabilities)
            check_settings(name, values, objs)
            print(f"chart {name}: lint ok, golden ok, {len(objs)} objects valid for Kubernetes {versions[0]}..{versions[-1]}, security invariants ok")
        except AssertionError as e:
            failures.append(str(e))
            print(f"chart {name}: FAILED: {e}", file=sys.stderr)
    try:
        check_schema()
    except AssertionError as e:
        failures.append(str(e))
        print(f"chart schema: FAILED: {e}", file=sys.stderr)
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
