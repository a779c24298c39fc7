"""The tuning database: lookups against brute force, concurrent writers, a killed writer,
refusal to touch foreign or corrupt files, JSON-lines round trips, and the `autopar db` CLI."""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import signal
import sqlite3
import subprocess
import sys

import pytest

from autopar.commands import db as db_command
from search.database import (
    APPLICATION_ID, SCHEMA_VERSION, ImportReport, TuningDB, TuningDBError, default_db_path,
)
from search.record import TuningRecord

REPO = pathlib.Path(__file__).resolve().parents[1]


def make_record(workload: str, target: str = "cpu-a", latencies=(1e-3,), error=None, **kw):
    return TuningRecord(
        workload_key=workload,
        task=kw.pop("task", {"op": "matmul", "shape": [64, 64, 64], "flops": 2 * 64**3}),
        target_key=target,
        target={"cpu": "Test CPU", "isa": ["avx2", "fma"], "compiler": "cc 12"},
        schedule=kw.pop("schedule", [{"kind": "split", "stage": "C", "iter": "i", "factors": [8, 8]}]),
        latencies_s=tuple(latencies),
        error=error,
        timestamp=kw.pop("timestamp", 1.7e9),
        tuning_time_s=kw.pop("tuning_time_s", 0.5),
        library_version="0.1.0",
        extra=kw.pop("extra", {}),
    )


def unroll(i: int) -> dict:
    """A schedule step that tells records apart by one number."""
    return {"kind": "pragma", "stage": "C", "auto_unroll_max_step": i}


def random_records(rng: random.Random, n: int) -> list[TuningRecord]:
    records = []
    for i in range(n):
        workload = f"matmul_{rng.randrange(4)}"
        target = rng.choice(["cpu-a", "cpu-b"])
        if rng.random() < 0.2:
            records.append(make_record(workload, target, (), error=f"build failed #{i}"))
        else:
            lat = [rng.uniform(1e-4, 1e-2) for _ in range(rng.randint(1, 5))]
            records.append(make_record(workload, target, lat, schedule=[unroll(i)]))
    return records


def run_child(code: str, *args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, stdin=subprocess.PIPE, text=True, **kw,
    )


# ---- lookups -----------------------------------------------------------------------------


def test_round_trip_and_lookups_match_brute_force(tmp_path):
    rng = random.Random(0)
    records = random_records(rng, 120)
    path = tmp_path / "sub" / "tuning.db"
    with TuningDB(path) as db:
        for r in records[:60]:
            db.add(r)
        assert db.add_many(records[60:]) == 60
        db.add(records[0])  # an exact duplicate is not stored twice
        assert len(db) == 120
    with TuningDB(path) as db:  # reopened: everything persisted
        assert db.records() == records
        for w in sorted({r.workload_key for r in records}):
            for t in (None, "cpu-a", "cpu-b"):
                subset = [r for r in records if r.workload_key == w and t in (None, r.target_key)]
                assert db.records(w, t) == subset
                ok = [r for r in subset if r.ok]
                expected = min(ok, key=lambda r: r.latency_s) if ok else None
                assert db.best(w, t) == expected
        expected_rows = []
        for w in sorted({r.workload_key for r in records}):
            mine = [r for r in records if r.workload_key == w]
            expected_rows.append((w, len(mine), min(r.latency_s for r in mine)))
        assert db.workloads() == expected_rows
        assert db.best("no-such-workload") is None


def test_best_uses_median_and_skips_failed(tmp_path):
    with TuningDB(tmp_path / "t.db") as db:
        db.add(make_record("w", latencies=(5e-3, 1e-3, 9e-3)))  # median 5 ms, min 1 ms
        db.add(make_record("w", latencies=(3e-3, 4e-3, 2e-3)))  # median 3 ms
        db.add(make_record("w", latencies=(), error="timeout"))
        db.add(make_record("only_failed", latencies=(), error="wrong result"))
        assert db.best("w").latencies_s == (3e-3, 4e-3, 2e-3)
        assert db.best("only_failed") is None
        assert dict((k, (n, b)) for k, n, b in db.workloads())["only_failed"] == (1, math.inf)


