// Compute/communication overlap under five runtime policies, on one GPU.
//
// A GEMM stream (cuBLAS bf16 GemmEx, loaded with dlopen; a tiled CUDA-core
// GEMM when cuBLAS is not found) runs beside an NCCL-footprint proxy kernel on
// a second stream: 640-thread CTAs built for ~96 registers (so one CTA needs
// almost a whole SM's register file, like an NCCL channel), a few CTAs, moving
// memory with streaming copies. Policies:
//   sequential   GEMM then proxy on one stream
//   concurrent   two streams, default priority
//   priority     proxy stream at the highest priority
//   shaping      GEMM kernels capped at --shape-blocks blocks/SM by the runtime
//                library (jor_set_rules; needs LD_PRELOAD=libjax_overlap_rt.so)
//   both         priority + shaping
// Reported per policy (median of --reps): makespan, proxy latency (issue to
// completion), GEMM time and its slowdown against the GEMM alone. JSON on
// stdout (or --out FILE).
//
// Build: nvcc -O3 -std=c++17 -arch=sm_90 -o overlap_bench overlap_bench.cu -ldl
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <string>
#include <vector>

#define CHECK(x)                                                                    \
  do {                                                                              \
    cudaError_t e = (x);                                                            \
    if (e != cudaSuccess) {                                                         \
      fprintf(stderr, "overlap_bench: %s failed: %s\n", #x, cudaGetErrorString(e)); \
      exit(1);                                                                      \
    }                                                                               \
  } while (0)

// ---------------------------------------------------------------------------
// The proxy: NCCL-like footprint (640 threads, ~96 registers, few CTAs).
// ---------------------------------------------------------------------------

constexpr int kProxyThreads = 640;
constexpr int kInFlight = 20;  // float4 loads in flight per thread: ~80 data registers

__global__ void __launch_bounds__(kProxyThreads, 1)
    nccl_proxy(const float4* __restrict__ src, float4* __restrict__ dst, size_t per_cta,
               int reps) {
  const float4* s = src + blockIdx.x * per_cta;
  float4* d = dst + blockIdx.x * per_cta;
  const size_t step = (size_t)blockDim.x * kInFlight;
  for (int r = 0; r < reps; ++r) {
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
  }
}

// ---------------------------------------------------------------------------
// GEMM: cuBLAS through dlopen (no link-time dependency), else a tiled kernel.
// ---------------------------------------------------------------------------

// cublas_api.h / library_types.h values.
constexpr int kCublasOpN = 0;
constexpr int kCudaR16BF = 14;
constexpr int kCublasCompute32F = 68;
constexpr int kCublasGemmDefault = -1;
typedef int (*CublasCreate)(void**);
typedef int (*CublasSetStream)(void*, cudaStream_t);
typedef int (*CublasGemmEx)(void*, int, int, int, int, int, const void*, const void*, int, int,
                            const void*, int, int, const void*, void*, int, int, int, int);

struct Cublas {
  void* handle = nullptr;
  CublasSetStream set_stream = nullptr;
  CublasGemmEx gemm = nullptr;
  std::string library;
};

bool LoadCublas(Cublas* c) {
  const char* names[] = {getenv("CUBLAS_LIBRARY"), "libcublas.so.13", "libcublas.so.12",
                         "libcublas.so"};
  for (const char* n : names) {
    if (n == nullptr || *n == '\0') continue;
    void* h = dlopen(n, RTLD_NOW | RTLD_GLOBAL);
    if (h == nullptr) continue;
    auto create = reinterpret_cast<CublasCreate>(dlsym(h, "cublasCreate_v2"));
    c->set_stream = reinterpret_cast<CublasSetStream>(dlsym(h, "cublasSetStream_v2"));
    c->gemm = reinterpret_cast<CublasGemmEx>(dlsym(h, "cublasGemmEx"));
    if (create && c->set_stream && c->gemm && create(&c->handle) == 0) {
      c->library = n;
      return true;
    }
  }
  return false;
}

constexpr int kTile = 64;
// Tiled GEMM, 256 threads, 2 x 16 KB shared memory: several blocks per SM,
// which is what occupancy shaping acts on.
__global__ void __launch_bounds__(256) tiled_gemm(const float* A, const float* B, float* C,
                                                  int n) {
  __shared__ float As[kTile][kTile];
  __shared__ float Bs[kTile][kTile];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int row0 = blockIdx.y * kTile, col0 = blockIdx.x * kTile;
  float acc[4][4] = {};
  for (int k0 = 0; k0 < n; k0 += kTile) {
    for (int i = threadIdx.x; i < kTile * kTile; i += blockDim.x) {
      int r = i / kTile, c = i % kTile;
      As[r][c] = A[(size_t)(row0 + r) * n + k0 + c];
      Bs[r][c] = B[(size_t)(k0 + r) * n + col0 + c];
    }
    __syncthreads();
    for (int k = 0; k < kTile; ++k) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += As[ty * 4 + i][k] * Bs[k][tx * 4 + j];
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) C[(size_t)(row0 + ty * 4 + i) * n + col0 + tx * 4 + j] = acc[i][j];
}

struct Gemm {
  Cublas cublas;
  bool use_cublas = false;
  int n = 0;
  void *a = nullptr, *b = nullptr, *c = nullptr;

  void Run(cudaStream_t s) {
    if (use_cublas) {
      const float one = 1.0f, zero = 0.0f;
      cublas.set_stream(cublas.handle, s);
      int st = cublas.gemm(cublas.handle, kCublasOpN, kCublasOpN, n, n, n, &one, a, kCudaR16BF, n,
                           b, kCudaR16BF, n, &zero, c, kCudaR16BF, n, kCublasCompute32F,
                           kCublasGemmDefault);
      if (st != 0) {
        fprintf(stderr, "overlap_bench: cublasGemmEx failed (%d)\n", st);
        exit(1);
      }
    } else {
      dim3 grid(n / kTile, n / kTile);
      tiled_gemm<<<grid, 256, 0, s>>>(static_cast<float*>(a), static_cast<float*>(b),
                                      static_cast<float*>(c), n);
      CHECK(cudaGetLastError());
    }
  }
};

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
// Measurement.
// ---------------------------------------------------------------------------

struct Sample {
  float makespan, proxy, gemm;
};

struct Setup {
  Gemm gemm;
  float4 *src = nullptr, *dst = nullptr;
  size_t per_cta = 0;
  int ctas = 0, reps_inner = 1;

  void Proxy(cudaStream_t s) {
    nccl_proxy<<<ctas, kProxyThreads, 0, s>>>(src, dst, per_cta, reps_inner);
    CHECK(cudaGetLastError());
  }
};

Sample Measure(Setup& st, cudaStream_t a, cudaStream_t b, bool sequential, bool run_gemm,
               bool run_proxy) {
  cudaEvent_t start, end_a, end_b;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&end_a));
  CHECK(cudaEventCreate(&end_b));
  CHECK(cudaEventRecord(start, a));
  if (sequential) {
    if (run_gemm) st.gemm.Run(a);
    CHECK(cudaEventRecord(end_a, a));
    if (run_proxy) st.Proxy(a);
    CHECK(cudaEventRecord(end_b, a));
  } else {
    CHECK(cudaStreamWaitEvent(b, start, 0));
    if (run_gemm) st.gemm.Run(a);
    if (run_proxy) st.Proxy(b);  // issued after the GEMM: it must find room beside it
    CHECK(cudaEventRecord(end_a, a));
    CHECK(cudaEventRecord(end_b, b));
  }
  CHECK(cudaDeviceSynchronize());
  float ta = 0, tb = 0;
  CHECK(cudaEventElapsedTime(&ta, start, end_a));
  CHECK(cudaEventElapsedTime(&tb, start, end_b));
  Sample s;
  if (sequential) {
    s = {tb, tb - ta, ta};
  } else {
    s = {std::max(ta, tb), tb, ta};
  }
  cudaEventDestroy(start);
  cudaEventDestroy(end_a);
  cudaEventDestroy(end_b);
  return s;
}

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.f : v[v.size() / 2];
}

