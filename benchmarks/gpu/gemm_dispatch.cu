// When does a communication-sized kernel start behind a library GEMM, and does a cuBLASLt
// SM-count target make room for it?
//
// On Hopper cuBLAS runs large GEMMs as persistent, cluster-launched kernels (one block per
// SM for the whole GEMM): a copy launched behind one waited for all of it at the highest
// stream priority (overlap_bench on an H200). cuBLASLt has one documented lever for this:
// CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, "the number of SMs to target ... when the user
// expects a concurrent stream to be using some of the device resources". This program
// measures, for a bf16 N x N x N GEMM at each SM-count target (0: the device's), through
// each of cuBLAS's two APIs ("api" in a record): cuBLASLt with the target on the matmul
// descriptor, and the legacy cublasGemmEx with cublasSetSmCountTarget on its handle (the
// API XLA's __cublas$gemm thunks call):
//   gemm_alone_s      the GEMM alone (events; median of the repetitions)
//   proxy_alone_s     the proxy alone: an NCCL channel's footprint (16 blocks x 544
//                     threads, 82,240 B of dynamic shared memory) copying 256 MiB
//   and, launched together, with the proxy's stream at the greatest priority or at the
//   default one, the GEMM launched first or the proxy launched first:
//   proxy_latency_s   the proxy's launch to its end
//   makespan_s        the first launch to both done
//   gemm_s            the GEMM's own time beside the proxy
//   free_sms          SMs on which a probe with the proxy's footprint (one block per SM,
//                     greatest priority, launched right after the GEMM) started a block
//                     before the GEMM ended: the SMs the GEMM's grid left to communication
//   waves             the waves cuBLASLt's heuristic expects for the chosen algorithm
// The environment the process ran under is recorded (CUDA_DEVICE_MAX_CONNECTIONS is read
// when the context is created, so a second run sets it).
//
// Output (--out FILE, and stdout): {"version": 1, "device": {...}, "library": ...,
// "cuda_device_max_connections": ..., "records": [...]}. --list: the configurations with
// null measurements, without touching a GPU or loading cuBLASLt.
//
// Build: nvcc -O3 -std=c++17 -arch=sm_90 -o gemm_dispatch gemm_dispatch.cu -ldl
// (cuBLAS and cuBLASLt are loaded with dlopen: CUBLAS_LIBRARY / CUBLASLT_LIBRARY override.)
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#define CHECK_PROGRAM "gemm_dispatch"
#include "cuda_check.h"
#include "cublas_loader.h"

constexpr int kProxyThreads = 544;  // NCCL's Simple protocol: 512 + a synchronization warp
constexpr int kProxySmem = 82240;   // ncclShmemDynamicSize, sm_80+
constexpr int kProxyCtas = 16;
constexpr size_t kProxyBytes = 256ull << 20;

__device__ __forceinline__ uint64_t GlobalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

extern "C" __global__ void __launch_bounds__(640, 1)
    proxy_copy(const float4* __restrict__ src, float4* __restrict__ dst, size_t per_cta) {
  extern __shared__ float4 stage[];
  const float4* s = src + blockIdx.x * per_cta;
  float4* d = dst + blockIdx.x * per_cta;
  for (size_t i = threadIdx.x; i < per_cta; i += blockDim.x) __stcs(d + i, __ldcs(s + i));
  if (threadIdx.x == 0) stage[0] = make_float4(0, 0, 0, 0);  // the allocation is real
}

// One block per SM at most (its shared memory): each records its SM and start time.
extern "C" __global__ void __launch_bounds__(640, 1) sm_probe(uint64_t* start, int* sm) {
  extern __shared__ float4 stage[];
  if (threadIdx.x == 0) {
    uint32_t id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    start[blockIdx.x] = GlobalTimer();
    sm[blockIdx.x] = (int)id;
    stage[0] = make_float4(0, 0, 0, 0);
  }
}

extern "C" __global__ void stamp(uint64_t* out) {
  if (threadIdx.x == 0) *out = GlobalTimer();
}

