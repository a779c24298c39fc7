"""Tuning database: kernel tuning records, op/stage profiles and collective calibrations in
one SQLite file (WAL mode, schema-versioned) that several tuning processes can share."""
from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import math
import os
import pathlib
import secrets
import sqlite3
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from search.db_file import (
    APPLICATION_ID, ENV_VAR, SCHEMA_VERSION, TuningDBError, check_ours, header_and_tables,
    inspect_file, read_only_uri,
)
from search.record import TuningRecord
from search.record_check import content_problem, field_type_problem, record_problem

__all__ = [
    "APPLICATION_ID", "ENV_VAR", "SCHEMA_VERSION", "ImportReport", "InvalidRecordError", "SkippedRecordsWarning",
    "TuningDB", "TuningDBError", "default_db_path", "summarize_problems",
]

BUSY_TIMEOUT_S = 60.0
_PAGE = 32  # rows per query when looking for the best valid record

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
_RECORD_COLUMNS = (
    "id, workload_key, task_json, target_key, target_json, schedule_json, latencies_json, "
    "error, timestamp, tuning_time_s, library_version, extra_json"
)


class InvalidRecordError(ValueError):
    """A well-typed record whose content fails validation (`search.record_check`)."""

    def __init__(self, workload_key: str, problem: str):
        super().__init__(f"record {workload_key!r}: {problem}; it was not stored")
        self.problem = problem


class SkippedRecordsWarning(UserWarning):
    """Stored records that fail validation were left out of a read (see TuningDB.skipped)."""


