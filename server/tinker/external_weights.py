"""Weights to take away: ``save_weights_external`` and the signed URLs its files download from.

``save_weights_external`` is a training call: it writes the live weights as an export of the run
(the same directory ``from_pretrained`` or PEFT loads) under ``external_weights/<name>``, with a
TTL. Given ``age_encryption_recipients``, every file is also written age-encrypted (``.age``)
into the front's own ``encrypted/`` folder, and only those are offered for download; a copy
(``copy_weights``) holds only those too, never the plaintext (``copy_encrypted``).

``external_weights_urls`` answers one URL per file, served by this server itself: the URL carries
the checkpoint, the file and an expiry, signed (HMAC-SHA256) with a key the server keeps in its
directory, so only a caller holding the API key can get one, it names exactly one file, and it
stops working after ``URL_TTL_S``. The download route checks the signature, the expiry and that
the checkpoint is still live, and streams the file; nothing else is reachable through it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import pyrage

from trainwire.contract.files import atomic_directory, clean_leftovers
from trainwire.server.errors import InvalidArgument, NotFound, Unauthenticated
from trainwire.server.paths import resolve_inside
from trainwire.server.service import operations as ops
from trainwire.server.service.intake import Submission
from trainwire.server.service.requests import ExportWeightsRequest
from trainwire.server.service.run_checkpoints import link_or_copy
from trainwire.server.service.state_dir import check_name
from trainwire.server.tinker import save_notes
from trainwire.server.tinker.catalog import TinkerPath, check_ttl, iso
from trainwire.server.tinker.fields import get_str
from trainwire.server.tinker.front import TinkerFront
from trainwire.server.tinker.save_notes import ExternalWeights
from trainwire.server.tinker.saved_checkpoints import ENCRYPTED_DIR, encrypted_dir

EXPORT_PREFIX = "external-"
URL_KEY_FILE = "url.key"
URL_TTL_S = 3600
MAX_RECIPIENTS = 10  # as Tinker
AGE_SUFFIX = ".age"
DOWNLOAD_ROUTE = "/api/v1/weights_files/"


def save_weights_external(front: TinkerFront, body: dict[str, Any]) -> str:
    """Export the live weights under ``external_weights/<path>``, encrypted when asked."""
    model_id, seq_id = get_str(body, "model_id", "") or "", body.get("seq_id")

    def prepare() -> Submission:
        name = check_name(get_str(body, "path", "") or "", "save_weights_external path")
        ttl = check_ttl(body.get("ttl_seconds"), "save_weights_external")
        given = body.get("age_encryption_recipients")
        parse_recipients(given)  # refused now, whole, before anything is written
        path = TinkerPath(model_id, "external_weights", name)
        export = EXPORT_PREFIX + name
        note = save_notes.to_json(ExternalWeights(path, export, ttl, tuple(given or ())))
        request = ExportWeightsRequest(export)
        return Submission(ops.EXPORT_WEIGHTS, request, "save_weights_external", note)

    return front.submit(body, model_id, seq_id, prepare)


def parse_recipients(value: Any) -> list[Any]:
    """age recipients (``age1...`` keys or SSH public keys), at most ``MAX_RECIPIENTS``."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_RECIPIENTS:
        raise InvalidArgument(f"age_encryption_recipients: a list of at most {MAX_RECIPIENTS}")
    recipients = []
    for text in value:
        if not isinstance(text, str):
            raise InvalidArgument("age_encryption_recipients: each is a string")
        kind = pyrage.x25519 if text.startswith("age1") else pyrage.ssh
        try:
            recipients.append(kind.Recipient.from_str(text))
        except pyrage.RecipientError as error:
            raise InvalidArgument(f"age recipient {text[:24]!r}...: {error}") from None
    return recipients


