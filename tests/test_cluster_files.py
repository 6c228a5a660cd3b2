"""Cluster recipes that cannot run on this machine are validated offline, and every launch script is linted.

Kubernetes objects go through the official client's models (required fields, types); the hub's
config keys must be real traits of the installed JupyterHub, OAuthenticator and KubeSpawner.
"""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "cluster"
K8S = CLUSTER / "k8s" / "base"
OVERLAY = CLUSTER / "k8s" / "overlays" / "cpu"
HUB = CLUSTER / "jupyterhub"
SCRIPTS = sorted([*CLUSTER.rglob("*.sh"), *CLUSTER.rglob("*.sbatch")])


def _deserialize(doc: dict, kind: str):
    from kubernetes.client import ApiClient

    # the client's own decoder: raises on a missing required field or a wrongly typed one
    return ApiClient()._ApiClient__deserialize(doc, kind)


def _kustomization(path: Path) -> dict:
    return yaml.safe_load((path / "kustomization.yaml").read_text())


def test_kubernetes_manifests_are_valid_objects():
    kinds = {"Job": "V1Job", "Service": "V1Service", "PersistentVolumeClaim": "V1PersistentVolumeClaim"}
    base = _kustomization(K8S)
    seen = {}
    for res in base["resources"]:
        doc = yaml.safe_load((K8S / res).read_text())
        obj = _deserialize(doc, kinds[doc["kind"]])
        assert obj.metadata.name, res
        seen[doc["kind"]] = obj
    job, svc = seen["Job"], seen["Service"]
    assert job.spec.completion_mode == "Indexed" and job.spec.completions == job.spec.parallelism
    pod = job.spec.template.spec
    assert pod.subdomain == svc.metadata.name and svc.spec.cluster_ip == "None"
    assert svc.spec.selector == {"job-name": job.metadata.name}
    claim = next(v for v in pod.volumes if v.persistent_volume_claim).persistent_volume_claim.claim_name
    assert claim == seen["PersistentVolumeClaim"].metadata.name
    assert "ReadWriteMany" in seen["PersistentVolumeClaim"].spec.access_modes
    assert pod.termination_grace_period_seconds > 60  # time to finish a step and save


def test_job_variables_are_all_defined_and_the_rendezvous_is_pod_zero():
    base = _kustomization(K8S)
    literals = dict(l.split("=", 1) for l in base["configMapGenerator"][0]["literals"])
    job = yaml.safe_load((K8S / "job.yaml").read_text())
    c = job["spec"]["template"]["spec"]["containers"][0]
    used = set(re.findall(r"\$\((\w+)\)", " ".join(c["command"] + c["args"])))
    assert used <= set(literals) | {e["name"] for e in c.get("env", [])}, used - set(literals)
    assert int(literals["NNODES"]) == job["spec"]["completions"]
    assert f"--rdzv-endpoint={job['metadata']['name']}-0.{job['spec']['template']['spec']['subdomain']}:29500" in c["args"]
    assert c["image"] in {i["name"] for i in base["images"]}
    # the entry point's flags exist
    from labkit.train import build_parser

    flags = {a for action in build_parser()._actions for a in action.option_strings}
    for arg in c["args"][c["args"].index("labkit.train") + 1:]:
        assert arg.split("=")[0] in flags, arg


def test_cpu_overlay_only_changes_known_keys():
    base, cpu = _kustomization(K8S), _kustomization(OVERLAY)
    assert all((OVERLAY / r / "kustomization.yaml").is_file() for r in cpu["resources"])
    keys = {l.split("=", 1)[0] for l in base["configMapGenerator"][0]["literals"]}
    gen = cpu["configMapGenerator"][0]
    assert gen["behavior"] == "merge" and gen["name"] == base["configMapGenerator"][0]["name"]
    assert {l.split("=", 1)[0] for l in gen["literals"]} <= keys
    job = yaml.safe_load((K8S / "job.yaml").read_text())
    for p in cpu["patches"]:
        for op in yaml.safe_load(p["patch"]):
            node = job
            for part in op["path"].strip("/").split("/"):
                node = node[int(part)] if isinstance(node, list) else node[part]  # the path exists
            if op["path"].endswith("/resources"):
                from kubernetes.client import V1ResourceRequirements

                assert isinstance(_deserialize(op["value"], "V1ResourceRequirements"), V1ResourceRequirements)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed (kustomize is built into it)")
