"""The launch package: rank detection, node lists and hostfiles, Slurm scripts and their CLI.
Everything here runs in seconds without MPI or Slurm; the Slurm scripts run against fake
srun, mpirun, scontrol and ringtrain commands."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ringtrain.launch.env import RankInfo, is_rank0, who_am_i
from ringtrain.launch.hostfile import (
    check_hostfile,
    expand_nodelist,
    expand_tasks_per_node,
    parse_hostfile,
    to_horovod,
    to_mpirun,
)
from ringtrain.launch.slurm_render import (
    REPO_ROOT,
    TEMPLATE_DIR,
    render,
    template_path,
    time_limit_seconds,
)

HOSTFILES = REPO_ROOT / "hostfiles"
TEMPLATES = sorted(TEMPLATE_DIR.glob("*.sbatch"))
BASH = shutil.which("bash")


@pytest.fixture(autouse=True)
def no_running_mpi(monkeypatch):
    """Another test in the session may have started MPI; here only the environment speaks."""
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)


# --- who am I ---------------------------------------------------------------------------------

SLURM_BATCH_VARS = {
    "SLURM_JOB_ID": "7",
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURMD_NODENAME": "node01",
}
SLURM_STEP_VARS = {
    **SLURM_BATCH_VARS,
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "2",
    "SLURM_NODEID": "1",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURMD_NODENAME": "node02",
}
OPEN_MPI_VARS = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "PMIX_RANK": "3",
}
HOST = socket.gethostname()


@pytest.mark.parametrize(
    "environ, expected",
    [
        pytest.param({}, RankInfo(0, 1, 0, 1, HOST, "single"), id="no-launcher"),
        pytest.param(OPEN_MPI_VARS, RankInfo(3, 4, 1, 2, HOST, "open-mpi"), id="mpirun"),
        pytest.param(
            {**SLURM_BATCH_VARS, **OPEN_MPI_VARS},
            RankInfo(3, 4, 1, 2, "node01", "open-mpi"),
            id="mpirun-inside-sbatch",
        ),
        pytest.param(
            {**SLURM_STEP_VARS, "PMIX_RANK": "2"},
            RankInfo(2, 4, 0, 2, "node02", "pmix"),
            id="srun-mpi-pmix",
        ),
        pytest.param(
            {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"},
            RankInfo(5, 8, 1, 4, HOST, "pmi"),
            id="hydra-pmi",
        ),
        pytest.param(
            {"PMI_RANK": "1", "PMI_SIZE": "2"},
            RankInfo(1, 2, 1, 2, HOST, "pmi"),
            id="pmi-without-local-vars-means-one-node",
        ),
        pytest.param(
            {
                **SLURM_STEP_VARS,
                "SLURM_PROCID": "4",
                "SLURM_NTASKS": "5",
                "SLURM_LOCALID": "1",
                "SLURM_STEP_TASKS_PER_NODE": "3,2",
            },
            RankInfo(4, 5, 1, 2, "node02", "slurm"),
            id="srun-step",
        ),
        pytest.param(
            SLURM_BATCH_VARS,
            RankInfo(0, 1, 0, 1, "node01", "single"),
            id="sbatch-script-is-not-a-rank",
        ),
    ],
)
def test_rank_is_read_from_each_launcher(environ, expected):
    assert who_am_i(environ) == expected


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"PMIX_RANK": "1"}, "no launcher variable gives the world size"),
        ({**OPEN_MPI_VARS, "OMPI_COMM_WORLD_RANK": "4"}, "rank 4 is outside a world of 4"),
        ({**OPEN_MPI_VARS, "OMPI_COMM_WORLD_SIZE": "four"}, "OMPI_COMM_WORLD_SIZE='four'"),
        ({"PMI_RANK": "0"}, "PMI_SIZE is not set"),
        ({**SLURM_STEP_VARS, "SLURM_NODEID": "2"}, "SLURM_NODEID=2"),
    ],
)
def test_inconsistent_launcher_variables_fail_loudly(environ, message):
    with pytest.raises(ValueError, match=message):
        who_am_i(environ)


def fake_mpi(rank: int, size: int, finalized: bool = False) -> SimpleNamespace:
    world = SimpleNamespace(Get_rank=lambda: rank, Get_size=lambda: size)
    return SimpleNamespace(
        Is_initialized=lambda: True, Is_finalized=lambda: finalized, COMM_WORLD=world
    )


def test_running_mpi_wins_over_the_environment(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", fake_mpi(1, 2))
    assert who_am_i({"PMI_RANK": "0", "PMI_SIZE": "2"}) == RankInfo(1, 2, 1, 2, HOST, "mpi4py")


def test_finalized_mpi_is_not_asked(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", fake_mpi(1, 2, finalized=True))
    assert who_am_i(OPEN_MPI_VARS).source == "open-mpi"


def test_who_am_i_never_starts_mpi():
    who_am_i(OPEN_MPI_VARS)
    assert "mpi4py.MPI" not in sys.modules


@pytest.mark.parametrize("rank, expected", [("0", True), ("1", False)])
def test_is_rank0_reads_the_process_environment(monkeypatch, rank, expected):
    for name, value in {**OPEN_MPI_VARS, "OMPI_COMM_WORLD_RANK": rank}.items():
        monkeypatch.setenv(name, value)
    assert is_rank0() is expected


# --- node lists, tasks per node, hostfiles ------------------------------------------------------


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("node[01-02],gpu-a[1-2],login", ["node01", "node02", "gpu-a1", "gpu-a2", "login"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("node[8-11]", ["node8", "node9", "node10", "node11"]),
        ("node[098-101]", ["node098", "node099", "node100", "node101"]),
        ("login", ["login"]),
        ("a[1],b.example.org", ["a1", "b.example.org"]),
        (" node1\n", ["node1"]),
    ],
)
def test_nodelist_expands_like_slurm(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize(
    "text",
    [
        "",
        "node[1-",
        "node1]",
        "a,,b",
        "node[3-1]",
        "node[a-b]",
        "n[[1]]",
        "n[]",
        "node 1",
        "n[1-2-3]",
        "n[1-9999999]",
        "node[1-2];id",
    ],
)
def test_bad_nodelist_is_one_line_error(text):
    with pytest.raises(ValueError) as error:
        expand_nodelist(text)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "spec, n_nodes, counts",
    [
        ("4(x2),2", 3, [4, 4, 2]),
        ("1", 1, [1]),
        ("2(x3)", 3, [2, 2, 2]),
        ("3,2", 2, [3, 2]),
    ],
)
def test_tasks_per_node_expands(spec, n_nodes, counts):
    assert expand_tasks_per_node(spec, n_nodes) == counts


@pytest.mark.parametrize(
    "spec, n_nodes",
    [
        ("4(x2)", 3),
        ("4(x2),2", 2),
        ("0", 1),
        ("2(x0),1", 1),
        ("x", 1),
        ("4(2)", 1),
        ("", 1),
        ("4 (x2)", 2),
        ("4(x999999999)", 2),
    ],
)
def test_bad_tasks_per_node_is_rejected(spec, n_nodes):
    with pytest.raises(ValueError):
        expand_tasks_per_node(spec, n_nodes)


@pytest.mark.parametrize(
    "text",
    [
        "localhost slots=2\n",
        "# two nodes\n\nnode1 slots=4 max_slots=8\nnode2 slots = 2  # the small one\n",
    ],
)
def test_good_mpirun_hostfile_has_no_problems(text):
    assert check_hostfile(text) == []


@pytest.mark.parametrize(
    "text, tool, problem",
    [
        ("node1\n", "mpirun", "line 1: no slots=N for 'node1'"),
        ("node1 slots=0\n", "mpirun", "line 1: slots=0: a host needs at least one slot"),
        ("node1 slots=two\n", "mpirun", "line 1: slots='two' is not a whole number"),
        ("node1 slots=2\nnode1 slots=2\n", "mpirun", "line 2: duplicate host 'node1' (first on"),
        ("node1 slots=2 cpus=4\n", "mpirun", "line 1: unknown key 'cpus'"),
        ("slots=2\n", "mpirun", "line 1: expected a host name first"),
        ("# c\nnode1 slots=2 garbage\n", "mpirun", "line 2: unexpected 'garbage'"),
        ("node1 slots=4 max_slots=2\n", "mpirun", "line 1: max_slots=2 is below slots=4"),
        ("node1 slots=2 slots=3\n", "mpirun", "line 1: slots= given twice"),
        ("# only a comment\n", "mpirun", "line 1: no hosts"),
        ("# c\nnode1 slots=2\n", "horovodrun", "line 1: comment: horovodrun"),
        ("node1 slots=2\n\nnode2 slots=2\n", "horovodrun", "line 2: blank line: horovodrun"),
        (
            "node1 slots=2 max_slots=4\n",
            "horovodrun",
            "line 1: horovodrun reads only 'host slots=N'",
        ),
        ("node1 slots=2 # x\n", "horovodrun", "line 1: trailing comment"),
        ("node1 slots = 2\n", "horovodrun", "line 1: horovodrun reads only 'host slots=N'"),
    ],
)
def test_hostfile_problem_is_reported_with_its_line(text, tool, problem):
    problems = check_hostfile(text, tool)
    assert len(problems) == 1 and problems[0].startswith(problem)


def test_repo_hostfiles_pass_for_their_tool():
    assert check_hostfile((HOSTFILES / "localhost.horovod").read_text(), "horovodrun") == []
    for name in ("localhost.horovod", "localhost.mpirun", "two-nodes.mpirun"):
        assert check_hostfile((HOSTFILES / name).read_text(), "mpirun") == [], name


def test_commented_hostfile_fails_for_horovodrun():
    problems = check_hostfile((HOSTFILES / "localhost.mpirun").read_text(), "horovodrun")
    assert problems and problems[0].startswith("line 1: comment")


def test_hostlist_example_is_the_two_node_hostfile_converted():
    hosts, _ = parse_hostfile((HOSTFILES / "two-nodes.mpirun").read_text())
    assert to_horovod(hosts) == (HOSTFILES / "two-nodes.hostlist").read_text().strip()


def test_converters_write_what_the_checker_accepts():
    pairs = [("node01", 4), ("node02", 2)]
    assert to_mpirun(pairs) == "node01 slots=4\nnode02 slots=2\n"
    assert to_horovod(pairs) == "node01:4,node02:2"
    assert parse_hostfile(to_mpirun(pairs), "horovodrun") == (pairs, [])


@pytest.mark.parametrize("pairs", [[], [("a", 1), ("a", 2)], [("a", 0)], [("a b", 1)]])
def test_converters_refuse_what_the_checker_would_reject(pairs):
    with pytest.raises(ValueError):
        to_mpirun(pairs)


@pytest.mark.parametrize(
    "text",
    [
        "localhost slots=2\n",
        "# c\nnode1 slots=2\n",
        "node1 slots=2\n\n",
        "node1 slots=2 max_slots=4\n",
        "node1 slots=2 # x\n",
        "node1 slots = 2\n",
    ],
)
def test_horovodrun_check_agrees_with_horovods_own_reader(tmp_path, text):
    from horovod.runner.common.util import hosts  # the reader horovodrun itself uses

    path = tmp_path / "hostfile"
    path.write_text(text)
    try:
        hosts.parse_hosts_and_slots(hosts.parse_host_files(str(path)))
        horovod_reads_it = True
    except (IndexError, ValueError):
        horovod_reads_it = False
    assert horovod_reads_it == (check_hostfile(text, "horovodrun") == [])


# --- Slurm templates and rendering --------------------------------------------------------------


def bash_syntax_ok(script: str) -> bool:
    return subprocess.run([BASH, "-n"], input=script, text=True).returncode == 0


def test_templates_are_plain_sbatch_scripts():
    assert [t.name for t in TEMPLATES] == [
        "data-1node.sbatch",
        "data-multinode.sbatch",
        "hybrid.sbatch",
        "pipeline.sbatch",
        "sweep.sbatch",
    ]
    assert bash_syntax_ok((TEMPLATE_DIR / "common.sh").read_text())
    for template in TEMPLATES:
        text = template.read_text()
        assert bash_syntax_ok(text), template.name
        for line in (
            "#SBATCH --output=%x-%j.out",
            "#SBATCH --signal=B:USR1@60",
            "#SBATCH --requeue",
            'source "$RINGTRAIN_HOME/slurm/common.sh"',
        ):
            assert line in text, (template.name, line)
        if template.stem == "sweep":  # its trials resume by themselves when retried
            assert "ringtrain_step ringtrain sweep run " in text
        else:
            assert "ringtrain train --strategy " + template.stem.split("-")[0] in text
            assert "--resume" in text, template.name


@pytest.mark.parametrize(
    "strategy, nodes, tasks, pp_size, template",
    [
        ("data", 1, 4, None, "data-1node.sbatch"),
        ("data", 3, 2, None, "data-multinode.sbatch"),
        ("pipeline", 1, 4, None, "pipeline.sbatch"),
        ("pipeline", 2, 2, 4, "pipeline.sbatch"),
        ("hybrid", 2, 3, 3, "hybrid.sbatch"),
        ("sweep", 2, 4, None, "sweep.sbatch"),
    ],
)
def test_render_rewrites_the_settings(strategy, nodes, tasks, pp_size, template):
    assert template_path(strategy, nodes).name == template
    script = render(
        strategy,
        nodes,
        tasks,
        "1-12:00",
        pp_size=pp_size,
        job_name="exp.1_a-b",
        train_args=["--epochs", "5"],
    )
    for line in (
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={tasks}",
        "#SBATCH --time=1-12:00",
        "#SBATCH --job-name=exp.1_a-b",
        "(($#)) || set -- --epochs 5",
    ):
        assert line + "\n" in script
    assert (f"PP_SIZE=${{PP_SIZE:-{pp_size}}}" in script) == (strategy == "hybrid")
    assert bash_syntax_ok(script)


def run_bash(script: str, cwd: Path) -> str:
    return subprocess.run(
        [BASH, "-c", script],
        cwd=cwd,
        text=True,
        capture_output=True,
        check=True,
        env={"PATH": os.environ["PATH"]},
    ).stdout


def test_rendered_script_finds_this_checkout(tmp_path):
    script = render("data", 1, 2, "10")
    home_line = next(line for line in script.splitlines() if line.startswith("RINGTRAIN_HOME="))
    assert run_bash(home_line + '; printf %s "$RINGTRAIN_HOME"', tmp_path) == str(REPO_ROOT)


def test_train_args_are_quoted_so_no_shell_code_runs(tmp_path):
    hostile = [
        "x; rm -rf /",
        "$(touch pwned)",
        "`touch pwned`",
        "a'b",
        "back\\slash",
        "*",
        "two\nlines",
        "--lr=0.1",
    ]
    script = render("pipeline", 1, 2, "30:00", train_args=hostile)
    assert bash_syntax_ok(script)
    set_line = next(line for line in script.splitlines() if line.startswith("(($#)) || set --"))
    assert "set -- 'x; rm -rf /' '$(touch pwned)' '`touch pwned`'" in set_line
    args_block = script[script.index("(($#)) || set --") : script.index("\nsource ")]
    printed = run_bash(args_block + "\nprintf '%s\\0' \"$@\"", tmp_path)
    assert printed.split("\0")[:-1] == hostile
    assert not (tmp_path / "pwned").exists()


def test_a_node_range_asks_for_cpus_per_node_and_lets_the_step_place_the_tasks():
    """Slurm sizes a --nodes=MIN-MAX job with --ntasks-per-node to MIN nodes; a range
    therefore asks for the tasks' CPUs on each node and sets the tasks per node for srun."""
    script = render("hybrid", (1, 2), 2, "10", pp_size=2)
    assert bash_syntax_ok(script)
    lines = script.splitlines()
    assert "#SBATCH --nodes=1-2" in lines and "#SBATCH --mincpus=2" in lines
    assert not any(line.startswith("#SBATCH --ntasks-per-node") for line in lines)
    assert lines.index("RINGTRAIN_TASKS_PER_NODE=2") + 1 == next(
        i for i, line in enumerate(lines) if line.startswith("source ")
    )
    pipeline = render("pipeline", (1, 2), 1, "10")  # the resume refuses other stage counts
    assert "#SBATCH --nodes=1-2" in pipeline.splitlines()
    with pytest.raises(ValueError, match="does not divide"):  # one node: 1 task, 2 stages
        render("hybrid", (1, 2), 1, "10", pp_size=2)


