"""The tenants map (``--tenants FILE``): what it takes, and each mistake refused in one line
naming the entry."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainwire.server.process import serve, tenant_weight
from trainwire.server.service.run_owners import RunOwners
from trainwire.server.service.state_dir import StateDirectory
from trainwire.server.service.tenants import Tenant, Tenants, read_keys

GOOD = """
tenants:
  - {name: alice, key: tml-alice-key, max_runs: 2, weight: 3}
  - {name: bob, key: bob-grpc-key}
  - {name: ro, key: tml-read-only, max_runs: 0}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    return path


def test_a_map_names_each_key_its_tenant_with_its_limits_and_weight(tmp_path: Path) -> None:
    tenants = Tenants.load(write(tmp_path, GOOD))
    assert tenants.names == ["alice", "bob", "ro"]
    assert tenants.by_key("tml-alice-key").name == "alice"
    assert tenants.by_key("bob-grpc-key").name == "bob"
    assert tenants.by_key("tml-alice-ke") is None and tenants.by_key("") is None
    assert (tenants.weight_of("alice"), tenants.weight_of("bob")) == (3.0, 1.0)
    assert (tenants.max_runs_of("alice"), tenants.max_runs_of("bob")) == (2, None)
    tenants.check_run_limit("alice", 1)
    with pytest.raises(RuntimeError, match="tenant 'ro' may hold at most 0 open run"):
        tenants.check_run_limit("ro", 0)
    assert "tml-alice-key" not in repr(list(tenants))  # keys never reach a log line


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tenants: {name: a, key: k}", "tenants must be a list"),
        ("- {name: a, key: k}", "give one top-level key, tenants"),
        ("tenants: []\nextra: 1", "give one top-level key, tenants"),
        ("tenants: []", "give at least one tenant"),
        ("tenants: [{name: a, key: k, weigth: 2}]", r"entry 1 \('a'\): unknown field 'weigth'"),
        ("tenants: [{name: a}]", r"entry 1 \('a'\): key is required"),
        ("tenants: [{key: k}]", "entry 1: name is required"),
        ("tenants: [{name: a, key: ''}]", r"entry 1 \('a'\): key must be a non-empty string"),
        ("tenants: [{name: a, key: 12}]", r"entry 1 \('a'\): key must be a non-empty string"),
        ("tenants: [{name: a, key: 'x y'}]", "key must be printable ASCII without spaces"),
        ("tenants: [{name: a.b, key: k}]", r"entry 1 \('a.b'\): name must be 1-48 characters"),
        ("tenants: [{name: a, key: k, max_runs: -1}]", "max_runs must be an integer >= 0"),
        ("tenants: [{name: a, key: k, max_runs: '2'}]", "max_runs must be an integer >= 0"),
        ("tenants: [{name: a, key: k, max_runs: true}]", "max_runs must be an integer >= 0"),
        ("tenants: [{name: a, key: k, weight: 0}]", "weight must be a positive number"),
        ("tenants: [{name: a, key: k, weight: .nan}]", "weight must be a positive number"),
        ("tenants: [{name: a, key: k, weight: x}]", "weight must be a positive number"),
        ("tenants: [a]", "entry 1: give a mapping"),
        (
            "tenants: [{name: a, key: k}, {name: a, key: j}]",
            r"entry 2 \('a'\): the name is also entry 1's",
        ),
        (
            "tenants: [{name: a, key: k}, {name: b, key: k}]",
            r"entry 2 \('b'\): the key is also entry 1's",
        ),
        ("tenants: [{name: a, key: k}", r"not valid YAML \(line 1\)"),
        ("tenants:\n  - {name: a, key: k, key: j}", "line 2: 'key' is given twice"),
        (
            "tenants:\n  - name: a\n    key: k\n    max_runs: 1\n    max_runs: 5",
            "line 5: 'max_runs'",
        ),
    ],
)
def test_every_mistake_is_one_line_naming_the_entry(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=message) as refused:
        Tenants.load(path)
    assert "\n" not in str(refused.value) and str(refused.value).startswith(f"--tenants {path}")


def test_a_token_file_holds_one_key_as_before_or_the_same_map(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("plain-token\n")
    assert read_keys(tmp_path / "token", "--token-file") == "plain-token"
    keys = read_keys(write(tmp_path, GOOD), "--token-file")
    assert isinstance(keys, Tenants) and keys.names == ["alice", "bob", "ro"]
    (tmp_path / "twice").write_text("tenants: [{name: a, key: tml-a, key: tml-b}]\n")
    with pytest.raises(ValueError, match=r"--token-file .*twice: line 1: 'key' is given twice"):
        read_keys(tmp_path / "twice", "--token-file")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match=r"--token-file .*empty is empty"):
        read_keys(tmp_path / "empty", "--token-file")


def test_tenants_and_a_token_file_together_are_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    tenants = Tenants([Tenant("alice", "tml-alice-key")])
    with pytest.raises(ValueError, match="--tenants gives the keys of both ports"):
        serve("127.0.0.1:0", tmp_path / "state", token="t", tenants=tenants)
    assert not (tmp_path / "state").exists()


def test_a_runs_share_of_the_turns_is_its_tenants_weight(tmp_path):
    tenants = Tenants([Tenant("alice", "key-a", weight=3.0), Tenant("bob", "key-b")])
    state_dir = StateDirectory(tmp_path / "state")
    owners = RunOwners(state_dir)
    owners.claim("alice-run", "alice")
    owners.claim("bob-run", "bob")
    assert tenant_weight(tenants, owners, "alice-run") == 3.0
    assert tenant_weight(tenants, owners, "bob-run") == 1.0
    assert tenant_weight(tenants, owners, "nobodys") == 1.0  # no tenant of the map
    state_dir.release()
