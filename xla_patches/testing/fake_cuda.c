/* A fake libcuda.so.1 for testing the runtime library without a GPU.
 *
 * It implements the driver entry points the runtime library and the test
 * programs use, checks launches against the device limits the way the driver
 * does, and records what it receives.
 *
 * (Over 500 lines: one short fake per driver entry point the runtime library
 * resolves, each checking what the driver checks.)
 *
 * Environment:
 *   FAKE_CUDA_DEVICE  "h100" (default) or "a100": per-SM limits to report.
 *   FAKE_CUDA_LIMITS  overrides, "key=value,...", keys: sm, smem_sm, optin,
 *                     reserved, threads_sm, blocks_sm, regs_sm, warp,
 *                     cc_major, cc_minor.
 *   FAKE_CUDA_FUNCS   kernels, "name:static=S:regs=R:maxdyn=D:cluster=W;..."
 *                     (defaults: static 0, regs 32, maxdyn 48 KB - static, no
 *                     compile-time cluster).
 *   FAKE_CUDA_FAIL    comma-separated entry points that return
 *                     CUDA_ERROR_INVALID_VALUE (e.g. "cuFuncGetAttribute"), or
 *                     "launch_dyn_over=N": launches with more than N bytes of
 *                     dynamic shared memory fail.
 *   FAKE_CUDA_LOG     file to which every call is appended, one line each.
 *   FAKE_CUDA_FUNCS_AFTER_UNLOAD  kernels as in FAKE_CUDA_FUNCS, given new
 *                     attributes (same handles) by cuModuleUnload: a new kernel
 *                     at an old handle.
 *   FAKE_CUDA_VERSIONED_PROCS  "1": cuGetProcAddress answers launches with
 *                     internal entry points that are not the exported symbols,
 *                     as a driver with versioned implementations may.
 *
 * Launch records are also kept in memory: fake_cuda_launch_count() and
 * fake_cuda_launch_dyn(i).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "../runtime/cuda_types.h"

#define EXPORT __attribute__((visibility("default")))

typedef struct FakeFunc {
  char name[128];
  int static_smem;
  int regs;
  int max_dyn;
  int carveout;
  int cluster;  /* compile-time cluster width (1: none) */
} FakeFunc;

typedef struct FakeStream {
  int id;
  int priority;
} FakeStream;

static struct {
  int sm, smem_sm, optin, reserved, threads_sm, blocks_sm, regs_sm, warp, cc_major, cc_minor;
} g_dev;

#define MAX_FUNCS 256
static FakeFunc g_funcs[MAX_FUNCS];
static int g_num_funcs;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_log_fd = -1;
static char g_fail[1024];
static long g_launch_dyn_over = -1;
static int g_capturing = 0; /* the (one) stream is capturing: launches are recorded */

#define MAX_RECORDS 65536
static unsigned g_launch_dyn[MAX_RECORDS];
static int g_launch_count;
static int g_stream_count;

static void set_limit(const char* key, int value) {
  if (!strcmp(key, "sm")) g_dev.sm = value;
  else if (!strcmp(key, "smem_sm")) g_dev.smem_sm = value;
  else if (!strcmp(key, "optin")) g_dev.optin = value;
  else if (!strcmp(key, "reserved")) g_dev.reserved = value;
  else if (!strcmp(key, "threads_sm")) g_dev.threads_sm = value;
  else if (!strcmp(key, "blocks_sm")) g_dev.blocks_sm = value;
  else if (!strcmp(key, "regs_sm")) g_dev.regs_sm = value;
  else if (!strcmp(key, "warp")) g_dev.warp = value;
  else if (!strcmp(key, "cc_major")) g_dev.cc_major = value;
  else if (!strcmp(key, "cc_minor")) g_dev.cc_minor = value;
}

static FakeFunc* add_func(const char* spec) {
  /* "name:static=S:regs=R:maxdyn=D:cluster=W" */
  if (g_num_funcs >= MAX_FUNCS) return NULL;
  FakeFunc* f = &g_funcs[g_num_funcs++];
  memset(f, 0, sizeof(*f));
  f->regs = 32;
  f->max_dyn = -1;
  char buf[256];
  snprintf(buf, sizeof(buf), "%s", spec);
  char* save = NULL;
  char* tok = strtok_r(buf, ":", &save);
  snprintf(f->name, sizeof(f->name), "%s", tok ? tok : "kernel");
  while ((tok = strtok_r(NULL, ":", &save)) != NULL) {
    char* eq = strchr(tok, '=');
    if (!eq) continue;
    *eq = '\0';
    int v = atoi(eq + 1);
    if (!strcmp(tok, "static")) f->static_smem = v;
    else if (!strcmp(tok, "regs")) f->regs = v;
    else if (!strcmp(tok, "maxdyn")) f->max_dyn = v;
    else if (!strcmp(tok, "cluster")) f->cluster = v;
  }
  if (f->max_dyn < 0) f->max_dyn = 48 * 1024 - f->static_smem;
  return f;
}

