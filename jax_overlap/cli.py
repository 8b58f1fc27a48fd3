"""The ``jax-overlap`` command.

  jax-overlap flags --target h100x8 --workload fsdp     # prints an export XLA_FLAGS=... line
  jax-overlap flags --check "<XLA_FLAGS string>"        # every problem; exit 1 if any error
  jax-overlap targets                                   # the GPU catalogue
  jax-overlap analyze MODULE:BUILDER --target h100x8 [--xla-option k=v ...]
                      [--plot out.png] [--json out.json] [--perfetto out.json]
  jax-overlap calibrate MODULE:BUILDER [--steps 10]     # kernel costs measured on this GPU
  jax-overlap simulate [--paper] ...                    # SM-level simulator
  jax-overlap launch [--plan plan.json] -- python train.py ...

Bad input gets a one-line error naming the bad token and the valid choices, and
exit status 2 (usage) or 1 (problems found); nothing raises a traceback.
"""

from __future__ import annotations

import importlib
import shlex
import sys
from collections.abc import Sequence

from absl import flags as absl_flags

COMMANDS = ("flags", "targets", "analyze", "calibrate", "simulate", "launch")

FLAGS = absl_flags.FLAGS


def _define_flags() -> None:
  """Defines the command's flags, each once: the module may be imported twice under -m,
  and a module imported before it (a benchmark, an example) may have defined --target."""

  def define(kind, name, *args, **kwargs):
    if name not in FLAGS:
      getattr(absl_flags, f"DEFINE_{kind}")(name, *args, **kwargs)
    else:  # defined elsewhere first: still listed by usage()
      absl_flags.declare_key_flag(name)

  define("string", "target", "h100x8", "Topology or GPU, e.g. h100x8, a100x8, h200x16.")
  define("string", "workload", "fsdp", "Workload: fsdp, tensor_parallel, data_parallel or hybrid.")
  define("string", "check", None, "An XLA_FLAGS string to check instead of recommending.")
  define("enum", "format", "export", ["export", "json", "table"], "Output format.")
  define(
    "multi_string",
    "xla-option",
    [],
    "XLA option for analyze, as name=value (repeatable).",
    short_name="X",
  )
  define("string", "plot", None, "analyze: write a timeline PNG here.")
  define("string", "json", None, "analyze: write the report as JSON here.")
  define("string", "perfetto", None, "analyze: write a Perfetto/Chrome trace here.")
  define("boolean", "recommended", False, "analyze: also apply the target's recommended options.")
  define("integer", "steps", 10, "calibrate: steps timed (3 more are profiled).")
  define(
    "boolean",
    "environment",
    False,
    "analyze: also judge CUDA_DEVICE_MAX_CONNECTIONS and NCCL_MAX_CTAS on this step (simulated).",
  )


class UsageError(Exception):
  """Bad command-line input; the message is printed as one line."""


def _fail(msg: str, code: int = 2) -> int:
  print(f"jax-overlap: error: {msg}", file=sys.stderr)
  return code


def _check_target_and_workload() -> None:
  """Unknown --target / --workload are bad input (exit 2), found before any work."""
  from jax_overlap._src import flags as flags_lib
  from jax_overlap._src import targets as targets_lib

  try:
    targets_lib.get(FLAGS.target)
    flags_lib.check_workload(FLAGS.workload)
  except (ValueError, TypeError) as e:
    raise UsageError(str(e).splitlines()[0]) from None


def _check_output_paths(*names: str) -> None:
  """Output files must be writable file paths; found before a long analysis, not after."""
  import os

  for name in names:
    path = FLAGS[name].value
    if path is None:
      continue
    if os.path.isdir(path):
      raise UsageError(
        f"--{name} {path} is a directory; give a file path such as {os.path.join(path, 'out.' + ('png' if name == 'plot' else 'json'))}"
      )
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
      raise UsageError(f"--{name} {path}: directory {parent} does not exist")


