"""What the tuning side of autopar refuses, and why: damaged tuning databases, records that
fail validation, bad `autopar tune` / `autopar db` arguments, a missing C compiler, and kernels
that try to fool the measuring runner. Each refusal names the problem and the fix."""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sqlite3
import warnings

import pytest

from autopar.commands import db as db_command
from search.database import (
    APPLICATION_ID, SCHEMA_VERSION, SkippedRecordsWarning, TuningDB, TuningDBError,
)
from search.record import TuningRecord

STEP = {"kind": "split", "stage": "C", "iter": "i", "factors": [8, 8]}


def record(workload: str = "w", latencies=(1e-3,), schedule=(STEP,), **kw) -> TuningRecord:
    return TuningRecord(
        workload_key=workload, task={"flops": 1e6}, target_key="cpu-t", target={"cpu": "t"},
        schedule=list(schedule), latencies_s=tuple(latencies), timestamp=kw.pop("timestamp", 1.7e9),
        library_version="0.1.0", **kw,
    )


def numbered(n: int, seed: int = 0) -> list[TuningRecord]:
    rng = random.Random(seed)
    return [record(f"w{rng.randrange(4)}", [rng.uniform(1e-4, 1e-2)],
                   [{"kind": "pragma", "stage": "C", "auto_unroll_max_step": i}]) for i in range(n)]


def db_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="autopar db")
    db_command.add_arguments(parser)
    return db_command.run(parser.parse_args(list(argv)))


def checkpointed(path, records) -> int:
    """Write `records` into a new database at `path`, folded into the main file; its size."""
    with TuningDB(path) as db:
        for r in records:
            db.add(r)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return path.stat().st_size


def raw_insert_takes_duplicate(path) -> bool:
    """Whether plain SQLite, on a copy of `path`, stores a second copy of a stored record."""
    copy = path.with_name("copy.db")
    shutil.copyfile(path, copy)
    conn = sqlite3.connect(copy)
    try:
        row = conn.execute("SELECT * FROM records ORDER BY id DESC LIMIT 1").fetchone()
        before = conn.execute("SELECT COUNT(*) FROM records").fetchone()[0]
        conn.execute(f"INSERT OR IGNORE INTO records VALUES (NULL{', ?' * (len(row) - 1)})", row[1:])
        conn.commit()
        return conn.execute("SELECT COUNT(*) FROM records").fetchone()[0] > before
    except sqlite3.DatabaseError:
        return False
    finally:
        conn.close()
        copy.unlink()


# ---- damaged databases: refused, never written ---------------------------------------------