static void init(void) {
  const char* dev = getenv("FAKE_CUDA_DEVICE");
  /* Public limits: CUDA C Programming Guide, compute capabilities 8.0 / 9.0. */
  if (dev && !strcmp(dev, "a100")) {
    g_dev.sm = 108; g_dev.smem_sm = 167936; g_dev.optin = 166912;
    g_dev.reserved = 1024; g_dev.threads_sm = 2048; g_dev.blocks_sm = 32;
    g_dev.regs_sm = 65536; g_dev.warp = 32; g_dev.cc_major = 8; g_dev.cc_minor = 0;
  } else {
    g_dev.sm = 132; g_dev.smem_sm = 233472; g_dev.optin = 232448;
    g_dev.reserved = 1024; g_dev.threads_sm = 2048; g_dev.blocks_sm = 32;
    g_dev.regs_sm = 65536; g_dev.warp = 32; g_dev.cc_major = 9; g_dev.cc_minor = 0;
  }
  const char* lim = getenv("FAKE_CUDA_LIMITS");
  if (lim) {
    char buf[512];
    snprintf(buf, sizeof(buf), "%s", lim);
    char* save = NULL;
    for (char* tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
      char* eq = strchr(tok, '=');
      if (!eq) continue;
      *eq = '\0';
      set_limit(tok, atoi(eq + 1));
    }
  }
  const char* funcs = getenv("FAKE_CUDA_FUNCS");
  if (funcs) {
    char buf[8192];
    snprintf(buf, sizeof(buf), "%s", funcs);
    char* save = NULL;
    for (char* tok = strtok_r(buf, ";", &save); tok; tok = strtok_r(NULL, ";", &save)) {
      add_func(tok);
    }
  }
  const char* fail = getenv("FAKE_CUDA_FAIL");
  if (fail) {
    snprintf(g_fail, sizeof(g_fail), ",%s,", fail);
    const char* over = strstr(fail, "launch_dyn_over=");
    if (over) g_launch_dyn_over = atol(over + strlen("launch_dyn_over="));
  }
  const char* log = getenv("FAKE_CUDA_LOG");
  if (log && *log) g_log_fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
}

static void ensure_init(void) { pthread_once(&g_once, init); }

static int should_fail(const char* api) {
  char key[160];
  snprintf(key, sizeof(key), ",%s,", api);
  return strstr(g_fail, key) != NULL;
}

