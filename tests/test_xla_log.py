"""XLA's latency-profile lines kept off stderr, everything else passed through."""

import os
import threading

from jax_overlap._src.compile import xla_log

_FOUND = "W1205 05:51:51.774645 19773 profile_guided_latency_estimator.cc:192] Found 402 instructions from the profile.\n"
_MISSING = "W1205 05:51:51.774701 19773 profile_guided_latency_estimator.cc:194] Missing 2 instructions from the profile.\n"
_NAME = "W1205 05:51:51.774705 19773 profile_guided_latency_estimator.cc:197]   {}\n"


def _write(text: str) -> None:
  os.write(2, text.encode())  # as XLA writes: to the file descriptor, not sys.stderr


def test_profile_lines_are_taken_out_and_the_rest_goes_through(capfd):
  with xla_log.quiet() as lookups:
    _write("before\n")
    _write(_FOUND + _MISSING + _NAME.format("custom-call.9") + _NAME.format("custom-call.12"))
    _write("an unfinished ")
    assert capfd.readouterr().err == ""  # held while the compile runs
    _write("line\n")
  err = capfd.readouterr().err
  assert err == "before\nan unfinished line\n"
  assert lookups.found == 402
  assert lookups.missing == ["custom-call.9", "custom-call.12"]
  assert lookups.lines == 4
  said = xla_log.summary(lookups)
  assert "2 instruction(s)" in said and "custom-call.12, custom-call.9" in said
  assert "kept off stderr" in said


def test_nothing_said_gives_no_summary_and_a_clean_profile_says_so():
  assert xla_log.summary(xla_log.ProfileLookups()) is None
  clean = xla_log.ProfileLookups(found=12, lines=1)
  assert "found every instruction" in xla_log.summary(clean)


def test_nested_and_threaded_compiles_each_get_the_lines_of_their_time(capfd):
  seen = {}
  started, go_on = threading.Event(), threading.Event()

  def other():
    with xla_log.quiet() as mine:
      started.set()
      go_on.wait(10)
      _write(_MISSING + _NAME.format("custom-call.7"))
    seen["other"] = mine

  with xla_log.quiet() as outer:
    _write(_MISSING + _NAME.format("custom-call.1"))
    t = threading.Thread(target=other)
    t.start()
    started.wait(10)
    _write("from the outer compile\n")
    go_on.set()
    t.join(10)
    # The thread's quiet ended first: its line reached the real stderr then.
    assert capfd.readouterr().err == "from the outer compile\n"
  assert outer.missing == ["custom-call.1", "custom-call.7"]
  assert seen["other"].missing == ["custom-call.7"]
  _write("after\n")
  assert capfd.readouterr().err == "after\n"
