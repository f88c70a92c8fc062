// A measurement prototype, not part of jspec: the AMX product of
// bench/proto/amx_blocks.cc on 4-bit weights (Q4_K's q, two to a byte)
// widened without float conversions: the bfloat16 16 + q is the 16-bit
// word 0x4180 | (q << 3), so shifts, masks and one `vpternlogd` make a B
// tile's pair of words from each byte, and 16 times the block's activation
// sum is taken off the block's dot product afterwards (docs/decisions-
// compact.md, "AMX for the verify: measured, not built"). Beside it, a
// float path on the same nibbles (widened once per tile, an FMA per row).
// The offsets of Q4_K are left out of both (the same term in either).
//
//   g++ -O3 -march=native -std=c++17 -pthread -o /tmp/amx_nibbles bench/proto/amx_nibbles.cc
//   /tmp/amx_nibbles
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <chrono>
#include <thread>
#include <vector>
#include <random>
#include <algorithm>

constexpr int KB = 32;
struct TileCfg { uint8_t palette; uint8_t start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static void amx_init(int M) {
  TileCfg c; memset(&c, 0, sizeof c); c.palette = 1;
  for (int t = 0; t < 4; ++t) { c.rows[t] = M; c.colsb[t] = 64; }
  for (int t = 4; t < 7; ++t) { c.rows[t] = M; c.colsb[t] = 64; }
  c.rows[7] = 16; c.colsb[7] = 64;
  _tile_loadconfig(&c);
}
// Weights: per panel of 64 columns (4 groups of 16), per block j: 4 x 256 bytes; byte [g][r][n] = q[2r][16g+n] | q[2r+1][16g+n] << 4.
// scales s [P64][K/32][64] f32. y = sum_j s * sum_k q x   (offset term omitted: same in both paths)
static void run_amx(int M, int K, int p0, int p1, const uint16_t* xs, const float* xsum, const uint8_t* q, const float* s, float* y, int N) {
  amx_init(M);
  alignas(64) uint32_t bt[4][16 * 16];
  alignas(64) float ct[4][16 * 16];
  const __m512i c = _mm512_set1_epi32(0x41804180), m1 = _mm512_set1_epi32(0x78), m2 = _mm512_set1_epi32(0x780000);
  const int J = K / KB;
  for (int p = p0; p < p1; ++p) {
    __m512 acc[9][4];
    for (int m = 0; m < M; ++m) for (int g = 0; g < 4; ++g) acc[m][g] = _mm512_setzero_ps();
    const uint8_t* qp = q + (size_t)p * J * 1024;
    for (int j = 0; j < J; ++j) {
      const uint8_t* qb = qp + (size_t)j * 1024;
      _mm_prefetch((const char*)(qb + 4096), _MM_HINT_T0);
      _mm_prefetch((const char*)(qb + 4096 + 64), _MM_HINT_T0);
      for (int g = 0; g < 4; ++g) for (int r = 0; r < 16; ++r) {
        __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qb + g * 256 + r * 16)));
        __m512i w = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_slli_epi32(d, 3), m1),
                                              _mm512_and_si512(_mm512_slli_epi32(d, 15), m2), c, 0xFE);
        _mm512_store_si512((__m512i*)(bt[g] + r * 16), w);
      }
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      _tile_loadd(4, xs + 0 * (size_t)M * K + j * KB, K * 2);
      _tile_loadd(5, xs + 1 * (size_t)M * K + j * KB, K * 2);
      _tile_loadd(6, xs + 2 * (size_t)M * K + j * KB, K * 2);
