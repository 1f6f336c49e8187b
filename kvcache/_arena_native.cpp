// Zeros that take no memory until written: an XLA:CPU custom call (XLA FFI) whose output reads as zeros,
// made by handing the output's whole memory pages back to Linux and writing zeros only into the partial
// pages at its two ends. madvise(MADV_DONTNEED) makes a page read as zeros (backed again only when written)
// in private anonymous memory only, which is what XLA:CPU's allocator hands out (malloc); in a shared or
// file-backed mapping the page would read its old contents again, so the handler first checks that the
// whole pages lie in private anonymous mappings (/proc/self/maps). XLA's own zeros write every byte, so a
// KV arena allocated through them is resident in full, if only until it is released again
// (kvcache/pool.py). Elsewhere than Linux, or where the check or the call fails, the output is written
// with zeros as XLA would.
#include <cstdint>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#endif

#include <pybind11/pybind11.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__linux__) && defined(MADV_DONTNEED)
// Whether [lo, hi) lies within private anonymous mappings: /proc/self/maps lists them in address order,
// each "start-end perms offset dev inode [path]"; anonymous ones have inode 0 and no path, or one of
// "[heap]" / "[anon:...]". A line longer than the buffer is read in pieces: the first has a path (not
// anonymous), the others do not parse. A mapping changed while the file is read can only make the
// answer a false "no" (then the caller writes the zeros).
static bool PrivateAnonymous(uintptr_t lo, uintptr_t hi) {
  FILE* maps = std::fopen("/proc/self/maps", "r");
  if (maps == nullptr) return false;
  char line[4096];
  uintptr_t covered = lo;
  bool ok = false;
  while (!ok && std::fgets(line, sizeof line, maps) != nullptr) {
    unsigned long start, end, offset, inode;
    char perms[8], dev[32];
    int path = 0;
    if (std::sscanf(line, "%lx-%lx %7s %lx %31s %lu %n", &start, &end, perms, &offset, dev, &inode, &path) < 6 ||
        end <= covered) {
      continue;
    }
    const char* name = line + path;
    const bool anonymous = inode == 0 && (name[0] == '\0' || std::strncmp(name, "[heap]", 6) == 0 ||
                                          std::strncmp(name, "[anon:", 6) == 0);
    if (start > covered || perms[3] != 'p' || !anonymous) break;
    covered = end;
    ok = covered >= hi;
  }
  std::fclose(maps);
  return ok;
}
#endif

static ffi::Error ZerosImpl(ffi::Result<ffi::AnyBuffer> out) {
  auto* data = static_cast<char*>(out->untyped_data());
  const size_t size = out->size_bytes();
#if defined(__linux__) && defined(MADV_DONTNEED)
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t start = reinterpret_cast<uintptr_t>(data), end = start + size;
  const uintptr_t lo = (start + page - 1) / page * page, hi = end / page * page;
  if (hi > lo && PrivateAnonymous(lo, hi) && madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED) == 0) {
    std::memset(data, 0, lo - start);
    std::memset(reinterpret_cast<void*>(hi), 0, end - hi);
    return ffi::Error::Success();
  }
#endif
  std::memset(data, 0, size);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(TalariaUnbackedZeros, ZerosImpl, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());

PYBIND11_MODULE(_arena_native, m) {
  m.doc() = "An XLA:CPU custom call whose output reads as zeros without backing its whole pages.";
  m.def("zeros_handler", []() { return pybind11::capsule(reinterpret_cast<void*>(TalariaUnbackedZeros)); },
        "The FFI handler, for jax.ffi.register_ffi_target(..., platform='cpu').");
  m.def("private_anonymous", [](uintptr_t lo, uintptr_t hi) {
#if defined(__linux__) && defined(MADV_DONTNEED)
          return PrivateAnonymous(lo, hi);
#else
          return false;
#endif
        }, "Whether the addresses [lo, hi) lie in private anonymous mappings (the handler's check; tests).");
}