def test_profiles_upsert_and_persist(tmp_path):
    path = tmp_path / "t.db"
    with TuningDB(path) as db:
        assert db.get_profile("collective", "all_reduce/x") is None
        db.put_profile("collective", "all_reduce/x", {"alpha_s": 1e-5, "beta_s_per_byte": 1e-9})
        db.put_profile("collective", "all_reduce/x", {"alpha_s": 2e-5, "beta_s_per_byte": 1e-9})
        db.put_profile("stage", "s0", {"time_s": 0.25, "peak_bytes": 123})
    with TuningDB(path) as db:
        assert db.get_profile("collective", "all_reduce/x") == {"alpha_s": 2e-5, "beta_s_per_byte": 1e-9}
        assert db.profiles("stage") == {"s0": {"time_s": 0.25, "peak_bytes": 123}}
        assert db.get_profile("stage", "all_reduce/x") is None


def test_bad_records_are_refused_with_the_field_named(tmp_path):
    with TuningDB(tmp_path / "t.db") as db:
        with pytest.raises(ValueError, match="latencies_s"):
            db.add(make_record("w", latencies=(float("nan"),)))
        with pytest.raises(TypeError, match="task"):
            db.add(make_record("w", task={"f": object()}))
        with pytest.raises(TypeError, match="workload_key"):
            db.add(make_record(""))
        assert len(db) == 0


