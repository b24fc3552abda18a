"""deploy/kubernetes/*.yaml checked against each other and against the kiln binary: every flag
the Deployment passes is one `kiln serve --help` lists, the probes and the Service hit the
ports those flags open, the grace period covers the preStop sleep and the drain, and the
Service, PodDisruptionBudget and InferencePool select the Deployment's pods.

Usage: deploy_manifests.py KILN_BINARY"""

import pathlib
import re
import subprocess
import sys

import yaml

kiln = sys.argv[1]
root = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
docs = [d for f in sorted(root.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
by_kind = {}
for d in docs:
    by_kind.setdefault(d["kind"], []).append(d)
for kind in ("Deployment", "Service", "PodDisruptionBudget", "InferencePool"):
    assert len(by_kind.get(kind, [])) == 1, f"one {kind} expected: {by_kind.get(kind)}"
(deploy,) = by_kind["Deployment"]
pod = deploy["spec"]["template"]
labels = pod["metadata"]["labels"]
assert deploy["spec"]["selector"]["matchLabels"].items() <= labels.items()
(c,) = pod["spec"]["containers"]
args = c["args"]
assert args[0] == "serve", args

help_text = subprocess.run([kiln, "serve", "--help"], capture_output=True, text=True, check=True).stdout
known = set(re.findall(r"(--[a-z0-9-]+)", help_text))
flags = {}
for a in args[1:]:
    name, _, value = a.partition("=")
    assert name in known, f"{name} is not a `kiln serve` flag"
    flags[name] = value
ports = {p["name"]: p["containerPort"] for p in c["ports"]}


def port_of(flag):
    return int(flags[flag].rsplit(":", 1)[1])


assert ports["grpc"] == port_of("--listen")
assert ports["http"] == port_of("--http-listen")
assert ports["metrics"] == port_of("--metrics-listen")
for flag in ("--listen", "--http-listen", "--metrics-listen"):
    assert flags[flag].startswith("0.0.0.0:"), f"{flag} must listen beyond the pod's loopback"


def probe_port(p):
    port = p.get("httpGet", p.get("grpc", {})).get("port")
    return ports[port] if isinstance(port, str) else port


assert c["readinessProbe"]["grpc"]["port"] == ports["grpc"], "readiness: grpc.health.v1"
for probe in ("livenessProbe", "startupProbe"):
    p = c[probe]
    assert p["httpGet"]["path"] == "/health" and probe_port(p) == ports["http"], probe
sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
drain = float(flags["--drain-timeout"])
grace = pod["spec"]["terminationGracePeriodSeconds"]
assert grace >= sleep + drain + 5, f"grace {grace} s < preStop {sleep} s + drain {drain} s + 5"

(svc,) = by_kind["Service"]
assert svc["spec"]["selector"].items() <= labels.items()
for p in svc["spec"]["ports"]:
    assert p["targetPort"] in ports, p
(pdb,) = by_kind["PodDisruptionBudget"]
assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
assert deploy["spec"]["replicas"] > pdb["spec"]["maxUnavailable"]
(pool,) = by_kind["InferencePool"]
assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports["http"]]
print(f"deploy/kubernetes: {len(docs)} objects consistent; {len(flags)} serve flags known to {kiln}")
