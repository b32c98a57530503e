"""The notebooks in notebooks/ run top to bottom (each in its own kernel) and show what they claim."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ["compose_pipeline", "replay_rollouts", "profile_stages", "plan_cluster"]


def execute(name: str):
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    # the cells assert their own claims (replay == recording, a custom stage's rewards, ...): a failing
    # assert raises CellExecutionError here
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    return nb


def outputs(nb, kind: str) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if kind in o.get("data", {})]


# The notebooks run in the slow tier (50-70 s each here): what they show is tested in the default
# tier by test_readme.py (the composition example), test_replay.py and test_profile.py.
@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name):
    nb = execute(name)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors
    assert outputs(nb, "text/html"), "every notebook shows at least one table"
    if name == "profile_stages":
        assert len(outputs(nb, "image/png")) >= 3       # timelines, bubbles/throughput, staleness/queues
