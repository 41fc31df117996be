"""Reading a ``torch.save`` file without running code from it.

``torch.load(weights_only=True)`` unpickles only tensors, containers and plain values: a file
whose pickle names anything else (a class of the training script, a ``__reduce__`` that would
call ``os.system``) is refused by torch before any of it runs. Such a file is loaded in full only
when the user says they trust it (``--trust-pickle``), after a warning on stderr: full unpickling
executes whatever the file says. A file that is not a torch.save file at all (truncated, another
format) is a :class:`CorruptCheckpointError` naming it.
"""

from __future__ import annotations

import pickle
import re
import warnings
import zipfile
from typing import Any

import torch

from crashproof._console import say
from crashproof.errors import ConfigError, CorruptCheckpointError

__all__ = ["load_torch_file", "pickle_refusal"]

_WEIGHTS_ONLY = "Weights only load failed"
"""How torch begins the message of a file ``weights_only=True`` refuses to unpickle."""
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
"""Where torch's refusal names what the pickle would have called (``posix.system``)."""


def load_torch_file(path: str, *, trust_pickle: bool, what: str = "") -> Any:
    """What ``torch.load`` gives for ``path`` (tensors on the CPU), unpickled with
    ``weights_only=True``; a file that needs more is refused (:class:`ConfigError`) unless
    ``trust_pickle``, and then loaded in full after a warning. ``what`` says what the file is
    for, in the messages ("the optimizer's state")."""
    try:
        with warnings.catch_warnings():  # torch's notes on pickle protocols: not the user's
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if _WEIGHTS_ONLY not in str(exc):
            raise _not_torch(path, exc, what) from None
        if not trust_pickle:
            raise ConfigError(pickle_refusal(path, exc)) from None
    except OSError:
        raise  # the storage's refusal (permissions, I/O): no verdict on the file
    except (RuntimeError, EOFError, ValueError, KeyError, IndexError, TypeError,
            AttributeError, zipfile.BadZipFile) as exc:  # fmt: skip
        raise _not_torch(path, exc, what) from None
    say(
        "crashproof",
        f"warning: loading {path} with full unpickling (--trust-pickle): this executes code "
        "stored in the file; do this only for a file you made or trust",
    )
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except OSError:
        raise
    except Exception as exc:  # whatever the file's own code raised
        raise CorruptCheckpointError(
            f"{path}: could not be loaded even with full unpickling ({type(exc).__name__}: "
            f"{exc}); check that it is a torch.save file"
        ) from None


def pickle_refusal(path: str, exc: BaseException) -> str:
    """The message for a file that only full unpickling loads: what it names, and what to do."""
    found = _GLOBAL.search(str(exc))
    named = f" (it calls {found.group(1)})" if found else ""
    return (
        f"{path}: loading it needs full unpickling{named}, which runs code from the file; "
        "torch.load(weights_only=True) loads only tensors and plain values. If you made this "
        "file or trust where it came from, give --trust-pickle; otherwise re-save it from "
        "its training code as a state dict (torch.save(model.state_dict(), ...))"
    )


def _not_torch(path: str, exc: BaseException, what: str) -> CorruptCheckpointError:
    text = str(exc).strip()
    reason = text.split(". ")[0].splitlines()[0] if text else type(exc).__name__
    return CorruptCheckpointError(
        f"{path}: {what + ': ' if what else ''}not a readable torch.save file ({reason}); "
        "expected a file written by torch.save, whole (a copy cut short reads like this)"
    )
