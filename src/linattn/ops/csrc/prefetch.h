// Cache hints for the chunk loops' inputs. The loops ask for the next chunk's rows of q, k, v (and the
// rows of o they will write) while the current chunk's products run, so that the first touch of each
// row does not wait on memory. Issued in one burst at the start of a chunk (96–128 KB, 1,500–2,000
// lines), the hints held the core on its few outstanding misses before the arithmetic began. So they go
// into a per-thread queue (`prefetch_soon`) and the register tiles of the gemm issue a few of its lines
// after each tile (`PrefetchQueue::drain`), as the arithmetic goes; what is left when the next chunk
// asks is issued at once (`flush`), as is everything before a product the tiles do not run. Measured
// (the window kernel's forward, 1 × 16 × 2048 × 128, one core, the three modes alternated in one
// process): 15.7 ms with the burst, 15.1 with the queue, 17.0 without hints; linear and GLA unchanged.
#pragma once

#include <algorithm>
#include <cstdint>

namespace {

// Hints the cache lines of [p, p + bytes) into cache now (for a store when write)
inline void prefetch_lines(const void* p, int64_t bytes, bool write = false) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) {
    if (write) {
      __builtin_prefetch(c + o, 1, 3);
    } else {
      __builtin_prefetch(c + o, 0, 3);
    }
  }
}

// Ranges of lines to hint soon, oldest first; at most kRanges (a push to a full queue issues the oldest).
struct PrefetchQueue {
  static constexpr int kRanges = 8;
  struct Range {
    const char* p;
    int64_t bytes;
    bool write;
  };
  Range ranges[kRanges];
  int head = 0, count = 0;

  void push(const void* p, int64_t bytes, bool write) {
    if (bytes <= 0) return;
    if (count == kRanges) issue_oldest();
    ranges[(head + count++) % kRanges] = {static_cast<const char*>(p), bytes, write};
  }
  // Issues up to `lines` lines, oldest ranges first
  void drain(int64_t lines) {
    while (count > 0 && lines > 0) {
      Range& r = ranges[head];
      const int64_t n = std::min<int64_t>(lines, (r.bytes + 63) / 64);
      prefetch_lines(r.p, n * 64, r.write);
      lines -= n;
      r.p += n * 64;
      r.bytes -= n * 64;
      if (r.bytes <= 0) head = (head + 1) % kRanges, --count;
    }
  }
  void flush() {
    while (count > 0) issue_oldest();
  }

 private:
  void issue_oldest() {
    prefetch_lines(ranges[head].p, ranges[head].bytes, ranges[head].write);
    head = (head + 1) % kRanges, --count;
  }
};

inline PrefetchQueue& prefetch_queue() {
  thread_local PrefetchQueue queue;
  return queue;
}

// Queues [p, p + bytes) to be hinted while the products that follow run (see above)
inline void prefetch_soon(const void* p, int64_t bytes, bool write = false) { prefetch_queue().push(p, bytes, write); }

}  // namespace
