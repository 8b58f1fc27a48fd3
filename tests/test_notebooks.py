"""Executes every tutorial notebook, so a broken notebook fails the suite."""

import glob
import os

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "notebooks", "*.ipynb")))


def test_there_are_notebooks():
  names = [os.path.basename(p) for p in NOTEBOOKS]
  assert names[:4] == [
    "01_quickstart.ipynb",
    "02_schedule_analysis.ipynb",
    "03_occupancy_and_priority.ipynb",
    "04_budgets.ipynb",
  ]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path):
  nb = nbformat.read(path, as_version=4)
  client = NotebookClient(
    nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
  )
  client.execute()
  errors = [
    o
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.get("outputs", [])
    if o.get("output_type") == "error"
  ]
  assert errors == []
