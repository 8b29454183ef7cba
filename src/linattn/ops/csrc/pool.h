// The pool of reused result buffers of the fused kernels (chunked.cpp, gated.cpp, gated_backward.cpp,
// delta.cpp). Its functions have external linkage (inline, in a named namespace), so every file of the
// extension shares one pool and `release_pool` empties all of it.
#pragma once

#include <ATen/ATen.h>

#include <sys/mman.h>

#include <cstdlib>
#include <mutex>
#include <utility>
#include <vector>

namespace linattn_pool {

// Large results (o, dq, dk, dv) come from a small pool of reusable buffers. glibc hands allocations
// of 32 MiB and more straight back to the OS when freed, so each fresh one costs a page fault per
// page and the kernel zeroing it (measured on the 2-core development machine: filling a fresh 32 MiB
// tensor took 13.5 ms, 4.4 ms on 2 MiB huge pages, 1.5 ms reused; the forward at N = 16384,
// B·H = 8, F = E = 64 takes 30-45 ms). A freed buffer goes back to the pool while it holds less than
// the cap (LINATTN_POOL_MB, default 512; 0 turns the pool off), else to the OS; `release_pool`
// empties it. New buffers are 2 MiB aligned, on transparent huge pages where Linux allows it. Such
// results cannot be resized in place (their storage is not torch's).
struct BufferPool {
  std::mutex mu;
  std::vector<std::pair<size_t, void*>> free;  // (bytes, buffer)
  size_t held = 0;
};

inline BufferPool& pool() {
  static BufferPool* p = new BufferPool();  // never destroyed: buffers may be freed at exit
  return *p;
}

inline size_t pool_cap() {
  const char* env = std::getenv("LINATTN_POOL_MB");
  const long mb = env == nullptr ? 512 : std::atol(env);
  return mb <= 0 ? 0 : static_cast<size_t>(mb) << 20;
}

inline constexpr size_t kPooledBytes = size_t{8} << 20;  // results below this size use the default allocator
inline constexpr size_t kHuge = size_t{2} << 20;

inline void return_buffer(void* buf, size_t bytes) {
  BufferPool& p = pool();
  {
    std::lock_guard<std::mutex> lock(p.mu);
    if (p.held + bytes <= pool_cap()) {
      p.free.emplace_back(bytes, buf);
      p.held += bytes;
      return;
    }
  }
  std::free(buf);
}

inline int64_t release_pool() {
  BufferPool& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  const auto released = static_cast<int64_t>(p.held);
  for (auto& entry : p.free) std::free(entry.second);
  p.free.clear();
  p.held = 0;
  return released;
}

inline at::Tensor empty_result(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) * opts.dtype().itemsize();
  if (bytes < kPooledBytes || pool_cap() == 0) return at::empty(sizes, opts);
  void* buf = nullptr;
  {
    BufferPool& p = pool();
    std::lock_guard<std::mutex> lock(p.mu);
    for (size_t i = 0; i < p.free.size(); ++i) {
      if (p.free[i].first == bytes) {
        buf = p.free[i].second;
        p.held -= bytes;
        p.free[i] = p.free.back();
        p.free.pop_back();
        break;
      }
    }
  }
  if (buf == nullptr) {
    buf = std::aligned_alloc(kHuge, (bytes + kHuge - 1) / kHuge * kHuge);
    TORCH_CHECK(buf != nullptr, "linattn_cpu: out of memory allocating ", bytes, " bytes");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(buf, (bytes + kHuge - 1) / kHuge * kHuge, MADV_HUGEPAGE);
#endif
  }
  return at::from_blob(buf, sizes, [bytes](void* data) { return_buffer(data, bytes); }, opts);
}

}  // namespace linattn_pool
