// The question before integer attention for verification (issue 53's speed lever): how much faster are
// a verification's attention scores as exact int8 dot products on VNNI (vpdpbusd) and AMX (tdpbssd)
// than as today's fp32 FMAs? One core. The shape of the code model's verification of 8 drafts: 9 rows x
// 7 query heads of a KV head = 63 query rows (64 with padding) against NK keys of 64 channels; every
// variant computes all 64 x NK scores, keys read once a pass from a layout made for it:
//   f32   fp32 FMAs over fp16 keys widened in registers, 16 keys in lanes (keys transposed), 4 rows a
//         tile: an upper bound for the fp32 path (today's kernel keeps keys as stored, 8 lanes a key)
//   vnni  int8 queries (+128 as u8) . int8 keys, vpdpbusd, 16 keys in lanes, 4 rows a tile; the +128
//         taken back exactly with each key's channel sum (int32: exact, every order)
//   amx   int8 . int8 tiles: C[16 rows x 16 keys] += A[16 rows x 64 channels] . B[16 x 16 keys x 4],
//         2 x 2 C tiles a step (32 rows x 32 keys)
// The integer variants' int32 scores are checked against plain sums and each other (exact sums agree
// whatever the order), and each variant's G multiply-adds/s printed, three runs.
// Build and run (an AMX machine; a VNNI one: drop -DWITH_AMX):
//   g++ -O3 -march=native -DWITH_AMX -ffp-contract=off scripts/int_scores_microbench.cpp -o /tmp/ism && /tmp/ism
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

constexpr int D = 64, R = 64, NK = 16384;
// scores go to a block buffer [R][OW] reused along the keys (L1-resident), as a fused kernel consumes a
// block's scores at once: key t's score of row x at [x][t % OW]; after a pass it holds the last OW keys'
constexpr int OW = 64, OS = OW;

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// f32: q [R][D] fp32; kt [NK/16][D][16] fp16 (16 keys in lanes); s [R][NK]
__attribute__((noinline)) void f32(const float* q, const uint16_t* kt, float* s) {
  for (int t0 = 0; t0 < NK; t0 += 16) {
    const uint16_t* kb = kt + (size_t)t0 * D;
    for (int x0 = 0; x0 < R; x0 += 4) {
      __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int j = 0; j < D; ++j) {
        const __m512 k = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(kb + 16 * j)));
        for (int x = 0; x < 4; ++x) a[x] = _mm512_fmadd_ps(_mm512_set1_ps(q[(x0 + x) * D + j]), k, a[x]);
      }
      for (int x = 0; x < 4; ++x) _mm512_storeu_ps(s + (x0 + x) * OS + t0 % OW, a[x]);
    }
  }
}

// vnni: qu [R][D] u8 (q + 128); kp [NK/16][D/4][16][4] s8; ksum [NK] (each key's channel sum); si [R][NK]
__attribute__((noinline)) void vnni(const uint8_t* qu, const int8_t* kp, const int32_t* ksum, int32_t* si) {
  for (int t0 = 0; t0 < NK; t0 += 16) {
    const int8_t* kb = kp + (size_t)t0 * D;
    const __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(ksum + t0), 7);   // 128 * sum_j k[j]
    for (int x0 = 0; x0 < R; x0 += 4) {
      __m512i a[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
      for (int j4 = 0; j4 < D / 4; ++j4) {
        const __m512i k = _mm512_loadu_si512(kb + 64 * j4);
        for (int x = 0; x < 4; ++x) {
          int32_t q4;
          std::memcpy(&q4, qu + (x0 + x) * D + 4 * j4, 4);
          a[x] = _mm512_dpbusd_epi32(a[x], _mm512_set1_epi32(q4), k);
        }
      }
      for (int x = 0; x < 4; ++x) _mm512_storeu_si512(si + (x0 + x) * OS + t0 % OW, _mm512_sub_epi32(a[x], corr));
    }
  }
}

