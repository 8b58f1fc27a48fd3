#include "symbols.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <string.h>

#include <atomic>

namespace jor {

const char* const kSymNames[kNumSyms] = {
#define JOR_SYM_NAME(name, ret, params, args) #name,
    JOR_HOOKED_SYMBOLS(JOR_SYM_NAME) "",
    JOR_USED_SYMBOLS(JOR_SYM_NAME)
#undef JOR_SYM_NAME
};

namespace {

std::atomic<void*> g_real[kNumSyms + 1];
DlsymFn g_real_dlsym = nullptr;
pthread_once_t g_dlsym_once = PTHREAD_ONCE_INIT;
std::atomic<void*> g_libcuda_handle{nullptr};

void ResolveRealDlsym() {
  // dlsym itself is interposed, so the real one comes from dlvsym: glibc >= 2.34
  // versions it GLIBC_2.34, older glibc GLIBC_2.2.5 (x86-64) / GLIBC_2.17 (arm64).
  static const char* const kVersions[] = {"GLIBC_2.34", "GLIBC_2.2.5",
                                          "GLIBC_2.17"};
  for (const char* v : kVersions) {
    void* p = dlvsym(RTLD_NEXT, "dlsym", v);
    if (p != nullptr) {
      g_real_dlsym = reinterpret_cast<DlsymFn>(p);
      return;
    }
  }
}

}  // namespace

DlsymFn RealDlsym() {
  pthread_once(&g_dlsym_once, ResolveRealDlsym);
  return g_real_dlsym;
}

void* LibcudaHandle() {
  void* h = g_libcuda_handle.load(std::memory_order_acquire);
  if (h != nullptr) return h;
  static const char* const kNames[] = {"libcuda.so.1", "libcuda.so"};
  for (const char* n : kNames) {
    h = dlopen(n, RTLD_LAZY | RTLD_NOLOAD);
    if (h != nullptr) {
      g_libcuda_handle.store(h, std::memory_order_release);
      return h;
    }
  }
  return nullptr;
}

// The real entry point for `id`, resolved on first use.
void* Real(int id) {
  void* p = g_real[id].load(std::memory_order_acquire);
  if (p != nullptr) return p;
  DlsymFn real_dlsym = RealDlsym();
  if (real_dlsym == nullptr) return nullptr;
  void* h = LibcudaHandle();
  if (h != nullptr) p = real_dlsym(h, kSymNames[id]);
  if (p == nullptr) p = real_dlsym(RTLD_NEXT, kSymNames[id]);
  if (p != nullptr) {
    void* expected = nullptr;
    g_real[id].compare_exchange_strong(expected, p);
    p = g_real[id].load(std::memory_order_acquire);
  }
  return p;
}

void* RecordReal(int id, void* p) {
  void* expected = nullptr;
  g_real[id].compare_exchange_strong(expected, p);
  return g_real[id].load(std::memory_order_acquire);
}

int HookedId(const char* name) {
  if (name == nullptr || name[0] != 'c' || name[1] != 'u') return -1;
  for (int i = 0; i < kNumHooked; ++i) {
    if (strcmp(name, kSymNames[i]) == 0) return i;
  }
  return -1;
}

bool IsLibcuda(void* handle) {
  if (handle == RTLD_DEFAULT || handle == RTLD_NEXT || handle == nullptr) return false;
  if (handle == g_libcuda_handle.load(std::memory_order_acquire)) return true;
  struct link_map* lm = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &lm) != 0 || lm == nullptr || lm->l_name == nullptr) {
    return false;
  }
  const char* base = strrchr(lm->l_name, '/');
  base = base ? base + 1 : lm->l_name;
  if (strncmp(base, "libcuda.so", 10) != 0) return false;
  void* expected = nullptr;
  g_libcuda_handle.compare_exchange_strong(expected, handle);
  return true;
}

// dlsym(RTLD_NEXT, ...) from another object: the real dlsym would answer
// relative to this library (its caller), so search the objects loaded after
// the caller, in load order, as glibc would. This library is one of them when
// it comes later: an interposer preloaded before it then finds its hooks.
void* DlsymNextFromCaller(const char* name, void* caller) {
  DlsymFn real = RealDlsym();
  Dl_info info;
  struct link_map* lm = nullptr;
  if (dladdr1(caller, &info, reinterpret_cast<void**>(&lm), RTLD_DL_LINKMAP) == 0 ||
      lm == nullptr) {
    return real(RTLD_NEXT, name);
  }
  for (struct link_map* l = lm->l_next; l != nullptr; l = l->l_next) {
    if (l->l_name == nullptr || l->l_name[0] == '\0') continue;
    void* h = dlopen(l->l_name, RTLD_LAZY | RTLD_NOLOAD);
    if (h == nullptr) continue;
    void* p = real(h, name);
    dlclose(h);
    if (p != nullptr) return p;
  }
  return nullptr;
}

}  // namespace jor
