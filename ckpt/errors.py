"""Errors of the checkpoint package, placed in the product's one hierarchy.

A checkpoint problem should not stop training by itself: a failed persist or a
fetch from a dead peer is *recoverable* (the in-memory tier still holds the
state, another peer can serve it). Only a wrong setup (a path that cannot work,
a secret that does not match, an impossible placement) is *fatal*.
"""

from __future__ import annotations

import errno
import os
from typing import Any

from ft_launch.errors import FatalError, RecoverableError


class CheckpointCorruptError(RecoverableError):
    """A copy of a checkpoint failed verification (checksum, size, manifest)."""


class NoCheckpointError(RecoverableError):
    """No tier holds a complete, verified copy; ``reasons`` says why each was skipped."""

    def __init__(self, message: str, *, reasons: tuple[str, ...] = (), **ids: Any) -> None:
        self.reasons = reasons
        detail = "; ".join(reasons) if reasons else "no copies found"
        super().__init__(f"{message}: {detail}",
                         hint="start from scratch or point ckpt.dir at a checkpoint", **ids)


class SnapshotFailedError(RecoverableError):
    """The background copy of a snapshot raised; the previous snapshot stays valid."""


class FetchError(RecoverableError):
    """Fetching state from a peer failed (refused, timed out, closed, corrupt)."""

    def __init__(self, message: str, *, status: int | None = None, **ids: Any) -> None:
        self.status = status
        super().__init__(message, hint="fetch from another healthy replica", **ids)


class PlacementError(FatalError):
    """No backup rank satisfies the placement rules for this topology."""


class LayoutMismatchError(FatalError):
    """A state sharded one way cannot load into a model sharded another (or not at all).

    A configuration error, not a transient one: the replica was started with a
    different mesh or number of ranks than the one whose state it loads, and
    no retry or other peer of that replica size can fix it. ``stored`` and
    ``live`` are the two ``layout`` records (``ft_launch.ckpt.manifest``; ``{}``: unsharded).
    """

    def __init__(self, difference: str, *, stored: Any = None, live: Any = None,
                 **ids: Any) -> None:
        self.stored = stored or {}
        self.live = live or {}
        super().__init__(f"the checkpoint's sharding does not match the live model's: "
                         f"{difference}",
                         hint="start the replica with the same mesh / ranks per replica as "
                              "the replica it catches up from", **ids)


class StorageError(RecoverableError):
    """Writing a checkpoint failed for a reason that may pass (disk full, I/O error).

    The previous checkpoint is untouched; training can go on from memory.
    """


class StorageSetupError(FatalError):
    """The checkpoint directory cannot work (missing, not a directory, no permission)."""


_SETUP_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR, errno.EROFS,
                 errno.EISDIR}
_HINTS = {
    errno.ENOSPC: "free space or point ckpt.dir at a larger filesystem",
    errno.EDQUOT: "raise the quota or point ckpt.dir elsewhere",
    errno.EFBIG: "the file size limit (ulimit -f) is too small for a shard",
    errno.EACCES: "give the job's user write permission on the directory",
    errno.EPERM: "give the job's user write permission on the directory",
    errno.EROFS: "point ckpt.dir at a writable filesystem",
    errno.ENOENT: "create the directory first (or set ckpt.dir to an existing one)",
    errno.ENOTDIR: "ckpt.dir must name a directory, not a file",
}


def storage_error(action: str, path: str | os.PathLike[str], exc: OSError,
                  **ids: Any) -> StorageError | StorageSetupError:
    """Turn an ``OSError`` from a checkpoint write into the matching product error."""
    code = exc.errno or 0
    name = errno.errorcode.get(code, str(code))
    message = (f"cannot {action} {os.fspath(path)}: {exc.strerror or exc} ({name}); "
               f"the previous checkpoint is untouched")
    hint = _HINTS.get(code)
    if code in _SETUP_ERRNOS:
        return StorageSetupError(message, hint=hint, **ids)
    return StorageError(message, hint=hint, **ids)