#define DO(C) _tile_loadd(7, bt[C], 64); _tile_dpbf16ps(C, 4, 7); _tile_dpbf16ps(C, 5, 7); _tile_dpbf16ps(C, 6, 7);
      DO(0) DO(1) DO(2) DO(3)
      _tile_stored(0, ct[0], 64); _tile_stored(1, ct[1], 64); _tile_stored(2, ct[2], 64); _tile_stored(3, ct[3], 64);
      const float* sp = s + ((size_t)p * J + j) * 64;
      for (int g = 0; g < 4; ++g) { __m512 sv = _mm512_loadu_ps(sp + g * 16);
        for (int m = 0; m < M; ++m) {
          __m512 v = _mm512_sub_ps(_mm512_load_ps(ct[g] + m * 16), _mm512_set1_ps(16.f * xsum[m * J + j]));
          acc[m][g] = _mm512_fmadd_ps(sv, v, acc[m][g]); } }
    }
    for (int m = 0; m < M; ++m) for (int g = 0; g < 4; ++g) _mm512_storeu_ps(y + (size_t)m * N + p * 64 + g * 16, acc[m][g]);
  }
  _tile_release();
}
// Float path on the same nibbles: widen once per tile, FMA per row.
static void run_fma(int M, int K, int p0, int p1, const float* x, const uint8_t* q, const float* s, float* y, int N) {
  const int J = K / KB; const __m512i m4 = _mm512_set1_epi32(15);
  for (int p = p0; p < p1; ++p) {
    const uint8_t* qp = q + (size_t)p * J * 1024;
    for (int g = 0; g < 4; ++g) {
      __m512 acc[9];
      for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
      for (int j = 0; j < J; ++j) {
        const uint8_t* qb = qp + (size_t)j * 1024 + g * 256;
        if (g == 0) { _mm_prefetch((const char*)(qb + 4096), _MM_HINT_T0); }
        __m512 b[9]; for (int m = 0; m < M; ++m) b[m] = _mm512_setzero_ps();
        for (int r = 0; r < 16; ++r) {
          __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qb + r * 16)));
          __m512 w0 = _mm512_cvtepi32_ps(_mm512_and_si512(d, m4)), w1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4));
          for (int m = 0; m < M; ++m) {
            b[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + j * KB + 2 * r]), w0, b[m]);
            b[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + j * KB + 2 * r + 1]), w1, b[m]); }
        }
        __m512 sv = _mm512_loadu_ps(s + ((size_t)p * J + j) * 64 + g * 16);
        for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(sv, b[m], acc[m]);
      }
      for (int m = 0; m < M; ++m) _mm512_storeu_ps(y + (size_t)m * N + p * 64 + g * 16, acc[m]);
    }
  }
}
static uint16_t bf(float f) { uint32_t u; memcpy(&u, &f, 4); uint32_t r = u + 0x7FFF + ((u >> 16) & 1); return r >> 16; }
static float fb(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { perror("arch_prctl"); return 1; }
  int K = 1536, N = 21504, layers = 4, J = K / KB; size_t P = N / 64;
  std::mt19937 g(1);
  std::vector<uint8_t> q((size_t)layers * P * J * 1024); for (auto& v : q) v = g() & 0xFF;
  std::vector<float> s((size_t)layers * P * J * 64); for (auto& v : s) v = 1e-3f * (1 + g() % 100);
  for (int M : {1, 2, 3, 5, 9}) {
    std::vector<float> x((size_t)M * K); for (auto& v : x) v = std::normal_distribution<float>()(g);
    std::vector<uint16_t> xs((size_t)3 * M * K); std::vector<float> xsum((size_t)M * J, 0.f);
    for (size_t i = 0; i < (size_t)M * K; ++i) { float r = x[i]; uint16_t h = bf(r); r -= fb(h); uint16_t m = bf(r); r -= fb(m); uint16_t l = bf(r);
      xs[i] = h; xs[(size_t)M * K + i] = m; xs[2 * (size_t)M * K + i] = l; xsum[(i / K) * J + (i % K) / KB] += x[i]; }
    std::vector<float> y1((size_t)M * N), y2((size_t)M * N);
    double best[2] = {1e9, 1e9};
    for (int rep = 0; rep < 5; ++rep) for (int mode = 0; mode < 2; ++mode) {
      auto t0 = std::chrono::steady_clock::now();
      for (int L = 0; L < layers; ++L) {
        const uint8_t* qL = q.data() + (size_t)L * P * J * 1024; const float* sL = s.data() + (size_t)L * P * J * 64;
        std::thread t1([&] { if (mode) run_amx(M, K, 0, P / 2, xs.data(), xsum.data(), qL, sL, y2.data(), N); else run_fma(M, K, 0, P / 2, x.data(), qL, sL, y1.data(), N); });
        if (mode) run_amx(M, K, P / 2, P, xs.data(), xsum.data(), qL, sL, y2.data(), N); else run_fma(M, K, P / 2, P, x.data(), qL, sL, y1.data(), N);
        t1.join();
      }
      best[mode] = std::min(best[mode], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    double maxd = 0, maxr = 0;
    for (size_t i = 0; i < y1.size(); ++i) { maxd = std::max(maxd, (double)fabs(y1[i] - y2[i])); maxr = std::max(maxr, (double)fabs(y1[i])); }
    double gw = (double)layers * K * N / 1e9;
    printf("M=%d nibbles: fma %.2f ms (%.1f weights/ns)  amx %.2f ms (%.1f)  ratio %.2f  maxdiff %.3g of %.3g\n", M, best[0] * 1e3, gw / best[0], best[1] * 1e3, gw / best[1], best[1] / best[0], maxd, maxr);
  }
}
