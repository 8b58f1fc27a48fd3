// The gap between one kernel's end and the next one's start: back to back on one stream,
// and on a second stream behind a CUDA event (what a collective that waits on its
// producer sees), launched one by one and replayed from a CUDA graph.
//
// The simulator assumes both (sim.Constants launch_overhead_s and event_latency_s), and
// its tensor-parallel results rest on the event being the slower of the two: the next
// compute kernel then reaches the dispatcher before the collective (docs/runtime.md,
// "Simulator constants"). Each kernel is one block whose first thread reads the GPU's
// global timer (%globaltimer, nanoseconds) when it starts and after spinning for a while,
// so that the second kernel is queued long before the first ends; the gap is the second
// kernel's start minus the first one's end, on the same clock.
//
// Output (--out FILE, and stdout): {"version": 1, "device": ..., "timer_resolution_ns":
// smallest nonzero step seen, "cases": {name: {"median_s", "p10_s", "p90_s", "n"}}}.
// --list: the cases without touching a GPU.
//
// Build: nvcc -O3 -std=c++17 -arch=sm_90 -o launch_gaps launch_gaps.cu
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <vector>

#define CHECK_PROGRAM "launch_gaps"
#include "cuda_check.h"

__device__ __forceinline__ uint64_t GlobalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// out[0] = start, out[1] = end (ns on the global timer).
extern "C" __global__ void stamp(uint64_t* out, uint64_t spin_ns) {
  if (threadIdx.x != 0) return;
  const uint64_t t0 = GlobalTimer();
  uint64_t t = t0;
  while (t - t0 < spin_ns) t = GlobalTimer();
  out[0] = t0;
  out[1] = t;
}

// out[0] = the smallest nonzero step of the global timer over many reads.
extern "C" __global__ void timer_step(uint64_t* out) {
  uint64_t best = ~0ull, prev = GlobalTimer();
  for (int i = 0; i < 100000; ++i) {
    const uint64_t t = GlobalTimer();
    if (t != prev && t - prev < best) best = t - prev;
    prev = t;
  }
  out[0] = best;
}

// Case c: the second kernel on another stream behind an event when c is odd, the pair
// replayed from a CUDA graph when c >= 2.
constexpr const char* kCases[] = {"same_stream", "event_other_stream", "graph_same_stream",
                                  "graph_event_other_stream"};
constexpr int kNumCases = sizeof(kCases) / sizeof(kCases[0]);

struct Stats {
  double median, p10, p90;
  size_t n;
};

Stats Summarise(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[(size_t)(q * (v.size() - 1))]; };
  return {at(0.5), at(0.1), at(0.9), v.size()};
}

// Enqueues A on s1, then B on s1 (same stream) or on s2 behind an event recorded after A.
void Enqueue(bool other, cudaStream_t s1, cudaStream_t s2, cudaEvent_t ev, uint64_t* a,
             uint64_t* b, uint64_t spin_ns) {
  stamp<<<1, 32, 0, s1>>>(a, spin_ns);
  if (other) {
    CHECK(cudaEventRecord(ev, s1));
    CHECK(cudaStreamWaitEvent(s2, ev, 0));
    stamp<<<1, 32, 0, s2>>>(b, spin_ns);
  } else {
    stamp<<<1, 32, 0, s1>>>(b, spin_ns);
  }
  CHECK(cudaGetLastError());
}

int main(int argc, char** argv) {
  const char* out = nullptr;
  bool list = false;
  int reps = 300;
  uint64_t spin_ns = 50000;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--list")) list = true;
    else if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
    else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: launch_gaps [--list] [--out FILE] [--reps R]\n");
      return 2;
    }
  }
  if (reps < 10) {
    fprintf(stderr, "launch_gaps: --reps must be at least 10, got %d\n", reps);
    return 2;
  }
  std::string json = "{\"version\": 1, ";
  if (list) {
    json += "\"device\": null, \"measured\": false, \"cases\": {";
    for (int c = 0; c < kNumCases; ++c)
      json += std::string(c ? ", " : "") + "\"" + kCases[c] + "\": null";
    json += "}}\n";
  } else {
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    cudaStream_t s1, s2;
    CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    cudaEvent_t ev;
    CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    uint64_t* d = nullptr;
    CHECK(cudaMalloc(&d, 4 * sizeof(uint64_t)));
    uint64_t h[4];
    timer_step<<<1, 1>>>(d);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(h, d, sizeof(uint64_t), cudaMemcpyDeviceToHost));
    const uint64_t resolution = h[0];
    json += "\"device\": \"" + std::string(prop.name) + "\", \"measured\": true, \"spin_ns\": " +
            std::to_string(spin_ns) + ", \"cases\": {";
    for (int c = 0; c < kNumCases; ++c) {
      const bool other = c % 2 == 1, graph = c >= 2;
      cudaGraph_t g = nullptr;
      cudaGraphExec_t exec = nullptr;
      cudaEvent_t fork = nullptr;
      if (graph) {
        CHECK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
        if (other) {
          // Fork s2 into the capture, as XLA's command buffers do for async streams.
          CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
          CHECK(cudaEventRecord(fork, s1));
          CHECK(cudaStreamWaitEvent(s2, fork, 0));
          Enqueue(true, s1, s2, ev, d, d + 2, spin_ns);
          CHECK(cudaEventRecord(fork, s2));
          CHECK(cudaStreamWaitEvent(s1, fork, 0));
        } else {
          Enqueue(false, s1, s2, ev, d, d + 2, spin_ns);
        }
        CHECK(cudaStreamEndCapture(s1, &g));
        CHECK(cudaGraphInstantiate(&exec, g, 0));
      }
      std::vector<double> gaps;
      for (int r = 0; r < reps + 5; ++r) {
        if (graph) CHECK(cudaGraphLaunch(exec, s1));
        else Enqueue(other, s1, s2, ev, d, d + 2, spin_ns);
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost));
        if (r >= 5) gaps.push_back(((double)h[2] - (double)h[1]) * 1e-9);  // warm-up left out
      }
      if (graph) {
        CHECK(cudaGraphExecDestroy(exec));
        CHECK(cudaGraphDestroy(g));
        if (fork) CHECK(cudaEventDestroy(fork));
      }
      Stats s = Summarise(gaps);
      char buf[256];
      snprintf(buf, sizeof(buf),
               "%s\"%s\": {\"median_s\": %.4g, \"p10_s\": %.4g, \"p90_s\": %.4g, \"n\": %zu}",
               c ? ", " : "", kCases[c], s.median, s.p10, s.p90, s.n);
      json += buf;
    }
    json += "}, \"timer_resolution_ns\": " + std::to_string(resolution) + "}\n";
  }
  if (out) {
    FILE* f = fopen(out, "w");
    if (!f) {
      perror(out);
      return 1;
    }
    fputs(json.c_str(), f);
    fclose(f);
  }
  fputs(json.c_str(), stdout);
  return 0;
}
