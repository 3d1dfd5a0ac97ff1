"""`ringtrain sweep run`: many trials at once, inside the allocation the user already has.

The launch's N ranks split into N/G groups of G consecutive ranks (an MPI sub-communicator
each, and a Horovod process set for data parallelism within it). A group's first rank asks
the study for a trial, under the storage's lock, and sends its parameters to the others; the
group trains it as `ringtrain train` would, with the trial's flags on top of the shared ones,
then takes the next trial at once. Optuna decides the trials; its storage keeps the study
through failures and requeues (ledger.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import uuid

import numpy as np

from ringtrain import log
from ringtrain.errors import EXIT_CHECKPOINTED, UserError, alike_on_every_rank
from ringtrain.launch.env import who_am_i
from ringtrain.sweep import ledger
from ringtrain.sweep.flags import OWNED_FLAGS, tensorboard_folder, trial_flags
from ringtrain.sweep.space import Param, as_record, check_names, load_space
from ringtrain.sweep.storage import StorageURL, asking, open_study, parse_storage

WAIT_FOR_OTHERS_S = 2.0  # between looks at another launch's running trials
STORAGE_TIMEOUT_S = 600.0  # for rank 0 to open (or create) the study while the others wait


def train_parser() -> argparse.ArgumentParser:
    """`ringtrain train`'s own parser: the shared flags and every trial's are read by it."""
    from ringtrain.one_line import OneLineParser
    from ringtrain.train_command import add_train_command_arguments

    p = OneLineParser(prog="ringtrain sweep run", allow_abbrev=False)
    add_train_command_arguments(p)
    return p


def takes_value(parser: argparse.ArgumentParser, name: str) -> bool:
    """Whether --name is a train flag a parameter can set (a value, or --x/--no-x)."""
    for action in parser._actions:
        if f"--{name}" in action.option_strings:
            return action.nargs != 0 or isinstance(action, argparse.BooleanOptionalAction)
    return False


def check_sweep(args: argparse.Namespace, world_size: int) -> tuple[list[Param], object, object]:
    """Every check that needs neither the storage nor TensorFlow, alike on every rank: the
    space, the objective, the group size, the shared train flags."""
    space = load_space(args.space)
    parser = train_parser()
    check_names(space, lambda name: takes_value(parser, name))
    for p in space:
        if p.name in OWNED_FLAGS:
            raise UserError(f"search space: {p.name} is set by the sweep for each trial")
    if args.sampler == "grid":
        points = math.prod(len(p.grid_values()) for p in space)
        if args.trials > points:
            raise UserError(f"--trials {args.trials} is more than the grid's {points} points")
    if args.objective != "loss" and not args.objective.startswith("val_"):
        raise UserError(
            f"--objective {args.objective}: want loss or val_METRIC (a held-out metric, e.g. "
            "val_accuracy)"
        )
    if world_size % args.group_size:
        raise UserError(
            f"--group-size {args.group_size} does not divide the {world_size} ranks into groups"
        )
    if args.trial_heartbeat <= 0:
        raise UserError("--trial-heartbeat must be above 0 seconds")
    for token in args.train_argv:
        flag = token.split("=", 1)[0]
        if flag.startswith("--") and flag[2:] in OWNED_FLAGS:
            raise UserError(f"{flag} is set by the sweep in each trial's folder (see --out)")
    as_a_trial = trial_flags(args.train_argv, [], os.path.join("out", "trial"), False)
    shared = parser.parse_args(as_a_trial)  # with the outputs the sweep adds
    check_group_config(shared, args.group_size)
    return space, parser, shared


def check_group_config(args: argparse.Namespace, group_size: int) -> None:
    """The flags checked as `ringtrain train` checks them on a job of the group's size, and
    what a group cannot run yet (these reduce over the whole launch, not over a group)."""
    from ringtrain.train_command import config_from_args, typed_flags
    from ringtrain.validation import validate_flags

    cfg = config_from_args(args)
    if group_size > 1:
        for bad, what in (
            (cfg.strategy == "hybrid", "--strategy hybrid"),
            (cfg.loop == "fit", "--loop fit"),
            (cfg.shard_optimizer, "--shard-optimizer"),
        ):
            if bad:
                raise UserError(f"{what} does not run within a sweep's group of ranks yet")
    validate_flags(cfg, group_size, typed_flags(args))


def run_sweep(args: argparse.Namespace) -> int:
    me = who_am_i()
    with alike_on_every_rank(me.rank):
        space, parser, shared = check_sweep(args, me.world_size)
    storage = parse_storage(args.storage)
    out = os.path.abspath(args.out or os.path.join("sweeps", args.study))
    study = _agreed_study(args, storage, space, shared.seed, me)
    from ringtrain import guard, runtime
    from ringtrain.heartbeat import gather_hosts

    guard.catch_stop_signals()  # a stop between trials must not kill the process
    runtime.init(args.group_size > 1)
    world, group, color = _rank_group(args.group_size)
    hosts = gather_hosts(group.comm)
    launch = f"{os.environ.get('SLURM_JOB_ID') or hosts[0]}-{uuid.uuid4().hex[:8]}"
    launch = _shared_text(world.comm, launch if world.rank == 0 else "")  # one per launch
    leader = group.rank == 0
    ranks = list(range(color * args.group_size, (color + 1) * args.group_size))
    where = f"group {color}, ranks {','.join(map(str, ranks))} on {','.join(sorted(set(hosts)))}"
    while not guard.stop_requested():
        chosen = None
        if leader:
            chosen = _next_trial(study, storage, space, args, launch, color, ranks, hosts)
        chosen = json.loads(_shared_text(group.comm, json.dumps(chosen) if leader else ""))
        if chosen is None or not _run_trial(study, chosen, args, parser, group, where, out, space):
            break
    stopped = guard.stop_requested()
    group.comm.Barrier()
    _wait_for_every_group(world, study, launch, args.trial_heartbeat)
    if me.rank == 0:
        log.info(_summary(study, args))
    return EXIT_CHECKPOINTED if stopped else 0


def _wait_for_every_group(world, study, launch: str, heartbeat_s: float) -> None:
    """The launch ends together, once every group is done. A group whose node went silent
    would hold the others here forever (no connection breaks, so MPI never fails): while they
    wait, each group's first rank watches this launch's running trials, and one that stopped
    beating ends the launch, naming its group and hosts. Its trial is retried by the next."""
    from optuna.trial import TrialState

    from ringtrain.errors import EXIT_SILENT_PEER
    from ringtrain.guard import abort_job

    everyone, looked = world.comm.Ibarrier(), time.monotonic()
    while not everyone.Test():
        time.sleep(0.05)
        if study is None or time.monotonic() - looked < WAIT_FOR_OTHERS_S:
            continue  # the groups' first ranks watch, every few seconds
        looked = time.monotonic()
        now = time.time()
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            mine = t.user_attrs.get(ledger.LAUNCH) == launch
            if mine and ledger.silent(t, heartbeat_s, now):
                group, hosts = t.user_attrs.get(ledger.GROUP), t.user_attrs.get(ledger.HOSTS)
                where = f"group {group} on {','.join(sorted(set(hosts or [])))}"
                quiet = now - ledger.last_heard(t)
                message = f"trial {t.number}'s {where} fell silent: no heartbeat for {quiet:.0f} s"
                abort_job(message, world.rank, EXIT_SILENT_PEER, "ringtrain sweep run")


def _agreed_study(args, storage: StorageURL, space: list[Param], seed: int, me):
    """The study opened (created if new) by rank 0 first, so a refused storage or study stops
    every rank in one line; then by every group's first rank."""
    from ringtrain.train_command import agreed

    record = as_record(space)

    def attempt():
        return open_study(
            storage,
            args.study,
            args.direction,
            record,
            args.objective,
            list(args.train_argv),
            _pruner(args),
        )

    agreed(lambda: attempt() if me.rank == 0 else None, me, STORAGE_TIMEOUT_S)
    if me.rank % args.group_size:
        return None
    study = attempt()
    study.sampler = _sampler(args, space, seed, me.rank, len(study.get_trials(deepcopy=False)))
    return study


