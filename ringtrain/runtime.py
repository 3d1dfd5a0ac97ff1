"""Process start-up shared by every strategy: MPI, thread pools, Horovod.

Order matters: threads are fixed before TensorFlow runs an op, MPI starts with MULTIPLE thread
support before Horovod (which then shares that MPI), and Open MPI's busy-polling is tamed where
a rank has no core to spare (an idle rank that spins steals the core something else computes on).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ringtrain import log
from ringtrain.errors import UserError
from ringtrain.launch.env import as_group, who_am_i
from ringtrain.proc import thread_ids


@dataclass
class World:
    """Who this process is in the job, and the communicators the strategies use."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    comm: object  # mpi4py COMM_WORLD
    hvd: object | None = None  # horovod.tensorflow, when the strategy averages gradients
    process_sets: list | None = None  # Horovod process sets, in the order they were asked for
    launcher: str = "single"  # what started the job (who_am_i's source); decides --progress auto
    process_set: object | None = None  # what data parallelism averages over; None: every rank


def default_threads(local_size: int) -> int:
    """One pool per rank, sized to its share of the cores, unless Slurm or the user says."""
    for name in ("RINGTRAIN_THREADS", "SLURM_CPUS_PER_TASK"):
        if os.environ.get(name, "").isdigit():
            return max(1, int(os.environ[name]))
    return max(1, int(cores_per_rank(local_size)))


def cores_per_rank(local_size: int) -> float:
    """This rank's share of the cores it may run on. A bound rank (mpirun's binding, a
    rehearsal node's taskset, a Slurm cgroup) owns its whole mask; an unbound one shares the
    machine with its node's other ranks."""
    mine = len(os.sched_getaffinity(0))
    return mine if is_bound() else mine / max(1, local_size)


def is_bound() -> bool:
    """Whether a launcher, taskset or cgroup gave this rank fewer cores than the machine has:
    then it owns them, with no other job's compute beside it."""
    return len(os.sched_getaffinity(0)) < (os.cpu_count() or 1)


def inter_op_threads(threads: int, with_horovod: bool) -> int:
    """At least two where Horovod averages gradients. Its allreduce is an asynchronous kernel,
    and with one inter-op thread TensorFlow's executor dispatches it only once the chain of
    backward ops it runs inline is done, so no bucket starts before the backward ends. A second
    thread only hands each bucket to Horovod as it is ready; the compute stays on the intra-op
    pool."""
    return max(threads, 2) if with_horovod else threads


def tune_environment(local_size: int) -> None:
    """Defaults for a rank without a core to spare (bound to one core, or ranks filling the
    node), where MPI's waiting takes the compute's core; the environment overrides each.
    Horovod's thread goes below the compute only on a core the rank owns: unbound, it would
    also wait behind every other process on the node (seen: hybrid ranks of twelve jobs on two
    cores silent past a 20 s --comm-timeout, their heartbeats too)."""
    spare_core = cores_per_rank(local_size) >= 2
    if not spare_core:
        os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    os.environ.setdefault("HOROVOD_CYCLE_TIME", default_cycle_time(spare_core))
    below_compute = not spare_core and is_bound()
    os.environ.setdefault("RINGTRAIN_HOROVOD_NICE", "19" if below_compute else "0")


def init_horovod(hvd, comm, process_sets: list | None = None) -> None:
    """hvd.init on `comm`, its background thread at the niceness RINGTRAIN_HOROVOD_NICE says
    (19 where a bound rank has no core to spare). That thread waits in MPI between coordination
    rounds, and at the compute's priority it took about half of a rank's only core: a step of
    `bench dp`'s heavy CNN here took 74.5 ms against 36.5 ms of compute, and 39.9 against
    37.6 with the thread at 19. The thread still runs whenever the compute waits for it."""
    nice = horovod_nice()
    before = thread_ids()
    hvd.init(comm=comm, process_sets=process_sets) if process_sets else hvd.init(comm=comm)
    if nice:
        for thread in thread_ids() - before:
            os.setpriority(os.PRIO_PROCESS, thread, nice)


def horovod_nice() -> int:
    raw = os.environ.get("RINGTRAIN_HOROVOD_NICE", "0").strip()
    if not raw.isdigit() or int(raw) > 19:
        raise UserError(f"RINGTRAIN_HOROVOD_NICE={raw!r}: want a niceness from 0 to 19")
    return int(raw)


