"""Every notebook in notebooks/ runs top to bottom (its code cells executed in order, in one
namespace, the way a kernel would; no notebook runner needed)."""
import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, capsys):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert cells
    namespace = {"__name__": "__main__"}
    for n, cell in enumerate(cells):
        source = "".join(cell["source"])
        exec(compile(source, f"{path.name}[cell {n}]", "exec"), namespace)
    out = capsys.readouterr().out
    assert "stage 0" in out and "nan" not in out.lower()
