"""How the command line words a failure: one line on stderr, whatever the paths and arguments it
quotes hold, and the same words for an output it could not write, whichever command it is.

Owns the form only; what each message says is its command's (``cli``, ``chaos``, ``report``).
"""

from __future__ import annotations

import logging
import sys
import textwrap
import unicodedata

__all__ = ["announce", "one_line", "output_unwritable", "say", "wrapped_cell"]

_ESCAPED = frozenset({"Cc", "Cs", "Zl", "Zp"})
"""Control characters (newline, carriage return, escape sequences, NUL), lone surrogates (bytes
of a path that are not UTF-8) and the Unicode line and paragraph separators."""


def one_line(text: str) -> str:
    """``text`` with each character that would break the line or drive the terminal written as
    its Python escape (``\\n``, ``\\x1b``, ``\\udcff``): a message quoting a path named
    ``$'root\\n'`` stays one line."""
    if text.isprintable():
        return text
    return "".join(repr(c)[1:-1] if unicodedata.category(c) in _ESCAPED else c for c in text)


def say(prog: str, message: str) -> None:
    """Print ``<prog>: <message>`` as one line on stderr."""
    print(one_line(f"{prog}: {message}"), file=sys.stderr)


def output_unwritable(option: str, path: str, exc: OSError) -> str:
    """The message for an output (``-o``, ``--html``) that could not be written: the option, the
    path, the system's reason and the file it met it on, and what to do (exit 74)."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    met = f" at {exc.filename}" if exc.filename not in (None, path) else ""
    return (
        f"{option} {path}: cannot be written ({reason}{met}); check that its directory is "
        "writable, mounted read-write and has room, or choose another path"
    )


def wrapped_cell(text: str, width: int) -> list[str]:
    """A table cell's text in lines of at most ``width`` characters, broken between words (a
    word longer than a line, such as a path, is split): a table never cuts a message short."""
    return textwrap.wrap(one_line(text), width, break_on_hyphens=False) or [""]


def announce(logger: logging.Logger, message: str) -> None:
    """An INFO line the user of a training script should see (a resume, the policies in force):
    logged, and printed as ``crashproof: <message>`` on stderr when the program has set up no
    logging at all (where Python would drop an INFO line unseen). A program that configured
    logging chose what it shows."""
    if logger.hasHandlers():
        logger.info("%s", message)
    else:
        print(one_line(f"crashproof: {message}"), file=sys.stderr, flush=True)