static void logf_(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void logf_(const char* fmt, ...) {
  if (g_log_fd < 0) return;
  char line[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof(line) - 1, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if (n > (int)sizeof(line) - 2) n = sizeof(line) - 2;
  line[n++] = '\n';
  /* One write per line with O_APPEND: lines from several threads do not mix. */
  ssize_t w = write(g_log_fd, line, (size_t)n);
  (void)w;
}

#define CHECK_FAIL(api)                                   \
  do {                                                    \
    ensure_init();                                        \
    if (should_fail(api)) {                               \
      logf_("error api=%s", api);                         \
      return JOR_CUDA_ERROR_INVALID_VALUE;                \
    }                                                     \
  } while (0)

/* ---- Introspection for tests. ---- */
EXPORT int fake_cuda_launch_count(void) { return __atomic_load_n(&g_launch_count, __ATOMIC_SEQ_CST); }
EXPORT unsigned fake_cuda_launch_dyn(int i) {
  return (i >= 0 && i < MAX_RECORDS) ? g_launch_dyn[i] : 0;
}

/* ---- Initialization, devices, contexts. ---- */
EXPORT CUresult cuInit(unsigned flags) { (void)flags; CHECK_FAIL("cuInit"); return 0; }
EXPORT CUresult cuDriverGetVersion(int* v) { *v = 13000; return 0; }
EXPORT CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  CHECK_FAIL("cuDeviceGet");
  *d = ordinal;
  return ordinal == 0 ? 0 : JOR_CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuCtxGetDevice(CUdevice* d) { CHECK_FAIL("cuCtxGetDevice"); *d = 0; return 0; }

EXPORT CUresult cuDeviceGetAttribute(int* pi, int attrib, CUdevice dev) {
  CHECK_FAIL("cuDeviceGetAttribute");
  (void)dev;
  switch (attrib) {
    case JOR_CU_DEVICE_ATTRIBUTE_WARP_SIZE: *pi = g_dev.warp; break;
    case JOR_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *pi = g_dev.sm; break;
    case JOR_CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: *pi = g_dev.threads_sm; break;
    case JOR_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: *pi = g_dev.smem_sm; break;
    case JOR_CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: *pi = g_dev.regs_sm; break;
    case JOR_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *pi = g_dev.optin; break;
    case JOR_CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: *pi = g_dev.blocks_sm; break;
    case JOR_CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK: *pi = g_dev.reserved; break;
    case JOR_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *pi = g_dev.cc_major; break;
    case JOR_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *pi = g_dev.cc_minor; break;
    default: return JOR_CUDA_ERROR_INVALID_VALUE;
  }
  return 0;
}

EXPORT CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
  CHECK_FAIL("cuCtxGetStreamPriorityRange");
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return 0;
}

/* ---- Streams. ---- */
static CUresult make_stream(CUstream* ph, unsigned flags, int priority, const char* api) {
  FakeStream* s = (FakeStream*)calloc(1, sizeof(FakeStream));
  s->id = __atomic_add_fetch(&g_stream_count, 1, __ATOMIC_SEQ_CST);
  if (priority < -5) priority = -5;
  if (priority > 0) priority = 0;
  s->priority = priority;
  *ph = (CUstream)s;
  logf_("stream api=%s id=%d flags=%u priority=%d", api, s->id, flags, priority);
  return 0;
}
EXPORT CUresult cuStreamCreate(CUstream* ph, unsigned flags) {
  CHECK_FAIL("cuStreamCreate");
  return make_stream(ph, flags, 0, "cuStreamCreate");
}
EXPORT CUresult cuStreamCreateWithPriority(CUstream* ph, unsigned flags, int priority) {
  CHECK_FAIL("cuStreamCreateWithPriority");
  return make_stream(ph, flags, priority, "cuStreamCreateWithPriority");
}
EXPORT CUresult cuStreamGetPriority(CUstream h, int* priority) {
  CHECK_FAIL("cuStreamGetPriority");
  *priority = h ? ((FakeStream*)h)->priority : 0;
  return 0;
}

/* ---- Modules and functions. ---- */
EXPORT CUresult cuModuleLoadData(CUmodule* m, const void* image) {
  (void)image;
  CHECK_FAIL("cuModuleLoadData");
  *m = (CUmodule)(uintptr_t)0x1000;
  return 0;
}
static FakeFunc* find_or_add(const char* name) {
  pthread_mutex_lock(&g_mu);
  FakeFunc* found = NULL;
  for (int i = 0; i < g_num_funcs; ++i) {
    if (!strcmp(g_funcs[i].name, name)) found = &g_funcs[i];
  }
  if (!found) {
    char spec[160];
    snprintf(spec, sizeof(spec), "%s", name);
    found = add_func(spec);
  }
  pthread_mutex_unlock(&g_mu);
  return found;
}

EXPORT CUresult cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
  (void)m;
  CHECK_FAIL("cuModuleGetFunction");
  FakeFunc* found = find_or_add(name);
  if (!found) return JOR_CUDA_ERROR_NOT_FOUND;
  *f = (CUfunction)found;
  return 0;
}

/* Context-less kernels (CUkernel), which the CUDA runtime of CUDA 12 and later
 * launches: one handle per function, distinct from it. cuLaunchKernel accepts
 * either; the function-attribute entry points and the occupancy calculator
 * refuse a kernel handle with CUDA_ERROR_INVALID_HANDLE, as the driver does;
 * cuKernelGetFunction gives its function in the (one) context. */
typedef struct FakeKernel {
  FakeFunc* func;
} FakeKernel;
static FakeKernel g_kernels[MAX_FUNCS];

static FakeFunc* kernel_func(const void* h) {
  const FakeKernel* k = (const FakeKernel*)h;
  if (k < g_kernels || k >= g_kernels + MAX_FUNCS) return NULL;
  return k->func;
}

EXPORT CUresult cuLibraryGetKernel(CUkernel* k, void* lib, const char* name) {
  (void)lib;
  CHECK_FAIL("cuLibraryGetKernel");
  FakeFunc* f = find_or_add(name);
  if (!f) return JOR_CUDA_ERROR_NOT_FOUND;
  FakeKernel* kernel = &g_kernels[f - g_funcs];
  kernel->func = f;
  *k = (CUkernel)kernel;
  return 0;
}