@pytest.mark.parametrize("where", [K8S, OVERLAY], ids=["base", "overlays/cpu"])
def test_kustomize_builds_valid_objects(where):
    out = subprocess.run(["kubectl", "kustomize", str(where)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = {d["kind"]: d for d in yaml.safe_load_all(out.stdout)}
    assert set(docs) == {"ConfigMap", "Service", "PersistentVolumeClaim", "Job"}
    job = _deserialize(docs["Job"], "V1Job")
    c = job.spec.template.spec.containers[0]
    cm = docs["ConfigMap"]["data"]
    assert c.env_from[0].config_map_ref.name == docs["ConfigMap"]["metadata"]["name"]  # the generated hash name
    assert set(re.findall(r"\$\((\w+)\)", " ".join(c.command + c.args))) <= set(cm) | {e.name for e in c.env}
    assert c.image.startswith("ghcr.io/training-at-scale/labkit")
    grace = job.spec.template.spec.termination_grace_period_seconds
    assert float(cm["GRACE_S"]) < float(cm["SHUTDOWN_TIMEOUT"]) < grace  # save, then torchrun, then the kubelet
    if where == OVERLAY:
        assert cm["DEVICE"] == "cpu" and "nvidia.com/gpu" not in (c.resources.limits or {})


def test_jupyterhub_values_use_real_traits_and_a_real_authenticator():
    from jupyterhub.app import JupyterHub
    from jupyterhub.auth import Authenticator
    from kubespawner import KubeSpawner
    from oauthenticator.github import GitHubOAuthenticator

    values = yaml.safe_load((HUB / "values.yaml").read_text())
    config = values["hub"]["config"]
    classes = {"JupyterHub": JupyterHub, "GitHubOAuthenticator": GitHubOAuthenticator, "Authenticator": Authenticator}
    for cls_name, traits in config.items():
        unknown = set(traits) - set(classes[cls_name].class_trait_names())
        assert not unknown, f"{cls_name}: {unknown}"
    assert config["JupyterHub"]["authenticator_class"] not in ("dummy", "null", "nativeauthenticator")
    assert not config["GitHubOAuthenticator"].get("allow_all") and config["GitHubOAuthenticator"]["allowed_organizations"]
    assert "client_secret" not in config["GitHubOAuthenticator"]  # secrets live in a separate values file
    profiles = values["singleuser"]["profileList"]
    assert {p["slug"] for p in profiles} == {"cpu", "gpu"}
    for p in profiles:
        unknown = set(p["kubespawner_override"]) - set(KubeSpawner.class_trait_names())
        assert not unknown, f"profile {p['slug']}: {unknown}"
    gpu = next(p for p in profiles if p["slug"] == "gpu")["kubespawner_override"]
    assert gpu["extra_resource_limits"]["nvidia.com/gpu"] == "1" and gpu["environment"]["LABKIT_DEVICE"] == "cuda"
    pull = values["singleuser"]["lifecycleHooks"]["postStart"]["exec"]["command"]
    assert pull[0] == "gitpuller" and shutil.which("gitpuller", path=str(Path(sys.executable).parent))


def test_image_installs_exactly_the_projects_requirements():
    docker = (HUB / "Dockerfile").read_text()
    assert "COPY requirements.txt" in docker and "-r requirements.txt" in docker
    assert "grep -E '^torch==' requirements.txt" in docker  # the pinned torch, not whatever is newest
    reqs = {l.split("==")[0].lower() for l in (ROOT / "requirements.txt").read_text().splitlines()}
    assert {"jupyterhub", "nbgitpuller", "jupyterhub-kubespawner", "oauthenticator"} <= reqs
    values = yaml.safe_load((HUB / "values.yaml").read_text())
    image = values["singleuser"]["image"]["name"]
    assert image == _kustomization(K8S)["images"][0]["newName"]  # hub and training pods: one image
    assert re.search(r"-t " + re.escape(image), docker)



@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_launch_script_lint(script):
    text = script.read_text()
    lines = text.splitlines()
    assert lines[0] == "#!/usr/bin/env bash", "a portable shebang"
    # Slurm reads #SBATCH only before the first command, and ignores "# SBATCH" silently
    assert not re.search(r"^#\s+SBATCH|^##+SBATCH|^#sbatch", text, re.M), "a disabled #SBATCH directive"
    first_cmd = next(i for i, l in enumerate(lines) if l.strip() and not l.startswith("#"))
    assert not [l for l in lines[first_cmd:] if l.startswith("#SBATCH")], "#SBATCH after the first command"
    # (the directives themselves go through Slurm's own parser in tests/test_slurm.py: sbatch --test-only)
    for path in re.findall(r"(?<![\w/])(cluster/[\w./-]+\.(?:sh|sbatch|yaml))", text):
        assert (ROOT / path).is_file(), f"{path} is referenced but does not exist"
    for mod in re.findall(r"-m (labkit(?:\.\w+)*)", text):
        assert (ROOT / (mod.replace(".", "/") + ".py")).is_file() or (ROOT / mod.replace(".", "/")).is_dir(), mod


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed; .ci/run installs it")
def test_launch_scripts_are_shellcheck_clean():
    out = subprocess.run(["shellcheck", "--shell=bash", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def _run(script: str, **env) -> subprocess.CompletedProcess:
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LAB", "PROFILE", "STRATEGY"))}
    return subprocess.run(["bash", str(CLUSTER / "slurm" / script)], env={**base, **env}, capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


def test_lab_and_deepspeed_scripts_stop_early_naming_what_is_missing():
    out = _run("lab.sbatch")
    assert out.returncode == 2 and "LAB is not set" in out.stderr
    out = _run("lab.sbatch", LAB="data_parallel", PROFILE="huge", PYTHON=sys.executable)
    assert out.returncode == 1 and "PROFILE='huge' is unknown for lab 'data_parallel'; valid profiles" in out.stderr
    out = _run("deepspeed.sbatch", STRATEGY="ddp")
    assert out.returncode == 2 and "STRATEGY=ddp is not a DeepSpeed strategy; valid: zero1, zero2, zero3" in out.stderr
