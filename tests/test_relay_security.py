"""The host-path relay's security: a raw TCP client that skips the handshake, or holds the wrong secret, is refused and
counted, and nothing it sends executes (not even a pickle after a valid handshake); proper clients keep working."""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
import time
from pathlib import Path

import pytest
import torch

from omni_ray.relay import RelayEndpoint, RelayItem, RelayMessage, RelayPeer, RelayServer, TcpTransport
from omni_ray.relay.auth import MAGIC, NONCE_BYTES, RelayAuthError, relay_secret, with_relay_env
from omni_ray.relay.wire import FIXED


class _Touch:
    """Unpickling this creates `path`: proof that a pickle ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return Path.touch, (self.path,)


def _old_style_frame(payload: bytes) -> bytes:
    """A frame as the pickle relay took it: (body length, buffer count), then a pickled body."""
    return FIXED.pack(len(payload), 0) + payload


async def _start() -> tuple[RelayServer, RelayPeer, list[RelayItem]]:
    endpoint = RelayEndpoint()
    got: list[RelayItem] = []
    endpoint.claim("good", got.append)
    server = RelayServer(endpoint, handshake_timeout_s=1.0)
    return server, RelayPeer("consumer", await server.start("127.0.0.1")), got


async def _raw_client(peer: RelayPeer, payload: bytes, read_hello: bool) -> bytes:
    """Connects, optionally reads the server's challenge, sends `payload` and returns what comes back before the
    server closes the connection."""
    host, port = peer.address.removeprefix("tcp://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        if read_hello:
            assert (await reader.readexactly(len(MAGIC) + NONCE_BYTES)).startswith(MAGIC)
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout=10)  # read to the end: the server closes
    except ConnectionError:
        return b""
    finally:
        writer.close()


async def _until(condition: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _good_client_delivers(peer: RelayPeer, got: list[RelayItem], seq: int) -> None:
    await TcpTransport().send(peer, RelayMessage("producer", [RelayItem("good", tensors={"x": torch.ones(2)}, seq=seq)]))
    await _until(lambda: len(got) == seq + 1)


def test_a_pickle_without_the_handshake_is_refused_and_never_runs(tmp_path: Path) -> None:
    flag = tmp_path / "pwned"
    evil = pickle.dumps(_Touch(flag))

    async def main() -> None:
        server, peer, got = await _start()
        # a pickle straight away, as the old relay took it, and as the answer to the challenge
        for payload, read_hello in ((_old_style_frame(evil), False), (evil * 4, True), (b"\x00" * 64, True)):
            rest = await _raw_client(peer, payload, read_hello)
            assert len(rest) <= len(MAGIC) + NONCE_BYTES  # nothing beyond the challenge: no proof, no frame read
        await _until(lambda: server.rejected == 3)
        host, port = peer.address.removeprefix("tcp://").rsplit(":", 1)
        silent = socket.create_connection((host, int(port)))  # connects and says nothing
        await _until(lambda: server.rejected == 4, timeout=5)  # dropped after the handshake timeout
        silent.close()
        await _good_client_delivers(peer, got, 0)
        await server.close()

    asyncio.run(main())
    assert not flag.exists()


def test_a_pickle_after_a_valid_handshake_is_a_decode_error_and_never_runs(tmp_path: Path) -> None:
    flag = tmp_path / "pwned"

    async def main() -> None:
        server, peer, got = await _start()
        transport = TcpTransport()
        await transport.send(peer, RelayMessage("warm", []))  # an authenticated connection
        sock = transport.connections[peer.address]
        await asyncio.get_running_loop().sock_sendall(sock, _old_style_frame(pickle.dumps(_Touch(flag))))
        await _until(lambda: server.rejected == 1 and peer.address not in transport.connections)
        await _good_client_delivers(peer, got, 0)
        await server.close()

    asyncio.run(main())
    assert not flag.exists()


def test_both_sides_must_hold_the_applications_secret() -> None:
    """A client with another secret is refused (and counted); a server with another secret is refused by the client
    (mutual proof), so neither learns what the other would send (CUDA IPC handles, rendezvous addresses)."""

    async def main() -> None:
        server, peer, got = await _start()
        stranger = TcpTransport(secret=b"another application")
        with pytest.raises(RelayAuthError):
            await stranger.send(peer, RelayMessage("producer", [RelayItem("good", seq=0)]))
        await _until(lambda: server.rejected == 1)
        assert not got
        impostor = RelayServer(RelayEndpoint(), secret=b"another application")
        impostor_peer = RelayPeer("impostor", await impostor.start("127.0.0.1"))
        with pytest.raises(RelayAuthError):
            await TcpTransport().send(impostor_peer, RelayMessage("caller", [], control={"op": "ipc"}))
        await _good_client_delivers(peer, got, 0)
        await server.close()
        await impostor.close()

    asyncio.run(main())


def test_replicas_get_one_secret_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_RAY_RELAY_SECRET", raising=False)
    own = relay_secret()
    assert len(own) >= 32 and relay_secret() == own  # without one configured: this process's random secret
    options = with_relay_env({"num_cpus": 1, "runtime_env": {"env_vars": {"A": "1"}}}, "0.0.0.0")
    env = options["runtime_env"]["env_vars"]
    assert env["OMNI_RAY_RELAY_SECRET"].encode() == own and env["A"] == "1"
    assert env["OMNI_RAY_RELAY_LISTEN_HOST"] == "0.0.0.0" and options["num_cpus"] == 1
    monkeypatch.setenv("OMNI_RAY_RELAY_SECRET", "from-a-kubernetes-secret")
    assert relay_secret() == b"from-a-kubernetes-secret"
    assert with_relay_env({})["runtime_env"]["env_vars"] == {"OMNI_RAY_RELAY_SECRET": "from-a-kubernetes-secret"}


def test_the_serve_app_hands_every_replica_one_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_ray.serve.app import build_app

    monkeypatch.setenv("OMNI_RAY_RELAY_SECRET", "s3cret")
    app = build_app({"pipeline": {"stages": {"talker": {"relay_listen_host": "0.0.0.0"}}}})
    [model] = app._bound_deployment.init_args[0]  # the ingress's models: one, with its stages' deployments
    deployments = [app._bound_deployment, *[a._bound_deployment for a in model["stages"].values()]]
    assert len(deployments) == 5
    for deployment in deployments:
        env = deployment.ray_actor_options["runtime_env"]["env_vars"]
        assert env["OMNI_RAY_RELAY_SECRET"] == "s3cret"
        assert env.get("OMNI_RAY_RELAY_LISTEN_HOST") == ("0.0.0.0" if deployment.name == "talker" else None)


def test_frames_on_the_wire_carry_no_pickle() -> None:
    from omni_ray.relay.wire import encode_message

    frame = b"".join(bytes(p) for p in encode_message(RelayMessage("p", [RelayItem("r", tensors={"x": torch.ones(1)})])))
    assert not frame[FIXED.size:].startswith(b"\x80")  # pickle's protocol opcode
    assert struct.unpack_from("!QI", frame)[1] == 1
