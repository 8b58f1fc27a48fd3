// Compute beside a communication-sized copy, under occupancy caps and stream priority.
//
// The sweep: compute kernel kind x cap x priority x issue order, each beside a proxy for
// an NCCL channel on a second stream:
//   kinds     gemm        cuBLAS bf16 GEMM (dlopen; skipped when cuBLAS is not found)
//             loop_fusion an XLA-loop-fusion-like elementwise kernel: 256 threads, a
//                         few registers, many blocks per SM, many waves
//             attention   an attention-like tile kernel: 128 threads, 48 KB of dynamic
//                         shared memory per block (a K/V tile), several blocks per SM
//   caps      none, 1, 2, 4 blocks per SM, applied by the runtime library
//             (jor_set_rules; needs LD_PRELOAD=libjax_overlap_rt.so) with comm_block
//             none: caps as written, also where they leave no room for the proxy
//   priority  off, on (proxy stream at the greatest priority)
//   issue     compute_first (the proxy launched after the compute kernel, as XLA orders a
//             collective that waited on an event behind compute already queued) and
//             proxy_first (the proxy launched first): the order in which the two kernels
//             reach the block dispatcher
// The proxy has an NCCL channel's footprint: built with __launch_bounds__(640, 1) (at
// most 96 registers), launched with 544 threads (NCCL's Simple protocol) and 82,240
// bytes of dynamic shared memory (ncclShmemDynamicSize on sm_80+), copying device
// memory with streaming loads and stores. Inputs are random.
//
// Output (--out FILE, and stdout): the measurement format sim.calibrate reads,
//   {"version": 1, "device": {...}, "baselines": {...}, "records": [...]}
// one record per (kind, cap, priority, issue order) plus one sequential record per kind. With
// --list nothing touches the GPU: the records are written with their configuration
// and null measurements (the dry run of run_all.sh fills those from the simulator).
//
// Build: nvcc -O3 -std=c++17 -arch=sm_90 -o overlap_bench overlap_bench.cu -ldl
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <vector>

#define CHECK_PROGRAM "overlap_bench"
#include "cuda_check.h"
#include "cublas_loader.h"

// ---------------------------------------------------------------------------
// Kernels. extern "C": the names the driver reports are the names here.
// ---------------------------------------------------------------------------

constexpr int kProxyBoundThreads = 640;  // NCCL_MAX_NTHREADS
constexpr int kProxyThreads = 544;       // Simple protocol: 512 + a synchronization warp
constexpr int kProxySmem = 82240;        // ncclShmemDynamicSize, sm_80+
constexpr int kInFlight = 16;            // float4 loads in flight per thread

extern "C" __global__ void __launch_bounds__(kProxyBoundThreads, 1)
    nccl_proxy(const float4* __restrict__ src, float4* __restrict__ dst, size_t per_cta) {
  extern __shared__ float4 stage[];
  const float4* s = src + blockIdx.x * per_cta;
  float4* d = dst + blockIdx.x * per_cta;
  const size_t step = (size_t)blockDim.x * kInFlight;
  for (size_t base = threadIdx.x; base < per_cta; base += step) {
    float4 v[kInFlight];
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      size_t idx = base + (size_t)i * blockDim.x;
      v[i] = idx < per_cta ? __ldcs(s + idx) : make_float4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      size_t idx = base + (size_t)i * blockDim.x;
      if (idx < per_cta) __stcs(d + idx, v[i]);
    }
  }
  if (threadIdx.x == 0) stage[0] = make_float4(0, 0, 0, 0);  // the allocation is real
}

extern "C" __global__ void __launch_bounds__(256)
    loop_fusion(const float4* __restrict__ a, const float4* __restrict__ b,
                float4* __restrict__ c, size_t n, int iters) {
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float4 x = a[i], y = b[i];
  for (int k = 0; k < iters; ++k) {
    x.x = fmaf(x.x, y.x, 0.5f);
    x.y = fmaf(x.y, y.y, 0.5f);
    x.z = fmaf(x.z, y.z, 0.5f);
    x.w = fmaf(x.w, y.w, 0.5f);
  }
  c[i] = x;
}

constexpr int kAttnThreads = 128;
constexpr int kAttnTile = 96;  // keys per tile
constexpr int kAttnDim = 128;  // head dimension: tile of 96 x 128 floats = 48 KB
constexpr int kAttnSmem = kAttnTile * kAttnDim * 4;

