"""Artifact folders (models, conversions, fused checkpoints): written whole or not at all, never clobbered.

Every folder quantmla writes goes through :func:`staged`:

1. the contents are written into a private temp folder next to the destination
   (``.<name>.tmp-<host>-<pid>-<random>``);
2. a completion manifest, :data:`MANIFEST`, is written *last*: the artifact's key (what it was built from, e.g.
   the full conversion key) and every file with its size;
3. the temp folder is renamed onto the destination. Without ``force`` the rename never replaces anything: the
   destination must not exist, and a destination that appeared meanwhile (a concurrent run) makes the rename fail
   (``ENOTEMPTY``/``EEXIST``), which is reported as :class:`FileExistsError`. With ``force`` the old folder is
   first renamed aside, the new one renamed into place, then the old one deleted (on a failure in between the old
   one is put back).

A folder is *complete* (:func:`read_manifest`) only when its manifest parses and every file it lists is there
with its size: an interrupted or truncated write never passes for a finished one. Temp and set-aside folders
left by a killed process of this host are removed by the next write to the same destination.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

MANIFEST = "quantmla_complete.json"  # written last into every folder quantmla publishes
MANIFEST_VERSION = 1


def _host() -> str:
    return "".join(ch for ch in socket.gethostname() if ch.isalnum() or ch in "-_")[:40] or "host"


def _prefix(final: str, kind: str) -> str:
    """``.<name>.<kind>-<host>-<pid>-`` (kind: ``tmp`` or ``old``)."""
    return f".{os.path.basename(final)}.{kind}-{_host()}-{os.getpid()}-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def sweep_stale(final: str) -> list[str]:
    """Remove temp / set-aside folders of ``final`` left by dead processes of this host; returns what was removed."""
    parent, name = os.path.dirname(os.path.abspath(final)), os.path.basename(final)
    if not os.path.isdir(parent):
        return []
    removed = []
    for entry in os.listdir(parent):
        for kind in ("tmp", "old"):
            head = f".{name}.{kind}-{_host()}-"
            if not entry.startswith(head):
                continue
            pid = entry[len(head) :].split("-", 1)[0]
            if pid.isdigit() and not _pid_alive(int(pid)):
                _remove(os.path.join(parent, entry))
                removed.append(entry)
    return removed


_APPEARED = "appeared while this job ran (another run?); it was left as it is -- pass --force (force=True) to replace"


def check_destination(final: str, force: bool, *, late: bool = False) -> None:
    """Raise :class:`FileExistsError` when ``final`` exists and ``force`` is not set (call before long work;
    ``late``: the check just before publishing, worded for a destination that appeared meanwhile)."""
    if os.path.lexists(final) and not force:
        if late:
            raise FileExistsError(f"{final} {_APPEARED}")
        raise FileExistsError(f"{final} already exists; pass --force (force=True) to replace it, or choose another one")


def file_sizes(folder: str) -> dict[str, int]:
    """Every regular file under ``folder`` (relative path -> size), the manifest excluded."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            rel = os.path.relpath(p, folder)
            if rel != MANIFEST:
                out[rel] = os.path.getsize(p)
    return dict(sorted(out.items()))