def default_cycle_time(spare_core: bool) -> str:
    """Milliseconds between Horovod's coordination rounds. Without a spare core a short cycle
    takes the compute's core, and a long one delays every allreduce by up to a cycle: with
    MPI yielding, a plain Horovod step of `bench dp`'s heavy CNN here cost 2.1 ms over its
    compute at 0.5 ms, 2.1 at 1, 3.5 at 2 and 5.9 at 5 across two one-core nodes (-0.7, 1.7
    and 5.4 at 1, 2 and 5 on one host). With a core to spare, 0.1 ms cuts a small
    allreduce's latency further."""
    return "0.1" if spare_core else "1"


_launched_by: list[str] = []  # what started the job, as seen before ringtrain started MPI


def start_mpi(local_size: int):
    """MPI with MULTIPLE thread support, after the node defaults it reads; returns COMM_WORLD.
    Safe to call again: MPI starts once."""
    if not _launched_by:  # once MPI runs, who_am_i would say "mpi4py" whoever launched us
        _launched_by.append(who_am_i().source)
    tune_environment(local_size)
    import mpi4py

    mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    return MPI.COMM_WORLD


_sized: list[bool] = []  # whether this process's thread pools were sized by ringtrain


def size_threads(with_horovod: bool = True) -> bool:
    """Size TensorFlow's thread pools to this rank's share of the cores, and pick its GPU.
    Possible only before TensorFlow runs its first op; False when it already has (and
    ringtrain did not size them first)."""
    if _sized:
        return _sized[0]
    me = who_am_i()
    from ringtrain.tensorflow_loader import tf

    threads = default_threads(me.local_size)
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(
            inter_op_threads(threads, with_horovod)
        )
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:  # one GPU per rank, chosen by local rank
            tf.config.set_visible_devices(gpus[me.local_rank % len(gpus)], "GPU")
    except RuntimeError:  # "cannot be modified after initialization"
        _sized.append(False)
        return False
    _sized.append(True)
    return True


def init(with_horovod: bool = True) -> None:
    """For a script that builds its own Keras model: call first, so each rank's TensorFlow
    runs on its share of the cores (as horovod's users call hvd.init() first)."""
    start_mpi(who_am_i().local_size)
    size_threads(with_horovod)


_acting: list[World] = []  # a sweep's rank group, while one of its trials trains


@contextmanager
def acting_as(group: World) -> Iterator[None]:
    """Train as if `group` were the whole job: who_am_i answers with its ranks, start() returns
    it, and the checks every rank agrees on run on its communicator. A sweep packs its trials
    this way, one per group of ranks, inside one launch (MPI and Horovod started once)."""
    _acting.append(group)
    try:
        with as_group(group.rank, group.size):
            yield
    finally:
        _acting.pop()


def communicator(local_size: int):
    """The communicator this job's ranks agree on: the acting group's, else COMM_WORLD."""
    return _acting[-1].comm if _acting else start_mpi(local_size)


def start(
    with_horovod: bool, process_sets: list[list[int]] | None = None, horovod_later: bool = False
) -> World:
    """Initialise MPI (and Horovod on the same communicator) and size TensorFlow's thread pools;
    `horovod_later` sizes them for a Horovod that the caller starts itself (the benchmarks).
    Inside acting_as, the group: already started."""
    if _acting:
        return _acting[-1]
    me = who_am_i()
    comm = start_mpi(me.local_size)
    log.set_rank(comm.Get_rank())
    if not size_threads(with_horovod or horovod_later) and comm.Get_rank() == 0:
        log.info(
            "warning: TensorFlow ran before ringtrain started, so its thread pools keep their "
            "default size; call ringtrain.init() before building the model"
        )
    hvd, sets = None, []
    if with_horovod:
        import horovod.tensorflow as hvd

        sets = [hvd.ProcessSet(ranks) for ranks in process_sets or []]
        init_horovod(hvd, comm, sets)
    return World(
        comm.Get_rank(),
        comm.Get_size(),
        me.local_rank,
        me.local_size,
        comm,
        hvd,
        sets,
        _launched_by[0],
    )