// One block: 128 queries of one head against `tiles` K tiles staged in shared memory.
extern "C" __global__ void __launch_bounds__(kAttnThreads)
    attention_like(const float* __restrict__ q, const float* __restrict__ k,
                   float* __restrict__ out, int tiles) {
  extern __shared__ float tile[];
  const float* qrow = q + ((size_t)blockIdx.x * kAttnThreads + threadIdx.x) * kAttnDim;
  float qv[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) qv[j] = qrow[j];
  float acc = 0.f, m = -1e30f;
  for (int t = 0; t < tiles; ++t) {
    const float* kt = k + ((size_t)(blockIdx.x + t) % 64) * kAttnTile * kAttnDim;
    __syncthreads();
    for (int i = threadIdx.x; i < kAttnTile * kAttnDim; i += blockDim.x) tile[i] = kt[i];
    __syncthreads();
    for (int key = 0; key < kAttnTile; ++key) {
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < kAttnDim; j += 8) {
#pragma unroll
        for (int u = 0; u < 8; ++u) s = fmaf(qv[u], tile[key * kAttnDim + j + u], s);
      }
      float nm = fmaxf(m, s);
      acc = acc * __expf(m - nm) + __expf(s - nm);
      m = nm;
    }
  }
  out[(size_t)blockIdx.x * kAttnThreads + threadIdx.x] = acc + m;
}

extern "C" __global__ void fill_random(float* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = scale * ((h & 0xffffff) / 16777216.0f - 0.5f);
  }
}

extern "C" __global__ void to_bf16(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t bits = __float_as_uint(src[i]);
    dst[i] = (uint16_t)(bits >> 16);
  }
}

// cuBLAS through dlopen: cublas_loader.h.

// ---------------------------------------------------------------------------
// Runtime library hooks (present when it is preloaded).
// ---------------------------------------------------------------------------

typedef int (*SetRules)(const char*);
typedef int (*CounterCount)();
typedef const char* (*CounterName)(int);
typedef uint64_t (*CounterValue)(int);

uint64_t RuntimeCounter(const char* name) {
  auto count = reinterpret_cast<CounterCount>(dlsym(RTLD_DEFAULT, "jor_counter_count"));
  auto cname = reinterpret_cast<CounterName>(dlsym(RTLD_DEFAULT, "jor_counter_name"));
  auto value = reinterpret_cast<CounterValue>(dlsym(RTLD_DEFAULT, "jor_counter_value"));
  if (!count || !cname || !value) return 0;
  for (int i = 0; i < count(); ++i)
    if (strcmp(cname(i), name) == 0) return value(i);
  return 0;
}

// ---------------------------------------------------------------------------
// The sweep.
// ---------------------------------------------------------------------------

struct Options {
  int gemm_n = 8192;
  size_t loop_elems = (size_t)1 << 26;  // float4 elements: 1 GiB per array
  int loop_iters = 64;
  int attn_blocks = 132 * 4 * 8;  // 8 waves at 4 blocks per SM on an H100
  int attn_tiles = 16;
  int proxy_ctas = 16;
  size_t proxy_mb = 256;
  int reps = 9;
  bool list = false;
  const char* out = nullptr;
  std::vector<std::string> kinds = {"gemm", "loop_fusion", "attention"};
  std::vector<int> caps = {0, 1, 2, 4};
  std::vector<std::string> issues = {"compute_first", "proxy_first"};
};

struct Compute {
  std::string kind;
  const char* regex = "";
  // Launch description (grid/threads/smem; regs from the driver, 0 before).
  long long grid = 0;
  int threads = 0, regs = 0, static_smem = 0, dyn_smem = 0, natural = 0;
  double flops = 0, bytes = 0;
  int m = 0, n = 0, k = 0;  // gemm
  // Device state.
  Cublas cublas;
  void *a = nullptr, *b = nullptr, *c = nullptr;
  Options* opt = nullptr;

  void Run(cudaStream_t s) {
    if (kind == "gemm") {
      int st = CublasBf16Gemm(cublas, n, a, b, c, s);
      if (st != 0) {
        fprintf(stderr, "overlap_bench: cublasGemmEx failed (%d)\n", st);
        exit(1);
      }
    } else if (kind == "loop_fusion") {
      loop_fusion<<<(unsigned)grid, threads, 0, s>>>(static_cast<float4*>(a),
                                                       static_cast<float4*>(b),
                                                       static_cast<float4*>(c),
                                                       opt->loop_elems, opt->loop_iters);
      CHECK(cudaGetLastError());
    } else {
      attention_like<<<(unsigned)grid, threads, dyn_smem, s>>>(
          static_cast<float*>(a), static_cast<float*>(b), static_cast<float*>(c), opt->attn_tiles);
      CHECK(cudaGetLastError());
    }
  }
};

