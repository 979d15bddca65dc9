"""The launchers' shared secret and what they prove with it (no TensorFlow).

Every connection between the launchers of a launch across hosts starts with a
challenge and a response from both sides, then carries each message with an
HMAC-SHA256 tag:

    initiator -> acceptor   {"type": "auth", "nonce": NC}        32 fresh random bytes
    acceptor -> initiator   {"type": "auth", "nonce": NS}        32 fresh random bytes
    initiator -> acceptor   {"type": "auth", "proof": HMAC(K, initiator NC NS)}
    acceptor -> initiator   {"type": "auth", "proof": HMAC(K, acceptor NC NS)}
                            (or {"type": "auth", "refused": ...} and the connection closes)
    then, each way          TAG JSON      TAG = HMAC(K_session, direction, number, JSON)

K is the job's secret, K_session = HMAC(K, session NC NS). Both nonces are
fresh on every connection, so nothing recorded from another connection is
accepted (its proofs and tags were made with other nonces); a message's number
is its position on the connection, so a message replayed, dropped or
reordered within one fails too. Tags and proofs are compared in constant time
(`hmac.compare_digest`). The secret itself never travels.

The secret comes from the environment variable `TFMULTI_LAUNCH_SECRET`
or from a file readable only by its owner (`load_secret`).

Example:
    >>> from tfmulti.cluster import auth
    >>> key = b"0123456789abcdef0123456789abcdef"
    >>> nc, ns = auth.nonce(), auth.nonce()
    >>> answer = auth.proof(key, "initiator", nc, ns)
    >>> auth.proof_ok(key, "initiator", nc, ns, answer)
    True
    >>> auth.proof_ok(key, "acceptor", nc, ns, answer)  # the other side's proof differs
    False
    >>> session = auth.session_key(key, nc, ns)
    >>> tag = auth.tag(session, "initiator", 0, b'{"type": "go"}')
    >>> auth.tag_ok(session, "initiator", 0, b'{"type": "go"}', tag)
    True
    >>> auth.tag_ok(session, "initiator", 1, b'{"type": "go"}', tag)  # replayed as the next
    False
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from typing import Mapping

__all__ = ["HOW_TO", "MIN_SECRET_BYTES", "SECRET_ENV", "check_secret", "is_nonce", "load_secret",
           "nonce", "proof", "proof_ok", "session_key", "tag", "tag_ok"]

SECRET_ENV = "TFMULTI_LAUNCH_SECRET"
"""The environment variable that holds the job's shared secret."""
MIN_SECRET_BYTES = 16
"""The shortest secret accepted (a `secrets.token_hex(32)` has 64)."""
_MAX_SECRET_BYTES = 4096
HOW_TO = (f"make one and give every host the same: export {SECRET_ENV}=$(python -c "
          "\"import secrets; print(secrets.token_hex(32))\") (under SLURM: export it in the "
          "batch script before `srun`), or write it to a file only you can read and pass "
          "--secret_file PATH")
"""How to make a secret, for the messages that ask for one."""
_NONCE_BYTES = 32
_ROLES = ("initiator", "acceptor")


def check_secret(secret: str | bytes, source: str) -> bytes:
    """`secret` (from `source`, named in the errors: never the secret itself) as bytes,
    without surrounding whitespace.

    Raises:
        ValueError: empty, shorter than `MIN_SECRET_BYTES` or longer than 4096 bytes.
    """
    value = os.fsencode(secret) if isinstance(secret, str) else bytes(secret)
    value = value.strip()
    if not value:
        raise ValueError(f"the launchers' secret from {source} is empty; {HOW_TO}.")
    if len(value) < MIN_SECRET_BYTES:
        raise ValueError(f"the launchers' secret from {source} has {len(value)} bytes, "
                         f"fewer than {MIN_SECRET_BYTES}: too easy to guess; {HOW_TO}.")
    if len(value) > _MAX_SECRET_BYTES:
        raise ValueError(f"the launchers' secret from {source} has {len(value)} bytes, more "
                         f"than {_MAX_SECRET_BYTES}; {HOW_TO}.")
    return value


