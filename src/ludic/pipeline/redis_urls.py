"""Redis URLs in messages: the password left out."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

__all__ = ["redacted"]


def redacted(url: str) -> str:
    """``url`` with its password replaced by ``***``, for messages, logs and files."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    port = f":{parts.port}" if parts.port else ""
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}{port}"
    return urlunsplit(parts._replace(netloc=netloc))
