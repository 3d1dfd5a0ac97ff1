"""argparse that fails in one line: a bad flag is a UserError, said once for the whole job."""

from __future__ import annotations

import argparse

from ringtrain.errors import UserError


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is a UserError, which main() turns into one line."""

    def error(self, message: str):
        raise bad_argv(message, self.prog)


def bad_argv(message: str, prog: str) -> UserError:
    """Every rank has the same argv and finds the same fault: rank 0 speaks for the job."""
    problem = UserError(message).on_every_rank(rank_or_none() or 0)
    problem.prog = prog
    return problem


def checked_who_am_i():
    from ringtrain.launch.env import who_am_i

    try:
        return who_am_i()
    except ValueError as exc:  # launcher variables that contradict each other
        raise UserError(str(exc)) from None


def rank_or_none() -> int | None:
    try:
        return checked_who_am_i().rank
    except UserError:
        return None
