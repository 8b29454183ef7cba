// The BLAS of the loaded torch, for the fused kernels that multiply matrices (chunked.cpp, gated.cpp,
// gated_backward.cpp, delta.cpp): symbols looked up at run time (without them the ops raise and
// linattn uses torch ops), row-major gemm and triangular-solve wrappers, and a guard that keeps MKL to
// one thread inside the kernels' own parallel rows. Internal linkage, one copy per file.
#pragma once

#include <ATen/ATen.h>

#include <dlfcn.h>

#include <type_traits>

#include "flop_count.h"
#include "gemm.h"
#include "gemm_bf16.h"

namespace {

// A symbol of the loaded torch (its BLAS), or nullptr: global lookup first, then libtorch_cpu itself.
void* torch_symbol(const char* name) {
  void* sym = dlsym(RTLD_DEFAULT, name);
  if (sym == nullptr) {
    void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    if (lib != nullptr) sym = dlsym(lib, name);
  }
  return sym;
}

// Fortran BLAS gemm, column-major: C = alpha op(A) op(B) + beta C, with In operands and Out results
// (sgemm_ / dgemm_: In = Out; MKL's gemm_bf16bf16f32_: bf16 in, float out).
template <typename In, typename Out>
using gemm_t = void (*)(const char*, const char*, const int*, const int*, const int*, const Out*, const In*,
                        const int*, const In*, const int*, const Out*, Out*, const int*);

template <typename In>
using linattn_acc = typename std::conditional<std::is_same<In, at::BFloat16>::value, float, In>::type;

// The gemm of the loaded torch for operands of type In, or nullptr (checked once).
template <typename In>
gemm_t<In, linattn_acc<In>> blas_gemm() {
  static const auto fn = reinterpret_cast<gemm_t<In, linattn_acc<In>>>(
      torch_symbol(std::is_same<In, at::BFloat16>::value ? "gemm_bf16bf16f32_"
                   : std::is_same<In, float>::value      ? "sgemm_"
                                                         : "dgemm_"));
  return fn;
}

bool has_blas() { return blas_gemm<float>() != nullptr && blas_gemm<double>() != nullptr; }

bool has_blas_bf16() { return blas_gemm<at::BFloat16>() != nullptr; }

// Fortran BLAS trsm, column-major, for float and double: B = alpha op(A)⁻¹ B (side L) or B op(A)⁻¹ (R).
template <typename T>
using trsm_t = void (*)(const char*, const char*, const char*, const char*, const int*, const int*, const T*,
                        const T*, const int*, T*, const int*);

template <typename T>
trsm_t<T> blas_trsm() {
  static const auto fn = reinterpret_cast<trsm_t<T>>(torch_symbol(std::is_same<T, float>::value ? "strsm_" : "dtrsm_"));
  return fn;
}

// In place on the row-major c×n block B (rows ldb apart): B ← L⁻¹ B, or L⁻ᵀ B with trans, where L is
// the unit lower-triangular matrix whose strictly lower part is the row-major c×c matrix at L (its
// diagonal and upper part are not read). Column-major, Bᵀ is solved from the right by Lᵀ, an
// upper-triangular matrix.
template <typename T>
inline void solve_unit_lower(bool trans, int c, int n, const T* L, T* B, int ldb) {
  const char side = 'R', uplo = 'U', diag = 'U', ta = trans ? 'T' : 'N';
  const T one = 1;
  blas_trsm<T>()(&side, &uplo, &ta, &diag, &n, &c, &one, L, &c, B, &ldb);
}

// Holds MKL to one thread on the calling thread while alive (MKL's thread-local setting; nothing
// where torch's BLAS is not MKL). Called from inside a parallel region, MKL still sets up for
// threads of its own on every call: two threads each calling 64×64 sgemms reached ~145 GFLOP/s on
// this 2-core machine, ~205 with this guard.
class SequentialBlas {
 public:
  SequentialBlas() {
    if (set_local() != nullptr) previous_ = set_local()(1);
  }
  ~SequentialBlas() {
    if (set_local() != nullptr) set_local()(previous_);
  }
  SequentialBlas(const SequentialBlas&) = delete;
  SequentialBlas& operator=(const SequentialBlas&) = delete;

 private:
  using set_t = int (*)(int);
  static set_t set_local() {
    static const auto fn = reinterpret_cast<set_t>(torch_symbol("MKL_Set_Num_Threads_Local"));
    return fn;
  }
  int previous_ = 0;
};

// row-major C (M×N) = alpha·op(A) op(B) + beta·C, op(X) = Xᵀ when tX: float and double by the register
// tiles of gemm.h where the CPU has AVX-512, else (and bf16 always) the column-major BLAS gemm on the
// transposes
template <typename In, typename Out = linattn_acc<In>>
inline void gemm_rm(bool ta, bool tb, int M, int N, int K, const In* A, int lda, const In* B, int ldb, Out beta, Out* C,
                    int ldc, Out alpha = Out(1)) {
  linattn_count::add_flops(int64_t{2} * M * N * K);
#if LINATTN_TILE_GEMM
  if constexpr (std::is_same<In, Out>::value) {
    if (tile_gemm_enabled()) {
      tile_gemm_rm<In>(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc, alpha);
      return;
    }
  } else if constexpr (std::is_same<In, at::BFloat16>::value) {
    if (bf16_tiles_enabled()) {
      bf16_gemm_rm(ta, tb, M, N, K, reinterpret_cast<const uint16_t*>(A), lda, reinterpret_cast<const uint16_t*>(B),
                   ldb, beta, C, ldc, alpha);
      return;
    }
  }
#endif
  prefetch_queue().flush();  // the BLAS does not drain the hints: issue them before its product
  const char tA = tb ? 'T' : 'N', tB = ta ? 'T' : 'N';
  blas_gemm<In>()(&tA, &tB, &N, &M, &K, &alpha, B, &ldb, A, &lda, &beta, C, &ldc);
}


}  // namespace
