"""Every measured figure in README.md and docs/ has a source in benchmarks/results/.

A measured figure is a number with a unit of speed, time, size or ratio (samples/s, ms, s, %,
a 1.5x ratio, MB/s, Gbit/s, MiB, ...), a bare decimal (a fraction such as 0.89, or 1.4e-5), a
tally ("21 of 22") or a count of things the code defines ("68 configurations"). In prose it may
stand only where benchmarks/docs_tables.py writes it from a results JSON, which its --check
proves current (tests/test_docs_tables.py): in a performance page's generated block or in an
inline figure, `<!-- fig: NAME -->...<!-- /fig -->`. Fenced code, inline code, HTML comments
and link targets are not prose and are not read.

A setting is not a measurement. It passes by one of two rules, never by a list of lines:
- it is written as it is typed, in inline code: `--link 200mbit`, `HOROVOD_CYCLE_TIME=1`;
- it is a flag's default: "default" stands right before it, and its sentence names, in inline
  code, a `ringtrain` flag whose default in the parser is that number.
A version after its package's name (TensorFlow 2.21) is neither: it is not read as a figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from functools import cache
from pathlib import Path

from conftest import ROOT

NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?"
UNIT = (
    r"samples/s|steps/s|[kMG]bit/s|[kMG]i?B/s|[µu]s|ns|ms|s|seconds?|minutes?|min|hours?|%"
    r"|[KMG]iB|[kKMG]B|bytes"
    r"|[x×](?!\s?\d)"  # a ratio; 8x8 and 2 × 8 are a shape and a product
)
FIGURE = re.compile(
    r"(?<![\w.=])(?:"
    rf"{NUMBER}(?:\s?[-–]\s?{NUMBER})?\s?(?:{UNIT})(?![\w/])"  # with a unit, or a range of them
    r"|\d+ of \d+\b"  # a tally
    r"|\d+ (?:[\w-]+ )?(?:configurations|predictions|cases|runs)\b"  # a count
    r"|\d+\.\d+(?:e[-+]?\d+)?(?![\w.])|\d+e[-+]?\d+"  # a bare decimal
    r")"
)
VERSIONED = re.compile(r"(?:Python|TensorFlow|Keras|Horovod|mpi4py|Open MPI|Slurm|Debian)\W*$")
DEFAULT_BEFORE = re.compile(r"\bdefaults?(?: to| is)?[\s,:(]*$")
FLAG = re.compile(r"`(--[a-z][a-z0-9-]*)")
FENCE = re.compile(r"^([ \t]*)(`{3,}|~{3,}).*?^\1\2[ \t]*$", re.S | re.M)
NOT_PROSE = (
    FENCE,
    re.compile(r"<!--.*?-->", re.S),  # markers and comments
    re.compile(r"`[^`]+`"),  # inline code, which may wrap a line
    re.compile(r"\]\([^)]*\)"),  # link targets
)


@cache
def docs_tables():
    """benchmarks/docs_tables.py, the only writer of figures, as a module."""
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "benchmarks/docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def flag_defaults() -> dict[str, float]:
    """Every `ringtrain` flag with a numeric default, over all subcommands."""
    from ringtrain.cli import build_parser

    found, parsers = {}, [build_parser()]
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            elif isinstance(action.default, int | float) and not isinstance(action.default, bool):
                found.update(dict.fromkeys(action.option_strings, float(action.default)))
    return found


def _blank(match: re.Match) -> str:
    """The match's characters as spaces, its line breaks kept: positions and lines stay."""
    return re.sub(r"[^\n]", " ", match.group(0))


def prose(text: str) -> str:
    """The text with everything that is not hand-written prose blanked out: the generated
    blocks and inline figures first, then code, comments and link targets."""
    tables = docs_tables()
    block = re.compile(f"{re.escape(tables.BEGIN)}.*?{re.escape(tables.END)}", re.S)
    for pattern in (block, tables.SPAN, *NOT_PROSE):
        text = pattern.sub(_blank, text)
    return text


