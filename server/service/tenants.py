"""Tenants: the keys a server takes, each naming who owns what its calls create.

``trainwire serve --tenants FILE`` reads a YAML map, the same one for the gRPC port and the
Tinker front::

    tenants:
      - {name: alice, key: tml-..., max_runs: 2, weight: 2.0}
      - {name: bob, key: tml-...}

A single key (``--token-file``, ``--tinker-token-file``) is the one-tenant form: one tenant named
``default`` (``Tenants.single``), which is also who owns whatever a server wrote before it had
tenants. A tenant sees and touches only its own runs, checkpoints, downloads and futures; the
transports check that (``grpc/servicer.py``, ``tinker/tenancy.py``). A Tinker SDK client can
only send a key that starts with ``tml-``: a tenant with another key uses gRPC only.

``max_runs`` caps the runs a tenant holds open at once (0: none, a tenant that may only read and
remove what it has); ``weight`` is its share when runs of several tenants wait for the device.
"""

from __future__ import annotations

import hmac
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainwire.server.errors import FailedPrecondition

DEFAULT_TENANT = "default"  # the one tenant of a single key, and the owner of older data
# Tenant names appear inside the ids the Tinker front hands out (and so in run ids): no ".",
# ":" or "/", which separate the parts of those ids.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,47}")
NAME_RULE = "1-48 characters from A-Z a-z 0-9 _ -, starting with a letter or digit"
# A key travels as an HTTP header and as gRPC metadata: printable ASCII, no spaces.
KEY_PATTERN = re.compile(r"[!-~]+")
FIELDS = ("name", "key", "max_runs", "weight")


@dataclass(frozen=True)
class Tenant:
    """One key and who it is. ``max_runs`` None: no cap of its own; ``weight``: its share."""

    name: str
    key: str = field(repr=False)  # never in a log line or an error
    max_runs: int | None = None
    weight: float = 1.0


class Tenants:
    """The server's tenants by name, and the one way to tell who a key is (constant time)."""

    def __init__(self, tenants: Sequence[Tenant], *, source: str = "tenants") -> None:
        if not tenants:
            raise ValueError(f"{source}: give at least one tenant")
        seen_names: dict[str, int] = {}
        seen_keys: dict[str, int] = {}
        for index, tenant in enumerate(tenants, 1):
            where = f"{source}: entry {index} ({tenant.name!r})"
            _check_tenant(tenant, where)
            if tenant.name in seen_names:
                raise ValueError(
                    f"{where}: the name is also entry {seen_names[tenant.name]}'s; names are unique"
                )
            if tenant.key in seen_keys:
                raise ValueError(
                    f"{where}: the key is also entry {seen_keys[tenant.key]}'s; each tenant "
                    "needs a key of its own"
                )
            seen_names[tenant.name], seen_keys[tenant.key] = index, index
        self._tenants = {tenant.name: tenant for tenant in tenants}

    @classmethod
    def single(cls, key: str) -> Tenants:
        """The one-tenant form of a single key."""
        return cls([Tenant(DEFAULT_TENANT, key)], source="the token")

    @classmethod
    def from_data(cls, data: Any, source: str) -> Tenants:
        """``{"tenants": [{name, key, max_runs?, weight?}, ...]}``, checked entry by entry."""
        if not isinstance(data, dict) or set(data) != {"tenants"}:
            raise ValueError(f"{source}: give one top-level key, tenants: [{{name, key}}, ...]")
        entries = data["tenants"]
        if not isinstance(entries, list):
            raise ValueError(f"{source}: tenants must be a list of {{name, key}} entries")
        tenants = [_tenant_of(entry, i, source) for i, entry in enumerate(entries, 1)]
        return cls(tenants, source=source)

    @classmethod
    def load(cls, path: str | Path, option: str = "--tenants") -> Tenants:
        """The YAML map in ``path``; ValueError (one line) for anything wrong with it."""
        source = f"{option} {path}"
        return cls.from_data(_yaml_of(Path(path), source), source)

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self._tenants.values())

    def __len__(self) -> int:
        return len(self._tenants)

    def __contains__(self, name: object) -> bool:
        return name in self._tenants

    def __getitem__(self, name: str) -> Tenant:
        return self._tenants[name]

    @property
    def names(self) -> list[str]:
        return list(self._tenants)

    def by_key(self, supplied: str | bytes | None) -> Tenant | None:
        """The tenant whose key ``supplied`` is, or None. Every key is compared, each in
        constant time, so how long this takes says nothing about which key was near."""
        if not supplied:
            return None
        given = supplied.encode() if isinstance(supplied, str) else supplied
        found = None
        for tenant in self._tenants.values():
            if hmac.compare_digest(given, tenant.key.encode()):
                found = tenant
        return found

    def weight_of(self, name: str) -> float:
        """``name``'s share of the device when runs of several tenants wait (default 1.0)."""
        return float(self._tenants[name].weight)

    def max_runs_of(self, name: str) -> int | None:
        return self._tenants[name].max_runs

    def check_run_limit(self, name: str, open_runs: int) -> None:
        """FailedPrecondition when tenant ``name`` holds ``open_runs`` runs and may not open
        another (its ``max_runs``): waiting does not help until it closes one."""
        cap = self.max_runs_of(name)
        if cap is not None and open_runs >= cap:
            raise FailedPrecondition(
                f"tenant {name!r} may hold at most {cap} open run(s) (its max_runs) and holds "
                f"{open_runs}: close one first"
            )


