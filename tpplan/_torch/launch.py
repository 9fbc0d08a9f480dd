"""torchrun's command line, as each torch version takes it, and its agent with forked workers.

Checked on torch 2.11 through 2.14.1. ``--shutdown-timeout`` (how long workers have to
finish after a signal before they are killed) is in torchrun from 2.13; torch 2.11's
torchrun does not know it and would exit on it. ``run_forked`` uses torchrun's public
pieces only (``get_args_parser``, ``config_from_args``, ``elastic_launch``), and names its
rendezvous events the cheap way (:func:`quick_rendezvous_event_names`).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Sequence

__all__ = ["quick_rendezvous_event_names", "run_forked", "shutdown_timeout_args"]


def shutdown_timeout_args(seconds: int) -> list[str]:
    """``["--shutdown-timeout=<seconds>"]`` where this torch's torchrun takes it, else ``[]``
    (torch 2.11: its workers get torchrun's own grace period after a signal)."""
    from torch.distributed.run import get_args_parser

    known = {s for a in get_args_parser()._actions for s in a.option_strings}
    return [f"--shutdown-timeout={seconds}"] if "--shutdown-timeout" in known else []


def run_forked(torchrun_args: Sequence[str], entry: Callable[..., Any], entry_args: tuple,
               preload: Sequence[str], from_here: bool = False) -> bool:
    """torchrun's agent as ``torchrun torchrun_args`` runs it (rendezvous, ``--max-restarts``,
    signals passed on, ``--shutdown-timeout``), each worker calling ``entry(*entry_args)`` in
    a process forked from a server that imported ``preload`` once: N workers do not each
    import torch (about 3 CPU-s apiece). The server imports nothing but ``preload`` and
    starts no thread, so CUDA and gloo start fresh in every worker, as in a new interpreter.

    ``from_here``: the workers forked from this process itself (torchrun's ``fork`` start
    method), which has imported what they need: no server's interpreter to start either
    (about 3 more CPU-s a launch). Only for workers that use no CUDA: a process that has
    asked CUDA anything (``torch.cuda.is_available()`` does) cannot be forked into one that
    uses it. Each worker starts with the default signal handlers, not the agent's.

    Returns False, starting nothing, where the platform has no forkserver (Windows): the
    caller runs the command line instead. Raises what ``torchrun`` raises
    (``ChildFailedError``, ``SignalException``).
    """
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    _one_line_failures()
    quick_rendezvous_event_names()
    config, _cmd, _cmd_args = config_from_args(
        get_args_parser().parse_args([f"--start-method={'fork' if from_here else 'forkserver'}", *torchrun_args]))
    if not from_here:  # workers forked from here have what this process imported
        multiprocessing.set_forkserver_preload(list(preload))  # read when the server starts
    elastic_launch(config, entrypoint=_WithDefaultSignals(entry))(*entry_args)
    return True


class _WithDefaultSignals:
    """``entry`` called with the signal handlers a new interpreter has: a worker forked from
    the agent would otherwise inherit the agent's (a SIGTERM raising torchrun's
    ``SignalException`` inside the worker). Picklable (a forkserver sends it); named as
    ``entry`` is, which the agent reads."""

    def __init__(self, entry: Callable[..., Any]) -> None:
        self.entry = entry
        self.__name__ = self.__qualname__ = getattr(entry, "__qualname__", type(self).__name__)

    def __call__(self, *args: Any) -> Any:
        import signal

        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return self.entry(*args)


def _method_name(depth: int = 2) -> str:
    """The name of the function ``depth`` frames up from this one, as
    ``inspect.stack()[depth].function`` gives it, read from the frames alone."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def quick_rendezvous_event_names() -> None:
    """torchrun's dynamic rendezvous names every event it records (join, keep-alive, close)
    by the method that recorded it, found with ``inspect.stack()``, which reads the source
    lines of every frame on the stack: about 0.8 of the 7 CPU-s a 4-worker launch of a tiny
    run costs on 2 cores (``py-spy``, 2026-11-29). This gives the same name from the frames
    alone. Relies on ``torch.distributed.elastic.rendezvous.dynamic_rendezvous.
    get_method_name(depth=2)``, a module function its handlers call by name (torch 2.11
    through 2.14.1); where it is gone, nothing is changed."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = _method_name


# The logger by which torchrun's agent reports a failed worker of a function entrypoint.
FAILURE_LOGGER = "torch.distributed.elastic.multiprocessing.api"


def _without_traceback(record: logging.LogRecord) -> bool:
    """A worker that exited (with a code, or killed by a signal) said in the agent's one
    line, without the agent's own traceback of how it noticed: the worker already said why,
    a killed one has nothing more to say. A worker's uncaught exception keeps it: the
    worker's traceback is inside (``ProcessRaisedException``)."""
    from torch.multiprocessing import ProcessExitedException

    if record.exc_info and isinstance(record.exc_info[1], ProcessExitedException):
        record.exc_info, record.exc_text = None, None
    return True


def _one_line_failures() -> None:
    log = logging.getLogger(FAILURE_LOGGER)
    if _without_traceback not in log.filters:
        log.addFilter(_without_traceback)
