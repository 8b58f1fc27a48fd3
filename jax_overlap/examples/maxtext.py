"""MaxText's own train step under @jax_overlap.overlap.

Builds the train step exactly as MaxText's ahead-of-time compiler does
(``maxtext.trainers.pre_train.train_compile``): the configuration from MaxText's
``base.yml`` and a model file through ``pyconfig``, the state and batch shapes from
``train_compile.get_shaped_inputs``, the step and its shardings from
``maxtext_utils.get_functional_train_with_signature``, on a mesh from
``maxtext_utils.create_device_mesh``: for a GPU target the target's compile-only devices
(no GPU needed), otherwise the local devices. The default configuration is Llama 2 7B's
layer (hidden 4096, MLP 11008, 32 heads) with 2 layers, FSDP over every device, one
sequence of 2048 per device, scanned and rematerialised layers, AdamW, bf16.

Needs MaxText (Python 3.12 or later; ``pip install 'jax_overlap[maxtext]'``).

``build()`` is a ``jax-overlap analyze`` builder::

    jax-overlap analyze jax_overlap.examples.maxtext:build --target h100x8

and the module prints the comparison (the step as written under XLA's defaults, and
under ``@overlap`` with the time its selection took)::

    python -m jax_overlap.examples.maxtext --target h100x8 --layers 2
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

__all__ = [
  "DEFAULTS",
  "require",
  "config",
  "build",
  "build_local",
  "shard_map_form",
  "compare",
  "main",
]

# MaxText's train step in the configuration of the repository's FSDP benchmarks: Llama 2
# 7B's layer, one sequence of 2048 per device, scanned layers rematerialised in full.
DEFAULTS: dict[str, Any] = {
  "model_name": "llama2-7b",
  # The model file sets the layer count; the overrides here and the caller's win.
  "override_model_config": True,
  "base_num_decoder_layers": 2,
  "per_device_batch_size": 1,
  "max_target_length": 2048,
  "scan_layers": True,
  "remat_policy": "full",
  "opt_type": "adamw",
  "hardware": "gpu",
  # XLA's attention (MaxText's "autoselected" picks a TPU kernel or cuDNN's on GPUs).
  "attention": "dot_product",
  "dataset_type": "synthetic",
  "enable_checkpointing": False,
  "skip_jax_distributed_system": True,
  "log_config": False,  # MaxText logs every configuration key otherwise
  # MaxText's default (~/jax_cache) turns on JAX's persistent compilation cache for the whole
  # process; JAX cannot read a deviceless compile back from it (it warns and compiles
  # again), and jax_overlap keeps its compiles in a store of its own.
  "jax_cache_dir": "",
  "run_name": "jax_overlap",
}


def require():
  """Imports MaxText's modules the step is built with, or says how to install them."""
  if sys.version_info < (3, 12):
    raise ImportError(
      "MaxText needs Python 3.12 or later (this is "
      f"{sys.version_info.major}.{sys.version_info.minor})"
    )
  try:
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train, train_compile
    from maxtext.utils import maxtext_utils, sharding
  except ImportError as e:
    raise ImportError(
      f"this example needs MaxText ({e.name} is missing): pip install 'jax_overlap[maxtext]'"
    ) from None
  return pyconfig, train, train_compile, maxtext_utils, sharding


def config(num_devices: int, **overrides):
  """MaxText's configuration (``pyconfig.initialize`` on its ``base.yml``) for
  ``num_devices`` devices: :data:`DEFAULTS`, then ``overrides`` (any key of MaxText's
  ``base.yml``, e.g. ``base_num_decoder_layers=8``, ``ici_tensor_parallelism=8``).

  FSDP takes the devices no other ``ici_*_parallelism`` override takes. MaxText sizes the
  global batch by ``num_devices`` (its own device count for a compile elsewhere). As MaxText
  does, this sets ``XLA_FLAGS`` to its HLO dump settings when the variable is unset.
  """
  import maxtext.configs

  pyconfig, *_ = require()
  settings = {**DEFAULTS, "internal_compile": True, "internal_compile_num_devices": num_devices}
  if not any(k.startswith("ici_") and k.endswith("_parallelism") for k in overrides):
    settings["ici_fsdp_parallelism"] = num_devices
  settings.update(overrides)
  base = os.path.join(os.path.dirname(maxtext.configs.__file__), "base.yml")
  return pyconfig.initialize(["", base], **settings)


