"""Cluster recipes that cannot run on this machine are validated offline, and every launch script is linted.

Kubernetes objects go through the official client's models (required fields, types); the hub's
config keys must be real traits of the installed JupyterHub, OAuthenticator and KubeSpawner.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import jupytext
import pytest
import yaml

from labkit.labs import PROFILES
from labkit.train.strategies import STRATEGIES
from labkit.train import TrainConfig
from labkit.train.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "cluster"
K8S = CLUSTER / "k8s" / "base"
OVERLAY = CLUSTER / "k8s" / "overlays" / "cpu"
OVERLAYS = sorted(p for p in (CLUSTER / "k8s" / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
HUB = CLUSTER / "jupyterhub"
SCRIPTS = sorted([*CLUSTER.rglob("*.sh"), *CLUSTER.rglob("*.sbatch")])
# a path into the repository, also behind a variable ("$ROOT/cluster/slurm/train.sbatch"), but not
# inside some other absolute path (/opt/cluster/x.sh)
REPO_PATH = re.compile(r"""(?:\$\{?\w+\}?"?/|(?<![\w/$]))(cluster/[\w./-]+\.(?:sh|sbatch|yaml))""")


def _deserialize(doc: dict, kind: str):
    from kubernetes.client import ApiClient

    # the client's own decoder: raises on a missing required field or a wrongly typed one
    return ApiClient()._ApiClient__deserialize(doc, kind)


def _kustomization(path: Path) -> dict:
    return yaml.safe_load((path / "kustomization.yaml").read_text())


def _apply(doc: dict, op: dict) -> None:
    """One JSON-patch ``add`` or ``replace``, the only ops these overlays use."""
    *parents, last = op["path"].strip("/").split("/")
    node = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    assert op["op"] in ("add", "replace"), op
    if isinstance(node, list):
        node[int(last)] = op["value"]
    else:
        assert op["op"] == "add" or last in node, f"{op['path']} does not exist"
        node[last] = op["value"]


def _build(where: Path, kust: dict | None = None) -> tuple[dict, dict]:
    """(the ConfigMap's literals, the Job) of a kustomization, its bases and patches applied: enough of
    kustomize for these files, so the checks run where kubectl is not installed."""
    kust = kust or _kustomization(where)
    literals, job = {}, None
    for res in kust.get("resources", []):
        path = Path(os.path.normpath(where / res))
        if path.is_dir():
            base_literals, job = _build(path)
            literals.update(base_literals)
        elif (doc := yaml.safe_load(path.read_text()))["kind"] == "Job":
            job = doc
    for gen in kust.get("configMapGenerator", []):
        literals.update(l.split("=", 1) for l in gen["literals"])
    for patch in kust.get("patches", []):
        if patch["target"]["kind"] == "Job":
            for op in yaml.safe_load(patch["patch"]):
                _apply(job, op)
    return literals, job


def _container(job: dict) -> dict:
    return job["spec"]["template"]["spec"]["containers"][0]


def _job_script(job: dict) -> str:
    c = _container(job)
    assert c["command"] == ["bash", "-c"] and len(c["args"]) == 1, "the container runs one bash script"
    return c["args"][0]


def _rejects_checkpoints(strategy: str) -> bool:
    """Whether labkit.train refuses a checkpoint directory with this strategy (asked, not assumed)."""
    try:
        TrainConfig(strategy=strategy, checkpoint_dir="ckpt")
    except ValueError:
        return True
    return False


def _check_train_argv(argv: list[str], strategy: str, stdout: str, ckpt: str) -> TrainConfig:
    """The flags a recipe gives ``-m labkit.train``, through the entry point's own parser and checks."""
    args = vars(build_parser().parse_args(argv[argv.index("labkit.train") + 1:]))
    cfg = TrainConfig(**{f.name: args[f.name] for f in fields(TrainConfig) if f.name in args})
    assert cfg.strategy == strategy
    if _rejects_checkpoints(strategy):
        assert cfg.checkpoint_dir is None and "not checkpointed" in stdout and "step 0" in stdout, stdout
    else:
        assert cfg.checkpoint_dir == ckpt and "not checkpointed" not in stdout, stdout
    return cfg


