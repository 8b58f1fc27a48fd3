"""PNG of a simulation: one lane per stream, and an SM-occupancy heat map.

Top panel: one horizontal lane per stream; each kernel is a bar from its first block's
dispatch to its last block's end (compute kernels in grey shades by kind, collectives
coloured by kind). Bottom panel (when the simulation ran with ``record=True``): SM index
against time, coloured by the fraction of the SM in use (the largest of its thread,
register, shared-memory and block fractions).
"""

from __future__ import annotations

__all__ = ["plot", "COLLECTIVE_COLORS"]

COLLECTIVE_COLORS = {
  "all-gather": "#1f77b4",
  "reduce-scatter": "#d62728",
  "all-reduce": "#9467bd",
  "all-to-all": "#ff7f0e",
  "collective-permute": "#2ca02c",
}
_COMPUTE_COLORS = {
  "gemm": "#555555",
  "custom": "#7f7f7f",
  "fusion": "#aaaaaa",
  "reduction": "#999999",
  "copy": "#cccccc",
  "other": "#bbbbbb",
}


def _pyplot():
  try:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
  except ImportError:
    raise ImportError(
      "jax_overlap.sim.plot needs matplotlib: pip install 'jax_overlap[plot]'"
    ) from None
  return plt


def plot(result, path: str, *, title: str | None = None, max_labels: int = 40) -> str:
  """Writes ``result``'s timeline and occupancy heat map to a PNG.

  Args:
    result: a SimResult (run with ``record=True`` for the heat map).
    path: output file name.
    title: figure title (default: target, policy and makespan).
    max_labels: label kernels with their names when there are at most this many.

  Returns:
    ``path``.

  Raises:
    ImportError: naming the ``jax_overlap[plot]`` extra when matplotlib is missing.
  """
  plt = _pyplot()
  from matplotlib.patches import Patch

  heat = result.occupancy is not None
  fig, axes = plt.subplots(
    2 if heat else 1,
    1,
    figsize=(12, 7 if heat else 3.5),
    sharex=True,
    squeeze=False,
    gridspec_kw={"height_ratios": [1, 2]} if heat else None,
  )
  ax = axes[0][0]
  scale = 1e3
  streams = sorted({t.stream for t in result.timings})
  lane = {s: i for i, s in enumerate(streams)}
  for t in result.timings:
    color = COLLECTIVE_COLORS.get(t.kind) if t.is_collective else _COMPUTE_COLORS.get(t.kind)
    y = lane[t.stream]
    ax.barh(
      y,
      (t.end_s - t.start_s) * scale,
      left=t.start_s * scale,
      height=0.6,
      color=color,
      edgecolor="black",
      linewidth=0.3,
    )
    if len(result.timings) <= max_labels:
      ax.text(
        (t.start_s + t.end_s) / 2 * scale,
        y,
        t.name,
        ha="center",
        va="center",
        fontsize=6,
        clip_on=True,
      )
  ax.set_yticks(range(len(streams)))
  ax.set_yticklabels([f"stream {s}" for s in streams])
  ax.invert_yaxis()
  kinds = sorted({t.kind for t in result.timings if t.is_collective})
  if kinds:
    ax.legend(
      handles=[Patch(color=COLLECTIVE_COLORS[k], label=k) for k in kinds],
      loc="upper right",
      fontsize=7,
    )
  ax.set_title(
    title or f"{result.target} / {result.policy}: makespan {result.makespan_s * 1e3:.3f} ms"
  )
  if heat:
    import numpy as np

    hx = axes[1][0]
    edges = np.append(result.occupancy_times, result.makespan_s) * scale
    occ = result.occupancy
    mesh = hx.pcolormesh(
      edges, np.arange(occ.shape[1] + 1), occ.T, cmap="viridis", vmin=0, vmax=1, shading="flat"
    )
    hx.set_ylabel("SM")
    fig.colorbar(mesh, ax=[ax, hx], label="SM in use (fraction)", fraction=0.03, pad=0.01)
    hx.set_xlabel("time (ms)")
  else:
    ax.set_xlabel("time (ms)")
  if not heat:
    fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
