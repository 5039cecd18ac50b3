"""Human-readable logging. Nothing here runs at import: executables call
``configure_logging`` once in ``main``; libraries only ``logging.getLogger(__name__)``."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"

#: A repeated event (a rejected message) is logged the first time and then once
#: per this many occurrences; the exact number lives in the caller's counter.
SAMPLE_EVERY = 1000


def configure_logging(level: str = "INFO", file: str | Path | None = None) -> None:
    """Log to stderr, and to ``file`` if given, one ``FORMAT`` line per record,
    replacing the root logger's handlers.

    Args:
        level: the root logger's level, a ``logging`` level name in any case.
        file: a file to append the log to as well (its directory is created).

    Raises:
        ValueError: ``level`` is not a level name.
        OSError: ``file`` or its directory cannot be created or opened.
    """
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if file is not None:
        Path(file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(file, encoding="utf-8"))
    logging.basicConfig(level=level.upper(), format=FORMAT, handlers=handlers, force=True)


def log_sampled(logger: logging.Logger, count: int, msg: str, *args: object,
                level: int = logging.WARNING, every: int = SAMPLE_EVERY,
                exc_info: bool = False) -> bool:
    """Log the ``count``-th occurrence of a repeated event only if it is the first
    or a multiple of ``every``, with the count appended: a peer flooding junk must
    not flood the log (5,000 junk messages cost 6 lines, not 5,000). True if logged."""
    if count != 1 and count % every:
        return False
    logger.log(level, msg + " (%d so far)", *args, count, exc_info=exc_info)
    return True