#ifdef WITH_AMX
struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: C (rows 0-15 / 16-31 x keys 0-15 / 16-31); 4, 5: A (16 rows x 64 channels); 6, 7: B (16 x 64)
void amx_config() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// amx: q [R][D] s8; kp as vnni's (B tile for 16 keys: [D/4 = 16 rows][16 keys x 4 bytes]); si [R][NK]
__attribute__((noinline)) void amx(const int8_t* q, const int8_t* kp, int32_t* si) {
  for (int t0 = 0; t0 < NK; t0 += 32) {
    for (int x0 = 0; x0 < R; x0 += 32) {
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      _tile_loadd(4, q + x0 * D, D);
      _tile_loadd(5, q + (x0 + 16) * D, D);
      _tile_loadd(6, kp + (size_t)t0 * D, 64);
      _tile_loadd(7, kp + (size_t)(t0 + 16) * D, 64);
      _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7); _tile_dpbssd(2, 5, 6); _tile_dpbssd(3, 5, 7);
      _tile_stored(0, si + x0 * OS + t0 % OW, OS * 4);
      _tile_stored(1, si + x0 * OS + t0 % OW + 16, OS * 4);
      _tile_stored(2, si + (x0 + 16) * OS + t0 % OW, OS * 4);
      _tile_stored(3, si + (x0 + 16) * OS + t0 % OW + 16, OS * 4);
    }
  }
}
#endif

int main() {
  std::vector<float> q(R * D), s((size_t)R * NK);
  std::vector<uint8_t> qu(R * D);
  std::vector<int8_t> q8(R * D), k8((size_t)NK * D), kp((size_t)NK * D);
  std::vector<uint16_t> kt((size_t)NK * D);
  std::vector<int32_t> ksum(NK), s1((size_t)R * NK), s2((size_t)R * NK);
  srand(1);
  for (int i = 0; i < R * D; ++i) {
    q8[i] = (int8_t)(rand() % 255 - 127);
    qu[i] = (uint8_t)(q8[i] + 128);
    q[i] = q8[i] / 127.f;
  }
  for (size_t i = 0; i < k8.size(); ++i) k8[i] = (int8_t)(rand() % 255 - 127);
  for (int t = 0; t < NK; ++t) {
    ksum[t] = 0;
    for (int j = 0; j < D; ++j) {
      const int8_t v = k8[(size_t)t * D + j];
      ksum[t] += v;
      kp[(size_t)(t / 16) * 16 * D + (j / 4) * 64 + (t % 16) * 4 + j % 4] = v;   // [NK/16][D/4][16][4]
      kt[(size_t)(t / 16) * 16 * D + j * 16 + t % 16] = _cvtss_sh(v / 127.f, 0);   // [NK/16][D][16]
    }
  }
  const double madds = (double)R * NK * D;
  auto run = [&](const char* name, auto&& f) {
    for (int rep = 0; rep < 3; ++rep) {
      const double t = now();
      for (int i = 0; i < 10; ++i) f();
      const double dt = (now() - t) / 10;
      printf("%-5s %8.3f ms  %7.1f G multiply-adds/s\n", name, 1e3 * dt, madds / dt / 1e9);
    }
  };
  run("f32", [&] { f32(q.data(), kt.data(), s.data()); });
  run("vnni", [&] { vnni(qu.data(), kp.data(), ksum.data(), s1.data()); });
  bool exact = true;   // the last block's scores against plain integer sums
  for (int x = 0; x < R; ++x)
    for (int t = NK - OW; t < NK; ++t) {
      int32_t ref = 0;
      for (int j = 0; j < D; ++j) ref += q8[x * D + j] * k8[(size_t)t * D + j];
      exact = exact && s1[x * OS + t % OW] == ref;
    }
  printf("vnni exact: %s\n", exact ? "yes" : "NO");
#ifdef WITH_AMX
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    printf("amx: arch_prctl refused the tile data\n");
    return 0;
  }
  amx_config();
  run("amx", [&] { amx(q8.data(), kp.data(), s2.data()); });
  printf("amx == vnni on every score: %s\n", std::memcmp(s1.data(), s2.data(), (size_t)R * OS * 4) == 0 ? "yes" : "NO");
  _tile_release();
#endif
  return 0;
}