def encrypt(front: TinkerFront, path: TinkerPath, export: str, recipients: list[Any]) -> None:
    """Every file of the export, age-encrypted, written whole before it becomes visible (a
    replay after a crash writes it again)."""
    source = front.host.state_dir.run(front.catalog.run(path.model_id).run_id).export(export)
    target = encrypted_dir(front, path)
    staging = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        out = staging / (str(file.relative_to(source)) + AGE_SUFFIX)
        out.parent.mkdir(parents=True, exist_ok=True)
        pyrage.encrypt_file(str(file), str(out), recipients)
    shutil.rmtree(target, ignore_errors=True)
    staging.mkdir(parents=True, exist_ok=True)
    os.replace(staging, target)


def copy_encrypted(front: TinkerFront, source: TinkerPath, copy: TinkerPath) -> bool:
    """Whether ``source`` offers only its encrypted files; when it does, ``copy`` is given the
    same files (hard links, whole or not at all), so a copy offers what its source offers and
    never the plaintext behind it."""
    origin = encrypted_dir(front, source)
    if source.segment != "external_weights" or not origin.is_dir():
        return False
    target = encrypted_dir(front, copy)
    if not target.is_dir():  # a retry finds it in place
        with atomic_directory(target) as staging:
            shutil.copytree(origin, staging, dirs_exist_ok=True, copy_function=link_or_copy)
    return True


def clean_encrypted_leftovers(directory: Path) -> None:
    """Remove encryptions and copies a crash cut short (a replay or a retry writes them again)."""
    for run_dir in sorted((directory / ENCRYPTED_DIR).glob("*")):
        for leftover in run_dir.glob(".*.tmp"):
            shutil.rmtree(leftover, ignore_errors=True)
        clean_leftovers(run_dir)


# -- signed download URLs ----------------------------------------------------------------------


def url_key(directory: Path) -> bytes:
    """The server's URL-signing key: made once, kept beside the request store (0600)."""
    path = directory / URL_KEY_FILE
    if not path.is_file():
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(secrets.token_bytes(32))
            handle.flush()
            os.fsync(handle.fileno())
    return path.read_bytes()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def files_of(front: TinkerFront, path: TinkerPath) -> dict[str, Path]:
    """The files a download of ``path`` offers: the encrypted ones when it was encrypted."""
    record, saved = front.catalog.find(path)
    encrypted = encrypted_dir(front, path)
    root = encrypted if encrypted.is_dir() else None
    if root is None:
        root = front.host.state_dir.run(record.run_id).export(saved.stored_as)
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}


def external_weights_urls(
    front: TinkerFront, model_id: str, checkpoint_id: str, base_url: str
) -> dict[str, Any]:
    """One signed URL per file of an external weights checkpoint, and when they expire."""
    path = TinkerPath.parse(f"tinker://{model_id}/{checkpoint_id}")
    if path.segment != "external_weights":
        raise InvalidArgument("download URLs are for external weights (save_weights_external)")
    expires = int(time.time()) + URL_TTL_S
    key = url_key(front.directory)
    urls = {}
    for name in files_of(front, path):
        claim = _b64(json.dumps([str(path), name, expires]).encode())
        signature = _b64(hmac.new(key, claim.encode(), hashlib.sha256).digest())
        urls[name] = f"{base_url.rstrip('/')}{DOWNLOAD_ROUTE}{claim}.{signature}"
    return {"urls": urls, "expires": iso(expires)}


def signed_file(front: TinkerFront, token: str) -> Path:
    """The file a signed URL names, after checking its signature, expiry and checkpoint."""
    claim, _, signature = token.partition(".")
    expected = _b64(hmac.new(url_key(front.directory), claim.encode(), hashlib.sha256).digest())
    if not signature or not hmac.compare_digest(signature, expected):
        raise Unauthenticated("this download URL is not one this server signed")
    try:
        tinker_path, name, expires = json.loads(_unb64(claim))
    except ValueError:
        raise Unauthenticated("this download URL is damaged") from None
    if time.time() >= expires:
        raise Unauthenticated("this download URL has expired: ask for new ones")
    files = files_of(front, TinkerPath.parse(tinker_path))
    if name not in files or resolve_inside(files[name].parent, files[name].name) is None:
        raise NotFound(f"{name!r} is no longer in {tinker_path}")
    return files[name]
