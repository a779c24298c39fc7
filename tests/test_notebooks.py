"""Every notebook in notebooks/ is stored clean (nbformat 4 JSON, without outputs) and runs top to
bottom: its code cells executed in order, in one namespace, the way a kernel would (no notebook
runner needed), with matplotlib on the headless Agg backend. What a notebook checks is its own
business: each has assert cells, and a failing assert fails its test."""
import ast
import json
import pathlib
import re
import time

import matplotlib
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
MAX_OUTPUT_CHARS = 10_000          # stored outputs, per notebook: none, or a few lines


def code_cells(path: pathlib.Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_clean(path):
    nb = json.loads(path.read_text())
    assert nb["nbformat"] == 4 and isinstance(nb.get("nbformat_minor"), int) and isinstance(nb["metadata"], dict)
    outputs = 0
    for n, cell in enumerate(nb["cells"]):
        assert cell["cell_type"] in ("code", "markdown", "raw"), n
        assert isinstance(cell["metadata"], dict) and isinstance(cell["source"], (str, list)), n
        if cell["cell_type"] == "code":
            assert isinstance(cell["outputs"], list) and "execution_count" in cell, n
            outputs += len(json.dumps(cell["outputs"]))
    assert outputs <= MAX_OUTPUT_CHARS, f"{path.name}: clear its outputs before committing (Edit > Clear All Outputs)"
    if nb["nbformat_minor"] >= 5:                     # nbformat 4.5: every cell has a unique id
        ids = [c.get("id") for c in nb["cells"]]
        assert all(isinstance(i, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", i) for i in ids), ids
        assert len(set(ids)) == len(ids), ids


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_passes_its_checks(path):
    cells = code_cells(path)
    asserts = sum(isinstance(node, ast.Assert) for source in cells for node in ast.walk(ast.parse(source)))
    assert asserts, f"{path.name} checks nothing: give it assert cells"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    namespace = {"__name__": "__main__"}
    t0 = time.perf_counter()
    try:
        for n, source in enumerate(cells):
            exec(compile(source, f"{path.name}[cell {n}]", "exec"), namespace)
    finally:
        plt.close("all")
        namespace.clear()
    print(f"{path.name}: {len(cells)} code cells, {asserts} asserts, {time.perf_counter() - t0:.1f} s")
