"""The runtime plan of a choice the simulator made: which kernels to cap, and whether the
communication streams run at the highest priority, as rules the runtime library applies
to the kernels it launches (matched by the names the driver reports)."""

from __future__ import annotations

from collections.abc import Mapping

from jax_overlap._src.runtime import plan as plan_lib
from jax_overlap._src.sim import engine
from jax_overlap._src.sim.model import Kernel, Workload

__all__ = ["glob_escape", "launch_name", "plan_dict", "plan_json", "unnamed_kernels"]


def plan_dict(
  target,
  shaping: Mapping[str, int],
  priority: bool,
  workload: Workload | None = None,
  comm: plan_lib.CommBlock | None = None,
) -> dict:
  """The runtime plan for a shaping/priority choice, validated by the runtime's plan format.

  Args:
    target: the GPU target.
    shaping: workload kernel name -> blocks per SM.
    priority: communication at the highest stream priority.
    workload: the workload the names refer to; its kernels' ``launch_name`` (the
      name the driver reports) is what the plan's rules match. Kernels sharing a
      launch name get one rule, with the smallest cap.
    comm: the communication block the caps were chosen to make room for (the plan's
      ``comm_block``); None: ``"auto"``.

  Returns:
    The plan's JSON form (``runtime.Plan.from_json`` reads it); validated on NVIDIA
    targets, the only ones the runtime library runs on.

  Raises:
    ValueError: when the runtime's plan format rejects it, or a shaped kernel has
      no name a rule could match.
  """
  topo = engine.resolve_target(target)
  d = plan_json("sim.plan_dict", topo, shaping, priority, workload, comm)
  if topo.gpu.vendor == "nvidia":
    plan_lib.Plan.from_json(d)  # raises on anything the runtime library would reject
  return d


def plan_json(api: str, topo, shaping, priority, workload, comm) -> dict:
  """The runtime plan's JSON form for a choice, not yet validated."""
  items = {it.name: it for it in (workload.items if workload is not None else ())}
  caps: dict[str, int] = {}
  for name, cap in shaping.items():
    it = items.get(name)
    rule = launch_name(it) if isinstance(it, Kernel) else name
    if not rule:
      raise ValueError(
        f"{api}: kernel {name!r} has no launch name (a library call): no plan rule can select it"
      )
    caps[rule] = min(int(cap), caps.get(rule, int(cap)))
  return {
    "version": 1,
    "target": topo.gpu.name,
    "kernels": [{"match": glob_escape(k), "blocks_per_sm": v} for k, v in sorted(caps.items())],
    "streams": {"priority": "highest" if priority else "default"},
    "comm_block": comm.to_dict() if comm is not None else "auto",
  }


def launch_name(item: Kernel) -> str:
  """The name a plan rule uses for ``item``: its driver name, else its workload name."""
  return item.name if item.launch_name is None else item.launch_name


def unnamed_kernels(wl: Workload) -> tuple[str, ...]:
  """Kernels no plan rule can select: the driver name is unknown (library calls)."""
  return tuple(it.name for it in wl.items if isinstance(it, Kernel) and it.launch_name == "")


def glob_escape(name: str) -> str:
  """``name`` as an fnmatch pattern that matches exactly it."""
  return "".join(f"[{c}]" if c in "*?[" else c for c in name)