def seal(folder: str, key: dict | None = None) -> dict:
    """Write the completion manifest of ``folder`` (its key and every file with its size); call it last."""
    manifest = {"manifest_version": MANIFEST_VERSION, "key": key, "files": file_sizes(folder)}
    with open(os.path.join(folder, MANIFEST), "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    return manifest


def read_manifest(folder: str) -> dict | None:
    """The manifest of a *complete* folder: None when it is missing, unreadable, or a listed file is missing or
    has another size (an interrupted or truncated write)."""
    try:
        with open(os.path.join(folder, MANIFEST)) as fh:
            m = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("manifest_version") != MANIFEST_VERSION or not isinstance(m.get("files"), dict):
        return None
    for rel, size in m["files"].items():
        p = os.path.join(folder, rel)
        if not os.path.isfile(p) or os.path.getsize(p) != size:
            return None
    return m


def publish(tmp: str, final: str, *, force: bool) -> str:
    """Rename the finished folder ``tmp`` onto ``final``; see the module docstring for the no-replace / force rules."""
    if not force:
        check_destination(final, force=False, late=True)  # (an empty folder would be replaced by the rename)
        try:
            os.rename(tmp, final)  # a directory rename never replaces a non-empty directory or a file
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise FileExistsError(f"{final} {_APPEARED}") from None
            raise
        return final
    aside = None
    if os.path.lexists(final):
        aside = tempfile.mkdtemp(prefix=_prefix(final, "old"), dir=os.path.dirname(os.path.abspath(final)))
        os.rmdir(aside)  # a free name next to final; rename the old artifact there
        os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except BaseException:
        if aside is not None and not os.path.lexists(final):
            os.rename(aside, final)  # put the previous artifact back
        raise
    if aside is not None:
        _remove(aside)
    return final


@contextmanager
def staged(final: str, *, force: bool = False, key: dict | None = None) -> Iterator[str]:
    """``with staged(final, force=..., key=...) as tmp:`` write the artifact into ``tmp``; on a normal exit it is
    sealed (:func:`seal`) and published to ``final`` (:func:`publish`); on any exception (interrupts included)
    the temp folder is removed and ``final`` is left as it was."""
    final = os.path.abspath(final)
    check_destination(final, force)
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    sweep_stale(final)
    tmp = tempfile.mkdtemp(prefix=_prefix(final, "tmp"), dir=parent)
    try:
        yield tmp
        seal(tmp, key)
        publish(tmp, final, force=force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(folder: str, name: str, obj) -> str:
    """Write ``obj`` as indented JSON to ``folder/name`` (inside a staged folder: atomic with the folder)."""
    p = os.path.join(folder, name)
    with open(p, "w") as fh:
        json.dump(obj, fh, indent=2)
    return p


# ---- model folders (a transformers checkpoint + tokenizer + a record, keyed by what they were built from) ----

MARKER = "quantmla_conversion.json"  # the record of a model folder quantmla built (source, config, report)


def _canonical(key):
    return json.loads(json.dumps(key, sort_keys=True))


def _flat(d, prefix: str = "") -> dict:
    if not isinstance(d, dict):
        return {prefix or "key": d}
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def key_difference(stored, wanted) -> str:
    """``"variant: 'a' there, 'b' asked; ..."``: how two artifact keys differ (for error messages)."""
    a, b = _flat(_canonical(stored)), _flat(_canonical(wanted))
    diffs = [f"{k}: {a.get(k)!r} there, {b.get(k)!r} asked" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return "; ".join(diffs[:6]) + (f"; ... ({len(diffs) - 6} more)" if len(diffs) > 6 else "")


def reusable_model_dir(final: str, key: dict, force: bool, *, rebuild_incomplete: bool = False) -> bool:
    """True when ``final`` holds a complete artifact built from ``key`` (and not ``force``): reuse it.

    False when it has to be built: it does not exist, ``force`` is set, or it is incomplete and
    ``rebuild_incomplete`` (quantmla's own cache folders). Raises :class:`FileExistsError` naming the difference
    when ``final`` holds an artifact with another key, and when it is incomplete or not quantmla's (unless
    ``force``): a user's folder is never replaced without ``force``."""
    if force or not os.path.lexists(final):
        return False
    m = read_manifest(final)
    if m is not None:
        if _canonical(m.get("key")) == _canonical(key):
            return True
        raise FileExistsError(
            f"{final} holds another build ({key_difference(m.get('key'), key)}); pass --force to replace it, or "
            "choose another --out"
        )
    if rebuild_incomplete:
        return False
    if os.path.lexists(os.path.join(final, MARKER)) or os.path.lexists(os.path.join(final, MANIFEST)):
        raise FileExistsError(f"{final} holds an incomplete quantmla build (an interrupted write?); pass --force to "
                              "rebuild it")
    raise FileExistsError(f"{final} exists and is not a quantmla model folder; pass --force to replace it, or "
                          "choose another --out")


def save_model_dir(
    final: str, model, tokenizer, record: dict, *, key: dict, force: bool = False, marker: str = MARKER
) -> str:
    """Write ``model`` + ``tokenizer`` (``save_pretrained``) + ``record`` (the ``marker`` JSON) as one artifact
    keyed by ``key`` (:func:`staged`: temp folder, manifest last, rename; replaces ``final`` only with ``force``).
    A concurrent run that published the same key first wins quietly; a failure leaves ``final`` as it was."""
    try:
        with staged(final, force=force, key=key) as tmp:
            model.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            write_json(tmp, marker, record)
    except FileExistsError:
        m = read_manifest(final)
        if m is not None and _canonical(m.get("key")) == _canonical(key):
            return final  # built meanwhile by another run, from the same inputs
        raise
    return final