def read_keys(path: str | Path, option: str) -> str | Tenants:
    """A token file: one key (as before tenants), or the same YAML map ``--tenants`` takes (a
    mapping whose one key is ``tenants``)."""
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None  # not YAML at all: a key
    if isinstance(data, dict) and "tenants" in data:
        return Tenants.load(path, option)  # read again, refusing what a plain load lets by
    token = text.strip()
    if not token:
        raise ValueError(f"{option} {path} is empty")
    return token


def tenants_of(keys: str | Tenants | None) -> Tenants | None:
    """A port's tenants: a map as given, a single key as the one-tenant form, None: no key."""
    if keys is None or isinstance(keys, Tenants):
        return keys
    return Tenants.single(keys)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: a plain loader keeps the
    last one silently, so ``{name: alice, key: a, key: b}`` would quietly change alice's key."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise DuplicateKey(key, key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class DuplicateKey(yaml.YAMLError):
    """A mapping's key given twice, with where (``problem_mark``, as PyYAML's errors carry)."""

    def __init__(self, key: Any, mark: yaml.Mark) -> None:
        super().__init__(f"{key!r} given twice")
        self.key = key
        self.problem_mark = mark


def _yaml_of(path: Path, source: str) -> Any:
    try:
        return yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except OSError as error:
        raise ValueError(f"{source}: cannot read it ({error.strerror or error})") from None
    except DuplicateKey as error:
        line = error.problem_mark.line + 1
        raise ValueError(f"{source}: line {line}: {error.key!r} is given twice") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark is not None else ""
        raise ValueError(f"{source}: not valid YAML{line}") from None


def _tenant_of(entry: Any, index: int, source: str) -> Tenant:
    name = entry.get("name") if isinstance(entry, dict) else None
    where = f"{source}: entry {index}" + (f" ({name!r})" if isinstance(name, str) else "")
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: give a mapping {{name, key, max_runs?, weight?}}")
    unknown = sorted(str(key) for key in entry if key not in FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; fields are {', '.join(FIELDS)}")
    for required in ("name", "key"):
        if required not in entry:
            raise ValueError(f"{where}: {required} is required")
    tenant = Tenant(entry["name"], entry["key"], entry.get("max_runs"), entry.get("weight", 1.0))
    _check_tenant(tenant, where)
    return tenant


def _check_tenant(tenant: Tenant, where: str) -> None:
    if not isinstance(tenant.name, str) or not NAME_PATTERN.fullmatch(tenant.name):
        raise ValueError(f"{where}: name must be {NAME_RULE}, got {tenant.name!r}")
    if not isinstance(tenant.key, str) or not tenant.key:
        raise ValueError(f"{where}: key must be a non-empty string")
    if not KEY_PATTERN.fullmatch(tenant.key):
        raise ValueError(f"{where}: key must be printable ASCII without spaces")
    cap = tenant.max_runs
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        raise ValueError(f"{where}: max_runs must be an integer >= 0 (or left out), got {cap!r}")
    weight = tenant.weight
    number = isinstance(weight, (int, float)) and not isinstance(weight, bool)
    if not (number and math.isfinite(weight) and weight > 0):
        raise ValueError(f"{where}: weight must be a positive number, got {weight!r}")
