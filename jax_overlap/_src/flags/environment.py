"""Environment settings judged by the simulator: one hardware queue, NCCL's channel cap.

``CUDA_DEVICE_MAX_CONNECTIONS`` and ``NCCL_MAX_CTAS`` cannot be set per compile and change
how the GPU dispatches a step's kernels, not what XLA compiles. Whether they pay depends on
the step, so each is judged by simulating a step with and without it under XLA's own
policy (its collective streams at the highest priority), with the dispatch rules measured on
an H200 (:mod:`jax_overlap.sim`'s engine):

* ``CUDA_DEVICE_MAX_CONNECTIONS=1``: every stream in one hardware queue, in launch order
  (``sim.Policy(single_queue=True)``). A collective launched before a GEMM reaches the SMs
  first, also where both waited for the same kernel (on Hopper, where it would otherwise wait
  behind cuBLAS's persistent GEMM); one launched after a kernel waits until that kernel's
  last blocks are placed, and anything waiting for an event holds back every launch behind
  it.
* ``NCCL_MAX_CTAS=c`` (the communicator's channel cap; XLA's
  ``xla_gpu_nccl_collective_max_nchannels`` sets the same per compile): each collective on
  ``min(c, NCCL's default)`` channels: fewer SMs taken beside the compute, each collective
  slower below the link's rate. Caps at or above the default change nothing and are not
  judged.

A setting is recommended where it makes the simulated step at least :data:`GAIN` faster.
The verdicts are the simulator's figures, not measurements: ``Verdict.why`` says so, and
names the step they were computed on. :func:`judge` takes the user's own step (an analysis
report from ``jax_overlap.analyze``); without one it judges a representative step of the
workload (:func:`representative`), which is what :func:`~.configuration.recommended`
(and ``jax-overlap flags``) recommends from.

NCCL's CTA policy (``ncclConfig_t.CTAPolicy``, NCCL 2.27 and later) is set by XLA on its
communicators itself; no jaxlib option reaches it, so it is not judged here.
"""

from __future__ import annotations

import dataclasses
import functools

from jax_overlap._src import targets as targets_lib
from jax_overlap._src.flags.registry import WORKLOADS, Workload

__all__ = ["GAIN", "Verdict", "representative", "judge", "paying", "environment"]

# The least simulated gain for which a setting is recommended (below it the model's own
# error decides).
GAIN = 0.02
# NCCL channel caps judged (those below the target's default channel count).
CHANNEL_CAPS = (16, 8, 4, 2)


@dataclasses.dataclass(frozen=True)
class Verdict:
  """One environment setting judged on one step.

  Attributes:
    name: the variable (``CUDA_DEVICE_MAX_CONNECTIONS``, ``NCCL_MAX_CTAS``).
    value: its value, as it would be exported.
    step_s: the simulated step with it.
    baseline_s: the simulated step without it (XLA's policy as launched).
    step: what was simulated (the user's step or the representative one, and the target).
  """

  name: str
  value: str
  step_s: float
  baseline_s: float
  step: str

  @property
  def gain(self) -> float:
    """The fraction of the step the setting saves (negative: it costs)."""
    return 1.0 - self.step_s / self.baseline_s if self.baseline_s > 0 else 0.0

  @property
  def recommended(self) -> bool:
    return self.gain >= GAIN

  @property
  def why(self) -> str:
    if self.recommended:
      verdict = "pays"
    elif self.gain > 0:
      verdict = f"gains under {GAIN:.0%}"
    else:
      verdict = "does not pay"
    return (
      f"{self.name}={self.value} {verdict}: simulated step {self.baseline_s * 1e3:.3f} -> "
      f"{self.step_s * 1e3:.3f} ms ({-self.gain:+.1%}) on {self.step} "
      f"(the simulator's figure, not a measurement; recommended from {GAIN:.0%} faster)"
    )