EXPORT CUresult cuKernelGetFunction(CUfunction* f, CUkernel k) {
  CHECK_FAIL("cuKernelGetFunction");
  FakeFunc* func = kernel_func(k);
  if (!func) return JOR_CUDA_ERROR_INVALID_HANDLE;
  *f = (CUfunction)func;
  return 0;
}

#define REFUSE_KERNEL_HANDLE(api, h)                              \
  do {                                                            \
    if (kernel_func(h)) {                                         \
      logf_("error api=%s kernel_handle=1", api);                 \
      return JOR_CUDA_ERROR_INVALID_HANDLE;                       \
    }                                                             \
  } while (0)

static void reload_funcs(const char* specs) {
  char buf[8192];
  snprintf(buf, sizeof(buf), "%s", specs);
  char* save = NULL;
  for (char* tok = strtok_r(buf, ";", &save); tok; tok = strtok_r(NULL, ";", &save)) {
    char name[128];
    snprintf(name, sizeof(name), "%s", tok);
    char* colon = strchr(name, ':');
    if (colon) *colon = '\0';
    for (int i = 0; i < g_num_funcs; ++i) {
      if (!strcmp(g_funcs[i].name, name)) {
        int n = g_num_funcs;
        g_num_funcs = i;
        add_func(tok); /* rewrites slot i in place */
        g_num_funcs = n;
      }
    }
  }
}

EXPORT CUresult cuModuleUnload(CUmodule m) {
  (void)m;
  CHECK_FAIL("cuModuleUnload");
  const char* after = getenv("FAKE_CUDA_FUNCS_AFTER_UNLOAD");
  pthread_mutex_lock(&g_mu);
  if (after) reload_funcs(after);
  pthread_mutex_unlock(&g_mu);
  logf_("unload api=cuModuleUnload");
  return 0;
}

EXPORT CUresult cuLibraryUnload(void* lib) {
  (void)lib;
  CHECK_FAIL("cuLibraryUnload");
  logf_("unload api=cuLibraryUnload");
  return 0;
}

EXPORT CUresult cuFuncGetAttribute(int* pi, int attrib, CUfunction hf) {
  CHECK_FAIL("cuFuncGetAttribute");
  REFUSE_KERNEL_HANDLE("cuFuncGetAttribute", hf);
  FakeFunc* f = (FakeFunc*)hf;
  if (!f) return JOR_CUDA_ERROR_INVALID_VALUE;
  switch (attrib) {
    case JOR_CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
    case JOR_CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: *pi = f->static_smem; break;
    case JOR_CU_FUNC_ATTRIBUTE_NUM_REGS: *pi = f->regs; break;
    case JOR_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *pi = f->max_dyn; break;
    case JOR_CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: *pi = f->carveout; break;
    case JOR_CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH: *pi = f->cluster > 0 ? f->cluster : 1; break;
    case JOR_CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT: *pi = 1; break;
    case JOR_CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH: *pi = 1; break;
    default: return JOR_CUDA_ERROR_INVALID_VALUE;
  }
  return 0;
}

EXPORT CUresult cuFuncSetAttribute(CUfunction hf, int attrib, int value) {
  CHECK_FAIL("cuFuncSetAttribute");
  REFUSE_KERNEL_HANDLE("cuFuncSetAttribute", hf);
  FakeFunc* f = (FakeFunc*)hf;
  if (!f) return JOR_CUDA_ERROR_INVALID_VALUE;
  if (attrib == JOR_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
    if (value < 0 || f->static_smem + value > g_dev.optin) {
      logf_("setattr func=%s attr=%d value=%d result=1", f->name, attrib, value);
      return JOR_CUDA_ERROR_INVALID_VALUE;
    }
    f->max_dyn = value;
  } else if (attrib == JOR_CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT) {
    if (value < -1 || value > 100) return JOR_CUDA_ERROR_INVALID_VALUE;
    f->carveout = value;
  } else {
    return JOR_CUDA_ERROR_INVALID_VALUE;
  }
  logf_("setattr func=%s attr=%d value=%d result=0", f->name, attrib, value);
  return 0;
}

EXPORT CUresult cuFuncGetName(const char** name, CUfunction hf) {
  CHECK_FAIL("cuFuncGetName");
  REFUSE_KERNEL_HANDLE("cuFuncGetName", hf);
  if (!hf) return JOR_CUDA_ERROR_INVALID_VALUE;
  *name = ((FakeFunc*)hf)->name;
  return 0;
}

