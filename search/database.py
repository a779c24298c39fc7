"""Tuning database: kernel tuning records, op/stage profiles and collective calibrations in
one SQLite file (WAL mode, schema-versioned) that several tuning processes can share."""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import pathlib
import secrets
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Iterable, Iterator
from typing import Any

from search.record import TuningRecord

APPLICATION_ID = 0x41505444  # "APTD": marks an autopar tuning database in the SQLite header
SCHEMA_VERSION = 1  # stored in PRAGMA user_version; bump with a migration in _MIGRATIONS
ENV_VAR = "AUTOPAR_TUNING_DB"
BUSY_TIMEOUT_S = 60.0

_SQLITE_MAGIC = b"SQLite format 3\x00"
_SQLITE_HEADER_BYTES = 100
_RECORD_FIELDS = (
    "workload_key", "task", "target_key", "target", "schedule", "latencies_s", "error",
    "timestamp", "tuning_time_s", "library_version", "extra",
)
_REQUIRED_FIELDS = ("workload_key", "task", "target_key", "target", "schedule")
_SCHEMA = (
    """CREATE TABLE records (
        id INTEGER PRIMARY KEY,
        digest TEXT NOT NULL UNIQUE,    -- sha256 of the record's canonical JSON (dedup)
        workload_key TEXT NOT NULL,
        target_key TEXT NOT NULL,
        latency_s REAL,                 -- median of latencies_s; NULL for failed records
        task_json TEXT NOT NULL,
        target_json TEXT NOT NULL,
        schedule_json TEXT NOT NULL,
        latencies_json TEXT NOT NULL,
        error TEXT,
        timestamp REAL NOT NULL,
        tuning_time_s REAL NOT NULL,
        library_version TEXT NOT NULL,
        extra_json TEXT NOT NULL
    )""",
    "CREATE INDEX records_by_workload ON records (workload_key, target_key, latency_s)",
    """CREATE TABLE profiles (
        kind TEXT NOT NULL,             -- e.g. "op", "stage", "collective"
        key TEXT NOT NULL,
        value_json TEXT NOT NULL,
        updated_s REAL NOT NULL,        -- unix time of the last put
        PRIMARY KEY (kind, key)
    )""",
)
_OUR_TABLES = {"records", "profiles"}
_RECORD_COLUMNS = (
    "workload_key, task_json, target_key, target_json, schedule_json, latencies_json, "
    "error, timestamp, tuning_time_s, library_version, extra_json"
)


class TuningDBError(Exception):
    """The tuning database cannot be opened, read or written; the message says what to do."""


def default_db_path() -> pathlib.Path:
    """$AUTOPAR_TUNING_DB if set, else $XDG_CACHE_HOME/autopar/tuning.db, else
    ~/.cache/autopar/tuning.db."""
    override = os.environ.get(ENV_VAR, "").strip()
    if override:
        return pathlib.Path(override).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME", "").strip()
    # The XDG spec says relative values are invalid and must be ignored.
    base = pathlib.Path(cache) if cache and os.path.isabs(cache) else pathlib.Path.home() / ".cache"
    return base / "autopar" / "tuning.db"


