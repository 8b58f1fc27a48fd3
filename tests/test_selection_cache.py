"""@overlap remembers its choice of variant on disk, so a restarted job skips the compiles."""

import json
import os
import re

import jax
import pytest

import jax_overlap
from jax_overlap._src.analysis import analyze as analysis
from jax_overlap._src.analysis import latency_profile
from jax_overlap._src.compile import compiler as compile_lib
from jax_overlap._src.transform import selection_cache, variants
from jax_overlap.examples import fsdp_transformer as G
from jax_overlap.examples import shard_map_fsdp as S


def _no_compiles(*args, **kwargs):
  raise AssertionError("compiled although the choice was remembered")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("JAX_OVERLAP_CACHE_DIR", str(tmp_path))
  return tmp_path


@pytest.fixture(scope="module")
def program():
  # The quickstart notebook's step (the session's compile store shares XLA's results).
  return S.build("h100x8", layers=2, hidden=1024, mlp=2816, heads=8, seq=512)


@pytest.fixture(scope="module")
def gspmd_program():
  # The scanned, rematerialized step test_to_shard_map.py chooses for too (the session's
  # compile store shares XLA's results between the two).
  return G.build("h100x8", layers=2, hidden=256, mlp=512, heads=4, seq=128, scan=True, remat=True)


def _without_metadata(hlo_text: str) -> str:
  """Scheduled HLO without source locations (which differ between call sites)."""
  return re.sub(r", metadata=\{[^}]*\}", "", hlo_text.split("\nFileNames", 1)[0])


@pytest.mark.slow
@pytest.mark.parametrize("form", ["shard_map", "gspmd"])
def test_choice_remembered_by_a_new_decorator(cache_dir, program, gspmd_program, monkeypatch, form):
  # A GSPMD step too: its compiler-option variants and its shard_map form's are chosen
  # among once, and the remembered one is rebuilt without compiling the step as written.
  # The shard_map step's choice includes variants scheduled from the cost model's estimates;
  # the GSPMD step's is test_to_shard_map.py's selection, compiled once for both.
  fn, args = program if form == "shard_map" else gspmd_program
  settings = {"target": "h100x8", "schedule_from_estimates": form == "shard_map"}
  chooser = jax_overlap.overlap(fn, **settings)
  first = chooser.explain(*args)
  assert not any("remembered" in n for n in first.notes)
  entries = list((cache_dir / "selection").glob("*.json"))
  assert len(entries) == 1
  stored = json.loads(entries[0].read_text())
  assert stored["chosen"] == first.chosen

  monkeypatch.setattr(analysis, "analyze", _no_compiles)
  again = jax_overlap.overlap(fn, **settings)
  e = again.explain(*args)
  assert (e.chosen, e.candidates, e.xla_options) == (
    first.chosen,
    first.candidates,
    first.xla_options,
  )
  assert any("remembered" in n for n in e.notes)

  # Other settings, or no cache, choose again (here: try to compile, and fail).
  with pytest.raises(AssertionError, match="compiled although"):
    jax_overlap.overlap(fn, **settings, prefetch=2).explain(*args)
  with pytest.raises(AssertionError, match="compiled although"):
    jax_overlap.overlap(fn, **settings, cache=False).explain(*args)
  with pytest.raises(TypeError, match="cache must be True or False"):
    jax_overlap.overlap(fn, cache="yes")

  # The remembered variant is the one compiled: XLA schedules what the new decorator gives
  # it as it schedules the chooser's variant (the same program with the same options is
  # compiled once: the process remembers XLA's result under both).
  monkeypatch.undo()
  chosen = compile_lib.compile_for_target(chooser, *args, target="h100x8")
  rebuilt = compile_lib.compile_for_target(again, *args, target="h100x8")
  assert _without_metadata(rebuilt.hlo_text) == _without_metadata(chosen.hlo_text)


