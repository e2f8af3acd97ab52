"""The application's relay secret and the HMAC challenge that every host-path connection passes before any frame.

Every replica of one application gets the same secret (`OMNI_RAY_RELAY_SECRET`, which the Serve app builder and the
Python API put in each replica's environment); a process without one makes a random one of its own, so a peer from
elsewhere fails the handshake. The exchange, on connect (each nonce 32 random bytes):

    server -> client: MAGIC, server nonce
    client -> server: client nonce, HMAC-SHA256(secret, b"client" + MAGIC + server nonce + client nonce)
    server -> client: HMAC-SHA256(secret, b"server" + MAGIC + server nonce + client nonce)

Each side checks the other's proof with `hmac.compare_digest`, so both prove they hold the secret without sending it,
and a recorded exchange does not replay (the other side's nonce is new each time)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import socket
from typing import Any

SECRET_ENV = "OMNI_RAY_RELAY_SECRET"
LISTEN_HOST_ENV = "OMNI_RAY_RELAY_LISTEN_HOST"  # a stage's `relay_listen_host`, in its replicas' environment
MAGIC = b"omni-ray relay v1"  # names the protocol and its version; part of every proof
NONCE_BYTES = 32
PROOF_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0  # a peer that does not answer within this is dropped
_process_secret = secrets.token_hex(32)  # used where the environment names none


class RelayAuthError(ConnectionError):
    """The peer did not prove that it holds this application's relay secret."""


def relay_secret() -> bytes:
    """This process's relay secret: the environment's, else the process's own random one."""
    return (os.environ.get(SECRET_ENV) or _process_secret).encode()


def with_relay_env(actor_options: dict[str, Any], listen_host: str = "") -> dict[str, Any]:
    """Ray actor options for a replica that this process's application starts: its runtime environment carries
    this process's relay secret (over any other value), and the stage's relay listen address when it sets one."""
    env = {SECRET_ENV: os.environ.get(SECRET_ENV) or _process_secret}
    if listen_host:
        env[LISTEN_HOST_ENV] = listen_host
    runtime_env = dict(actor_options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **env}
    return {**actor_options, "runtime_env": runtime_env}


def _proof(secret: bytes, role: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, role + MAGIC + server_nonce + client_nonce, hashlib.sha256).digest()


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = await loop.sock_recv(sock, count - len(data))
        if not chunk:
            raise RelayAuthError("relay peer closed the connection during the handshake")
        data += chunk
    return bytes(data)


async def accept_handshake(sock: socket.socket, secret: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """Server side: challenge the connecting peer; RelayAuthError (or a timeout) unless it proves the secret."""
    loop = asyncio.get_running_loop()
    server_nonce = secrets.token_bytes(NONCE_BYTES)

    async def exchange() -> None:
        await loop.sock_sendall(sock, MAGIC + server_nonce)
        answer = await _recv_exactly(loop, sock, NONCE_BYTES + PROOF_BYTES)
        client_nonce, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        if not hmac.compare_digest(proof, _proof(secret, b"client", server_nonce, client_nonce)):
            raise RelayAuthError("relay peer failed the handshake: wrong application secret")
        await loop.sock_sendall(sock, _proof(secret, b"server", server_nonce, client_nonce))

    await asyncio.wait_for(exchange(), timeout=timeout_s)


async def connect_handshake(sock: socket.socket, secret: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """Client side: answer the server's challenge and check its proof; RelayAuthError when either fails."""
    loop = asyncio.get_running_loop()

    async def exchange() -> None:
        hello = await _recv_exactly(loop, sock, len(MAGIC) + NONCE_BYTES)
        if not hmac.compare_digest(hello[: len(MAGIC)], MAGIC):
            raise RelayAuthError("relay peer does not speak this relay protocol")
        server_nonce, client_nonce = hello[len(MAGIC):], secrets.token_bytes(NONCE_BYTES)
        await loop.sock_sendall(sock, client_nonce + _proof(secret, b"client", server_nonce, client_nonce))
        proof = await _recv_exactly(loop, sock, PROOF_BYTES)
        if not hmac.compare_digest(proof, _proof(secret, b"server", server_nonce, client_nonce)):
            raise RelayAuthError("relay peer failed the handshake: it does not hold this application's secret")

    try:
        await asyncio.wait_for(exchange(), timeout=timeout_s)
    except asyncio.TimeoutError as exc:
        raise RelayAuthError(f"relay peer did not finish the handshake within {timeout_s} s") from exc
