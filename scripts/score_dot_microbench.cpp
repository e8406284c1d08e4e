// Issue 51 item 2, the question first: how much faster are integer attention scores than today's fp32
// scores on a CPU *without* VNNI? One core; 24 query rows (8 verified rows x 3 query heads of a KV head)
// against 4096 keys of 64 channels, keys read row by row as packed_attention.cpp does, 4 rows a tile:
//   f32  fp32 FMAs over fp16 keys widened in registers (the kernel's scheme)
//   i8   int8 x int8 with AVX2 maddubs (llama.cpp's Q8_0 sign trick), 32-channel blocks, fp32 block scales
//   i16  int16 queries x int8 keys widened once per key (madd_epi16)
// Build and run: g++ -O3 -march=native -ffp-contract=off -funroll-loops scripts/score_dot_microbench.cpp -o /tmp/sdm && /tmp/sdm
// Prints G multiply-adds/s for each, three times. Results: docs/history/BENCHMARKS-by-issue.md, "Integer scores on AVX2".
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <cstdlib>
// 24 query rows x NK keys x 64 dims scores, keys read row-wise; NR=4 rows per tile, 2 keys at a time
constexpr int D = 64, NK = 4096, R = 24;
static double now(){return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();}
__attribute__((noinline)) void f32(const float* q, const uint16_t* k, float* s) {
  for (int x0 = 0; x0 < R; x0 += 4)
  for (int t = 0; t < NK; t += 2) {
    __m256 a0[4], a1[4];
    for (int x=0;x<4;++x) a0[x]=a1[x]=_mm256_setzero_ps();
    for (int j=0;j<D;j+=8){
      __m256 k0=_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(k+t*D+j)));
      __m256 k1=_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(k+(t+1)*D+j)));
      for(int x=0;x<4;++x){__m256 qx=_mm256_loadu_ps(q+(x0+x)*D+j); a0[x]=_mm256_fmadd_ps(qx,k0,a0[x]); a1[x]=_mm256_fmadd_ps(qx,k1,a1[x]);}
    }
    for(int x=0;x<4;++x){ __m256 h=_mm256_hadd_ps(a0[x],a1[x]); __m128 l=_mm_add_ps(_mm256_castps256_ps128(h),_mm256_extractf128_ps(h,1)); s[(x0+x)*NK+t]=l[0]+l[1]; s[(x0+x)*NK+t+1]=l[2]+l[3];}
  }
}
// int8 sign trick: per 32-channel block
__attribute__((noinline)) void i8(const int8_t* q, const int8_t* k, const float* qd, const float* kd, float* s) {
  const __m256i ones=_mm256_set1_epi16(1);
  for (int x0 = 0; x0 < R; x0 += 4) {
    __m256i aq[4][2], sq[4][2];
    for(int x=0;x<4;++x) for(int b=0;b<2;++b){ sq[x][b]=_mm256_loadu_si256((const __m256i*)(q+(x0+x)*D+32*b)); aq[x][b]=_mm256_sign_epi8(sq[x][b],sq[x][b]);}
    for (int t = 0; t < NK; t += 2) {
      __m256i c0[4][2], c1[4][2];
      for(int b=0;b<2;++b){
        __m256i k0=_mm256_loadu_si256((const __m256i*)(k+t*D+32*b)), k1=_mm256_loadu_si256((const __m256i*)(k+(t+1)*D+32*b));
        for(int x=0;x<4;++x){
          c0[x][b]=_mm256_madd_epi16(_mm256_maddubs_epi16(aq[x][b],_mm256_sign_epi8(k0,sq[x][b])),ones);
          c1[x][b]=_mm256_madd_epi16(_mm256_maddubs_epi16(aq[x][b],_mm256_sign_epi8(k1,sq[x][b])),ones);
        }
      }
      for(int x=0;x<4;++x){
        __m256i h=_mm256_hadd_epi32(_mm256_hadd_epi32(c0[x][0],c0[x][1]),_mm256_hadd_epi32(c1[x][0],c1[x][1]));
        __m128i l=_mm_add_epi32(_mm256_castsi256_si128(h),_mm256_extracti128_si256(h,1));
        // l: [k0b0, k0b1, k1b0, k1b1] after reduce
        l=_mm_hadd_epi32(l,l);
        (void)l;
        int32_t v[4]; _mm_storeu_si128((__m128i*)v,l);
        s[(x0+x)*NK+t]=(float)v[0]*(qd[(x0+x)*2]*kd[t*2]);
        s[(x0+x)*NK+t+1]=(float)v[1]*(qd[(x0+x)*2]*kd[t*2+2]);
      }
    }
  }
}
// int16 madd: keys widened once per key (shared by the 4 rows)
__attribute__((noinline)) void i16(const int16_t* q, const int8_t* k, float* s) {
  for (int x0 = 0; x0 < R; x0 += 4)
  for (int t = 0; t < NK; t += 2) {
    __m256i a0[4], a1[4];
    for(int x=0;x<4;++x) a0[x]=a1[x]=_mm256_setzero_si256();
    for(int j=0;j<D;j+=16){
      __m256i k0=_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(k+t*D+j))), k1=_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(k+(t+1)*D+j)));
      for(int x=0;x<4;++x){__m256i qx=_mm256_loadu_si256((const __m256i*)(q+(x0+x)*D+j)); a0[x]=_mm256_add_epi32(a0[x],_mm256_madd_epi16(qx,k0)); a1[x]=_mm256_add_epi32(a1[x],_mm256_madd_epi16(qx,k1));}
    }
    for(int x=0;x<4;++x){ __m256i h=_mm256_hadd_epi32(a0[x],a1[x]); __m128i l=_mm_add_epi32(_mm256_castsi256_si128(h),_mm256_extracti128_si256(h,1)); int32_t v[4]; _mm_storeu_si128((__m128i*)v,l); s[(x0+x)*NK+t]=(float)(v[0]+v[1]); s[(x0+x)*NK+t+1]=(float)(v[2]+v[3]);}
  }
}
int main(){
  std::vector<float> q(R*D), s(R*NK), qd(R*2), kd(NK*2); std::vector<uint16_t> k(NK*D); std::vector<int8_t> q8(R*D), k8(NK*D); std::vector<int16_t> q16(R*D);
  for(auto&x:q)x=rand()/(float)RAND_MAX; for(auto&x:k)x=0x3c00+(rand()&0xff); for(auto&x:q8)x=(rand()%255)-127; for(auto&x:k8)x=(rand()%255)-127; for(auto&x:q16)x=(rand()%255)-127; for(auto&x:qd)x=0.01f; for(auto&x:kd)x=0.01f;
  double macs=(double)R*NK*D;
  for(int rep=0;rep<3;++rep){
  double t0=now(); for(int i=0;i<20;++i) f32(q.data(),k.data(),s.data()); double t1=now();
  for(int i=0;i<20;++i) i8(q8.data(),k8.data(),qd.data(),kd.data(),s.data()); double t2=now();
  for(int i=0;i<20;++i) i16(q16.data(),k8.data(),s.data()); double t3=now();
  printf("f32 %.1f GMAC/s  i8-maddubs %.1f  i16-madd %.1f\n", macs*20/(t1-t0)/1e9, macs*20/(t2-t1)/1e9, macs*20/(t3-t2)/1e9);
  }
}
