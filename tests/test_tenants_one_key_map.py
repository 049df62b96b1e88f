"""One key map, both ports: a server never has a keyed port beside an open one. A Tinker front
keyed by a tenants map (or a key) beside a gRPC port without one used to start without a word,
and any local process then listed, read, sampled and closed every tenant's run over gRPC; it is
refused at start, in one line, before torch is imported, as the reverse already was.
``--tenants FILE`` keys both ports with one map."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from service_fixtures import NO_RETRY, connect, running_server

from trainwire.cli import build_parser
from trainwire.serve_command import read_port_keys
from trainwire.server.port_keys import PortKeys, port_keys
from trainwire.server.service.tenants import Tenant, Tenants

ALICE, BOB = "tml-alice-key", "tml-bob-key"
TENANTS = Tenants([Tenant("alice", ALICE), Tenant("bob", BOB)])
FRONT = "127.0.0.1:0"
OPEN_GRPC = "--tinker-token-file keys the Tinker front, but the gRPC port (--listen) has no key"
OPEN_FRONT = "--tinker-listen needs --tinker-token-file when the gRPC port needs --token-file"


def write_tenants(directory: Path) -> Path:
    path = directory / "tenants.yaml"
    entries = [{"name": t.name, "key": t.key} for t in TENANTS]
    path.write_text(yaml.safe_dump({"tenants": entries}))
    return path


@pytest.mark.parametrize(
    ("token", "tinker_token", "refusal"),
    [
        (None, TENANTS, OPEN_GRPC),  # the review's case: a map on the front, gRPC open
        (None, ALICE, OPEN_GRPC),  # a single key on the front, gRPC open
        (TENANTS, None, OPEN_FRONT),
        ("grpc-secret", None, OPEN_FRONT),
        (TENANTS, TENANTS, None),
        ("grpc-secret", ALICE, None),  # two keys, one per port
        (None, None, None),  # nothing keyed, on loopback
    ],
)
def test_beside_a_front_both_ports_have_keys_or_neither_has(token, tinker_token, refusal) -> None:
    if refusal is None:
        assert port_keys(FRONT, None, token, tinker_token) == PortKeys(token, tinker_token)
    else:
        with pytest.raises(ValueError, match=f"^{re.escape(refusal)}"):
            port_keys(FRONT, None, token, tinker_token)


def test_a_front_key_without_a_front_beside_an_open_grpc_port_is_refused() -> None:
    with pytest.raises(
        ValueError, match="--tinker-token-file without --tinker-listen keys no port"
    ):
        port_keys(None, None, None, ALICE)
    assert port_keys(None, None, "grpc-secret", None) == PortKeys("grpc-secret", None)


def test_tenants_key_both_ports_and_go_with_no_other_key() -> None:
    assert port_keys(FRONT, TENANTS, None, None) == PortKeys(TENANTS, TENANTS)
    assert port_keys(None, TENANTS, None, None) == PortKeys(TENANTS, TENANTS)
    with pytest.raises(ValueError, match="--tenants gives the keys of both ports"):
        port_keys(FRONT, TENANTS, None, ALICE)


def test_a_server_with_a_keyed_front_beside_an_open_grpc_port_does_not_start(
    tmp_path: Path, model_root: Path
) -> None:
    from trainwire.server import serve

    with pytest.raises(ValueError, match=re.escape(OPEN_GRPC)):
        serve(
            "127.0.0.1:0",
            tmp_path / "state",
            model_root,
            device="cpu",
            tinker_listen=FRONT,
            tinker_token=TENANTS,
        )
    assert not (tmp_path / "state").exists()  # refused before anything was touched


# Runs ``trainwire serve`` in a fresh interpreter and reports its exit code and whether torch
# was imported by then: the refusal must come before the server's heavy imports.
SERVE_AND_REPORT = """
import json, sys
from trainwire.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def test_the_command_line_refuses_it_in_one_line_before_importing_torch(
    tmp_path: Path, model_root: Path
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SERVE_AND_REPORT, "serve", "--listen", "127.0.0.1:0",
         "--state-dir", str(tmp_path / "state"), "--model-root", str(model_root),
         "--tinker-listen", FRONT, "--tinker-token-file", str(write_tenants(tmp_path))],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert json.loads(done.stdout) == {"code": 2, "torch": False}
    assert done.stderr.count("\n") == 1 and OPEN_GRPC in done.stderr, done.stderr
    assert not (tmp_path / "state").exists()


def test_the_command_line_reads_one_map_or_one_file_for_both_ports(tmp_path: Path) -> None:
    tenants = write_tenants(tmp_path)
    key = tmp_path / "key.txt"
    key.write_text(ALICE + "\n")
    serve = ["serve", "--listen", "127.0.0.1:0", "--state-dir", "unused", "--tinker-listen", FRONT]
    parse = build_parser().parse_args
    keys = read_port_keys(parse([*serve, "--tenants", str(tenants)]))
    assert keys.grpc is keys.tinker and keys.grpc.names == ["alice", "bob"]
    same = read_port_keys(
        parse([*serve, "--token-file", str(key), "--tinker-token-file", str(key)])
    )
    assert same == PortKeys(ALICE, ALICE)


def test_tenants_keep_every_keyless_caller_out_of_both_ports(
    tmp_path: Path, model_root: Path
) -> None:
    with running_server(tmp_path / "state", model_root, tenants=TENANTS, tinker_listen=FRONT) as h:
        keyless = connect(h, retry=NO_RETRY)
        with pytest.raises(grpc.RpcError) as refused:
            keyless.runs()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert connect(h, token=BOB, retry=NO_RETRY).runs() == []
        url = f"{h.tinker.base_url}/api/v1/create_session"
        assert httpx.post(url, json={}).status_code == 401
        assert httpx.post(url, json={}, headers={"X-API-Key": ALICE}).status_code == 200
