"""How the ranks start: hosts, processes per node, rendezvous and the multi-node launcher (DeepSpeed's
runner, mpirun or srun). GPT-NeoX files these keys under ``NeoXArgsDeepspeedRunner`` (``deepspeed_mpi``
and ``deepspeed_slurm``, which say deepy itself was started by mpirun or srun, under ``NeoXArgsOther``).

Declared here, beside the launcher that reads them; the one argument object (``NeoXArgs``) is composed
of this class. The launcher also reads ``deepspeed_log_level``, declared with the logging keys:
``deepy.py`` hands :func:`plan_launch <megatron.launcher.command.plan_launch>` the argument object typed
as :class:`DeepSpeedRunnerArgs` and again as ``LoggingArgs``, so nothing is copied. Nothing here imports
DeepSpeed: deepy.py counts and plans the ranks without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import Field

from megatron.config_rules import DERIVED
from megatron.config_schema import ArgGroup, obsolete

LauncherName = Literal["pdsh", "openmpi", "mvapich", "mpich", "slurm", "torchrun"]

AUTOTUNING_REFUSED = (
    "DeepSpeed 0.19.8's autotuner (deepspeed/autotuning/autotuner.py, scheduler.py run_experiment) re-runs the "
    "training script once per experiment, replacing the value after --deepspeed_config with a base64 config whose "
    "ZeRO stage, micro batch and accumulation it picks itself, and reads back the metric file the engine writes "
    "before calling exit() at end_profile_step; Deepy's train.py reads the one config deepy.py resolved and checked "
    "before launch (batch arithmetic, ZeRO and precision rules) and takes no --deepspeed_config, so the "
    "experiments would run unchecked configs or none: remove the key, check a layout's memory with "
    "deepy.py --rehearse N and set train_micro_batch_size_per_gpu and zero_optimization yourself")
"""Why ``autotuning`` and ``autotuning_run`` are refused (GPT-NeoX ea7aefd8 passes ``--autotuning tune|run`` to
DeepSpeed's runner, megatron/neox_arguments/arguments.py ``get_deepspeed_main_args``)."""


class DeepSpeedRunnerArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsDeepspeedRunner`` group, with ``deepspeed_mpi``/``deepspeed_slurm`` of
    ``NeoXArgsOther``."""

    hostfile: str | None = None
    """DeepSpeed hostfile listing nodes and their slots."""

    include: str | None = None
    """Restrict the run to these hosts/devices (`host1:0,1@host2`)."""

    exclude: str | None = None
    """Leave out these hosts/devices."""

    num_nodes: int = Field(-1, ge=-1)
    """Number of nodes to use; -1 means all in the hostfile."""

    num_gpus: int | None = Field(None, ge=1)
    """Processes (devices) per node; on CPU, the number of worker processes."""

    master_port: int = Field(29500, ge=1, le=65535)
    """Port of the rendezvous on the master node; unset, a free port when rank 0 runs on this machine."""

    master_addr: str | None = None
    """Address of the master node; unset means the first host."""

    launcher: LauncherName = "pdsh"
    """How ranks start: `pdsh` (DeepSpeed's runner, local or over ssh), `openmpi`/`mpich`/`mvapich` (mpirun), `slurm` (srun),
    `torchrun` (torch's elastic agent on each node, started locally, by srun in a Slurm allocation or by pdsh over a
    hostfile; `max_restarts` becomes its `--max-restarts`)."""

    force_multi: bool = False
    """With launcher pdsh: go through pdsh even for one node."""

    autotuning_run: Literal["tune", "run"] | None = obsolete(None, AUTOTUNING_REFUSED)
    """Run DeepSpeed's autotuner (`tune` or `run`) instead of training. Refused: DeepSpeed's autotuner re-runs the
    training script with configs that skip deepy.py's checks."""

    no_ssh_check: bool = False
    """Skip the runner's passwordless-ssh check."""

    comment: str | None = None
    """Comment passed to srun (slurm launcher)."""

    account: str | None = None
    """Account passed to srun (slurm launcher)."""

    slurm_requeue: bool = True
    """launcher slurm, in an sbatch job: when its time limit's signal or a preemption stopped the ranks (they
    saved) short of `train_iters`, the job requeues itself (`scontrol requeue`; needs `#SBATCH --requeue`, as in
    tools/slurm/train.sbatch) and resumes from `load`, which must be `save`. False: it ends, to be submitted again
    by hand."""

    max_requeues_without_progress: int = Field(3, ge=1)
    """With `slurm_requeue`: requeues in a row after which the job had no newer checkpoint, before it stops
    (exit code 75) instead of requeueing again; counted in `<save>/slurm_requeues.jsonl`."""

    max_restarts: int = Field(0, ge=0)
    """When a rank dies or the run hangs (`hang_timeout`), stop every rank and launch again, resuming from the last
    committed checkpoint, at most this many times per deepy.py invocation (the same hosts: srun again inside the
    allocation, mpirun or pdsh again); then exit with the failing rank's code. Not for ranks that each run
    deepy.py (in-place launches), nor after a rank refused its input (exit code 2). 0: a failure ends the run."""

    deepspeed_mpi: bool = False
    """deepy.py started by mpirun (one copy per rank) runs the worker in place; ranks read MPI's variables."""

    deepspeed_slurm: bool = False
    """Ranks read their place from Slurm's variables first; deepy.py started by srun runs the worker in place."""


def master_port_chosen(args: DeepSpeedRunnerArgs, provenance: Mapping[str, str] | None = None) -> bool:
    """Whether the user chose ``master_port`` (else a free port is picked where the launch is local).

    ``provenance`` is the resolved config's (key -> where its value came from). Without an entry for
    the key (tests and programmatic callers build the arguments directly) a ``master_port`` other than
    the schema default counts as chosen, as in the config rules.
    """
    source = (provenance or {}).get("master_port")
    if source is None:
        return args.master_port != DeepSpeedRunnerArgs.model_fields["master_port"].default
    return source != DERIVED
