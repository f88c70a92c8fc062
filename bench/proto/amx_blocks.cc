// A measurement prototype, not part of jspec: the target's block product
// (float32 activations times int8 block weights, a float32 scale per output
// and block of 32 inputs) on Intel AMX, to see whether a verify's rows could
// cost what one row costs on an AMX host (docs/decisions-compact.md, "AMX
// for the verify: measured, not built").
//
// (a) the AVX-512 float path: each weight widened to float32 once per tile,
//     an FMA per row (what jspec's block kernel does, without its tuning);
// (b) AMX-BF16: int8 weights are exact in bfloat16, and each activation is
//     split into three bfloat16 pieces whose sum is the float32 exactly, so
//     `tdpbf16ps` (exact products, float32 sums) gives the float32 product up
//     to the order of its sums. One tile product per block of 32 inputs and
//     16 outputs per piece; the block's sums are stored and scaled in AVX-512.
//     Every row's result depends on its own activations only.
//
// Build and run (needs AMX-BF16 and Linux's permission for the tile state):
//   g++ -O3 -march=native -std=c++17 -pthread -o /tmp/amx_blocks bench/proto/amx_blocks.cc
//   /tmp/amx_blocks
// Prints, per row count, the best of 5 calls over 4 layers' worth of
// [1536 -> 21504] int8 blocks (gate, up and four smaller matrices) on 2
// threads, and the largest difference between the two paths' outputs.

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
  // tiles 0-3: C (M rows x 16 fp32 = 64 bytes); 4-6: A pieces (M rows x 32 bf16 = 64 bytes); 7: B (16 rows x 64 bytes)
  for (int t = 0; t < 4; ++t) { c.rows[t] = M; c.colsb[t] = 64; }
  for (int t = 4; t < 7; ++t) { c.rows[t] = M; c.colsb[t] = 64; }
  c.rows[7] = 16; c.colsb[7] = 64;
  _tile_loadconfig(&c);
}

// weights: panels [P][K][32] int8 ; scales [P][K/32][32] f32
// (a) fp32 path
static void run_fma(int M, int K, int p0, int p1, const float* x, const int8_t* q, const float* s, float* y, int N) {
  for (int p = p0; p < p1; ++p) {
    const int8_t* qp = q + (size_t)p * K * 32; const float* sp = s + (size_t)p * (K / KB) * 32;
    __m512 acc[9][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int j = 0; j < K / KB; ++j) {
      __m512 b[9][2];
      for (int m = 0; m < M; ++m) b[m][0] = b[m][1] = _mm512_setzero_ps();
      for (int k = 0; k < KB; ++k) {
        const int8_t* r = qp + (size_t)(j * KB + k) * 32;
        __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)r)));
        __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(r + 16))));
        for (int m = 0; m < M; ++m) { __m512 xv = _mm512_set1_ps(x[m * K + j * KB + k]);
          b[m][0] = _mm512_fmadd_ps(xv, w0, b[m][0]); b[m][1] = _mm512_fmadd_ps(xv, w1, b[m][1]); }
      }
      __m512 s0 = _mm512_loadu_ps(sp + j * 32), s1 = _mm512_loadu_ps(sp + j * 32 + 16);
      for (int m = 0; m < M; ++m) { acc[m][0] = _mm512_fmadd_ps(s0, b[m][0], acc[m][0]); acc[m][1] = _mm512_fmadd_ps(s1, b[m][1], acc[m][1]); }
    }
    for (int m = 0; m < M; ++m) { _mm512_storeu_ps(y + (size_t)m * N + p * 32, acc[m][0]); _mm512_storeu_ps(y + (size_t)m * N + p * 32 + 16, acc[m][1]); }
  }
}

// (b) AMX: xs pieces [3][M][K] bf16 precomputed. Two panels (64 columns = 4 C tiles) at a time.
static void run_amx(int M, int K, int p0, int p1, const uint16_t* xs, const int8_t* q, const float* s, float* y, int N) {
  amx_init(M);
  alignas(64) uint16_t bt[4][16 * 32];  // 4 B tiles of 16 cols: 16 rows (k pairs) x 32 bf16
  alignas(64) float ct[4][16 * 16];
  for (int p = p0; p < p1; p += 2) {
    __m512 acc[9][4];
    for (int m = 0; m < M; ++m) for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_setzero_ps();
    for (int j = 0; j < K / KB; ++j) {
      // convert two panels' block (32 k x 64 cols) to 4 B tiles in VNNI-2 bf16
      for (int pp = 0; pp < 2; ++pp) {
        const int8_t* qp = q + (size_t)(p + pp) * K * 32 + (size_t)j * KB * 32;
        for (int r = 0; r < 16; ++r) {
          __m256i a = _mm256_loadu_si256((const __m256i*)(qp + (2 * r) * 32));
          __m256i b = _mm256_loadu_si256((const __m256i*)(qp + (2 * r + 1) * 32));
          // interleave bytes: pairs (a_n, b_n)
          __m256i lo = _mm256_unpacklo_epi8(a, b), hi = _mm256_unpackhi_epi8(a, b);  // per 128-bit lane
          // lo: lane0 n0-7 pairs, lane1 n16-23 ; hi: lane0 n8-15, lane1 n24-31
          __m256i c0 = _mm256_permute2x128_si256(lo, hi, 0x20);  // n0-15 pairs (32 bytes)
          __m256i c1 = _mm256_permute2x128_si256(lo, hi, 0x31);  // n16-31
          for (int h = 0; h < 2; ++h) {
            __m256i cc = h ? c1 : c0;
            __m512i i32a = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(cc));
            __m512i i32b = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(cc, 1));
            __m512bh bf = _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(i32b), _mm512_cvtepi32_ps(i32a));
            _mm512_store_si512((__m512i*)(bt[pp * 2 + h] + r * 32), (__m512i)bf);
          }
        }
      }
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      _tile_loadd(4, xs + 0 * (size_t)M * K + j * KB, K * 2);
      _tile_loadd(5, xs + 1 * (size_t)M * K + j * KB, K * 2);
      _tile_loadd(6, xs + 2 * (size_t)M * K + j * KB, K * 2);
