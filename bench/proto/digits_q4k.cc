// A measurement prototype, not part of jspec: a Q4_K product over float
// activations in integer arithmetic, to see whether jspec's block kernel
// could read Q4_K as fast as llama.cpp's on a VNNI host, and how fast its
// verify rows could be (docs/decisions-compact.md, "Where llama.cpp's lead
// comes from on the Zen 5 host").
//
// Each block of 32 activations becomes a fixed point at the block's largest
// exponent (|xi| < 2^22), cut into 3 signed-byte digits; q (nibbles, 0..15)
// times each digit is summed exactly in int32 by vpdpbusd, the digits are
// combined in float, then scaled by d * sc and the offset dmin * m * sum(x)
// taken off, as jspec's block kernel does per block. A row's result does not
// depend on the rows beside it (checked: the program exits 1 if a row of a
// several-row call differs from a one-row call in any bit).
//
//   g++ -O3 -march=native -fopenmp -o /tmp/digits_q4k bench/proto/digits_q4k.cc
//   OMP_NUM_THREADS=2 OMP_PROC_BIND=close /tmp/digits_q4k 7          # one row: prefetch variants
//   ROWS=1 OMP_NUM_THREADS=2 OMP_PROC_BIND=close /tmp/digits_q4k 5   # 1 to 8 rows
//   SMALL=1 ... a quick run on small matrices (tests/test_proto.py)
//   ONE=1 ...  streams one [1536, 71680] matrix 4 times (as llama.cpp's
//   test-backend-ops does) instead of 4 distinct ones; HUGE=1 advises 2 MiB pages.
//
// "stream" reads 4 distinct [1536, 71680] matrices (62 MB each, past the
// 32 MiB L3); "cached" one [1536, 4096] matrix 100 times. maxerr is against
// a float64 dot product; "fp32 fma chain" is a plain float32 FMA loop's.
#include <immintrin.h>
#include <omp.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <vector>
#include <algorithm>
#include <random>
#include <sys/mman.h>

constexpr int K = 1536;
constexpr int SB = 256;             // super-block
constexpr int NB = SB / 32;         // blocks per super-block
// Per panel (32 columns) per super-block: q 4096 B, then d 128 B, sc 256 B, dm 128 B, m 256 B.
constexpr int QB = SB * 32 / 2;
constexpr int SUPER_BYTES = QB + 128 + 256 + 128 + 256;
constexpr int PANEL_BYTES = K / SB * SUPER_BYTES;

struct Matrix {
  int panels;
  uint8_t* data;
};

// Reference values: q[o][k], d[o][g], sc[o][b], dm[o][g], m[o][b] -> w = d*sc*q - dm*m
struct Ref {
  std::vector<uint8_t> q; std::vector<float> d, dm; std::vector<int8_t> sc, m; int n;
};

Ref make_ref(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  Ref r; r.n = n;
  r.q.resize((size_t)n * K); r.d.resize((size_t)n * K / SB); r.dm.resize((size_t)n * K / SB);
  r.sc.resize((size_t)n * K / 32); r.m.resize((size_t)n * K / 32);
  for (auto& v : r.q) v = rng() & 15;
  std::uniform_real_distribution<float> u(1e-4f, 1e-3f);
  for (auto& v : r.d) v = u(rng);
  for (auto& v : r.dm) v = u(rng);
  for (auto& v : r.sc) v = rng() & 63;
  for (auto& v : r.m) v = rng() & 63;
  return r;
}