def test_default_path_honours_env_and_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("AUTOPAR_TUNING_DB", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_db_path() == tmp_path / "cache" / "autopar" / "tuning.db"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert default_db_path() == pathlib.Path.home() / ".cache" / "autopar" / "tuning.db"
    monkeypatch.setenv("AUTOPAR_TUNING_DB", str(tmp_path / "x.db"))
    assert default_db_path() == tmp_path / "x.db"
    with TuningDB() as db:
        assert db.path == tmp_path / "x.db"
        db.add(make_record("w"))
    assert (tmp_path / "x.db").exists()


def test_file_is_marked_as_ours_in_wal_mode(tmp_path):
    path = tmp_path / "t.db"
    TuningDB(path).close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


# ---- several processes -------------------------------------------------------------------

WRITER = """
import os, sys, time
from search.database import TuningDB
from search.record import TuningRecord
proc, n, path, go = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
db = TuningDB(path)          # all writers create the same new file at once
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.005)
for i in range(n):
    db.add(TuningRecord(f"w{proc}", {}, "cpu", {}, [{"kind": "pragma", "stage": "C", "auto_unroll_max_step": i}],
                        (1e-3 * (i + 1),)))
db.close()
print("done", flush=True)
"""


def test_concurrent_writers_lose_nothing(tmp_path):
    path, go = tmp_path / "shared.db", tmp_path / "go"
    n_procs, n = 3, 150
    procs = [run_child(WRITER, str(p), str(n), str(path), str(go)) for p in range(n_procs)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        go.touch()  # release all writers together
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    with TuningDB(path) as db:
        got = sorted((r.workload_key, r.schedule[0]["auto_unroll_max_step"]) for r in db.records())
    assert got == sorted((f"w{p}", i) for p in range(n_procs) for i in range(n))


KILLED_WRITER = """
import sys
from search.database import TuningDB
from search.record import TuningRecord
db = TuningDB(sys.argv[1])
for i in range(1_000_000):
    db.add(TuningRecord("w", {}, "cpu", {}, [{"kind": "pragma", "stage": "C", "auto_unroll_max_step": i}], (1e-3,)))
    print(i + 1, flush=True)
"""


def test_killed_writer_keeps_every_record_reported(tmp_path):
    path, k = tmp_path / "killed.db", 40
    proc = run_child(KILLED_WRITER, str(path))
    try:
        reported = 0
        while reported < k:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            reported = int(line)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    with TuningDB(path) as db:
        got = [r.schedule[0]["auto_unroll_max_step"] for r in db.records()]
        assert len(got) >= k and got == list(range(len(got)))  # a prefix, nothing torn
        db.add(make_record("after-kill"))  # still writable
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()


# ---- files that are not ours -------------------------------------------------------------


def _random_bytes(path):
    path.write_bytes(random.Random(1).randbytes(8192))


def _sqlite_magic_then_garbage(path):
    path.write_bytes(b"SQLite format 3\x00" + random.Random(2).randbytes(8176))


def _foreign_sqlite(path):
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO users (name) VALUES ('ada')")
    conn.commit()
    conn.close()


def _foreign_application_id(path):
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA application_id = 1234")
    conn.execute("CREATE TABLE records (x)")
    conn.commit()
    conn.close()


def _truncated_ours(path):
    with TuningDB(path) as db:
        db.add(make_record("w"))
    path.write_bytes(path.read_bytes()[:60])


@pytest.mark.parametrize(
    "make_file, message",
    [
        (_random_bytes, "not an SQLite file"),
        (_sqlite_magic_then_garbage, "not a readable autopar tuning database"),
        (_foreign_sqlite, "another application"),
        (_foreign_application_id, "another application"),
        (_truncated_ours, "not an SQLite file"),
    ],
)
def test_foreign_or_corrupt_file_is_refused_and_untouched(tmp_path, make_file, message):
    path = tmp_path / "tuning.db"
    make_file(path)
    before = path.read_bytes()
    with pytest.raises(TuningDBError, match=message) as info:
        TuningDB(path)
    assert str(path) in str(info.value) and "--db" in str(info.value)
    assert path.read_bytes() == before
    assert db_command.run(argparse.Namespace(db_command="list", db=str(path), target=None)) == 2
    assert path.read_bytes() == before


def test_newer_schema_asks_to_upgrade_and_is_untouched(tmp_path):
    path = tmp_path / "tuning.db"
    with TuningDB(path) as db:
        db.add(make_record("w"))
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    with pytest.raises(TuningDBError, match="Upgrade autopar"):
        TuningDB(path)
    assert path.read_bytes() == before


def test_missing_file_with_create_false(tmp_path):
    with pytest.raises(TuningDBError, match="no tuning database"):
        TuningDB(tmp_path / "absent.db", create=False)
    assert not (tmp_path / "absent.db").exists()


# ---- JSON lines ----------------------------------------------------------------------------


def test_export_import_round_trip(tmp_path):
    records = random_records(random.Random(3), 50)
    with TuningDB(tmp_path / "a.db") as a:
        a.add_many(records)
        a.put_profile("stage", "s", {"time_s": 1.0})
        assert a.export_jsonl(tmp_path / "out.jsonl") == 50
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert [TuningRecord.from_json(line) for line in lines] == records
    with TuningDB(tmp_path / "b.db") as b:
        assert b.import_jsonl(tmp_path / "out.jsonl") == ImportReport(added=50, duplicates=0)
        assert b.import_jsonl(tmp_path / "out.jsonl") == ImportReport(added=0, duplicates=50)
        assert b.records() == records
        assert b.export_jsonl(tmp_path / "again.jsonl") == 50
    assert (tmp_path / "again.jsonl").read_bytes() == (tmp_path / "out.jsonl").read_bytes()


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "JSON object"),
        ('{"workload_key": "w"}', "missing fields"),
        (json.dumps({**json.loads(make_record("w").to_json()), "latencies_s": "fast"}), "latencies_s"),
        (json.dumps({**json.loads(make_record("w").to_json()), "task": 3}), "task"),
    ],
)
def test_bad_jsonl_line_names_line_and_imports_nothing(tmp_path, bad_line, message):
    good = [make_record(f"w{i}").to_json() for i in range(4)]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(good[:2] + [""] + [bad_line] + good[2:]) + "\n")
    with TuningDB(tmp_path / "t.db") as db:
        db.add(make_record("existing"))
        with pytest.raises(TuningDBError, match=f"line 4: .*{message}"):
            db.import_jsonl(src)
        assert [r.workload_key for r in db.records()] == ["existing"]


