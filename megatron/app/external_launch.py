"""``train.py CONFIG... [key=value ...]`` started by torchrun or DeepSpeed's runner, with no deepy.py.

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --max-restarts 3 \\
        train.py configs/125M.yml configs/local_setup.yml
    deepspeed --no_ssh --node_rank K --hostfile H --master_addr HOST train.py configs/125M.yml ...

This is how clusters without ssh between nodes start jobs (Kubernetes' PyTorchJob and JobSet, SkyPilot, cloud
batch services): one launcher per node, which starts the node's workers with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT set. Each worker then does what deepy.py does before a launch, for itself:

1. resolve and check the config files and overrides exactly as ``deepy.py train.py CONFIG...`` would, for the
   world size the launcher started (a refusal is printed once per node, exit code 2);
2. join the process group, and agree with every other rank, before anything else talks, that they resolved the
   same config from the same code (a digest of the resolved arguments, of every ``megatron/`` source file and
   of the library versions): a difference is refused on every rank, naming the keys (with each side's
   ``file:line``) or the source files that differ, and the hosts;
3. take rank 0's run name (a resumed run keeps the one its checkpoint records), write the resolved config into
   the run directory (each node's local rank 0: the nodes need not share a file system for it), clear the last
   attempt's error records there, and take ``save``'s lock on rank 0;
4. train as a rank of a deepy.py launch does (``train.py --deepy_config PATH``).

``torchrun --max-restarts N`` restarts every worker after a failure; they resolve again and resume from the last
committed checkpoint in ``load``. deepy.py's own launcher keys (``num_gpus``, ``hostfile``, ``max_restarts``,
...) are not read: the launcher placed the ranks, and the workers say which of them a config sets.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron.app.deepy import (
    already_finished,
    check_memory,
    hf_start,
    local_save,
    lock_save,
    notes,
    parse_command,
    resolve,
    resumed_run_name,
)
from megatron.config_rules import DERIVED
from megatron.engine.memory import memory_fit
from megatron.errors import ConfigError, UsageError
from megatron.launcher.config import DeepSpeedRunnerArgs
from megatron.launcher.save_lock import Holder, this_process
from megatron.logging import rank_errors
from megatron.logging.rank_errors import RankErrorReport
from megatron.logging.trackers import new_run_name
from megatron.neox_arguments.resolved import RESOLVED_FILE_NAME, run_directory
from megatron.neox_arguments.run_config import RunConfig

if TYPE_CHECKING:
    from megatron.launcher.save_lock import SaveLock
    from megatron.neox_arguments.resolved import ResolvedConfig

REPO = Path(__file__).resolve().parents[2]
CODE_ROOTS = ("megatron",)
"""Directories of the repository whose Python files every node must run identically (with the entry script)."""
LIBRARIES = ("torch", "deepspeed", "transformers", "tokenizers", "numpy", "pydantic")


@dataclass(frozen=True)
class ExternalLaunch:
    """This worker's place, as its launcher (torchrun, DeepSpeed's per-node launcher) set it."""

    launcher: str
    """``torchrun`` or ``DeepSpeed's launcher``, for messages."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    restart: int
    """torchrun's attempt: 0 first, then one more for each restart."""
    max_restarts: int | None
    rendezvous_id: str | None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ExternalLaunch | None:
        """The launch that started this worker, or None when nothing set RANK and WORLD_SIZE."""
        if not environ.get("RANK", "").isdigit() or not environ.get("WORLD_SIZE", "").isdigit():
            return None
        torchrun = "TORCHELASTIC_RUN_ID" in environ
        local_world = environ.get("LOCAL_WORLD_SIZE") or environ.get("LOCAL_SIZE") or "1"
        max_restarts = environ.get("TORCHELASTIC_MAX_RESTARTS", "")
        run_id = environ.get("TORCHELASTIC_RUN_ID")
        return cls(launcher="torchrun" if torchrun else "DeepSpeed's launcher", rank=int(environ["RANK"]),
                   world_size=int(environ["WORLD_SIZE"]), local_rank=int(environ.get("LOCAL_RANK", "0") or 0),
                   local_world_size=int(local_world), restart=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
                   max_restarts=int(max_restarts) if max_restarts.isdigit() else None,
                   rendezvous_id=run_id if run_id and run_id != "none" else None)

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


@dataclass
class ExternalStart:
    """What train.py trains from after :func:`start`: the resolved config written for this run, and the lock."""

    config_path: str
    lock: SaveLock | None = None


class ErrorReport:
    """``run_guarded``'s report for such a worker: before the run directory is known every rank of a node has the
    same error (the same files, resolved the same way), so local rank 0 prints it, once per node (each node's log
    is separate under Kubernetes); afterwards, the run's own record (the first failing rank prints)."""

    def __init__(self, local_rank: int, rank: int) -> None:
        self.local_rank = local_rank
        self.rank = rank
        self.run_dir: str | None = None

    def __call__(self, message: str, details: str) -> bool:
        if self.run_dir is None:
            return self.local_rank == 0

        return RankErrorReport(self.run_dir, self.rank)(message, details)


