/* A test program that reaches the (fake) driver the way real programs do.
 *
 *   fake_app MODE ACTION...
 *
 * MODE: direct    calls the driver symbols it was linked against (-lcuda),
 *       dlopen    dlopen("libcuda.so.1") + dlsym, as XLA's runtime does,
 *       procaddr  cuGetProcAddress_v2 (per-thread default stream variants),
 *                 as the CUDA runtime, cuBLAS and CuPy do,
 *       procaddr1 cuGetProcAddress (v1) with legacy-stream variants.
 * ACTION: launch:NAME:THREADS:DYN[:COUNT]     cuLaunchKernel
 *         klaunch:NAME:THREADS:DYN[:COUNT]    cuLaunchKernel of a context-less kernel
 *                                             (cuLibraryGetKernel), as the CUDA runtime does
 *         klaunchex:NAME:THREADS:DYN[:...]    the same through cuLaunchKernelEx
 *         launchex:NAME:THREADS:DYN[:coop|cluster]  cuLaunchKernelEx
 *         graph:NAME:THREADS:DYN              cuGraphAddKernelNode (_v2 ABI)
 *         graphset:NAME:THREADS:DYN           cuGraphExecKernelNodeSetParams
 *         kset:NAME:THREADS:DYN               cuGraphKernelNodeSetParams (_v2 ABI)
 *         node:NAME:THREADS:DYN[:TYPE]        cuGraphAddNode (_v2 ABI), kernel node
 *                                             (or node type TYPE, e.g. 2 = memset)
 *         nodeset:NAME:THREADS:DYN            cuGraphNodeSetParams, kernel node
 *         execnodeset:NAME:THREADS:DYN        cuGraphExecNodeSetParams, kernel node
 *         coop:NAME:THREADS:DYN               cuLaunchCooperativeKernel
 *         setattr:NAME:VALUE                  cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)
 *         capture_begin | capture_end         cuStreamBeginCapture / cuStreamEndCapture
 *         launchon:NAME:THREADS:DYN:S         cuLaunchKernel on the S-th created stream
 *         region_begin_on:ID:BLOCKS:S         jor_region_begin_on_stream (S-th stream)
 *         stream | streamprio:P               cuStreamCreate(WithPriority)
 *         threads:N:NAME:THREADS:DYN:COUNT    N threads launching concurrently
 *         region_begin:ID:BLOCKS | region_end:ID   jor_region_* if loaded
 *         rules:FILE                          jor_set_rules(contents of FILE)
 *         unload                              cuModuleUnload
 *         next:SYMBOL                         which object dlsym(RTLD_NEXT, SYMBOL) finds
 *         cublas:PATH                         dlopen a cuBLAS, create a handle with the
 *                                             cublasCreate_v2 dlsym gives (as XLA does),
 *                                             print the handle's SM-count target
 *         cublaslt:PATH                       the same for a cuBLASLt matmul descriptor
 * Prints one "result ..." line per action and a final "counters {...}" line.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../runtime/cuda_types.h"

typedef CUresult (*PFN_init)(unsigned);
typedef CUresult (*PFN_getfunc)(CUfunction*, CUmodule, const char*);
typedef CUresult (*PFN_launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                               unsigned, unsigned, CUstream, void**, void**);
typedef CUresult (*PFN_launchex)(const CUlaunchConfig*, CUfunction, void**, void**);
typedef CUresult (*PFN_graphadd)(CUgraphNode*, CUgraph, const CUgraphNode*, size_t,
                                 const CUDA_KERNEL_NODE_PARAMS_v2*);
typedef CUresult (*PFN_graphset)(CUgraphExec, CUgraphNode, const CUDA_KERNEL_NODE_PARAMS_v2*);
typedef CUresult (*PFN_kset)(CUgraphNode, const CUDA_KERNEL_NODE_PARAMS_v2*);
typedef CUresult (*PFN_nodeadd)(CUgraphNode*, CUgraph, const CUgraphNode*, const CUgraphEdgeData*,
                                size_t, CUgraphNodeParams*);
typedef CUresult (*PFN_nodeset)(CUgraphNode, CUgraphNodeParams*);
typedef CUresult (*PFN_execnodeset)(CUgraphExec, CUgraphNode, CUgraphNodeParams*);
typedef CUresult (*PFN_coop)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, unsigned, CUstream, void**);
typedef CUresult (*PFN_setattr)(CUfunction, int, int);
typedef CUresult (*PFN_streamcreate)(CUstream*, unsigned);
typedef CUresult (*PFN_streamprio)(CUstream*, unsigned, int);
typedef CUresult (*PFN_streamgetprio)(CUstream, int*);
typedef CUresult (*PFN_unload)(CUmodule);
typedef CUresult (*PFN_procaddr2)(const char*, void**, int, cuuint64_t,
                                  CUdriverProcAddressQueryResult*);
typedef CUresult (*PFN_procaddr1)(const char*, void**, int, cuuint64_t);

static struct {
  PFN_init init;
  PFN_getfunc getfunc;
  PFN_launch launch;
  PFN_launchex launchex;
  PFN_graphadd graphadd;
  PFN_graphset graphset;
  PFN_kset kset;
  PFN_nodeadd nodeadd;
  PFN_nodeset nodeset;
  PFN_execnodeset execnodeset;
  PFN_coop coop;
  PFN_setattr setattr;
  PFN_streamcreate streamcreate;
  PFN_streamprio streamprio;
  PFN_streamgetprio streamgetprio;
  PFN_unload unload;
} api;

#ifdef LINK_DIRECT
CUresult cuInit(unsigned);
CUresult cuModuleGetFunction(CUfunction*, CUmodule, const char*);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, CUstream, void**, void**);
CUresult cuLaunchKernelEx(const CUlaunchConfig*, CUfunction, void**, void**);
CUresult cuGraphAddKernelNode_v2(CUgraphNode*, CUgraph, const CUgraphNode*, size_t,
                                 const CUDA_KERNEL_NODE_PARAMS_v2*);
CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec, CUgraphNode,
                                           const CUDA_KERNEL_NODE_PARAMS_v2*);
CUresult cuGraphKernelNodeSetParams_v2(CUgraphNode, const CUDA_KERNEL_NODE_PARAMS_v2*);
CUresult cuGraphAddNode_v2(CUgraphNode*, CUgraph, const CUgraphNode*, const CUgraphEdgeData*,
                           size_t, CUgraphNodeParams*);
CUresult cuGraphNodeSetParams(CUgraphNode, CUgraphNodeParams*);
CUresult cuGraphExecNodeSetParams(CUgraphExec, CUgraphNode, CUgraphNodeParams*);
CUresult cuLaunchCooperativeKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                   unsigned, unsigned, CUstream, void**);
CUresult cuFuncSetAttribute(CUfunction, int, int);
CUresult cuStreamCreate(CUstream*, unsigned);
CUresult cuStreamCreateWithPriority(CUstream*, unsigned, int);
CUresult cuStreamGetPriority(CUstream, int*);
CUresult cuModuleUnload(CUmodule);
static int load_direct(void) {
  api.unload = cuModuleUnload;
  api.init = cuInit;
  api.getfunc = cuModuleGetFunction;
  api.launch = cuLaunchKernel;
  api.launchex = cuLaunchKernelEx;
  api.graphadd = cuGraphAddKernelNode_v2;
  api.graphset = cuGraphExecKernelNodeSetParams_v2;
  api.kset = cuGraphKernelNodeSetParams_v2;
  api.nodeadd = cuGraphAddNode_v2;
  api.nodeset = cuGraphNodeSetParams;
  api.execnodeset = cuGraphExecNodeSetParams;
  api.coop = cuLaunchCooperativeKernel;
  api.setattr = cuFuncSetAttribute;
  api.streamcreate = cuStreamCreate;
  api.streamprio = cuStreamCreateWithPriority;
  api.streamgetprio = cuStreamGetPriority;
  return 0;
}
#endif

static void* must(void* p, const char* what) {
  if (!p) {
    fprintf(stderr, "fake_app: cannot resolve %s\n", what);
    exit(3);
  }
  return p;
}

static int load_dlopen(void) {
  void* h = must(dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL), "libcuda.so.1");
#define SYM(field, name) api.field = must(dlsym(h, name), name)
  SYM(init, "cuInit");
  SYM(getfunc, "cuModuleGetFunction");
  SYM(launch, "cuLaunchKernel");
  SYM(launchex, "cuLaunchKernelEx");
  SYM(graphadd, "cuGraphAddKernelNode_v2");
  SYM(graphset, "cuGraphExecKernelNodeSetParams_v2");
  SYM(kset, "cuGraphKernelNodeSetParams_v2");
  SYM(nodeadd, "cuGraphAddNode_v2");
  SYM(nodeset, "cuGraphNodeSetParams");
  SYM(execnodeset, "cuGraphExecNodeSetParams");
  SYM(coop, "cuLaunchCooperativeKernel");
  SYM(setattr, "cuFuncSetAttribute");
  SYM(streamcreate, "cuStreamCreate");
  SYM(streamprio, "cuStreamCreateWithPriority");
  SYM(streamgetprio, "cuStreamGetPriority");
  SYM(unload, "cuModuleUnload");
#undef SYM
  return 0;
}

static int load_procaddr(int v2) {
  void* h = must(dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL), "libcuda.so.1");
  PFN_procaddr2 get2 = NULL;
  PFN_procaddr1 get1 = NULL;
  if (v2) get2 = must(dlsym(h, "cuGetProcAddress_v2"), "cuGetProcAddress_v2");
  else get1 = must(dlsym(h, "cuGetProcAddress"), "cuGetProcAddress");
  const int version = v2 ? 13000 : 11080;
  const cuuint64_t flags = v2 ? JOR_CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                              : JOR_CU_GET_PROC_ADDRESS_LEGACY_STREAM;
#define SYM(field, name)                                                     \
  do {                                                                       \
    void* p = NULL;                                                          \
    CUdriverProcAddressQueryResult st = 0;                                   \
    CUresult r = v2 ? get2(name, &p, version, flags, &st)                    \
                    : get1(name, &p, version, flags);                        \
    if (r != 0) { fprintf(stderr, "fake_app: cuGetProcAddress(%s) = %d\n", name, r); exit(3); } \
    api.field = p;                                                           \
  } while (0)
  SYM(init, "cuInit");
  SYM(getfunc, "cuModuleGetFunction");
  SYM(launch, "cuLaunchKernel");
  SYM(launchex, "cuLaunchKernelEx");
  SYM(streamcreate, "cuStreamCreate");
  SYM(streamprio, "cuStreamCreateWithPriority");
  SYM(streamgetprio, "cuStreamGetPriority");
  SYM(unload, "cuModuleUnload");
  SYM(coop, "cuLaunchCooperativeKernel");
  SYM(setattr, "cuFuncSetAttribute");
  if (v2) {
    SYM(graphadd, "cuGraphAddKernelNode");
    SYM(kset, "cuGraphKernelNodeSetParams");
    SYM(nodeadd, "cuGraphAddNode");
    SYM(nodeset, "cuGraphNodeSetParams");
    SYM(execnodeset, "cuGraphExecNodeSetParams");
  }
#undef SYM
  return 0;
}

static CUstream g_streams[16];
static int g_num_streams = 0;

static CUstream stream_at(const char* index) {
  int i = atoi(index);
  if (i < 0 || i >= g_num_streams) { fprintf(stderr, "fake_app: no stream %d\n", i); exit(3); }
  return g_streams[i];
}

static CUfunction get_function(const char* name) {
  CUfunction f = NULL;
  CUresult r = api.getfunc(&f, (CUmodule)0, name);
  if (r != 0) { fprintf(stderr, "fake_app: no function %s\n", name); exit(3); }
  return f;
}

/* A context-less kernel handle (CUkernel) for NAME, as the CUDA runtime of CUDA 12 and
 * later launches its kernels. */
