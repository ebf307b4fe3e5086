"""Records sealed with the job token: whoever reaches the store's port can read and write its keys,
so every record the protocol writes carries an HMAC of the job token over where it is written and
what it says, and a reader takes only a record whose seal it can check. The token itself is never
written to the store.

A sealed value is the record's text, a newline, and the hex HMAC-SHA256 of
``"<generation>/<key>\\0<text>"`` under the token: the generation and key in the MAC keep a record
from being replayed under another key or into another generation. A counter moved by ``add`` is not
sealed (the store adds to it); neither are the wake keys that only tell a waiter to read again.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

from ds_recycle.log import logger

MAC_HEX_LENGTH = 64


class ForgedRecord(RuntimeError):
    """A record that must be in the store is there, but not sealed with this job's token."""


@dataclass
class Seal:
    """The job token's seal on the records of one generation (``generation`` None: the store's root).

    ``token`` None is a reader without the token (``ds-recycle status``): it reads the records
    without checking their seals and cannot write."""

    token: str | None
    generation: int | None = None
    _reported: set[str] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.token == "":
            raise ValueError("sealing the job's records needs the job token (DS_RECYCLE_TOKEN); got an empty one")

    def for_generation(self, generation: int | None) -> Seal:
        return Seal(self.token, generation)

    def _mac(self, key: str, text: bytes) -> str:
        where = f"{'root' if self.generation is None else self.generation}/{key}\0".encode()
        return hmac.new(self.token.encode(), where + text, hashlib.sha256).hexdigest()

    def seal(self, key: str, text: str | bytes) -> bytes:
        """``text`` as written at ``key``: the text, a newline, its MAC."""
        if self.token is None:
            raise PermissionError(f"cannot write {key!r}: this store client was opened without the job token")
        body = text.encode() if isinstance(text, str) else text
        return body + b"\n" + self._mac(key, body).encode()

    def open(self, key: str, value: bytes) -> bytes | None:
        """The record sealed in ``value`` at ``key``, or None when its seal is not this job's: a
        writer without the token wrote it."""
        body, _, mac = value.rpartition(b"\n")
        if self.token is None:
            return body
        if len(mac) == MAC_HEX_LENGTH and hmac.compare_digest(mac.decode("ascii", "replace"), self._mac(key, body)):
            return body
        return None

    def report(self, key: str) -> None:
        """Say once per key that a record there was ignored."""
        if key not in self._reported:
            self._reported.add(key)
            where = "the store's root" if self.generation is None else f"generation {self.generation}"
            logger.warning(
                f"ignored the record at {key!r} ({where}): it is not sealed with this job's token "
                "(written by a process without the token)"
            )