Matrix pack(const Ref& r) {
  Matrix mtx; mtx.panels = r.n / 32;
  size_t bytes = ((size_t)mtx.panels * PANEL_BYTES + (2 << 20) - 1) / (2 << 20) * (2 << 20);
  mtx.data = (uint8_t*)aligned_alloc(2 << 20, bytes);
  if (getenv("HUGE")) madvise(mtx.data, bytes, MADV_HUGEPAGE);
  for (int p = 0; p < mtx.panels; ++p) {
    for (int g = 0; g < K / SB; ++g) {
      uint8_t* s = mtx.data + (size_t)p * PANEL_BYTES + (size_t)g * SUPER_BYTES;
      // q: for gp in 0..31 (8 k each), h in 0..1: 64 bytes, byte c*4+j:
      //   low nibble q[k=g*256+gp*8+j][col h*16+c], high nibble k+4.
      for (int gp = 0; gp < SB / 8; ++gp)
        for (int h = 0; h < 2; ++h)
          for (int c = 0; c < 16; ++c)
            for (int j = 0; j < 4; ++j) {
              int o = p * 32 + h * 16 + c, k = g * SB + gp * 8 + j;
              uint8_t lo = r.q[(size_t)o * K + k], hi = r.q[(size_t)o * K + k + 4];
              s[(gp * 2 + h) * 64 + c * 4 + j] = lo | (hi << 4);
            }
      float* d = (float*)(s + QB);
      int8_t* sc = (int8_t*)(s + QB + 128);
      float* dm = (float*)(s + QB + 384);
      int8_t* m = (int8_t*)(s + QB + 512);
      for (int c = 0; c < 32; ++c) {
        int o = p * 32 + c;
        d[c] = r.d[(size_t)o * (K / SB) + g];
        dm[c] = r.dm[(size_t)o * (K / SB) + g];
        for (int b = 0; b < NB; ++b) {
          sc[b * 32 + c] = r.sc[(size_t)o * (K / 32) + g * NB + b];
          m[b * 32 + c] = r.m[(size_t)o * (K / 32) + g * NB + b];
        }
      }
    }
  }
  return mtx;
}

// x prepared: per block of 32: scale (float, power of two), digits [D][32] int8, block sum xs.
template <int D>
struct Xprep {
  float scale[K / 32];
  float xs[K / 32];
  alignas(64) int8_t dg[K / 32][D][32];
};

template <int D>
void prep_x(const float* x, Xprep<D>* xp) {
  constexpr int bits = D == 3 ? 22 : 30;  // |xi| < 2^bits
  for (int b = 0; b < K / 32; ++b) {
    float mx = 0, total = 0;
    for (int i = 0; i < 32; ++i) { mx = std::max(mx, std::fabs(x[b * 32 + i])); total += x[b * 32 + i]; }
    xp->xs[b] = total;
    int e = 0;
    if (mx > 0) std::frexp(mx, &e);  // mx in [2^(e-1), 2^e)
    float scale = std::ldexp(1.0f, e - bits);
    xp->scale[b] = scale;
    for (int i = 0; i < 32; ++i) {
      int64_t xi = (int64_t)std::nearbyint((double)x[b * 32 + i] / scale);
      for (int dd = 0; dd < D; ++dd) {
        int64_t lo = ((xi + 128) & 255) - 128;
        xp->dg[b][dd][i] = (int8_t)lo;
        xi = (xi - lo) >> 8;
      }
      if (xi != 0) { fprintf(stderr, "digit overflow\n"); exit(1); }
    }
  }
}

static inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// One panel, one row: y[0:32].
template <int D, int PF>
inline void panel_row(const uint8_t* s, const Xprep<D>* xp, float* y) {
  const __m512i mask = _mm512_set1_epi8(15);
  __m512 out0 = _mm512_setzero_ps(), out1 = _mm512_setzero_ps();
  for (int g = 0; g < K / SB; ++g, s += SUPER_BYTES) {
    const float* d = (const float*)(s + QB);
    const int8_t* sc = (const int8_t*)(s + QB + 128);
    const float* dm = (const float*)(s + QB + 384);
    const int8_t* m = (const int8_t*)(s + QB + 512);
    const __m512 d0 = _mm512_load_ps(d), d1 = _mm512_load_ps(d + 16);
    const __m512 dm0 = _mm512_load_ps(dm), dm1 = _mm512_load_ps(dm + 16);
    for (int b = 0; b < NB; ++b) {
      const int blk = g * NB + b;
      __m512i acc[2][D];
      for (int h = 0; h < 2; ++h) for (int dd = 0; dd < D; ++dd) acc[h][dd] = _mm512_setzero_si512();
      const uint8_t* qb = s + b * 4 * 128;
      if constexpr (PF > 0) {
        for (int l = 0; l < 8; ++l) _mm_prefetch((const char*)(qb + PF + l * 64), _MM_HINT_T0);
      }
#pragma GCC unroll 4
      for (int gp = 0; gp < 4; ++gp) {
        __m512i xd_lo[D], xd_hi[D];
        for (int dd = 0; dd < D; ++dd) {
          xd_lo[dd] = _mm512_set1_epi32(*(const int32_t*)&xp->dg[blk][dd][gp * 8]);
          xd_hi[dd] = _mm512_set1_epi32(*(const int32_t*)&xp->dg[blk][dd][gp * 8 + 4]);
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m512i w = _mm512_load_si512(qb + (gp * 2 + h) * 64);
          const __m512i lo = _mm512_and_si512(w, mask);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), mask);
          for (int dd = 0; dd < D; ++dd) {
            acc[h][dd] = dpbusd(acc[h][dd], lo, xd_lo[dd]);
            acc[h][dd] = dpbusd(acc[h][dd], hi, xd_hi[dd]);
          }
        }
      }
      const __m512 xsc = _mm512_set1_ps(xp->scale[blk]);
      const __m512 xsum = _mm512_set1_ps(xp->xs[blk]);
      for (int h = 0; h < 2; ++h) {
        __m512 f;
        if constexpr (D == 3) {
          __m512i t = _mm512_add_epi32(acc[h][1], _mm512_slli_epi32(acc[h][2], 8));
          f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(acc[h][0]));
        } else {
          __m512i tl = _mm512_add_epi32(acc[h][0], _mm512_slli_epi32(acc[h][1], 8));
          __m512i th = _mm512_add_epi32(acc[h][2], _mm512_slli_epi32(acc[h][3], 8));
          f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(th), _mm512_set1_ps(65536.f), _mm512_cvtepi32_ps(tl));
        }
        const __m512 scv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i*)(sc + b * 32 + h * 16))));
        const __m512 mv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i*)(m + b * 32 + h * 16))));
        const __m512 sv = _mm512_mul_ps(_mm512_mul_ps(scv, h ? d1 : d0), xsc);  // exact
        __m512 part = _mm512_mul_ps(sv, f);
        __m512 shift = _mm512_mul_ps(_mm512_mul_ps(mv, h ? dm1 : dm0), xsum);
        part = _mm512_sub_ps(part, shift);
        if (h) out1 = _mm512_add_ps(out1, part); else out0 = _mm512_add_ps(out0, part);
      }
    }
  }
  _mm512_storeu_ps(y, out0);
  _mm512_storeu_ps(y + 16, out1);
}

template <int D, int PF = 0>
void matvec(const Matrix& w, const Xprep<D>* xp, float* y) {
#pragma omp parallel
  {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int p0 = (int64_t)w.panels * t / nt, p1 = (int64_t)w.panels * (t + 1) / nt;
    for (int p = p0; p < p1; ++p) panel_row<D, PF>(w.data + (size_t)p * PANEL_BYTES, xp, y + p * 32);
  }
}


double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

static inline __m512i dpbusd_b(__m512i acc, __m512i a, const int8_t* b) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*(const int32_t*)b));
  return acc;
}

// MR rows, one panel: y[m][0:32] for m < MR. xps: MR prepared rows.
template <int D, int MR>
inline void panel_rows(const uint8_t* s, const Xprep<D>* const* xps, float* y, int ldy) {
  const __m512i mask = _mm512_set1_epi8(15);
  __m512 out[MR][2];
  for (int m = 0; m < MR; ++m) out[m][0] = out[m][1] = _mm512_setzero_ps();
  for (int g = 0; g < K / SB; ++g, s += SUPER_BYTES) {
    const float* d = (const float*)(s + QB);
    const int8_t* sc = (const int8_t*)(s + QB + 128);
    const float* dm = (const float*)(s + QB + 384);
    const int8_t* mm = (const int8_t*)(s + QB + 512);
    for (int b = 0; b < NB; ++b) {
      const int blk = g * NB + b;
      const uint8_t* qb = s + b * 4 * 128;
      for (int l = 0; l < 8; ++l) _mm_prefetch((const char*)(qb + 4096 + l * 64), _MM_HINT_T0);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m512i acc[MR][D];
        for (int m = 0; m < MR; ++m) for (int dd = 0; dd < D; ++dd) acc[m][dd] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int gp = 0; gp < 4; ++gp) {
          const __m512i w = _mm512_load_si512(qb + (gp * 2 + h) * 64);
          const __m512i lo = _mm512_and_si512(w, mask);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), mask);
#pragma GCC unroll 12
          for (int m = 0; m < MR; ++m) {
            for (int dd = 0; dd < D; ++dd) {
              acc[m][dd] = dpbusd_b(acc[m][dd], lo, &xps[m]->dg[blk][dd][gp * 8]);
              acc[m][dd] = dpbusd_b(acc[m][dd], hi, &xps[m]->dg[blk][dd][gp * 8 + 4]);
            }
          }
        }
        const __m512 scv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i*)(sc + b * 32 + h * 16))));
        const __m512 mv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i*)(mm + b * 32 + h * 16))));
        const __m512 sd = _mm512_mul_ps(scv, _mm512_load_ps(d + h * 16));
        const __m512 md = _mm512_mul_ps(mv, _mm512_load_ps(dm + h * 16));
