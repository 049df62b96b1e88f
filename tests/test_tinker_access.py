"""Who may reach the Tinker front: a front without a key never opens the run that a gRPC token
guards, and never listens beyond loopback (issue 21.6)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tinker_loops import KEY

from trainwire.server import serve


def keyless_front(tmp_path: Path, model_root: Path, tinker_listen: str, **options) -> None:
    """Start a server whose Tinker front has no key (the tests expect it refused)."""
    serve(
        listen="127.0.0.1:0",
        state_dir=tmp_path / "state",
        model_root=model_root,
        device="cpu",
        tinker_listen=tinker_listen,
        **options,
    )


def test_a_keyless_front_beside_a_protected_grpc_port_is_refused(tmp_path, model_root) -> None:
    with pytest.raises(ValueError, match="--tinker-listen needs --tinker-token-file"):
        keyless_front(tmp_path, model_root, "127.0.0.1:0", token="grpc-secret")
    assert not (tmp_path / "state").exists()  # refused before anything was touched


def test_a_keyless_front_beyond_loopback_is_refused(tmp_path, model_root) -> None:
    with pytest.raises(ValueError, match="beyond loopback without a key"):
        keyless_front(tmp_path, model_root, "0.0.0.0:0")


def test_the_command_line_says_it_in_one_line(tmp_path: Path, model_root: Path) -> None:
    token = tmp_path / "token"
    token.write_text("grpc-secret\n")
    done = subprocess.run(
        [sys.executable, "-m", "trainwire", "serve", "--listen", "127.0.0.1:0",
         "--state-dir", str(tmp_path / "state"), "--model-root", str(model_root),
         "--token-file", str(token), "--tinker-listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert "--tinker-listen needs --tinker-token-file" in done.stderr
    assert "Traceback" not in done.stderr


def test_with_both_keys_each_port_takes_its_own(tmp_path, model_root) -> None:
    handle = serve(
        listen="127.0.0.1:0",
        state_dir=tmp_path / "state",
        model_root=model_root,
        device="cpu",
        token="grpc-secret",
        tinker_listen="127.0.0.1:0",
        tinker_token=KEY,
    )
    try:
        import httpx

        url = f"{handle.tinker.base_url}/api/v1/create_session"
        assert httpx.post(url, json={}).status_code == 401
        assert httpx.post(url, json={}, headers={"X-API-Key": KEY}).status_code == 200
    finally:
        handle.stop(grace=5)


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/weights_files/../training_runs",
        "/api/v1/weights_files/%2e%2e/training_runs",
        "/api/v1/weights_files/not-a-signed-token",
    ],
)
def test_the_signed_download_route_is_the_only_one_without_a_key(
    tmp_path: Path, model_root: Path, path: str
) -> None:
    """A download URL is its own credential; nothing else is reachable through its prefix:
    a path climbing out of it matches no route (404), and an unsigned token is 401."""
    import socket

    from tinker_loops import tinker_server

    with tinker_server(tmp_path / "state", model_root) as handle:
        host, port = handle.tinker.base_url.removeprefix("http://").split(":")

        def status_of(target: str) -> str:
            with socket.create_connection((host, int(port))) as sock:
                request = f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                sock.sendall(request.encode())
                return sock.recv(4096).decode(errors="replace").split(" ", 2)[1]

        assert status_of("/api/v1/training_runs") == "401"  # keyed routes stay keyed
        expected = "401" if path.endswith("token") else "404"
        assert status_of(path) == expected