static CUfunction get_kernel(const char* name) {
  typedef CUresult (*PFN_getkernel)(CUkernel*, void*, const char*);
  void* h = must(dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD), "libcuda.so.1");
  PFN_getkernel get = (PFN_getkernel)must(dlsym(h, "cuLibraryGetKernel"), "cuLibraryGetKernel");
  CUkernel k = NULL;
  if (get(&k, NULL, name) != 0) { fprintf(stderr, "fake_app: no kernel %s\n", name); exit(3); }
  return (CUfunction)k;
}

/* A kernel node's parameters from NAME:THREADS:DYN (fields[1..3]), grid 8. */
static void kernel_node(CUDA_KERNEL_NODE_PARAMS_v2* p, char** fields) {
  memset(p, 0, sizeof(*p));
  p->func = get_function(fields[1]);
  p->gridDimX = 8; p->gridDimY = p->gridDimZ = 1;
  p->blockDimX = (unsigned)atoi(fields[2]); p->blockDimY = p->blockDimZ = 1;
  p->sharedMemBytes = (unsigned)atoi(fields[3]);
}

typedef struct LaunchJob {
  CUfunction f;
  unsigned threads, dyn;
  int count;
  int failures;
} LaunchJob;

static void* launch_thread(void* arg) {
  LaunchJob* job = (LaunchJob*)arg;
  for (int i = 0; i < job->count; ++i) {
    if (api.launch(job->f, 4, 1, 1, job->threads, 1, 1, job->dyn, NULL, NULL, NULL) != 0) {
      job->failures++;
    }
  }
  return NULL;
}