def _step_and_shapes(cfg, devices, donate: bool):
  """MaxText's train step (jitted, with its shardings) and its abstract arguments on a mesh
  of ``devices``, as ``train_compile`` builds them; and MaxText's mesh."""
  import jax
  from flax.core.spmd import logical_axis_rules
  from jax.sharding import AxisType, Mesh

  _, train, train_compile, maxtext_utils, sharding = require()
  mesh = Mesh(
    maxtext_utils.create_device_mesh(cfg, devices),
    cfg.mesh_axes,
    axis_types=(AxisType.Auto,) * len(cfg.mesh_axes),
  )
  args, _, state_shardings, _, graphdef = train_compile.get_shaped_inputs(mesh, cfg)
  params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
    cfg, state_shardings
  )
  input_state_shardings = sharding.build_zero1_input_state_mesh_shardings(
    cfg, state_shardings, params_shardings
  )
  data_sharding = sharding.get_input_data_sharding(cfg, mesh)
  fn, in_shardings, out_shardings, _, donate_argnums = (
    maxtext_utils.get_functional_train_with_signature(
      train.train_step, data_sharding, input_state_shardings, graphdef, cfg, params_shardings
    )
  )
  rules = cfg.logical_axis_rules
  abstract_mesh = mesh.abstract_mesh

  # train_compile traces the step inside `jax.set_mesh(mesh)` and MaxText's logical axis
  # rules; the step carries both, so that any later trace (each of @overlap's variants, a
  # compile for another target) sees them. Inside a trace only the abstract mesh can be set.
  def train_step(state, batch):
    with jax.sharding.use_abstract_mesh(abstract_mesh), logical_axis_rules(rules):
      return fn(state, batch)

  step = jax.jit(
    train_step,
    in_shardings=in_shardings,
    out_shardings=out_shardings,
    donate_argnums=donate_argnums if donate else (),
  )
  return step, args, mesh


def build(target: str = "h100x8", *, donate: bool = True, **overrides):
  """Builder for ``jax-overlap analyze``: MaxText's jitted train step and its abstract
  arguments ``(state, batch)`` on ``target``'s compile-only devices.

  Args:
    target: an NVIDIA topology such as ``"h100x8"``.
    donate: donate the state, as MaxText does.
    **overrides: MaxText configuration keys (see :func:`config`).

  Returns:
    ``(step, (state, batch))``, the arguments ``jax.ShapeDtypeStruct``s with shardings.

  Example:
    >>> step, args = build("h100x8", base_num_decoder_layers=8)  # doctest: +SKIP
    >>> print(jax_overlap.analyze(step, *args, target="h100x8"))  # doctest: +SKIP
  """
  from jax_overlap._src import targets as targets_lib

  devices = targets_lib.compile_only_devices(target)
  cfg = config(len(devices), **overrides)
  step, args, _ = _step_and_shapes(cfg, devices, donate)
  return step, args


def build_local(*, seed: int = 0, donate: bool = True, **overrides):
  """MaxText's train step on the local devices (8 CPU devices in the tests) with a real
  state, initialised as MaxText's training loop does when it restores no checkpoint
  (``maxtext_utils.setup_initial_state``), and a batch of random tokens.

  Args:
    seed: the parameters' and the tokens' seed.
    donate: donate the state, as MaxText does.
    **overrides: MaxText configuration keys (see :func:`config`).

  Returns:
    ``(step, (state, batch))`` with arrays sharded as MaxText shards them.
  """
  import jax
  import numpy as np
  from flax import nnx
  from flax.core.spmd import logical_axis_rules
  from maxtext.common import train_state_nnx
  from maxtext.optimizers import optimizers
  from maxtext.utils import model_creation_utils

  *_, maxtext_utils, _ = require()
  devices = jax.devices()
  cfg = config(len(devices), **overrides)
  step, (state, batch), mesh = _step_and_shapes(cfg, devices, donate)
  # train_compile.get_shaped_inputs's train state, made concrete.
  create_model, model = model_creation_utils.create_nnx_abstract_model(
    cfg, mesh, rng_key=jax.random.key(seed)
  )
  schedule = maxtext_utils.create_learning_rate_schedule(cfg)
  tx = optimizers.get_optimizer(cfg, schedule, model, mesh=mesh)

  def init_state():
    model = create_model()
    return nnx.state(train_state_nnx.TrainStateNNX(model, nnx.Optimizer(model, tx, wrt=nnx.Param)))

  shardings = jax.tree.map(lambda a: a.sharding, state)
  with logical_axis_rules(cfg.logical_axis_rules):
    real_state = jax.jit(init_state, out_shardings=shardings)()
  shape = batch["inputs"].shape
  tokens = np.random.default_rng(seed).integers(1, cfg.vocab_size, (shape[0], shape[1] + 1))
  fields = {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "inputs_position": np.broadcast_to(np.arange(shape[1]), shape),
    "inputs_segmentation": np.ones(shape),
  }
  fields["targets_position"] = fields["inputs_position"]
  fields["targets_segmentation"] = fields["inputs_segmentation"]
  real_batch = {
    k: jax.device_put(np.asarray(fields[k], np.int32), v.sharding) for k, v in batch.items()
  }
  return step, (real_state, real_batch)


