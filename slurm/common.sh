# Shared by the five ringtrain Slurm templates: sourced by them, never run on its own.
#
# It prepares one training step and runs it so that a time limit or a preemption ends in a
# checkpoint and a requeue instead of lost work. The contract with `ringtrain train`:
#   - on SIGUSR1 or SIGTERM every rank writes a checkpoint and exits 75 ("checkpointed, not
#     finished", EX_TEMPFAIL in ringtrain/errors.py); a second signal changes nothing, and no
#     rank exits before all have written theirs (mpirun kills the rest when one exits non-zero);
#   - `--resume` continues from the newest checkpoint in --checkpoint-dir, and is a no-op when
#     there is none, so the first run and every requeued run use the same command.
# A checkpointed step is requeued while the job is still running (the USR1 of --signal before
# the time limit, or `scancel --batch --signal=USR1`). A job Slurm is already ending (scancel,
# the time limit itself) keeps its checkpoint but is not requeued: requeueing would bring a
# cancelled job back to life.
#
# Settings (environment variables, with their defaults):
#   CKPT_DIR        checkpoint folder                       [ckpt-$SLURM_JOB_NAME]
#   RINGTRAIN_VENV  virtual environment to activate         [$RINGTRAIN_HOME/.venv if present]
#   RINGTRAIN_NETWORK  the CIDR ranks talk over, for nodes with several networks  [unset]
#   RINGTRAIN_HOME  the ringtrain checkout (set by the template before sourcing this file)

readonly RINGTRAIN_CHECKPOINTED=75
CKPT_DIR=${CKPT_DIR:-ckpt-${SLURM_JOB_NAME:-ringtrain}}

ringtrain_die() {
  echo "ringtrain job: error: $*" >&2
  exit 1
}

# The environment every rank inherits: the venv that provides `ringtrain`, and one TensorFlow
# thread pool per task sized to the CPUs Slurm gave that task. Without the sizes each rank
# would size its pools to the whole node, and N ranks would fight over the same cores.
ringtrain_prepare() {
  local venv=${RINGTRAIN_VENV:-$RINGTRAIN_HOME/.venv}
  if [[ -f $venv/bin/activate ]]; then
    source "$venv/bin/activate"
  elif [[ -n ${RINGTRAIN_VENV:-} ]]; then
    ringtrain_die "RINGTRAIN_VENV=$RINGTRAIN_VENV has no bin/activate"
  fi
  command -v ringtrain >/dev/null || ringtrain_die "no ringtrain command: set RINGTRAIN_VENV"
  local cpus=${SLURM_CPUS_PER_TASK:-1}
  export OMP_NUM_THREADS=$cpus TF_NUM_INTRAOP_THREADS=$cpus TF_NUM_INTEROP_THREADS=$cpus
  # RINGTRAIN_NETWORK (a CIDR such as 10.77.0.0/24) names the network the ranks talk over:
  # ringtrain turns it into Open MPI's btl_tcp_if_include and oob_tcp_if_include (plus a short
  # keepalive, so a job whose node went silent ends) and Horovod's Gloo interface.
  if [[ -n ${RINGTRAIN_NETWORK:-} ]]; then
    local network
    network=$(python -m ringtrain.launch.network) || ringtrain_die "see the line above"
    eval "$network"
  fi
}

# How ranks start. `srun --mpi=pmix` is the first choice: Debian's Open MPI speaks PMIx to
# Slurm, but was built without PMI-2 (`srun --mpi=pmi2` fails with "OMPI was not built with
# SLURM's PMI support"). Where `srun --mpi=list` offers no pmix, mpirun inside the allocation
# is the fallback: Open MPI reads the nodes and tasks per node from Slurm itself.
# srun gets --cpus-per-task again because Slurm 22.05 steps no longer inherit it from sbatch.
# --kill-on-bad-exit=1 ends the whole step as soon as one task exits non-zero (a rank that
# named a silent peer and aborted), instead of leaving the others to wait for it.
# RINGTRAIN_TASKS_PER_NODE, set by `ringtrain slurm render --nodes MIN-MAX`, places that many
# tasks on every node the job got, however many that is.
ringtrain_launcher() {
  local per_node=${RINGTRAIN_TASKS_PER_NODE:-}
  if srun --mpi=list 2>&1 | grep -qw pmix; then
    launcher=(srun --mpi=pmix --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}")
    if [[ -n $per_node ]]; then
      launcher+=(--ntasks-per-node="$per_node" --ntasks=$((per_node * SLURM_JOB_NUM_NODES)))
    fi
  else
    launcher=(mpirun --bind-to none -x OMP_NUM_THREADS -x TF_NUM_INTRAOP_THREADS
      -x TF_NUM_INTEROP_THREADS)
    if [[ -n $per_node ]]; then
      launcher+=(--npernode "$per_node")
    fi
  fi
}

# Forward a signal to the running step; srun and mpirun pass USR1 and TERM on to every rank.
ringtrain_forward() {
  [[ -n ${ringtrain_step_pid:-} ]] && kill -s "$1" "$ringtrain_step_pid" 2>/dev/null
}

# Run "$@" as the training step and return its exit code; requeue the job when it checkpointed.
# The step runs in the background because bash runs a trap only between commands: a
# foreground step would hold back the USR1 that Slurm sends 60 s before the time limit
# (#SBATCH --signal=B:USR1@60 signals only this batch shell) until it no longer mattered.
ringtrain_step() {
  local launcher
  ringtrain_launcher
  trap 'ringtrain_forward USR1' USR1
  trap 'ringtrain_forward TERM' TERM
  "${launcher[@]}" "$@" &
  ringtrain_step_pid=$!
  # A trapped signal interrupts `wait`, so wait until the step is really gone, then ask bash
  # (which keeps the status of its finished children) for its exit code.
  while kill -0 "$ringtrain_step_pid" 2>/dev/null; do
    wait "$ringtrain_step_pid"
  done
  wait "$ringtrain_step_pid"
  local status=$?
  if ((status == RINGTRAIN_CHECKPOINTED)); then
    if ringtrain_job_ending; then
      echo "ringtrain job: step checkpointed, but job $SLURM_JOB_ID is ending (cancelled or" \
        "out of time), so it is not requeued; resubmit it to resume" >&2
    else
      echo "ringtrain job: step checkpointed before the end; requeueing job $SLURM_JOB_ID" >&2
      scontrol requeue "$SLURM_JOB_ID"
    fi
  elif ((status != 0)); then
    echo "ringtrain job: step exited $status (see the error above); job $SLURM_JOB_ID ends" >&2
  fi
  return "$status"
}

# Whether Slurm is already ending this job. scancel and the time limit send TERM to the batch
# shell and the steps alike, and the job reads COMPLETING from then on; Slurm's --signal and
# `scancel --batch --signal=...` leave it RUNNING. When scontrol cannot tell, requeue.
ringtrain_job_ending() {
  local info
  info=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null)
  [[ $info =~ (^|[[:space:]])JobState=([A-Z_]+) ]] && [[ ${BASH_REMATCH[2]} != RUNNING ]]
}
