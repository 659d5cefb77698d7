"""Manifest signing keys: one current key signs, previous keys still verify.

A manifest names the key that signed it (``key_id``, derived from the key, so
nothing but the secret has to be configured). Rotating a key means moving the
old one to the previous keys: checkpoints signed with it keep verifying. Turning
signing on does not condemn unsigned checkpoints unless ``strict`` says so, and
a manifest signed with a key this keyring does not hold is *unverifiable*, not
corrupt: the bytes may be fine, this process just cannot tell.

Keys come from the environment or from a file only its owner can read:
``REWIND_MANIFEST_KEY`` (the current key), ``REWIND_MANIFEST_PREVIOUS_KEYS``
(comma-separated), or ``REWIND_MANIFEST_KEY_FILE`` (one key per line, the first
is current; refused unless its mode is 0600 or stricter). ``REWIND_MANIFEST_STRICT=1``
refuses unsigned manifests.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from rewind.infra.errors import ConfigError

KEY_ENV = "REWIND_MANIFEST_KEY"
PREVIOUS_ENV = "REWIND_MANIFEST_PREVIOUS_KEYS"
FILE_ENV = "REWIND_MANIFEST_KEY_FILE"
STRICT_ENV = "REWIND_MANIFEST_STRICT"
MAC_FIELD = "hmac_sha256"
KEY_ID_FIELD = "key_id"


class Signature(StrEnum):
    VALID = "valid"
    UNSIGNED = "unsigned"  # acceptable unless strict
    UNKNOWN_KEY = "unknown_key"  # unverifiable: this keyring lacks the key
    INVALID = "invalid"  # a key we hold says the manifest was altered


def key_id(key: str) -> str:
    """A public name for a key: a domain-separated hash, never the key itself."""
    return hashlib.sha256(b"rewind-manifest-key\0" + key.encode()).hexdigest()[:16]


def _mac(key: str, body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key.encode(), canonical, hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class Keyring:
    keys: tuple[str, ...] = ()  # the first signs; all verify
    strict: bool = False

    @property
    def signing(self) -> bool:
        return bool(self.keys)

    def sign(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with the current key's id and HMAC added (unchanged when no key is set)."""
        if not self.keys:
            return body
        signed = {**body, KEY_ID_FIELD: key_id(self.keys[0])}
        return {**signed, MAC_FIELD: _mac(self.keys[0], signed)}

    def check(self, body: dict[str, Any]) -> Signature:
        """Verify a parsed manifest body (with its ``hmac_sha256`` and, from format 2 on, ``key_id``)."""
        mac = body.get(MAC_FIELD)
        if mac is None:
            return Signature.UNSIGNED
        unsigned = {k: v for k, v in body.items() if k != MAC_FIELD}
        kid = body.get(KEY_ID_FIELD)
        candidates = [k for k in self.keys if kid is None or key_id(k) == kid]
        if not candidates:
            return Signature.UNKNOWN_KEY
        if any(hmac.compare_digest(str(mac), _mac(k, unsigned)) for k in candidates):
            return Signature.VALID
        # Format 1 named no key: a mismatch may just be a key we do not hold.
        return Signature.INVALID if kid is not None else Signature.UNKNOWN_KEY


def _read_key_file(path: Path) -> list[str]:
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigError(f"{FILE_ENV}={path}: cannot read it ({exc.strerror})") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{FILE_ENV}={path} is readable by others (mode {oct(mode & 0o777)}); chmod 600 it")
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def from_env() -> Keyring:
    """The keyring this process was given (empty: manifests are neither signed nor checked)."""
    keys: list[str] = []
    if os.environ.get(FILE_ENV):
        keys += _read_key_file(Path(os.environ[FILE_ENV]).expanduser())
    if os.environ.get(KEY_ENV):
        keys.insert(0, os.environ[KEY_ENV])
    keys += [k.strip() for k in os.environ.get(PREVIOUS_ENV, "").split(",") if k.strip()]
    strict = os.environ.get(STRICT_ENV, "").lower() in ("1", "true", "yes")
    if strict and not keys:
        raise ConfigError(f"{STRICT_ENV} is set but no key is: set {KEY_ENV} or {FILE_ENV}")
    return Keyring(tuple(dict.fromkeys(keys)), strict)