def shard_map_form(step, args):
  """The step converted to one ``shard_map`` as ``@overlap`` converts it (the program its
  variants named "shard_map form" rewrite), as written: ``(jitted function, its arguments
  as abstract arrays, the conversion's record)``; the state's leaves count as parameters,
  as ``@overlap``'s ``params_argnums=(0,)`` has them."""
  import jax

  from jax_overlap._src.transform import arguments, out_layouts, to_shard_map

  traced = step.trace(*args)
  closed = traced.jaxpr
  leaves = jax.tree.leaves(args)
  avals = arguments.abstract_leaves(
    leaves, closed.jaxpr.invars, getattr(traced, "_params", {}).get("in_shardings")
  )
  converted = to_shard_map.convert(
    closed,
    avals,
    out_layouts.partitioner_choice(traced),
    params_leaves=range(len(jax.tree.leaves(args[0]))),
  )
  return jax.jit(converted.fn), avals, converted


def compare(target: str = "h100x8", *, workload: str = "fsdp", **overrides) -> dict:
  """MaxText's step analysed for ``target`` as written (under XLA's defaults, and under the
  recommended flags), in its shard_map form as written (:func:`shard_map_form`, the
  recommended flags) and under ``@overlap`` (its selection timed, with no cached choice; the
  compiles it makes are kept in jax_overlap's compile store, so time it with an empty one).

  Args:
    target: an NVIDIA topology such as ``"h100x8"``.
    workload: the workload of the recommended flags (``"fsdp"``, ``"tensor_parallel"``, ...).
    **overrides: MaxText configuration keys (see :func:`config`).

  Returns:
    ``{"reports": {name: Report}, "selection_s": seconds, "chosen": variant name,
    "explanation": the decorated step's explain()}``.
  """
  import jax_overlap

  step, args = build(target, **overrides)
  # The selection first, so that it finds none of the analyses' compiles in the store.
  decorated = jax_overlap.overlap(step, target=target, cache=False)
  t0 = time.perf_counter()
  explanation = decorated.explain(*args)
  selection_s = time.perf_counter() - t0
  recommended = jax_overlap.flags.as_compiler_options(target=target, workload=workload)
  converted, converted_args, _ = shard_map_form(step, args)
  reports = {
    "XLA defaults": jax_overlap.analyze(step, *args, target=target, name="XLA defaults"),
    "recommended flags": jax_overlap.analyze(
      step, *args, target=target, name="recommended flags", xla_options=recommended
    ),
    "shard_map form": jax_overlap.analyze(
      converted, *converted_args, target=target, name="shard_map form", xla_options=recommended
    ),
    "@overlap": jax_overlap.analyze(decorated, *args, target=target, name="@overlap"),
  }
  return {
    "reports": reports,
    "selection_s": selection_s,
    "chosen": explanation.chosen,
    "explanation": explanation,
  }


def main(argv) -> None:
  from absl import app, flags

  import jax_overlap

  del argv
  FLAGS = flags.FLAGS
  overrides: dict[str, Any] = {"base_num_decoder_layers": FLAGS.layers}
  for item in FLAGS.override:
    key, sep, value = item.partition("=")
    if not sep:
      raise app.UsageError(f"--override must look like key=value, got {item!r}")
    overrides[key] = _parse(value)
  result = compare(FLAGS.target, workload=FLAGS.workload, **overrides)
  print(jax_overlap.compare(result["reports"]))
  print(f"chosen: {result['chosen']} (selection took {result['selection_s']:.0f} s)")


def _parse(value: str):
  """A command-line value as MaxText's own command line reads it (a YAML scalar)."""
  import yaml

  return yaml.safe_load(value)


def _define_flags() -> None:
  from absl import flags

  flags.DEFINE_string("target", "h100x8", "NVIDIA topology to compile for (no GPU needed).")
  flags.DEFINE_integer("layers", 2, "Decoder layers (MaxText's base_num_decoder_layers).")
  flags.DEFINE_string("workload", "fsdp", "Workload of the recommended flags.")
  flags.DEFINE_multi_string(
    "override",
    [],
    "MaxText configuration key=value (repeatable), e.g. ici_tensor_parallelism=8.",
  )


if __name__ == "__main__":
  from absl import app

  _define_flags()
  app.run(main)
