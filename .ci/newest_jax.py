"""Prints the newest jax release the package index serves this interpreter with a CUDA
plugin of the same version.

jax loads a jax-cuda13-plugin (and its jax-cuda13-pjrt) only when its version is jaxlib's
(jaxlib/plugin_support.py: it warns and leaves a plugin of another version unused), and
the plugin's releases do not follow jaxlib's one for one (jaxlib 0.12.0.1 and a plugin
0.12.1 with no jaxlib 0.12.1, say). The newest version all four packages are served in
is the one ``make test-jax JAX=latest`` installs. Asks the index with pip, for this
interpreter (``python .ci/newest_jax.py``).
"""

import re
import subprocess
import sys

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt")


def served(package: str) -> set[str]:
  """The versions of ``package`` the index serves this interpreter (``pip index``)."""
  out = subprocess.run(
    [sys.executable, "-m", "pip", "index", "versions", package],
    capture_output=True,
    text=True,
    check=False,
  )
  m = re.search(r"^Available versions: (.*)$", out.stdout, re.M)
  if m is None:
    sys.exit(f"newest_jax: pip served no versions of {package}: {out.stderr.strip()[-400:]}")
  return {v.strip() for v in m.group(1).split(",") if v.strip()}


def key(version: str) -> tuple[int, ...]:
  """A release's order: its numbers (0.12.0.1 after 0.12.0)."""
  return tuple(int(n) for n in re.findall(r"\d+", version))


def main() -> None:
  common = set.intersection(*(served(p) for p in PACKAGES))
  releases = [v for v in common if not re.search(r"(a|b|rc|dev)\d*", v)]
  if not releases:
    sys.exit(f"newest_jax: no version is served for all of {', '.join(PACKAGES)}")
  print(max(releases, key=key))


if __name__ == "__main__":
  main()