class TuningDB:
    """Kernel tuning records, measured profiles and calibrations in one SQLite file.

    Every write is its own committed transaction, so records survive a killed process and
    concurrent writers (threads or processes) never lose each other's records. A file that
    is not an autopar tuning database raises TuningDBError and is never written to.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        create: bool = True,
        synchronous: str = "NORMAL",
        timeout_s: float = BUSY_TIMEOUT_S,
    ):
        self.path = pathlib.Path(path).expanduser() if path is not None else default_db_path()
        if synchronous.upper() not in ("NORMAL", "FULL", "EXTRA"):
            raise ValueError(
                f"synchronous={synchronous!r}: use 'NORMAL' (survives a killed process) or "
                "'FULL' (also survives power loss, one fsync per write)"
            )
        self._create = create
        self._synchronous = synchronous.upper()
        self._timeout_s = float(timeout_s)
        self._lock = threading.RLock()
        self._inherited: list[sqlite3.Connection] = []
        self._conn: sqlite3.Connection | None = self._connect()
        self._pid = os.getpid()

    # ---- opening and validation -------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        state = _inspect_file(self.path, self._timeout_s)
        if state == "missing":
            if not self._create:
                raise TuningDBError(
                    f"no tuning database at {self.path}: nothing has been tuned into it yet. "
                    f"Run a tuning first, or point --db / ${ENV_VAR} at an existing database."
                )
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise TuningDBError(
                    f"cannot create the directory for the tuning database {self.path}: {e}. "
                    f"Pass a writable path (--db or ${ENV_VAR})."
                ) from e
        try:
            conn = sqlite3.connect(
                str(self.path), timeout=self._timeout_s, isolation_level=None,
                check_same_thread=False,
            )
        except sqlite3.Error as e:
            raise TuningDBError(
                f"cannot open the tuning database {self.path}: {e}. "
                f"Check that the path is writable, or pass another with --db / ${ENV_VAR}."
            ) from e
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self._timeout_s * 1000)}")
            if state in ("missing", "empty"):
                self._initialize(conn)
            _set_wal(conn, self._timeout_s)
            # NORMAL in WAL mode: a commit has been write()n to the -wal file before it
            # returns, so a killed process loses nothing; only an OS crash or power loss can
            # drop the last commits (FULL adds an fsync per commit against that).
            conn.execute(f"PRAGMA synchronous = {self._synchronous}")
        except sqlite3.Error as e:
            conn.close()
            raise TuningDBError(f"cannot set up the tuning database {self.path}: {e}") from e
        except BaseException:
            conn.close()
            raise
        return conn

    def _initialize(self, conn: sqlite3.Connection) -> None:
        """Create the schema in an empty file; another process may be doing the same now, so
        check again under the write lock."""
        _set_wal(conn, self._timeout_s)
        conn.execute("BEGIN IMMEDIATE")
        try:
            app_id, version, names = _header_and_tables(conn)
            if app_id == 0 and not names:
                for statement in _SCHEMA:
                    conn.execute(statement)
                conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            else:
                _check_ours(self.path, app_id, version, names)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise TuningDBError(f"the tuning database {self.path} was closed; open a new TuningDB")
        if self._pid != os.getpid():
            # An SQLite connection must not cross fork(): the child opens its own. The
            # parent's stays referenced so that garbage collection does not close it here.
            self._inherited.append(self._conn)
            self._conn = self._connect()
            self._pid = os.getpid()
        return self._conn

    @contextlib.contextmanager
    def _reading(self, action: str) -> Iterator[sqlite3.Connection]:
        with self._lock:
            conn = self._connection()
            try:
                yield conn
            except sqlite3.Error as e:
                raise TuningDBError(_sqlite_message(self.path, action, e)) from e

    @contextlib.contextmanager
    def _writing(self, action: str) -> Iterator[sqlite3.Connection]:
        """One committed write transaction; BEGIN IMMEDIATE takes the write lock up front so
        a busy database waits (busy timeout) instead of failing on lock upgrade."""
        with self._lock:
            conn = self._connection()
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as e:
                raise TuningDBError(_sqlite_message(self.path, action, e)) from e

    # ---- records ----------------------------------------------------------------------

    def add(self, record: TuningRecord) -> None:
        """Store one record, committed before returning; an exact duplicate is ignored."""
        row = _record_row(record)
        with self._writing("add a record") as conn:
            conn.execute(_INSERT_RECORD, row)

    def add_many(self, records: Iterable[TuningRecord]) -> int:
        """Store many records in one transaction (all or none); returns how many were new."""
        rows = [_record_row(r) for r in records]
        with self._writing("add records") as conn:
            return sum(conn.execute(_INSERT_RECORD, row).rowcount for row in rows)

    def best(self, workload_key: str, target_key: str | None = None) -> TuningRecord | None:
        """The successful record with the lowest median latency, or None if there is none."""
        where, params = _filter(workload_key, target_key)
        sql = (
            f"SELECT {_RECORD_COLUMNS} FROM records WHERE {where} AND latency_s IS NOT NULL "
            "ORDER BY latency_s, id LIMIT 1"
        )
        with self._reading("look up the best record") as conn:
            row = conn.execute(sql, params).fetchone()
        return None if row is None else _row_record(row)

    def records(
        self, workload_key: str | None = None, target_key: str | None = None
    ) -> list[TuningRecord]:
        """All records (failed ones included) in insertion order, optionally filtered."""
        where, params = _filter(workload_key, target_key)
        sql = f"SELECT {_RECORD_COLUMNS} FROM records WHERE {where} ORDER BY id"
        with self._reading("read records") as conn:
            return [_row_record(row) for row in conn.execute(sql, params).fetchall()]

    def workloads(self, target_key: str | None = None) -> list[tuple[str, int, float]]:
        """(workload_key, n_records, best_latency_s) per workload, sorted by key; the latency
        is +inf when no record of that workload succeeded."""
        where, params = _filter(None, target_key)
        sql = (
            f"SELECT workload_key, COUNT(*), MIN(latency_s) FROM records WHERE {where} "
            "GROUP BY workload_key ORDER BY workload_key"
        )
        with self._reading("list workloads") as conn:
            rows = conn.execute(sql, params).fetchall()
        return [(key, n, math.inf if best is None else best) for key, n, best in rows]

    def __len__(self) -> int:
        with self._reading("count records") as conn:
            return conn.execute("SELECT COUNT(*) FROM records").fetchone()[0]

    # ---- profiles and calibrations ----------------------------------------------------

    def put_profile(self, kind: str, key: str, value: dict[str, Any]) -> None:
        """Insert or replace one measured profile (kind e.g. "op", "stage", "collective")."""
        _check_profile_name(kind, key)
        if not isinstance(value, dict):
            raise TypeError(f"profile {kind}/{key}: value must be a dict, got {type(value).__name__}")
        value_json = _dumps(value, f"profile {kind}/{key}")
        with self._writing("store a profile") as conn:
            conn.execute(
                "INSERT INTO profiles (kind, key, value_json, updated_s) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (kind, key) DO UPDATE SET value_json = excluded.value_json, "
                "updated_s = excluded.updated_s",
                (kind, key, value_json, time.time()),
            )

    def get_profile(self, kind: str, key: str) -> dict[str, Any] | None:
        """The stored profile, or None if it was never measured."""
        _check_profile_name(kind, key)
        with self._reading("read a profile") as conn:
            row = conn.execute(
                "SELECT value_json FROM profiles WHERE kind = ? AND key = ?", (kind, key)
            ).fetchone()
        return None if row is None else json.loads(row[0])

    def profiles(self, kind: str) -> dict[str, dict[str, Any]]:
        """All profiles of one kind, by key."""
        with self._reading("read profiles") as conn:
            rows = conn.execute(
                "SELECT key, value_json FROM profiles WHERE kind = ? ORDER BY key", (kind,)
            ).fetchall()
        return {key: json.loads(value) for key, value in rows}

    # ---- JSON lines -------------------------------------------------------------------

    def export_jsonl(
        self,
        path: str | os.PathLike,
        workload_key: str | None = None,
        target_key: str | None = None,
    ) -> int:
        """Write records as JSON lines (TuningRecord.to_json format); returns the count. The
        file is written aside and renamed, so a failure never leaves a half-written file."""
        out = pathlib.Path(path).expanduser()
        where, params = _filter(workload_key, target_key)
        sql = f"SELECT {_RECORD_COLUMNS} FROM records WHERE {where} ORDER BY id"
        tmp_name = str(out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies
        except OSError as e:
            raise TuningDBError(f"cannot write {out}: {e}; check that its directory exists") from e
        count = 0
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f, self._reading("export") as conn:
                for row in conn.execute(sql, params):
                    f.write(_canonical_json(_row_record(row)) + "\n")
                    count += 1
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_name, out)
        except OSError as e:
            raise TuningDBError(f"cannot write {out}: {e}") from e
        finally:
            if os.path.exists(tmp_name):
                os.unlink(tmp_name)
        return count

    def import_jsonl(self, path: str | os.PathLike) -> int:
        """Add the records of a JSON-lines file in one transaction, skipping exact duplicates;
        returns how many were new. A bad line raises TuningDBError naming it, and then
        nothing from the file is imported."""
        src = pathlib.Path(path).expanduser()
        try:
            raw_lines = src.read_bytes().splitlines()
        except OSError as e:
            raise TuningDBError(f"cannot read {src}: {e}") from e
        rows = []
        for number, raw in enumerate(raw_lines, start=1):
            if not raw.strip():
                continue
            try:
                rows.append(_record_row(_parse_record_line(raw)))
            except (ValueError, TypeError) as e:
                raise TuningDBError(
                    f"{src}, line {number}: {e}. Nothing was imported; fix or delete that line."
                ) from e
        with self._writing(f"import {src}") as conn:
            return sum(conn.execute(_INSERT_RECORD, row).rowcount for row in rows)

    # ---- lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None

    def __enter__(self) -> "TuningDB":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TuningDB({str(self.path)!r})"


# ---- file inspection (read-only: never writes to a file that is not ours) ---------------


def _inspect_file(path: pathlib.Path, timeout_s: float) -> str:
    """'missing', 'empty' (zero bytes or an SQLite file with nothing in it) or 'ours';
    raises TuningDBError for anything else, after opening it read-only at most."""
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
            _not_a_db_message(path, "it is not an SQLite file: no complete SQLite header")
        )
    uri = "file:" + urllib.parse.quote(str(path.absolute())) + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=timeout_s)
        try:
            app_id, version, names = _header_and_tables(conn)
        finally:
            conn.close()
    except sqlite3.Error as e:
        if "locked" in str(e) or "busy" in str(e):
            raise TuningDBError(f"the tuning database {path} stayed locked for {timeout_s:.0f} s: {e}") from e
        raise TuningDBError(_not_a_db_message(path, f"SQLite cannot read it: {e}")) from e
    if app_id == 0 and not names:
        return "empty"
    _check_ours(path, app_id, version, names)
    return "ours"


def _header_and_tables(conn: sqlite3.Connection) -> tuple[int, int, set[str]]:
    app_id = conn.execute("PRAGMA application_id").fetchone()[0]
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    return app_id, version, names


def _check_ours(path: pathlib.Path, app_id: int, version: int, names: set[str]) -> None:
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
            _not_a_db_message(
                path, f"schema version {version} with tables {sorted(names)} is incomplete"
            )
        )


def _not_a_db_message(path: pathlib.Path, reason: str) -> str:
    return (
        f"{path} is not a readable autopar tuning database ({reason}). It was left unchanged. "
        f"Move it aside (mv '{path}' '{path}.bad') to start a fresh database, or pass a "
        f"different path with --db or ${ENV_VAR}."
    )


def _set_wal(conn: sqlite3.Connection, timeout_s: float) -> None:
    """Switch to WAL (persistent in the file); retried because the switch needs a moment
    with no other connection in a transaction."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            break
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    if str(mode).lower() != "wal":
        raise sqlite3.OperationalError(f"could not switch to WAL mode (journal_mode is {mode})")