def _cmd_flags(args: Sequence[str]) -> int:
  from jax_overlap._src import flags as flags_lib

  if args:
    raise UsageError(f"flags takes no positional arguments, got {' '.join(args)!r}")
  _check_target_and_workload()
  if FLAGS.check is not None:
    problems = flags_lib.validate(FLAGS.check)
    if not problems:
      print("ok: no problems found")
      return 0
    for p in problems:
      print(p)
    return 1 if any(p.severity == "error" for p in problems) else 0
  opts = flags_lib.recommended(target=FLAGS.target, workload=FLAGS.workload)
  xla = {k: v for k, v in opts.items() if flags_lib.REGISTRY[k].kind == "xla"}
  env = {k: v for k, v in opts.items() if flags_lib.REGISTRY[k].kind == "env"}
  if FLAGS.format == "json":
    import dataclasses
    import json

    judged = [
      {**dataclasses.asdict(v), "gain": v.gain, "recommended": v.recommended, "why": v.why}
      for v in _judged()
    ]
    print(json.dumps({"xla_flags": xla, "env": env, "judged": judged}, indent=2, default=str))
    return 0
  if FLAGS.format == "table":
    verdicts = {(v.name, v.value): v for v in _judged()}
    for k, v in opts.items():
      judged = verdicts.get((k, flags_lib.format_value(v)))
      why = judged.why if judged else flags_lib.REGISTRY[k].why or flags_lib.REGISTRY[k].meaning
      print(f"{k} = {flags_lib.format_value(v)}\n    {why}")
    _print_left_out(opts)
    _print_not_set(opts, verdicts.values())
    return 0
  print(f"export XLA_FLAGS={shlex.quote(flags_lib.format_xla_flags(xla))}")
  for k, v in env.items():
    print(f"export {k}={shlex.quote(flags_lib.format_value(v))}")
  return 0


def _judged():
  from jax_overlap._src import flags as flags_lib

  return flags_lib.judge_environment(target=FLAGS.target, workload=FLAGS.workload)


def _print_not_set(opts, verdicts) -> None:
  """The environment settings judged and not recommended, and why."""
  from jax_overlap._src import flags as flags_lib

  for v in verdicts:
    if flags_lib.format_value(opts.get(v.name, "")) != v.value:
      print(f"# not set: {v.name} = {v.value}\n    {v.why}")


def _print_left_out(opts) -> None:
  """The recommendation's options the installed jaxlib does not get, and why."""
  import jaxlib

  from jax_overlap._src import flags as flags_lib
  from jax_overlap._src.flags import aborts

  full = flags_lib.recommended(target=FLAGS.target, workload=FLAGS.workload, check_installed=False)
  spellings = {k for k in opts} | {flags_lib.REGISTRY[k].replacement for k in opts}
  for k, v in full.items():
    if k in spellings or any(flags_lib.REGISTRY[o].replacement == k for o in opts):
      continue
    aborted, message = aborts.aborts(k)
    why = (
      f"jaxlib {jaxlib.__version__}'s XLA aborts the process compiling programs with a "
      f"while loop with it ({message})"
      if aborted
      else f"jaxlib {jaxlib.__version__} does not take it"
    )
    print(f"# left out: {k} = {flags_lib.format_value(v)}\n    {why}")