/* ---- Launches: validated as the driver would, then recorded. ---- */
/* Blocks of `f` resident per SM by NVIDIA's published occupancy rules (the CUDA
 * occupancy calculator, cuda_occupancy.h), written independently of the runtime
 * library's arithmetic: warps per SM; registers allocated per warp in units of 256
 * and split over four sub-partitions (a warp's registers come from one of them);
 * shared memory per block (static + dynamic + the per-block reservation) in
 * 128-byte units; the blocks-per-SM limit. 0: the block cannot run. */
static int occupancy(const FakeFunc* f, int threads, long dyn) {
  if (threads <= 0 || threads > 1024 || f->regs > 255) return 0;
  if ((long)f->static_smem + dyn > g_dev.optin) return 0;
  int warps = (threads + g_dev.warp - 1) / g_dev.warp;
  int limit = g_dev.blocks_sm;
  int by_warps = (g_dev.threads_sm / g_dev.warp) / warps;
  if (by_warps < limit) limit = by_warps;
  if (f->regs > 0) {
    int per_warp = (f->regs * g_dev.warp + 255) / 256 * 256;
    int warps_per_partition = (g_dev.regs_sm / 4) / per_warp;
    int by_regs = warps_per_partition * 4 / warps;
    if (by_regs < limit) limit = by_regs;
  }
  long smem = ((long)f->static_smem + dyn + g_dev.reserved + 127) / 128 * 128;
  if (smem > 0 && g_dev.smem_sm / smem < limit) limit = (int)(g_dev.smem_sm / smem);
  return limit;
}

EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* n, CUfunction hf,
                                                                     int block, size_t dyn,
                                                                     unsigned flags) {
  (void)flags;
  CHECK_FAIL("cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags");
  REFUSE_KERNEL_HANDLE("cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags", hf);
  FakeFunc* f = (FakeFunc*)hf;
  if (!f || !n) return JOR_CUDA_ERROR_INVALID_VALUE;
  *n = occupancy(f, block, (long)dyn);
  return 0;
}

static CUresult do_launch(const char* api, CUfunction hf, unsigned gx, unsigned gy,
                          unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned dyn,
                          CUstream s) {
  FakeFunc* f = kernel_func(hf) ? kernel_func(hf) : (FakeFunc*)hf;
  if (!f) return JOR_CUDA_ERROR_INVALID_VALUE;
  unsigned threads = bx * by * bz;
  CUresult r = 0;
  if (threads == 0 || threads > 1024) r = JOR_CUDA_ERROR_INVALID_VALUE;
  else if ((long)f->static_smem + dyn > g_dev.optin) r = JOR_CUDA_ERROR_INVALID_VALUE;
  else if ((int)dyn > f->max_dyn) r = JOR_CUDA_ERROR_INVALID_VALUE;
  else if ((long)f->regs * threads > g_dev.regs_sm) r = JOR_CUDA_ERROR_INVALID_VALUE;
  else if (g_launch_dyn_over >= 0 && (long)dyn > g_launch_dyn_over) r = JOR_CUDA_ERROR_INVALID_VALUE;
  logf_("launch api=%s func=%s grid=%u,%u,%u block=%u,%u,%u threads=%u dyn=%u static=%d "
        "regs=%d stream=%d tid=%ld captured=%d occ=%d result=%d",
        api, f->name, gx, gy, gz, bx, by, bz, threads, dyn, f->static_smem, f->regs,
        s ? ((FakeStream*)s)->id : 0, (long)syscall(SYS_gettid), g_capturing,
        occupancy(f, (int)threads, dyn), r);
  /* As the driver does: an error inside a capture invalidates it. */
  if (r != 0 && g_capturing) g_capturing = 2;
  if (r == 0) {
    int i = __atomic_fetch_add(&g_launch_count, 1, __ATOMIC_SEQ_CST);
    if (i < MAX_RECORDS) g_launch_dyn[i] = dyn;
  }
  return r;
}

#define LAUNCH_PARAMS                                                              \
  CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,   \
      unsigned bz, unsigned dyn, CUstream s, void **params, void **extra