@dataclass(frozen=True)
class ImportReport:
    """What `import_jsonl` did: records added, exact duplicates of stored ones, and the
    (line number, problem) of each record that failed validation and was skipped."""

    added: int
    duplicates: int
    invalid: tuple[tuple[int, str], ...] = ()


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
    is not an autopar tuning database, or is damaged, raises TuningDBError and is never
    written to. Reads leave out stored records that fail validation and note them in
    `skipped`. `salvage=True` opens a damaged file read-only to export what can still be read.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        create: bool = True,
        synchronous: str = "NORMAL",
        timeout_s: float = BUSY_TIMEOUT_S,
        salvage: bool = False,
    ):
        self.path = pathlib.Path(path).expanduser() if path is not None else default_db_path()
        if synchronous.upper() not in ("NORMAL", "FULL", "EXTRA"):
            raise ValueError(
                f"synchronous={synchronous!r}: use 'NORMAL' (survives a killed process) or "
                "'FULL' (also survives power loss, one fsync per write)"
            )
        self._create = create and not salvage
        self._salvage = salvage
        self._synchronous = synchronous.upper()
        self._timeout_s = float(timeout_s)
        self._lock = threading.RLock()
        self._inherited: list[sqlite3.Connection] = []
        self._skipped: dict[int, str] = {}
        self._unreadable: list[tuple[int, int | None]] = []
        self._conn: sqlite3.Connection | None = self._connect()
        self._pid = os.getpid()

    @property
    def skipped(self) -> dict[int, str]:
        """Row id -> problem of every stored record that reads so far left out as invalid."""
        with self._lock:
            return dict(self._skipped)

    @property
    def unreadable(self) -> list[tuple[int, int | None]]:
        """(first, last) row ids a salvage read could not reach (damaged pages); last is
        None when nothing after `first` could be read."""
        with self._lock:
            return list(self._unreadable)

    # ---- opening and validation -------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        state = inspect_file(self.path, self._timeout_s, salvage=self._salvage)
        if self._salvage:
            if state != "ours":
                raise TuningDBError(f"nothing to salvage: {self.path} is {state}")
            return self._open_for_salvage()
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

    def _open_for_salvage(self) -> sqlite3.Connection:
        """Read-only, and past SQLite's refusal of a file shorter than its header says."""
        try:
            conn = sqlite3.connect(
                read_only_uri(self.path), uri=True, timeout=self._timeout_s,
                isolation_level=None, check_same_thread=False,
            )
            conn.execute("PRAGMA writable_schema = ON")  # a read-only connection still cannot write
        except sqlite3.Error as e:
            raise TuningDBError(f"cannot open {self.path} to salvage it: {e}") from e
        return conn

    def _initialize(self, conn: sqlite3.Connection) -> None:
        """Create the schema in an empty file; another process may be doing the same now, so
        check again under the write lock."""
        _set_wal(conn, self._timeout_s)
        conn.execute("BEGIN IMMEDIATE")
        try:
            app_id, version, names = header_and_tables(conn)
            if app_id == 0 and not names:
                for statement in _SCHEMA:
                    conn.execute(statement)
                conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            else:
                check_ours(self.path, app_id, version, names)
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
        if self._salvage:
            raise TuningDBError(
                f"cannot {action}: {self.path} was opened to salvage its records, read-only"
            )
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

    def _valid(self, rows: Iterable[tuple], limit: int | None = None) -> list[TuningRecord]:
        """The records of `rows` (id + record columns) that pass validation, the first `limit`
        of them; the others are noted in `skipped`, with one SkippedRecordsWarning per read
        that finds new ones."""
        records: list[TuningRecord] = []
        new: dict[int, str] = {}
        for row in rows:
            record, problem = _checked_record(row)
            if problem is None:
                records.append(record)
                if len(records) == limit:
                    break
            elif row[0] not in self._skipped:
                new[row[0]] = problem
        if new:
            self._skipped.update(new)
            warnings.warn(SkippedRecordsWarning(
                f"{self.path}: left out {summarize_problems(new.values())}; "
                f"`autopar db remove --invalid --db '{self.path}'` deletes them"
            ), stacklevel=3)
        return records

    def _rows_by_id(self, conn: sqlite3.Connection, where: str, params: tuple) -> Iterator[tuple]:
        """Records matching `where`, in insertion order; when salvaging, one row at a time past
        pages that cannot be read (their row-id ranges are noted in `unreadable`)."""
        if not self._salvage:
            yield from conn.execute(
                f"SELECT {_RECORD_COLUMNS} FROM records WHERE {where} ORDER BY id", params
            )
            return
        sql = (f"SELECT {_RECORD_COLUMNS} FROM records NOT INDEXED WHERE id > ? AND {where} "
               "ORDER BY id LIMIT 1")

        def first_after(row_id: int) -> tuple | None:
            return conn.execute(sql, (row_id, *params)).fetchone()

        last = 0
        while True:
            try:
                row = first_after(last)
            except sqlite3.DatabaseError:
                resume = _first_readable(first_after, last)
                self._unreadable.append((last + 1, resume))
                if resume is None:
                    return
                last = resume
                continue
            if row is None:
                return
            yield row
            last = row[0]

    # ---- records ----------------------------------------------------------------------

    def add(self, record: TuningRecord) -> None:
        """Store one record, committed before returning; an exact duplicate is ignored. A
        record that fails validation raises (TypeError or ValueError naming the field)."""
        row = _record_row(record)
        with self._writing("add a record") as conn:
            conn.execute(_INSERT_RECORD, row)

    def add_many(self, records: Iterable[TuningRecord]) -> int:
        """Store many records in one transaction (all or none); returns how many were new."""
        rows = [_record_row(r) for r in records]
        with self._writing("add records") as conn:
            return sum(conn.execute(_INSERT_RECORD, row).rowcount for row in rows)

    def best(self, workload_key: str, target_key: str | None = None) -> TuningRecord | None:
        """The valid successful record with the lowest median latency, or None."""
        where, params = _filter(workload_key, target_key)
        sql = (
            f"SELECT {_RECORD_COLUMNS} FROM records WHERE {where} AND latency_s IS NOT NULL "
            f"ORDER BY latency_s, id LIMIT {_PAGE} OFFSET ?"
        )

        def fastest_first(conn: sqlite3.Connection) -> Iterator[tuple]:
            # pages, so that SQLite keeps only the top few rows when sorting
            for offset in itertools.count(0, _PAGE):
                rows = conn.execute(sql, (*params, offset)).fetchall()
                yield from rows
                if len(rows) < _PAGE:
                    return

        with self._reading("look up the best record") as conn:
            found = self._valid(fastest_first(conn), limit=1)
        return found[0] if found else None

    def records(
        self, workload_key: str | None = None, target_key: str | None = None
    ) -> list[TuningRecord]:
        """All valid records (failed ones included) in insertion order, optionally filtered."""
        where, params = _filter(workload_key, target_key)
        with self._reading("read records") as conn:
            return self._valid(self._rows_by_id(conn, where, params))

    def workloads(self, target_key: str | None = None) -> list[tuple[str, int, float]]:
        """(workload_key, n_records, best_latency_s) per workload, sorted by key: the count of
        stored records (invalid ones included: validating every row would make this O(file)
        in Python) and the latency of `best()`, +inf when no valid record succeeded."""
        where, params = _filter(None, target_key)
        sql = (f"SELECT workload_key, COUNT(*), MIN(latency_s) FROM records WHERE {where} "
               "GROUP BY workload_key ORDER BY workload_key")
        with self._reading("list workloads") as conn:
            rows = conn.execute(sql, params).fetchall()
        out = []
        for key, n, fastest in rows:
            best = self.best(key, target_key) if fastest is not None else None
            out.append((key, n, math.inf if best is None else best.latency_s))
        return out

    def remove(
        self,
        workload_key: str | None = None,
        target_key: str | None = None,
        *,
        invalid_only: bool = False,
        dry_run: bool = False,
    ) -> list[tuple[str, str | None]]:
        """Delete the records of a workload (and target), or with `invalid_only` those that fail
        validation; returns (workload_key, problem or None) of each one deleted, or that would
        be with `dry_run`."""
        if workload_key is None and not invalid_only:
            raise ValueError("remove: name a workload_key, or pass invalid_only=True; to drop "
                             "every record, delete the database file instead")
        where, params = _filter(workload_key, target_key)

        def chosen(conn: sqlite3.Connection) -> list[tuple[int, str, str | None]]:
            out = []
            for row in conn.execute(f"SELECT {_RECORD_COLUMNS} FROM records WHERE {where}", params):
                problem = _checked_record(row)[1]
                if problem is not None or not invalid_only:
                    out.append((row[0], row[1], problem))
            return out

        if dry_run:
            with self._reading("find records to remove") as conn:
                found = chosen(conn)
        else:
            with self._writing("remove records") as conn:
                found = chosen(conn)
                conn.executemany("DELETE FROM records WHERE id = ?", [(i,) for i, _, _ in found])
            for i, _, _ in found:
                self._skipped.pop(i, None)
        return [(key, problem) for _, key, problem in found]

    def __len__(self) -> int:
        """Stored records, invalid ones included."""
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
        """Write valid records as JSON lines (TuningRecord.to_json format); returns the count.
        The file is written aside and renamed, so a failure never leaves a half-written file."""
        out = pathlib.Path(path).expanduser()
        where, params = _filter(workload_key, target_key)
        tmp_name = str(out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies
        except OSError as e:
            raise TuningDBError(f"cannot write {out}: {e}; check that its directory exists") from e
        count = 0
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f, self._reading("export") as conn:
                for record in self._valid(self._rows_by_id(conn, where, params)):
                    f.write(_canonical_json(record) + "\n")
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

    def import_jsonl(self, path: str | os.PathLike) -> ImportReport:
        """Add the valid records of a JSON-lines file in one transaction, skipping exact
        duplicates and (reported by line) records that fail validation. A line that is not a
        tuning record at all raises TuningDBError naming it, and then nothing is imported."""
        src = pathlib.Path(path).expanduser()
        try:
            raw_lines = src.read_bytes().splitlines()
        except OSError as e:
            raise TuningDBError(f"cannot read {src}: {e}") from e
        rows, invalid = [], []
        for number, raw in enumerate(raw_lines, start=1):
            if not raw.strip():
                continue
            try:
                rows.append(_record_row(_parse_record_line(raw)))
            except InvalidRecordError as e:
                invalid.append((number, e.problem))
            except (ValueError, TypeError) as e:
                raise TuningDBError(
                    f"{src}, line {number}: {e}. Nothing was imported; fix or delete that line."
                ) from e
        with self._writing(f"import {src}") as conn:
            added = sum(conn.execute(_INSERT_RECORD, row).rowcount for row in rows)
        return ImportReport(added, len(rows) - added, tuple(invalid))

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



# ---- SQLite helpers ----------------------------------------------------------------------


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


def _record_row(record: TuningRecord) -> tuple:
    """The row that stores `record`; TypeError for a field of the wrong type, ValueError for
    content that fails validation (both name the problem)."""
    problem = field_type_problem(record)
    if problem:
        raise TypeError(problem)
    problem = content_problem(record)
    if problem:
        raise InvalidRecordError(record.workload_key, problem)
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


def _checked_record(row: tuple) -> tuple[TuningRecord | None, str | None]:
    """The record of a row (id + record columns), or None and why it cannot be used."""
    (_, workload_key, task, target_key, target, schedule, latencies, error, timestamp,
     tuning_time_s, library_version, extra) = row
    try:
        record = TuningRecord(
            workload_key=workload_key, task=json.loads(task), target_key=target_key,
            target=json.loads(target), schedule=json.loads(schedule),
            latencies_s=tuple(json.loads(latencies)), error=error, timestamp=timestamp,
            tuning_time_s=tuning_time_s, library_version=library_version, extra=json.loads(extra),
        )
    except (TypeError, ValueError) as e:  # NULL or garbled columns of a damaged file
        return None, f"unreadable row ({type(e).__name__}: {e})"
    problem = record_problem(record)
    return (None, problem) if problem else (record, None)


def _first_readable(first_after: Any, last: int) -> int | None:
    """The smallest row id past `last` from which `first_after(id)` reads again (ids in
    between sit on damaged pages), or None when nothing further can be read."""
    def readable(row_id: int) -> bool:
        try:
            first_after(row_id)
            return True
        except sqlite3.DatabaseError:
            return False

    step = 1
    while not readable(last + step):
        step *= 2
        if last + step > 2**62:
            return None
    low, high = last + step // 2, last + step  # low is unreadable (or `last`), high reads
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if readable(middle) else (middle, high)
    return high


def summarize_problems(problems: Iterable[str], noun: str = "invalid record", shown: int = 3) -> str:
    """'N invalid records (k: problem; ...)', the most common problems first."""
    counts = collections.Counter(problems)
    total = sum(counts.values())
    parts = [f"{n}: {problem}" for problem, n in counts.most_common(shown)]
    if len(counts) > shown:
        parts.append(f"{len(counts) - shown} other problems")
    return f"{total} {noun}{'s' if total != 1 else ''} ({'; '.join(parts)})"


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
