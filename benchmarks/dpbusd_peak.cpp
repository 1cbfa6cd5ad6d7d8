// The host's peak rate of 512-bit vpdpbusd (the integer-dot kernel's instruction on AVX512-VNNI):
// 12 independent accumulators, so the loop is bound by the instruction's throughput, not its
// latency, each in its own register (unrolled: a rolled loop kept them in memory, and a store
// forwarded to the next load bounded it at ~1 a cycle, 2.9 G/s on the Zen 5). One thread. Build and run (on a host with AVX512-VNNI):
//   g++ -O2 -march=native -o /tmp/dpbusd_peak benchmarks/dpbusd_peak.cpp && /tmp/dpbusd_peak
// The integer-dot kernel's many-row GMAC/s a core (benchmarks/bench_int_dot_stream.py) against
// this one says how far from the instruction's peak it runs.
#include <immintrin.h>

#include <chrono>
#include <cstdio>

int main() {
  __m512i acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
  const long n = 200000000;
  const auto t0 = std::chrono::steady_clock::now();
  for (long it = 0; it < n; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], w, x);
    asm volatile("" : "+v"(w), "+v"(x));  // keep the operands opaque: no hoisting
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int sum = 0;
  for (int i = 0; i < 12; ++i) sum += _mm512_reduce_add_epi32(acc[i]);
  std::printf("vpdpbusd zmm: %.2f G/s on one core, %.1f GMAC/s (checksum %d)\n",
              n * 12 / s / 1e9, n * 12 * 64 / s / 1e9, sum & 1);
  return 0;
}