# Stand-ins for Slurm's commands and for python: they record the command line a recipe builds.
STUBS = {
    "scontrol": 'case "$1 $2" in\n  "show hostnames") printf "n1\\nn2\\n" ;;\n'
                '  "show node") echo "NodeName=$3 NodeAddr=10.0.0.1 State=IDLE" ;;\n  *) exit 1 ;;\nesac\n',
    "srun": 'printf "%s\\n" "$@" > "$ARGV_OUT"\n',
    "python": '[ "$1" = -c ] && exit 0\n[ "$1 $2" = "-m labkit" ] && exec "$REAL_PYTHON" "$@"\n'
              'case " $* " in *" --can-checkpoint "*) exec "$REAL_PYTHON" "$@" ;; esac\n'
              'printf "%s\\n" "$@" > "$ARGV_OUT"\n',
}
# what the recipes read from the environment: never from the caller's
SCRIPT_VARS = {"CKPT_DIR", "DEVICE", "NPROC_PER_NODE", "STRATEGY", "STEPS", "SEED", "BATCH_SIZE", "SAVE_EVERY",
               "GRACE_S", "METRICS", "PYTHON", "LABKIT_ROOT", "MAX_RESTARTS", "LAB", "PROFILE", "OUT_DIR",
               "CUDA_VISIBLE_DEVICES", "LABKIT_LISTEN_PORTS"}


def _env(**env) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in SCRIPT_VARS}
    return {**base, **env}


def _stubbed(cmd: list[str], tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run a recipe with the stubs first on PATH; return the result and the command line it started."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    for name, body in STUBS.items():
        (stubs / name).write_text("#!/usr/bin/env bash\n" + body)
        (stubs / name).chmod(0o755)
    argv_out = tmp_path / "argv"
    env = _env(**{"PATH": f"{stubs}:{os.environ['PATH']}", "ARGV_OUT": str(argv_out),
                  "REAL_PYTHON": sys.executable, **env})
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=60)
    return out, (argv_out.read_text().splitlines() if argv_out.exists() else [])


def _sbatch(script: str, tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, list[str]]:
    """A batch script inside a pretend two-node allocation (n1, n2), with stub srun and scontrol."""
    job = dict(SLURM_JOB_ID="7", SLURM_JOB_NODELIST="n[1-2]", SLURM_JOB_NUM_NODES="2",
               CKPT_DIR=str(tmp_path / "ckpt"), DEVICE="cpu", PYTHON=str(tmp_path / "bin" / "python"),
               LABKIT_ROOT=str(ROOT))
    return _stubbed(["bash", str(CLUSTER / "slurm" / script)], tmp_path, **{**job, **env})


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
    literals, job = _build(K8S)
    c = _container(job)
    script = _job_script(job)
    # Kubernetes expands $(VAR) in command and args, and turns $$ into $, before bash sees them
    assert "$(" not in script and "$$" not in script
    used = set(re.findall(r"\$\{?([A-Za-z_]\w*)", script))
    assert used <= set(literals) | {e["name"] for e in c.get("env", [])}, used - set(literals)
    assert f"--rdzv-endpoint={job['metadata']['name']}-0.{job['spec']['template']['spec']['subdomain']}:29500" in script
    assert c["image"] in {i["name"] for i in base["images"]}
    # training talks to no Kubernetes API: its pods get no service-account token
    assert job["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed; .ci/run installs it")
