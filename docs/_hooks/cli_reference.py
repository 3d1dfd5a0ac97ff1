"""Writes the CLI reference from ringtrain's argparse parser as the site builds.

docs/reference/cli.md holds only a placeholder, so the page can never drift from
`ringtrain COMMAND --help`. Building the parser imports neither TensorFlow nor MPI.
"""

from __future__ import annotations

import argparse
import html

from mkdocs.exceptions import PluginError

from ringtrain.cli import build_parser

PAGE = "reference/cli.md"
PLACEHOLDER = "<!-- cli-reference -->"


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if PLACEHOLDER not in markdown:
        raise PluginError(f"{PAGE} lost its placeholder {PLACEHOLDER}")
    return markdown.replace(PLACEHOLDER, "\n".join(command_sections(build_parser())))


def command_sections(parser: argparse.ArgumentParser, level: int = 2) -> list[str]:
    """A heading, description and option table per command, then its subcommands in order."""
    lines = [f"{'#' * level} `{parser.prog}`", ""]
    if parser.description:
        lines += [_cell(parser.description), ""]
    lines += [f"```text\n{parser.format_usage().strip()}\n```", ""]
    for group in parser._action_groups:
        lines += _options_table(parser, group)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                lines += command_sections(sub, level + 1)
    return lines


def _options_table(parser: argparse.ArgumentParser, group) -> list[str]:
    actions = [a for a in group._group_actions if _documented(a)]
    if not actions:
        return []
    formatter = parser._get_formatter()
    rows = [f"**{group.title.capitalize()}**", "", "| Option | Default | Choices | Help |"]
    rows.append("| --- | --- | --- | --- |")
    for action in actions:
        invocation = formatter._format_action_invocation(action)
        help_text = formatter._expand_help(action) if action.help else ""
        rows.append(
            f"| `{invocation}` | {_default(action)} | {_choices(action)} | {_cell(help_text)} |"
        )
    return [*rows, ""]


def _documented(action: argparse.Action) -> bool:
    return not isinstance(action, argparse._HelpAction | argparse._SubParsersAction) and (
        action.help != argparse.SUPPRESS
    )


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
        return ""  # a flag, or no default the parser knows of
    return f"`{action.default}`"


def _choices(action: argparse.Action) -> str:
    return ", ".join(f"`{choice}`" for choice in action.choices or ())


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: one line, no stray HTML or column breaks."""
    return html.escape(" ".join(text.split()), quote=False).replace("|", "\\|")
