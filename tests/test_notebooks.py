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
def test_notebook_runs(path, tmp_path, monkeypatch):
  # The kernel takes the suite's CPU setting (cpu_setting.py) from an IPython startup file.
  startup = tmp_path / "ipython" / "profile_default" / "startup"
  startup.mkdir(parents=True)
  tests = os.path.dirname(os.path.abspath(__file__))
  (startup / "00_cpu_setting.py").write_text(
    f"import sys\nsys.path.insert(0, {tests!r})\nimport cpu_setting\ncpu_setting.install()\n"
    "sys.path.remove(sys.path[0])\n"
  )
  monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
  nb = nbformat.read(path, as_version=4)
  # Last, a cell that says whether the kernel compiled its CPU programs with the setting.
  check = nbformat.v4.new_code_cell(
    "import inspect\nfrom jax._src import compiler as _c\n"
    "print(hasattr(_c.get_compile_options, '__wrapped__') or "
    "'backend' not in inspect.signature(_c.get_compile_options).parameters)"
  )
  nb.cells.append(check)
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
  if os.environ.get("JAX_OVERLAP_TEST_CPU_OPT") != "1":
    assert check.outputs[0]["text"].strip() == "True", "the kernel missed the CPU setting"
