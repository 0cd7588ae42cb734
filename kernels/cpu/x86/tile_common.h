// Helpers shared by the x86 tiers' kernels. Plain baseline x86-64 code: each tier file includes
// this before its `#pragma GCC target` region, so these inline functions are compiled (and
// possibly emitted out of line) without the tier's instructions, and every tier may call them.
#pragma once

#include <xmmintrin.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cpu/dot.h"

namespace moe::cpu::x86 {

// Streamed weight bytes are requested this far ahead, into L2: measured on Zen 4, 4 KB into L1
// left the in-register MXFP4 loop at ~65% of the streaming-read probe, 8 KB into L2 at ~90%
// (L1 prefetches compete with the loop's own loads for the few L1 miss buffers).
constexpr int kPrefetchBytes = 8192;
inline void PrefetchStream(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T1);
}

// Software prefetch spread over the blocks of many tile calls: `per_block` cache lines of
// [next, end) each time a tile starts a 128-element block.
struct PrefetchCursor {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t per_block = 0;
  void Step() {
    const char* stop = end - next > per_block * 64 ? next + per_block * 64 : end;
    for (const char* p = next; p < stop; p += 64) _mm_prefetch(p, _MM_HINT_T1);
    if (stop > next) next = stop;
  }
  // The stored bytes of weight rows [row, row + rows), spread over `blocks` steps.
  static PrefetchCursor Rows(const WeightMatrix& w, int64_t row, int64_t rows, int64_t blocks) {
    PrefetchCursor c;
    if (rows <= 0 || blocks <= 0) return c;
    const int64_t row_bytes = w.DataBytes() / w.rows;
    c.next = static_cast<const char*>(w.data) + row * row_bytes;
    c.end = c.next + rows * row_bytes;
    c.per_block = (rows * row_bytes / 64 + blocks) / blocks;
    return c;
  }
};

// Pointers to operand rows i0 .. i0 + mr - 1 (through x_rows when the op gathers them).
template <typename T>
void OperandRows(const DotOperands& op, int64_t i0, int64_t mr, const T** xr) {
  for (int64_t i = 0; i < mr; ++i)
    xr[i] = static_cast<const T*>(op.x) + (op.x_rows ? op.x_rows[i0 + i] : i0 + i) * op.x_stride;
}

// Calls f(std::integral_constant<int, n>{}) for a runtime n in [1, N] (larger n: N), so that
// tiles get their row counts as compile-time constants.
template <int N, typename F>
void WithCount(int n, F&& f) {
  if constexpr (N > 1) {
    if (n < N) return WithCount<N - 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

// Calls tile(std::integral_constant<int, mr>, operand row pointers) for a runtime mr in [1, 6].
template <typename T, typename Tile>
void DispatchTile(const DotOperands& op, int64_t i0, int mr, Tile&& tile) {
  const T* xr[6];
  OperandRows(op, i0, mr, xr);
  WithCount<6>(mr, [&](auto tag) { tile(tag, xr); });
}

}  // namespace moe::cpu::x86