def strip_launcher_flags(argv: Sequence[str]) -> list[str]:
    """The config files and overrides without what a launcher appends (DeepSpeed's ``--local_rank=N``)."""
    out: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        if token.startswith("--local_rank=") or token.startswith("--local-rank="):
            continue
        if token in ("--local_rank", "--local-rank"):
            skip = True
            continue
        out.append(token)
    return out


def code_fingerprint(script: str) -> dict[str, str]:
    """sha256 of every Python file this worker runs from the repository (``megatron/`` and the entry script), and
    the versions of the libraries that compute the numbers; one entry each, so a difference names the file."""
    files = {str(p.relative_to(REPO)): p for root in CODE_ROOTS for p in sorted((REPO / root).rglob("*.py"))}
    entry = Path(script).resolve()
    files[entry.name if not entry.is_relative_to(REPO) else str(entry.relative_to(REPO))] = entry
    found = {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in files.items() if path.is_file()}
    found["python"] = platform.python_version()
    for library in LIBRARIES:
        try:
            found[library] = version(library)
        except PackageNotFoundError:
            found[library] = "(not installed)"
    return found


def config_record(resolved: ResolvedConfig) -> dict[str, Any]:
    """The resolved arguments and DeepSpeed config every rank must agree on, as JSON values."""
    return {"args": resolved.args.model_dump(mode="json"), "deepspeed": resolved.deepspeed_config}


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def config_differences(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """The keys whose resolved values differ (``args`` keys by name, then the DeepSpeed config as a whole)."""
    keys = sorted(set(ours["args"]) | set(theirs["args"]))
    names = [key for key in keys if ours["args"].get(key) != theirs["args"].get(key)]
    if not names and ours["deepspeed"] != theirs["deepspeed"]:
        names.append("(the DeepSpeed config)")
    return names


def code_differences(ours: dict[str, str], theirs: dict[str, str]) -> list[str]:
    return sorted(name for name in set(ours) | set(theirs) if ours.get(name) != theirs.get(name))


@dataclass(frozen=True)
class RankRecord:
    """What one rank says about itself in the agreement."""

    rank: int
    host: str
    config: str
    code: str
    run_name: str | None


def agree(resolved: ResolvedConfig, script: str, launch: ExternalLaunch, proposed_name: str | None) -> str | None:
    """Check with every rank that all resolved the same config from the same code (one gather of digests over the
    process group, the first exchange of the job); returns rank 0's run name. A difference raises one
    :class:`ConfigError`, the same on every rank, naming what differs between rank 0 and the first rank that
    differs from it (their full records are then broadcast to find it)."""
    # lazy: torch and DeepSpeed load after the config is checked, as under deepy.py
    import torch.distributed as dist

    group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    code = code_fingerprint(script)
    record = config_record(resolved)
    mine = RankRecord(rank=launch.rank, host=socket.gethostname(), config=digest(record), code=digest(code),
                      run_name=proposed_name)
    everyone: list[Any] = [None] * launch.world_size
    dist.all_gather_object(everyone, mine, group=group)
    first = everyone[0]
    odd = next((r for r in everyone if (r.config, r.code) != (first.config, first.code)), None)
    if odd is None:
        return str(first.run_name) if first.run_name else None
    sources = dict(resolved.provenance)
    full: list[Any] = [record, code, sources]
    theirs: list[Any] = list(full)
    dist.broadcast_object_list(full, src=0, group=group)  # rank 0's, everywhere
    dist.broadcast_object_list(theirs, src=odd.rank, group=group)  # and the other rank's
    raise ConfigError(difference_message(first, odd, full, theirs, launch.launcher))


def difference_message(first: RankRecord, odd: RankRecord, ours: list[Any], theirs: list[Any], launcher: str) -> str:
    """Why the ranks refuse: the keys (each side's value and where it came from) or files that differ."""
    parts = []
    if first.code != odd.code:
        files = code_differences(ours[1], theirs[1])
        shown = ", ".join(files[:8]) + (f" and {len(files) - 8} more" if len(files) > 8 else "")
        parts.append(f"they run different code: {shown} differ{'s' if len(files) == 1 else ''} between rank 0 (host "
                     f"{first.host}) and rank {odd.rank} (host {odd.host}); install the same revision of Deepy and the "
                     f"same libraries on every node")
    if first.config != odd.config:
        rows = []
        for key in config_differences(ours[0], theirs[0])[:8]:
            if key.startswith("("):
                rows.append(key)
                continue
            rows.append(f"{key}={json.dumps(ours[0]['args'].get(key))} on rank 0 (host {first.host}; "
                        f"{ours[2].get(key, 'default')}) but {json.dumps(theirs[0]['args'].get(key))} on rank "
                        f"{odd.rank} (host {odd.host}; {theirs[2].get(key, 'default')})")
        parts.append("they resolved different configs: " + "; ".join(rows) + "; give every node the same config "
                     "files and key=value overrides")
    return f"the ranks {launcher} started disagree before training: " + ". And ".join(parts)


def launcher_keys_set(resolved: ResolvedConfig) -> list[str]:
    """deepy.py's launcher keys the config sets (not read under another launcher), as ``key (file:line)``."""
    return [f"{key} ({source})" for key, source in resolved.provenance.items()
            if key in DeepSpeedRunnerArgs.model_fields and source != DERIVED]


def start(script: str, argv: Sequence[str], report: ErrorReport) -> ExternalStart | None:
    """Everything before training for a worker started with config files; None when the run has nothing left to
    do (already finished: every rank exits 0)."""
    launch = ExternalLaunch.from_environ(os.environ)
    if launch is None:
        raise UsageError(f"{os.path.basename(script)} CONFIG... runs as a worker of torchrun or DeepSpeed's launcher "
                         f"(they set RANK and WORLD_SIZE): start it with torchrun [its flags] {script} CONFIG..., or "
                         f"let deepy.py start the ranks: python deepy.py {script} CONFIG...")
    command = parse_command([script, *strip_launcher_flags(argv)])
    if command.dry_run:
        raise UsageError(f"--dry-run checks a launch: run python deepy.py --dry-run {script} CONFIG... instead")
    resolved = resolve(command, world=launch.world_size)
    said = launcher_keys_set(resolved)
    if said:
        restarts = f" --max-restarts={launch.max_restarts}" if launch.max_restarts is not None else ""
        resolved.warnings.append(f"{launch.launcher} placed the {launch.world_size} rank(s) on {launch.nodes} "
                                 f"node(s){' and restarts them:' + restarts if restarts else ''}; deepy.py's "
                                 f"launcher keys are not read: {', '.join(said)}")
    finished = already_finished(resolved, script)
    if finished is not None:
        if launch.rank == 0:
            print(f"deepy: {finished}", flush=True)
        return None
    if resolved.args.initialize_from_hf:
        started = hf_start(resolved, in_place=True)
        if launch.rank == 0:
            print(f"deepy: {started}", flush=True)
    check_memory(resolved, external_memory_fit(resolved, launch), script)

    # lazy: torch and DeepSpeed load after the config is checked, as under deepy.py
    from megatron.initialize import init_distributed

    run = RunConfig.from_resolved(resolved)
    init_distributed(run.parallel, run.hang.init_timeout_seconds)
    name = agree(resolved, script, launch, resumed_run_name(resolved, script) or new_run_name())
    if not resolved.args.run_dir:
        resolved.run_name = name
    run_dir = resolved.directory = str(run_directory(resolved.args, run_name=resolved.run_name))
    report.run_dir = run_dir
    return write_and_lock(resolved, script, launch, run_dir, notes(resolved, script))


def external_memory_fit(resolved: ResolvedConfig, launch: ExternalLaunch) -> Any:
    """The memory estimate, checked against this machine when every rank runs on it (one node)."""
    return memory_fit(RunConfig.from_resolved(resolved), launches_locally=launch.nodes == 1)


def write_and_lock(resolved: ResolvedConfig, script: str, launch: ExternalLaunch, run_dir: str,
                   said: list[str]) -> ExternalStart:
    """The run directory made ready on every node, then ``save``'s lock on rank 0."""
    # lazy: torch and DeepSpeed load after the config is checked, as under deepy.py
    import torch.distributed as dist


    config_path = os.path.join(run_dir, RESOLVED_FILE_NAME)
    if launch.local_rank == 0:  # once per node: the nodes need not share a file system
        resolved.write(config_path)
        rank_errors.clear(run_dir)  # the last attempt's records (torchrun restarts into the same directory)
    lock: SaveLock | None = None
    refusal: list[str | None] = [None]
    if launch.rank == 0:
        try:
            lock = take_lock(resolved, script, launch)
        except ConfigError as err:
            refusal = [err.message]
    dist.broadcast_object_list(refusal, src=0)  # every rank refuses a busy `save` together (and waits for the writes)
    if refusal[0] is not None:
        raise ConfigError(str(refusal[0]))
    if launch.rank == 0:
        for line in said:
            print(f"deepy: {line}", flush=True)
        print(f"deepy: {launch.world_size} rank(s) started by {launch.launcher} on {launch.nodes} node(s) agree on "
              f"the config and code; resolved config written to {config_path}", flush=True)
    return ExternalStart(config_path=config_path, lock=lock)


def take_lock(resolved: ResolvedConfig, script: str, launch: ExternalLaunch) -> SaveLock | None:
    """``save``'s lock (megatron/launcher/save_lock.py) for this job. A restart of the same torchrun job (same
    rendezvous id) takes over its own earlier attempt's lock even where that one's holder ran on another node
    (the rank 0 of an attempt may land on any node)."""
    save = local_save(resolved)
    if not save:
        return None
    job = (f"{launch.launcher} job {launch.rendezvous_id}" if launch.rendezvous_id else launch.launcher)
    command = shlex.join([job + ":", os.path.basename(sys.executable), script, *sys.argv[1:]])
    holder = this_process(command, resolved.run_name or "", resolved.directory or "")

    def same_job(found: Holder) -> bool:
        return launch.rendezvous_id is not None and launch.restart > 0 and found.command.startswith(
            shlex.join([job + ":"]))

    return lock_save(resolved, save, holder, takes_over=same_job)
