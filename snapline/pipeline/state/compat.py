"""Whether stored state can be read by the code's state declarations: the checks a restore
makes, from a savepoint (savepoint/restore.py) or from the job's own checkpoints (the worker),
against the descriptions stored with it (``StateDescriptor.describe()``).

A state's kind and serde decide how its bytes are read; a state with a TTL stores each value
behind its expiry (8 bytes), one without does not, so a TTL may change its length but not
appear or disappear; a map state's key serde decides its keys' bytes. Any of these changed
makes the stored state unreadable or silently wrong (every value expired in 1970, every read
failing), so the restore is refused, naming the state. A checkpoint stores entries by state
id, so there a state renamed, replaced or moved at an id is refused too.

Pure logic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def incompatibility(
    stored: Mapping[str, Any], now: Mapping[str, Any], where: str, source: str
) -> str | None:
    """Why the state described by ``stored`` (in ``source``: "the savepoint", "checkpoint 7")
    cannot be restored into the state described by ``now``, or None. Descriptions written
    before TTLs and key serdes were recorded (no ``ttl_ms`` key, for savepoints; no
    ``key_serde`` key) are not checked for them."""
    if (now["kind"], now["serde"]) != (stored["kind"], stored["serde"]):
        return (
            f"{where} is a {stored['kind']} state with serde {stored['serde']!r} in {source} "
            f"but a {now['kind']} state with serde {now['serde']!r} in the code; keep its kind "
            "and serde, or rename the state to start it empty"
        )
    if "ttl_ms" in stored and (stored["ttl_ms"] is None) != (now.get("ttl_ms") is None):
        had = "no TTL" if stored["ttl_ms"] is None else f"ttl={stored['ttl_ms']} ms"
        has = "no TTL" if now.get("ttl_ms") is None else f"ttl={now['ttl_ms']} ms"
        return (
            f"{where} has {had} in {source} but {has} in the code; values of a state "
            "with a TTL are stored with their expiry, so a TTL can be changed but not added "
            "or removed: keep it as it was, or rename the state to start it empty"
        )
    if "key_serde" in stored and stored["key_serde"] != now.get("key_serde"):
        return (
            f"{where} has map keys with serde {stored['key_serde']!r} in {source} but "
            f"{now.get('key_serde')!r} in the code; keep the key serde, or rename the state to "
            "start it empty"
        )
    return None


def state_description(described: Mapping[str, Any]) -> dict[str, Any]:
    """What a savepoint records of a state (``described``: ``describe()``): name, kind, serde,
    TTL (None: none) and a map's key serde."""
    out = {k: described[k] for k in ("name", "kind", "serde")}
    out["ttl_ms"] = described.get("ttl_ms")
    if "key_serde" in described:
        out["key_serde"] = described["key_serde"]
    return out


def moved_states(
    stored: Sequence[Mapping[str, Any]],
    declared: Mapping[tuple[str, str], Mapping[str, Any]],
    uids: Mapping[int, str],
) -> list[str]:
    """The states (``'name' of operator 'uid'``) a checkpoint (``stored``: its state
    descriptions) holds under another id than the code (``declared``: (uid, name) -> the
    code's description) gives them. Entries are stored by id, and ids are positional: code
    that adds, removes or reorders a state before others renumbers them. A state the code
    no longer declares, or one whose uid or name changed, is not compared. Checkpoints of
    versions before operator uids name the operator by its index (``uids``)."""
    out = []
    for desc in stored:
        if "id" not in desc:
            continue
        uid = desc.get("uid") or uids.get(int(desc.get("operator", -1)))
        now = declared.get((str(uid), desc.get("name") or ""))
        if now is not None and int(now["id"]) != int(desc["id"]):
            out.append(f"{desc.get('name')!r} of operator {uid!r}")
    return sorted(out)


def replaced_states(
    stored: Sequence[Mapping[str, Any]],
    declared: Mapping[tuple[str, str], Mapping[str, Any]],
    source: str,
) -> list[str]:
    """Why states a checkpoint (``stored``: its state descriptions, in ``source``) holds
    would be read by another state of the code (``declared``: (uid, name) -> the code's
    description) that has the same id: a state renamed or replaced in place, which
    ``moved_states`` and ``incompatibility`` (matching by name) do not see. Entries are
    stored by id, so the code's state would read the old one's entries as its own. A state
    whose operator alone was renamed (its uid is gone from the code; same name, kind and
    serde) keeps its entries; a checkpoint of a version before operator uids is compared by
    name. An id the code no longer has (a state removed at the end) is not compared."""
    by_id = {int(now["id"]): now for now in declared.values() if "id" in now}
    uids = {uid for uid, _ in declared}
    out = []
    for desc in stored:
        now = by_id.get(int(desc["id"])) if "id" in desc else None
        if now is None:
            continue
        uid, name = desc.get("uid"), desc.get("name") or ""
        if (uid, name) == (now["uid"], now.get("name") or ""):
            continue  # the same state: checked by incompatibility
        if name == (now.get("name") or "") and (uid is None or uid not in uids):
            # A checkpoint's description names the TTL whenever there is one.
            kept = {**desc, "ttl_ms": desc.get("ttl_ms")}
            if "kind" not in desc or incompatibility(kept, now, "", source) is None:
                continue
        out.append(
            f"state id {desc['id']} holds {_described(desc)} in {source} but is "
            f"{_described(now)} in the code"
        )
    return out


def _described(desc: Mapping[str, Any]) -> str:
    """``'seen' of operator 'Visits' (a map state, serde 'json', keys 'json')``."""
    out = repr(desc.get("name")) + (f" of operator {desc['uid']!r}" if desc.get("uid") else "")
    if "kind" not in desc:
        return out
    what = [f"a {desc['kind']} state", f"serde {desc['serde']!r}"]
    if desc.get("ttl_ms") is not None:
        what.append(f"ttl={desc['ttl_ms']} ms")
    if "key_serde" in desc:
        what.append(f"keys {desc['key_serde']!r}")
    return f"{out} ({', '.join(what)})"