static void print_counters(void) {
  int (*count)(void) = dlsym(RTLD_DEFAULT, "jor_counter_count");
  const char* (*name)(int) = dlsym(RTLD_DEFAULT, "jor_counter_name");
  uint64_t (*value)(int) = dlsym(RTLD_DEFAULT, "jor_counter_value");
  printf("counters {");
  if (count && name && value) {
    for (int i = 0; i < count(); ++i) {
      printf("%s\"%s\": %llu", i ? ", " : "", name(i), (unsigned long long)value(i));
    }
  }
  printf("}\n");
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: fake_app MODE ACTION...\n");
    return 2;
  }
  const char* mode = argv[1];
  if (!strcmp(mode, "direct")) {
#ifdef LINK_DIRECT
    load_direct();
#else
    fprintf(stderr, "fake_app: built without LINK_DIRECT\n");
    return 2;
#endif
  } else if (!strcmp(mode, "dlopen")) {
    load_dlopen();
  } else if (!strcmp(mode, "procaddr")) {
    load_procaddr(1);
  } else if (!strcmp(mode, "procaddr1")) {
    load_procaddr(0);
  } else {
    fprintf(stderr, "fake_app: unknown mode %s\n", mode);
    return 2;
  }
  api.init(0);
  for (int a = 2; a < argc; ++a) {
    char buf[512];
    snprintf(buf, sizeof(buf), "%s", argv[a]);
    char* fields[8] = {0};
    int nf = 0;
    char* save = NULL;
    for (char* t = strtok_r(buf, ":", &save); t && nf < 8; t = strtok_r(NULL, ":", &save)) {
      fields[nf++] = t;
    }
    const char* act = fields[0];
    if ((!strcmp(act, "launch") || !strcmp(act, "klaunch")) && nf >= 4) {
      CUfunction f = act[0] == 'k' ? get_kernel(fields[1]) : get_function(fields[1]);
      int count = nf >= 5 ? atoi(fields[4]) : 1;
      int fails = 0;
      CUresult last = 0;
      for (int i = 0; i < count; ++i) {
        last = api.launch(f, 8, 1, 1, (unsigned)atoi(fields[2]), 1, 1, (unsigned)atoi(fields[3]),
                          NULL, NULL, NULL);
        if (last) fails++;
      }
      printf("result %s %d failures=%d\n", argv[a], last, fails);
    } else if ((!strcmp(act, "launchex") || !strcmp(act, "klaunchex")) && nf >= 4) {
      CUfunction f = act[0] == 'k' ? get_kernel(fields[1]) : get_function(fields[1]);
      CUlaunchAttribute attr;
      memset(&attr, 0, sizeof(attr));
      CUlaunchConfig c;
      memset(&c, 0, sizeof(c));
      c.gridDimX = 8; c.gridDimY = c.gridDimZ = 1;
      c.blockDimX = (unsigned)atoi(fields[2]); c.blockDimY = c.blockDimZ = 1;
      c.sharedMemBytes = (unsigned)atoi(fields[3]);
      if (nf >= 5 && !strcmp(fields[4], "coop")) {
        attr.id = JOR_CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
        attr.value.cooperative = 1;
        c.attrs = &attr; c.numAttrs = 1;
      } else if (nf >= 5 && !strcmp(fields[4], "cluster")) {
        attr.id = JOR_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attr.value.clusterDim.x = 2; attr.value.clusterDim.y = attr.value.clusterDim.z = 1;
        c.attrs = &attr; c.numAttrs = 1;
      }
      printf("result %s %d\n", argv[a], api.launchex(&c, f, NULL, NULL));
    } else if ((!strcmp(act, "graph") || !strcmp(act, "graphset")) && nf >= 4) {
      CUDA_KERNEL_NODE_PARAMS_v2 p;
      kernel_node(&p, fields);
      CUresult r;
      if (!strcmp(act, "graph")) {
        CUgraphNode node = NULL;
        r = api.graphadd ? api.graphadd(&node, NULL, NULL, 0, &p) : -1;
      } else {
        r = api.graphset ? api.graphset(NULL, NULL, &p) : -1;
      }
      printf("result %s %d\n", argv[a], r);
    } else if (!strcmp(act, "kset") && nf >= 4) {
      CUDA_KERNEL_NODE_PARAMS_v2 p;
      kernel_node(&p, fields);
      printf("result %s %d\n", argv[a], api.kset ? api.kset(NULL, &p) : -1);
    } else if ((!strcmp(act, "node") || !strcmp(act, "nodeset") || !strcmp(act, "execnodeset")) &&
               nf >= 4) {
      CUgraphNodeParams p;
      memset(&p, 0, sizeof(p));
      p.type = nf >= 5 ? atoi(fields[4]) : JOR_CU_GRAPH_NODE_TYPE_KERNEL;
      kernel_node(&p.kernel, fields);
      const unsigned before = p.kernel.sharedMemBytes;
      CUresult r = -1;
      if (!strcmp(act, "node") && api.nodeadd) {
        CUgraphNode node = NULL;
        r = api.nodeadd(&node, NULL, NULL, NULL, 0, &p);
      } else if (!strcmp(act, "nodeset") && api.nodeset) {
        r = api.nodeset(NULL, &p);
      } else if (!strcmp(act, "execnodeset") && api.execnodeset) {
        r = api.execnodeset(NULL, NULL, &p);
      }
      /* The caller's parameters are never changed: shaping works on a copy. */
      printf("result %s %d caller_dyn_kept=%d\n", argv[a], r, p.kernel.sharedMemBytes == before);
    } else if (!strcmp(act, "coop") && nf >= 4) {
      CUfunction f = get_function(fields[1]);
      printf("result %s %d\n", argv[a],
             api.coop ? api.coop(f, 8, 1, 1, (unsigned)atoi(fields[2]), 1, 1,
                                 (unsigned)atoi(fields[3]), NULL, NULL)
                      : -1);
    } else if (!strcmp(act, "launchon") && nf >= 5) {
      CUfunction f = get_function(fields[1]);
      printf("result %s %d\n", argv[a],
             api.launch(f, 8, 1, 1, (unsigned)atoi(fields[2]), 1, 1, (unsigned)atoi(fields[3]),
                        stream_at(fields[4]), NULL, NULL));
    } else if (!strcmp(act, "region_begin_on") && nf >= 4) {
      int (*begin)(int64_t, int64_t, void*) = dlsym(RTLD_DEFAULT, "jor_region_begin_on_stream");
      printf("result %s %d\n", argv[a],
             begin ? begin(atoll(fields[1]), atoll(fields[2]), stream_at(fields[3])) : -99);
    } else if (!strcmp(act, "capture_begin") || !strcmp(act, "capture_end")) {
      void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
      CUresult (*begin)(CUstream, int) = h ? dlsym(h, "cuStreamBeginCapture") : NULL;
      CUresult (*end)(CUstream, CUgraph*) = h ? dlsym(h, "cuStreamEndCapture") : NULL;
      CUgraph g = NULL;
      CUresult r = !strcmp(act, "capture_begin") ? (begin ? begin(NULL, 0) : -1)
                                                 : (end ? end(NULL, &g) : -1);
      printf("result %s %d\n", argv[a], r);
    } else if (!strcmp(act, "setattr") && nf >= 3) {
      CUfunction f = get_function(fields[1]);
      printf("result %s %d\n", argv[a],
             api.setattr ? api.setattr(f, JOR_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                       atoi(fields[2]))
                         : -1);
    } else if (!strcmp(act, "stream") || !strcmp(act, "streamprio")) {
      CUstream s = NULL;
      CUresult r = !strcmp(act, "stream") ? api.streamcreate(&s, 1)
                                          : api.streamprio(&s, 1, nf >= 2 ? atoi(fields[1]) : 0);
      int prio = 99;
      api.streamgetprio(s, &prio);
      if (r == 0 && g_num_streams < 16) g_streams[g_num_streams++] = s;
      printf("result %s %d priority=%d\n", argv[a], r, prio);
    } else if (!strcmp(act, "threads") && nf >= 6) {
      int n = atoi(fields[1]);
      if (n > 64) n = 64;
      pthread_t tids[64];
      LaunchJob jobs[64];
      CUfunction f = get_function(fields[2]);
      for (int i = 0; i < n; ++i) {
        jobs[i].f = f;
        jobs[i].threads = (unsigned)atoi(fields[3]);
        jobs[i].dyn = (unsigned)atoi(fields[4]);
        jobs[i].count = atoi(fields[5]);
        jobs[i].failures = 0;
        pthread_create(&tids[i], NULL, launch_thread, &jobs[i]);
      }
      int fails = 0;
      for (int i = 0; i < n; ++i) {
        pthread_join(tids[i], NULL);
        fails += jobs[i].failures;
      }
      printf("result %s 0 failures=%d\n", argv[a], fails);
    } else if (!strcmp(act, "region_begin") && nf >= 3) {
      int (*begin)(int64_t, int64_t) = dlsym(RTLD_DEFAULT, "jor_region_begin");
      printf("result %s %d\n", argv[a], begin ? begin(atoll(fields[1]), atoll(fields[2])) : -99);
    } else if (!strcmp(act, "region_end") && nf >= 2) {
      int (*end)(int64_t) = dlsym(RTLD_DEFAULT, "jor_region_end");
      printf("result %s %d\n", argv[a], end ? end(atoll(fields[1])) : -99);
    } else if (!strcmp(act, "unload")) {
      printf("result %s %d\n", argv[a], api.unload((CUmodule)0));
    } else if (!strcmp(act, "next") && nf >= 2) {
      void* p = dlsym(RTLD_NEXT, fields[1]);
      Dl_info info;
      const char* where = (p && dladdr(p, &info) && info.dli_fname) ? info.dli_fname : "none";
      const char* base = strrchr(where, '/');
      printf("result %s 0 object=%s\n", argv[a], base ? base + 1 : where);
    } else if ((!strcmp(act, "cublas") || !strcmp(act, "cublaslt")) && nf >= 2) {
      void* lib = dlopen(fields[1], RTLD_NOW | RTLD_LOCAL);
      int r = -99, target = -1;
      if (lib != NULL && !strcmp(act, "cublas")) {
        int (*create)(void**) = (int (*)(void**))dlsym(lib, "cublasCreate_v2");
        int (*get)(void*, int*) = (int (*)(void*, int*))dlsym(lib, "cublasGetSmCountTarget");
        void* h = NULL;
        r = create ? create(&h) : -98;
        if (r == 0 && get) get(h, &target);
      } else if (lib != NULL) {
        int (*create)(void**, int, int) =
            (int (*)(void**, int, int))dlsym(lib, "cublasLtMatmulDescCreate");
        int (*get)(void*, int, void*, size_t, size_t*) =
            (int (*)(void*, int, void*, size_t, size_t*))dlsym(lib,
                                                               "cublasLtMatmulDescGetAttribute");
        void* d = NULL;
        r = create ? create(&d, 68, 0) : -98; /* CUBLAS_COMPUTE_32F, CUDA_R_32F */
        if (r == 0 && get) get(d, 15, &target, sizeof(target), NULL);
      }
      printf("result %s %d sm_count_target=%d\n", act, r, target);
    } else if (!strcmp(act, "rules") && nf >= 2) {
      int (*set)(const char*) = dlsym(RTLD_DEFAULT, "jor_set_rules");
      FILE* fp = fopen(fields[1], "r");
      static char text[65536];
      size_t len = fp ? fread(text, 1, sizeof(text) - 1, fp) : 0;
      if (fp) fclose(fp);
      text[len] = '\0';
      printf("result %s %d\n", argv[a], set ? set(text) : -99);
    } else {
      fprintf(stderr, "fake_app: bad action %s\n", argv[a]);
      return 2;
    }
  }
  print_counters();
  fflush(stdout);
  return 0;
}
