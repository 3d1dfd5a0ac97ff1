"""Lets a nav entry in mkdocs.yml name a folder, `Title: folder/`, for every page in it.

The folder's index.md comes first, the rest by file name, so a page added to the folder
joins the nav without an edit to mkdocs.yml.
"""

from __future__ import annotations

from pathlib import Path


def on_config(config, **kwargs):
    config.nav = _expand(config.nav, Path(config.docs_dir))
    return config


def _expand(nav: list, docs: Path) -> list:
    return [
        {title: _entry(value, docs) for title, value in item.items()}
        if isinstance(item, dict)
        else item
        for item in nav
    ]


def _entry(value, docs: Path):
    if isinstance(value, list):
        return _expand(value, docs)
    if isinstance(value, str) and value.endswith("/"):
        pages = sorted(docs.joinpath(value).glob("*.md"), key=lambda p: (p.name != "index.md", p))
        return [page.relative_to(docs).as_posix() for page in pages]
    return value
