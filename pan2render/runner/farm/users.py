"""The farm's users: a token per user, kept hashed in ``ROOT/users.json`` (readable by the farm's
owner only), and the farm's own admin token (``ROOT/token``).

A request's user is the one its token names, never a field of the request: the owner of a batch
is who submitted it. A user acts on their own batches and videos; the admin (the farm's own
token, which `pan2-render` commands run by the farm's owner use) on all of them. Tokens are 256
random bits, so a plain SHA-256 of each is stored: there is nothing to guess that a slower hash
would protect. ``farm user add`` works whether or not the farm runs: the farm reads the file
again when it changes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from pan2render.runner.farm.folder import USERS_NAME, UnsafeRoot, read_small_file, write_private

ADMIN = "admin"  # the user the farm's own token acts as
NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
NAME_RULE = "1-32 characters: lowercase letters, digits, '-' and '_', starting with a letter"
TOKEN_PREFIX = "p2r_"
MAX_TOKEN_LENGTH = 256  # longer Authorization headers are refused before anything is hashed


class UserError(ValueError):
    """A user name refused, or an unknown user."""


@dataclass(frozen=True)
class User:
    name: str
    token_sha256: str
    created_at: float

    @property
    def admin(self) -> bool:
        return self.name == ADMIN


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Users:
    """The users of the farm whose folder is ``root``; ``admin_token``: the farm's own."""

    def __init__(self, root: Path, *, admin_token: str | None = None):
        self.path = root / USERS_NAME
        self._admin = None if admin_token is None else User(ADMIN, token_digest(admin_token), 0.0)
        self._loaded: tuple[int, int, int] | None = None  # (ino, size, mtime_ns) of the file read
        self._users: dict[str, User] = {}

    # ------------------------------------------------------------------ reading
    def _load(self) -> dict[str, User]:
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            self._loaded, self._users = None, {}
            return self._users
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key != self._loaded:
            doc = json.loads(read_small_file(self.path))
            self._users = {n: User(n, u["token_sha256"], float(u["created_at"])) for n, u in doc["users"].items()}
            self._loaded = key
        return self._users

    def all(self) -> list[User]:
        return sorted(self._load().values(), key=lambda u: u.created_at)

    def who(self, token: str) -> User | None:
        """The user ``token`` belongs to (the admin for the farm's own token), or None."""
        if not token or len(token) > MAX_TOKEN_LENGTH:
            return None
        digest = token_digest(token)
        if self._admin is not None and hmac.compare_digest(digest, self._admin.token_sha256):
            return self._admin
        try:
            users = self._load()
        except (OSError, ValueError, KeyError, UnsafeRoot):
            return None  # a damaged users file admits nobody but the admin
        return next((u for u in users.values() if hmac.compare_digest(digest, u.token_sha256)), None)

    # ------------------------------------------------------------------ writing (the farm's owner)
    def add(self, name: str) -> str:
        """A new user named ``name``; returns its token (shown once: only its hash is kept)."""
        if not NAME.fullmatch(name) or name == ADMIN:
            raise UserError(f"user name {name!r}: {NAME_RULE}, and not {ADMIN!r}")
        users = dict(self._load())
        if name in users:
            raise UserError(f"a user {name!r} exists already (`pan2-render farm user remove {name}` first for "
                            f"a new token)")
        token = TOKEN_PREFIX + secrets.token_hex(32)
        users[name] = User(name, token_digest(token), time.time())
        self._write(users)
        return token

    def remove(self, name: str) -> None:
        users = dict(self._load())
        if users.pop(name, None) is None:
            raise UserError(f"no user {name!r} on this farm (`pan2-render farm user list` lists them)")
        self._write(users)

    def _write(self, users: dict[str, User]) -> None:
        doc = {"users": {u.name: {"token_sha256": u.token_sha256, "created_at": u.created_at}
                         for u in users.values()}}
        write_private(self.path, (json.dumps(doc, indent=1) + "\n").encode())
        self._loaded = None