def _sentence(text: str, start: int) -> tuple[int, int]:
    """The bounds of the sentence around position `start`: from the last full stop or blank
    line before it to the next."""
    ends = re.compile(r"[.!?;]\s|\n\s*\n")
    left = max((m.end() for m in ends.finditer(text, 0, start)), default=0)
    right = ends.search(text, start)
    return left, right.start() if right else len(text)


def is_flag_default(raw: str, clean: str, figure: re.Match) -> bool:
    """Whether the figure follows "default" and equals the parser default of a flag its
    sentence names."""
    if not DEFAULT_BEFORE.search(clean[: figure.start()]):
        return False
    value = float(re.match(NUMBER, figure.group(0)).group(0).replace(",", ""))
    left, right = _sentence(clean, figure.start())
    named = FLAG.findall(raw[left:right])
    return any(flag_defaults().get(flag) == value for flag in named)


def unsourced(text: str, name: str) -> list[str]:
    """`NAME:LINE: FIGURE` for each measured figure of a Markdown text that has no source."""
    clean, found = prose(text), []
    for figure in FIGURE.finditer(clean):
        if VERSIONED.search(clean[: figure.start()]) or is_flag_default(text, clean, figure):
            continue
        line = clean.count("\n", 0, figure.start()) + 1
        found.append(f"{name}:{line}: {' '.join(figure.group(0).split())}")
    return found


def doc_files() -> list[Path]:
    return docs_tables().doc_files()


def test_every_figure_in_the_docs_has_a_source():
    found = [
        problem
        for path in doc_files()
        for problem in unsourced(path.read_text(), path.relative_to(ROOT).as_posix())
    ]
    assert not found, (
        "measured figures without a source in benchmarks/results/ (route them through "
        "benchmarks/docs_tables.py, or reword without the number):\n" + "\n".join(found)
    )


# --- the scanner's own rules, each shown on a small page ----------------------------------


def test_a_planted_figure_is_named_with_its_line():
    page = "# Speed\n\nringtrain ran 1.38x tuned MultiWorkerMirrored\nin 30-40 s.\n"
    assert unsourced(page, "page.md") == ["page.md:3: 1.38x", "page.md:4: 30-40 s"]


def test_every_kind_of_figure_is_found():
    for figure in (
        "38,734 samples/s",
        "1.5 ms",
        "0.62-0.96x",
        "2.3%",
        "16 MiB",
        "200 Mbit/s",
        "1970 MB/s",
        "5 µs",
        "0.898",
        "1.4e-5",
        "21 of 22",
        "68 configurations",
        "4 stop-and-resume runs",
    ):
        assert unsourced(f"It measured {figure} here.\n", "page.md") == [f"page.md:1: {figure}"]


def test_generated_text_and_code_are_not_prose():
    tables = docs_tables()
    for page in (
        f"{tables.BEGIN}\nran 1.38x\n{tables.END}\n",
        "the bubble went from <!-- fig: one-host bubble -->0.34 to 0.15<!-- /fig -->.\n",
        "```text\nstep 1.72 ms\n```\n",
        "run `mpirun --mca oob_tcp_keepalive_time 5` or `tc qdisc ... latency\n10ms`\n",
        "<!-- illustrative: many minutes at 1 Gbit/s -->\n",
        "[the planning page](perf.md#15x-at-8-ms)\n",
    ):
        assert not unsourced(page, "page.md"), page


def test_a_flag_default_passes_only_as_the_parser_has_it():
    assert not unsourced("A deadline (`--comm-timeout`, default 120 s) applies.\n", "p.md")
    assert not unsourced("Each wait has `--comm-timeout` (default\n120 s).\n", "p.md")
    assert unsourced("A deadline (`--comm-timeout`, default 99 s) applies.\n", "p.md")
    assert unsourced("Its default, 120 s, suits clusters.\n", "p.md")  # which flag's?
    assert unsourced("`--comm-timeout` ended it after 120 s.\n", "p.md")  # not a default


def test_versions_shapes_and_plain_counts_are_not_figures():
    page = (
        "TensorFlow 2.21, Horovod 0.28.1 and Slurm 22.05 on 8x8 digits, grids 2×2 and 4×1, "
        "on 10.77.0.0/24 with 2 cores and 1 to 4 ranks.\n"
        "| Python | 3.11 |\n"
    )
    assert not unsourced(page, "page.md")