int main(int argc, char** argv) {
  int n = 8192, ctas = 16, reps = 15, shape_blocks = 1;
  size_t proxy_mb = 256;
  const char* out_path = nullptr;
  const char* shape_regex = "gemm|nvjet|xmma|cutlass";
  for (int i = 1; i < argc; ++i) {
    auto next = [&]() { return i + 1 < argc ? argv[++i] : (char*)""; };
    if (!strcmp(argv[i], "--n")) n = atoi(next());
    else if (!strcmp(argv[i], "--proxy-ctas")) ctas = atoi(next());
    else if (!strcmp(argv[i], "--proxy-mb")) proxy_mb = strtoull(next(), nullptr, 10);
    else if (!strcmp(argv[i], "--reps")) reps = atoi(next());
    else if (!strcmp(argv[i], "--shape-blocks")) shape_blocks = atoi(next());
    else if (!strcmp(argv[i], "--shape-regex")) shape_regex = next();
    else if (!strcmp(argv[i], "--out")) out_path = next();
    else {
      fprintf(stderr, "usage: overlap_bench [--n N] [--proxy-ctas C] [--proxy-mb MB] [--reps R] "
                      "[--shape-blocks B] [--shape-regex RE] [--out FILE]\n");
      return 2;
    }
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  Setup st;
  st.gemm.n = n;
  st.gemm.use_cublas = LoadCublas(&st.gemm.cublas);
  const size_t elem = st.gemm.use_cublas ? 2 : 4;
  if (!st.gemm.use_cublas && n > 4096) st.gemm.n = n = 4096;  // CUDA-core GEMM: keep it short
  CHECK(cudaMalloc(&st.gemm.a, (size_t)n * n * elem));
  CHECK(cudaMalloc(&st.gemm.b, (size_t)n * n * elem));
  CHECK(cudaMalloc(&st.gemm.c, (size_t)n * n * elem));
  CHECK(cudaMemset(st.gemm.a, 0, (size_t)n * n * elem));
  CHECK(cudaMemset(st.gemm.b, 0, (size_t)n * n * elem));
  st.ctas = ctas;
  st.per_cta = proxy_mb * 1024 * 1024 / sizeof(float4) / ctas;
  CHECK(cudaMalloc(&st.src, st.per_cta * ctas * sizeof(float4)));
  CHECK(cudaMalloc(&st.dst, st.per_cta * ctas * sizeof(float4)));
  CHECK(cudaMemset(st.src, 0, st.per_cta * ctas * sizeof(float4)));
  cudaFuncAttributes proxy_attr;
  CHECK(cudaFuncGetAttributes(&proxy_attr, nccl_proxy));

  int least = 0, greatest = 0;
  CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t a, b, b_high;
  CHECK(cudaStreamCreateWithPriority(&a, cudaStreamNonBlocking, least));
  CHECK(cudaStreamCreateWithPriority(&b, cudaStreamNonBlocking, least));
  CHECK(cudaStreamCreateWithPriority(&b_high, cudaStreamNonBlocking, greatest));

  auto set_rules = reinterpret_cast<SetRules>(dlsym(RTLD_DEFAULT, "jor_set_rules"));
  char rules_text[512];
  snprintf(rules_text, sizeof(rules_text), "version\t1\nkernel\tregex\t%s\tblocks_per_sm\t%d\n",
           shape_regex, shape_blocks);

  // Warm up (cuBLAS heuristics, module loading).
  for (int i = 0; i < 3; ++i) Measure(st, a, b, false, true, true);

  std::vector<float> alone_gemm, alone_proxy;
  for (int i = 0; i < reps; ++i) {
    alone_gemm.push_back(Measure(st, a, b, true, true, false).gemm);
    alone_proxy.push_back(Measure(st, a, b, true, false, true).proxy);
  }
  const float gemm_alone = Median(alone_gemm), proxy_alone = Median(alone_proxy);

  struct Policy {
    const char* name;
    bool sequential, priority, shaping;
  } policies[] = {{"sequential", true, false, false},
                  {"concurrent", false, false, false},
                  {"priority", false, true, false},
                  {"shaping", false, false, true},
                  {"both", false, true, true}};
  std::string json = "{";
  char buf[1024];
  snprintf(buf, sizeof(buf),
           "\"gpu\": \"%s\", \"sm_count\": %d, \"compute_capability\": \"%d.%d\", "
           "\"gemm\": {\"impl\": \"%s\", \"n\": %d, \"dtype\": \"%s\"}, "
           "\"proxy\": {\"threads\": %d, \"registers\": %d, \"ctas\": %d, \"bytes\": %zu}, "
           "\"stream_priority_range\": [%d, %d], \"runtime_loaded\": %s, "
           "\"shape_rule\": {\"regex\": \"%s\", \"blocks_per_sm\": %d}, "
           "\"gemm_alone_ms\": %.4f, \"proxy_alone_ms\": %.4f, \"policies\": {",
           prop.name, prop.multiProcessorCount, prop.major, prop.minor,
           st.gemm.use_cublas ? st.gemm.cublas.library.c_str() : "tiled_gemm", n,
           st.gemm.use_cublas ? "bf16" : "f32", kProxyThreads, proxy_attr.numRegs, ctas,
           st.per_cta * ctas * sizeof(float4), least, greatest, set_rules ? "true" : "false",
           shape_regex, shape_blocks, gemm_alone, proxy_alone);
  json += buf;
  bool first = true;
  for (const Policy& p : policies) {
    if (p.shaping && set_rules == nullptr) {
      snprintf(buf, sizeof(buf), "%s\"%s\": {\"skipped\": \"runtime library not preloaded\"}",
               first ? "" : ", ", p.name);
      json += buf;
      first = false;
      continue;
    }
    if (set_rules) set_rules(p.shaping ? rules_text : "version\t1\n");
    const uint64_t shaped0 = RuntimeCounter("launches_shaped");
    std::vector<float> mk, px, gm;
    for (int i = 0; i < reps; ++i) {
      Sample s = Measure(st, a, p.priority ? b_high : b, p.sequential, true, true);
      mk.push_back(s.makespan);
      px.push_back(s.proxy);
      gm.push_back(s.gemm);
    }
    const uint64_t shaped = RuntimeCounter("launches_shaped") - shaped0;
    snprintf(buf, sizeof(buf),
             "%s\"%s\": {\"makespan_ms\": %.4f, \"proxy_latency_ms\": %.4f, \"gemm_ms\": %.4f, "
             "\"gemm_slowdown\": %.4f, \"shaped_launches\": %llu}",
             first ? "" : ", ", p.name, Median(mk), Median(px), Median(gm),
             Median(gm) / gemm_alone, (unsigned long long)shaped);
    json += buf;
    first = false;
  }
  if (set_rules) set_rules("version\t1\n");
  json += "}}\n";
  if (out_path) {
    FILE* f = fopen(out_path, "w");
    if (!f) {
      perror(out_path);
      return 1;
    }
    fputs(json.c_str(), f);
    fclose(f);
  }
  fputs(json.c_str(), stdout);
  return 0;
}
