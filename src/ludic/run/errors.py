"""The product layer's user-facing error (exit status 2 from the ``ludic`` command)."""

from __future__ import annotations


class RunError(RuntimeError):
    """A run that cannot proceed for a reason the user can fix; the message says how."""
