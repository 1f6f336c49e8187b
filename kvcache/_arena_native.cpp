// Zeros that take no memory until written: an XLA:CPU custom call (XLA FFI) whose output reads as zeros,
// made by handing the output's whole memory pages back to Linux (madvise MADV_DONTNEED on private anonymous
// memory: a page reads as zeros until written, and is backed only then) and writing zeros only into the
// partial pages at its two ends. XLA's own zeros write every byte, so a KV arena allocated through them is
// resident in full, if only until it is released again (kvcache/pool.py). Elsewhere than Linux, or where the
// call fails (memory that is not private anonymous), the output is written with zeros as XLA would.
#include <cstdint>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include <pybind11/pybind11.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error ZerosImpl(ffi::Result<ffi::AnyBuffer> out) {
  auto* data = static_cast<char*>(out->untyped_data());
  const size_t size = out->size_bytes();
#if defined(__linux__) && defined(MADV_DONTNEED)
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t start = reinterpret_cast<uintptr_t>(data), end = start + size;
  const uintptr_t lo = (start + page - 1) / page * page, hi = end / page * page;
  if (hi > lo && madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED) == 0) {
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
}