def _sampler(args, space: list[Param], seed: int, rank: int, trials_before: int):
    """Each group's own seed, and each launch's: the same seed would propose the same
    parameters in every group, and a continued study would repeat its first launch's. The
    grid instead shuffles its points by one seed, and hands them out by trial number."""
    import optuna

    if args.sampler == "grid":  # the same order everywhere: trial N takes grid point N
        return _grid({p.name: p.grid_values() for p in space}, seed)
    seed = (seed * 1000 + rank) * 100_003 + trials_before
    if args.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=args.startup_trials)


def _grid(space: dict, seed: int):
    """Optuna's grid sampler, without its stop once every point is visited: that stop works
    only inside study.optimize (elsewhere it raises), and --trials ends a sweep here."""
    import optuna

    class SweepGrid(optuna.samplers.GridSampler):
        def after_trial(self, study, trial, state, values) -> None:
            return None

    return SweepGrid(space, seed=seed)


def _pruner(args):
    import optuna

    if args.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=args.startup_trials)
    if args.pruner == "halving":
        return optuna.pruners.SuccessiveHalvingPruner()
    return optuna.pruners.NopPruner()


def _rank_group(group_size: int):
    """This rank's group as a World of its own: (the launch's world, the group, its index)."""
    from ringtrain import runtime

    world_size = who_am_i().world_size
    groups = [list(range(g, g + group_size)) for g in range(0, world_size, group_size)]
    sets = groups if 1 < group_size < world_size else None
    world = runtime.start(with_horovod=group_size > 1, process_sets=sets)
    color = world.rank // group_size
    comm = world.comm.Split(color, world.rank)
    return (
        world,
        runtime.World(
            comm.Get_rank(),
            comm.Get_size(),
            world.local_rank,
            world.local_size,
            comm,
            world.hvd if group_size > 1 else None,
            None,
            world.launcher,
            world.process_sets[color] if sets else None,
        ),
        color,
    )


