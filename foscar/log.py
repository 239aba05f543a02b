"""FOSCAR's logger, ``logging.getLogger("foscar")``: what takes seconds and would otherwise be a silent pause (a
kernel's first compile, ``foscar.jit.cached_compile``) is said on stderr as ``[foscar] ...``, as FlashInfer's JIT
says its builds. ``FOSCAR_LOG_LEVEL`` sets its level (default ``INFO``; ``WARNING`` silences the compile lines).
It does not propagate to the root logger (so pytest's ``caplog`` does not see it); an application that routes it
elsewhere replaces its handler (``logging.getLogger("foscar").handlers = [...]``), and one that configures logging
by ``logging.config.dictConfig`` after importing foscar keeps it with ``disable_existing_loggers=False``."""

from __future__ import annotations

import logging
import os
import sys
import warnings


class _StderrHandler(logging.StreamHandler):
    """Writes to the ``sys.stderr`` of the moment (not the one at import: test runners and notebooks replace it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ sets it
        pass


def _logger() -> logging.Logger:
    log = logging.getLogger("foscar")
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("[foscar] %(message)s"))
        log.addHandler(handler)
        log.propagate = False  # said once, not again by the root logger's handlers
    level = os.environ.get("FOSCAR_LOG_LEVEL", "INFO").upper()
    level = int(level) if level.isdigit() else level
    if not isinstance(level, int) and not isinstance(logging.getLevelName(level), int):  # a name it does not know
        warnings.warn(f"FOSCAR_LOG_LEVEL must be a logging level (DEBUG, INFO, WARNING, ... or a number), got "
                      f"{level!r}: using INFO", RuntimeWarning, stacklevel=2)
        level = "INFO"
    log.setLevel(level)
    return log


logger = _logger()