void Describe(Compute* c, Options& o) {
  c->opt = &o;
  if (c->kind == "gemm") {
    c->regex = "gemm|nvjet|xmma|cutlass|sm90_|sm80_|ampere_";
    c->m = c->n = c->k = o.gemm_n;
    c->flops = 2.0 * o.gemm_n * (double)o.gemm_n * o.gemm_n;
  } else if (c->kind == "loop_fusion") {
    c->regex = "^loop_fusion$";
    c->threads = 256;
    c->grid = (long long)((o.loop_elems + 255) / 256);
    c->flops = 8.0 * o.loop_iters * (double)o.loop_elems;
    c->bytes = 3.0 * 16 * (double)o.loop_elems;
  } else {
    c->regex = "^attention_like$";
    c->threads = kAttnThreads;
    c->dyn_smem = kAttnSmem;
    c->grid = o.attn_blocks;
    c->flops = 2.0 * kAttnDim * kAttnTile * (double)o.attn_tiles * kAttnThreads * o.attn_blocks;
    c->bytes = 4.0 * kAttnTile * kAttnDim * (double)o.attn_tiles * o.attn_blocks;
  }
}

struct Proxy {
  float4 *src = nullptr, *dst = nullptr;
  size_t per_cta = 0;
  int ctas = 0;
  void Run(cudaStream_t s) {
    nccl_proxy<<<ctas, kProxyThreads, kProxySmem, s>>>(src, dst, per_cta);
    CHECK(cudaGetLastError());
  }
};

struct Sample {
  float makespan, proxy, compute;
};

// Compute on stream a and the proxy on stream b, the proxy launched after the compute
// kernel or (proxy_first) before it; or both on a when sequential.
Sample Measure(Compute& comp, Proxy& px, cudaStream_t a, cudaStream_t b, bool sequential,
               bool run_compute, bool run_proxy, bool proxy_first = false) {
  cudaEvent_t start, end_a, end_b;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&end_a));
  CHECK(cudaEventCreate(&end_b));
  CHECK(cudaEventRecord(start, a));
  if (sequential) {
    if (run_compute) comp.Run(a);
    CHECK(cudaEventRecord(end_a, a));
    if (run_proxy) px.Run(a);
    CHECK(cudaEventRecord(end_b, a));
  } else {
    CHECK(cudaStreamWaitEvent(b, start, 0));
    if (run_proxy && proxy_first) px.Run(b);
    if (run_compute) comp.Run(a);
    if (run_proxy && !proxy_first) px.Run(b);
    CHECK(cudaEventRecord(end_a, a));
    CHECK(cudaEventRecord(end_b, b));
  }
  CHECK(cudaDeviceSynchronize());
  float ta = 0, tb = 0;
  CHECK(cudaEventElapsedTime(&ta, start, end_a));
  CHECK(cudaEventElapsedTime(&tb, start, end_b));
  Sample s = sequential ? Sample{tb, tb - ta, ta} : Sample{std::max(ta, tb), tb, ta};
  cudaEventDestroy(start);
  cudaEventDestroy(end_a);
  cudaEventDestroy(end_b);
  return s;
}

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.f : v[v.size() / 2];
}

