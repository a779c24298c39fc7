"""Is a file a healthy autopar tuning database? Checked by reading its header and opening it
read-only, before anything may write to it: a file that is not ours, or is damaged, is refused
with a TuningDBError that says what to do, and its bytes stay as they were."""
from __future__ import annotations

import os
import pathlib
import sqlite3
import time
import urllib.parse

APPLICATION_ID = 0x41505444  # "APTD": marks an autopar tuning database in the SQLite header
SCHEMA_VERSION = 1  # stored in PRAGMA user_version; bump with a migration
ENV_VAR = "AUTOPAR_TUNING_DB"

_SQLITE_MAGIC = b"SQLite format 3\x00"
_SQLITE_HEADER_BYTES = 100
_OUR_TABLES = {"records", "profiles"}
_INTEGRITY_LINES = 3  # problems quoted from PRAGMA integrity_check


class TuningDBError(Exception):
    """The tuning database cannot be opened, read or written; the message says what to do."""


def read_only_uri(path: pathlib.Path) -> str:
    """An SQLite URI that opens `path` read-only (it cannot create or change the file)."""
    return "file:" + urllib.parse.quote(str(path.absolute())) + "?mode=ro"


def inspect_file(path: pathlib.Path, timeout_s: float, *, salvage: bool = False) -> str:
    """'missing', 'empty' (zero bytes or an SQLite file with nothing in it) or 'ours'; raises
    TuningDBError for anything else, including a damaged database (unless `salvage`, which
    only asks whether the file is ours)."""
    if not path.exists():
        return "missing"
    if path.is_dir():
        raise TuningDBError(
            f"{path} is a directory; the tuning database is a file, e.g. {path / 'tuning.db'}"
        )
    # Another process may be writing the first page of a brand-new file right now, so a
    # bad header is read again a few times before it counts as corrupt.
    for attempt in range(3):
        try:
            with open(path, "rb") as f:
                header = f.read(_SQLITE_HEADER_BYTES)
        except OSError as e:
            raise TuningDBError(f"cannot read the tuning database {path}: {e}") from e
        if not header:
            return "empty"
        if len(header) == _SQLITE_HEADER_BYTES and header.startswith(_SQLITE_MAGIC):
            break
        time.sleep(0.02 * (attempt + 1))
    else:
        raise TuningDBError(
            not_a_db_message(path, "it is not an SQLite file: no complete SQLite header")
        )
    try:
        conn = sqlite3.connect(read_only_uri(path), uri=True, timeout=timeout_s, isolation_level=None)
        try:
            if salvage:  # read a file shorter than its header says (read-only: no writes)
                conn.execute("PRAGMA writable_schema = ON")
            # one snapshot: another process may be creating the schema of this new file right
            # now, and separate reads could see its tables but not yet its application_id
            conn.execute("BEGIN")
            app_id, version, names = header_and_tables(conn)
            if app_id == 0 and not names:
                return "empty"
            check_ours(path, app_id, version, names)
            damage = None if salvage else _damage(conn, path, header)
        finally:
            conn.close()
    except sqlite3.Error as e:
        if "locked" in str(e) or "busy" in str(e):
            raise TuningDBError(f"the tuning database {path} stayed locked for {timeout_s:.0f} s: {e}") from e
        if int.from_bytes(header[68:72], "big") == APPLICATION_ID:  # ours, by its raw header
            raise TuningDBError(damaged_message(path, f"SQLite cannot read it: {e}")) from e
        raise TuningDBError(not_a_db_message(path, f"SQLite cannot read it: {e}")) from e
    if damage:
        raise TuningDBError(damaged_message(path, damage))
    return "ours"


def _damage(conn: sqlite3.Connection, path: pathlib.Path, header: bytes) -> str | None:
    """Which check finds `path` damaged, and what it found; None for a healthy file."""
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    size = path.stat().st_size
    # Pages are written whole; a partial last page means the file was cut short (an
    # interrupted copy, a full disk), unless a WAL still holds that page.
    if size % page_size and not _wal_bytes(path):
        return (f"the file size check failed: {size} bytes is not a whole number of "
                f"{page_size}-byte pages, so the file was cut short")
    if not any(row[2] and _index_columns(conn, row[1]) == ["digest"]
               for row in conn.execute("PRAGMA index_list(records)")):
        return "the schema check failed: the records table has no unique index on digest"
    try:
        found = [row[0] for row in conn.execute(f"PRAGMA integrity_check({_INTEGRITY_LINES})")]
    except sqlite3.DatabaseError as e:
        return f"SQLite's integrity check failed: {e}"
    if found != ["ok"]:
        detail = "; ".join(line.replace("\n", " ").strip() for line in found)
        return f"SQLite's integrity check failed: {detail}"
    return None


def _index_columns(conn: sqlite3.Connection, index: str) -> list[str]:
    return [row[2] for row in conn.execute(f"PRAGMA index_info({_quote(index)})")]


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def header_and_tables(conn: sqlite3.Connection) -> tuple[int, int, set[str]]:
    """The file's application_id, schema version and table/index names."""
    app_id = conn.execute("PRAGMA application_id").fetchone()[0]
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    return app_id, version, names


def check_ours(path: pathlib.Path, app_id: int, version: int, names: set[str]) -> None:
    """Raise TuningDBError unless the header and tables are those of this autopar's schema."""
    if app_id != APPLICATION_ID:
        tables = ", ".join(sorted(names)) or "none"
        raise TuningDBError(
            f"{path} is an SQLite database of another application (application_id "
            f"{app_id:#x}, tables: {tables}), not an autopar tuning database. It was left "
            f"unchanged; pass a different path with --db or ${ENV_VAR}."
        )
    if version > SCHEMA_VERSION:
        raise TuningDBError(
            f"the tuning database {path} has schema version {version}, written by a newer "
            f"autopar; this autopar reads schema version {SCHEMA_VERSION}. Upgrade autopar "
            f"(pip install -U autopar), or pass a different path with --db or ${ENV_VAR}."
        )
    if version < SCHEMA_VERSION or not _OUR_TABLES <= names:
        raise TuningDBError(
            not_a_db_message(
                path, f"schema version {version} with tables {sorted(names)} is incomplete"
            )
        )


def not_a_db_message(path: pathlib.Path, reason: str) -> str:
    """Why `path` was refused, and how to go on without it."""
    return (
        f"{path} is not a readable autopar tuning database ({reason}). It was left unchanged. "
        f"Move it aside (mv '{path}' '{path}.bad') to start a fresh database, or pass a "
        f"different path with --db or ${ENV_VAR}."
    )


def damaged_message(path: pathlib.Path, damage: str) -> str:
    """What is wrong with a damaged database, and the three ways to go on."""
    return (
        f"the tuning database {path} is damaged ({damage}). It was left unchanged and nothing "
        f"will be written to it. Restore it from a backup; or save the records that can still "
        f"be read with `autopar db export --salvage OUT.jsonl --db '{path}'` and import them "
        f"into a new file with `autopar db import OUT.jsonl --db NEW.db`; or start a new file: "
        f"mv '{path}' '{path}.bad', or pass another path with --db or ${ENV_VAR}."
    )


def _wal_bytes(path: pathlib.Path) -> int:
    """Size of the file's write-ahead log (0 when there is none)."""
    try:
        return os.stat(f"{path}-wal").st_size
    except FileNotFoundError:
        return 0