def _cmd_targets(args: Sequence[str]) -> int:
  from jax_overlap._src import targets as targets_lib

  if args:
    raise UsageError(f"targets takes no positional arguments, got {' '.join(args)!r}")
  header = (
    f"{'name':8} {'description':30} {'SMs':>4} {'smem/SM':>8} {'bf16 TF':>8} "
    f"{'HBM GB/s':>9} {'link':>16} {'GB/s/dir':>8} {'deviceless':>10}"
  )
  print(header)
  print("-" * len(header))
  for name in targets_lib.names():
    g = targets_lib.GPUS[name]
    print(
      f"{g.name:8} {g.description:30} {g.sm_count:>4} {g.smem_per_sm // 1024:>6}KB "
      f"{g.peak_bf16_flops / 1e12:>8.1f} {g.memory_bandwidth / 1e9:>9.0f} {g.link:>16} "
      f"{g.link_bandwidth / 1e9:>8.0f} {'yes' if g.deviceless else 'no':>10}"
    )
  print("\nTopologies: <gpu>x<count>, e.g. h100x8 (one host of 8), h200x16 (two hosts of 8).")
  return 0


def _load_builder(spec: str):
  if ":" not in spec:
    raise UsageError(
      f"expected MODULE:BUILDER (e.g. jax_overlap.examples.fsdp_mlp:build), got {spec!r}"
    )
  mod_name, fn_name = spec.split(":", 1)
  try:
    mod = importlib.import_module(mod_name)
  except ImportError as e:
    raise UsageError(f"cannot import module {mod_name!r}: {e}") from None
  builder = getattr(mod, fn_name, None)
  if builder is None or not callable(builder):
    raise UsageError(f"module {mod_name!r} has no callable {fn_name!r}")
  return builder


def _their_mesh(args):
  """The mesh a builder's arrays lie on, where its axes are Explicit and no mesh is set: the
  step runs under it, as its own script would run it (``with jax.set_mesh(mesh):``, which
  a bare PartitionSpec in the step needs)."""
  import contextlib

  import jax

  from jax_overlap._src.compile import retarget

  meshes = retarget.meshes_in(args)
  if meshes and retarget.has_explicit_axes(meshes[0]) and retarget.context_mesh() is None:
    return jax.set_mesh(meshes[0])
  return contextlib.nullcontext()


def _parse_options(items: Sequence[str]) -> dict[str, str]:
  out = {}
  for item in items:
    if "=" not in item:
      raise UsageError(f"--xla-option expects name=value, got {item!r}")
    k, v = item.split("=", 1)
    out[k.strip().lstrip("-")] = v.strip()
  return out


def _cmd_analyze(args: Sequence[str]) -> int:
  if len(args) != 1:
    raise UsageError("analyze expects exactly one MODULE:BUILDER argument")
  _check_target_and_workload()
  _check_output_paths("json", "perfetto", "plot")
  builder = _load_builder(args[0])
  from jax_overlap._src import flags as flags_lib
  from jax_overlap._src.analysis import analyze as analysis

  options: dict = {}
  if FLAGS.recommended:
    options.update(flags_lib.as_compiler_options(target=FLAGS.target, workload=FLAGS.workload))
  given = _parse_options(FLAGS["xla-option"].value)
  if given:
    # A misspelt or malformed option is the user's: said as a usage error, before any
    # compile (XLA would refuse it with a RuntimeError of its own).
    errors = [p for p in flags_lib.validate(given) if p.severity == "error"]
    if errors:
      raise UsageError("; ".join(f"--xla-option {p.name}: {p.message}" for p in errors))
  options.update(given)
  built = builder()
  if not (isinstance(built, tuple) and len(built) == 2):
    raise UsageError(f"{args[0]} must return (fn, args), got {type(built).__name__}")
  fn, fn_args = built
  with _their_mesh(fn_args):
    report = analysis.analyze(fn, *fn_args, target=FLAGS.target, xla_options=options or None)
  print(report)
  if FLAGS.environment:
    print("Environment settings judged on this step:")
    for v in flags_lib.judge_environment(report):
      print(f"  {v.why}")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      f.write(report.to_json())
    print(f"wrote {FLAGS.json}")
  if FLAGS.perfetto:
    report.to_perfetto(FLAGS.perfetto)
    print(f"wrote {FLAGS.perfetto}")
  if FLAGS.plot:
    report.plot(FLAGS.plot)
    print(f"wrote {FLAGS.plot}")
  return 0