std::string Num(double v, bool valid) {
  if (!valid) return "null";
  char buf[64];
  snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

std::string ComputeJson(const Compute& c) {
  char buf[512];
  if (c.kind == "gemm") {
    snprintf(buf, sizeof(buf),
             "{\"kind\": \"gemm\", \"m\": %d, \"n\": %d, \"k\": %d, \"dtype\": \"bf16\", "
             "\"library\": \"%s\"}",
             c.m, c.n, c.k, c.cublas.library.c_str());
  } else {
    // Both kernels are scalar FP32 arithmetic (CUDA cores, not tensor cores): the
    // simulator's "fusion" kind at the f32 rate.
    snprintf(buf, sizeof(buf),
             "{\"kind\": \"fusion\", \"name\": \"%s\", \"dtype\": \"f32\", "
             "\"grid\": %lld, \"threads\": %d, "
             "\"regs\": %s, \"smem\": %d, \"flops\": %.6g, \"bytes\": %.6g, "
             "\"natural_blocks_per_sm\": %s}",
             c.kind == "loop_fusion" ? "loop_fusion" : "attention_like",
             c.grid, c.threads, c.regs > 0 ? std::to_string(c.regs).c_str() : "null",
             c.static_smem + c.dyn_smem, c.flops, c.bytes,
             c.natural > 0 ? std::to_string(c.natural).c_str() : "null");
  }
  return buf;
}

int Usage() {
  fprintf(stderr,
          "usage: overlap_bench [--list] [--out FILE] [--reps R] [--kinds gemm,loop_fusion,"
          "attention] [--caps 0,1,2,4] [--issue compute_first,proxy_first] [--gemm-n N] "
          "[--proxy-ctas C] [--proxy-mb MB]\n");
  return 2;
}

std::vector<std::string> SplitList(const char* s) {
  std::vector<std::string> out;
  std::string cur;
  for (const char* p = s;; ++p) {
    if (*p == ',' || *p == '\0') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
      if (*p == '\0') break;
    } else {
      cur += *p;
    }
  }
  return out;
}

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    auto next = [&]() -> const char* { return i + 1 < argc ? argv[++i] : ""; };
    if (!strcmp(argv[i], "--list")) o.list = true;
    else if (!strcmp(argv[i], "--out")) o.out = next();
    else if (!strcmp(argv[i], "--reps")) o.reps = atoi(next());
    else if (!strcmp(argv[i], "--gemm-n")) o.gemm_n = atoi(next());
    else if (!strcmp(argv[i], "--proxy-ctas")) o.proxy_ctas = atoi(next());
    else if (!strcmp(argv[i], "--proxy-mb")) o.proxy_mb = strtoull(next(), nullptr, 10);
    else if (!strcmp(argv[i], "--kinds")) o.kinds = SplitList(next());
    else if (!strcmp(argv[i], "--issue")) o.issues = SplitList(next());
    else if (!strcmp(argv[i], "--caps")) {
      o.caps.clear();
      for (auto& c : SplitList(next())) o.caps.push_back(atoi(c.c_str()));
    } else return Usage();
  }
  for (auto& k : o.kinds)
    if (k != "gemm" && k != "loop_fusion" && k != "attention") return Usage();
  for (auto& k : o.issues)
    if (k != "compute_first" && k != "proxy_first") return Usage();
  if (o.reps < 1 || o.proxy_ctas < 1 || o.proxy_mb < 1 || o.issues.empty()) return Usage();

  std::vector<Compute> comps;
  for (auto& k : o.kinds) {
    Compute c;
    c.kind = k;
    Describe(&c, o);
    comps.push_back(c);
  }
  Proxy px;
  px.ctas = o.proxy_ctas;
  px.per_cta = o.proxy_mb * 1024 * 1024 / sizeof(float4) / o.proxy_ctas;
  const double proxy_bytes = (double)px.per_cta * px.ctas * sizeof(float4);

  std::string device = "{\"name\": null}", baselines = "{";
  int least = 0, greatest = 0;
  cudaStream_t a = nullptr, b = nullptr, b_high = nullptr;
  SetRules set_rules = nullptr;
  int proxy_regs = 0;
  if (!o.list) {
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    char buf[512];
    snprintf(buf, sizeof(buf),
             "{\"name\": \"%s\", \"sm_count\": %d, \"compute_capability\": \"%d.%d\", "
             "\"smem_per_sm\": %zu}",
             prop.name, prop.multiProcessorCount, prop.major, prop.minor,
             prop.sharedMemPerMultiprocessor);
    device = buf;
    CHECK(cudaFuncSetAttribute(nccl_proxy, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               kProxySmem));
    CHECK(cudaFuncSetAttribute(attention_like, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               kAttnSmem));
    cudaFuncAttributes attr;
    CHECK(cudaFuncGetAttributes(&attr, nccl_proxy));
    proxy_regs = attr.numRegs;
    CHECK(cudaMalloc(&px.src, proxy_bytes));
    CHECK(cudaMalloc(&px.dst, proxy_bytes));
    fill_random<<<1024, 256>>>(reinterpret_cast<float*>(px.src), proxy_bytes / 4, 1, 1.f);
    for (auto& c : comps) {
      if (c.kind == "gemm") {
        if (!LoadCublas(&c.cublas)) {
          fprintf(stderr, "overlap_bench: cuBLAS not found; set CUBLAS_LIBRARY\n");
          return 1;
        }
        size_t n2 = (size_t)c.n * c.n;
        float* tmp = nullptr;
        CHECK(cudaMalloc(&tmp, n2 * 4));
        CHECK(cudaMalloc(&c.a, n2 * 2));
        CHECK(cudaMalloc(&c.b, n2 * 2));
        CHECK(cudaMalloc(&c.c, n2 * 2));
        fill_random<<<1024, 256>>>(tmp, n2, 2, 1.f);
        to_bf16<<<1024, 256>>>(tmp, static_cast<uint16_t*>(c.a), n2);
        fill_random<<<1024, 256>>>(tmp, n2, 3, 1.f);
        to_bf16<<<1024, 256>>>(tmp, static_cast<uint16_t*>(c.b), n2);
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaFree(tmp));
      } else if (c.kind == "loop_fusion") {
        for (void** p : {&c.a, &c.b, &c.c}) CHECK(cudaMalloc(p, o.loop_elems * 16));
        fill_random<<<1024, 256>>>(static_cast<float*>(c.a), o.loop_elems * 4, 4, 1.f);
        fill_random<<<1024, 256>>>(static_cast<float*>(c.b), o.loop_elems * 4, 5, 1.f);
        CHECK(cudaFuncGetAttributes(&attr, loop_fusion));
        c.regs = attr.numRegs;
        c.static_smem = (int)attr.sharedSizeBytes;
        CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&c.natural, loop_fusion, c.threads,
                                                            0));
      } else {
        size_t qn = (size_t)o.attn_blocks * kAttnThreads * kAttnDim;
        size_t kn = (size_t)64 * kAttnTile * kAttnDim;
        CHECK(cudaMalloc(&c.a, qn * 4));
        CHECK(cudaMalloc(&c.b, kn * 4));
        CHECK(cudaMalloc(&c.c, (size_t)o.attn_blocks * kAttnThreads * 4));
        fill_random<<<1024, 256>>>(static_cast<float*>(c.a), qn, 6, 0.1f);
        fill_random<<<1024, 256>>>(static_cast<float*>(c.b), kn, 7, 0.1f);
        CHECK(cudaFuncGetAttributes(&attr, attention_like));
        c.regs = attr.numRegs;
        c.static_smem = (int)attr.sharedSizeBytes;
        CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&c.natural, attention_like, c.threads,
                                                            c.dyn_smem));
      }
    }
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    CHECK(cudaStreamCreateWithPriority(&a, cudaStreamNonBlocking, least));
    CHECK(cudaStreamCreateWithPriority(&b, cudaStreamNonBlocking, least));
    CHECK(cudaStreamCreateWithPriority(&b_high, cudaStreamNonBlocking, greatest));
    set_rules = reinterpret_cast<SetRules>(dlsym(RTLD_DEFAULT, "jor_set_rules"));
  }

  char buf[2048];
  snprintf(buf, sizeof(buf),
           "{\"kind\": \"copy\", \"ctas\": %d, \"threads\": %d, \"regs\": %s, \"smem\": %d, "
           "\"bytes\": %.0f, \"group_size\": 1}",
           px.ctas, kProxyThreads, proxy_regs > 0 ? std::to_string(proxy_regs).c_str() : "96",
           kProxySmem, proxy_bytes);
  const std::string proxy_json = buf;

  std::vector<std::string> records;
  float proxy_alone = 0;
  if (!o.list) {
    std::vector<float> v;
    for (int i = 0; i < o.reps; ++i) v.push_back(Measure(comps[0], px, a, b, true, false, true).proxy);
    proxy_alone = Median(v);
  }
  baselines += "\"proxy_alone_ms\": " + Num(proxy_alone, !o.list);
  for (auto& c : comps) {
    // Warm up (cuBLAS heuristics, module loading).
    if (!o.list) {
      if (set_rules) set_rules("version\t1\n");
      for (int i = 0; i < 2; ++i) Measure(c, px, a, b, false, true, true);
    }
    for (int cap : o.caps) {
      std::string rules = "version\t1\ncomm_block\tnone\n";
      if (cap > 0) {
        snprintf(buf, sizeof(buf), "kernel\tregex\t%s\tblocks_per_sm\t%d\n", c.regex, cap);
        rules += buf;
      }
      const bool skipped = !o.list && cap > 0 && set_rules == nullptr;
      float alone = 0;
      if (!o.list && !skipped) {
        if (set_rules) set_rules(rules.c_str());
        std::vector<float> v;
        for (int i = 0; i < o.reps; ++i) v.push_back(Measure(c, px, a, b, true, true, false).compute);
        alone = Median(v);
        snprintf(buf, sizeof(buf), ", \"%s_cap%d_alone_ms\": %.6g", c.kind.c_str(), cap, alone);
        baselines += buf;
      }
      for (size_t issue = 0; issue < o.issues.size(); ++issue) {
        for (int prio = 0; prio < 2; ++prio) {
          for (int seq = 0; seq < 2; ++seq) {
            // One sequential record per kind (issue order does not matter on one stream).
            if (seq && (cap > 0 || prio || issue > 0)) continue;
            const bool proxy_first = o.issues[issue] == "proxy_first" && !seq;
            const char* policy = seq ? "sequential"
                                 : cap > 0 ? (prio ? "priority+shaping" : "shaping")
                                           : (prio ? "priority" : "concurrent");
            std::string meas = "\"makespan_s\": null, \"proxy_latency_s\": null, "
                               "\"compute_slowdown\": null";
            long long shaped = -1, no_room = -1;
            if (skipped) {
              meas += ", \"skipped\": \"runtime library not preloaded\"";
            } else if (!o.list) {
              const uint64_t s0 = RuntimeCounter("launches_shaped");
              const uint64_t n0 = RuntimeCounter("launches_no_room");
              std::vector<float> mk, pl, ct;
              for (int i = 0; i < o.reps; ++i) {
                Sample s = Measure(c, px, a, prio ? b_high : b, seq, true, true, proxy_first);
                mk.push_back(s.makespan);
                pl.push_back(s.proxy);
                ct.push_back(s.compute);
              }
              shaped = (long long)(RuntimeCounter("launches_shaped") - s0);
              no_room = (long long)(RuntimeCounter("launches_no_room") - n0);
              const float base = alone > 0 ? alone : Median(ct);
              snprintf(buf, sizeof(buf),
                       "\"makespan_s\": %.6g, \"proxy_latency_s\": %.6g, "
                       "\"compute_slowdown\": %.6g, "
                       "\"compute_s\": %.6g, \"compute_alone_s\": %.6g",
                       Median(mk) * 1e-3, Median(pl) * 1e-3, Median(ct) / base - 1.0,
                       Median(ct) * 1e-3, base * 1e-3);
              meas = buf;
            }
            const bool meant = cap > 0 && c.natural > cap;
            snprintf(buf, sizeof(buf),
                     "{\"policy\": \"%s\", \"cap\": %s, \"issue\": \"%s\", \"compute\": %s, "
                     "\"proxy\": %s, %s, "
                     "\"shaped_launches\": %s, \"no_room_launches\": %s, \"meant_to_shape\": %s, "
                     "\"shape_regex\": \"%s\"}",
                     policy, cap > 0 ? std::to_string(cap).c_str() : "null",
                     proxy_first ? "proxy_first" : "compute_first", ComputeJson(c).c_str(),
                     proxy_json.c_str(), meas.c_str(),
                     shaped >= 0 ? std::to_string(shaped).c_str() : "null",
                     no_room >= 0 ? std::to_string(no_room).c_str() : "null",
                     c.kind == "gemm" ? "null" : (meant ? "true" : "false"), c.regex);
            records.push_back(buf);
          }
        }
      }
    }
    if (!o.list && set_rules) set_rules("version\t1\n");
  }
  baselines += "}";
  std::string json = "{\"version\": 1, \"device\": " + device + ", \"stream_priority_range\": [" +
                     std::to_string(least) + ", " + std::to_string(greatest) +
                     "], \"runtime_loaded\": " + (set_rules ? "true" : "false") +
                     ", \"measured\": " + (o.list ? "false" : "true") +
                     ", \"baselines\": " + baselines + ", \"records\": [\n";
  for (size_t i = 0; i < records.size(); ++i) json += "  " + records[i] + (i + 1 < records.size() ? ",\n" : "\n");
  json += "]}\n";
  if (o.out) {
    FILE* f = fopen(o.out, "w");
    if (!f) {
      perror(o.out);
      return 1;
    }
    fputs(json.c_str(), f);
    fclose(f);
  }
  fputs(json.c_str(), stdout);
  return 0;
}
