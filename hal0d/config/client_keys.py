"""The keys clients present, and where their secrets come from: `[server] api_keys`, the
lines of `api_keys_file`, and each `[[keys]]` table's one source (`key`, `key_env`, `key_file`).

The secrets are read here, once, when the config is loaded (an unset variable or an unreadable
file is a problem of the config, not a 401 later), and a secret two keys share is refused: the
name a key's requests are recorded under must be the one that sent them. The secrets stay out
of every repr and of print-config's output (model.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hal0d.config.model import KEY_SCOPES, KEY_SECRET_SOURCES, REDACTED_SECRET, KeyConfig
from hal0d.config.spec import KEY_SPEC, check_table, string_list
from hal0d.shares.share import SERVICE_CLASSES


def access_keys(server: dict[str, Any], base_dir: Path, problems: list[str]) -> None:
    """Check api_keys, read api_keys_file (one key per line; systemd's LoadCredential can
    supply it: `api_keys_file = "${CREDENTIALS_DIRECTORY}/hal0d-keys"`)."""
    keys: set[str] = set()
    listed = server.get("api_keys", [])
    if not all(isinstance(key, str) and key.strip() for key in listed):
        problems.append("server.api_keys: every key must be a non-empty string")
    elif REDACTED_SECRET in (key.strip() for key in listed):
        problems.append(f"server.api_keys: {REDACTED_SECRET!r} is what print-config writes in "
                        "place of a key: put the keys back (or use api_keys_file)")
    else:
        server["api_keys"] = tuple(key.strip() for key in listed)
        keys.update(server["api_keys"])
    if "api_keys_file" in server:
        where = "server.api_keys_file"
        path, text = _read_key_file(server["api_keys_file"], where, base_dir, problems)
        if text is not None:
            lines = text.splitlines()
            found = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
            if not found:
                problems.append(f"{where}: {str(path)!r} holds no key")
            keys.update(found)
    server["accepted_keys"] = frozenset(keys)


def check_keys(raw: Any, server: dict[str, Any], base_dir: Path, problems: list[str]
               ) -> tuple[KeyConfig, ...]:
    """The [[keys]] tables: a unique name, one secret source that yields a secret no other key
    has, at least one scope; each problem ends with the key's name when it has one."""
    if not isinstance(raw, list):
        problems.append("keys: must be an array of tables ([[keys]])")
        return ()
    keys: list[KeyConfig] = []
    names: set[str] = set()
    owners: dict[str, str] = {secret: "server.api_keys" for secret in
                              server.get("accepted_keys", ())}
    for index, table in enumerate(raw):
        path = f"keys[{index}]"
        before = len(problems)
        good = check_table(table, KEY_SPEC, path, problems)
        name = good.get("name")
        if isinstance(table, dict) and "name" not in table:
            problems.append(f"{path}.name: is required")
        elif isinstance(name, str) and not name.strip():
            problems.append(f"{path}.name: must not be empty")
        elif isinstance(name, str):
            if name in names:
                problems.append(f"{path}.name: {name!r} is used by another key")
            names.add(name)
        if isinstance(table, dict) and "scopes" not in table:
            problems.append(f"{path}.scopes: is required (any of {', '.join(KEY_SCOPES)})")
        elif "scopes" in good:
            good["scopes"] = check_scopes(good["scopes"], f"{path}.scopes", problems)
        if "models" in good:
            good["models"] = string_list(good["models"], f"{path}.models", problems)
        check_share(good, path, problems)
        secret = _key_secret(good, table, path, base_dir, problems)
        if secret is not None:
            if secret in owners:
                problems.append(f"{path}: its secret is also {owners[secret]}'s; every key "
                                "needs its own")
            owners.setdefault(secret, f"key {name!r}")
        if len(problems) == before:
            keys.append(KeyConfig(secret=secret or "", **good))
        elif isinstance(name, str) and name:
            problems[before:] = [f'{problem} (key "{name}")' for problem in problems[before:]]
    return tuple(keys)