@pytest.mark.parametrize("job_name", ["x;id", "$(id)", "a b", "", "x\n", "n" * 65, "ünï"])
def test_job_name_outside_the_safe_set_is_rejected(job_name):
    with pytest.raises(ValueError, match="job name"):
        render("data", 1, 2, "10", job_name=job_name)


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("30", 1800),
        ("30:15", 1815),
        ("01:30:00", 5400),
        ("48:00:00", 172800),
        ("2-12", 216000),
        ("1-00:30", 88200),
        ("1-00:00:30", 86430),
    ],
)
def test_slurm_time_formats_are_accepted(text, seconds):
    assert time_limit_seconds(text) == seconds


@pytest.mark.parametrize(
    "text",
    [
        "",
        "0",
        "00:00:00",
        "1h",
        "abc",
        " 10",
        "10 ",
        "10\n",
        "-5",
        "1-",
        "1:2:3:4",
        "25:60",
        "1:60:00",
        "1-24",
        "1-10:60",
        "400-00",
        "1--2",
        "1:",
        "UNLIMITED",
        "１０",
    ],
)
def test_bad_time_is_rejected(text):
    with pytest.raises(ValueError, match="time"):
        render("data", 1, 2, text)


@pytest.mark.parametrize(
    "strategy, nodes, tasks, pp_size, message",
    [
        ("hybrid", 2, 3, 4, "--pp-size 4 does not divide the 6 tasks"),
        ("hybrid", 1, 4, 8, "does not divide"),
        ("hybrid", 1, 4, 0, "does not divide"),
        ("hybrid", 1, 4, None, "hybrid needs --pp-size"),
        ("data", 1, 4, 2, "data parallelism has no stages"),
        ("sweep", 1, 4, 2, "a sweep's trials take it after --"),
        ("pipeline", 1, 4, 2, "every one of the 4 tasks a stage"),
        ("data", 0, 4, None, "at least one node"),
        ("pipeline", 1, 0, None, "at least one task"),
        ("model", 1, 2, None, "unknown strategy"),
    ],
)
def test_impossible_layout_is_rejected(strategy, nodes, tasks, pp_size, message):
    with pytest.raises(ValueError, match=message):
        render(strategy, nodes, tasks, "10", pp_size=pp_size)