def test_job_script_is_shellcheck_clean():
    out = subprocess.run(["shellcheck", "--shell=bash", "-"], input=_job_script(_build(K8S)[1]),
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


# The recipes relay what `python -m labkit.train --strategy S --can-checkpoint` answers; one strategy of
# each kind of answer goes through a recipe here (a subprocess that imports torch each time), and
# test_every_strategys_can_checkpoint_answer_is_the_registrys holds the answer for every strategy.
RECIPE_STRATEGIES = ["ddp", "zero3", "tp_scratch", "ep"]


def test_every_strategys_can_checkpoint_answer_is_the_registrys(capsys):
    from labkit.train.cli import main as train_main

    for name in STRATEGIES:
        assert train_main(["--strategy", name, "--can-checkpoint"]) == 0
        out = capsys.readouterr().out.strip()
        assert (out == "yes") == (not _rejects_checkpoints(name)), (name, out)
        assert out == "yes" or out.startswith("no: ") and len(out) > 10, (name, out)
    kinds = {_rejects_checkpoints(s) for s in RECIPE_STRATEGIES}
    assert kinds == {True, False} and any(STRATEGIES[s].deepspeed for s in RECIPE_STRATEGIES)


@pytest.mark.parametrize("strategy", RECIPE_STRATEGIES)
def test_job_passes_checkpoint_flags_only_where_labkit_can_checkpoint(strategy, tmp_path):
    literals, job = _build(K8S)
    env = {**literals, **{e["name"]: e["value"] for e in _container(job).get("env", [])},
           "DEVICE": "cpu", "STRATEGY": strategy}  # cpu: TrainConfig checks the device exists
    out, argv = _stubbed(["bash", "-c", _job_script(job)], tmp_path, **env)
    assert out.returncode == 0 and argv[:2] == ["-m", "labkit.launch.torchrun"], out.stderr
    assert f"--nnodes={literals['NNODES']}" in argv
    _check_train_argv(argv, strategy, out.stdout, ckpt=f"/ckpt/{literals['RUN_NAME']}")


@pytest.mark.parametrize("where", [K8S, *OVERLAYS], ids=lambda p: str(p.relative_to(CLUSTER / "k8s")))
def test_nnodes_matches_the_jobs_pod_count(where):
    # torchrun waits for NNODES agents; the Job starts `completions` pods, `parallelism` at a time
    literals, job = _build(where)
    assert int(literals["NNODES"]) == job["spec"]["completions"] == job["spec"]["parallelism"]


def test_the_books_own_overlay_changes_nnodes_with_the_pod_count():
    book = (ROOT / "book" / "clusters.md").read_text()
    example = next(b for b in re.findall(r"```yaml\n(.*?)```", book, re.S) if "my-run/kustomization.yaml" in b)
    literals, job = _build(ROOT / "my-run", yaml.safe_load(example))
    assert int(literals["NNODES"]) == job["spec"]["completions"] == job["spec"]["parallelism"] == 4


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlay_only_changes_known_keys(overlay):
    base, cpu = _kustomization(K8S), _kustomization(overlay)
    assert all((overlay / r / "kustomization.yaml").is_file() for r in cpu["resources"])
    keys = {l.split("=", 1)[0] for l in base["configMapGenerator"][0]["literals"]}
    gen = cpu["configMapGenerator"][0]
    assert gen["behavior"] == "merge" and gen["name"] == base["configMapGenerator"][0]["name"]
    assert {l.split("=", 1)[0] for l in gen["literals"]} <= keys
    job = yaml.safe_load((K8S / "job.yaml").read_text())
    for p in cpu.get("patches", []):
        for op in yaml.safe_load(p["patch"]):
            node = job
            for part in op["path"].strip("/").split("/"):
                node = node[int(part)] if isinstance(node, list) else node[part]  # the path exists
            if op["path"].endswith("/resources"):
                from kubernetes.client import V1ResourceRequirements

                assert isinstance(_deserialize(op["value"], "V1ResourceRequirements"), V1ResourceRequirements)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed (kustomize is built into it)")
@pytest.mark.parametrize("where", [K8S, *OVERLAYS], ids=lambda p: str(p.relative_to(CLUSTER / "k8s")))
def test_kustomize_builds_valid_objects(where):
    out = subprocess.run(["kubectl", "kustomize", str(where)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = {d["kind"]: d for d in yaml.safe_load_all(out.stdout)}
    assert set(docs) == {"ConfigMap", "Service", "PersistentVolumeClaim", "Job"}
    job = _deserialize(docs["Job"], "V1Job")
    c = job.spec.template.spec.containers[0]
    cm = docs["ConfigMap"]["data"]
    assert c.env_from[0].config_map_ref.name == docs["ConfigMap"]["metadata"]["name"]  # the generated hash name
    assert set(re.findall(r"\$\{?([A-Za-z_]\w*)", c.args[0])) <= set(cm) | {e.name for e in c.env}
    assert int(cm["NNODES"]) == job.spec.completions == job.spec.parallelism
    assert c.image.startswith("ghcr.io/training-at-scale/labkit")
    grace = job.spec.template.spec.termination_grace_period_seconds
    assert float(cm["GRACE_S"]) < float(cm["SHUTDOWN_TIMEOUT"]) < grace  # save, then torchrun, then the kubelet
    if where == OVERLAY:  # the cpu overlay
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
    assert {p["slug"] for p in profiles} == {"cpu", "gpu", "instructor"}
    # a student's server hides the formgrader (the settings the Dockerfile copies); the instructors' does not
    from kubespawner.utils import recursive_update

    student_settings = values["singleuser"]["extraEnv"]["JUPYTER_CONFIG_PATH"]
    assert f"COPY cluster/jupyterhub/student {student_settings}" in (ROOT / "cluster/jupyterhub/Dockerfile").read_text()
    for p in profiles:
        env = dict(values["singleuser"]["extraEnv"])
        recursive_update(env, p["kubespawner_override"].get("environment", {}))
        assert (env.get("JUPYTER_CONFIG_PATH") == student_settings) == (p["slug"] != "instructor"), p["slug"]
    for p in profiles:
        unknown = set(p["kubespawner_override"]) - set(KubeSpawner.class_trait_names())
        assert not unknown, f"profile {p['slug']}: {unknown}"
    gpu = next(p for p in profiles if p["slug"] == "gpu")["kubespawner_override"]
    assert gpu["extra_resource_limits"]["nvidia.com/gpu"] == "1" and gpu["environment"]["LABKIT_DEVICE"] == "cuda"
    # a profile's tolerations replace the chart's for user pods (hub.jupyter.org/dedicated=user): kept
    assert {t["key"] for t in gpu["tolerations"]} >= {"hub.jupyter.org/dedicated", "hub.jupyter.org_dedicated", "nvidia.com/gpu"}
    # the exchange every server mounts is a claim of its own manifest, shared by all (ReadWriteMany)
    claim = _deserialize(yaml.safe_load((HUB / "exchange.yaml").read_text()), "V1PersistentVolumeClaim")
    mounted = {v["persistentVolumeClaim"]["claimName"] for v in values["singleuser"]["storage"]["extraVolumes"]}
    assert claim.metadata.name in mounted and claim.spec.access_modes == ["ReadWriteMany"]
    # every server starts with labkit-start (the person's uid, the student labs), which the image installs
    assert values["singleuser"]["cmd"][0] == "labkit-start" and "lifecycleHooks" not in values["singleuser"]
    assert "COPY cluster/jupyterhub/labkit-start.sh /usr/local/bin/labkit-start" in (HUB / "Dockerfile").read_text()


def test_the_docs_install_the_hub_as_the_values_file_says():
    def commands(text: str) -> list[str]:  # continued lines joined, spaces normalised
        return [" ".join(l.split()) for l in re.sub(r"\\\n", " ", text).splitlines()]

    header = commands("\n".join(l[1:] for l in (HUB / "values.yaml").read_text().splitlines()[1:5]))
    assert [c.split()[:2] for c in header] == [["kubectl", "create"], ["kubectl", "apply"], ["helm", "upgrade"]]
    for doc in (ROOT / "book" / "clusters.md", CLUSTER / "README.md"):
        assert set(header) <= set(commands(doc.read_text())), doc


def test_the_hub_image_runs_the_jupyterhub_of_the_servers():
    """Chart 4.4.0's hub is JupyterHub 5.5.0; the course's hub image installs requirements.txt's pins,
    those of every server's jupyterhub-singleuser, and values.yaml runs it."""
    steps = _dockerfile(HUB / "hub.Dockerfile")
    assert next(a for i, a in steps if i == "ARG").startswith("BASE=quay.io/jupyterhub/k8s-hub:4.4.0")
    (run,) = [a for i, a in steps if i == "RUN"]
    pattern = re.search(r"grep -E '(\S+)' /tmp/requirements.txt", run)[1]
    pins = [l for l in (ROOT / "requirements.txt").read_text().splitlines() if re.match(pattern, l)]
    assert sorted(p.split("==")[0] for p in pins) == ["jupyterhub", "jupyterhub-kubespawner", "oauthenticator"]
    values = yaml.safe_load((HUB / "values.yaml").read_text())
    assert values["hub"]["image"]["name"] == "ghcr.io/training-at-scale/labkit-hub"
    assert str(values["hub"]["image"]["tag"]) == str(values["singleuser"]["image"]["tag"]).split("@")[0]
    assert "helm upgrade --install course jupyterhub/jupyterhub --version 4.4.0" in (HUB / "values.yaml").read_text()


def _dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: comment lines dropped, continued lines joined."""
    text = "\n".join(l for l in path.read_text().splitlines() if not l.lstrip().startswith("#"))
    lines = re.sub(r"\\\n\s*", " ", text).splitlines()
    return [(l.split(None, 1)[0].upper(), l.split(None, 1)[1]) for l in lines if l.strip()]


def _pip_installs(commands: list[str]) -> list[list[str]]:
    """Each ``pip install``, from the command's environment prefix on, with the options that change
    only the output or the cache left out."""
    out = []
    for cmd in commands:
        cmd = cmd.replace("$(PIP_INSTALL)", "pip install --no-compile")
        if "pip install" in cmd:
            cmd = cmd.replace("$(PY) -m pip", "pip").replace("$$", "$").replace('"', "")
            # output, cache and byte-compiling differ (the image is read-only to its user): not what is installed
            out.append([t for t in cmd.split() if t not in ("-q", "--no-cache-dir", "--no-compile")])
    return out


def test_image_installs_exactly_the_projects_requirements():
    steps = _dockerfile(HUB / "Dockerfile")
    assert any("requirements.txt" in a.split()[:-1] for i, a in steps if i == "COPY")
    run = [cmd.strip() for i, a in steps if i == "RUN" for cmd in a.split("&&")]
    # the same installs as the project's own venv (the Makefile's), in the same order, and nothing else:
    # the pinned tools, the pinned torch, requirements.txt, labkit itself
    make = [l.strip() for l in (ROOT / "Makefile").read_text().splitlines() if l.startswith("\t")]
    assert _pip_installs(run) == _pip_installs(make) != []
    reqs = {l.split("==")[0].lower() for l in (ROOT / "requirements.txt").read_text().splitlines()}
    assert {"jupyterhub", "nbgitpuller", "jupyterhub-kubespawner", "oauthenticator"} <= reqs
    values = yaml.safe_load((HUB / "values.yaml").read_text())
    image = values["singleuser"]["image"]["name"]
    assert image == _kustomization(K8S)["images"][0]["newName"]  # hub and training pods: one image
    # the build command the docs give tags that image
    for doc in (ROOT / "book" / "clusters.md", ROOT / "book" / "clusters_runbook.md", CLUSTER / "README.md"):
        tags = re.findall(r"^docker build -f cluster/jupyterhub/Dockerfile -t (\S+) \.$", doc.read_text(), re.M)
        assert tags and {t.split(":")[0] for t in tags} == {image}, doc


def test_dockerfile_reader_ignores_comments():
    steps = _dockerfile(HUB / "Dockerfile")
    assert not any("docker build" in a for _, a in steps)  # the build command in its header comment
    assert ("WORKDIR", "/opt/labkit") in steps and any(i == "RUN" and "\\" not in a for i, a in steps)


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
    for path in REPO_PATH.findall(text):
        assert (ROOT / path).is_file(), f"{path} is referenced but does not exist"
    for mod in re.findall(r"-m (labkit(?:\.\w+)*)", text):
        assert (ROOT / (mod.replace(".", "/") + ".py")).is_file() or (ROOT / mod.replace(".", "/")).is_dir(), mod


def test_path_lint_sees_repository_paths_behind_a_variable():
    text = 'bash "$ROOT/cluster/a.sbatch" ${LABKIT_ROOT}/cluster/b.sh "$R"/cluster/c.yaml cluster/d.sh /opt/cluster/e.sh'
    assert REPO_PATH.findall(text) == ["cluster/a.sbatch", "cluster/b.sh", "cluster/c.yaml", "cluster/d.sh"]
    assert "cluster/slurm/train.sbatch" in REPO_PATH.findall((CLUSTER / "slurm" / "deepspeed.sbatch").read_text())


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed; .ci/run installs it")
def test_launch_scripts_are_shellcheck_clean():
    out = subprocess.run(["shellcheck", "--shell=bash", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def _run(script: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER / "slurm" / script)], env=_env(**env), capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


def test_lab_and_deepspeed_scripts_stop_early_naming_what_is_missing():
    out = _run("lab.sbatch")
    assert out.returncode == 2 and "LAB is not set" in out.stderr
    out = _run("lab.sbatch", LAB="data_parallel", PROFILE="huge", PYTHON=sys.executable)
    assert out.returncode == 2 and "PROFILE='huge' is unknown for lab 'data_parallel'; valid profiles" in out.stderr
    out = _run("deepspeed.sbatch", STRATEGY="ddp")
    assert out.returncode == 2 and "STRATEGY=ddp is not a DeepSpeed strategy; valid: zero1, zero2, zero3" in out.stderr
    # a Python without torch (the node's system python) stops at once, naming PYTHON=
    out = _run("lab.sbatch", LAB="data_parallel", PYTHON="/bin/false")
    assert out.returncode == 2 and "PYTHON=/bin/false cannot import labkit, torch, papermill, jupytext" in out.stderr
    proc = subprocess.run(["bash", str(ROOT / "cluster" / "torchrun.sh")], env=_env(PYTHON="/bin/false"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "set PYTHON= to the Python that has them" in proc.stderr


def test_torchrun_sh_writes_its_metrics_under_build_not_in_the_checkout_root(tmp_path):
    """`DEVICE=cpu bash cluster/torchrun.sh`, run from the checkout as the README does, left metrics.json in
    the repository root."""
    out, argv = _stubbed(["bash", str(ROOT / "cluster" / "torchrun.sh")], tmp_path, DEVICE="cpu",
                         PYTHON=str(tmp_path / "bin" / "python"))
    assert out.returncode == 0 and argv[:2] == ["-m", "labkit.launch.torchrun"], out.stderr
    assert argv[argv.index("--metrics") + 1] == str(ROOT / "_build" / "torchrun" / "metrics.json")


@pytest.mark.parametrize("strategy", RECIPE_STRATEGIES)
def test_train_sbatch_passes_checkpoint_flags_only_where_labkit_can_checkpoint(strategy, tmp_path):
    out, argv = _sbatch("train.sbatch", tmp_path, STRATEGY=strategy)
    assert out.returncode == 0, out.stderr
    python = argv.index(str(tmp_path / "bin" / "python"))  # srun's own options come first
    assert argv[:python] == ["--kill-on-bad-exit=0", "--nodes=2", "--ntasks-per-node=1"]
    assert argv[python + 1:python + 3] == ["-m", "labkit.launch.torchrun"]  # torchrun, quiet on an expected signal
    endpoint = next(a for a in argv if a.startswith("--rdzv-endpoint="))
    assert "--nnodes=2" in argv and endpoint.startswith("--rdzv-endpoint=10.0.0.1:")  # NodeAddr of the head
    cfg = _check_train_argv(argv, strategy, out.stdout, ckpt=str(tmp_path / "ckpt"))
    assert (cfg.step_log is None) == _rejects_checkpoints(strategy)


def test_jobs_whose_ids_differ_by_the_port_range_get_different_free_ports(tmp_path):
    """The port used to be 20000 + job id mod 20000: jobs 12345 and 32345 on one node shared it."""
    import socket

    ports = []
    for job in ("12345", "32345"):
        out, argv = _sbatch("train.sbatch", tmp_path, STRATEGY="ddp", SLURM_JOB_ID=job)
        assert out.returncode == 0, out.stderr
        port = int(next(a for a in argv if a.startswith("--rdzv-endpoint=")).rsplit(":", 1)[1])
        assert f"--rdzv-id={job}" in argv and port != 32345
        with socket.socket() as s:
            s.bind(("", port))  # free on this (the batch) host
        ports.append(port)


def test_train_sbatch_trains_at_a_lab_profiles_size(tmp_path):
    out, argv = _sbatch("train.sbatch", tmp_path, STRATEGY="fsdp", LAB="zero_fsdp", PROFILE="gpu", STEPS="7")
    assert out.returncode == 0, out.stderr
    cfg = _check_train_argv(argv, "fsdp", out.stdout, ckpt=str(tmp_path / "ckpt"))
    gpu = PROFILES["zero_fsdp"]["gpu"]
    args = vars(build_parser().parse_args(argv[argv.index("labkit.train") + 1:]))
    assert (args["n_layer"], args["n_embd"], args["block_size"]) == (gpu["n_layer"], gpu["n_embd"], gpu["block_size"])
    assert cfg.steps == 7 and cfg.batch_size == 8 * 2 * 2  # STEPS wins; "8 per rank" on 2 nodes x 2 ranks
    (tmp_path / "argv").unlink()
    out, argv = _sbatch("train.sbatch", tmp_path, PROFILE="gpu")
    assert out.returncode == 2 and "PROFILE=gpu needs LAB" in out.stderr and not argv
    out, argv = _sbatch("train.sbatch", tmp_path, LAB="zero_fsdp", PROFILE="huge")
    assert out.returncode == 2 and "PROFILE='huge' is unknown for lab 'zero_fsdp'" in out.stderr and not argv


def test_deepspeed_sbatch_runs_train_sbatch_with_zero3(tmp_path):
    out, argv = _sbatch("deepspeed.sbatch", tmp_path)
    assert out.returncode == 0, out.stderr
    _check_train_argv(argv, "zero3", out.stdout, ckpt=str(tmp_path / "ckpt"))


def test_train_sbatch_gives_each_rank_its_own_gpu(tmp_path):
    for gpus in (dict(SLURM_GPUS_ON_NODE="2"), dict(CUDA_VISIBLE_DEVICES="0,1")):
        out, argv = _sbatch("train.sbatch", tmp_path, DEVICE="cuda", NPROC_PER_NODE="4", **gpus)
        assert out.returncode == 2 and not argv, gpus
        assert ("NPROC_PER_NODE=4 but Slurm gave this node 2 GPU(s): ask for --gpus-per-node=4 or lower "
                "NPROC_PER_NODE") in out.stderr
    out, argv = _sbatch("train.sbatch", tmp_path, DEVICE="cpu", NPROC_PER_NODE="two")
    assert out.returncode == 2 and "NPROC_PER_NODE=two must be a positive integer" in out.stderr
    # within the GPUs, and by default one rank per GPU ("--gpus-per-node=a100:4" gives "a100:4")
    for env in (dict(NPROC_PER_NODE="4", SLURM_GPUS_ON_NODE="4"), dict(SLURM_GPUS_PER_NODE="a100:4"),
                dict(NPROC_PER_NODE="4", CUDA_VISIBLE_DEVICES="0,1,2,3")):
        out, argv = _sbatch("train.sbatch", tmp_path, DEVICE="cuda", **env)
        assert out.returncode == 0 and "--nproc-per-node=4" in argv, (env, out.stderr)


def _fake_step(state: Path) -> subprocess.Popen:
    """A process that looks like a job step of the local cluster in ``state`` (see stop.sh)."""
    p = subprocess.Popen(["bash", "-c", 'exec -a "slurmstepd: [9.0]" sleep 60'], cwd=state,
                         env=dict(os.environ, SLURM_CONF=str(state / "slurm.conf")))
    deadline = time.monotonic() + 10
    while not Path(f"/proc/{p.pid}/cmdline").read_bytes().startswith(b"slurmstepd: ["):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return p


@pytest.mark.skipif(not Path("/proc/self/environ").exists() or shutil.which("pgrep") is None,
                    reason="needs Linux's /proc and pgrep")
def test_stop_script_stops_only_its_own_clusters_job_steps(tmp_path):
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    other.mkdir()
    (tmp_path / "link").symlink_to(mine)  # the state directory, spelt another way
    own, foreign = _fake_step(mine), _fake_step(other)
    try:
        out = subprocess.run(["bash", str(CLUSTER / "slurm" / "local" / "stop.sh"), str(tmp_path / "link")],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert own.wait(timeout=10) == -15  # SIGTERM
        assert foreign.poll() is None  # another local cluster's step keeps running
    finally:
        for p in (own, foreign):
            p.kill()
            p.wait()


# -- what a hostile or careless setting must not get through (the hardening review) --
@pytest.mark.skipif(os.geteuid() != 0, reason="start.sh runs as root (slurmd starts jobs as their user); CI is root")
def test_the_local_slurm_starter_refuses_a_state_directory_it_did_not_make(tmp_path):
    """With the munge key one can mint credentials for any user: the state directory must be new or
    root's own and empty, never a link, and nothing planted in it may be followed."""
    start = CLUSTER / "slurm" / "local" / "start.sh"
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)  # nobody's
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "slurm.conf").symlink_to(victim)
    (planted / "munge.key").symlink_to(victim)
    (tmp_path / "link").symlink_to(planted)
    for state, why in ((theirs, "is not a directory owned by root"), (tmp_path / "link", "is not a directory owned by root"),
                       (planted, "is not empty")):
        out = subprocess.run(["bash", str(start), str(state)], capture_output=True, text=True, timeout=30)
        assert out.returncode == 2 and why in out.stderr, (state, out.stderr)
    assert victim.read_text() == "keep me" and (theirs.stat().st_mode & 0o777) == 0o755
    # A folder stop.sh left may be started again: start.sh clears what a cluster leaves, by name, and
    # follows no link doing so; anything else in it is still refused.
    (planted / "stopped").write_text("planted")
    (planted / "spool").symlink_to(tmp_path)
    (planted / "notes.txt").write_text("not start.sh's")
    out = subprocess.run(["bash", str(start), str(planted)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "is not empty, and not a folder stop.sh left" in out.stderr, out.stderr
    assert sorted(p.name for p in planted.iterdir()) == ["notes.txt"] and victim.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "planted", "theirs", "victim"]


def test_the_hub_names_no_admin_and_its_secrets_stay_out_of_git():
    values = yaml.safe_load((HUB / "values.yaml").read_text())
    assert "admin_users" not in values["hub"]["config"].get("Authenticator", {})
    for path in ("secrets.yaml", "cluster/jupyterhub/secrets.yaml"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path


def test_images_are_pinned_so_replaced_pods_run_the_same_code():
    values = yaml.safe_load((HUB / "values.yaml").read_text())
    hub_tag = str(values["singleuser"]["image"]["tag"])
    k8s_tag = str(_kustomization(K8S)["images"][0]["newTag"])
    assert hub_tag == k8s_tag and re.fullmatch(r"\d+\.\d+\.\d+(@sha256:[0-9a-f]{64})?", hub_tag), hub_tag
    steps = _dockerfile(HUB / "Dockerfile")
    base = next(a for i, a in steps if i == "ARG" and a.startswith("BASE="))
    assert re.fullmatch(r"BASE=python:3\.11\.\d+-slim-bookworm@sha256:[0-9a-f]{64}", base), base
    assert next(a for i, a in steps if i == "FROM") == "${BASE}"


def test_pin_image_pins_the_pushed_digest_in_every_recipe(tmp_path):
    """Our own image's digest exists only once it is pushed: cluster/pin-image.sh writes it into the
    Kubernetes Job's kustomization and the hub's values (here on copies, with the digest given)."""
    kust, values = tmp_path / "kustomization.yaml", tmp_path / "values.yaml"
    shutil.copy(K8S / "kustomization.yaml", kust)
    shutil.copy(HUB / "values.yaml", values)
    digest = "sha256:" + "ab" * 32
    env = {**os.environ, "KUSTOMIZATION": str(kust), "VALUES": str(values), "DIGEST": digest}
    run = lambda *a: subprocess.run(["bash", str(CLUSTER / "pin-image.sh"), *a], env=env, capture_output=True,
                                    text=True, timeout=60)
    out = run("ghcr.io/training-at-scale/labkit:0.2.0")
    assert out.returncode == 0, out.stderr
    image = yaml.safe_load(kust.read_text())["images"][0]
    assert image == {"name": "labkit", "newName": "ghcr.io/training-at-scale/labkit", "newTag": "0.2.0",
                     "digest": digest}
    pinned = yaml.safe_load(values.read_text())
    assert pinned["singleuser"]["image"]["tag"] == f"0.2.0@{digest}"
    assert pinned["hub"]["image"] == yaml.safe_load((HUB / "values.yaml").read_text())["hub"]["image"]  # the hub's own
    assert run("ghcr.io/training-at-scale/labkit:0.2.0").returncode == 0  # again: nothing changes
    assert yaml.safe_load(kust.read_text())["images"][0]["digest"] == digest
    for bad, why in [("labkit:latest", "'latest' moves"), ("ghcr.io/x/labkit@sha256:" + "0" * 64, "already names"),
                     ("labkit", "must be REGISTRY/NAME:TAG")]:
        out = run(bad)
        assert out.returncode == 2 and why in out.stderr and out.stderr.count("\n") == 1, out.stderr
    env["DIGEST"] = "sha256:xyz"
    out = run("ghcr.io/training-at-scale/labkit:0.2.0")
    assert out.returncode == 2 and "is not sha256: followed by 64 hex digits" in out.stderr


def test_training_pods_run_as_the_images_user_without_privileges():
    pod = yaml.safe_load((K8S / "job.yaml").read_text())["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000}
    c = pod["containers"][0]["securityContext"]
    assert c["allowPrivilegeEscalation"] is False and c["capabilities"]["drop"] == ["ALL"]
    assert "useradd --create-home --uid 1000 jovyan" in (HUB / "Dockerfile").read_text()


def _kernel_installs(commands: list[str]) -> list[str]:
    return [" ".join(c.split(">")[0].replace("$(PY)", "python").replace('"', "").split()) for c in commands
            if "ipykernel install" in c]


def test_image_and_venv_give_students_the_same_jupyterlab():
    """The hub image and `make venv` install the same course kernel and the same JupyterLab settings,
    so what a student meets on the hub is what the browser test drives from .venv."""
    steps = _dockerfile(HUB / "Dockerfile")
    run = [cmd.strip() for i, a in steps if i == "RUN" for cmd in a.split("&&")]
    makefile = (ROOT / "Makefile").read_text()
    make = [l.strip() for l in makefile.splitlines() if l.startswith("\t")]
    assert _kernel_installs(run) == _kernel_installs(make) == [
        "python -m ipykernel install --sys-prefix --name labkit --display-name Python (labkit)"]
    # the image's interpreter prefix is /usr/local (python:*-slim); the venv's is .venv
    copies = [a.split() for i, a in steps if i == "COPY" and "overrides.json" in a]
    assert copies == [["cluster/jupyterhub/overrides.json",
                       "/usr/local/share/jupyter/lab/settings/overrides.json"]]
    assert re.search(r"^LAB_SETTINGS := \$\(VENV\)/share/jupyter/lab/settings/overrides\.json$", makefile, re.M)
    assert re.search(r"^\$\(LAB_SETTINGS\): cluster/jupyterhub/overrides\.json", makefile, re.M)
    viewers = json.loads((HUB / "overrides.json").read_text())[
        "@jupyterlab/docmanager-extension:plugin"]["defaultViewers"]
    assert viewers == {"markdown": "Jupytext Notebook", "myst": "Jupytext Notebook"}
    # every lab and every student notebook names that kernel
    from labkit.labs import LABS_DIR, list_labs
    from labkit.course.assignments import KERNELSPEC
    for lab in list_labs():
        assert jupytext.read(LABS_DIR / f"{lab}.md").metadata["kernelspec"]["name"] == "labkit", lab
    assert KERNELSPEC["name"] == "labkit"


def test_every_module_the_makefile_and_cluster_recipes_run_exists():
    """`python -m X` in the Makefile or a cluster recipe: X must import (`make assignments` once named a
    module that did not exist, and only an instructor running it would have found out)."""
    import importlib.util

    files = [ROOT / "Makefile", *(p for p in CLUSTER.rglob("*") if p.is_file())]
    modules = {m for f in files for m in re.findall(r"-m ([A-Za-z_][\w.]*)", f.read_text(errors="replace"))}
    assert "labkit.train" in modules  # the pattern reads the recipes
    assert not [m for m in sorted(modules) if importlib.util.find_spec(m) is None]
