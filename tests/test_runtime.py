"""The runtime library against a fake libcuda: interposition paths, shaping, fallbacks."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
from fake_cuda import harness

from jax_overlap import runtime as public_runtime
from jax_overlap._src import targets
from jax_overlap._src.runtime import library as runtime
from jax_overlap._src.runtime import plan as plan_lib
from jax_overlap._src.runtime import residency

MODES = ["direct", "dlopen", "procaddr", "procaddr1"]
PATH_COUNTER = {
  "direct": "launches_direct",
  "dlopen": "launches_dlsym",
  "procaddr": "launches_procaddr",
  "procaddr1": "launches_procaddr",
}
H100_SMEM_SM = 228 * 1024
A100_SMEM_SM = 164 * 1024


def rules(*lines: str) -> str:
  return "version\t1\n" + "".join(line + "\n" for line in lines)


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
  return harness.build(tmp_path_factory.mktemp("fake_cuda"))


@pytest.fixture(scope="module")
def rt():
  return runtime.load_library(runtime.library_path(runtime.RUNTIME_LIBRARY))


# ---------------------------------------------------------------------------
# Interposition: the three ways programs reach the driver.
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_shapes_selected_kernel_on_every_path(fake, mode, tmp_path):
  r = harness.run_app(
    fake,
    mode,
    ["launch:gemm_fusion_1:256:0:3", "launch:nccl_proxy:640:0", "launchex:gemm_fusion_1:256:0"],
    rules=rules("kernel\tglob\tgemm_fusion_*\tblocks_per_sm\t2"),
    tmp=tmp_path,
  )
  assert r.returncode == 0, r.stderr
  # H100: floor(233472 / 3) + 1 - 1024 static - 1024 reserved.
  expected = H100_SMEM_SM // 3 + 1 - 1024 - 1024
  assert expected == 75777
  assert r.launch_dyn("gemm_fusion_1") == [expected] * 4
  assert r.launch_dyn("nccl_proxy") == [0]
  c = r.counters
  assert c["launches_seen"] == 5
  assert c["launches_shaped"] == 4
  assert c["launches_fallback"] == 0
  assert c[PATH_COUNTER[mode]] == 5
  assert c["func_attr_raised"] == 1  # 75777 > 48 KB: raised once, then cached
  assert any("setattr func=gemm_fusion_1 attr=8 value=75777 result=0" in x for x in r.log)


@pytest.mark.parametrize("mode", MODES)
def test_context_less_kernel_handles_are_shaped_through_their_function(fake, mode, tmp_path):
  # The CUDA runtime (CUDA 12+) launches CUkernel handles, which cuFuncGetAttribute
  # refuses (seen on an H200, driver 580: every runtime-launched kernel fell back).
  r = harness.run_app(
    fake,
    mode,
    [
      "klaunch:gemm_fusion_1:256:0:3",
      "launch:gemm_fusion_1:256:0",
      "klaunchex:gemm_fusion_1:256:0",
      "klaunch:nccl_proxy:640:0",
    ],
    rules=rules("kernel\tglob\tgemm_fusion_*\tblocks_per_sm\t2"),
    tmp=tmp_path,
  )
  assert r.returncode == 0, r.stderr
  assert r.launch_dyn("gemm_fusion_1") == [H100_SMEM_SM // 3 + 1 - 1024 - 1024] * 5
  assert r.launch_dyn("nccl_proxy") == [0]
  c = r.counters
  assert c["launches_shaped"] == 5
  assert c["launches_fallback"] == 0
  assert c["launches_kernel_handle"] == 5
  # Classified once per handle: one refused attribute query each, not one per launch.
  assert sum("kernel_handle=1" in line for line in r.log) == 2
  assert not any("error api=cuFuncSetAttribute" in line for line in r.log)


def test_a_kernel_handle_the_driver_cannot_resolve_goes_out_unchanged(fake, tmp_path):
  # cuKernelGetFunction failing (say a kernel not yet loaded in the context): launched as
  # it came, and asked about again at the next launch rather than taken for a function.
  r = harness.run_app(
    fake,
    "procaddr",
    ["klaunch:gemm_fusion_1:256:0:3"],
    rules=rules("kernel\tglob\tgemm_fusion_*\tblocks_per_sm\t2"),
    env={"FAKE_CUDA_FAIL": "cuKernelGetFunction"},
    tmp=tmp_path,
  )
  assert r.returncode == 0, r.stderr
  assert r.launch_dyn("gemm_fusion_1") == [0, 0, 0]
  assert r.counters["launches_shaped"] == 0
  assert r.counters["launches_fallback"] == 3
  assert sum("error api=cuKernelGetFunction" in line for line in r.log) == 3


@pytest.mark.parametrize("mode", MODES)
def test_nothing_changes_without_a_plan(fake, mode, tmp_path):
  r = harness.run_app(
    fake,
    mode,
    ["launch:gemm_fusion_1:256:0:2", "launchex:nccl_proxy:640:128", "stream", "streamprio:-2"],
    tmp=tmp_path,
  )
  assert r.returncode == 0, r.stderr
  assert r.launch_dyn("gemm_fusion_1") == [0, 0]
  assert r.launch_dyn("nccl_proxy") == [128]
  assert not any(x.startswith("setattr") for x in r.log)
  assert r.counters["launches_seen"] == 3
  assert r.counters["launches_shaped"] == 0
  assert r.counters["streams_promoted"] == 0
  assert "priority=-2" in r.results[-1]


def test_without_the_library_launches_reach_the_driver(fake, tmp_path):
  r = harness.run_app(
    fake,
    "dlopen",
    ["launch:gemm_fusion_1:256:0"],
    preload=False,
    rules=rules("kernel\tglob\t*\tblocks_per_sm\t1"),
    tmp=tmp_path,
  )
  assert r.returncode == 0
  assert r.launch_dyn("gemm_fusion_1") == [0]
  assert r.counters == {}


def test_procaddr_hands_out_per_thread_variants(fake, tmp_path):
  r = harness.run_app(
    fake,
    "procaddr",
    ["launch:gemm_fusion_1:256:0"],
    tmp=tmp_path,
    rules=rules("kernel\tglob\tgemm*\tblocks_per_sm\t4"),
  )
  assert [x["api"] for x in r.launches] == ["cuLaunchKernel_ptsz"]
  assert r.counters["lookups_procaddr"] >= 2
  assert r.counters["lookups_unhooked"] == 0


# ---------------------------------------------------------------------------
# Residency arithmetic against hand-computed values.
# ---------------------------------------------------------------------------

# (device, threads, regs, static, dyn, N, expected dyn). Expected values by hand:
#   block = smallest multiple of 128 B above smem_per_sm / (N + 1)
#   dyn = block - 127 - static - 1024 (reserved), at least dyn.
HAND_CASES = [
  # H100 (228 KB/SM): 256 threads, 32 regs -> 8 blocks by threads and registers.
  ("h100", 256, 32, 0, 0, 1, 116736 + 1 - 1024),  # 115713; 233472 // 116737 = 1
  ("h100", 256, 32, 1024, 0, 2, 77824 + 1 - 2048),  # 75777
  # 233472 // 5 = 46694 -> 365 units of 128 B = 46720; 46720 - 127 - 1024 = 45569
  ("h100", 128, 64, 0, 8192, 4, 46720 - 127 - 1024),
  ("h100", 256, 32, 0, 100000, 1, 100000 + 15713),  # starts at 100000: 115713
  # A100 (164 KB/SM).
  ("a100", 128, 64, 4096, 0, 3, 41984 + 1 - 5120),  # 36865
  ("a100", 256, 32, 49152, 0, 1, 83968 + 1 - 50176),  # 33793
  # Already at or below the cap: unchanged.
  ("h100", 1024, 64, 0, 0, 2, 0),  # registers allow 1 block
  ("a100", 640, 96, 0, 0, 1, 0),  # an NCCL-like CTA: 1 block by registers
  ("h100", 256, 32, 0, 120000, 1, 120000),  # 121024 B/block: 1 block already
]


@pytest.mark.parametrize("device,threads,regs,static,dyn,n,expected", HAND_CASES)
def test_hand_computed_residency(fake, tmp_path, device, threads, regs, static, dyn, n, expected):
  gpu = targets.get_gpu(device)
  funcs = f"k:static={static}:regs={regs}:maxdyn={max(dyn, 49152 - static)}"
  r = harness.run_app(
    fake,
    "dlopen",
    [f"launch:k:{threads}:{dyn}"],
    rules=rules(f"kernel\tglob\tk\tblocks_per_sm\t{n}"),
    env={"FAKE_CUDA_DEVICE": device},
    funcs=funcs,
    tmp=tmp_path,
  )
  assert r.launch_dyn("k") == [expected], r.log
  # The Python mirror and the residency it implies.
  assert residency.shaped_dynamic_smem(gpu, threads, regs, static, dyn, n) == expected
  resident = residency.blocks_per_sm(gpu, threads, regs, static + expected)
  assert resident <= n
  if expected != dyn:
    assert residency.blocks_per_sm(gpu, threads, regs, static + expected - 1) > n  # smallest
  assert r.counters["launches_shaped"] == (1 if expected != dyn else 0)


def test_opt_in_limit_caps_the_padding(fake, tmp_path):
  # A device whose opt-in limit (64 KB) is below what N=1 needs (115713 B).
  r = harness.run_app(
    fake,
    "dlopen",
    ["launch:k:256:0"],
    rules=rules("kernel\tglob\tk\tblocks_per_sm\t1"),
    env={"FAKE_CUDA_LIMITS": "optin=65536"},
    funcs="k:static=2048:regs=32",
    tmp=tmp_path,
  )
  assert r.launch_dyn("k") == [65536 - 2048]
  assert r.counters["launches_capped"] == 1
  assert r.counters["launches_shaped"] == 1
  assert r.counters["launches_fallback"] == 0


def test_padding_rule_and_first_match_wins(fake, tmp_path):
  r = harness.run_app(
    fake,
    "dlopen",
    ["launch:gemm_fusion_1:256:512", "launch:loop_fusion_7:128:0"],
    rules=rules(
      "kernel\tregex\t^gemm_\tpadding_bytes\t4096",
      "kernel\tglob\t*fusion*\tblocks_per_sm\t1",
    ),
    tmp=tmp_path,
  )
  assert r.launch_dyn("gemm_fusion_1") == [512 + 4096]
  assert r.launch_dyn("loop_fusion_7") == [H100_SMEM_SM // 2 + 1 - 1024]


# ---------------------------------------------------------------------------
# Fallbacks and skips.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  "fail",
  [
    "cuFuncGetAttribute",
    "cuFuncSetAttribute",
    "cuDeviceGetAttribute",
    "cuCtxGetDevice",
    "launch_dyn_over=49152",
  ],
)
def test_driver_errors_fall_back_to_the_original_launch(fake, tmp_path, fail):
  r = harness.run_app(
    fake,
    "dlopen",
    ["launch:gemm_fusion_1:256:0:2"],
    rules=rules("kernel\tglob\tgemm_fusion_*\tblocks_per_sm\t2"),
    env={"FAKE_CUDA_FAIL": fail},
    tmp=tmp_path,
  )
  assert r.returncode == 0, r.stderr
  assert r.results == ["launch:gemm_fusion_1:256:0:2 0 failures=0"]
  assert r.launch_dyn("gemm_fusion_1") == [0, 0]
  assert r.counters["launches_fallback"] == 2


def test_no_fallback_relaunch_inside_stream_capture(fake, tmp_path):
  # Outside a capture a failed shaped launch is re-launched unchanged; inside one it is not:
  # the error already invalidated the capture, and XLA must see the real error.
  r = harness.run_app(
    fake,
    "dlopen",
    [
      "launch:gemm_fusion_1:256:0",
      "capture_begin",
      "launch:gemm_fusion_1:256:0",
      "capture_end",
    ],
    rules=rules("kernel\tglob\tgemm_fusion_*\tblocks_per_sm\t2"),
    env={"FAKE_CUDA_FAIL": "launch_dyn_over=49152"},
    tmp=tmp_path,
  )
  assert r.returncode == 0, r.stderr
  outside = [x for x in r.launches if x["captured"] == "0"]
  inside = [x for x in r.launches if x["captured"] != "0"]
  assert [(x["dyn"], x["result"]) for x in outside] == [("75777", "1"), ("0", "0")]
  assert [x["dyn"] for x in inside] == ["75777"]  # no second, unshaped launch
  assert r.results[2].split()[1] != "0"  # the program sees the launch error
  assert r.results[3] == "capture_end 901"
  assert r.counters["launches_fallback"] == 1
  assert r.counters["capture_errors"] == 1


def test_failed_attribute_queries_are_not_repeated_on_every_launch(fake, tmp_path):
  r = harness.run_app(
    fake,
    "dlopen",
    ["launch:gemm_fusion_1:256:0:50"],
    rules=rules("kernel\tglob\tgemm_fusion_*\tblocks_per_sm\t2"),
    env={"FAKE_CUDA_FAIL": "cuFuncGetAttribute"},
    tmp=tmp_path,
  )
  assert r.returncode == 0, r.stderr
  assert r.counters["launches_fallback"] == 50
  assert r.launch_dyn("gemm_fusion_1") == [0] * 50
  # Two queries (what kind of handle it is, then its attributes, the first failing), not
  # one per launch.
  assert sum("error api=cuFuncGetAttribute" in line for line in r.log) == 2
  # New rules ask again.
  (tmp_path / "r.txt").write_text(rules("kernel\tglob\tgemm_fusion_*\tblocks_per_sm\t3"))
  again = harness.run_app(
    fake,
    "dlopen",
    ["launch:gemm_fusion_1:256:0:3", f"rules:{tmp_path / 'r.txt'}", "launch:gemm_fusion_1:256:0:3"],
    rules=rules("kernel\tglob\tgemm_fusion_*\tblocks_per_sm\t2"),
    env={"FAKE_CUDA_FAIL": "cuFuncGetAttribute"},
    tmp=tmp_path,
  )
  assert sum("error api=cuFuncGetAttribute" in line for line in again.log) == 3
  assert r.counters["launches_shaped"] == 0


@pytest.mark.parametrize("kind", ["coop", "cluster"])
def test_cooperative_and_cluster_launches_are_not_shaped(fake, tmp_path, kind):
  r = harness.run_app(
    fake,
    "dlopen",
    [f"launchex:gemm_fusion_1:256:0:{kind}"],
    rules=rules("kernel\tglob\t*\tblocks_per_sm\t1"),
    tmp=tmp_path,
  )
  assert r.launch_dyn("gemm_fusion_1") == [0]
  assert r.counters["launches_skipped"] == 1


@pytest.mark.parametrize("mode", ["direct", "dlopen", "procaddr"])
def test_program_lowering_the_dynamic_smem_limit_is_seen(fake, mode, tmp_path):
  # The library raises the kernel's limit for its shaped launch; the program then sets
  # it lower itself. The next shaped launch must raise it again, not fail and fall back.
  r = harness.run_app(
    fake,
    mode,
    ["launch:gemm_fusion_1:256:0", "setattr:gemm_fusion_1:1024", "launch:gemm_fusion_1:256:0"],
    rules=rules("kernel\tglob\tgemm_fusion_*\tblocks_per_sm\t2"),
    tmp=tmp_path,
  )
  assert r.returncode == 0, r.stderr
  assert r.launch_dyn("gemm_fusion_1") == [75777, 75777]
  assert r.counters["launches_fallback"] == 0
  assert r.counters["func_attr_raised"] == 2
  raises = [x for x in r.log if x.startswith("setattr") and "attr=8" in x]
  assert [x.split("value=")[1].split()[0] for x in raises] == ["75777", "1024", "75777"]


def test_kernels_with_compile_time_clusters_are_not_shaped(fake, tmp_path):
  # A kernel compiled with __cluster_dims__ launches as clusters even through cuLaunchKernel.
  r = harness.run_app(
    fake,
    "dlopen",
    ["launch:gemm_fusion_1:256:0", "launch:cluster_gemm:256:0"],
    rules=rules("kernel\tglob\t*gemm*\tblocks_per_sm\t1"),
    funcs="gemm_fusion_1:static=1024:regs=32;cluster_gemm:regs=32:cluster=2",
    tmp=tmp_path,
  )
  assert r.returncode == 0, r.stderr
  assert r.launch_dyn("cluster_gemm") == [0]
  assert r.launch_dyn("gemm_fusion_1") != [0]
  assert r.counters["launches_skipped"] == 1 and r.counters["launches_shaped"] == 1


# ---------------------------------------------------------------------------
# Threads, regions, graphs, streams, rules at run time, logging.
# ---------------------------------------------------------------------------


def test_concurrent_launches_from_many_threads(fake, tmp_path):
  threads, per_thread = 8, 400
  r = harness.run_app(
    fake,
    "dlopen",
    [f"threads:{threads}:gemm_fusion_1:256:0:{per_thread}"],
    rules=rules("kernel\tglob\tgemm_fusion_*\tblocks_per_sm\t2"),
    tmp=tmp_path,
  )
  total = threads * per_thread
  assert r.results == [f"threads:{threads}:gemm_fusion_1:256:0:{per_thread} 0 failures=0"]
  assert r.counters["launches_seen"] == total
  assert r.counters["launches_shaped"] == total
  assert r.counters["launches_dlsym"] == total
  dyns = r.launch_dyn("gemm_fusion_1")
  assert len(dyns) == total and set(dyns) == {75777}
  assert len({x["tid"] for x in r.launches}) == threads


def test_region_policy_applies_between_begin_and_end(fake, tmp_path):
  r = harness.run_app(
    fake,
    "dlopen",
    [
      "launch:loop_fusion_7:128:0",
      "region_begin:7:2",
      "launch:loop_fusion_7:128:0",
      "region_begin:9:0",  # plan value for region 9: 1 block
      "launch:loop_fusion_7:128:0",
      "region_end:9",
      "region_end:7",
      "launch:loop_fusion_7:128:0",
    ],
    rules=rules("region\t9\tblocks_per_sm\t1"),
    tmp=tmp_path,
  )
  assert r.launch_dyn("loop_fusion_7") == [0, 233472 // 3 + 1 - 1024, 233472 // 2 + 1 - 1024, 0]
  assert r.counters["regions_entered"] == 2
  assert r.counters["launches_in_region"] == 2


def test_stream_region_caps_only_its_stream_and_a_stale_one_is_closed(fake, tmp_path):
  # XLA's region thunks pass their stream: launches of the same thread on another
  # stream are not capped. A region whose end never ran (a failed execution) is closed
  # when it begins again on its stream.
  r = harness.run_app(
    fake,
    "dlopen",
    [
      "stream",
      "stream",
      "region_begin_on:7:2:0",
      "launchon:gemm_fusion_1:256:0:0",
      "launchon:gemm_fusion_1:256:0:1",
      "region_end:7",
      "launchon:gemm_fusion_1:256:0:0",
      "region_begin_on:7:2:0",  # its end never runs
      "region_begin_on:7:2:0",  # the next step
      "region_end:7",
      "launchon:gemm_fusion_1:256:0:0",
    ],
    tmp=tmp_path,
  )
  assert r.returncode == 0, r.stderr
  # No plan: the region makes room for NCCL's channel on the H100 (82,240 B of shared
  # memory), which only a cap of 1 leaves: 116864 (913 units) - 127 - 1024 static - 1024.
  assert r.launch_dyn("gemm_fusion_1") == [116864 - 127 - 2048, 0, 0, 0]
  assert r.results[-2] == "region_end:7 0"  # no frame left open


def test_region_works_without_rules(fake, tmp_path):
  r = harness.run_app(
    fake, "direct", ["region_begin:3:4", "launch:loop_fusion_7:128:0", "region_end:3"], tmp=tmp_path
  )
  # Cap 4, lowered to 1: the only cap that leaves room for NCCL's channel (comm_block auto).
  assert r.launch_dyn("loop_fusion_7") == [116864 - 127 - 1024]
  assert r.counters["launches_no_room"] == 0


def test_graph_kernel_nodes_are_shaped(fake, tmp_path):
  r = harness.run_app(
    fake,
    "dlopen",
    ["graph:gemm_fusion_1:256:0", "graphset:gemm_fusion_1:256:0"],
    rules=rules("kernel\tglob\tgemm_fusion_*\tblocks_per_sm\t2"),
    tmp=tmp_path,
  )
  assert [int(x["dyn"]) for x in r.launches] == [75777, 75777]
  assert r.counters["graph_nodes_seen"] == 2
  assert r.counters["graph_nodes_shaped"] == 2


@pytest.mark.parametrize("mode", ["direct", "dlopen", "procaddr"])
def test_every_kernel_node_api_is_shaped(fake, mode, tmp_path):
  # XLA's command buffers may create kernel nodes through cuGraphAddKernelNode or the
  # generic node API (cuGraphAddNode), and update them through either family.
  actions = [
    "graph:gemm_fusion_1:256:0",
    "kset:gemm_fusion_1:256:0",
    "node:gemm_fusion_1:256:0",
    "nodeset:gemm_fusion_1:256:0",
    "execnodeset:gemm_fusion_1:256:0",
    "node:nccl_proxy:640:0",  # a kernel node no rule selects
    "node:gemm_fusion_1:256:0:2",  # a memset node: passed through untouched
  ]
  r = harness.run_app(
    fake, mode, actions, rules=rules("kernel\tglob\tgemm_fusion_*\tblocks_per_sm\t2"), tmp=tmp_path
  )
  assert r.returncode == 0, r.stderr
  assert [x.split()[1] for x in r.results] == ["0"] * len(actions)
  kernel_nodes = [x for x in r.launches if "func" in x]
  assert [x["func"] for x in kernel_nodes] == ["gemm_fusion_1"] * 5 + ["nccl_proxy"]
  assert [int(x["dyn"]) for x in kernel_nodes] == [75777] * 5 + [0]
  assert any(x.get("type") == "2" for x in r.launches)  # the memset node reached the driver
  assert all("caller_dyn_kept=1" in x for x in r.results if "node" in x.split()[0])
  assert r.counters["graph_nodes_seen"] == 6
  assert r.counters["graph_nodes_shaped"] == 5
  apis = {x["api"] for x in kernel_nodes}
  assert {"cuGraphAddNode_v2", "cuGraphNodeSetParams", "cuGraphExecNodeSetParams"} <= apis
  assert "cuGraphKernelNodeSetParams_v2" in apis


@pytest.mark.parametrize("mode", ["direct", "dlopen", "procaddr"])
def test_cooperative_kernel_launches_are_counted_not_shaped(fake, mode, tmp_path):
  r = harness.run_app(
    fake,
    mode,
    ["coop:gemm_fusion_1:256:0"],
    rules=rules("kernel\tglob\tgemm_fusion_*\tblocks_per_sm\t1"),
    tmp=tmp_path,
  )
  assert r.returncode == 0, r.stderr
  assert r.launch_dyn("gemm_fusion_1") == [0]
  assert r.counters["launches_seen"] == 1
  assert r.counters["launches_skipped"] == 1
  assert r.counters["launches_shaped"] == 0
  assert r.counters[PATH_COUNTER[mode]] == 1
  if mode == "procaddr":  # the per-thread-default-stream variant
    assert r.launches[0]["api"] == "cuLaunchCooperativeKernel_ptsz"


def test_stream_priority_promotes_requested_and_listed_streams(fake, tmp_path):
  r = harness.run_app(
    fake,
    "dlopen",
    ["stream", "streamprio:-1", "stream", "streamprio:0"],
    rules=rules(
      "streams\tpriority\thighest", "streams\tpromote_requested\t1", "streams\tcreate_order\t2"
    ),
    tmp=tmp_path,
  )
  prios = [x.split("priority=")[1] for x in r.results]
  assert prios == ["0", "-5", "-5", "0"]  # -5: greatest of the fake's range
  assert r.counters["streams_created"] == 4
  assert r.counters["streams_promoted"] == 2


def test_rules_can_be_replaced_at_run_time(fake, tmp_path):
  path = tmp_path / "rules.txt"
  path.write_text(rules("kernel\tglob\tloop_*\tblocks_per_sm\t1"))
  r = harness.run_app(
    fake,
    "dlopen",
    ["launch:loop_fusion_7:128:0", f"rules:{path}", "launch:loop_fusion_7:128:0"],
    tmp=tmp_path,
  )
  assert r.results[1].endswith(" 0")
  assert r.launch_dyn("loop_fusion_7") == [0, 233472 // 2 + 1 - 1024]


def test_bad_rule_lines_are_reported_and_ignored(fake, tmp_path):
  r = harness.run_app(
    fake,
    "dlopen",
    ["launch:loop_fusion_7:128:0"],
    rules=rules(
      "kernel\tglob\tloop_*\tblocks_per_sm\t0",
      "kernel\tregex\t(\tblocks_per_sm\t1",
      "bogus line",
      "kernel\tglob\tloop_*\tblocks_per_sm\t1",
    ),
    tmp=tmp_path,
  )
  assert r.returncode == 0
  assert "3 line(s) ignored" in r.stderr
  assert r.launch_dyn("loop_fusion_7") == [233472 // 2 + 1 - 1024]


def test_verbose_logs_and_prints_counters_at_exit(fake, tmp_path):
  r = harness.run_app(
    fake,
    "dlopen",
    ["launch:gemm_fusion_1:256:0"],
    rules=rules("kernel\tglob\tgemm_fusion_*\tblocks_per_sm\t2"),
    env={"JAX_OVERLAP_RT_VERBOSE": "2"},
    tmp=tmp_path,
  )
  assert "counters: launches_seen=1 launches_shaped=1" in r.stderr
  assert "[jax_overlap_rt pid=" in r.stderr and " tid=" in r.stderr
  assert "kernel gemm_fusion_1: static smem 1024, 32 regs" in r.stderr


def test_verbose_exit_lists_rules_that_matched_no_kernel(fake, tmp_path):
  # One rule names a launched kernel; the other is an HLO instruction name, which the
  # driver never reports ('.' is '_' in kernel names).
  r = harness.run_app(
    fake,
    "dlopen",
    ["launch:gemm_fusion_1:256:0", "launch:gemm_fusion_1:256:0"],
    rules=rules(
      "kernel\tglob\tgemm_fusion_*\tblocks_per_sm\t2",
      "kernel\tglob\tloop_fusion.7\tblocks_per_sm\t1",
    ),
    env={"JAX_OVERLAP_RT_VERBOSE": "1"},
    tmp=tmp_path,
  )
  assert r.returncode == 0
  assert "1 of 2 kernel rule(s) matched no kernel: loop_fusion.7\n" in r.stderr
  quiet = harness.run_app(
    fake,
    "dlopen",
    ["launch:gemm_fusion_1:256:0"],
    rules=rules("kernel\tglob\tgemm_fusion_*\tblocks_per_sm\t2"),
    env={"JAX_OVERLAP_RT_VERBOSE": "1"},
    tmp=tmp_path,
  )
  assert "matched no kernel" not in quiet.stderr


# ---------------------------------------------------------------------------
# Fuzzing the arithmetic (C, through ctypes) and end to end (fake driver).
# ---------------------------------------------------------------------------


def _random_gpu(rng: np.random.Generator) -> targets.Gpu:
  base = targets.get_gpu(rng.choice(["a40", "a100", "h100", "h200"]))
  smem_per_sm = int(rng.choice([64, 96, 100, 164, 228, 256])) * 1024
  reserved = int(rng.choice([0, 1024]))
  return dataclasses.replace(
    base,
    smem_per_sm=smem_per_sm,
    # Real parts: opt-in = per-SM shared memory minus the per-block reservation.
    smem_per_block_optin=smem_per_sm - reserved - int(rng.choice([0, 3072])),
    smem_reserved_per_block=reserved,
    max_threads_per_sm=int(rng.choice([1024, 1536, 2048])),
    max_blocks_per_sm=int(rng.choice([16, 24, 32])),
  )


def test_fuzz_shaping_never_exceeds_device_limits(rt):
  rng = np.random.default_rng(20261129)
  status = ctypes.c_int()
  n_cases = 12000
  shaped = capped = 0
  rooms = [0, 0]
  for _ in range(n_cases):
    gpu = _random_gpu(rng)
    lim = runtime.DeviceLimits.from_gpu(gpu)
    threads = int(rng.integers(1, 1025))
    regs = int(rng.integers(0, 129)) if rng.random() < 0.9 else int(rng.integers(129, 256))
    static = (
      int(rng.integers(0, 16 * 1024 + 1))
      if rng.random() < 0.8
      else int(rng.integers(0, 48 * 1024 + 1))
    )
    room = max(1, gpu.smem_per_block_optin - static + 1)
    dyn = (
      int(rng.integers(0, min(room, 8 * 1024)))
      if rng.random() < 0.8
      else int(rng.integers(0, room))
    )
    n = int(rng.integers(1, 9)) if rng.random() < 0.9 else int(rng.integers(9, 33))
    new = rt.jor_shaped_dynamic_smem(
      ctypes.byref(lim), threads, regs, static, dyn, n, ctypes.byref(status)
    )
    st = status.value
    assert st in (0, 1, 2), (st, gpu, threads, regs, static, dyn, n)
    assert new >= dyn
    if new != dyn:
      # A shaped launch never exceeds a device limit.
      assert static + new <= gpu.smem_per_block_optin
      assert static + new + gpu.smem_reserved_per_block <= gpu.smem_per_sm
    resident = rt.jor_blocks_per_sm(ctypes.byref(lim), threads, regs, static + new)
    if st == 1:
      shaped += 1
      assert resident <= n
      if new - 1 >= dyn:
        assert rt.jor_blocks_per_sm(ctypes.byref(lim), threads, regs, static + new - 1) > n
    elif st == 2:
      capped += 1
      assert static + new == gpu.smem_per_block_optin
    else:
      assert new == dyn
    # Python mirror agrees with C.
    assert residency.shaped_dynamic_smem(gpu, threads, regs, static, dyn, n) == new
    assert residency.blocks_per_sm(gpu, threads, regs, static + new) == resident
    comm = plan_lib.CommBlock(
      int(rng.choice([128, 288, 544, 640])),
      int(rng.choice([0, 64, 96])),
      int(rng.choice([0, 8192, 41280, 82240])),
    )
    cc = runtime.CommBlock(*dataclasses.astuple(comm))
    reasons = ctypes.c_int()
    c_room = rt.jor_room_cap(
      ctypes.byref(lim), ctypes.byref(cc), threads, regs, static, dyn, n, ctypes.byref(reasons)
    )
    py_room, why = residency.room_cap(gpu, comm, threads, regs, static, dyn, n)
    assert c_room == py_room, (gpu, comm, threads, regs, static, dyn, n)
    bits = {"threads": 1, "registers": 2, "shared_memory": 4, "blocks": 8}
    assert reasons.value == sum(bits[w] for w in why)
    rooms[py_room > 0] += 1
  # The fuzz reaches every branch.
  assert shaped > n_cases // 10 and capped + shaped < n_cases
  assert min(rooms) > n_cases // 20, rooms


def test_fuzz_end_to_end_through_the_fake_driver(fake, tmp_path):
  rng = np.random.default_rng(7)
  funcs, actions = [], []
  for i in range(60):
    static = int(rng.integers(0, 48 * 1024))
    regs = int(rng.integers(16, 65))
    funcs.append(f"f{i}:static={static}:regs={regs}")
    threads = int(rng.choice([64, 128, 256, 512, 1024]))
    dyn = int(rng.integers(0, 48 * 1024 - static + 1))
    actions.append(f"launch:f{i}:{threads}:{dyn}")
  text = rules(
    *[f"kernel\tglob\tf{i}\tblocks_per_sm\t{int(rng.integers(1, 9))}" for i in range(60)]
  )
  for device in ("a100", "h100"):
    r = harness.run_app(
      fake,
      "dlopen",
      actions,
      rules=text,
      funcs=";".join(funcs),
      env={"FAKE_CUDA_DEVICE": device},
      tmp=tmp_path,
    )
    assert r.returncode == 0
    assert all(x.endswith("failures=0") for x in r.results), r.results
    assert r.counters["launches_fallback"] == 0
    assert all(x["result"] == "0" for x in r.launches)


def _random_kernels(rng, n):
  """Kernels that can run at all: (threads, regs, static, dyn, cap)."""
  out = []
  while len(out) < n:
    threads = int(rng.integers(1, 33)) * 32
    regs = int(rng.integers(16, 256))
    if regs * threads > 65536:
      continue
    static = int(rng.integers(0, 16 * 1024))
    dyn = int(rng.integers(0, 48 * 1024 - static + 1))
    out.append((threads, regs, static, dyn, int(rng.integers(1, 17))))
  return out


def test_fuzz_ten_thousand_kernels_against_the_drivers_occupancy_rules(fake, tmp_path):
  # 10,000 random kernels launched through the library and the fake driver, whose
  # occupancy follows NVIDIA's published rules (registers per sub-partition, allocation
  # units), written apart from the library's arithmetic. Each kernel's residency as
  # launched and as written (the run without the library) comes from the driver's log.
  kernels = _random_kernels(np.random.default_rng(11), 10_000)
  chunk = 250  # kernels per process (the fake driver holds 256 functions)
  seen = padded = capped = 0
  for device in ("h100", "a100"):
    for start in range(0, len(kernels) // 2 if device == "a100" else len(kernels), chunk):
      part = kernels[start : start + chunk]
      funcs = ";".join(f"k{i}:static={s}:regs={g}" for i, (_, g, s, _, _) in enumerate(part))
      actions = [f"launch:k{i}:{t}:{d}" for i, (t, _, _, d, _) in enumerate(part)]
      text = rules(*[f"kernel\tglob\tk{i}\tblocks_per_sm\t{c}" for i, (*_, c) in enumerate(part)])
      env = {"FAKE_CUDA_DEVICE": device}
      plain = harness.run_app(
        fake, "dlopen", actions, preload=False, funcs=funcs, env=env, tmp=tmp_path
      )
      shaped = harness.run_app(
        fake, "dlopen", actions, rules=text, funcs=funcs, env=env, tmp=tmp_path
      )
      assert plain.returncode == shaped.returncode == 0, shaped.stderr[-500:]
      natural = {x["func"]: int(x["occ"]) for x in plain.launches}
      ok = [x for x in shaped.launches if x["result"] == "0"]
      # No launch exceeds a device limit: every kernel launched once, successfully.
      assert len(ok) == len(part) and shaped.counters["launches_fallback"] == 0
      for x in ok:
        i = int(x["func"][1:])
        threads, regs, static, dyn, cap = part[i]
        occ, launched = int(x["occ"]), int(x["dyn"])
        seen += 1
        if natural[x["func"]] <= cap:
          assert launched == dyn, (device, part[i], natural[x["func"]])  # not padded
          continue
        padded += 1
        if occ > cap:  # only when even the opt-in limit cannot bring it down
          capped += 1
          assert static + launched >= (232448 if device == "h100" else 166912) - 127, part[i]
        assert launched > dyn
  assert seen == 15_000
  assert padded > 1000 and capped < padded // 10


_LIMITS = {
  "h100": dict(smem_sm=233472, threads_sm=2048, regs_sm=65536, blocks_sm=32, cc=(9, 0)),
  "a100": dict(smem_sm=167936, threads_sm=2048, regs_sm=65536, blocks_sm=32, cc=(8, 0)),
}


def _sm_wide_fits(device, blocks, threads, regs, smem_total, comm):
  """Independent, necessary condition for room: SM-wide sums of ``blocks`` compute blocks
  and one communication block within each per-SM limit (registers per warp in units of
  256, shared memory per block with its 1 KB reservation in units of 128 B)."""
  lim = _LIMITS[device]

  def warps(t):
    return -(-t // 32)

  def regs_of(t, r):
    return warps(t) * (-(-r * 32 // 256) * 256)

  def smem_of(b):
    return -(-(b + 1024) // 128) * 128

  return (
    blocks * warps(threads) * 32 + warps(comm.threads) * 32 <= lim["threads_sm"]
    and blocks * regs_of(threads, regs) + regs_of(comm.threads, comm.regs_per_thread)
    <= lim["regs_sm"]
    and blocks * smem_of(smem_total) + smem_of(comm.smem_bytes) <= lim["smem_sm"]
    and blocks + 1 <= lim["blocks_sm"]
  )


def test_caps_make_room_for_the_communication_block(fake, tmp_path):
  # comm_block auto: NCCL's channel on the device (544 threads, 96 registers, 82,240 B).
  funcs = "gemm_like:static=0:regs=168:maxdyn=200000;small:static=0:regs=32;mid:static=0:regs=64"
  actions = [
    "launch:gemm_like:384:200000",  # Hopper GEMM tile: needs the whole register file
    "launch:small:128:0",  # cap 4 leaves no shared memory for the channel; 1 does
    "launch:mid:256:0",  # 8 warps x 2048 registers: no sub-partition room beside 17 warps
  ]
  text = rules(
    "kernel\tglob\tgemm_like\tblocks_per_sm\t1",
    "kernel\tglob\tsmall\tblocks_per_sm\t4",
    "kernel\tglob\tmid\tblocks_per_sm\t2",
    "comm_block\tauto",
  )
  r = harness.run_app(fake, "dlopen", actions, rules=text, funcs=funcs, tmp=tmp_path)
  assert r.returncode == 0, r.stderr
  assert r.launch_dyn("gemm_like") == [200000]  # left alone
  assert r.launch_dyn("small") == [116864 - 127 - 1024]  # capped at 1, not 4
  assert r.launch_dyn("mid") == [0]
  assert r.counters["launches_no_room"] == 2
  assert r.counters["no_room_registers"] == 2
  assert r.counters["no_room_smem"] == 1  # the GEMM tile's 200 KB as well
  assert r.counters["launches_shaped"] == 1
  # NCCL_NTHREADS=256 (288 threads with the sync warp) leaves registers for `mid`.
  r = harness.run_app(
    fake, "dlopen", actions, rules=text, funcs=funcs, env={"NCCL_NTHREADS": "256"}, tmp=tmp_path
  )
  assert r.launch_dyn("mid") == [116864 - 127 - 1024]
  assert r.counters["launches_no_room"] == 1
  # The same answers from the Python mirror.
  gpu = targets.get_gpu("h100")
  assert residency.room_cap(gpu, plan_lib.CommBlock.nccl(gpu, 544), 256, 64, 0, 0, 2) == (
    0,
    ("registers",),
  )
  assert residency.room_cap(gpu, plan_lib.CommBlock.nccl(gpu, 288), 256, 64, 0, 0, 2) == (1, ())
  # comm_block none: caps as written.
  r = harness.run_app(
    fake, "dlopen", actions, rules=text.replace("auto", "none"), funcs=funcs, tmp=tmp_path
  )
  assert r.counters["launches_no_room"] == 0
  assert r.launch_dyn("small") == [46720 - 127 - 1024]


def test_nccl_comm_block_matches_the_library(rt):
  out = runtime.CommBlock()
  for gpu in ("a40", "a100", "h100", "h200"):
    g = targets.get_gpu(gpu)
    for n in (288, 544, 640):
      assert rt.jor_nccl_comm_block(*g.compute_capability, n, ctypes.byref(out)) == 1
      assert (out.threads, out.regs_per_thread, out.smem_bytes) == dataclasses.astuple(
        plan_lib.CommBlock.nccl(g, n)
      )
  assert rt.jor_nccl_comm_block(6, 0, 544, ctypes.byref(out)) == 0


def test_fuzz_room_through_the_fake_driver(fake, tmp_path):
  # Random kernels and caps under comm_block auto, through the launch path. Per launch:
  # the library and its Python mirror agree on the cap (or on leaving it alone); the
  # driver's own occupancy (written apart from the library) is at most that cap; and an
  # independent SM-wide sum shows the communication block fitting beside the blocks.
  rng = np.random.default_rng(29)
  kernels = _random_kernels(rng, 3000)
  chunk = 250
  no_room = lowered = 0
  for device in ("h100", "a100"):
    gpu = targets.get_gpu(device)
    comm = plan_lib.CommBlock.nccl(gpu)
    for start in range(0, len(kernels), chunk):
      part = kernels[start : start + chunk]
      funcs = ";".join(f"k{i}:static={s}:regs={g}" for i, (_, g, s, _, _) in enumerate(part))
      actions = [f"launch:k{i}:{t}:{d}" for i, (t, _, _, d, _) in enumerate(part)]
      text = rules(
        *[f"kernel\tglob\tk{i}\tblocks_per_sm\t{c}" for i, (*_, c) in enumerate(part)],
        "comm_block\tauto",
      )
      env = {"FAKE_CUDA_DEVICE": device, "NCCL_NTHREADS": ""}
      r = harness.run_app(fake, "dlopen", actions, rules=text, funcs=funcs, env=env, tmp=tmp_path)
      assert r.returncode == 0 and r.counters["launches_fallback"] == 0, r.stderr[-500:]
      expect_no_room = 0
      for x in r.launches:
        i = int(x["func"][1:])
        threads, regs, static, dyn, cap = part[i]
        occ, launched = int(x["occ"]), int(x["dyn"])
        room, why = residency.room_cap(gpu, comm, threads, regs, static, dyn, cap)
        natural = residency.blocks_per_sm(gpu, threads, regs, static + dyn)
        if natural == 0:  # cannot run at all (registers per sub-partition): left alone
          assert launched == dyn and room == 0 and why == () and occ == 0
          continue
        if room == 0:
          expect_no_room += 1
          assert launched == dyn and why, (device, part[i])
          # Independent: if the SM-wide sums fit at one block, registers per
          # sub-partition or the padding's shared memory are what stand in the way.
          if _sm_wide_fits(device, 1, threads, regs, static + dyn, comm):
            assert set(why) & {"registers", "shared_memory"}, (part[i], why)
          continue
        assert room <= cap
        if room < natural:
          lowered += room < cap
          assert launched > dyn and occ <= room, (device, part[i], room, occ)
        else:
          assert launched == dyn
        assert _sm_wide_fits(device, occ, threads, regs, static + launched, comm), part[i]
      no_room += expect_no_room
      assert r.counters["launches_no_room"] == expect_no_room
  assert no_room > 500 and lowered > 100, (no_room, lowered)


# ---------------------------------------------------------------------------
# status() from Python.
# ---------------------------------------------------------------------------


def test_status_when_not_loaded(monkeypatch):
  monkeypatch.delenv("JAX_OVERLAP_RT_PLAN", raising=False)
  s = public_runtime.status()
  assert s.loaded is False
  assert s.counters == runtime.Counters()
  assert s.plan is None


def test_status_reads_counters_of_a_preloaded_library(tmp_path):
  plan_path = tmp_path / "plan.json"
  public_runtime.Plan(kernels=[{"match": "gemm_*", "blocks_per_sm": 2}]).to_json(plan_path)
  code = (
    "import json; from jax_overlap import runtime; s = runtime.status(); "
    "print(json.dumps([s.loaded, s.library, s.rules, s.plan is not None, "
    "s.counters.launches_seen, s.counters.by_path, s.rule_functions, s.unmatched_rules]))"
  )
  env = dict(os.environ)
  env.update(
    LD_PRELOAD=str(runtime.library_path()),
    JAX_OVERLAP_RT_PLAN=str(plan_path),
    JAX_OVERLAP_RT_RULES=public_runtime.Plan.from_json(plan_path).to_rules(),
  )
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
  )
  assert out.returncode == 0, out.stderr
  loaded, library, n_rules, has_plan, seen, by_path, functions, unmatched = __import__(
    "json"
  ).loads(out.stdout)
  assert loaded is True
  assert library.endswith("libjax_overlap_rt.so")
  assert n_rules == 1 and has_plan is True
  assert seen == 0 and by_path == {"direct": 0, "dlsym": 0, "cuGetProcAddress": 0}
  # Nothing launched: the one rule has selected no kernel yet.
  assert functions == {"gemm_*": 0} and unmatched == ["gemm_*"]


def test_counter_names_match_the_library(rt):
  names = [rt.jor_counter_name(i).decode() for i in range(rt.jor_counter_count())]
  assert tuple(names) == tuple(f.name for f in dataclasses.fields(runtime.Counters))


def test_procaddr_answers_that_are_not_exported_symbols_are_hooked(fake, tmp_path):
  r = harness.run_app(
    fake,
    "procaddr",
    ["launch:gemm_fusion_1:256:0:2", "launchex:gemm_fusion_1:256:0"],
    rules=rules("kernel\tglob\tgemm_fusion_*\tblocks_per_sm\t2"),
    env={"FAKE_CUDA_VERSIONED_PROCS": "1"},
    tmp=tmp_path,
  )
  assert [x["api"] for x in r.launches] == ["cuLaunchKernel_v2_internal"] * 2 + [
    "cuLaunchKernelEx_v2_internal"
  ]
  assert r.launch_dyn("gemm_fusion_1") == [75777] * 3
  assert r.counters["launches_procaddr"] == 3
  assert r.counters["lookups_unhooked"] == 0


def test_region_ends_out_of_order_close_the_right_region(fake, tmp_path):
  # XLA may order an unused forward-pass end after a backward-pass begin.
  r = harness.run_app(
    fake,
    "dlopen",
    [
      "region_begin:7:2",
      "region_begin:9:1",
      "region_end:7",
      "launch:loop_fusion_7:128:0",
      "region_end:9",
      "region_end:9",  # unbalanced: reported, not fatal
      "launch:loop_fusion_7:128:0",
    ],
    env={"JAX_OVERLAP_RT_VERBOSE": "1"},
    tmp=tmp_path,
  )
  assert r.returncode == 0
  assert r.launch_dyn("loop_fusion_7") == [233472 // 2 + 1 - 1024, 0]
  assert "region 9 end without begin" in r.stderr


def test_dlsym_rtld_next_keeps_glibc_semantics(fake, tmp_path):
  # From the program, the next definition after it is the preloaded library's.
  r = harness.run_app(
    fake, "dlopen", ["next:cuLaunchKernel", "next:puts", "next:no_such_symbol"], tmp=tmp_path
  )
  assert r.returncode == 0, r.stderr
  assert r.results[0].endswith("object=libjax_overlap_rt.so")
  assert r.results[1].endswith("object=libc.so.6")
  assert r.results[2].endswith("object=none")


@pytest.mark.parametrize("mode", ["direct", "dlopen", "procaddr"])
def test_module_unload_forgets_cached_kernels(fake, tmp_path, mode):
  # After an unload, a new kernel at the same handle has 8 KB of static shared memory.
  r = harness.run_app(
    fake,
    mode,
    ["launch:k:256:0", "unload", "launch:k:256:0"],
    rules=rules("kernel\tglob\tk\tblocks_per_sm\t2"),
    funcs="k:static=1024:regs=32",
    env={"FAKE_CUDA_FUNCS_AFTER_UNLOAD": "k:static=8192:regs=32"},
    tmp=tmp_path,
  )
  assert r.launch_dyn("k") == [233472 // 3 + 1 - 1024 - 1024, 233472 // 3 + 1 - 8192 - 1024]