EXPORT CUresult cuLaunchKernel(LAUNCH_PARAMS) {
  (void)params; (void)extra;
  CHECK_FAIL("cuLaunchKernel");
  return do_launch("cuLaunchKernel", f, gx, gy, gz, bx, by, bz, dyn, s);
}
EXPORT CUresult cuLaunchKernel_ptsz(LAUNCH_PARAMS) {
  (void)params; (void)extra;
  CHECK_FAIL("cuLaunchKernel");
  return do_launch("cuLaunchKernel_ptsz", f, gx, gy, gz, bx, by, bz, dyn, s);
}
EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig* c, CUfunction f, void** params,
                                 void** extra) {
  (void)params; (void)extra;
  CHECK_FAIL("cuLaunchKernelEx");
  return do_launch("cuLaunchKernelEx", f, c->gridDimX, c->gridDimY, c->gridDimZ,
                   c->blockDimX, c->blockDimY, c->blockDimZ, c->sharedMemBytes, c->hStream);
}
EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig* c, CUfunction f, void** params,
                                      void** extra) {
  (void)params; (void)extra;
  CHECK_FAIL("cuLaunchKernelEx");
  return do_launch("cuLaunchKernelEx_ptsz", f, c->gridDimX, c->gridDimY, c->gridDimZ,
                   c->blockDimX, c->blockDimY, c->blockDimZ, c->sharedMemBytes, c->hStream);
}

/* ---- Graphs: nodes are validated and recorded like launches. ---- */
static CUresult graph_node(const char* api, const CUDA_KERNEL_NODE_PARAMS_v1* p) {
  FakeFunc* f = p ? (FakeFunc*)p->func : NULL;
  if (!f) return JOR_CUDA_ERROR_INVALID_VALUE;
  CUresult r = 0;
  if ((long)f->static_smem + p->sharedMemBytes > g_dev.optin ||
      (int)p->sharedMemBytes > f->max_dyn) {
    r = JOR_CUDA_ERROR_INVALID_VALUE;
  }
  logf_("graphnode api=%s func=%s threads=%u dyn=%u result=%d", api, f->name,
        p->blockDimX * p->blockDimY * p->blockDimZ, p->sharedMemBytes, r);
  return r;
}
EXPORT CUresult cuGraphAddKernelNode(CUgraphNode* n, CUgraph g, const CUgraphNode* d,
                                     size_t nd, const CUDA_KERNEL_NODE_PARAMS_v1* p) {
  (void)g; (void)d; (void)nd;
  CHECK_FAIL("cuGraphAddKernelNode");
  if (n) *n = (CUgraphNode)(uintptr_t)0x2000;
  return graph_node("cuGraphAddKernelNode", p);
}
EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode* n, CUgraph g, const CUgraphNode* d,
                                        size_t nd, const CUDA_KERNEL_NODE_PARAMS_v2* p) {
  (void)g; (void)d; (void)nd;
  CHECK_FAIL("cuGraphAddKernelNode");
  if (n) *n = (CUgraphNode)(uintptr_t)0x2000;
  return graph_node("cuGraphAddKernelNode_v2", (const CUDA_KERNEL_NODE_PARAMS_v1*)p);
}
EXPORT CUresult cuGraphExecKernelNodeSetParams(CUgraphExec e, CUgraphNode n,
                                               const CUDA_KERNEL_NODE_PARAMS_v1* p) {
  (void)e; (void)n;
  CHECK_FAIL("cuGraphExecKernelNodeSetParams");
  return graph_node("cuGraphExecKernelNodeSetParams", p);
}
EXPORT CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec e, CUgraphNode n,
                                                  const CUDA_KERNEL_NODE_PARAMS_v2* p) {
  (void)e; (void)n;
  CHECK_FAIL("cuGraphExecKernelNodeSetParams");
  return graph_node("cuGraphExecKernelNodeSetParams_v2", (const CUDA_KERNEL_NODE_PARAMS_v1*)p);
}

EXPORT CUresult cuGraphKernelNodeSetParams(CUgraphNode n, const CUDA_KERNEL_NODE_PARAMS_v1* p) {
  (void)n;
  CHECK_FAIL("cuGraphKernelNodeSetParams");
  return graph_node("cuGraphKernelNodeSetParams", p);
}
EXPORT CUresult cuGraphKernelNodeSetParams_v2(CUgraphNode n, const CUDA_KERNEL_NODE_PARAMS_v2* p) {
  (void)n;
  CHECK_FAIL("cuGraphKernelNodeSetParams");
  return graph_node("cuGraphKernelNodeSetParams_v2", (const CUDA_KERNEL_NODE_PARAMS_v1*)p);
}

/* The generic node API: kernel nodes are validated like cuGraphAddKernelNode's;
 * other node types are logged with their type and accepted. */