// ---------------------------------------------------------------------------
// cuBLASLt through dlopen (the types are opaque pointers; enum values from cublasLt.h).
// ---------------------------------------------------------------------------
constexpr int kDescSmCountTarget = 15;   // CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET
constexpr int kPrefMaxWorkspace = 1;     // CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES
struct Heuristic {
  uint64_t algo[8];
  size_t workspace;
  int state;
  float waves;
  int reserved[4];
};
typedef int (*LtCreate)(void**);
typedef int (*LtDescCreate)(void**, int, int);
typedef int (*LtDescSet)(void*, int, const void*, size_t);
typedef int (*LtLayoutCreate)(void**, int, uint64_t, uint64_t, int64_t);
typedef int (*LtPrefCreate)(void**);
typedef int (*LtPrefSet)(void*, int, const void*, size_t);
typedef int (*LtHeuristic)(void*, void*, void*, void*, void*, void*, void*, int, Heuristic*,
                           int*);
typedef int (*LtMatmul)(void*, void*, const void*, const void*, void*, const void*, void*,
                        const void*, const void*, void*, void*, void*, const void*, void*,
                        size_t, cudaStream_t);

struct Lt {
  void* handle = nullptr;
  LtDescCreate desc_create;
  LtDescSet desc_set;
  LtLayoutCreate layout_create;
  LtPrefCreate pref_create;
  LtPrefSet pref_set;
  LtHeuristic heuristic;
  LtMatmul matmul;
  std::string library;
};

