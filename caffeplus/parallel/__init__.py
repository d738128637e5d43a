"""Data-parallel training on several GPUs and several machines.

    caffeplus train -solver s.prototxt -gpu 0,1          # one process per GPU, NCCL
    caffeplus train -solver s.prototxt -gpu all
    mpirun -np 8 -H a:4,b:4 caffeplus train -solver s.prototxt -gpu all
    mpirun -np 2 caffeplus train -solver s.prototxt      # CPU ranks, MPI all-reduce

Each rank runs the solver on its own share of the data (the prototxt batch
per rank, so the effective batch is batch x ranks); the gradients are summed
over the ranks and scaled by 1/ranks (Caffe's NCCL semantics) before every
update, so all ranks hold the same weights. Rank 0 logs, tests and writes
the snapshots; `-snapshot` resumes with the same number of ranks.

Modules: launcher (start-up, supervision, MPI), comm (MPI, TCP and NCCL
communicators with one interface), sync (the overlapped gradient
all-reduce), trainer (one rank's solver loop).
"""
from caffeplus.parallel.comm import (Communicator, MPIComm, NCCLComm, SingleComm,  # noqa: F401
                                     TCPComm, mpi_env_world_size)
from caffeplus.parallel.launcher import (check_gpu_launch, launch, mpi_world_size,  # noqa: F401
                                         supervise, validate_gpus)
from caffeplus.parallel.sync import GradientSync, broadcast_params, params_checksum  # noqa: F401


def wants_parallel(gpus):
    """Whether `caffeplus train` should hand over to launch(): several GPUs,
    or a process started by an MPI launcher with more than one rank."""
    return len(gpus) > 1 or mpi_env_world_size() > 1