def _read_secret_file(path: str) -> bytes:
    where = f"`secret_file` {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOCTTY)
    except OSError as e:
        raise ValueError(f"cannot read {where} ({e.strerror or e}); give the path of a file "
                         f"that holds the secret; {HOW_TO}.") from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{where} is not a regular file; {HOW_TO}.")
        if info.st_mode & 0o077:
            raise ValueError(f"{where} can be read or written by others (mode "
                             f"{stat.S_IMODE(info.st_mode):04o}); make it readable only by "
                             f"its owner: chmod 600 {path}")
        data = os.read(fd, _MAX_SECRET_BYTES + 2)
    except OSError as e:
        raise ValueError(f"cannot read {where} ({e.strerror or e}); {HOW_TO}.") from e
    finally:
        os.close(fd)
    return check_secret(data, where)


def load_secret(environ: Mapping[str, str], secret_file: str | None = None) -> bytes:
    """The job's shared secret: the content of `secret_file` when given, else the
    environment variable `SECRET_ENV` of `environ`.

    Raises:
        ValueError: no secret, a secret too short or too long, or a `secret_file` that
            cannot be read, is not a regular file, or can be read or written by anyone
            but its owner (mode & 0o077).
    """
    if secret_file is not None:
        return _read_secret_file(os.fspath(secret_file))
    value = environ.get(SECRET_ENV)
    if value is None:
        raise ValueError(f"a launch across hosts needs the launchers' shared secret, so that "
                         f"no other machine can join the job or steer it: {SECRET_ENV} is not "
                         f"set and no --secret_file was given; {HOW_TO}.")
    return check_secret(value, SECRET_ENV)


def nonce() -> str:
    """A fresh challenge: 32 random bytes, as hex."""
    return secrets.token_hex(_NONCE_BYTES)


def is_nonce(value) -> bool:
    """Whether `value` has a nonce's form (64 hex digits)."""
    return (isinstance(value, str) and len(value) == 2 * _NONCE_BYTES
            and all(c in "0123456789abcdef" for c in value))


def _mac(key: bytes, *parts) -> str:
    return hmac.new(key, "\n".join(map(str, parts)).encode(), hashlib.sha256).hexdigest()


def proof(secret: bytes, role: str, initiator_nonce: str, acceptor_nonce: str) -> str:
    """What `role` ("initiator" or "acceptor") answers to prove that it holds `secret`,
    bound to both nonces of the connection."""
    if role not in _ROLES:
        raise ValueError(f"`role` must be one of {_ROLES}, got {role!r}.")
    return _mac(secret, "tfmulti launch proof", role, initiator_nonce, acceptor_nonce)


def proof_ok(secret: bytes, role: str, initiator_nonce: str, acceptor_nonce: str,
             received) -> bool:
    """Whether `received` is `role`'s proof for these nonces (compared in constant time)."""
    return isinstance(received, str) and hmac.compare_digest(
        proof(secret, role, initiator_nonce, acceptor_nonce).encode(),
        received.encode("utf-8", "replace"))


def session_key(secret: bytes, initiator_nonce: str, acceptor_nonce: str) -> bytes:
    """The key of one connection's message tags."""
    return bytes.fromhex(_mac(secret, "tfmulti launch session", initiator_nonce,
                              acceptor_nonce))


def tag(key: bytes, sender: str, number: int, payload: bytes) -> str:
    """The tag of the `number`-th message (from 0) that `sender` ("initiator" or
    "acceptor") sends on a connection with session `key`."""
    return hmac.new(key, f"{sender}\n{number}\n".encode() + payload,
                    hashlib.sha256).hexdigest()


def tag_ok(key: bytes, sender: str, number: int, payload: bytes, received: bytes | str) -> bool:
    """Whether `received` is the tag of that message (compared in constant time)."""
    if isinstance(received, str):
        received = received.encode("utf-8", "replace")
    return hmac.compare_digest(tag(key, sender, number, payload).encode(), received)