#define DO(C) _tile_loadd(7, bt[C], 64); _tile_dpbf16ps(C, 4, 7); _tile_dpbf16ps(C, 5, 7); _tile_dpbf16ps(C, 6, 7);
      DO(0) DO(1) DO(2) DO(3)
      _tile_stored(0, ct[0], 64); _tile_stored(1, ct[1], 64); _tile_stored(2, ct[2], 64); _tile_stored(3, ct[3], 64);
      const float* sp0 = s + (size_t)p * (K / KB) * 32 + j * 32;
      const float* sp1 = s + (size_t)(p + 1) * (K / KB) * 32 + j * 32;
      __m512 sv[4] = {_mm512_loadu_ps(sp0), _mm512_loadu_ps(sp0 + 16), _mm512_loadu_ps(sp1), _mm512_loadu_ps(sp1 + 16)};
      for (int c = 0; c < 4; ++c) for (int m = 0; m < M; ++m) acc[m][c] = _mm512_fmadd_ps(sv[c], _mm512_load_ps(ct[c] + m * 16), acc[m][c]);
    }
    for (int m = 0; m < M; ++m) for (int c = 0; c < 4; ++c) _mm512_storeu_ps(y + (size_t)m * N + p * 32 + c * 16, acc[m][c]);
  }
  _tile_release();
}

static uint16_t bf(float f) { uint32_t u; memcpy(&u, &f, 4); uint32_t r = u + 0x7FFF + ((u >> 16) & 1); return r >> 16; }
static float fb(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { perror("arch_prctl"); return 1; }
  int K = 1536, N = 8960 * 2 + 1536 * 2 + 256 * 2;  // gate, up, q, o-ish: a big chunk
  int layers = 4;
  std::mt19937 g(1);
  size_t P = N / 32;
  std::vector<int8_t> q((size_t)layers * P * K * 32);
  for (auto& v : q) v = (int8_t)(g() % 64) - 32;
  std::vector<float> s((size_t)layers * P * (K / KB) * 32);
  for (auto& v : s) v = 1e-3f * (1 + g() % 100);
  int T = 2;
  for (int M : {1, 2, 3, 5, 9}) {
    std::vector<float> x((size_t)M * K); for (auto& v : x) v = std::normal_distribution<float>()(g);
    std::vector<uint16_t> xs((size_t)3 * M * K);
    for (size_t i = 0; i < (size_t)M * K; ++i) { float r = x[i]; uint16_t h = bf(r); r -= fb(h); uint16_t m = bf(r); r -= fb(m); uint16_t l = bf(r);
      xs[i] = h; xs[(size_t)M * K + i] = m; xs[2 * (size_t)M * K + i] = l; }
    std::vector<float> y1((size_t)M * N), y2((size_t)M * N);
    double best[2] = {1e9, 1e9};
    for (int rep = 0; rep < 5; ++rep) for (int mode = 0; mode < 2; ++mode) {
      auto t0 = std::chrono::steady_clock::now();
      for (int L = 0; L < layers; ++L) {
        const int8_t* qL = q.data() + (size_t)L * P * K * 32; const float* sL = s.data() + (size_t)L * P * (K / KB) * 32;
        std::vector<std::thread> th;
        for (int t = 0; t < T; ++t) { int a = (int)(P * t / T) & ~1, b = t == T - 1 ? (int)P : (int)(P * (t + 1) / T) & ~1;
          th.emplace_back([&, a, b] { if (mode == 0) run_fma(M, K, a, b, x.data(), qL, sL, y1.data(), N); else run_amx(M, K, a, b, xs.data(), qL, sL, y2.data(), N); }); }
        for (auto& t : th) t.join();
      }
      double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best[mode] = std::min(best[mode], dt);
    }
    double maxd = 0, maxr = 0;
    for (size_t i = 0; i < y1.size(); ++i) { maxd = std::max(maxd, (double)fabs(y1[i] - y2[i])); maxr = std::max(maxr, (double)fabs(y1[i])); }
    double gb = (double)layers * P * K * 32 / 1e9;
    printf("M=%d fma %.2f ms (%.1f GB/s)  amx %.2f ms (%.1f GB/s)  ratio %.2f  maxdiff %.3g of %.3g\n", M, best[0] * 1e3, gb / best[0], best[1] * 1e3, gb / best[1], best[1] / best[0], maxd, maxr);
  }
}
