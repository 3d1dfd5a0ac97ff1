"""The docs site builds with --strict, and every command block in README.md and docs/ either
runs here, names the test that runs it, or says why it cannot run.

A command block is a fenced block whose info string is sh, bash, shell, console or python. The
line directly above its opening fence holds exactly one marker:

    <!-- run -->                      a shell block: its commands run here, in one bash
    <!-- run: COMMAND -->             a python block: saved as script.py, then COMMAND runs,
                                      {script} standing for its path
    <!-- tested-by: tests/FILE.py::TEST -->   that test already runs it
    <!-- illustrative: REASON -->     it cannot run here (e.g. a real cluster's sbatch)
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import BIN, ENV, ROOT

COMMAND_LANGUAGES = {"sh", "bash", "shell", "console", "python"}
SHELL_LANGUAGES = COMMAND_LANGUAGES - {"python"}
# Files the commands name relative to the repository root.
REPO_FOLDERS = ("hostfiles", "examples", "slurm")
# A bound on a hung command, not a speed check: `ringtrain plan` calibrates first (two mpirun
# launches), which took 23 s on a quiet machine and 116 s beside other test runs.
COMMAND_TIMEOUT_S = 300
RUN_ENV = {**ENV, "OMPI_MCA_rmaps_base_oversubscribe": "1", "NO_MKDOCS_2_WARNING": "1"}

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\s`{]*)")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>[a-z-]+)\s*(?::(?P<arg>.*?))?\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced command block: where it opens, its language, the marker above it, its text."""

    where: str  # FILE:LINE of the opening fence
    language: str
    marker: str  # the line above the fence
    above_marker: str  # the line above that, to catch a second marker
    body: str

    def parsed_marker(self) -> tuple[str, str | None] | None:
        """(kind, argument) of the marker above, e.g. ("run", None), or None without one."""
        found = MARKER.match(self.marker)
        return (found["kind"], found["arg"]) if found else None

    def runs_here(self) -> bool:
        return (self.parsed_marker() or ("",))[0] == "run"


def fenced_blocks(text: str, name: str) -> list[Block]:
    """Every command block of a Markdown text, its body dedented like the fence (lists)."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, close = len(opening["indent"]), opening["fence"], i + 1
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        while close < len(lines) and not closing.match(lines[close]):
            close += 1
        language = opening["info"].lower()
        if language in COMMAND_LANGUAGES:
            blocks.append(
                Block(
                    where=f"{name}:{i + 1}",
                    language=language,
                    marker=lines[i - 1] if i >= 1 else "",
                    above_marker=lines[i - 2] if i >= 2 else "",
                    body="\n".join(line[indent:] for line in lines[i + 1 : close]),
                )
            )
        i = close + 1
    return blocks


def marker_problem(block: Block, root: Path) -> str | None:
    """What is wrong with a block's marker, as `FILE:LINE: problem`, or None."""
    parsed = block.parsed_marker()
    if parsed is None:
        return f"{block.where}: command block without a marker"
    if MARKER.match(block.above_marker):
        return f"{block.where}: more than one marker above the block"
    kind, arg = parsed
    problem = {
        "run": _run_problem,
        "tested-by": _tested_by_problem,
        "illustrative": _illustrative_problem,
    }.get(kind, _unknown_marker)(block, arg, root)
    return f"{block.where}: {problem}" if problem else None


def _run_problem(block: Block, command: str | None, root: Path) -> str | None:
    if block.language == "python":
        if not command or "{script}" not in command:
            return "a python block runs by <!-- run: COMMAND --> with {script} in COMMAND"
    elif command is not None:
        return "a shell block runs as printed: <!-- run --> takes no command"
    return None


def _tested_by_problem(block: Block, test_id: str | None, root: Path) -> str | None:
    """tests/FILE.py::NAME[::NAME]: the file exists and defines each name (a parametrized id
    names its function, `test_x[case]` is `test_x`)."""
    file, *names = (test_id or "").split("::")
    path = root / file.strip()
    if not names or not file.strip():
        return f"tested-by wants tests/FILE.py::TEST, got {test_id!r}"
    if not path.is_file():
        return f"tested-by names {file.strip()}, which does not exist"
    source = path.read_text()
    for name in names:
        base = name.strip().split("[")[0]
        if not re.search(rf"^\s*(?:async\s+def|def|class)\s+{re.escape(base)}\b", source, re.M):
            return f"tested-by names {base}, which {file.strip()} does not define"
    return None


def _illustrative_problem(block: Block, reason: str | None, root: Path) -> str | None:
    return None if reason else "an illustrative block says why: <!-- illustrative: REASON -->"


def _unknown_marker(block: Block, arg: str | None, root: Path) -> str:
    return f"unknown marker {block.marker.strip()} (run, tested-by or illustrative)"


def shell_commands(body: str, language: str) -> list[str]:
    """The command lines of a shell block: continuations joined, comments and blank lines
    dropped; in a console block only the `$ ` lines, the rest being their output."""
    lines = re.sub(r"[ \t]*\\\n\s*", " ", body).splitlines()
    if language == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    return [line.strip() for line in lines if shlex.split(line, comments=True)]


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def all_blocks() -> list[Block]:
    return [
        block
        for path in doc_files()
        for block in fenced_blocks(path.read_text(), path.relative_to(ROOT).as_posix())
    ]


BLOCKS = all_blocks()
RUN_BLOCKS = [block for block in BLOCKS if block.runs_here()]