#pragma GCC unroll 12
        for (int m = 0; m < MR; ++m) {
          __m512i t = _mm512_add_epi32(acc[m][1], _mm512_slli_epi32(acc[m][2], 8));
          __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(acc[m][0]));
          __m512 part = _mm512_mul_ps(_mm512_mul_ps(sd, _mm512_set1_ps(xps[m]->scale[blk])), f);
          part = _mm512_sub_ps(part, _mm512_mul_ps(md, _mm512_set1_ps(xps[m]->xs[blk])));
          out[m][h] = _mm512_add_ps(out[m][h], part);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) { _mm512_storeu_ps(y + m * ldy, out[m][0]); _mm512_storeu_ps(y + m * ldy + 16, out[m][1]); }
}

template <int MR>
void matrows(const Matrix& w, const Xprep<3>* const* xps, float* y, int ldy) {
#pragma omp parallel
  {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int p0 = (int64_t)w.panels * t / nt, p1 = (int64_t)w.panels * (t + 1) / nt;
    for (int p = p0; p < p1; ++p) panel_rows<3, MR>(w.data + (size_t)p * PANEL_BYTES, xps, y + p * 32, ldy);
  }
}

// rows > 8: tiles of up to 8 rows over the same panel (from L1/L2 on the second pass).
template <int MR>
void run_rows(std::vector<Matrix>& big, Matrix& small, const std::vector<float>& x, int reps) {
  static Xprep<3> xs[MR];
  const Xprep<3>* xps[MR];
  for (int m = 0; m < MR; ++m) { std::vector<float> xm(x); for (auto& v : xm) v *= (1 + 0.1f * m); prep_x<3>(xm.data(), &xs[m]); xps[m] = &xs[m]; }
  std::vector<float> yb((size_t)big[0].panels * 32 * MR), y((size_t)small.panels * 32 * MR);
  // check rows against one-row calls
  std::vector<float> y1(small.panels * 32);
  matrows<MR>(small, xps, y.data(), small.panels * 32);
  for (int m = 0; m < MR; ++m) { matvec<3>(small, xps[m], y1.data());
    for (int o = 0; o < small.panels * 32; ++o) if (y1[o] != y[(size_t)m * small.panels * 32 + o]) { printf("row %d differs at %d\n", m, o); exit(1); } }
  std::vector<double> ts, tc;
  for (int r = 0; r < reps; ++r) {
    double t0 = now();
    for (auto& mtx : big) matrows<MR>(mtx, xps, yb.data(), big[0].panels * 32);
    ts.push_back((now() - t0) / big.size());
    t0 = now();
    for (int i = 0; i < 100; ++i) matrows<MR>(small, xps, y.data(), small.panels * 32);
    tc.push_back((now() - t0) / 100);
  }
  std::sort(ts.begin(), ts.end()); std::sort(tc.begin(), tc.end());
  double wb = (double)big[0].panels * 32 * K, ws = (double)small.panels * 32 * K;
  printf("digits M=%d: stream %.3f ms/call (%.1f w/ns, %.1f w*rows/ns) | cached %.3f ms/call (%.1f w*rows/ns)\n", MR,
         ts[reps / 2] * 1e3, wb / ts[reps / 2] * 1e-9, MR * wb / ts[reps / 2] * 1e-9, tc[reps / 2] * 1e3, MR * ws / tc[reps / 2] * 1e-9);
}


