"""Kernel build directories: a killed tuning run's directory is removed when the next one
starts, a live run's never is, and one without a lock file (an older autopar's) is left alone."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile

from search.backend import CBackend
from search.build_dirs import LOCK, PREFIX, remove_stale_build_dirs

REPO = pathlib.Path(__file__).resolve().parents[1]
OWNER = """
import sys, time
from search.build_dirs import make_build_dir
print(make_build_dir(sys.argv[1])[0], flush=True)
time.sleep(600)
"""


def owner(parent: pathlib.Path) -> tuple[subprocess.Popen, pathlib.Path]:
    """A process that made a build directory in `parent` and keeps running."""
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(parent)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    return proc, pathlib.Path(proc.stdout.readline().strip())


def test_only_directories_of_dead_runs_are_removed(tmp_path):
    live, live_dir = owner(tmp_path)
    killed, killed_dir = owner(tmp_path)
    legacy = tmp_path / (PREFIX + "from_an_older_autopar")
    legacy.mkdir()
    (killed_dir / "k1.c").write_text("int x;")
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert (killed_dir / LOCK).exists() and live_dir.exists()
        assert remove_stale_build_dirs(str(tmp_path)) == [str(killed_dir)]
        assert not killed_dir.exists() and live_dir.exists() and legacy.exists()
    finally:
        live.kill()
        live.wait()
    assert remove_stale_build_dirs(str(tmp_path)) == [str(live_dir)]  # its owner is gone now
    assert legacy.exists()


def test_a_new_backend_sweeps_the_temp_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    killed, killed_dir = owner(tmp_path)
    killed.kill()
    killed.wait()
    backend = CBackend()
    mine = pathlib.Path(backend.workdir)
    assert not killed_dir.exists() and mine.parent == tmp_path and (mine / LOCK).exists()
    assert remove_stale_build_dirs(str(tmp_path)) == []  # this backend's is live
    backend.close()
    assert not mine.exists()
