"""`autopar tune`: shape parsing, bad input, and a tiny run that lands in the tuning DB."""
import argparse

import pytest

from autopar.commands import tune as tune_cmd
from search import Task
from search.database import TuningDB


def test_parse_task_maps_shapes_to_tasks():
    assert tune_cmd.parse_task("matmul", "512,256,128", None) == Task.matmul(512, 256, 128)
    assert tune_cmd.parse_task("dense", "8,16,4", "gelu") == Task.dense(8, 16, 4, "gelu")
    assert tune_cmd.parse_task("dense", "8,16,4", None) == Task.dense(8, 16, 4, "relu")
    assert tune_cmd.parse_task("conv2d", "1,8,8,3,4,3,3,2,1", None) == Task.conv2d(1, 8, 8, 3, 4, 3, 3, 2, 1)
    with pytest.raises(ValueError, match="M,N,K"):
        tune_cmd.parse_task("matmul", "512,512", None)
    with pytest.raises(ValueError, match="integers"):
        tune_cmd.parse_task("softmax", "a,b", None)
    with pytest.raises(ValueError, match="epilogue"):
        tune_cmd.parse_task("softmax", "4,4", "gelu")


def _args(tmp_path, **kw):
    p = argparse.ArgumentParser()
    tune_cmd.add_arguments(p)
    argv = ["--task", kw.get("task", "softmax"), "--shape", kw.get("shape", "4,16"), "--trials",
            str(kw.get("trials", 4)), "--batch-size", "4", "--db", str(tmp_path / "db.sqlite")]
    return p.parse_args(argv)


def test_cli_run_tunes_and_stores_records(tmp_path, capsys):
    assert tune_cmd.run(_args(tmp_path)) == 0
    assert "GFLOP/s" in capsys.readouterr().out
    with TuningDB(str(tmp_path / "db.sqlite")) as db:
        assert len(db.records(Task.softmax(4, 16).workload_key)) == 4


def test_cli_reports_bad_shapes_with_exit_code_2(tmp_path, capsys):
    assert tune_cmd.run(_args(tmp_path, shape="4")) == 2
    assert "softmax takes M,N" in capsys.readouterr().err


def test_cli_no_transfer_reaches_tune(tmp_path, monkeypatch):
    import search

    seen = {}
    real = search.tune

    def spy(*a, **kw):
        seen["transfer"] = kw.get("transfer")
        return real(*a, **kw)

    monkeypatch.setattr(search, "tune", spy)
    p = argparse.ArgumentParser()
    tune_cmd.add_arguments(p)
    base = ["--task", "softmax", "--shape", "4,16", "--trials", "4", "--batch-size", "4",
            "--db", str(tmp_path / "db.sqlite")]
    assert tune_cmd.run(p.parse_args(base + ["--no-transfer"])) == 0 and seen["transfer"] is False
    assert tune_cmd.run(p.parse_args(base)) == 0 and seen["transfer"] is True


def test_ctrl_c_keeps_every_measured_record(tmp_path):
    """Ctrl-C reaches the whole foreground process group. It used to print the runner's
    KeyboardInterrupt traceback and lose the batch being measured."""
    import os
    import pathlib
    import signal
    import subprocess
    import sys
    import time

    db_path = tmp_path / "db.sqlite"
    repo = pathlib.Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "autopar.cli", "tune", "--task", "softmax", "--shape", "64,256", "--trials", "200",
         "--batch-size", "16", "--db", str(db_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=dict(os.environ, PYTHONPATH=str(repo)))
    try:
        seen, deadline = 0, time.monotonic() + 120
        while seen < 5 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            if db_path.exists():
                with TuningDB(str(db_path)) as db:
                    seen = len(db)
        assert seen >= 5, proc.stderr.read()
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    kept = int(err.split("interrupted; ")[1].split(" records kept")[0])
    with TuningDB(str(db_path)) as db:  # records are stored one by one, not per batch of 16
        assert len(db) == kept >= seen