def _shared_text(comm, text: str) -> str:
    """Rank 0's text on every rank of `comm`: a length, then the bytes (no pickle)."""
    raw = np.frombuffer(text.encode(), np.uint8)
    size = np.array([len(raw)], np.int64)
    comm.Bcast(size, root=0)
    buf = raw.copy() if comm.Get_rank() == 0 else np.empty(int(size[0]), np.uint8)
    comm.Bcast(buf, root=0)
    return buf.tobytes().decode()


def _next_trial(study, storage, space, args, launch, color, ranks, hosts) -> dict | None:
    """The next trial for this group, asked under the storage's lock: a queued retry first,
    then a new one while the study has fewer than --trials; None when the study is done. A
    trial another launch still runs is waited for: if that launch died, it goes stale and is
    retried here."""
    from optuna.trial import TrialState

    while True:
        with asking(storage):
            trials = ledger.fail_stale(study, launch, args.trial_heartbeat)
            waiting = any(t.state == TrialState.WAITING for t in trials)
            if waiting or ledger.counted(trials) < args.trials:
                trial = study.ask()
                values = {p.name: _suggest(trial, p) for p in space}
                for key, value in (
                    (ledger.LAUNCH, launch),
                    (ledger.GROUP, color),
                    (ledger.RANKS, ranks),
                    (ledger.HOSTS, hosts),
                    (ledger.ALIVE_AT, time.time()),
                ):
                    trial.set_user_attr(key, value)
                retry_of = trial.user_attrs.get(ledger.RETRY_OF)
                return {
                    "number": trial.number,
                    "id": trial._trial_id,
                    "params": values,
                    "retry_of": retry_of,
                }
            others = [
                t
                for t in trials
                if t.state == TrialState.RUNNING and t.user_attrs.get(ledger.LAUNCH) != launch
            ]
        if not others:
            return None
        time.sleep(WAIT_FOR_OTHERS_S)


def _suggest(trial, p: Param):
    if p.choices is not None:
        return trial.suggest_categorical(p.name, list(p.choices))
    if p.type == "int":
        return trial.suggest_int(p.name, int(p.low), int(p.high), step=int(p.step or 1), log=p.log)
    return trial.suggest_float(p.name, float(p.low), float(p.high), step=p.step, log=p.log)