def test_db_truncated_inside_its_last_page_is_refused_untouched(tmp_path, capsys):
    path = tmp_path / "tuning.db"
    for n in range(200, 1200, 20):  # until an index page is last: cut inside it, plain
        path.unlink(missing_ok=True)  # SQLite then takes an exact duplicate (220 records do)
        size = checkpointed(path, numbered(n))
        with open(path, "r+b") as f:
            f.truncate(size - 2000)
        if raw_insert_takes_duplicate(path):
            break
    else:
        pytest.fail("no database size put an index page last")
    before = path.read_bytes()
    with pytest.raises(TuningDBError) as info:
        TuningDB(path)
    message = str(info.value)
    assert str(path) in message and "file size check failed" in message
    assert "backup" in message and "--salvage" in message and f"mv '{path}'" in message
    assert path.read_bytes() == before
    # the CLI says so in one line, exit code 2, and writes nothing either
    assert db_cli("import", str(tmp_path / "none.jsonl"), "--db", str(path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "damaged" in err
    assert path.read_bytes() == before


def test_db_with_a_zeroed_page_fails_the_integrity_check(tmp_path):
    path = tmp_path / "tuning.db"
    size = checkpointed(path, numbered(200))
    with open(path, "r+b") as f:  # same size, last page wiped
        f.seek(size - 4096)
        f.write(bytes(4096))
    before = path.read_bytes()
    with pytest.raises(TuningDBError, match="integrity check failed") as info:
        TuningDB(path)
    assert str(path) in str(info.value)
    assert path.read_bytes() == before


def test_db_without_a_unique_digest_is_refused(tmp_path):
    """Duplicates are kept out by the unique index on each record's digest; a file of ours
    without it (made by hand, or by a broken tool) is refused rather than written."""
    path = tmp_path / "tuning.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE records (id INTEGER PRIMARY KEY, digest TEXT)")
    conn.execute("CREATE TABLE profiles (kind TEXT, key TEXT)")
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    conn.commit()
    conn.close()
    with pytest.raises(TuningDBError, match="unique index on digest"):
        TuningDB(path)


def test_equal_records_are_stored_once_however_they_are_spelled(tmp_path):
    a = record(latencies=(1, 2), timestamp=1_700_000_000)
    b = record(latencies=[1.0, 2.0], schedule=[dict(STEP)], timestamp=1.7e9)
    with TuningDB(tmp_path / "t.db") as db:
        assert db.add_many([a, b, a]) == 1
        db.add(b)
        assert len(db) == 1


def test_salvage_exports_what_a_damaged_db_still_holds(tmp_path, capsys):
    path, out = tmp_path / "tuning.db", tmp_path / "saved.jsonl"
    records = numbered(500)
    size = checkpointed(path, records)
    with open(path, "r+b") as f:  # lose the last five pages
        f.truncate(size - 5 * 4096)
    before = path.read_bytes()
    assert db_cli("export", "--salvage", str(out), "--db", str(path)) == 0
    assert "sit on damaged pages and were not exported" in capsys.readouterr().err
    assert path.read_bytes() == before
    saved = [TuningRecord.from_json(line) for line in out.read_text().splitlines()]
    assert 0 < len(saved) < len(records)
    assert all(r in records for r in saved)  # what comes out is real records, in order
    assert saved == [r for r in records if r in saved]
    with TuningDB(path, salvage=True) as db, pytest.raises(TuningDBError, match="read-only"):
        db.add(record("new"))
    assert db_cli("import", str(out), "--db", str(tmp_path / "new.db")) == 0
    assert f"imported {len(saved)} new records" in capsys.readouterr().out


# ---- records that fail validation: skipped on import, never returned ---------------------


def _line(r: TuningRecord, **changes) -> str:
    return json.dumps({**json.loads(r.to_json()), **changes})


INVALID = [  # (change to a good record, problem named)
    ({"schedule": [{"kind": "tile_v2", "stage": "C"}]}, "unknown step kind 'tile_v2'"),
    ({"schedule": [1, "x", None]}, "a step must be a JSON object"),
    ({"schedule": [{"kind": "split", "stage": "C", "iter": "i"}]}, "lacks field 'factors'"),
    ({"schedule": [{"kind": "annotate", "stage": "C", "iter": "i", "ann": "fast"}]}, "field 'ann'"),
    ({"latencies_s": [0.0]}, "positive finite seconds"),
    ({"latencies_s": [-1e-3, 1e-3]}, "positive finite seconds"),
]


def test_import_skips_invalid_records_and_says_which_and_why(tmp_path, capsys):
    good = record("mm", latencies=(2e-3,))
    lines = [_line(good)] + [_line(good, **change) for change, _ in INVALID]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    with TuningDB(tmp_path / "t.db") as db:
        report = db.import_jsonl(src)
        assert report.added == 1 and report.duplicates == 0
        assert [n for n, _ in report.invalid] == list(range(2, 2 + len(INVALID)))
        for (_, problem), (_, named) in zip(report.invalid, INVALID):
            assert named in problem
        assert db.best("mm") == good and len(db) == 1
    assert db_cli("import", str(src), "--db", str(tmp_path / "u.db")) == 0
    out, err = capsys.readouterr()
    assert "imported 1 new records" in out
    assert f"skipped {len(INVALID)} invalid records" in err and "unknown step kind 'tile_v2'" in err


@pytest.mark.parametrize("change, named", INVALID)
def test_add_refuses_an_invalid_record(tmp_path, change, named):
    bad = TuningRecord.from_json(_line(record(), **change))
    with TuningDB(tmp_path / "t.db") as db:
        with pytest.raises(ValueError, match="not stored") as info:
            db.add(bad)
        assert named in str(info.value) and len(db) == 0


def _store_unchecked(path, records: list[TuningRecord]) -> None:
    """Write rows the way an older autopar did, without validation."""
    conn = sqlite3.connect(path)
    for r in records:
        conn.execute(
            "INSERT INTO records (digest, workload_key, target_key, latency_s, task_json, "
            "target_json, schedule_json, latencies_json, error, timestamp, tuning_time_s, "
            "library_version, extra_json) VALUES (?, ?, ?, ?, ?, ?, ?, ?, NULL, 0, 0, '', '{}')",
            (os.urandom(8).hex(), r.workload_key, r.target_key, r.latency_s, json.dumps(r.task),
             json.dumps(r.target), json.dumps(r.schedule), json.dumps(list(r.latencies_s))),
        )
    conn.commit()
    conn.close()


def test_stored_invalid_records_are_never_returned(tmp_path, capsys):
    path = tmp_path / "t.db"
    good = record("mm", latencies=(5e-3,))
    with TuningDB(path) as db:
        db.add(good)
    bad = [TuningRecord.from_json(_line(good, **change)) for change, _ in INVALID]
    _store_unchecked(path, bad)  # all but one are "faster" than the good record
    with TuningDB(path) as db:
        with pytest.warns(SkippedRecordsWarning, match="left out 2 invalid records .*positive"):
            assert db.best("mm") == good  # the two with bad latencies were "faster"
        with pytest.warns(SkippedRecordsWarning, match=f"left out {len(INVALID) - 2} invalid"):
            assert db.records() == [good]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # each skipped record is reported once
            assert db.best("mm") == good
            assert db.workloads() == [("mm", 1 + len(INVALID), 5e-3)]  # stored, best valid
            assert db.export_jsonl(tmp_path / "out.jsonl") == 1
        assert sorted(db.skipped) == list(range(2, 2 + len(INVALID)))
        assert len(db) == 1 + len(INVALID)
    assert db_cli("list", "--db", str(path)) == 0
    err = capsys.readouterr().err
    assert "left out 2 invalid records" in err and "db remove --invalid" in err


def test_db_remove_counts_first_then_deletes(tmp_path, capsys):
    path = tmp_path / "t.db"
    with TuningDB(path) as db:
        db.add_many([record("mm", latencies=(5e-3,)), record("sm", latencies=(1e-3,))])
    _store_unchecked(path, [TuningRecord.from_json(_line(record("mm"), **c)) for c, _ in INVALID[:3]])
    assert db_cli("remove", "--invalid", "--dry-run", "--db", str(path)) == 0
    out = capsys.readouterr().out
    assert "would remove 3 invalid records" in out and "nothing was deleted" in out
    with TuningDB(path) as db:
        assert len(db) == 5
    assert db_cli("remove", "--invalid", "--db", str(path)) == 0
    assert "removed 3 invalid records" in capsys.readouterr().out
    assert db_cli("remove", "sm", "--db", str(path)) == 0
    assert "removed 1 records of sm" in capsys.readouterr().out
    with TuningDB(path) as db:
        assert [r.workload_key for r in db.records()] == ["mm"] and len(db) == 1
    assert db_cli("remove", "m", "--db", str(path)) == 1  # no prefixes: exact keys only
    assert "no records of workload 'm'" in capsys.readouterr().err
    assert db_cli("remove", "--db", str(path)) == 2
    assert "name a workload KEY, or pass --invalid" in capsys.readouterr().err


def test_tune_survives_stored_records_it_cannot_use(tmp_path):
    """Invalid records, and valid-looking ones whose schedule does not apply to the task,
    were search elites and crashed every later tuning of that workload."""
    from search import Task, tune

    task, path = Task.softmax(4, 16), tmp_path / "t.db"
    first = tune(task, trials=4, batch_size=4, db=str(path), transfer=False)
    good = first.records[0]
    steps = [{"kind": "tile_v2", "stage": "out"}], [1, "x", None], \
        [{"kind": "split", "stage": "no_such_stage", "iter": "i", "factors": [2]}]
    _store_unchecked(path, [TuningRecord.from_json(_line(good, schedule=s, latencies_s=[1e-9]))
                            for s in steps])
    with pytest.warns(SkippedRecordsWarning) as caught:
        again = tune(task, trials=4, batch_size=4, db=str(path), transfer=False)
    assert again.best_schedule is not None and again.best_latency_s > 1e-9
    said = " ".join(str(w.message) for w in caught)
    assert "left out 2 invalid records" in said and "left out 1 stored records" in said


# ---- kernels that try to fool the measuring runner -------------------------------------

MATMUL = """
#include <stdio.h>
#include <string.h>
#include <unistd.h>
static int calls = 0;
void kernel(const float* A, const float* B, float* C) {
    %s
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 8; j++) {
            float s = 0;
            for (int k = 0; k < 8; k++) s += A[i * 8 + k] * B[k * 8 + j];
            C[i * 8 + j] = s;
        }
}
"""
FAKE = '{"id": 1, "ready": true, "latencies_s": [1e-12], "error": null}\n'
TRICKS = {
    "honest": "",
    "prints a fake reply": f'printf("%s", {json.dumps(FAKE)}); fflush(stdout);',
    "writes a fake reply to every fd": f'for (int fd = 0; fd < 64; fd++) write(fd, {json.dumps(FAKE)}, {len(FAKE)});',
    "is right only once": "if (calls++ > 0) return;",
}


def test_runner_is_not_fooled_by_what_kernels_print_or_skip(tmp_path):
    """The runner used to read replies from its stdout, which kernels share: a kernel that
    printed a reply was recorded at 1e-12 s and every later reply landed on the wrong
    schedule. It also checked only the first call, so a kernel right once was "fast"."""
    from search.backend import CBackend
    from search.measure import MeasureOptions, Runner
    from search.task import Task

    backend = CBackend(workdir=str(tmp_path))
    sources = [MATMUL % code for code in TRICKS.values()]
    paths = [b.path for b in backend.build(sources + [sources[0]])]
    runner = Runner(Task.matmul(8, 8, 8), MeasureOptions(repeats=3, min_time_s=0.0))
    try:
        results = dict(zip(list(TRICKS) + ["honest again"], (runner.run(p) for p in paths)))
    finally:
        runner.close()
    for name in ("honest", "prints a fake reply", "honest again"):
        latencies, error = results[name]
        assert error is None and len(latencies) >= 3 and min(latencies) > 1e-8, (name, results[name])
    assert "answered something other than request" in results["writes a fake reply to every fd"][1]
    assert "wrong result" in results["is right only once"][1]
    assert "timed call 1" in results["is right only once"][1]


# ---- `autopar tune` arguments and environment: one line on stderr, no traceback ----------


def tune_cli(tmp_path, *extra: str, shape: str = "4,16") -> int:
    from autopar.commands import tune as tune_command

    parser = argparse.ArgumentParser(prog="autopar tune")
    tune_command.add_arguments(parser)
    argv = ["--task", "softmax", "--shape", shape, "--trials", "2", "--batch-size", "2",
            "--db", str(tmp_path / "t.db"), *extra]
    return tune_command.run(parser.parse_args(argv))


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("autopar tune: error: "), err
    return err


@pytest.mark.parametrize("extra, named", [
    (("--batch-size", "0"), "--batch-size must be at least 1, got 0"),
    (("--trials", "-3"), "--trials must be at least 1, got -3"),
])
def test_tune_refuses_bad_counts(tmp_path, capsys, extra, named):
    assert tune_cli(tmp_path, *extra) == 2
    assert named in one_error_line(capsys)


def test_tune_refuses_a_shape_too_large_for_memory(tmp_path, capsys):
    """Used to end in three tracebacks and a BrokenPipeError from the runner."""
    assert tune_cli(tmp_path, shape="1000000,1000000") == 2
    err = one_error_line(capsys)
    # 1e12 inputs + 1e12 outputs: 4 + 4 + 8 bytes per input element, 4 + 8 per output element
    assert f"{28e12 / 2**30:,.1f} GiB" in err and "available" in err and "smaller shape" in err
    assert not (tmp_path / "t.db").exists()


@pytest.mark.parametrize("make_db, named", [
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: p.write_text("not a database\n"), "not a readable autopar tuning database"),
])
def test_tune_refuses_a_bad_db_file(tmp_path, capsys, make_db, named):
    make_db(tmp_path / "t.db")
    assert tune_cli(tmp_path) == 2
    assert named in one_error_line(capsys)


@pytest.mark.parametrize("how", ["CC names a missing compiler", "no gcc on PATH"])
def test_tune_names_the_missing_compiler(tmp_path, capsys, monkeypatch, how):
    """Used to end in a bare FileNotFoundError: 'gcc'."""
    from search import Task, tune
    from search.backend import CompilerNotFoundError

    if how == "no gcc on PATH":
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path))
        named = "'gcc' (the default; $CC is not set) is not on PATH"
    else:
        monkeypatch.setenv("CC", "no-such-cc")
        named = "'no-such-cc' (set by $CC) is not on PATH"
    assert tune_cli(tmp_path) == 1
    err = one_error_line(capsys)
    assert named in err and "apt install gcc" in err and "set CC to" in err
    with pytest.raises(CompilerNotFoundError, match="not on PATH"):
        tune(Task.softmax(4, 16), trials=2, db=str(tmp_path / "t.db"))