template <int D, int PF = 0>
void run(const char* name, std::vector<Matrix>& big, Matrix& small, const std::vector<float>& x,
         const Ref& rsmall, int reps) {
  static Xprep<D> xp;
  prep_x<D>(x.data(), &xp);
  // error check on the small matrix against double
  std::vector<float> y(small.panels * 32);
  matvec<D>(small, &xp, y.data());
  double maxerr = 0, maxerr_f32 = 0, maxabs = 0;
  for (int o = 0; o < rsmall.n; ++o) {
    double acc = 0; float accf = 0;
    for (int k = 0; k < K; ++k) {
      double w = (double)rsmall.d[(size_t)o * (K / SB) + k / SB] * rsmall.sc[(size_t)o * (K / 32) + k / 32] * rsmall.q[(size_t)o * K + k]
               - (double)rsmall.dm[(size_t)o * (K / SB) + k / SB] * rsmall.m[(size_t)o * (K / 32) + k / 32];
      acc += w * x[k];
      accf = std::fma((float)w, x[k], accf);
    }
    maxerr = std::max(maxerr, std::fabs(acc - y[o]));
    maxerr_f32 = std::max(maxerr_f32, std::fabs(acc - accf));
    maxabs = std::max(maxabs, std::fabs(acc));
  }
  std::vector<float> yb(big[0].panels * 32);
  std::vector<double> ts, tc;
  for (int r = 0; r < reps; ++r) {
    double t0 = now();
    if (getenv("ONE")) { for (int i = 0; i < 4; ++i) matvec<D, PF>(big[0], &xp, yb.data()); }
    else for (auto& m : big) matvec<D, PF>(m, &xp, yb.data());
    ts.push_back((now() - t0) / big.size());
    t0 = now();
    for (int i = 0; i < 100; ++i) matvec<D, PF>(small, &xp, y.data());
    tc.push_back((now() - t0) / 100);
  }
  std::sort(ts.begin(), ts.end()); std::sort(tc.begin(), tc.end());
  double wb = (double)big[0].panels * 32 * K, ws = (double)small.panels * 32 * K;
  printf("%s: stream %.1f w/ns %.1f GB/s | cached %.1f w/ns | maxerr %.2e (fp32 fma chain %.2e, |y| max %.1f)\n", name,
         wb / ts[reps / 2] * 1e-9, (double)big[0].panels * PANEL_BYTES / ts[reps / 2] * 1e-9,
         ws / tc[reps / 2] * 1e-9, maxerr, maxerr_f32, maxabs);
}

int main(int argc, char** argv) {
  // SMALL=1: small matrices (a test's quick check of the rows and the error).
  int nbig = getenv("SMALL") ? 4096 : 71680, nsmall = 4096, reps = argc > 1 ? atoi(argv[1]) : 7;
  std::vector<Matrix> big;
  for (int i = 0; i < 4; ++i) big.push_back(pack(make_ref(nbig, 100 + i)));
  Ref rs = make_ref(nsmall, 7);
  Matrix small = pack(rs);
  std::vector<float> x(K);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0, 1);
  for (auto& v : x) v = nd(rng) * (rng() % 7 == 0 ? 30.f : 1.f);
  if (getenv("ROWS")) {
    for (int round = 0; round < 2; ++round) {
      run<3, 4096>("3 digits M=1 (row kernel), pf 4K", big, small, x, rs, reps);
      run_rows<1>(big, small, x, reps); run_rows<2>(big, small, x, reps); run_rows<3>(big, small, x, reps);
      run_rows<4>(big, small, x, reps); run_rows<5>(big, small, x, reps); run_rows<6>(big, small, x, reps); run_rows<8>(big, small, x, reps);
    }
    return 0;
  }
  for (int round = 0; round < 2; ++round) {
    // plain read of the big matrices
    std::vector<double> tr;
    for (int r = 0; r < reps; ++r) {
      double t0 = now(); int64_t tot = 0;
      for (auto& m : big) {
        size_t n = (size_t)m.panels * PANEL_BYTES / 64;
#pragma omp parallel for reduction(+:tot)
        for (size_t i = 0; i < n; ++i) { __m512i v = _mm512_load_si512(m.data + i * 64); tot += _mm_cvtsi128_si64(_mm512_castsi512_si128(v)); }
      }
      tr.push_back(now() - t0); if (tot == 42) printf("x");
    }
    std::sort(tr.begin(), tr.end());
    printf("plain read %.1f GB/s\n", 4.0 * big[0].panels * PANEL_BYTES / tr[reps / 2] * 1e-9);
    run<3>("3 digits, no pf", big, small, x, rs, reps);
    run<3, 2048>("3 digits, pf 2K", big, small, x, rs, reps);
    run<3, 4096>("3 digits, pf 4K", big, small, x, rs, reps);
  }
}
