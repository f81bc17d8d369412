"""Exceptions raised by h3_core.

Every error a user can cause (a bad file, a bad argument) is one of these, and its message names the file, key or
value at fault and says how to fix it.
"""

from __future__ import annotations


class H3Error(ValueError):
    """Base class of every user-facing h3_core error."""


class CheckpointError(H3Error):
    """A checkpoint file or folder cannot be read as an H3 component.

    `path` is the offending file or folder and `key` the tensor name, when one is at fault.
    """

    def __init__(self, message: str, *, path=None, key: str | None = None):
        super().__init__(message)
        self.path = path
        self.key = key


class ResidencyError(H3Error):
    """A residency setting or call is invalid; the message names the value and the fix."""


class PickleCheckpointError(CheckpointError):
    """A pickle-based checkpoint (.ckpt/.pt/.bin/...) was given; only safetensors are ever read."""


class RemoteError(H3Error):
    """A remote generation server refused, failed or could not be reached; the message names the server and what it
    said. `status` is the HTTP status when one came back, `body` its parsed JSON body (or None)."""

    def __init__(self, message: str, *, status: int | None = None, body=None):
        super().__init__(message)
        self.status = status
        self.body = body