static CUresult generic_node(const char* api, const CUgraphNodeParams* p) {
  if (!p) return JOR_CUDA_ERROR_INVALID_VALUE;
  if (p->type != JOR_CU_GRAPH_NODE_TYPE_KERNEL) {
    logf_("graphnode api=%s type=%d result=0", api, p->type);
    return 0;
  }
  return graph_node(api, (const CUDA_KERNEL_NODE_PARAMS_v1*)&p->kernel);
}
EXPORT CUresult cuGraphAddNode(CUgraphNode* n, CUgraph g, const CUgraphNode* d, size_t nd,
                               CUgraphNodeParams* p) {
  (void)g; (void)d; (void)nd;
  CHECK_FAIL("cuGraphAddNode");
  if (n) *n = (CUgraphNode)(uintptr_t)0x2000;
  return generic_node("cuGraphAddNode", p);
}
EXPORT CUresult cuGraphAddNode_v2(CUgraphNode* n, CUgraph g, const CUgraphNode* d,
                                  const CUgraphEdgeData* e, size_t nd, CUgraphNodeParams* p) {
  (void)g; (void)d; (void)e; (void)nd;
  CHECK_FAIL("cuGraphAddNode");
  if (n) *n = (CUgraphNode)(uintptr_t)0x2000;
  return generic_node("cuGraphAddNode_v2", p);
}
EXPORT CUresult cuGraphNodeSetParams(CUgraphNode n, CUgraphNodeParams* p) {
  (void)n;
  CHECK_FAIL("cuGraphNodeSetParams");
  return generic_node("cuGraphNodeSetParams", p);
}
EXPORT CUresult cuGraphExecNodeSetParams(CUgraphExec e, CUgraphNode n, CUgraphNodeParams* p) {
  (void)e; (void)n;
  CHECK_FAIL("cuGraphExecNodeSetParams");
  return generic_node("cuGraphExecNodeSetParams", p);
}

#define COOP_PARAMS                                                                \
  CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,   \
      unsigned bz, unsigned dyn, CUstream s, void **params
EXPORT CUresult cuLaunchCooperativeKernel(COOP_PARAMS) {
  (void)params;
  CHECK_FAIL("cuLaunchCooperativeKernel");
  return do_launch("cuLaunchCooperativeKernel", f, gx, gy, gz, bx, by, bz, dyn, s);
}
EXPORT CUresult cuLaunchCooperativeKernel_ptsz(COOP_PARAMS) {
  (void)params;
  CHECK_FAIL("cuLaunchCooperativeKernel");
  return do_launch("cuLaunchCooperativeKernel_ptsz", f, gx, gy, gz, bx, by, bz, dyn, s);
}

/* Stream capture: status 0 none, 1 active, 2 invalidated. */
EXPORT CUresult cuStreamBeginCapture(CUstream s, int mode) {
  (void)s; (void)mode;
  CHECK_FAIL("cuStreamBeginCapture");
  g_capturing = 1;
  logf_("capture begin");
  return 0;
}
EXPORT CUresult cuStreamEndCapture(CUstream s, CUgraph* g) {
  (void)s;
  CHECK_FAIL("cuStreamEndCapture");
  CUresult r = g_capturing == 2 ? 901 /* CUDA_ERROR_STREAM_CAPTURE_INVALIDATED */ : 0;
  g_capturing = 0;
  if (g) *g = (CUgraph)(uintptr_t)0x3000;
  logf_("capture end result=%d", r);
  return r;
}
EXPORT CUresult cuStreamIsCapturing(CUstream s, int* status) {
  (void)s;
  CHECK_FAIL("cuStreamIsCapturing");
  if (status) *status = g_capturing;
  return 0;
}

/* Internal, unexported launch entry points (FAKE_CUDA_VERSIONED_PROCS). */
static CUresult launch_v2_internal(LAUNCH_PARAMS) {
  (void)params; (void)extra;
  CHECK_FAIL("cuLaunchKernel");
  return do_launch("cuLaunchKernel_v2_internal", f, gx, gy, gz, bx, by, bz, dyn, s);
}
static CUresult launch_ex_v2_internal(const CUlaunchConfig* c, CUfunction f, void** params,
                                      void** extra) {
  (void)params; (void)extra;
  CHECK_FAIL("cuLaunchKernelEx");
  return do_launch("cuLaunchKernelEx_v2_internal", f, c->gridDimX, c->gridDimY, c->gridDimZ,
                   c->blockDimX, c->blockDimY, c->blockDimZ, c->sharedMemBytes, c->hStream);
}

/* ---- cuGetProcAddress: answers with this library's own entry points. ---- */
typedef struct ProcEntry {
  const char* name;
  void* fn;
} ProcEntry;