def test_every_command_block_has_a_marker():
    problems = [p for block in BLOCKS if (p := marker_problem(block, ROOT))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[b.where for b in RUN_BLOCKS])
def test_a_run_block_runs_as_printed(block: Block, tmp_path: Path):
    for folder in REPO_FOLDERS:
        (tmp_path / folder).symlink_to(ROOT / folder)
    if block.language == "python":
        script = tmp_path / "script.py"
        script.write_text(block.body + "\n")
        commands = [block.parsed_marker()[1].replace("{script}", str(script))]
    else:
        commands = shell_commands(block.body, block.language)
    assert commands, f"{block.where}: a run block without a command"
    # One shell, so a block's `cd` and `export` hold for its later lines; the first failing
    # line ends it and is named.
    script = "set -e\ntrap 'echo \"failed: $BASH_COMMAND\" >&2' ERR\n" + "\n".join(commands)
    done = subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S * len(commands),
        cwd=tmp_path,
        env=RUN_ENV,
    )
    assert done.returncode == 0, f"{block.where}\n{done.stderr[-2000:]}"
    assert "Traceback" not in done.stderr, f"{block.where}\n{done.stderr[-2000:]}"


# --- the runner's own rules, each shown failing on a small page ---------------------------


def problems_of(markdown: str) -> list[str]:
    return [p for b in fenced_blocks(markdown, "page.md") if (p := marker_problem(b, ROOT))]


def test_the_parser_finds_command_blocks_only():
    page = "```json\n{}\n```\n\n```\nplain\n```\n\n- an item:\n\n    ```bash\n    ls -l\n    ```\n"
    (block,) = fenced_blocks(page, "page.md")
    assert (block.where, block.language, block.body) == ("page.md:11", "bash", "ls -l")


def test_an_unmarked_block_is_rejected():
    assert problems_of("Text\n```sh\nringtrain --help\n```\n") == [
        "page.md:2: command block without a marker"
    ]


def test_an_illustrative_block_needs_a_reason():
    assert not problems_of("<!-- illustrative: a real cluster's sbatch -->\n```sh\nsbatch x\n```\n")
    assert problems_of("<!-- illustrative -->\n```sh\nsbatch x\n```\n")
    assert problems_of("<!-- illustrative:   -->\n```sh\nsbatch x\n```\n")


def test_tested_by_must_name_a_test_that_exists():
    this = "tests/test_docs.py"
    good = f"<!-- tested-by: {this}::test_a_run_block_runs_as_printed[README.md:1] -->"
    assert not problems_of(f"{good}\n```sh\nls\n```\n")
    for bad in (f"{this}::test_nobody_wrote", "tests/test_nowhere.py::test_x", this):
        assert problems_of(f"<!-- tested-by: {bad} -->\n```sh\nls\n```\n"), bad


def test_run_markers_fit_their_language_and_stand_alone():
    assert not problems_of("<!-- run: python {script} -->\n```python\nprint(1)\n```\n")
    assert problems_of("<!-- run -->\n```python\nprint(1)\n```\n")
    assert problems_of("<!-- run: bash -c ls -->\n```sh\nls\n```\n")
    assert problems_of("<!-- ci: runs in under a minute -->\n```sh\nls\n```\n")
    assert problems_of("<!-- run -->\n<!-- illustrative: x -->\n```sh\nls\n```\n")


def test_shell_commands_join_continuations_and_skip_output():
    body = "# set-up\nringtrain schedule \\\n    --kind gpipe  # GPipe\n\n"
    assert shell_commands(body, "sh") == ["ringtrain schedule --kind gpipe  # GPipe"]
    assert shell_commands("$ ringtrain --help\nusage: ringtrain\n", "console") == [
        "ringtrain --help"
    ]


# --- the site ------------------------------------------------------------------------------


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "mkdocs"), "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=RUN_ENV,
    )


def warnings(done: subprocess.CompletedProcess) -> str:
    """The lines that say why a strict build stopped."""
    return "\n".join(
        line for line in done.stderr.splitlines() if line.startswith(("WARNING", "ERROR", "Abort"))
    )


def test_the_site_builds_strictly_with_the_cli_and_the_plots(tmp_path: Path):
    from ringtrain.cli import build_parser

    done = mkdocs_build(ROOT / "mkdocs.yml", tmp_path)
    assert done.returncode == 0, warnings(done) or done.stderr[-3000:]
    cli_page = (tmp_path / "reference" / "cli" / "index.html").read_text()
    for parser in _parsers(build_parser()):
        assert parser.prog in cli_page
        for action in parser._actions:
            if action.help != argparse.SUPPRESS:  # hidden from --help, so from the page too
                assert all(option in cli_page for option in action.option_strings), action
    for plot in (ROOT / "benchmarks" / "results").glob("*.png"):
        assert (tmp_path / "results" / plot.name).is_file(), plot.name


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [parser, *(p for s in subs for sub in s.choices.values() for p in _parsers(sub))]


def test_a_broken_link_or_anchor_fails_the_strict_build(tmp_path: Path):
    """The project's own settings on a one-page site whose page links nowhere."""
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[gone](missing.md) and [here](#nowhere)\n")
    config.update(docs_dir=str(docs), nav=["index.md"], hooks=[], plugins=["search"])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "missing.md" in done.stderr and "#nowhere" in done.stderr, done.stderr