bool LoadLt(Lt* lt) {
  const char* n = OpenFirstLibrary(
      "CUBLASLT_LIBRARY", {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"},
      [lt](void* h) {
        auto create = reinterpret_cast<LtCreate>(dlsym(h, "cublasLtCreate"));
        lt->desc_create = reinterpret_cast<LtDescCreate>(dlsym(h, "cublasLtMatmulDescCreate"));
        lt->desc_set = reinterpret_cast<LtDescSet>(dlsym(h, "cublasLtMatmulDescSetAttribute"));
        lt->layout_create =
            reinterpret_cast<LtLayoutCreate>(dlsym(h, "cublasLtMatrixLayoutCreate"));
        lt->pref_create =
            reinterpret_cast<LtPrefCreate>(dlsym(h, "cublasLtMatmulPreferenceCreate"));
        lt->pref_set =
            reinterpret_cast<LtPrefSet>(dlsym(h, "cublasLtMatmulPreferenceSetAttribute"));
        lt->heuristic =
            reinterpret_cast<LtHeuristic>(dlsym(h, "cublasLtMatmulAlgoGetHeuristic"));
        lt->matmul = reinterpret_cast<LtMatmul>(dlsym(h, "cublasLtMatmul"));
        return create && lt->desc_create && lt->desc_set && lt->layout_create &&
               lt->pref_create && lt->pref_set && lt->heuristic && lt->matmul &&
               create(&lt->handle) == 0;
      });
  if (n != nullptr) lt->library = n;
  return n != nullptr;
}

#define LT_CHECK(x)                                                          \
  do {                                                                       \
    int st = (x);                                                            \
    if (st != 0) {                                                           \
      fprintf(stderr, "gemm_dispatch: %s failed: cuBLAS status %d\n", #x, st); \
      exit(1);                                                               \
    }                                                                        \
  } while (0)

// One GEMM D = A B (bf16 in and out, fp32 accumulation) planned at an SM-count target.
struct Gemm {
  void *desc, *a, *b, *c;
  Heuristic h;
  void* workspace;
};

Gemm Plan(const Lt& lt, int n, int sm_target, void* workspace, size_t ws_bytes) {
  Gemm g{};
  LT_CHECK(lt.desc_create(&g.desc, kCublasCompute32F, kCudaR32F));
  LT_CHECK(lt.desc_set(g.desc, kDescSmCountTarget, &sm_target, sizeof(sm_target)));
  LT_CHECK(lt.layout_create(&g.a, kCudaR16BF, n, n, n));
  LT_CHECK(lt.layout_create(&g.b, kCudaR16BF, n, n, n));
  LT_CHECK(lt.layout_create(&g.c, kCudaR16BF, n, n, n));
  void* pref;
  LT_CHECK(lt.pref_create(&pref));
  LT_CHECK(lt.pref_set(pref, kPrefMaxWorkspace, &ws_bytes, sizeof(ws_bytes)));
  int found = 0;
  LT_CHECK(lt.heuristic(lt.handle, g.desc, g.a, g.b, g.c, g.c, pref, 1, &g.h, &found));
  if (found < 1) {
    fprintf(stderr, "gemm_dispatch: cuBLASLt found no algorithm at SM target %d\n", sm_target);
    exit(1);
  }
  g.workspace = workspace;
  return g;
}

void RunGemm(const Lt& lt, const Gemm& g, const void* a, const void* b, void* d,
             cudaStream_t s) {
  const float one = 1.f, zero = 0.f;
  LT_CHECK(lt.matmul(lt.handle, g.desc, &one, a, g.a, b, g.b, &zero, d, g.c, d, g.c, g.h.algo,
                     g.workspace, g.h.workspace, s));
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Options {
  std::string out;
  bool list = false;
  int n = 8192;
  int reps = 10;
  std::vector<int> targets;  // empty: 0 and sms - 32, sms - 64, sms / 2
};

std::string Null(bool list, double v) {
  if (list) return "null";
  char buf[64];
  snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

int Usage() {
  fprintf(stderr,
          "usage: gemm_dispatch [--list] [--out FILE] [--n N] [--reps R] "
          "[--targets 0,100,...]\n");
  return 2;
}

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    auto next = [&]() -> const char* { return i + 1 < argc ? argv[++i] : ""; };
    if (!strcmp(argv[i], "--list")) o.list = true;
    else if (!strcmp(argv[i], "--out")) o.out = next();
    else if (!strcmp(argv[i], "--n")) o.n = atoi(next());
    else if (!strcmp(argv[i], "--reps")) o.reps = atoi(next());
    else if (!strcmp(argv[i], "--targets")) {
      std::string s = next();
      for (size_t p = 0; p <= s.size();) {
        size_t q = s.find(',', p);
        if (q == std::string::npos) q = s.size();
        if (q > p) o.targets.push_back(atoi(s.substr(p, q - p).c_str()));
        p = q + 1;
      }
    } else return Usage();
  }
  if (o.n < 256 || o.reps < 1) return Usage();
  int sms = 132;
  std::string name = "(listed)";
  if (!o.list) {
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    sms = prop.multiProcessorCount;
    name = prop.name;
  }
  if (o.targets.empty()) o.targets = {0, sms - 32, sms - 64, sms / 2};
  const char* conn = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  Lt lt;
  if (!o.list && !LoadLt(&lt)) {
    fprintf(stderr, "gemm_dispatch: cuBLASLt not found (set CUBLASLT_LIBRARY)\n");
    return 1;
  }
  Cublas blas;
  if (!o.list && !(LoadCublas(&blas) && blas.set_sm_count_target)) {
    fprintf(stderr, "gemm_dispatch: cuBLAS with cublasSetSmCountTarget not found (set CUBLAS_LIBRARY)\n");
    return 1;
  }
  int lo = 0, hi = 0;
  cudaStream_t s_gemm = nullptr, s_hi = nullptr, s_lo = nullptr;
  void *a = nullptr, *b = nullptr, *d = nullptr, *ws = nullptr, *src = nullptr, *dst = nullptr;
  uint64_t* stamps = nullptr;
  int* sm_ids = nullptr;
  const size_t ws_bytes = 64ull << 20;
  cudaEvent_t ev[6];
  if (!o.list) {
    CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    CHECK(cudaStreamCreateWithPriority(&s_gemm, cudaStreamNonBlocking, lo));
    CHECK(cudaStreamCreateWithPriority(&s_hi, cudaStreamNonBlocking, hi));
    CHECK(cudaStreamCreateWithPriority(&s_lo, cudaStreamNonBlocking, lo));
    const size_t mat = (size_t)o.n * o.n * 2;
    CHECK(cudaMalloc(&a, mat));
    CHECK(cudaMalloc(&b, mat));
    CHECK(cudaMalloc(&d, mat));
    CHECK(cudaMemset(a, 0x3c, mat));  // bf16 ~1.0-ish patterns: real arithmetic, no NaN
    CHECK(cudaMemset(b, 0x3c, mat));
    CHECK(cudaMalloc(&ws, ws_bytes));
    CHECK(cudaMalloc(&src, kProxyBytes));
    CHECK(cudaMalloc(&dst, kProxyBytes));
    CHECK(cudaMemset(src, 1, kProxyBytes));
    CHECK(cudaMalloc(&stamps, (sms + 2) * sizeof(uint64_t)));
    CHECK(cudaMalloc(&sm_ids, sms * sizeof(int)));
    CHECK(cudaFuncSetAttribute(proxy_copy, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               kProxySmem));
    CHECK(cudaFuncSetAttribute(sm_probe, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               kProxySmem));
    for (auto& event : ev) CHECK(cudaEventCreate(&event));
  }
  const size_t per_cta = kProxyBytes / sizeof(float4) / kProxyCtas;
  auto proxy = [&](cudaStream_t s) {
    proxy_copy<<<kProxyCtas, kProxyThreads, kProxySmem, s>>>(static_cast<float4*>(src),
                                                             static_cast<float4*>(dst), per_cta);
  };
  auto ms = [&](cudaEvent_t x, cudaEvent_t y) {
    float v = 0;
    CHECK(cudaEventElapsedTime(&v, x, y));
    return (double)v * 1e-3;
  };
  std::string records;
  double proxy_alone = 0;
  if (!o.list) {
    std::vector<double> v;
    for (int r = 0; r < o.reps + 1; ++r) {
      CHECK(cudaEventRecord(ev[0], s_hi));
      proxy(s_hi);
      CHECK(cudaEventRecord(ev[1], s_hi));
      CHECK(cudaStreamSynchronize(s_hi));
      if (r) v.push_back(ms(ev[0], ev[1]));
    }
    proxy_alone = Median(v);
  }
  for (const char* api : {"cublasLt", "cublas"})
  for (int target : o.targets) {
    const bool legacy = !strcmp(api, "cublas");
    Gemm g{};
    auto run_gemm = [&](cudaStream_t s) {
      if (legacy) LT_CHECK(CublasBf16Gemm(blas, o.n, a, b, d, s));
      else RunGemm(lt, g, a, b, d, s);
    };
    double alone = 0;
    if (!o.list) {
      if (legacy) LT_CHECK(blas.set_sm_count_target(blas.handle, target));
      else g = Plan(lt, o.n, target, ws, ws_bytes);
      std::vector<double> v;
      for (int r = 0; r < o.reps + 1; ++r) {
        CHECK(cudaEventRecord(ev[0], s_gemm));
        run_gemm(s_gemm);
        CHECK(cudaEventRecord(ev[1], s_gemm));
        CHECK(cudaStreamSynchronize(s_gemm));
        if (r) v.push_back(ms(ev[0], ev[1]));
      }
      alone = Median(v);
    }
    // The SMs the GEMM leaves: a probe with the proxy's footprint launched behind it.
    int free_sms = 0;
    double probe_first = 0;
    if (!o.list) {
      std::vector<int> counts;
      std::vector<double> firsts;
      for (int r = 0; r < o.reps; ++r) {
        stamp<<<1, 32, 0, s_gemm>>>(stamps + sms);
        run_gemm(s_gemm);
        stamp<<<1, 32, 0, s_gemm>>>(stamps + sms + 1);
        sm_probe<<<sms, kProxyThreads, kProxySmem, s_hi>>>(stamps, sm_ids);
        CHECK(cudaDeviceSynchronize());
        std::vector<uint64_t> t(sms + 2);
        std::vector<int> ids(sms);
        CHECK(cudaMemcpy(t.data(), stamps, t.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(ids.data(), sm_ids, ids.size() * sizeof(int), cudaMemcpyDeviceToHost));
        const uint64_t begin = t[sms], end = t[sms + 1];
        std::set<int> early;
        uint64_t first = ~0ull;
        for (int i = 0; i < sms; ++i) {
          if (t[i] + 2000 < end) early.insert(ids[i]);  // 2 us before the GEMM's end
          first = std::min(first, t[i]);
        }
        counts.push_back((int)early.size());
        firsts.push_back(first > begin ? (first - begin) * 1e-9 : 0.0);
      }
      std::sort(counts.begin(), counts.end());
      free_sms = counts[counts.size() / 2];
      probe_first = Median(firsts);
    }
    for (int prio : {1, 0}) {
      for (int gemm_first : {1, 0}) {
        double latency = 0, makespan = 0, gemm_s = 0;
        if (!o.list) {
          cudaStream_t sp = prio ? s_hi : s_lo;
          std::vector<double> lat, mk, gs;
          for (int r = 0; r < o.reps + 1; ++r) {
            CHECK(cudaDeviceSynchronize());
            if (gemm_first) {
              CHECK(cudaEventRecord(ev[0], s_gemm));
              run_gemm(s_gemm);
              CHECK(cudaEventRecord(ev[1], s_gemm));
              CHECK(cudaEventRecord(ev[2], sp));
              proxy(sp);
              CHECK(cudaEventRecord(ev[3], sp));
            } else {
              CHECK(cudaEventRecord(ev[2], sp));
              proxy(sp);
              CHECK(cudaEventRecord(ev[3], sp));
              CHECK(cudaEventRecord(ev[0], s_gemm));
              run_gemm(s_gemm);
              CHECK(cudaEventRecord(ev[1], s_gemm));
            }
            CHECK(cudaDeviceSynchronize());
            if (!r) continue;
            const cudaEvent_t first = gemm_first ? ev[0] : ev[2];
            lat.push_back(ms(ev[2], ev[3]));
            gs.push_back(ms(ev[0], ev[1]));
            mk.push_back(std::max(ms(first, ev[1]), ms(first, ev[3])));
          }
          latency = Median(lat);
          makespan = Median(mk);
          gemm_s = Median(gs);
        }
        char buf[1024];
        snprintf(buf, sizeof(buf),
                 "%s{\"gemm\": {\"m\": %d, \"n\": %d, \"k\": %d, \"dtype\": \"bf16\", "
                 "\"sm_count_target\": %d, \"api\": \"%s\"}, \"priority\": %s, \"issue\": \"%s\", "
                 "\"gemm_alone_s\": %s, \"proxy_alone_s\": %s, \"proxy_latency_s\": %s, "
                 "\"makespan_s\": %s, \"gemm_s\": %s, \"free_sms\": %s, "
                 "\"probe_first_s\": %s, \"waves\": %s}",
                 records.empty() ? "" : ",\n  ", o.n, o.n, o.n, target, api,
                 prio ? "true" : "false", gemm_first ? "compute_first" : "proxy_first",
                 Null(o.list, alone).c_str(), Null(o.list, proxy_alone).c_str(),
                 Null(o.list, latency).c_str(), Null(o.list, makespan).c_str(),
                 Null(o.list, gemm_s).c_str(), Null(o.list, free_sms).c_str(),
                 Null(o.list, probe_first).c_str(),
                 legacy ? "null" : Null(o.list, g.h.waves).c_str());
        records += buf;
      }
    }
  }
  std::string json = "{\"version\": 1, \"measured\": " + std::string(o.list ? "false" : "true") +
                     ", \"device\": {\"name\": \"" + name + "\", \"sm_count\": " +
                     std::to_string(sms) + "}, \"library\": \"" + lt.library +
                     "\", \"legacy_library\": \"" + blas.library +
                     "\", \"cuda_device_max_connections\": " +
                     (conn ? "\"" + std::string(conn) + "\"" : std::string("null")) +
                     ", \"proxy\": {\"ctas\": " + std::to_string(kProxyCtas) +
                     ", \"threads\": " + std::to_string(kProxyThreads) +
                     ", \"smem\": " + std::to_string(kProxySmem) +
                     ", \"bytes\": " + std::to_string(kProxyBytes) + "}, \"records\": [\n  " +
                     records + "\n]}\n";
  fputs(json.c_str(), stdout);
  if (!o.out.empty()) {
    FILE* f = fopen(o.out.c_str(), "w");
    if (!f) {
      fprintf(stderr, "gemm_dispatch: cannot write %s\n", o.out.c_str());
      return 1;
    }
    fputs(json.c_str(), f);
    fclose(f);
  }
  return 0;
}
