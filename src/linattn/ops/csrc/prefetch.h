// Cache hints for the chunk loops' inputs. The loops ask for the next chunk's rows of q, k, v (and the
// rows of o they will write) while the current chunk's products run, so that the first touch of each
// row does not wait on memory. Issued in one burst at the start of a chunk (96–128 KB, 1,500–2,000
// lines), the hints held the core on its few outstanding misses before the arithmetic began. So they go
// into a per-thread queue (`prefetch_soon`), and each register tile of the gemm takes a few lines of it
// (`PrefetchQueue::take`) and issues one every 4 k-steps between its multiply-adds; what is left when
// the next chunk asks is issued at once (`flush`), as is everything before a product the tiles do not
// run. Measured (the window kernel's forward, 1 × 16 × 2048 × 128, one core, the modes alternated in one
// process): 15.7 ms with the burst, 15.1 with the lines issued after each tile, 17.0 without hints. After
// each tile, the core waited on the burst of ~33 prefetches (73% of the samples of the panel loop sat on
// the instruction after one); issued inside the tile (one line per 4 k-steps, alternated processes, one
// core): GLA's forward 18.1 → 16.5 ms, linear 18.0 → 16.1, the window 13.0 → 12.5, KDA 31.8 → 29.7,
// the delta rule 25.5 → 24.0; forward + backward: window 49.4 → 46.5, GLA 81.7 → 80.4, KDA 128 → 126.
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
  static constexpr int kRanges = 16;
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
  // Takes up to `lines` lines from the oldest range (none left: bytes 0), to be issued by the caller
  Range take(int64_t lines) {
    if (count == 0) return {nullptr, 0, false};
    Range& r = ranges[head];
    const int64_t n = std::min<int64_t>(lines, (r.bytes + 63) / 64);
    const Range out{r.p, n * 64, r.write};
    r.p += n * 64;
    r.bytes -= n * 64;
    if (r.bytes <= 0) head = (head + 1) % kRanges, --count;
    return out;
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

// Inside a register tile's loop over k (or k-pairs): at every 4th step, the next line of `hint`
// (PrefetchQueue::take) while lines remain. Forced inline: called (not inlined) from the AVX-512 tiles,
// whose target differs, it cost GLA's forward 17.5 → 22.3 ms.
[[gnu::always_inline]] inline void hint_line(const PrefetchQueue::Range& hint, int step) {
  if ((step & 3) != 0 || int64_t(step) * 16 >= hint.bytes) return;
  if (hint.write) {
    __builtin_prefetch(hint.p + step * 16, 1, 3);
  } else {
    __builtin_prefetch(hint.p + step * 16, 0, 3);
  }
}

inline PrefetchQueue& prefetch_queue() {
  thread_local PrefetchQueue queue;
  return queue;
}

// Queues [p, p + bytes) to be hinted while the products that follow run (see above)
inline void prefetch_soon(const void* p, int64_t bytes, bool write = false) { prefetch_queue().push(p, bytes, write); }

}  // namespace
