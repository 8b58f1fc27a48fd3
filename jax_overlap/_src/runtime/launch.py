"""``jax-overlap launch``: run a program with the runtime library and a plan.

  jax-overlap launch [--plan plan.json] [--verbose] [--no-command-buffers |
                     --keep-command-buffers] [--dry-run] \\
      -- python train.py args...

validates the plan, prepends ``libjax_overlap_rt.so`` to ``LD_PRELOAD`` (keeping
the entries already there), exports ``JAX_OVERLAP_RT_PLAN`` (the plan file) and
``JAX_OVERLAP_RT_RULES`` (the compiled rules the library reads), and replaces
itself with the command (``os.execvpe``). Without ``--plan`` the library is
loaded but changes nothing: it only counts launches.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Mapping

from jax_overlap._src.flags import syntax
from jax_overlap._src.runtime import library as runtime
from jax_overlap._src.runtime.plan import Plan

__all__ = ["main", "launch_environment"]

_PROG = "jax-overlap launch"
# XLA flag that turns off command buffers (CUDA graphs): with it empty, every
# kernel is launched by cuLaunchKernel on the thread that runs the thunk.
NO_COMMAND_BUFFERS_FLAG = "--xla_gpu_enable_command_buffer="


COMMAND_BUFFER_OPTION = "xla_gpu_enable_command_buffer"


def _set_xla_flag(flags: str, name: str, value: str) -> str:
  """Sets one XLA flag in an ``XLA_FLAGS`` value, keeping the others as XLA reads them.

  Tokens are cut and re-quoted the way XLA's own parser reads them, so a user's
  ``--xla_dump_to="/tmp/a b"`` survives.
  """
  tokens = [t for t in syntax.read_xla_flags(flags).tokens if t.name != name]
  kept = [
    t.text if t.name is None or t.value is None else syntax.format_token(t.name, t.value)
    for t in tokens
  ]
  return " ".join([*kept, syntax.format_token(name, value)])


def command_buffers_off(
  plan: Plan | None, no_command_buffers: bool | None, environ: Mapping[str, str]
) -> tuple[bool, str]:
  """Whether the command runs with XLA's command buffers off, and why.

  A plan with occupancy regions needs them off: a command buffer (CUDA graph) is
  recorded once, before any region thunk runs, so its kernels would never see
  the region's policy. ``None`` decides automatically: off for such a plan,
  unless ``XLA_FLAGS`` already sets the option (the user's choice is kept).
  """
  if no_command_buffers is not None:
    return bool(no_command_buffers), "asked for" if no_command_buffers else ""
  if plan is None or not plan.regions:
    return False, ""
  user = syntax.parse_xla_flags(environ.get("XLA_FLAGS", ""))[0]
  if COMMAND_BUFFER_OPTION in user:
    return False, ""
  return True, (
    f"the plan has occupancy regions, and kernels recorded in command buffers (CUDA graphs) "
    f"would not see them: command buffers off ({NO_COMMAND_BUFFERS_FLAG}); "
    "--keep-command-buffers keeps them"
  )


def launch_environment(
  plan: Plan | None,
  *,
  plan_path: str | None = None,
  library: str | os.PathLike | None = None,
  verbose: bool = False,
  no_command_buffers: bool | None = None,
  environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
  """The environment ``jax-overlap launch`` runs the command with.

  Args:
    plan: validated plan, or None to only load the library.
    plan_path: the plan's file, exported as JAX_OVERLAP_RT_PLAN.
    library: runtime library path (default: built or found by ``library_path``).
    verbose: print counters at exit and warnings (JAX_OVERLAP_RT_VERBOSE=1 at least).
    no_command_buffers: add ``--xla_gpu_enable_command_buffer=`` to XLA_FLAGS;
      None (default): when the plan has occupancy regions and XLA_FLAGS does
      not set that option (see :func:`command_buffers_off`).
    environ: base environment (default: ``os.environ``).
  """
  env = dict(os.environ if environ is None else environ)
  lib = os.path.abspath(os.fspath(library or runtime.library_path(runtime.RUNTIME_LIBRARY)))
  preload = [p for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
  preload = [lib] + [p for p in preload if os.path.abspath(p) != lib]
  env["LD_PRELOAD"] = ":".join(preload)
  env.pop(runtime.RULES_ENV, None)
  env.pop(runtime.PLAN_ENV, None)
  if plan is not None:
    env[runtime.RULES_ENV] = plan.to_rules()
    if plan_path is not None:
      env[runtime.PLAN_ENV] = os.path.abspath(plan_path)
  if verbose:
    level = env.get(runtime.VERBOSE_ENV, "")
    if not level.isdigit() or int(level) < 1:
      env[runtime.VERBOSE_ENV] = "1"
  if command_buffers_off(plan, no_command_buffers, env)[0]:
    env["XLA_FLAGS"] = _set_xla_flag(env.get("XLA_FLAGS", ""), COMMAND_BUFFER_OPTION, "")
  return env


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog=_PROG,
    description="Run a command with the jax_overlap runtime library (occupancy shaping, "
    "stream priority) preloaded.",
  )
  p.add_argument("--plan", help="runtime plan (JSON, version 1)")
  p.add_argument("--verbose", action="store_true", help="print the library's counters at exit")
  cb = p.add_mutually_exclusive_group()
  cb.add_argument(
    "--no-command-buffers",
    dest="no_command_buffers",
    action="store_const",
    const=True,
    default=None,
    help=f"add {NO_COMMAND_BUFFERS_FLAG} to XLA_FLAGS so that every launch reaches the library "
    "(the default when the plan has occupancy regions)",
  )
  cb.add_argument(
    "--keep-command-buffers",
    dest="no_command_buffers",
    action="store_const",
    const=False,
    help="keep XLA's command buffers even for a plan with occupancy regions",
  )
  p.add_argument(
    "--dry-run", action="store_true", help="print the environment and command; do not run it"
  )
  p.add_argument("command", nargs=argparse.REMAINDER, help="-- command args...")
  return p


def main(argv: list[str]) -> int:
  """Entry point of ``jax-overlap launch`` (``argv`` excludes the word "launch").

  Returns:
    An exit status when the command is not run (errors, ``--dry-run``); on
    success the process is replaced by the command and this does not return.
  """
  parser = _parser()
  try:
    args = parser.parse_args(argv)
  except SystemExit as e:  # argparse already printed the message
    return int(e.code or 0)
  command = list(args.command)
  if command and command[0] == "--":
    command = command[1:]
  if not command:
    print(
      f"{_PROG}: error: no command given; usage: {_PROG} [--plan plan.json] -- cmd args...",
      file=sys.stderr,
    )
    return 2
  plan = None
  if args.plan is not None:
    if os.path.isdir(args.plan):
      print(
        f"{_PROG}: error: --plan {args.plan} is a directory; expected a plan JSON file "
        "(jax_overlap.sim.tune(...).plan.to_json(path))",
        file=sys.stderr,
      )
      return 2
    try:
      plan = Plan.from_json(args.plan)
    except (OSError, ValueError, TypeError) as e:
      print(f"{_PROG}: error: invalid plan {args.plan}: {e}", file=sys.stderr)
      return 2
  off, why = command_buffers_off(plan, args.no_command_buffers, os.environ)
  if off and args.no_command_buffers is None:
    print(f"{_PROG}: {why}", file=sys.stderr)
  try:
    env = launch_environment(
      plan,
      plan_path=args.plan,
      verbose=args.verbose,
      no_command_buffers=off,
    )
  except RuntimeError as e:
    print(f"{_PROG}: error: {e}", file=sys.stderr)
    return 1
  if args.verbose or args.dry_run:
    changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
    for k in sorted(changed):
      print(f"{_PROG}: {k}={shlex.quote(changed[k])}", file=sys.stderr)
    print(f"{_PROG}: exec {shlex.join(command)}", file=sys.stderr)
  if args.dry_run:
    return 0
  sys.stdout.flush()
  sys.stderr.flush()
  try:
    os.execvpe(command[0], command, env)
  except OSError as e:
    print(f"{_PROG}: error: cannot run {command[0]!r}: {e}", file=sys.stderr)
    return 127
  return 0  # not reached
