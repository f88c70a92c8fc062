// A measurement of this host's AMX rate, not part of jspec: 12 `tdpbf16ps`
// (4 accumulators x 3 pieces, the block of `RunBlkAmx`) in a loop, with the
// tile loads, zeroing and stores added mode by mode (docs/decisions-compact.md,
// "AMX for prefill chunks").
//
//   g++ -O2 -march=native -o /tmp/amx_rate bench/proto/amx_rate.cc && /tmp/amx_rate
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <chrono>
struct alignas(64) Cfg { uint8_t p=1,s=0; uint8_t r[14]={}; uint16_t c[16]={}; uint8_t rows[16]={}; };
alignas(64) uint16_t A[3][16*32]; alignas(64) uint32_t Bt[4][256]; alignas(64) float C[4][256];
int main(){
  syscall(SYS_arch_prctl,0x1023,18);
  Cfg c; for(int t=0;t<8;++t){c.rows[t]=16;c.c[t]=64;} _tile_loadconfig(&c);
  for (int mode=0; mode<4; ++mode) {
  const int N=200000;
  auto t0=std::chrono::steady_clock::now();
  for(int i=0;i<N;++i){
    if (mode>=1) { _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3); }
    _tile_loadd(4,A[0],64);_tile_loadd(5,A[1],64);_tile_loadd(6,A[2],64);
    _tile_loadd(7,Bt[0],64); _tile_dpbf16ps(0,4,7);_tile_dpbf16ps(0,5,7);_tile_dpbf16ps(0,6,7);
    _tile_loadd(7,Bt[1],64); _tile_dpbf16ps(1,4,7);_tile_dpbf16ps(1,5,7);_tile_dpbf16ps(1,6,7);
    _tile_loadd(7,Bt[2],64); _tile_dpbf16ps(2,4,7);_tile_dpbf16ps(2,5,7);_tile_dpbf16ps(2,6,7);
    _tile_loadd(7,Bt[3],64); _tile_dpbf16ps(3,4,7);_tile_dpbf16ps(3,5,7);_tile_dpbf16ps(3,6,7);
    if (mode>=2) { _tile_stored(0,C[0],64);_tile_stored(1,C[1],64);_tile_stored(2,C[2],64);_tile_stored(3,C[3],64); }
    if (mode>=3) { volatile float z = C[0][i & 255]; (void)z; }
  }
  double s=std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count();
  printf("mode %d: %.1f ns per 12 tdp (%.2f ns/tdp) -> %.1f bf16 MAC/ns\n",mode,s/N*1e9,s/N*1e9/12, 12.0*16*16*32/(s/N*1e9));
  }
}
