"""The command line's argument parser: every usage error is one line, naming what is wrong.

argparse prints its usage (8 lines for ``mount``) above each error, and a misspelled flag
comes out as ``unrecognized arguments: --cachesize mnt`` from the top-level parser, after
the flag's value was taken for the dataset and the dataset for the mount point. Here the
error is the command's, it names the unknown flag first (the cause of whatever else went
wrong) and suggests the closest known one (Python 3.11's argparse has no
``suggest_on_error``).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

#: A negative number is a value (``show DS -1``), never a flag.
_NUMBER = re.compile(r"-\d+(\.\d*)?([eE][-+]?\d+)?")
#: argparse's own message for a value outside a fixed list (a command's name...).
_CHOICE = re.compile(r"invalid choice: '(?P<given>[^']*)' \(choose from (?P<choices>.*)\)$")


class Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line on stderr (status 2), with a
    suggestion for a misspelled flag or command name. Sub-parsers are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._given: list[str] = []
        #: The sub-parsers by command name (filled by :meth:`command`'s callers through
        #: ``add_subparsers``), so that extra arguments are said by the command's parser.
        self.commands: dict[str, Parser] = {}

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        self._given = list(sys.argv[1:] if args is None else args)  # what error() looks through
        return super().parse_known_args(args, namespace)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # said by the command that was given them, not by the top level
            where = self.commands.get(getattr(parsed, "command", None) or "", self)
            where.error(where.extras_message(extras))
        return parsed

    def extras_message(self, extras: list[str]) -> str:
        """What is wrong with arguments left over: the first unknown flag, else the extra values."""
        unknown = next((f for f in extras if self._looks_like_flag(f)), None)
        if unknown is not None:
            return self._unknown_flag(unknown.split("=", 1)[0])
        return f"unexpected argument{'s' if len(extras) > 1 else ''}: {' '.join(map(repr, extras))}"

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: what is wrong`` (one line) and exit with status 2."""
        unknown = self._first_unknown_flag()
        if unknown is not None and not message.startswith(f"{unknown}:"):
            message = self._unknown_flag(unknown)  # the cause: the values after it were misplaced
        choice = _CHOICE.search(message)
        if choice:
            options = re.findall(r"'([^']*)'", choice["choices"])
            close = difflib.get_close_matches(choice["given"], options, n=1)
            if close:
                message = f"{message[:choice.start()]}invalid choice {choice['given']!r} (did you mean {close[0]!r}?)"
        if message.startswith("the following arguments are required"):
            message += f" ({self.prog} --help says what they are)"
        self.exit(2, f"{self.prog}: {message}\n")

    def _looks_like_flag(self, text: str) -> bool:
        return text.startswith("-") and text != "-" and not _NUMBER.fullmatch(text)

    def _known(self, flag: str) -> bool:
        """Whether ``flag`` (without ``=value``) is one of this parser's, as argparse reads it:
        exact, a unique long prefix, or a short flag with its value attached (``-j2``)."""
        known = self._option_string_actions
        if flag in known:
            return True
        if flag.startswith("--"):
            return any(name.startswith(flag) for name in known if name.startswith("--"))
        return flag[:2] in known

    def _first_unknown_flag(self) -> str | None:
        for text in self._given:
            if text == "--":
                return None
            if text in self.commands:  # the rest is the command's to judge
                return None
            if self._looks_like_flag(text) and not self._known(text.split("=", 1)[0]):
                return text.split("=", 1)[0]
        return None

    def _unknown_flag(self, flag: str) -> str:
        longs = sorted(name for name in self._option_string_actions if name.startswith("--"))
        close = difflib.get_close_matches(flag, longs, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else f"{self.prog} --help lists them"
        return f"{flag}: no such flag ({hint})"