def _run_trial(study, chosen: dict, args, parser, group, where: str, out: str, space) -> bool:
    """Train one trial on this group and record it (its first rank does); False when a stop
    signal interrupted it (it is then failed with its checkpoint kept, and retried)."""
    from ringtrain import runtime
    from ringtrain.sweep.trial import Pruning, write_hparams
    from ringtrain.train_command import train_from_args

    number, leader, retry_of = chosen["number"], group.rank == 0, chosen["retry_of"]
    folder = os.path.join(out, f"trial-{number if retry_of is None else retry_of:05d}")
    params = chosen["params"]
    if leader:
        os.makedirs(folder, exist_ok=True)
        again = "" if retry_of is None else f" (retry of trial {retry_of})"
        said = " ".join(f"{k}={v}" for k, v in params.items())
        log.each_rank(f"trial {number}{again}: {where}: {said}")
    by_name = {p.name: p for p in space}
    flags = [by_name[name].flags(value) for name, value in params.items()]
    argv = trial_flags(args.train_argv, flags, folder, retry_of is not None)
    board = tensorboard_folder(argv)
    if leader and board:
        os.makedirs(os.path.dirname(board), exist_ok=True)
    group.comm.Barrier()  # the folders exist before any rank checks its outputs
    beat = ledger.Heartbeat(study, chosen["id"], args.trial_heartbeat) if leader else None
    pruning = Pruning(study if leader else None, chosen["id"], args.objective)
    started = time.perf_counter()
    reason, metrics = None, None
    try:
        trial_args = parser.parse_args(argv)
        check_group_config(trial_args, args.group_size)
        with runtime.acting_as(group):
            _, result = train_from_args(trial_args, callbacks=[pruning])
        metrics = result.metrics
    except UserError as exc:
        if not exc.together and group.size > 1:
            raise  # one rank's own failure: the launch ends (the guard's bounds)
        reason = str(exc)
    finally:
        if beat:
            beat.stop()
    finished = metrics is None or metrics.get("finished", True)
    if leader:
        if board and metrics is not None:
            write_hparams(board, params, number)
        seconds = time.perf_counter() - started
        _record(study, chosen, metrics, reason, pruning, args.objective, seconds)
    return finished


def _record(study, chosen, metrics, reason, pruning, objective: str, seconds: float) -> None:
    """The trial's outcome in the study: its value, or pruned, or failed with its reason."""
    from optuna.trial import TrialState

    storage, trial_id, number = study._storage, chosen["id"], chosen["number"]
    if metrics is not None:
        storage.set_trial_user_attr(trial_id, ledger.STEPS, metrics["steps"])
    storage.set_trial_user_attr(trial_id, ledger.SECONDS, round(seconds, 3))
    if reason is None and metrics.get("finished", True) and not pruning.pruned:
        value = pruning.final_value(metrics)
        if value is not None:
            study.tell(number, value)
            log.each_rank(f"trial {number} done: {objective} {value:.4f}")
            return
        reason = f"the run reported no {objective}"
    if reason is not None:
        ledger.fail(study, trial_id, number, reason)
        log.each_rank(f"trial {number} failed: {reason}")
    elif pruning.pruned:
        study.tell(number, state=TrialState.PRUNED)
        log.each_rank(f"trial {number} pruned after epoch {pruning.epochs}")
    else:  # a stop signal: checkpointed, not finished
        frozen = study._storage.get_trial(trial_id)
        why = "interrupted by a stop signal; its checkpoint is kept"
        ledger.fail_and_retry(study, frozen, why, always=True)
        log.each_rank(f"trial {number} interrupted: checkpointed, to be retried")


def _summary(study, args) -> str:
    """The study in one line once this launch is done; `sweep status` tells the rest."""
    from collections import Counter

    states = Counter(t.state.name.lower() for t in study.get_trials(deepcopy=False))
    said = ", ".join(f"{n} {state}" for state, n in sorted(states.items())) or "no trials yet"
    line = f"study {args.study}: {said}"
    if states.get("complete"):
        best = study.best_trial
        line += f"; best trial {best.number}, {args.objective} {best.value:.4f}"
    return f"{line} (ringtrain sweep status {args.study} --storage {args.storage})"
