"""API keys: how one is made and how it is stored (its SHA-256, never the key itself)."""

from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "mf-"  # so that a leaked key is recognisable to secret scanners


def new_key() -> str:
    """A new API key: the prefix and 192 random bits from `secrets`."""
    return KEY_PREFIX + secrets.token_urlsafe(24)


def hash_key(key: str) -> str:
    """The form in which a key is stored and looked up."""
    return hashlib.sha256(key.encode()).hexdigest()
