"""Runtime plans: format, validation errors, rules text, residency arithmetic."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_overlap import runtime
from jax_overlap._src import targets
from jax_overlap._src.runtime import residency

GOOD = {
  "version": 1,
  "target": "h100",
  "kernels": [
    {"match": "gemm_fusion_*", "blocks_per_sm": 2},
    {"regex": "^sm90_xmma_gemm_.*", "padding_bytes": 16384, "comment": "cuBLAS"},
  ],
  "regions": {"mlp": {"blocks_per_sm": 1}, "7": {"blocks_per_sm": 3}},
  "streams": {"priority": "highest"},
}


def test_round_trip_through_json(tmp_path):
  plan = runtime.Plan.from_json(GOOD)
  path = tmp_path / "plan.json"
  text = plan.to_json(path)
  assert json.loads(path.read_text()) == json.loads(text)
  again = runtime.Plan.from_json(path)
  assert again == plan
  assert runtime.Plan.from_json(text) == plan
  assert hash(plan) == hash(again)
  assert plan.kernels[1] == runtime.KernelRule(regex="^sm90_xmma_gemm_.*", padding_bytes=16384)
  assert plan.regions[1].id == 7


def test_simple_constructor_for_the_tuner():
  plan = runtime.Plan(
    target="a100",
    kernels=[runtime.KernelRule(match="*gemm*", blocks_per_sm=1)],
    regions={"attn": 2},
    streams=runtime.StreamPolicy(priority="highest", create_order=(3,)),
  )
  assert plan.validate() is plan
  d = json.loads(plan.to_json())
  assert d == {
    "version": 1,
    "target": "a100",
    "kernels": [{"match": "*gemm*", "blocks_per_sm": 1}],
    "regions": {"attn": {"blocks_per_sm": 2}},
    "streams": {"priority": "highest", "create_order": [3]},
    "comm_block": "auto",
  }
  assert not plan.empty and runtime.Plan().empty


def test_rules_text():
  plan = runtime.Plan.from_json(GOOD)
  lines = plan.to_rules().splitlines()
  assert lines[0] == "version\t1"
  assert lines[1] == "kernel\tglob\tgemm_fusion_*\tblocks_per_sm\t2"
  assert lines[2] == "kernel\tregex\t^sm90_xmma_gemm_.*\tpadding_bytes\t16384"
  assert lines[3] == f"region\t{runtime.region_id('mlp')}\tblocks_per_sm\t1"
  assert lines[4] == "region\t7\tblocks_per_sm\t3"
  assert lines[5:] == [
    "streams\tpriority\thighest",
    "streams\tpromote_requested\t1",
    "comm_block\tauto",
  ]
  explicit = dataclasses.replace(plan, comm_block={"threads": 288, "regs_per_thread": 96})
  assert explicit.to_rules().splitlines()[-1] == "comm_block\t288\t96\t0"
  assert dataclasses.replace(plan, comm_block=None).to_rules().endswith("comm_block\tnone\n")
  assert runtime.Plan.from_json(explicit.to_json()) == explicit


def test_region_ids_are_stable_and_disjoint():
  assert runtime.region_id(5) == 5 and runtime.region_id("5") == 5
  named = runtime.region_id("mlp")
  assert named == runtime.region_id("mlp") >= 2**62
  assert named != runtime.region_id("attn")
  with pytest.raises(ValueError, match=r"region id must be in \[0, 2\*\*62\), got -1"):
    runtime.region_id(-1)
  with pytest.raises(TypeError, match="region name must be a string or an integer, got float"):
    runtime.region_id(1.5)


BAD_PLANS = [
  (
    {"version": 1, "comm_block": {"threads": 2048}},
    ValueError,
    "comm_block.threads must be 1-1024, got 2048",
  ),
  (
    {"version": 1, "comm_block": {"threads": 544, "regs": 96}},
    ValueError,
    "comm_block: unknown key 'regs'; valid keys: regs_per_thread, smem_bytes, threads",
  ),
  ({"version": 1, "comm_block": "nccl"}, TypeError, "'comm_block' must be \"auto\", null"),
  ({"kernels": []}, ValueError, "missing key 'version' (expected 1)"),
  ({"version": 2}, ValueError, "unsupported plan version 2; this jax_overlap reads version 1"),
  ({"version": "1"}, TypeError, "'version' must be an integer, got '1'"),
  (
    {"version": 1, "kernel": []},
    ValueError,
    "plan: unknown key 'kernel'; valid keys: comm_block, comment, kernels, library_gemms, regions, streams, target, version",
  ),
  (
    {"version": 1, "target": "h1000"},
    ValueError,
    "'target': unknown GPU 'h1000'; a plan's target names the GPU, one of: a100, a100-40, a40, "
    "h100, h200, mi250x",
  ),
  (
    {"version": 1, "target": "h100x8"},
    ValueError,
    "unknown GPU 'h100x8' ('h100x8' is a topology: its GPU is 'h100')",
  ),
  ({"version": 1, "target": "mi250x"}, ValueError, "is not an NVIDIA GPU"),
  ({"version": 1, "kernels": {"match": "x"}}, TypeError, "'kernels' must be a list of rules"),
  (
    {"version": 1, "kernels": [{"match": "x", "blocks": 2}]},
    ValueError,
    "kernels[0]: unknown key 'blocks'; valid keys: blocks_per_sm, comment, match, padding_bytes, "
    "regex",
  ),
  (
    {"version": 1, "kernels": [{"match": "x", "blocks_per_sm": 0}]},
    ValueError,
    "kernels[0]: kernel rule 'blocks_per_sm' must be a positive integer (>= 1), got 0",
  ),
  (
    {"version": 1, "kernels": [{"match": "x", "blocks_per_sm": -3}]},
    ValueError,
    "must be a positive integer (>= 1), got -3",
  ),
  (
    {"version": 1, "kernels": [{"match": "x", "padding_bytes": -1}]},
    ValueError,
    "kernel rule 'padding_bytes' must be a positive integer (>= 1), got -1",
  ),
  (
    {"version": 1, "kernels": [{"match": "x", "blocks_per_sm": 2.5}]},
    TypeError,
    "kernel rule 'blocks_per_sm' must be an integer, got float 2.5",
  ),
  (
    {"version": 1, "kernels": [{"match": "x", "blocks_per_sm": True}]},
    TypeError,
    "must be an integer, got bool True",
  ),
  (
    {"version": 1, "kernels": [{"blocks_per_sm": 2}]},
    ValueError,
    "needs exactly one of 'match' (glob) or 'regex'",
  ),
  (
    {"version": 1, "kernels": [{"match": "a", "regex": "b", "blocks_per_sm": 1}]},
    ValueError,
    "needs exactly one of 'match' (glob) or 'regex'",
  ),
  (
    {"version": 1, "kernels": [{"match": "a", "blocks_per_sm": 1, "padding_bytes": 4}]},
    ValueError,
    "needs exactly one of 'blocks_per_sm' or 'padding_bytes'",
  ),
  (
    {"version": 1, "kernels": [{"regex": "(", "blocks_per_sm": 1}]},
    ValueError,
    "kernel rule 'regex' '(' does not compile",
  ),
  (
    {"version": 1, "kernels": [{"match": "a\tb", "blocks_per_sm": 1}]},
    ValueError,
    "must not contain tabs or line breaks",
  ),
  (
    {"version": 1, "kernels": [{"match": "", "blocks_per_sm": 1}]},
    ValueError,
    "kernel rule 'match' must not be empty",
  ),
  (
    {"version": 1, "target": "h100", "kernels": [{"match": "x", "blocks_per_sm": 33}]},
    ValueError,
    "kernels[0]: 'blocks_per_sm' must be at most 32 on h100, got 33",
  ),
  (
    {"version": 1, "target": "a100", "kernels": [{"match": "x", "padding_bytes": 10**6}]},
    ValueError,
    "'padding_bytes' must be at most 166912 (the opt-in shared memory per block on "
    "a100), got 1000000",
  ),
  (
    {"version": 1, "regions": {"mlp": {"blocks": 1}}},
    ValueError,
    "regions['mlp']: unknown key 'blocks'; valid keys: blocks_per_sm, comment",
  ),
  (
    {"version": 1, "regions": {"mlp": {}}},
    ValueError,
    "regions['mlp']: missing key 'blocks_per_sm'",
  ),
  (
    {"version": 1, "regions": {"mlp": 0}},
    ValueError,
    "regions['mlp'] 'blocks_per_sm' must be a positive integer (>= 1), got 0",
  ),
  ({"version": 1, "regions": [1, 2]}, TypeError, "regions must map names to blocks_per_sm"),
  (
    {"version": 1, "streams": {"priority": "high"}},
    ValueError,
    "streams 'priority' must be one of default, highest, got 'high'",
  ),
  (
    {"version": 1, "streams": {"priority": "highest", "order": [1]}},
    ValueError,
    "streams: unknown key 'order'; valid keys: comment, create_order, priority, promote_requested",
  ),
  (
    {"version": 1, "streams": {"priority": "highest", "create_order": [-1]}},
    ValueError,
    "streams 'create_order'[0] must be >= 0, got -1",
  ),
  (
    {"version": 1, "streams": {"create_order": "1"}},
    TypeError,
    "streams 'create_order' must be a list of integers, got str",
  ),
  ({"version": 1, "streams": []}, TypeError, "'streams' must be a JSON object, got list"),
  ([1, 2], TypeError, "a plan must be a JSON object, got list"),
]


@pytest.mark.parametrize("data,exc,message", BAD_PLANS)
def test_bad_plans_give_clear_errors(tmp_path, data, exc, message):
  path = tmp_path / "plan.json"
  path.write_text(json.dumps(data))
  with pytest.raises(exc, match=re.escape(message)):
    runtime.Plan.from_json(path)


def test_malformed_json_and_missing_file(tmp_path):
  path = tmp_path / "plan.json"
  path.write_text('{"version": 1,, }')
  with pytest.raises(ValueError, match=r"Plan.from_json: malformed JSON in .*plan.json: Expecting"):
    runtime.Plan.from_json(path)
  with pytest.raises(FileNotFoundError, match="no plan file"):
    runtime.Plan.from_json(tmp_path / "missing.json")


def test_constructor_errors_name_the_api():
  with pytest.raises(ValueError, match=r"^jax_overlap\.runtime\.Plan: "):
    runtime.Plan(kernels=[{"match": "x", "blocks_per_sm": 0}])
  with pytest.raises(ValueError, match="duplicate region names"):
    runtime.Plan(regions=[runtime.RegionRule("a", 1), runtime.RegionRule("a", 2)])
  with pytest.raises(ValueError, match="'12' and '012' name the same region id 12"):
    runtime.Plan(regions={"12": 1, "012": 2})


# ---------------------------------------------------------------------------
# Arithmetic.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  "gpu,threads,regs,smem,expected",
  [
    ("h100", 256, 32, 0, 8),  # threads: 2048 / 256
    ("h100", 128, 32, 0, 16),
    ("h100", 64, 32, 0, 32),  # max blocks per SM
    ("h100", 1024, 64, 0, 1),  # registers: 65536 / (2048 * 32)
    ("h100", 640, 96, 0, 1),  # an NCCL channel CTA: 61440 registers
    ("h100", 96, 255, 0, 2),  # 255 regs round to 8192 per warp, 3 warps
    ("h100", 256, 32, 48 * 1024, 4),  # 233472 // (49152 + 1024)
    ("a100", 256, 32, 48 * 1024, 3),  # 167936 // 50176
    ("a40", 256, 32, 0, 6),  # 1536 threads per SM
    ("h100", 33, 0, 0, 32),  # 33 threads round up to 64
  ],
)
def test_blocks_per_sm_by_hand(gpu, threads, regs, smem, expected):
  assert runtime.blocks_per_sm(gpu, threads, regs, smem) == expected


def test_shaped_and_padded_by_hand():
  h100 = targets.get_gpu("h100")
  assert runtime.shaped_dynamic_smem(h100, 256, 32, 1024, 0, 2) == 75777
  assert runtime.shaped_dynamic_smem("a100", 128, 64, 4096, 0, 3) == 36865
  assert runtime.shaped_dynamic_smem("h100", 1024, 64, 0, 0, 2) == 0  # already 1 block
  assert runtime.padded_dynamic_smem("h100", 1024, 512, 4096) == 4608
  assert runtime.padded_dynamic_smem("h100", 1024, 512, 10**6) == h100.smem_per_block_optin - 1024


@pytest.mark.parametrize(
  "args,exc,message",
  [
    ((256, 32, 0, 0, 0), ValueError, "shaped_dynamic_smem: blocks_per_sm must be >= 1, got 0"),
    ((0, 32, 0, 0, 1), ValueError, "shaped_dynamic_smem: threads must be >= 1, got 0"),
    ((256, -1, 0, 0, 1), ValueError, "regs_per_thread must be >= 0, got -1"),
    ((256, 32, 0, -5, 1), ValueError, "dynamic_smem must be >= 0, got -5"),
    ((256, 32, 0.5, 0, 1), TypeError, "static_smem must be an integer, got 0.5"),
  ],
)
def test_arithmetic_input_errors(args, exc, message):
  with pytest.raises(exc, match=re.escape(message)):
    runtime.shaped_dynamic_smem("h100", *args)


def test_arithmetic_unknown_gpu():
  with pytest.raises(ValueError, match="unknown GPU 'b200'"):
    residency.blocks_per_sm("b200", 256, 32, 0)


_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_*0123456789", min_size=1, max_size=20)
_kernel_rules = st.builds(
  lambda pattern, use_blocks, n: runtime.KernelRule(
    match=pattern,
    blocks_per_sm=n if use_blocks else None,
    padding_bytes=None if use_blocks else n * 512,
  ),
  _names,
  st.booleans(),
  st.integers(1, 32),
)


@settings(max_examples=60, deadline=None)
@given(
  kernels=st.lists(_kernel_rules, max_size=5),
  regions=st.dictionaries(
    _names.filter(lambda s: "*" not in s and not s.isdigit()), st.integers(1, 32), max_size=4
  ),
  priority=st.sampled_from(["default", "highest"]),
  order=st.lists(st.integers(0, 20), max_size=3),
)
def test_plans_round_trip_and_compile(kernels, regions, priority, order):
  plan = runtime.Plan(
    target="h100",
    kernels=kernels,
    regions=regions,
    streams={"priority": priority, "create_order": order},
  )
  assert runtime.Plan.from_json(plan.to_json()) == plan
  lines = plan.to_rules().splitlines()
  assert sum(line.startswith("kernel\t") for line in lines) == len(kernels)
  assert sum(line.startswith("region\t") for line in lines) == len(regions)
  assert all(len(line.split("\t")) in (2, 3, 4, 5) for line in lines)
