// A measurement program, not part of jspec: does one sequential stream per
// thread overlap its reads with integer work, and what does a software
// prefetch do to it (docs/decisions-compact.md, "One panel for one row on
// Zen 5")? Each thread reads its half of 4 distinct 64 MiB buffers (past
// the L3) in 64-byte loads, with OPS `vpdpbusd` per line on 8 accumulators;
// "cached" runs the same over 1 MiB 50 times. The last column is what the
// stream would read if its reads and its work did not overlap at all (a
// 33 GB/s read plus the cached rate's time).
//
//   g++ -O3 -march=native -fopenmp -o /tmp/stream_pattern bench/proto/stream_pattern.cc
//   OMP_NUM_THREADS=2 OMP_PROC_BIND=close /tmp/stream_pattern 5     # HUGE=1: 2 MiB pages
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <sys/mman.h>
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static inline __m512i dp(__m512i acc, __m512i a, __m512i b) { asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b)); return acc; }

// OPS dpbusd per 64-byte line, 8 independent accumulators; PF prefetch distance (bytes), HINT 0=T0 1=T1 2=T2 3=NTA
template <int OPS, int PF, int HINT>
__attribute__((noinline)) int64_t kern(const uint8_t* p, size_t bytes) {
  __m512i acc[8]; for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_si512();
  const __m512i xb = _mm512_set1_epi32(0x01020304);
  for (size_t off = 0; off < bytes; off += 512) {
    if constexpr (PF > 0) for (int l = 0; l < 8; ++l) {
      const char* a = (const char*)p + off + PF + l * 64;
      if (HINT == 0) _mm_prefetch(a, _MM_HINT_T0); else if (HINT == 1) _mm_prefetch(a, _MM_HINT_T1);
      else if (HINT == 2) _mm_prefetch(a, _MM_HINT_T2); else _mm_prefetch(a, _MM_HINT_NTA);
    }
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) {
      __m512i w = _mm512_load_si512(p + off + l * 64);
      if constexpr (OPS == 0) acc[l] = _mm512_xor_si512(acc[l], w);
#pragma GCC unroll 32
      for (int o = 0; o < OPS; ++o) acc[(l + o) & 7] = dp(acc[(l + o) & 7], w, xb);
    }
  }
  __m512i t = acc[0]; for (int i = 1; i < 8; ++i) t = _mm512_add_epi32(t, acc[i]);
  return _mm512_reduce_add_epi32(t);
}

template <int OPS, int PF, int HINT>
void run(const char* name, std::vector<uint8_t*>& big, size_t bbytes, uint8_t* small, size_t sbytes, int reps) {
  std::vector<double> ts, tc; volatile int64_t sink = 0;
  for (int r = 0; r < reps; ++r) {
    double t0 = now();
    for (auto* b : big) {
#pragma omp parallel
      { int t = omp_get_thread_num(), nt = omp_get_num_threads();
        size_t per = bbytes / nt / 512 * 512; sink += kern<OPS, PF, HINT>(b + per * t, per); }
    }
    ts.push_back((now() - t0) / big.size());
    t0 = now();
    for (int i = 0; i < 50; ++i) {
#pragma omp parallel
      { int t = omp_get_thread_num(), nt = omp_get_num_threads();
        size_t per = sbytes / nt / 512 * 512; sink += kern<OPS, PF, HINT>(small + per * t, per); }
    }
    tc.push_back((now() - t0) / 50);
  }
  std::sort(ts.begin(), ts.end()); std::sort(tc.begin(), tc.end());
  double s = bbytes / ts[reps / 2] * 1e-9, c = sbytes / tc[reps / 2] * 1e-9;
  printf("%-28s stream %5.1f GB/s  cached %6.1f GB/s  no-overlap model %5.1f\n", name, s, c, 1.0 / (1.0 / c + 1.0 / 33.0));
}

int main(int argc, char** argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 5;
  size_t bbytes = 64ull << 20, sbytes = 1 << 20;
  std::vector<uint8_t*> big;
  for (int i = 0; i < 4; ++i) { auto* b = (uint8_t*)aligned_alloc(2 << 20, bbytes + 65536); memset(b, i + 1, bbytes + 65536); if (getenv("HUGE")) madvise(b, bbytes, MADV_HUGEPAGE); big.push_back(b); }
  auto* small = (uint8_t*)aligned_alloc(4096, sbytes + 65536); memset(small, 3, sbytes + 65536);
  for (int round = 0; round < 2; ++round) {
    run<0, 0, 0>("read", big, bbytes, small, sbytes, reps);
    run<2, 0, 0>("2 dp/line", big, bbytes, small, sbytes, reps);
    run<4, 0, 0>("4 dp/line", big, bbytes, small, sbytes, reps);
    run<6, 0, 0>("6 dp/line", big, bbytes, small, sbytes, reps);
    run<8, 0, 0>("8 dp/line", big, bbytes, small, sbytes, reps);
    run<12, 0, 0>("12 dp/line", big, bbytes, small, sbytes, reps);
    run<6, 4096, 0>("6 dp/line pf4K T0", big, bbytes, small, sbytes, reps);
    run<6, 4096, 1>("6 dp/line pf4K T1", big, bbytes, small, sbytes, reps);
    run<6, 8192, 1>("6 dp/line pf8K T1", big, bbytes, small, sbytes, reps);
    run<6, 16384, 2>("6 dp/line pf16K T2", big, bbytes, small, sbytes, reps);
    run<6, 2048, 3>("6 dp/line pf2K NTA", big, bbytes, small, sbytes, reps);
  }
}