def test_failed_export_leaves_existing_file(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("precious\n")
    with TuningDB(tmp_path / "t.db") as db:
        db.add(make_record("w", task={"n": 1}))
        with pytest.raises(TuningDBError):
            db.export_jsonl(tmp_path / "no-such-dir" / "x.jsonl")
        db.close()
        with pytest.raises(TuningDBError, match="closed"):
            db.export_jsonl(out)
    assert out.read_text() == "precious\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


# ---- CLI -----------------------------------------------------------------------------------


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="autopar db")
    db_command.add_arguments(parser)
    return db_command.run(parser.parse_args(argv))


def test_cli_list_show_export_import(tmp_path, capsys):
    path = str(tmp_path / "t.db")
    flops = 2 * 128**3
    with TuningDB(path) as db:
        db.add(make_record("matmul_128_fp32", latencies=(4e-3, 2e-3, 3e-3), task={"flops": flops}))
        db.add(make_record("matmul_128_fp32", latencies=(), error="timeout", task={"flops": flops}))
        db.add(make_record("softmax_1024", latencies=(1e-5,), task={"rows": 1024},
                           schedule=[{"kind": "annotate", "stage": "out", "iter": "j", "ann": "vectorize"}]))
    assert run_cli(["list", "--db", path]) == 0
    out = capsys.readouterr().out
    assert "matmul_128_fp32" in out and "softmax_1024" in out
    assert f"{flops / 3e-3 / 1e9:.2f}" in out  # GFLOP/s at the 3 ms median

    assert run_cli(["--db", path, "show", "softmax"]) == 0  # a unique prefix works
    out = capsys.readouterr().out
    assert "softmax_1024" in out and 'annotate(ann="vectorize", iter="j", stage="out")' in out

    assert run_cli(["show", "conv2d", "--db", path]) == 1
    assert "no workload 'conv2d'" in capsys.readouterr().err

    assert run_cli(["export", str(tmp_path / "x.jsonl"), "--db", path]) == 0
    assert "exported 3 records" in capsys.readouterr().out
    new = str(tmp_path / "new.db")
    assert run_cli(["import", str(tmp_path / "x.jsonl"), "--db", new]) == 0
    assert "imported 3 new records" in capsys.readouterr().out
    with TuningDB(new) as a, TuningDB(path) as b:
        assert a.records() == b.records()

    (tmp_path / "bad.jsonl").write_text("{oops\n")
    assert run_cli(["import", str(tmp_path / "bad.jsonl"), "--db", new]) == 1
    assert "line 1" in capsys.readouterr().err

    assert run_cli(["list", "--db", str(tmp_path / "absent.db")]) == 2
    assert "no tuning database" in capsys.readouterr().err
    assert not (tmp_path / "absent.db").exists()


def test_cli_shows_gflops_of_records_made_by_tune(tmp_path, capsys):
    """tune's records carry the task ({op, params, dtype}), not its FLOPs: the CLI counts them
    from the task's compute definition, and GFLOP/s = FLOPs / the best latency shown."""
    from search import Task, tune
    from search.measure import MeasureOptions

    task = Task.matmul(32, 32, 32)
    path = str(tmp_path / "t.db")
    fast = MeasureOptions(repeats=3, min_time_s=0.0, num_threads=1)    # one thread: us, not scheduler ticks
    tune(task, trials=2, db=path, batch_size=2, measure_options=fast, policy="random", transfer=False)
    with TuningDB(path) as db:
        best = db.best(task.workload_key)
    assert "flops" not in best.task and task.flops == 2 * 32**3
    gflops = f"{task.flops / best.latency_s / 1e9:.2f}"
    assert run_cli(["list", "--db", path]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if task.workload_key in line)
    cells = [c.strip() for c in row.split("│")[1:-1]]
    # no planned step compared this workload with XLA's code: those two columns are empty
    assert cells == [task.workload_key, "2", db_command._format_seconds(best.latency_s), gflops, "-", "-"]
    assert run_cli(["show", task.workload_key, "--db", path]) == 0
    assert any(line.split() == ["GFLOP/s", gflops] for line in capsys.readouterr().out.splitlines())
