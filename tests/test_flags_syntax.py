"""How XLA cuts XLA_FLAGS into flags, mirrored by jax_overlap._src.flags.syntax."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jax_overlap import flags
from jax_overlap._src.flags import probe, syntax


def texts(value: str) -> list[str]:
  return [t.text for t in syntax.read_xla_flags(value).tokens]


@pytest.mark.parametrize(
  "value,tokens,ignored",
  [
    ("", [], ""),
    ("  --a=1\t--b\n--c=x  ", ["--a=1", "--b", "--c=x"], ""),
    ('--a="x y" --b=2', ["--a=x y", "--b=2"], ""),
    ("--a='x y' --b=2", ["--a=x y", "--b=2"], ""),
    ('--a="q\\"r\\\\s"', ['--a=q"r\\s'], ""),
    ("--a='q\\r'", ["--a=q\\r"], ""),
    ('--a="open --b=1', ["--a=open --b=1"], ""),
    ('--a="x"y --b=2', ["--a=x"], "y --b=2"),
    ("--a=x'y z' --b=2", ["--a=x'y"], "z' --b=2"),
    ("--a=1 junk --b=2", ["--a=1"], "junk --b=2"),
    ("--a 1", ["--a"], "1"),
    ("-- --a=1", ["--", "--a=1"], ""),
    ("-a=1 --x-y=2", ["-a=1", "--x-y=2"], ""),
  ],
)
def test_tokens_as_xla_cuts_them(value, tokens, ignored):
  read = syntax.read_xla_flags(value)
  assert [t.text for t in read.tokens] == tokens
  assert read.ignored.strip() == ignored
  assert read.flag_file is None


def test_value_not_starting_with_a_dash_is_a_flag_file(tmp_path):
  path = tmp_path / "flags.txt"
  path.write_text("--xla_gpu_autotune_level=0\n--xla_dump_to='/tmp/a b'\n")
  read = syntax.read_xla_flags(str(path))
  assert read.flag_file == str(path) and read.file_error is None
  assert [t.text for t in read.tokens] == ["--xla_gpu_autotune_level=0", "--xla_dump_to=/tmp/a b"]
  missing = syntax.read_xla_flags(str(tmp_path / "nope"))
  assert missing.file_error and missing.tokens == ()
  assert syntax.read_xla_flags("   ").file_error  # blank only: XLA opens a file named "   "
  # validate follows the file, and XLA agrees that this file is fine.
  assert flags.validate(str(path)) == []
  assert probe.judge([str(path)])[str(path)].accepted


@pytest.mark.parametrize(
  "type_,value,ok",
  [
    ("bool", None, True),
    ("bool", "TRUE", True),
    ("bool", "0", True),
    ("bool", "yes", False),
    ("bool", "", False),
    ("int32", " 7 ", True),
    ("int32", "+7", True),
    ("int32", "0x7", False),
    ("int32", "1e2", False),
    ("int32", "2147483648", False),
    ("int64", "2147483648", True),
    ("int64", "9223372036854775808", False),
    ("int64", None, False),
    ("float", ".5", True),
    ("float", "1e-3", True),
    ("float", "inf", True),
    ("float", "+-1", False),
    ("float", "1,5", False),
    ("string", "", True),
    ("string", None, False),
  ],
)
def test_value_syntax_per_type(type_, value, ok):
  assert (syntax.value_error(type_, value) is None) == ok


# Values XLA's tokenizer must hand back unchanged after format_token quotes them.
_VALUE = st.text(
  alphabet=st.sampled_from(list("ab/_.,=-") + [" ", "\t", "'", '"', "\\"]), max_size=12
)


@given(_VALUE)
def test_format_token_round_trips_through_the_tokenizer(value):
  (tok,) = syntax.read_xla_flags(syntax.format_token("xla_dump_to", value)).tokens
  assert tok.name == "xla_dump_to" and tok.value == value


def test_format_xla_flags_is_read_back_by_xla():
  text = flags.format_xla_flags({"xla_dump_to": "/tmp/a b'c\"d", "xla_gpu_autotune_level": 0})
  assert flags.parse_xla_flags(text) == (
    {"xla_dump_to": "/tmp/a b'c\"d", "xla_gpu_autotune_level": "0"},
    [],
  )
  assert probe.judge([text])[text].accepted


def test_types_read_from_xla():
  assert probe.flag_type("xla_gpu_enable_latency_hiding_scheduler") == "bool"
  assert probe.flag_type("xla_gpu_autotune_level") == "int32"
  assert probe.flag_type("xla_gpu_all_gather_combine_threshold_bytes") == "int64"
  assert probe.flag_type("xla_gpu_autotune_gemm_rtol") == "float"
  assert probe.flag_type("xla_dump_to") == "string"
  assert probe.flag_type("xla_gpu_enable_command_buffer") == "choice"
  assert probe.flag_type("xla_gpu_no_such_flag_xyz") is None


def test_repeated_flags_last_wins_and_conflicts_warn():
  (p,) = flags.validate("--xla_gpu_autotune_level=0 --xla_gpu_autotune_level=4")
  assert p.kind == "conflict" and p.severity == "warning"
  assert "the last one, '4', wins" in p.message
  assert flags.validate("--xla_gpu_enable_triton_gemm=true --xla_gpu_enable_triton_gemm=1") == []
  assert flags.parse_xla_flags("--xla_gpu_autotune_level=0 --xla_gpu_autotune_level=4")[0] == {
    "xla_gpu_autotune_level": "4"
  }


def test_negative_thresholds_and_ignored_text_warn():
  (p,) = flags.validate("--xla_gpu_reduce_scatter_combine_threshold_bytes=-1")
  assert (p.kind, p.severity) == ("out_of_range", "warning")
  assert "below 0" in p.message
  (q,) = flags.validate("--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
  assert (q.kind, q.severity) == ("ignored", "warning")
  assert "XLA stops reading XLA_FLAGS at 'intra_op_parallelism_threads=1'" in q.message


def test_quoted_whole_value_names_the_fix():
  (p,) = flags.validate("'--xla_gpu_enable_latency_hiding_scheduler=true'")
  assert p.severity == "error" and "remove the quotes" in p.message


def test_accepted_by_jaxlib_uses_xla_flags_syntax():
  assert flags.accepted_by_jaxlib("xla_dump_hlo_as_text", "true")
  assert flags.accepted_by_jaxlib("xla_dump_hlo_as_text", True)
  assert not flags.accepted_by_jaxlib("xla_dump_hlo_as_text", "yes")
  assert flags.accepted_by_jaxlib("xla_dump_to")
  assert not flags.accepted_by_jaxlib("xla_gpu_enable_async_all_gather")