# --- the batch script's step, signals and requeue (fake srun, mpirun, scontrol, ringtrain) ------

FAKE_SRUN = """#!/bin/bash
[[ $1 == --mpi=list ]] && { echo "MPI plugin types are... $FAKE_MPI_TYPES"; exit 0; }
echo "srun $*" >"$OUT/launcher"
while [[ $1 == -* ]]; do shift; done
exec "$@"
"""
FAKE_MPIRUN = """#!/bin/bash
echo "mpirun $*" >"$OUT/launcher"
while [[ $1 == -* ]]; do [[ $1 == -x || $1 == --bind-to ]] && shift; shift; done
exec "$@"
"""
FAKE_RINGTRAIN = """#!/bin/bash
printf '%s\\n' "$@" >"$OUT/args"
echo "$TF_NUM_INTRAOP_THREADS $TF_NUM_INTEROP_THREADS $OMP_NUM_THREADS" >"$OUT/threads"
[[ $FAKE_EXIT ]] && exit "$FAKE_EXIT"
trap 'echo USR1 >"$OUT/signal"; exit 75' USR1
trap 'echo TERM >"$OUT/signal"; exit 75' TERM
touch "$OUT/ready"
while :; do sleep 0.02; done
"""


def run_batch_script(
    tmp_path: Path,
    send: signal.Signals | None = None,
    fake_exit: str = "",
    mpi_types: str = "none pmi2 pmix",
    argv: tuple[str, ...] = ("hybrid.sbatch", "--epochs", "3"),
) -> tuple[int, Path]:
    """Run a template (slurm/hybrid.sbatch unless `argv` names another, with its arguments) as
    sbatch would, with fakes on PATH; return (rc, output dir)."""
    venv, out = tmp_path / "venv", tmp_path / "out"
    (venv / "bin").mkdir(parents=True)
    out.mkdir()
    (venv / "bin" / "activate").write_text(f'PATH="{venv}/bin:$PATH"\n')
    fakes = {
        "srun": FAKE_SRUN,
        "mpirun": FAKE_MPIRUN,
        "ringtrain": FAKE_RINGTRAIN,
        "scontrol": '#!/bin/bash\necho "$*" >"$OUT/scontrol"\n',
    }
    for name, text in fakes.items():
        (venv / "bin" / name).write_text(text)
        (venv / "bin" / name).chmod(0o755)
    env = {
        "PATH": os.environ["PATH"],
        "OUT": str(out),
        "RINGTRAIN_VENV": str(venv),
        "RINGTRAIN_HOME": str(REPO_ROOT),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NAME": "demo",
        "SLURM_CPUS_PER_TASK": "3",
        "FAKE_EXIT": fake_exit,
        "FAKE_MPI_TYPES": mpi_types,
    }
    batch = subprocess.Popen([BASH, str(TEMPLATE_DIR / argv[0]), *argv[1:]], env=env, cwd=tmp_path)
    if send is not None:
        deadline = time.monotonic() + 10
        while not (out / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        batch.send_signal(send)
    return batch.wait(timeout=20), out


@pytest.mark.parametrize("sent", [signal.SIGUSR1, signal.SIGTERM])
def test_signal_reaches_the_step_and_a_checkpointed_step_is_requeued(tmp_path, sent):
    rc, out = run_batch_script(tmp_path, send=sent)
    assert rc == 75
    assert (out / "signal").read_text().strip() == sent.name.removeprefix("SIG")
    assert (out / "scontrol").read_text().strip() == "requeue 42"


@pytest.mark.parametrize("exit_code", ["0", "1"])
def test_finished_or_failed_step_is_not_requeued(tmp_path, exit_code):
    rc, out = run_batch_script(tmp_path, fake_exit=exit_code)
    assert rc == int(exit_code)
    assert not (out / "scontrol").exists()


def test_step_runs_ringtrain_train_with_srun_pmix_and_one_pool_per_task(tmp_path):
    """--kill-on-bad-exit: one rank's failure (a silent peer's exit 3) ends the whole step."""
    _, out = run_batch_script(tmp_path, fake_exit="0")
    assert (out / "launcher").read_text().split()[:4] == [
        "srun",
        "--mpi=pmix",
        "--kill-on-bad-exit=1",
        "--cpus-per-task=3",
    ]
    assert (out / "args").read_text().split() == [
        "train",
        "--strategy",
        "hybrid",
        "--pp-size",
        "2",
        "--checkpoint-dir",
        "ckpt-demo",
        "--resume",
        "--epochs",
        "3",
    ]
    assert (out / "threads").read_text().split() == ["3", "3", "3"]


SWEEP_ARGV = ("sweep.sbatch", "space.yaml", "--trials", "8", "--epochs", "3")


def test_sweep_keeps_its_study_in_a_journal_named_after_the_job_and_is_requeued(tmp_path):
    done, stopped = tmp_path / "done", tmp_path / "stopped"
    done.mkdir()
    stopped.mkdir()
    rc, out = run_batch_script(done, fake_exit="0", argv=SWEEP_ARGV)
    assert rc == 0 and (done / "sweeps").is_dir()  # the storage's folder must exist
    assert (out / "args").read_text().split() == [
        *("sweep", "run", "--study", "demo", "--storage", "journal:sweeps/demo.journal"),
        *("--out", "sweeps/demo", *SWEEP_ARGV[1:]),
    ]
    rc, out = run_batch_script(stopped, send=signal.SIGUSR1, argv=SWEEP_ARGV)
    assert (rc, (out / "scontrol").read_text().strip()) == (75, "requeue 42")


def test_sweep_without_arguments_says_what_it_needs(tmp_path, capfd):
    rc, out = run_batch_script(tmp_path, fake_exit="0", argv=("sweep.sbatch",))
    assert rc == 1 and not (out / "args").exists()
    assert "no sweep arguments: SPACE --trials N" in capfd.readouterr().err


def test_step_falls_back_to_mpirun_without_pmix(tmp_path):
    rc, out = run_batch_script(tmp_path, fake_exit="0", mpi_types="none pmi2")
    assert rc == 0
    assert (out / "launcher").read_text().startswith("mpirun ")


# --- the commands ----------------------------------------------------------------------------


def run_cli(argv: list[str]) -> int:
    """The launch commands through the main CLI, which turns their errors into exit codes."""
    from ringtrain.cli import main

    return main(argv)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            [
                "slurm",
                "render",
                "--strategy",
                "hybrid",
                "--nodes",
                "2",
                "--ntasks-per-node",
                "3",
                "--time",
                "1:00:00",
                "--pp-size",
                "4",
            ],
            "ringtrain slurm render: error: --pp-size 4 does not divide the 6 tasks",
        ),
        (
            [
                "slurm",
                "render",
                "--strategy",
                "data",
                "--nodes",
                "1",
                "--ntasks-per-node",
                "2",
                "--time",
                "10",
                "--job-name",
                "x;id",
            ],
            "ringtrain slurm render: error: job name 'x;id'",
        ),
        (
            [
                "slurm",
                "render",
                "--strategy",
                "data",
                "--nodes",
                "1",
                "--ntasks-per-node",
                "2",
                "--time",
                "25:99",
            ],
            "ringtrain slurm render: error: time '25:99'",
        ),
        (
            ["hostfile", "convert", "node[1-", "--slots", "2", "--format", "mpirun"],
            "ringtrain hostfile convert: error: bad node list 'node[1-'",
        ),
        (["hostfile", "check", "/no/such/hostfile"], "ringtrain hostfile check: error: "),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_2(capsys, argv, message):
    assert run_cli(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(message) and captured.err.count("\n") == 1


def test_bad_flag_in_the_real_cli_is_one_line(capsys):
    assert run_cli(["hostfile", "convert", "node1", "--slots", "2"]) == 2
    assert capsys.readouterr().err == (
        "ringtrain hostfile convert: error: the following arguments are required: --format\n"
    )


def test_check_prints_ok_or_each_bad_line(tmp_path, capsys):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text("localhost slots=2\n127.0.0.1 slots=4\n")  # names must resolve
    bad.write_text("# c\nnode1 slots=0\n")
    assert run_cli(["hostfile", "check", str(good), "--for", "horovodrun"]) == 0
    assert capsys.readouterr().out == "ok: 2 hosts, 6 slots\n"
    assert run_cli(["hostfile", "check", str(bad), "--for", "horovodrun"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "line 1: comment: horovodrun's hostfile reader cannot skip comments; delete it",
        "line 2: slots=0: a host needs at least one slot",
    ]


def test_convert_reads_the_slurm_allocation_by_default(monkeypatch, capsys):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[01-02],gpu1")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "4(x2),2")
    assert run_cli(["hostfile", "convert", "--format", "mpirun"]) == 0
    assert capsys.readouterr().out == "node01 slots=4\nnode02 slots=4\ngpu1 slots=2\n"
    assert run_cli(["hostfile", "convert", "n[1-2]", "--slots", "3", "--format", "horovod"]) == 0
    assert capsys.readouterr().out == "n1:3,n2:3\n"


def test_render_writes_the_file_with_train_args_after_double_dash(tmp_path, capsys):
    target = tmp_path / "job.sbatch"
    argv = [
        "slurm",
        "render",
        "--strategy",
        "hybrid",
        "--nodes",
        "1",
        "--ntasks-per-node",
        "4",
        "--time",
        "00:10:00",
        "--pp-size",
        "2",
        "--output",
        str(target),
        "--",
        "--epochs",
        "1",
        "$(id)",
    ]
    assert run_cli(argv) == 0
    assert "(($#)) || set -- --epochs 1 '$(id)'\n" in target.read_text()
    assert capsys.readouterr().out.startswith(f"wrote {target}")
