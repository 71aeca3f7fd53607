"""Keys that become command-line arguments of the DeepSpeed runner (``deepspeed`` launcher): hosts,
processes per node, rendezvous and the multi-node launcher.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron.config_schema import ArgGroup, not_supported


class DeepSpeedRunnerArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsDeepspeedRunner`` group."""

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

    launcher: Literal["pdsh", "openmpi", "mvapich", "mpich", "slurm"] = "pdsh"
    """How ranks start: `pdsh` (DeepSpeed's runner, local or over ssh), `openmpi`/`mpich`/`mvapich` (mpirun), `slurm` (srun)."""

    force_multi: bool = False
    """With launcher pdsh: go through pdsh even for one node."""

    autotuning_run: Literal["tune", "run"] | None = not_supported(None)
    """Run DeepSpeed's autotuner (`tune` or `run`) instead of training."""

    no_ssh_check: bool = False
    """Skip the runner's passwordless-ssh check."""

    comment: str | None = None
    """Comment passed to srun (slurm launcher)."""

    account: str | None = None
    """Account passed to srun (slurm launcher)."""