def test_unusable_entries_are_chosen_again(cache_dir, program):
  fn, args = program
  quick = dict(target="h100x8", schedule_from_estimates=False)
  jax_overlap.overlap(fn, cache=False, **quick).explain(*args)
  assert not (cache_dir / "selection").exists()  # cache=False writes nothing
  ov = jax_overlap.overlap(fn, **quick)
  first = ov.explain(*args)
  (entry,) = (cache_dir / "selection").glob("*.json")
  stored = json.loads(entry.read_text())
  k = entry.stem
  assert selection_cache.load(k) == stored
  for bad in ("not json", json.dumps({"chosen": 3}), json.dumps([stored])):
    entry.write_text(bad)
    assert selection_cache.load(k) is None
  # A variant the decorator no longer offers, or a latency profile file that is
  # gone, is not used.
  entry.write_text(json.dumps(stored))
  settings = ov.settings
  cfg = ov.build(*args).choice.candidate.config
  offered = [variants.Candidate(stored["base"], cfg, {})]
  choice = variants.recall(settings, k, offered)
  assert choice.how == "remembered" and choice.origin == "the selection cache"
  assert choice.candidate.name == stored["chosen"]
  assert choice.candidate.options == stored["options"]
  assert list(choice.estimates) == [(n, t) for n, t in stored["estimates"]] and choice.estimates
  assert variants.recall(settings, k, [variants.Candidate("another variant", cfg)]) is None
  profile = cache_dir / "profile.pbtxt"
  profile.write_text("")
  entry.write_text(json.dumps({**stored, "options": {latency_profile.OPTION: str(profile)}}))
  choice = variants.recall(settings, k, offered)
  assert choice.candidate.options == {latency_profile.OPTION: str(profile)}
  profile.unlink()
  assert variants.recall(settings, k, offered) is None
  # End to end: a damaged entry is chosen again and written again.
  entry.write_text("not json")
  e = jax_overlap.overlap(fn, **quick).explain(*args)
  assert not any("remembered" in n for n in e.notes)
  assert e.chosen == first.chosen
  assert json.loads(entry.read_text()) == stored


def test_key_covers_program_signature_and_settings():
  base = selection_cache.key(
    "{ lambda ; a:f32[8]. let b = sin a in (b,) }", ("sig",), {"target": "h100x8"}
  )
  assert base == selection_cache.key(
    "{ lambda ; a:f32[8]. let b = sin a in (b,) }", ("sig",), {"target": "h100x8"}
  )
  assert base != selection_cache.key(
    "{ lambda ; a:f32[8]. let b = cos a in (b,) }", ("sig",), {"target": "h100x8"}
  )
  assert base != selection_cache.key(
    "{ lambda ; a:f32[8]. let b = sin a in (b,) }", ("other",), {"target": "h100x8"}
  )
  assert base != selection_cache.key(
    "{ lambda ; a:f32[8]. let b = sin a in (b,) }", ("sig",), {"target": "a100x8"}
  )
  # Function addresses in printed custom_vjp parameters change between processes.
  assert selection_cache.key("f=<function g at 0x7f00aa>", (), {}) == selection_cache.key(
    "f=<function g at 0x7f11bb>", (), {}
  )
  assert selection_cache.key("x", (), {"opt": object()}) is None


def test_unwritable_directory_remembers_nothing(tmp_path, monkeypatch):
  blocker = tmp_path / "file"
  blocker.write_text("")
  monkeypatch.setenv("JAX_OVERLAP_CACHE_DIR", str(blocker))  # a file, not a directory
  assert selection_cache.store("k", {"chosen": "x"}) is None
  assert selection_cache.load("k") is None
  assert os.path.isfile(blocker)


def test_jit_keywords_are_part_of_the_key(cache_dir, program):
  # Donation and output layouts change what XLA compiles, so a choice made with one is
  # not reused for another: each setting (by value, and the donation of a jitted step)
  # gets its own entry; the same setting again is remembered.
  fn, args = program
  quick = dict(target="h100x8", schedule_from_estimates=False)
  settings = [
    dict(donate_argnums=(0,)),
    dict(donate_argnums=(1,)),
  ]
  for i, kw in enumerate(settings):
    e = jax_overlap.overlap(fn, **kw, **quick).explain(*args)
    assert not any("remembered" in n for n in e.notes), kw
    assert len(list((cache_dir / "selection").glob("*.json"))) == i + 1
  # The donation of a jitted step (the same program text with and without it).
  raw = getattr(fn, "__wrapped__", fn)
  jax_overlap.overlap(jax.jit(raw), **quick).explain(*args)
  e = jax_overlap.overlap(jax.jit(raw, donate_argnums=(0,)), **quick).explain(*args)
  assert not any("remembered" in n for n in e.notes)
  e = jax_overlap.overlap(fn, donate_argnums=(1,), **quick).explain(*args)
  assert any("remembered" in n for n in e.notes)
