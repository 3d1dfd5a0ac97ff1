"""The study's bookkeeping, kept in Optuna's own trial attributes so that every launch (and
`sweep status`) reads the same record: who runs a trial, whether it is still alive, and which
failed trial a retry replaces.

A running trial's group beats every `--trial-heartbeat` seconds (`alive_at`). One that missed
STALE_BEATS beats belongs to a launch that died: the next launch to ask records it as failed
and, unless it was a retry itself, queues a retry with the same parameters, which resumes from
the trial's checkpoint. A trial a stop signal interrupted (a preemption) is retried each time.
`--trials N` counts a trial and its retries once.
"""

from __future__ import annotations

import threading
import time

GROUP, RANKS, HOSTS, LAUNCH = "group", "ranks", "hosts", "launch"
ALIVE_AT, STEPS, SECONDS, REASON, RETRY_OF = "alive_at", "steps", "seconds", "reason", "retry_of"
STALE_BEATS = 3


def counted(trials: list) -> int:
    """Trials towards --trials: a trial and its retries are one."""
    return len({original_number(t) for t in trials})


def original_number(trial) -> int:
    """The trial whose folder (and checkpoint) a retry continues."""
    return int(trial.user_attrs.get(RETRY_OF, trial.number))


def last_heard(trial) -> float:
    alive = trial.user_attrs.get(ALIVE_AT)
    if alive is not None:
        return float(alive)
    return trial.datetime_start.timestamp() if trial.datetime_start else 0.0


def silent(trial, heartbeat_s: float, now: float) -> bool:
    """Whether a running trial missed STALE_BEATS beats."""
    return now - last_heard(trial) > STALE_BEATS * heartbeat_s


def is_stale(trial, launch: str, heartbeat_s: float, now: float) -> bool:
    """Running, not ours, and silent."""
    from optuna.trial import TrialState

    if trial.state != TrialState.RUNNING or trial.user_attrs.get(LAUNCH) == launch:
        return False
    return silent(trial, heartbeat_s, now)


def fail(study, trial_id: int, number: int, reason: str) -> None:
    """Record a trial as failed, with its one-line reason."""
    from optuna.trial import TrialState

    study._storage.set_trial_user_attr(trial_id, REASON, reason)
    study.tell(number, state=TrialState.FAIL)


def fail_and_retry(study, trial, reason: str, always: bool = False) -> None:
    """Record `trial` as failed with `reason` and queue a retry with its parameters, which
    continues its folder: once after a crash (unless it is a retry already), `always` after a
    stop signal (a preempted trial did nothing wrong, and its checkpoint is fresh). A trial
    killed while its parameters were drawn has only some: its retry keeps those and draws the
    rest."""
    fail(study, trial._trial_id, trial.number, reason)
    if always or RETRY_OF not in trial.user_attrs:
        retry = {RETRY_OF: original_number(trial)}
        study.enqueue_trial(dict(trial.params), user_attrs=retry)


def fail_stale(study, launch: str, heartbeat_s: float) -> list:
    """Fail (and retry) the running trials of launches that stopped beating; the trials after."""
    now = time.time()
    trials = study.get_trials(deepcopy=False)
    stale = [t for t in trials if is_stale(t, launch, heartbeat_s, now)]
    for t in stale:
        silent = now - last_heard(t)
        fail_and_retry(study, t, f"interrupted: its launch fell silent {silent:.0f} s ago")
    return study.get_trials(deepcopy=False) if stale else trials


class Heartbeat:
    """Beats for one running trial from a thread, until stopped."""

    def __init__(self, study, trial_id: int, every_s: float):
        self._storage, self._trial_id, self._every = study._storage, trial_id, every_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="trial-heartbeat")
        self._thread.start()

    def _beat(self) -> None:
        while not self._done.wait(self._every):
            try:
                self._storage.set_trial_user_attr(self._trial_id, ALIVE_AT, time.time())
            except Exception:  # a storage hiccup: the next beat tries again
                continue

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