def check_share(good: dict[str, Any], path: str, problems: list[str]) -> None:
    """A key's (or a listener's anonymous) share of the box, in `good` as checked by its spec:
    `class` one of SERVICE_CLASSES (kept as `service_class`), a weight above 0 (a key of
    weight 0 would never be served beside others), an hourly quota within the daily one."""
    if "class" in good:
        service_class = good.pop("class")
        if service_class in SERVICE_CLASSES:
            good["service_class"] = service_class
        else:
            problems.append(f"{path}.class: {service_class!r} is not a class (classes: "
                            f"{', '.join(SERVICE_CLASSES)})")
    if good.get("weight") == 0:
        problems.append(f"{path}.weight: 0 would never be served beside other keys of its "
                        "class; a weight is above 0 (1 is the default, 0.1 a tenth of it)")
    hour, day = good.get("tokens_per_hour"), good.get("tokens_per_day")
    if hour is not None and day is not None and hour > day:
        problems.append(f"{path}.tokens_per_hour: {hour} is more than its tokens_per_day, "
                        f"{day}: the day's quota would end every hour's first")


def check_scopes(scopes: list[Any], where: str, problems: list[str],
                 allowed: tuple[str, ...] = KEY_SCOPES, refused: str = "") -> tuple[str, ...]:
    """The scopes listed, each once; a problem naming every entry that is no scope (a typo
    among valid ones is named, not hidden behind "at least one of"). `refused`: why a scope
    of KEY_SCOPES missing from `allowed` is not for this table."""
    if not scopes:
        problems.append(f"{where}: {scopes!r} must list at least one of {', '.join(allowed)}")
        return ()
    for scope in scopes:
        if not isinstance(scope, str) or scope not in KEY_SCOPES:
            problems.append(f"{where}: {scope!r} is not a scope (scopes: {', '.join(allowed)})")
        elif scope not in allowed:
            problems.append(f"{where}: {scope!r} {refused} (scopes here: {', '.join(allowed)})")
    return tuple(dict.fromkeys(scope for scope in scopes if isinstance(scope, str)))


def _key_secret(good: dict[str, Any], table: Any, path: str, base_dir: Path,
                problems: list[str]) -> str | None:
    """The secret from the key's one source, or None (and a problem) when it yields none."""
    given = [source for source in KEY_SECRET_SOURCES if isinstance(table, dict) and source in table]
    if len(given) != 1:
        problems.append(f"{path}: needs exactly one of {', '.join(KEY_SECRET_SOURCES)}"
                        + (f" (has {', '.join(given)})" if given else ""))
        return None
    source = given[0]
    if source not in good:
        return None  # malformed: its own problem is reported
    where = f"{path}.{source}"
    if source == "key":
        secret = good["key"].strip()
        if secret == REDACTED_SECRET:
            problems.append(f"{where}: {REDACTED_SECRET!r} is what print-config writes in place "
                            "of a secret: put the key back (or use key_env, key_file)")
            return None
    elif source == "key_env":
        secret = os.environ.get(good["key_env"], "").strip()
        if not secret:
            problems.append(f"{where}: the environment variable {good['key_env']!r} is unset "
                            "or empty")
            return None
    else:
        text = _read_key_file(good["key_file"], where, base_dir, problems)[1]
        if text is None:
            return None
        secret = text.strip()
    if not secret:
        problems.append(f"{where}: the secret is empty")
        return None
    return secret


def _read_key_file(written: str, where: str, base_dir: Path, problems: list[str]
                   ) -> tuple[Path, str | None]:
    """The file a key setting names, as read: its variables expanded (systemd's
    `${CREDENTIALS_DIRECTORY}`), a relative path taken from the config's folder; its text is
    None, and `where` has a problem, when it cannot be read."""
    path = Path(os.path.expandvars(written))
    path = path if path.is_absolute() else base_dir / path
    try:
        return path, path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(f"{where}: {str(path)!r} cannot be read ({exc})")
        return path, None