def _sqlite_message(path: pathlib.Path, action: str, e: sqlite3.Error) -> str:
    text = str(e)
    if "locked" in text or "busy" in text:
        hint = "another process held the write lock too long; retry"
    elif "malformed" in text or "not a database" in text:
        hint = f"the file is damaged; move it aside (mv '{path}' '{path}.bad') and start afresh"
    elif "readonly" in text or "read-only" in text:
        hint = "the file or its directory is not writable"
    else:
        hint = "check the file and the disk"
    return f"tuning database {path}: could not {action}: {text} ({hint})"


# ---- record <-> row ----------------------------------------------------------------------

_INSERT_RECORD = (
    "INSERT OR IGNORE INTO records (digest, workload_key, target_key, latency_s, task_json, "
    "target_json, schedule_json, latencies_json, error, timestamp, tuning_time_s, "
    "library_version, extra_json) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def _dumps(value: Any, what: str) -> str:
    try:
        return json.dumps(value, sort_keys=True, default=_json_default, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} cannot be stored as JSON: {e}") from e


def _check_record(record: TuningRecord) -> None:
    """Type checks with messages that name the field; the database stores only what
    TuningRecord.from_json can read back."""
    if not isinstance(record, TuningRecord):
        raise TypeError(f"expected a TuningRecord, got {type(record).__name__}")
    name = record.workload_key
    if not isinstance(name, str) or not name:
        raise TypeError(f"workload_key must be a non-empty string, got {name!r}")
    expected = {
        "task": dict, "target_key": str, "target": dict, "schedule": (list, tuple),
        "latencies_s": (list, tuple), "error": (str, type(None)), "library_version": str,
        "extra": dict,
    }
    for field, kind in expected.items():
        value = getattr(record, field)
        if not isinstance(value, kind):
            raise TypeError(f"record {name!r}: {field} has type {type(value).__name__}")
    for field in ("timestamp", "tuning_time_s"):
        value = getattr(record, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TypeError(f"record {name!r}: {field} must be a finite number, got {value!r}")
    for x in record.latencies_s:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
            raise ValueError(
                f"record {name!r}: latencies_s must be finite non-negative seconds, got {x!r}; "
                "record a failed measurement with error=... and no latencies instead"
            )


def _record_row(record: TuningRecord) -> tuple:
    _check_record(record)
    name = record.workload_key
    latencies = [float(x) for x in record.latencies_s]
    fields = {
        "task": _dumps(record.task, f"record {name!r}: task"),
        "target": _dumps(record.target, f"record {name!r}: target"),
        "schedule": _dumps(list(record.schedule), f"record {name!r}: schedule"),
        "extra": _dumps(record.extra, f"record {name!r}: extra"),
    }
    canonical = _canonical_json(record)
    digest = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    return (
        digest, name, record.target_key, record.latency_s if record.ok else None,
        fields["task"], fields["target"], fields["schedule"], json.dumps(latencies),
        record.error, float(record.timestamp), float(record.tuning_time_s),
        record.library_version, fields["extra"],
    )


def _canonical_json(record: TuningRecord) -> str:
    """The record as sorted-key JSON (readable by TuningRecord.from_json); equal records
    give equal text, which is what duplicate detection hashes."""
    d = {field: getattr(record, field) for field in _RECORD_FIELDS}
    d["schedule"] = list(record.schedule)
    d["latencies_s"] = [float(x) for x in record.latencies_s]
    d["timestamp"] = float(record.timestamp)
    d["tuning_time_s"] = float(record.tuning_time_s)
    return _dumps(d, f"record {record.workload_key!r}")


def _row_record(row: tuple) -> TuningRecord:
    (workload_key, task, target_key, target, schedule, latencies, error, timestamp,
     tuning_time_s, library_version, extra) = row
    return TuningRecord(
        workload_key=workload_key, task=json.loads(task), target_key=target_key,
        target=json.loads(target), schedule=json.loads(schedule),
        latencies_s=tuple(json.loads(latencies)), error=error, timestamp=timestamp,
        tuning_time_s=tuning_time_s, library_version=library_version, extra=json.loads(extra),
    )


def _parse_record_line(raw: bytes) -> TuningRecord:
    try:
        d = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text ({e})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from e
    if not isinstance(d, dict):
        raise ValueError(f"expected a JSON object (one tuning record), got {type(d).__name__}")
    missing = [f for f in _REQUIRED_FIELDS if f not in d]
    unknown = sorted(set(d) - set(_RECORD_FIELDS))
    if missing or unknown:
        raise ValueError(
            f"not a tuning record (missing fields: {missing or 'none'}; unknown fields: "
            f"{unknown or 'none'})"
        )
    if not isinstance(d.get("latencies_s", []), list):
        raise ValueError("latencies_s must be a list of seconds")
    d["latencies_s"] = tuple(d.get("latencies_s", ()))
    return TuningRecord(**d)


def _filter(workload_key: str | None, target_key: str | None) -> tuple[str, tuple]:
    clauses, params = ["1"], []
    if workload_key is not None:
        clauses.append("workload_key = ?")
        params.append(workload_key)
    if target_key is not None:
        clauses.append("target_key = ?")
        params.append(target_key)
    return " AND ".join(clauses), tuple(params)


def _check_profile_name(kind: str, key: str) -> None:
    for what, value in (("kind", kind), ("key", key)):
        if not isinstance(value, str) or not value:
            raise TypeError(f"profile {what} must be a non-empty string, got {value!r}")
