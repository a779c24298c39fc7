"""Plan.summary(): the plan as text tables, the same in a terminal and in Jupyter."""
import rich.console
import rich.jupyter

from autopar.plan import Plan, StagePlan, TensorPlan


def _plan() -> Plan:
    x = TensorPlan("args[0]", (64, 128), "float32", (("data",), ()))
    stage = StagePlan((2, 4), ("data", "model"), tuple(range(8)), (x,), (x,), predicted_time_s=1.5e-3,
                      memory_bytes=3 * 2**20, solver_status="optimal")
    return Plan("auto", "f(x)", {}, (stage,))


def test_summary_is_text_in_a_terminal():
    text = _plan().summary()
    assert "2x4" in text and "args[0]" in text and "(data, *)" in text and "1.500 ms" in text


def test_summary_in_jupyter_returns_the_same_text_and_displays_nothing(monkeypatch):
    """rich's Console detects Jupyter and displays its tables itself, writing nothing to its file."""
    terminal = _plan().summary()
    shown = []
    monkeypatch.setattr(rich.console, "_is_jupyter", lambda: True)
    monkeypatch.setattr(rich.jupyter, "display", lambda *args: shown.append(args))
    monkeypatch.setenv("JUPYTER_COLUMNS", "80")
    assert rich.console.Console().is_jupyter                # the detection is simulated
    assert _plan().summary() == terminal
    assert shown == []