def representative(topo: targets_lib.Topology, workload: Workload):
  """The step a workload's settings are judged on without the user's own: (sim workload,
  its description). FSDP and hybrid: a 4-layer bf16 FSDP transformer step (width 4096,
  4096 tokens per device, prefetched all-gathers, per-layer reduce-scatters) over every
  device; data parallel: the same step with per-layer gradient all-reduces and no gathers;
  tensor parallel: six 8192 x 8192 x 8192 GEMMs, each output reduce-scattered over a host's
  GPUs while the next one runs."""
  from jax_overlap._src.sim import model, workloads

  if workload == "tensor_parallel":
    group = topo.gpus_per_host
    wl = workloads.tp_chain(6, 8192, 8192, group_size=group)
    return wl, f"six 8192^3 GEMMs with reduce-scatters over {group} GPUs ({topo.name})"
  step = workloads.transformer_step(4, 4096, 4096, group_size=topo.num_devices)
  if workload != "data_parallel":
    return step, f"a 4-layer FSDP transformer step, width 4096 ({topo.name})"
  items = []
  for it in step.items:
    if isinstance(it, model.Collective) and it.kind == "all-gather":
      continue
    if isinstance(it, model.Collective):
      it = dataclasses.replace(it, kind="all-reduce")
    after = tuple(a for a in it.after if not a.startswith(("ag.", "agb.")))
    items.append(dataclasses.replace(it, after=after))
  wl = model.Workload(tuple(items), f"dp_{step.name}")
  return wl, f"a 4-layer data-parallel transformer step, width 4096 ({topo.name})"


def judge(report=None, *, target="h100x8", workload: Workload = "fsdp") -> list[Verdict]:
  """Each environment setting (module docstring) judged on a step.

  Args:
    report: the user's step, an analysis report (``jax_overlap.analyze(...)``; its own
      target is used), or a ``jax_overlap.sim.Workload``; None for the representative step
      of ``workload`` on ``target``.
    target: topology name (for a workload or the representative step).
    workload: see ``jax_overlap.flags.WORKLOADS`` (for the representative step).

  Returns:
    One :class:`Verdict` per setting, in the order of the module docstring.

  Raises:
    ValueError: for an unknown target or workload.
    TypeError: if ``report`` is neither a report nor a sim workload.
  """
  from jax_overlap._src.sim import model, policies, realize

  if workload not in WORKLOADS:
    raise ValueError(f"unknown workload {workload!r}; valid choices: {', '.join(WORKLOADS)}")
  if report is None or isinstance(report, model.Workload):
    topo = targets_lib.get(target)
    wl, step = (
      representative(topo, workload) if report is None else (report, f"{report.name} ({topo.name})")
    )
  elif hasattr(report, "kernels") and hasattr(report, "collectives"):
    topo = realize.target_of(report)
    wl, step = realize.workload_from_report(report), f"this step ({topo.name})"
  else:
    raise TypeError(
      "jax_overlap.flags.judge: report must be an analysis Report (jax_overlap.analyze), a "
      f"jax_overlap.sim.Workload or None, got {type(report).__name__}"
    )
  const = model.constants_for(topo.gpu)
  xla = policies.Policy("priority", priority=True)

  def step_s(w, policy=xla) -> float:
    return policies.simulate(w, target=topo, policy=policy, baseline=False).makespan_s

  base = step_s(wl)
  out = []
  if topo.gpu.vendor == "nvidia":  # a CUDA variable (HIP's queues are GPU_MAX_HW_QUEUES)
    one_queue = policies.Policy("one queue", priority=True, single_queue=True)
    out.append(Verdict("CUDA_DEVICE_MAX_CONNECTIONS", "1", step_s(wl, one_queue), base, step))
  for cap in CHANNEL_CAPS:
    if cap < const.channels:
      capped = realize.with_channels(wl, cap, topo, const)
      out.append(Verdict("NCCL_MAX_CTAS", str(cap), step_s(capped), base, step))
  return out


def paying(verdicts: list[Verdict]) -> list[Verdict]:
  """The verdicts that pay, the best value of each variable (one channel cap)."""
  best: dict[str, Verdict] = {}
  for v in verdicts:
    if v.recommended and (v.name not in best or v.step_s < best[v.name].step_s):
      best[v.name] = v
  return list(best.values())


@functools.lru_cache(maxsize=64)
def environment(topo: targets_lib.Topology, workload: str) -> tuple[tuple[str, str], ...]:
  """The settings the representative step of ``workload`` on ``topo`` gains from: the
  best channel cap that pays, and one queue where it pays."""
  return tuple((v.name, v.value) for v in paying(judge(target=topo, workload=workload)))
