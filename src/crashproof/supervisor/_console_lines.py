"""Each rank's output reaches the console a whole line at a time.

torch's agent copies every rank's log file to the console with a thread per rank that prints
whatever ``readline`` returns, each piece behind the rank's prefix. A trainer with unbuffered
output (``PYTHONUNBUFFERED``, ``python -u``) writes a ``print``'s text and its newline in two
``write`` calls; a copier that reads between them prints half a line, and the next rank's line
lands on its end (``...}[rank 1] ...``): lines a script or a person reads back are broken.

:func:`tail_whole_lines` takes the place of torch's copier (same arguments) and holds a piece
without its newline until the rest of the line comes. A line that stays unfinished for
:data:`HOLD_S` (a prompt, dots printed one at a time) is shown as it is, ended on the console, so
that nothing waits long (its ending, when it comes, adds no empty line: a progress bar that
redraws itself with ``\r`` every few seconds shows one line per redraw); the rank's log file in
the run directory is never touched.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["HOLD_S", "install", "tail_whole_lines"]

log = logging.getLogger(__name__)

HOLD_S = 0.5
"""How long an unfinished line is held back for the rest of it."""


def tail_whole_lines(
    header: str,
    file: str,
    dst: TextIO,
    finished: threading.Event,
    interval_sec: float,
    log_line_filter: Callable[[str], bool] | None = None,
) -> None:
    """Copy ``file`` to ``dst`` as it grows, each whole line behind ``header``, until
    ``finished`` is set and the file is read to its end (torch's ``tail_logfile``'s contract)."""
    while not os.path.exists(file):
        if finished.is_set():
            return
        time.sleep(interval_sec)

    def show(line: str) -> None:
        if log_line_filter is None or log_line_filter(line):
            dst.write(f"{header}{line}")

    pending = ""
    since = 0.0
    ended = False  # the last line was shown unfinished, ended here
    with open(file, errors="replace") as fp:
        while True:
            piece = fp.readline()
            if piece:
                if ended and piece == "\n":  # its own ending, come late: shown already
                    ended = False
                    continue
                ended = False
                if not pending:
                    since = time.monotonic()
                pending += piece
                if pending.endswith("\n"):
                    show(pending)
                    pending = ""
                continue
            if finished.is_set():  # the rank is gone: what is left is all there will be
                *lines, last = (pending + fp.read()).split("\n")
                for line in [*lines, last] if last else lines:
                    show(line + "\n")
                return
            if pending and time.monotonic() - since >= HOLD_S:
                show(pending + "\n")
                pending, ended = "", True
            time.sleep(interval_sec)


def install() -> None:
    """Make torch's agent copy the ranks' output with :func:`tail_whole_lines`. torch looks its
    copier up by name in its module each time it starts one, so this holds for every attempt;
    a torch without that name keeps its own copier."""
    from torch.distributed.elastic.multiprocessing import tail_log

    if not callable(getattr(tail_log, "tail_logfile", None)):
        log.debug("torch has no tail_logfile to replace; the ranks' output is copied as torch does")
        return
    tail_log.tail_logfile = tail_whole_lines
