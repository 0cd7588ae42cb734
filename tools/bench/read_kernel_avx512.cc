// The streaming-read loop of the bandwidth roofline: 512-bit loads, four independent
// accumulators so the loop is bound by memory, not by the add latency.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace moe::bench {

uint64_t StreamRead(const uint8_t* data, size_t bytes) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 256 <= bytes; i += 256) {
    a0 = _mm512_add_epi64(a0, _mm512_load_si512(data + i));
    a1 = _mm512_add_epi64(a1, _mm512_load_si512(data + i + 64));
    a2 = _mm512_add_epi64(a2, _mm512_load_si512(data + i + 128));
    a3 = _mm512_add_epi64(a3, _mm512_load_si512(data + i + 192));
  }
  const __m512i s = _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3));
  uint64_t sum = static_cast<uint64_t>(_mm512_reduce_add_epi64(s));
  for (; i < bytes; ++i) sum += data[i];
  return sum;
}

}  // namespace moe::bench