static void* lookup_proc(const char* symbol, int version, cuuint64_t flags) {
  const int ptsz = (flags & JOR_CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
  const char* versioned = getenv("FAKE_CUDA_VERSIONED_PROCS");
  if (versioned && !strcmp(versioned, "1")) {
    if (!strcmp(symbol, "cuLaunchKernel")) return (void*)launch_v2_internal;
    if (!strcmp(symbol, "cuLaunchKernelEx")) return (void*)launch_ex_v2_internal;
  }
  if (!strcmp(symbol, "cuLaunchKernel")) return ptsz ? (void*)cuLaunchKernel_ptsz : (void*)cuLaunchKernel;
  if (!strcmp(symbol, "cuLaunchKernelEx")) return ptsz ? (void*)cuLaunchKernelEx_ptsz : (void*)cuLaunchKernelEx;
  if (!strcmp(symbol, "cuGraphAddKernelNode"))
    return version >= 12000 ? (void*)cuGraphAddKernelNode_v2 : (void*)cuGraphAddKernelNode;
  if (!strcmp(symbol, "cuGraphExecKernelNodeSetParams"))
    return version >= 12000 ? (void*)cuGraphExecKernelNodeSetParams_v2
                            : (void*)cuGraphExecKernelNodeSetParams;
  if (!strcmp(symbol, "cuGraphKernelNodeSetParams"))
    return version >= 12000 ? (void*)cuGraphKernelNodeSetParams_v2
                            : (void*)cuGraphKernelNodeSetParams;
  if (!strcmp(symbol, "cuGraphAddNode"))
    return version >= 12030 ? (void*)cuGraphAddNode_v2 : (void*)cuGraphAddNode;
  if (!strcmp(symbol, "cuLaunchCooperativeKernel"))
    return ptsz ? (void*)cuLaunchCooperativeKernel_ptsz : (void*)cuLaunchCooperativeKernel;
  static const ProcEntry table[] = {
      {"cuGraphNodeSetParams", (void*)cuGraphNodeSetParams},
      {"cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags",
       (void*)cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags},
      {"cuStreamBeginCapture", (void*)cuStreamBeginCapture},
      {"cuStreamEndCapture", (void*)cuStreamEndCapture},
      {"cuStreamIsCapturing", (void*)cuStreamIsCapturing},
      {"cuGraphExecNodeSetParams", (void*)cuGraphExecNodeSetParams},
      {"cuInit", (void*)cuInit},
      {"cuDriverGetVersion", (void*)cuDriverGetVersion},
      {"cuDeviceGet", (void*)cuDeviceGet},
      {"cuCtxGetDevice", (void*)cuCtxGetDevice},
      {"cuDeviceGetAttribute", (void*)cuDeviceGetAttribute},
      {"cuCtxGetStreamPriorityRange", (void*)cuCtxGetStreamPriorityRange},
      {"cuStreamCreate", (void*)cuStreamCreate},
      {"cuStreamCreateWithPriority", (void*)cuStreamCreateWithPriority},
      {"cuStreamGetPriority", (void*)cuStreamGetPriority},
      {"cuModuleLoadData", (void*)cuModuleLoadData},
      {"cuModuleGetFunction", (void*)cuModuleGetFunction},
      {"cuModuleUnload", (void*)cuModuleUnload},
      {"cuLibraryUnload", (void*)cuLibraryUnload},
      {"cuFuncGetAttribute", (void*)cuFuncGetAttribute},
      {"cuFuncSetAttribute", (void*)cuFuncSetAttribute},
      {"cuFuncGetName", (void*)cuFuncGetName},
      {"cuLibraryGetKernel", (void*)cuLibraryGetKernel},
      {"cuKernelGetFunction", (void*)cuKernelGetFunction},
  };
  for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); ++i) {
    if (!strcmp(symbol, table[i].name)) return table[i].fn;
  }
  return NULL;
}

EXPORT CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version,
                                    cuuint64_t flags, CUdriverProcAddressQueryResult* st);
EXPORT CUresult cuGetProcAddress(const char* symbol, void** pfn, int version,
                                 cuuint64_t flags) {
  CHECK_FAIL("cuGetProcAddress");
  void* p = NULL;
  if (!strcmp(symbol, "cuGetProcAddress")) {
    p = version >= 12000 ? (void*)cuGetProcAddress_v2 : (void*)cuGetProcAddress;
  } else {
    p = lookup_proc(symbol, version, flags);
  }
  logf_("procaddr symbol=%s version=%d flags=%llu found=%d", symbol, version,
        (unsigned long long)flags, p != NULL);
  *pfn = p;
  return p ? 0 : JOR_CUDA_ERROR_NOT_FOUND;
}
EXPORT CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version,
                                    cuuint64_t flags, CUdriverProcAddressQueryResult* st) {
  CUresult r = cuGetProcAddress(symbol, pfn, version, flags);
  if (st) *st = r == 0 ? 0 : 1;
  return r;
}
