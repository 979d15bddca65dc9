"""One authenticated connection between two launchers of a launch across hosts (no
TensorFlow): JSON messages, one per line, each with an HMAC tag under the job's
shared secret after a challenge and response from both sides
(`tfmulti.cluster.auth`). The launchers' protocol over it is
`tfmulti.cluster.rendezvous`'s."""

from __future__ import annotations

import json
import select
import socket
from typing import Callable

from tfmulti.cluster import auth

__all__ = ["Channel"]

_SEND_TIMEOUT_S = 10.0
_MAX_LINE = 1 << 20
_MAX_HANDSHAKE_LINE = 1024
# A peer host that vanished without closing its connection is found in about
# IDLE + INTERVAL * COUNT seconds.
_KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}


class Channel:
    """One TCP connection between two launchers that carries JSON messages, one per line,
    each authenticated with the job's `secret` (`tfmulti.cluster.auth`): the side that
    connected is the `initiator`. Messages sent before both sides proved that they hold the
    secret wait until they have; a peer that fails a proof or a tag, or sends anything
    else, is dropped: the channel closes, `failed` is set and `on_failure(peer)` is
    called."""

    def __init__(self, sock: socket.socket, peer: str, secret: bytes, initiator: bool,
                 on_failure: Callable[[str], None] = lambda peer: None):
        self.sock, self.peer = sock, peer
        self.closed = False
        self.failed = False  # the peer failed authentication
        self.refused = False  # the peer refused this launcher's proof
        self._secret, self._on_failure = secret, on_failure
        self._me, self._them = (("initiator", "acceptor") if initiator
                                else ("acceptor", "initiator"))
        self._nonces: dict[str, str] = {}
        self._key: bytes | None = None  # once both proofs passed
        self._sent = self._received = 0  # messages tagged each way
        self._outbox: list[dict] = []
        self._buffer = b""
        self.unread: list[dict] = []  # received, to be returned by the next `receive`
        sock.settimeout(_SEND_TIMEOUT_S)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in _KEEPALIVE.items():
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
        if initiator:
            self._nonces["initiator"] = auth.nonce()
            self._send_line(json.dumps({"type": "auth", "nonce": self._nonces["initiator"]}))

    @property
    def authenticated(self) -> bool:
        return self._key is not None

    def fileno(self) -> int:
        return self.sock.fileno()

    def _send_line(self, line: str) -> bool:
        try:
            self.sock.sendall(line.encode() + b"\n")
            return True
        except OSError:
            self.closed = True
            return False

    def send(self, message: dict) -> bool:
        """Sends `message` (once the peer is authenticated); False when the peer is gone."""
        if self.closed:
            return False
        if not self.authenticated:
            self._outbox.append(message)
            return True
        payload = json.dumps(message)
        tag = auth.tag(self._key, self._me, self._sent, payload.encode())
        self._sent += 1
        return self._send_line(f"{tag} {payload}")

    def _fail(self) -> None:
        if not self.failed:
            self.failed = True
            self.close()
            self._on_failure(self.peer)

    def _handshake(self, line: bytes) -> None:
        """One line of the challenge and response (`tfmulti.cluster.auth`)."""
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        if not isinstance(message, dict) or message.get("type") != "auth":
            return self._fail()  # not a launcher of this job, or one without a secret
        if "refused" in message and self._me == "initiator":
            self.refused = True
            return self.close()
        nonce, proof = message.get("nonce"), message.get("proof")
        if self._them not in self._nonces:
            if not auth.is_nonce(nonce):
                return self._fail()
            self._nonces[self._them] = nonce
            if self._me == "acceptor":
                self._nonces["acceptor"] = auth.nonce()
                self._send_line(json.dumps({"type": "auth", "nonce": self._nonces["acceptor"]}))
            else:
                self._send_line(json.dumps({"type": "auth", "proof": self._proof("initiator")}))
            return None
        nonces = (self._nonces["initiator"], self._nonces["acceptor"])
        if not auth.proof_ok(self._secret, self._them, *nonces, proof):
            if self._me == "acceptor":
                self._send_line(json.dumps({"type": "auth", "refused": "failed authentication"}))
            return self._fail()
        if self._me == "acceptor":
            self._send_line(json.dumps({"type": "auth", "proof": self._proof("acceptor")}))
        self._key = auth.session_key(self._secret, *nonces)
        waiting, self._outbox = self._outbox, []
        for queued in waiting:
            self.send(queued)
        return None

    def _proof(self, role: str) -> str:
        return auth.proof(self._secret, role, self._nonces["initiator"],
                          self._nonces["acceptor"])

    def _open(self, line: bytes) -> dict | None:
        """The message of an authenticated line, or None (and the peer dropped)."""
        tag, _, payload = line.partition(b" ")
        if not auth.tag_ok(self._key, self._them, self._received, payload, tag):
            self._fail()
            return None
        self._received += 1
        try:
            message = json.loads(payload)
        except ValueError:
            message = None
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            self._fail()
            return None
        return message

    def receive(self, timeout_s: float = 0.0) -> list[dict]:
        """The messages that arrived, waiting up to `timeout_s` for the first; sets
        `closed` when the peer closed the connection or failed authentication."""
        messages, self.unread = self.unread, []
        if self.closed:
            return messages
        ready, _, _ = select.select([self.sock], [], [], 0 if messages else timeout_s)
        while ready:
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                self.closed = True
                break
            self._buffer += data
            ready, _, _ = select.select([self.sock], [], [], 0)
        *lines, self._buffer = self._buffer.split(b"\n")
        if len(self._buffer) > (_MAX_LINE if self.authenticated else _MAX_HANDSHAKE_LINE):
            self._fail()
        for line in lines:
            if self.failed or self.refused:
                break
            if not self.authenticated:
                self._handshake(line)
                continue
            message = self._open(line)
            if message is None:
                break
            messages.append(message)
        return messages

    def close(self) -> None:
        self.closed = True
        self.sock.close()