def _cmd_calibrate(args: Sequence[str]) -> int:
  """Runs a step on the local GPU, fits the kernel costs to it and stores the calibration
  that analyze and @overlap then use for that GPU."""
  if len(args) != 1:
    raise UsageError("calibrate expects exactly one MODULE:BUILDER argument")
  if FLAGS.steps < 1:
    raise UsageError(f"--steps must be at least 1, got {FLAGS.steps}")
  builder = _load_builder(args[0])
  import jax

  from jax_overlap._src.analysis import calibration

  if jax.devices()[0].platform != "gpu":
    raise UsageError(
      f"calibrate runs the step on a GPU; this machine's devices are {jax.devices()[0].platform}"
    )
  built = builder()
  if not (isinstance(built, tuple) and len(built) == 2):
    raise UsageError(f"{args[0]} must return (fn, args), got {type(built).__name__}")
  fn, fn_args = built
  with _their_mesh(fn_args):
    cal = calibration.calibrate(fn, *fn_args, name=args[0], steps=FLAGS.steps)
  print(cal.describe())
  print(f"wrote {calibration.path(cal.gpu, cal.jaxlib)}")
  return 0


def _delegate(module: str, argv: Sequence[str]) -> int:
  try:
    mod = importlib.import_module(module)
  except ImportError as e:
    return _fail(f"this installation lacks {module}: {e}", 1)
  return int(mod.main(list(argv)) or 0)


def main(argv: Sequence[str]) -> int:
  args = list(argv[1:])
  if not args:
    return _fail(f"missing command; choose one of {', '.join(COMMANDS)}")
  cmd, rest = args[0], args[1:]
  try:
    if cmd == "flags":
      return _cmd_flags(rest)
    if cmd == "targets":
      return _cmd_targets(rest)
    if cmd == "analyze":
      return _cmd_analyze(rest)
    if cmd == "calibrate":
      return _cmd_calibrate(rest)
    return _fail(f"unknown command {cmd!r}; choose one of {', '.join(COMMANDS)}")
  except UsageError as e:
    return _fail(str(e))
  except (ValueError, TypeError, ImportError) as e:
    return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__, 1)
  except Exception as e:  # noqa: BLE001 - a CLI prints one line, not a traceback
    from jax_overlap._src.errors import ConfigError

    if isinstance(e, ConfigError):
      return _fail(str(e), 1)
    return _fail(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", 1)


def run() -> None:
  """Console-script entry point."""
  argv = sys.argv
  _define_flags()
  # Commands that pass the rest of the line through parse their own arguments.
  if len(argv) > 1 and argv[1] == "launch":
    sys.exit(_delegate("jax_overlap._src.runtime.launch", argv[2:]))
  if len(argv) > 1 and argv[1] == "simulate":
    sys.exit(_delegate("jax_overlap._src.sim.cli", argv[2:]))
  if any(a == "-h" or (a.startswith("-") and a.lstrip("-").startswith("help")) for a in argv[1:]):
    print(usage())
    sys.exit(0)
  try:
    rest = FLAGS(argv)
  except absl_flags.Error as e:
    sys.exit(_fail(str(e).splitlines()[0]))
  sys.exit(main(rest))


def usage() -> str:
  """What ``jax-overlap --help`` prints: the commands and the flags of ``flags``,
  ``targets`` and ``analyze`` (``simulate --help`` and ``launch --help`` list their own)."""
  _define_flags()
  lines = [__doc__.strip().replace("``", ""), "", "Flags of flags, targets and analyze:"]
  for flag in sorted(FLAGS.get_key_flags_for_module(sys.modules[__name__]), key=lambda f: f.name):
    default = "" if flag.default is None else f" (default: {flag.default_as_str})"
    lines.append(f"  --{flag.name}: {flag.help}{default}")
  return "\n".join(lines)


if __name__ == "__main__":
  run()
