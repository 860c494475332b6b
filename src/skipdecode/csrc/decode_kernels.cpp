// CPU kernels for the decode step (fp32 activations; fp32, bf16, int8 or int4 weights; AVX2 + FMA), built on first use by
// skipdecode/kernels.py. Inference only: no autograd.
//
// Why: a decode step multiplies 1-32 rows by every weight once. oneDNN and
// MKL are tuned for big GEMMs: on the 2-core EPYC these were measured on,
// oneDNN's packed GEMM streamed weights at ~20 GB/s at batch 1 (this kernel:
// ~30 GB/s) and ran under half the FMA peak at batch 8. A small-M GEMM over
// weights packed in 16-column panels, blocked along K so a weight block stays
// in L1 while every row block uses it, is faster at every batch of 1-32. The
// norm, RoPE and SwiGLU kernels replace a handful of dispatched ops each; the
// attention kernel reads each key/value once for all query heads of its group.
// For the Llama family, decode_block runs a whole layer in one call.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t NR = 16;   // panel width: output columns per micro-kernel (two AVX registers)
constexpr int64_t MR = 6;    // rows per micro-kernel: 12 accumulators + 2 weights + 1 broadcast
// Panels stream from memory once per step, and the hardware prefetcher alone
// left the loads waiting: each micro-kernel step asks for the line 4 KB ahead
// in the same panel stream. With the accumulator sets of micro_kernel, this
// took the committed fp32 batch-8 decode step from 41.4 to 32.2 ms
// (benchmarks/results/bench.md before and after, same machine).
constexpr int64_t PF_BYTES = 4096;
// The narrow forms (batch-1 decode) also ask for the line 16 KB ahead into L2 (prefetcht1), once
// or twice a line: with the 4 KB requests alone, int8 panels streamed at 67% of the read bandwidth
// while their arithmetic alone took well under that time
// (benchmarks/results/xeon-amx/gemm-streamed-b1.json). Batch-1 decode steps with and without:
// benchmarks/results/kernel-ab-far-prefetch.json.
constexpr int64_t PF_FAR_BYTES = 4 * PF_BYTES;
// Except fp32 panels in the narrow form (batch-1 decode): their lines are asked for 1 KB ahead into
// L1 and 4 KB ahead into L2. An fp32 line feeds a single FMA, so it is used up four times as fast
// as an int8 line, and the kernels' read probe reads 16% slower with its lines asked for 4 KB
// ahead than 1 KB (benchmarks/results/xeon-amx/read-probe). In one process on an Intel Xeon,
// decode steps against 4 KB and 16 KB ran 1.07x faster at full depth, 1.05x at 3x and 1.02x at 5x,
// with controls (fp32 at 8 rows, int8) at 1.02x and 0.99x
// (benchmarks/results/xeon-amx/kernel-ab-f32-near-prefetch.json). A first run of the same code read
// 1.093x, 1.038x and 0.975x (-first-run.json): at 5x, where the weights a step reads mostly fit that
// host's 480 MiB cache, the two runs differ in sign. 1 KB alone, without the L2 request, ran 1.04x at
// full depth and 1.03x at 3x (-l1-only.json).
constexpr int64_t PF_F32_BYTES = 1024, PF_F32_FAR_BYTES = 4 * PF_F32_BYTES;
constexpr int64_t KC = 256;  // K block: a 16 x 256 weight block (16 KB) stays in L1 across row blocks

// 16 weights of one panel row as two fp32 vectors: fp32 panels load directly;
// bf16 panels (uint16) widen to 32 bits and shift into the high half, which is
// exactly the fp32 value (bf16 is fp32's top 16 bits). Half the bytes per weight
// for the memory-bound decode step; the FMAs stay fp32.
static inline void load_w(const float* w, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(w);
  w1 = _mm256_loadu_ps(w + 8);
}
static inline void load_w(const uint16_t* w, __m256& w0, __m256& w1) {
  const __m128i h0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  const __m128i h1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 8));
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h0), 16));
  w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h1), 16));
}

// int8 panels (weight-only, symmetric per output channel) widen to int32 and
// convert to fp32 exactly; the channel's scale multiplies the finished sum
// once (sum_k x_k * s * q_k = s * sum_k x_k * q_k). A quarter of fp32's bytes.
static inline void load_w(const int8_t* w, __m256& w0, __m256& w1) {
  w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
  w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8))));
}

// The finished sums of R rows of one panel (acc, NR per row) into y: times the column scale
// (int8 weight-only), plus bias, plus the residual (res may be y itself), for its ncols columns.
// Every micro-kernel ends with this on its last K block.
static inline void store_rows(int64_t R, const float* acc, float* y, int64_t ldy, int64_t ncols, const float* scale,
                              const float* bias, const float* res) {
  if (ncols == NR) {  // a whole panel: the same operations, 8 columns at a time
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < NR; c += 8) {
        __m256 v = _mm256_loadu_ps(acc + r * NR + c);
        if (scale) v = _mm256_mul_ps(v, _mm256_loadu_ps(scale + c));
        v = _mm256_add_ps(v, bias ? _mm256_loadu_ps(bias + c) : _mm256_setzero_ps());
        v = _mm256_add_ps(v, res ? _mm256_loadu_ps(res + r * ldy + c) : _mm256_setzero_ps());
        _mm256_storeu_ps(y + r * ldy + c, v);
      }
    return;
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < ncols; ++c)
      y[r * ldy + c] = (scale ? acc[r * NR + c] * scale[c] : acc[r * NR + c]) + (bias ? bias[c] : 0.f) +
                       (res ? res[r * ldy + c] : 0.f);
}

// rows x 16 outputs of one panel over one K block. `acc` holds the partial
// sums between K blocks; on the last block the result (x scale, + bias) goes to y.
// Below 4 rows there are too few accumulators to hide the FMA latency (2R
// chains against the 8 that two FMA ports with 4-cycle latency need), so U
// independent sets of them take alternate k and are summed at the end.
template <int R, typename W>
static inline void micro_kernel(const float* x, int64_t ldx, const W* w, int64_t kc, float* acc, bool first,
                                bool last, float* y, int64_t ldy, int64_t ncols, const float* scale,
                                const float* bias, const float* res) {
  constexpr int U = R >= 4 ? 1 : R == 3 ? 2 : 4 / R;
  __m256 a0[U][R], a1[U][R];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) {
      if (first || u > 0) {
        a0[u][r] = _mm256_setzero_ps();
        a1[u][r] = _mm256_setzero_ps();
      } else {
        a0[u][r] = _mm256_loadu_ps(acc + r * NR);
        a1[u][r] = _mm256_loadu_ps(acc + r * NR + 8);
      }
    }
  int64_t k = 0;
  for (; k + U <= kc; k += U)
    for (int u = 0; u < U; ++u) {
      __m256 w0, w1;
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + u) * NR) + PF_BYTES, _MM_HINT_T0);
      load_w(w + (k + u) * NR, w0, w1);
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k + u);
        a0[u][r] = _mm256_fmadd_ps(xb, w0, a0[u][r]);
        a1[u][r] = _mm256_fmadd_ps(xb, w1, a1[u][r]);
      }
    }
  for (; k < kc; ++k) {
    __m256 w0, w1;
    load_w(w + k * NR, w0, w1);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
      a0[0][r] = _mm256_fmadd_ps(xb, w0, a0[0][r]);
      a1[0][r] = _mm256_fmadd_ps(xb, w1, a1[0][r]);
    }
  }
  for (int u = 1; u < U; ++u)
    for (int r = 0; r < R; ++r) {
      a0[0][r] = _mm256_add_ps(a0[0][r], a0[u][r]);
      a1[0][r] = _mm256_add_ps(a1[0][r], a1[u][r]);
    }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc + r * NR, a0[0][r]);
    _mm256_storeu_ps(acc + r * NR + 8, a1[0][r]);
  }
  if (last) store_rows(R, acc, y, ldy, ncols, scale, bias, res);
}

// One row block. The micro-kernels stay plain `static inline`: marked
// always_inline, GCC 12 stored all 12 accumulators to the stack on every
// iteration (2.5x slower).
template <typename W>
inline void row_block(int64_t r, const float* x, int64_t K, const W* w, int64_t kc, float* acc, bool first,
                      bool last, float* y, int64_t N, int64_t ncols, const float* scale, const float* bias,
                      const float* res) {
  switch (r) {
    case 6: return micro_kernel<6>(x, K, w, kc, acc, first, last, y, N, ncols, scale, bias, res);
    case 5: return micro_kernel<5>(x, K, w, kc, acc, first, last, y, N, ncols, scale, bias, res);
    case 4: return micro_kernel<4>(x, K, w, kc, acc, first, last, y, N, ncols, scale, bias, res);
    case 3: return micro_kernel<3>(x, K, w, kc, acc, first, last, y, N, ncols, scale, bias, res);
    case 2: return micro_kernel<2>(x, K, w, kc, acc, first, last, y, N, ncols, scale, bias, res);
    default: return micro_kernel<1>(x, K, w, kc, acc, first, last, y, N, ncols, scale, bias, res);
  }
}

// int4 panels (weight-only, the size class of llama.cpp's Q4_0; kernels.pack_int4): per 8
// consecutive k of a 16-column panel, 16 little-endian 32-bit words (64 bytes), word c holding
// column c's 8 codes, nibble j for k0 + j; one bf16 scale per output column and group of G4
// consecutive k. Nibbles 0-6 hold q = v + 8 (0..15) for the weight v * scale; nibble 7 holds v in
// two's complement. Masking nibble j in place and converting the whole word gives q * 16^j exactly
// (nibble 7: v * 16^7, its top bit the word's sign), so a weight costs one AND and one conversion
// before its FMA, with no shuffle: the activations are pre-scaled by 16^-j (exact, a power of two;
// prescale_q4) so the FMA adds x * q, and the 8 * x that nibbles 0-6 carry is taken off once per
// group with the group's sum of those x. The form before widened each byte and mapped nibbles
// through a table, two shuffles per 32 weights: a batch-1 int4 step took 6.08 ms then, 4.46 ms
// now (benchmarks/results/llamacpp.md and its history). An eighth of fp32's bytes, plus a bf16
// scale per 32 weights.
constexpr int64_t G4 = 32;

// The masks that keep nibble j of each word in place.
static inline int32_t nibble_mask(int j) { return static_cast<int32_t>(0xFu << (4 * j)); }

// micro_kernel for int4 panels: x holds the pre-scaled activations (prescale_q4; the AVX-512 form
// below at one row takes them as they are), sx each row's
// 8 * (sum of its x under nibbles 0-6) per group (row stride ldsx), w the block's first 8-k word
// block ([kc / 8, 16] words), s its first group's 16 bf16 scales ([kc / G4, 16]); kc is a multiple
// of G4. The running sums live in acc between groups, so only the group's U x R accumulator pairs
// stay in registers (U sets take alternate k to keep enough FMA chains in flight: at one row, four
// sets, since two left the AVX-512 form bound by the FMA latency rather than its ports).
template <int R>
static inline void micro_kernel_q4(const float* x, int64_t ldx, const float* sx, int64_t ldsx, const uint8_t* w,
                                   const uint16_t* s, int64_t kc, float* acc, bool first, bool last, float* y,
                                   int64_t ldy, int64_t ncols, const float* bias, const float* res) {
  constexpr int U = R == 1 ? 4 : R <= 3 ? 2 : 1;
  for (int64_t g = 0; g < kc; g += G4) {
    __m256 t0[U][R], t1[U][R];
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < R; ++r) t0[u][r] = t1[u][r] = _mm256_setzero_ps();
    for (int64_t k = g; k < g + G4; k += 8) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k * 8) + PF_BYTES, _MM_HINT_T0);
      const __m256i d0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 8));
      const __m256i d1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 8 + 32));
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256i m = _mm256_set1_epi32(nibble_mask(j));
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(d0, m));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_and_si256(d1, m));
        const int u = j % U;
        for (int r = 0; r < R; ++r) {
          const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k + j);
          t0[u][r] = _mm256_fmadd_ps(xb, w0, t0[u][r]);
          t1[u][r] = _mm256_fmadd_ps(xb, w1, t1[u][r]);
        }
      }
    }
    __m256 s0, s1;
    load_w(s + (g / G4) * NR, s0, s1);
    const bool fresh = first && g == 0;
    for (int r = 0; r < R; ++r) {
      for (int u = 1; u < U; ++u) {
        t0[0][r] = _mm256_add_ps(t0[0][r], t0[u][r]);
        t1[0][r] = _mm256_add_ps(t1[0][r], t1[u][r]);
      }
      const __m256 c = _mm256_broadcast_ss(sx + r * ldsx + g / G4);
      const __m256 b0 = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * NR);
      const __m256 b1 = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * NR + 8);
      _mm256_storeu_ps(acc + r * NR, _mm256_fmadd_ps(_mm256_sub_ps(t0[0][r], c), s0, b0));
      _mm256_storeu_ps(acc + r * NR + 8, _mm256_fmadd_ps(_mm256_sub_ps(t1[0][r], c), s1, b1));
    }
  }
  if (last) store_rows(R, acc, y, ldy, ncols, nullptr, bias, res);
}

inline void row_block_q4(int64_t r, const float* x, int64_t K, const float* sx, int64_t ldsx, const uint8_t* w,
                         const uint16_t* s, int64_t kc, float* acc, bool first, bool last, float* y, int64_t N,
                         int64_t ncols, const float* bias, const float* res) {
  switch (r) {
    case 6: return micro_kernel_q4<6>(x, K, sx, ldsx, w, s, kc, acc, first, last, y, N, ncols, bias, res);
    case 5: return micro_kernel_q4<5>(x, K, sx, ldsx, w, s, kc, acc, first, last, y, N, ncols, bias, res);
    case 4: return micro_kernel_q4<4>(x, K, sx, ldsx, w, s, kc, acc, first, last, y, N, ncols, bias, res);
    case 3: return micro_kernel_q4<3>(x, K, sx, ldsx, w, s, kc, acc, first, last, y, N, ncols, bias, res);
    case 2: return micro_kernel_q4<2>(x, K, sx, ldsx, w, s, kc, acc, first, last, y, N, ncols, bias, res);
    default: return micro_kernel_q4<1>(x, K, sx, ldsx, w, s, kc, acc, first, last, y, N, ncols, bias, res);
  }
}

// AVX-512 forms of the micro-kernels (AVX-512 F/BW/VL/DQ, chosen at run time by set_isa; the
// file is built for AVX2 + FMA and only these functions use the wider instructions): a panel
// row of 16 outputs is one register, so each weight row takes half the loads, widenings and
// FMAs of the AVX2 form. Decode with int8/int4/bf16 weights is bound by those instructions,
// not by memory, on the 2-core slices measured here.
#define SD_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
bool g_avx512 = false;

SD_AVX512 static inline __m512 load_w16(const float* w) { return _mm512_loadu_ps(w); }
SD_AVX512 static inline __m512 load_w16(const uint16_t* w) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))), 16));
}
SD_AVX512 static inline __m512 load_w16(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}

template <int R>
SD_AVX512 static inline void finish512(__m512* a, float* acc, bool last, float* y, int64_t ldy, int64_t ncols,
                                       const float* scale, const float* bias, const float* res) {
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * NR, a[r]);
  if (last) store_rows(R, acc, y, ldy, ncols, scale, bias, res);
}

// U independent accumulator sets so that R * U >= 8 FMA chains are in flight.
template <int R, typename W>
SD_AVX512 static inline void micro_kernel512(const float* x, int64_t ldx, const W* w, int64_t kc, float* acc,
                                             bool first, bool last, float* y, int64_t ldy, int64_t ncols,
                                             const float* scale, const float* bias, const float* res) {
  constexpr int U = R >= 4 ? 2 : R == 3 ? 3 : 8 / R;
  __m512 a[U][R];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) a[u][r] = (first || u > 0) ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + r * NR);
  int64_t k = 0;
  for (; k + U <= kc; k += U)
    for (int u = 0; u < U; ++u) {
      if constexpr (std::is_same<W, float>::value) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (k + u) * NR) + PF_F32_BYTES, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w + (k + u) * NR) + PF_F32_FAR_BYTES, _MM_HINT_T1);
      } else {
        _mm_prefetch(reinterpret_cast<const char*>(w + (k + u) * NR) + PF_BYTES, _MM_HINT_T0);
        if ((k + u) * NR * sizeof(W) % 64 == 0)
          _mm_prefetch(reinterpret_cast<const char*>(w + (k + u) * NR) + PF_FAR_BYTES, _MM_HINT_T1);
      }
      const __m512 wv = load_w16(w + (k + u) * NR);
      for (int r = 0; r < R; ++r) a[u][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k + u]), wv, a[u][r]);
    }
  for (; k < kc; ++k) {
    const __m512 wv = load_w16(w + k * NR);
    for (int r = 0; r < R; ++r) a[0][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), wv, a[0][r]);
  }
  for (int u = 1; u < U; ++u)
    for (int r = 0; r < R; ++r) a[0][r] = _mm512_add_ps(a[0][r], a[u][r]);
  finish512<R>(a[0], acc, last, y, ldy, ncols, scale, bias, res);
}

template <typename W>
SD_AVX512 void row_block512(int64_t r, const float* x, int64_t K, const W* w, int64_t kc, float* acc, bool first,
                            bool last, float* y, int64_t N, int64_t ncols, const float* scale, const float* bias,
                            const float* res) {
  switch (r) {
    case 6: return micro_kernel512<6>(x, K, w, kc, acc, first, last, y, N, ncols, scale, bias, res);
    case 5: return micro_kernel512<5>(x, K, w, kc, acc, first, last, y, N, ncols, scale, bias, res);
    case 4: return micro_kernel512<4>(x, K, w, kc, acc, first, last, y, N, ncols, scale, bias, res);
    case 3: return micro_kernel512<3>(x, K, w, kc, acc, first, last, y, N, ncols, scale, bias, res);
    case 2: return micro_kernel512<2>(x, K, w, kc, acc, first, last, y, N, ncols, scale, bias, res);
    default: return micro_kernel512<1>(x, K, w, kc, acc, first, last, y, N, ncols, scale, bias, res);
  }
}

// int4 (layout above): one register per 8-k word block. A nibble's weight comes from a table
// lookup instead of the AVX2 form's AND and conversion: vpermps reads only the low 4 bits of each
// index, so the word shifted right by 4 j picks nibble j's value out of a register of 0 .. 15
// (nibble 7: of its two's complement values), and the FMA takes the activation as it is. Seven
// shifts and eight lookups per word (one on the port that takes no FMA) against eight ANDs and
// eight conversions. At one row, where that decode is most of the work, decode steps on an Intel
// Xeon ran 1.01-1.06x faster at 1x, 3x and 5x, unchanged controls 0.98-0.99x
// (benchmarks/results/xeon-amx/kernel-ab-int4-lookup.json). From 2 rows the FMAs are a larger share
// and runs disagreed: at 2 rows 1.03-1.07x in one and 0.97-0.98x in another, at 3 rows 0.96-0.98x
// (xeon-amx/kernel-ab-int4-lookup-every-row*.json, -two-rows*.json), so from 2 rows the AND and the
// conversion stay, on pre-scaled activations. x q is the same product as the AVX2 form's
// (x 16^-j)(q 16^j), the powers of two exact (for |x| of at least 2^-98, where x 16^-7 stays a
// normal float), so the FMAs add the same terms in the same order per column: both forms give
// identical sums.
// With R2 > 0 a second block of R2 rows (rows R .. R + R2 - 1 of x, sx, acc and y) takes each
// decoded weight too: one decode for two of the AVX2 form's row blocks, each row summed exactly as
// its own block's kernel sums it (its own U sets), so the bits do not change.
constexpr int Q4_LOOKUP_ROWS = 1;
// Whether the AVX-512 form takes a block of r rows by lookup (on x as it is) or by conversion (on
// prescale_q4's scaled x): the kernel and the caller that hands it x ask the same question.
constexpr bool q4_lookup(int64_t r) { return r <= Q4_LOOKUP_ROWS; }
constexpr int q4_sets(int R) { return R == 1 ? 4 : R <= 3 ? 2 : 1; }

// One row block's running sums over an int4 group: U sets taking alternate k (enough FMA chains in
// flight at few rows), added in order at the group's end.
template <int R>
struct Q4Sums {
  static constexpr int U = q4_sets(R);
  __m512 t[U][R];
  SD_AVX512 void zero() {
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < R; ++r) t[u][r] = _mm512_setzero_ps();
  }
  // t[j % U][r] += x[r, k] * wv, x at the block's first row and k.
  SD_AVX512 void fma(const float* x, int64_t ldx, int j, __m512 wv) {
    for (int r = 0; r < R; ++r) t[j % U][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx]), wv, t[j % U][r]);
  }
  // The same for two panels' weights, this panel's (w0) and other's (w1), on one broadcast per row.
  SD_AVX512 void fma2(const float* x, int64_t ldx, int j, __m512 w0, __m512 w1, Q4Sums& other) {
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx]);
      t[j % U][r] = _mm512_fmadd_ps(xb, w0, t[j % U][r]);
      other.t[j % U][r] = _mm512_fmadd_ps(xb, w1, other.t[j % U][r]);
    }
  }
  // acc[r] += (sum - the row's nibble correction sx[r]) * the group's scales sc (acc[r] = where fresh).
  SD_AVX512 void finish(const float* sx, int64_t ldsx, __m512 sc, bool fresh, float* acc) {
    for (int r = 0; r < R; ++r) {
      for (int u = 1; u < U; ++u) t[0][r] = _mm512_add_ps(t[0][r], t[u][r]);
      const __m512 base = fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + r * NR);
      const __m512 c = _mm512_set1_ps(sx[r * ldsx]);
      _mm512_storeu_ps(acc + r * NR, _mm512_fmadd_ps(_mm512_sub_ps(t[0][r], c), sc, base));
    }
  }
};

// With P = 2 the kernel runs two panels (the second at w + ldw bytes, s + lds scales, acc + lda
// and y + NR, its ncols2 columns): each row's activation is broadcast once for both panels' FMAs,
// and twice the FMA chains are in flight. From 2 rows, where the conversion form runs, one panel's
// chains (a row block's R x U sets) are about as many as two FMA units of 4-cycle latency need,
// so the units waited on them. Each output keeps its own chain, in the same order: the same bits.
// On an AMD EPYC (Zen 5), decode steps ran 1.07x faster at 2 rows, 1.10x at 4, 1.15x at 6 and
// 1.07-1.10x at 8 (benchmarks/results/epyc/kernel-ab-int4-two-panels.json and -rerun.json; 8 rows
// at 3x 1.07x in the rerun, 0.92x in the first run, whose unchanged controls ran 1.00x and 1.02x).
// The nibble masks of a pair are one register shifted along (an empty asm keeps GCC from folding
// them back into eight constants): against eight constants, 1.05x at 8 rows, 1.04x at 6, 0.99x at
// 4 (-mask-shift.json).
// Two panels at once for 2 .. Q4_PAIR_ROWS rows: from 9 rows the two panels' sums (22-24 registers)
// left too few for the rest and spilled, and decode steps at 12 rows ran 0.82x as fast
// (kernel-ab-int4-two-panels-to-12-rows.json).
constexpr int64_t Q4_PAIR_ROWS = 8;
constexpr bool q4_pair(int64_t r) { return !q4_lookup(r) && r <= Q4_PAIR_ROWS; }
template <int R, int R2 = 0, int P = 1>
SD_AVX512 static inline void micro_kernel_q4_512(const float* x, int64_t ldx, const float* sx, int64_t ldsx,
                                                 const uint8_t* w, const uint16_t* s, int64_t kc, float* acc,
                                                 bool first, bool last, float* y, int64_t ldy, int64_t ncols,
                                                 const float* bias, const float* res, int64_t ldw = 0,
                                                 int64_t lds = 0, int64_t lda = 0, int64_t ncols2 = 0) {
  constexpr bool LOOKUP = q4_lookup(R + R2);
  static_assert(P == 1 || q4_pair(R + R2), "two panels at once only where q4_pair says");
  // the values of a nibble: q (nibbles 0-6), v in two's complement (nibble 7)
  const __m512 tq = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
               t7 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  for (int64_t g = 0; g < kc; g += G4) {
    Q4Sums<R> a[P];
    Q4Sums<(R2 > 0 ? R2 : 1)> b[P];  // the second block's (used only with R2 > 0)
    for (int q = 0; q < P; ++q) {
      a[q].zero();
      if constexpr (R2 > 0) b[q].zero();
    }
    for (int64_t k = g; k < g + G4; k += 8) {
      __m512i d[P];
      for (int q = 0; q < P; ++q) {
        const uint8_t* wq = w + q * ldw + k * 8;
        _mm_prefetch(reinterpret_cast<const char*>(wq) + PF_BYTES, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wq) + PF_FAR_BYTES, _MM_HINT_T1);
        d[q] = _mm512_loadu_si512(reinterpret_cast<const void*>(wq));
      }
      __m512i mask = _mm512_set1_epi32(nibble_mask(0));
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        if constexpr (P == 2) {
          if (j > 0) mask = _mm512_slli_epi32(mask, 4);
          asm("" : "+v"(mask));
        }
        __m512 wv[P];
        const __m512i m = P == 2 ? mask : _mm512_set1_epi32(nibble_mask(j));
        for (int q = 0; q < P; ++q)
          wv[q] = LOOKUP ? _mm512_permutexvar_ps(j == 0 ? d[q] : _mm512_srli_epi32(d[q], 4 * j), j == 7 ? t7 : tq)
                         : _mm512_cvtepi32_ps(_mm512_and_si512(d[q], m));
        if constexpr (P == 1) {
          a[0].fma(x + k + j, ldx, j, wv[0]);
          if constexpr (R2 > 0) b[0].fma(x + R * ldx + k + j, ldx, j, wv[0]);
        } else {
          a[0].fma2(x + k + j, ldx, j, wv[0], wv[1], a[1]);
          if constexpr (R2 > 0) b[0].fma2(x + R * ldx + k + j, ldx, j, wv[0], wv[1], b[1]);
        }
      }
    }
    const bool fresh = first && g == 0;
    for (int q = 0; q < P; ++q) {
      const __m512 sc = load_w16(s + q * lds + (g / G4) * NR);
      a[q].finish(sx + g / G4, ldsx, sc, fresh, acc + q * lda);
      if constexpr (R2 > 0) b[q].finish(sx + R * ldsx + g / G4, ldsx, sc, fresh, acc + q * lda + R * NR);
    }
  }
  if (last) {
    store_rows(R + R2, acc, y, ldy, ncols, nullptr, bias, res);
    if constexpr (P == 2)
      store_rows(R + R2, acc + lda, y + NR, ldy, ncols2, nullptr, bias ? bias + NR : nullptr, res ? res + NR : nullptr);
  }
}

// r <= 2 * MR rows: one block of r, or (from MR + 1 rows) the AVX2 form's two blocks, MR and r - MR,
// on one decode. np 2 (where q4_pair(r)): two panels at once (the extra arguments as the kernel's).
SD_AVX512 void row_block_q4_512(int64_t r, const float* x, int64_t K, const float* sx, int64_t ldsx,
                                const uint8_t* w, const uint16_t* s, int64_t kc, float* acc, bool first, bool last,
                                float* y, int64_t N, int64_t ncols, const float* bias, const float* res,
                                int64_t np = 1, int64_t ldw = 0, int64_t lds = 0, int64_t lda = 0,
                                int64_t ncols2 = 0) {
  static_assert(MR == 6, "row_block_q4_512 has kernels for 1-6 rows and 6 + 1-6 rows");
  if (np == 2 && q4_pair(r)) {
    switch (r) {
#define SD_Q4_CASE2(n, a, b) \
      case n: return micro_kernel_q4_512<a, b, 2>(x, K, sx, ldsx, w, s, kc, acc, first, last, y, N, ncols, bias, res, \
                                                  ldw, lds, lda, ncols2);
      SD_Q4_CASE2(8, 6, 2) SD_Q4_CASE2(7, 6, 1) SD_Q4_CASE2(6, 6, 0) SD_Q4_CASE2(5, 5, 0) SD_Q4_CASE2(4, 4, 0)
      SD_Q4_CASE2(3, 3, 0)
      default: return micro_kernel_q4_512<2, 0, 2>(x, K, sx, ldsx, w, s, kc, acc, first, last, y, N, ncols, bias, res,
                                                     ldw, lds, lda, ncols2);
#undef SD_Q4_CASE2
    }
  }
  switch (r) {
#define SD_Q4_CASE(n, ...) \
    case n: return micro_kernel_q4_512<__VA_ARGS__>(x, K, sx, ldsx, w, s, kc, acc, first, last, y, N, ncols, bias, res);
    SD_Q4_CASE(12, 6, 6) SD_Q4_CASE(11, 6, 5) SD_Q4_CASE(10, 6, 4) SD_Q4_CASE(9, 6, 3) SD_Q4_CASE(8, 6, 2)
    SD_Q4_CASE(7, 6, 1) SD_Q4_CASE(6, 6) SD_Q4_CASE(5, 5) SD_Q4_CASE(4, 4) SD_Q4_CASE(3, 3) SD_Q4_CASE(2, 2)
#undef SD_Q4_CASE
    default: return micro_kernel_q4_512<1>(x, K, sx, ldsx, w, s, kc, acc, first, last, y, N, ncols, bias, res);
  }
}

// ---- Several rows (batched decode, a lossless verification): compute-bound panels.
// At one row a step streams every weight once and the narrow micro-kernels above keep up with
// memory. With more rows the multiply-adds dominate, and widening int8/int4/bf16 weights
// inside each row block repeats that work for every block of rows. Here each K block of a group of
// panels is widened once into an fp32 buffer that stays in L1 (fp32 panels are read in place), and
// every row block runs on it: up to 6 rows x 4 panels = 24 accumulators, 10 loads per 24 FMAs.
// Each output is one FMA chain over k in order, whatever the rows around it, the row blocking or
// the ISA: the AVX2 and AVX-512 forms give bitwise identical outputs, and a row's outputs do not
// depend on how many rows share the call (from WIDE_MIN_* rows on).
// From how many rows the wide form runs, per panel dtype (tests/test_kernels.py covers both sides):
// fp32 panels are read in place, so from 2; int8 and bf16 from three row blocks. int4 from 17: its
// narrow form (a mask and a conversion per weight and row block, no decoded copy) was faster up
// to 16 rows with weights streamed from memory on an AMD EPYC (Zen 5), a decode step at 8 rows
// 1.19x (benchmarks/results/kernel-ab-int4-wide-from-17.json), and slower from 20.
constexpr int64_t WIDE_MIN_F32 = 2, WIDE_MIN_INT4 = 17, WIDE_MIN_INT8 = 13;
constexpr int64_t WP = 4;    // panels per group
constexpr int64_t KW = 128;  // K block of widened panels: WP x KW x 16 floats (32 KB) stay in L1
// Rows per block of the wide form (linear_wide says why the AVX2 form takes fewer).
constexpr int64_t WIDE_ROWS_AVX512 = 6, WIDE_ROWS_AVX2 = 4;

// One K block of one panel widened to fp32 ([kc, 16], row k at out + k * NR): exact for bf16
// (a shift), int8 (a conversion; the column scale multiplies the finished sum) and int4 (v times its
// group's bf16 scale: a 4-bit integer times an 8-bit mantissa fits fp32's 24). w and s point at the
// block's first weight and (int4) first group's scales, as in the narrow kernels.
static inline void widen_block(const uint16_t* w, const uint16_t*, int64_t kc, float* out) {
  for (int64_t k = 0; k < kc; ++k) {
    // one 64-byte line per 2 k, PF_BYTES ahead, as the int8 and int4 forms ask for theirs
    if (k % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k * NR) + PF_BYTES, _MM_HINT_T0);
    __m256 w0, w1;
    load_w(w + k * NR, w0, w1);
    _mm256_storeu_ps(out + k * NR, w0);
    _mm256_storeu_ps(out + k * NR + 8, w1);
  }
}
static inline void widen_block(const int8_t* w, const uint16_t*, int64_t kc, float* out) {
  for (int64_t k = 0; k < kc; ++k) {
    if (k % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k * NR) + PF_BYTES, _MM_HINT_T0);
    __m256 w0, w1;
    load_w(w + k * NR, w0, w1);
    _mm256_storeu_ps(out + k * NR, w0);
    _mm256_storeu_ps(out + k * NR + 8, w1);
  }
}
static inline void widen_block(const uint8_t* w, const uint16_t* s, int64_t kc, float* out) {
  const __m256i low = _mm256_set1_epi32(0xF), eight = _mm256_set1_epi32(8);
  for (int64_t k = 0; k < kc; k += 8) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k * 8) + PF_BYTES, _MM_HINT_T0);
    __m256 s0, s1;
    load_w(s + (k / G4) * NR, s0, s1);
    const __m256i d0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 8));
    const __m256i d1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 8 + 32));
    for (int j = 0; j < 8; ++j) {  // nibbles 0-6 hold v + 8, nibble 7 holds v in two's complement
      const __m256i v0 = j < 7 ? _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(d0, 4 * j), low), eight)
                               : _mm256_srai_epi32(d0, 28);
      const __m256i v1 = j < 7 ? _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(d1, 4 * j), low), eight)
                               : _mm256_srai_epi32(d1, 28);
      _mm256_storeu_ps(out + (k + j) * NR, _mm256_mul_ps(_mm256_cvtepi32_ps(v0), s0));
      _mm256_storeu_ps(out + (k + j) * NR + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(v1), s1));
    }
  }
}

// The same with AVX-512 (one register per panel row): identical values.
SD_AVX512 static inline void widen_block512(const uint16_t* w, const uint16_t*, int64_t kc, float* out) {
  for (int64_t k = 0; k < kc; ++k) {
    if (k % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k * NR) + PF_BYTES, _MM_HINT_T0);
    _mm512_storeu_ps(out + k * NR, load_w16(w + k * NR));
  }
}
SD_AVX512 static inline void widen_block512(const int8_t* w, const uint16_t*, int64_t kc, float* out) {
  int64_t k = 0;
  for (; k + 4 <= kc; k += 4) {  // one 64-byte line per 4 k
    _mm_prefetch(reinterpret_cast<const char*>(w + k * NR) + PF_BYTES, _MM_HINT_T0);
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(out + (k + i) * NR, load_w16(w + (k + i) * NR));
  }
  for (; k < kc; ++k) _mm512_storeu_ps(out + k * NR, load_w16(w + k * NR));
}
SD_AVX512 static inline void widen_block512(const uint8_t* w, const uint16_t* s, int64_t kc, float* out) {
  const __m512i low = _mm512_set1_epi32(0xF), eight = _mm512_set1_epi32(8);
  for (int64_t k = 0; k < kc; k += 8) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k * 8) + PF_BYTES, _MM_HINT_T0);
    const __m512 sc = load_w16(s + (k / G4) * NR);
    const __m512i d = _mm512_loadu_si512(reinterpret_cast<const void*>(w + k * 8));
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512i v = j < 7 ? _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(d, 4 * j), low), eight)
                              : _mm512_srai_epi32(d, 28);
      _mm512_storeu_ps(out + (k + j) * NR, _mm512_mul_ps(_mm512_cvtepi32_ps(v), sc));
    }
  }
}

// R rows x one panel of fp32 weights (AVX2): acc [R, NR] running sums, one chain per output.
template <int R>
static inline void wide_kernel(const float* x, int64_t ldx, const float* w, int64_t kc, float* acc, bool first) {
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) {
    a0[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * NR);
    a1[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * NR + 8);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * NR), w1 = _mm256_loadu_ps(w + k * NR + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
      a0[r] = _mm256_fmadd_ps(xb, w0, a0[r]);
      a1[r] = _mm256_fmadd_ps(xb, w1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc + r * NR, a0[r]);
    _mm256_storeu_ps(acc + r * NR + 8, a1[r]);
  }
}

// R rows x P panels (AVX-512): w panel j at w + j * ldw, acc panel j at acc + j * lda.
template <int R, int P>
SD_AVX512 static inline void wide_kernel512(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t kc,
                                            float* acc, int64_t lda, bool first) {
  __m512 a[R][P];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j) a[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + j * lda + r * NR);
  for (int64_t k = 0; k < kc; ++k) {
    __m512 wv[P];
    for (int j = 0; j < P; ++j) wv[j] = _mm512_loadu_ps(w + j * ldw + k * NR);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      for (int j = 0; j < P; ++j) a[r][j] = _mm512_fmadd_ps(xb, wv[j], a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j) _mm512_storeu_ps(acc + j * lda + r * NR, a[r][j]);
}

template <int P>
SD_AVX512 void wide_rows512(int64_t r, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t kc,
                            float* acc, int64_t lda, bool first) {
  switch (r) {
    case 6: return wide_kernel512<6, P>(x, ldx, w, ldw, kc, acc, lda, first);
    case 5: return wide_kernel512<5, P>(x, ldx, w, ldw, kc, acc, lda, first);
    case 4: return wide_kernel512<4, P>(x, ldx, w, ldw, kc, acc, lda, first);
    case 3: return wide_kernel512<3, P>(x, ldx, w, ldw, kc, acc, lda, first);
    case 2: return wide_kernel512<2, P>(x, ldx, w, ldw, kc, acc, lda, first);
    default: return wide_kernel512<1, P>(x, ldx, w, ldw, kc, acc, lda, first);
  }
}

// r rows (1-WIDE_ROWS_* of the form) x np panels (1-WP) of one K block, in whichever form set_isa chose.
void wide_block(int64_t r, int64_t np, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t kc,
                float* acc, int64_t lda, bool first) {
  if (g_avx512) {
    switch (np) {
      case 4: return wide_rows512<4>(r, x, ldx, w, ldw, kc, acc, lda, first);
      case 3: return wide_rows512<3>(r, x, ldx, w, ldw, kc, acc, lda, first);
      case 2: return wide_rows512<2>(r, x, ldx, w, ldw, kc, acc, lda, first);
      default: return wide_rows512<1>(r, x, ldx, w, ldw, kc, acc, lda, first);
    }
  }
  for (int64_t j = 0; j < np; ++j) {
    const float* wj = w + j * ldw;
    float* aj = acc + j * lda;
    switch (r) {
      case 4: wide_kernel<4>(x, ldx, wj, kc, aj, first); break;
      case 3: wide_kernel<3>(x, ldx, wj, kc, aj, first); break;
      case 2: wide_kernel<2>(x, ldx, wj, kc, aj, first); break;
      default: wide_kernel<1>(x, ldx, wj, kc, aj, first); break;
    }
  }
}

// exp for 8 floats (Cephes' expf: x = n ln2 + r, degree-5 polynomial in r;
// relative error ~1e-7). Inputs below ln(2^-126) (and -inf) give exactly 0.
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.0f), lo = _mm256_set1_ps(-87.33654475f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(n)), keep);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "skipdecode kernel: ", what); }

}  // namespace

// Indices 0 .. n - 1 shared among torch's threads: each thread runs worker(next) once, and
// next(b, e) hands it a range [b, e) until none is left (false). Each thread starts on its own
// contiguous share, taken `chunk` at a time from the front; a thread that has run out takes the
// back half of what another has left, which becomes its own share, taken from the same way
// (chunk 0: each share whole, nothing taken from another: a fixed split as parallel_for's). Why:
// threads run at different rates from one step to the next (memory and cores shared with other
// machines), and with fixed shares the faster waited for the slower (a profile of a batch-1 int8
// step found both threads spending much of it in libgomp's barrier). Whole indices go to one
// thread as before (an output is summed by one thread), so no output changes. In panel_loop, for
// the fp32-activation panels: int8 decode steps at batch 1 1.10x faster on an Intel Xeon, bf16
// 1.04x, fp32 even (benchmarks/results/kernel-ab-steal-panels.json). Every other GEMM form then
// took its panels (or pairs, or groups of them) the same way: the fp32 stream form 1.03x faster at
// 8 rows, 1.02x at 32 and 1.04x at 8 rows and 5x (xeon-amx/kernel-ab-steal-stream.json); then the
// int4 panels, the int8-activation panels, tiles and AMX, the wide form and the fp32 AMX tiles:
// int4 1.11x at batch 1 and 1.05x at 8 rows, w8a8 1.11x / 1.08x / 1.04x at 1 / 8 / 32 rows, w4a8
// 1.14x at batch 1, int8 1.04x at 32 rows, fp32 1.05x at 32 rows (xeon-amx/kernel-ab-steal-all.json).
struct alignas(64) StealRange {
  std::atomic<uint64_t> r;  // begin | end << 32
};
template <typename Worker>
void parallel_steal(int64_t n, int64_t chunk, const Worker& worker) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    bool given = n <= 0;
    worker([&](int64_t& b, int64_t& e) {
      if (given) return false;
      b = 0, e = n, given = true;
      return true;
    });
    return;
  }
  const auto pack = [](uint64_t b, uint64_t e) { return b | e << 32; };
  const auto begin = [](uint64_t r) { return r & 0xffffffffu; };
  const auto end = [](uint64_t r) { return r >> 32; };
  const auto left = [&](uint64_t r) { return end(r) > begin(r) ? end(r) - begin(r) : 0; };
  std::vector<StealRange> ranges(threads);
  for (int64_t t = 0; t < threads; ++t) ranges[t].r.store(pack(n * t / threads, n * (t + 1) / threads));
  const bool steal = chunk > 0;
  if (!steal) chunk = n;
  // One share per thread of the team; a smaller team than asked for runs some shares in turn.
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) worker([&](int64_t& b, int64_t& e) {
      for (;;) {
        uint64_t r = ranges[t].r.load(std::memory_order_acquire);
        while (left(r) > 0) {  // the own share, from the front
          const uint64_t m = std::min<uint64_t>(end(r), begin(r) + chunk);
          if (ranges[t].r.compare_exchange_weak(r, pack(m, end(r)), std::memory_order_acq_rel)) {
            b = static_cast<int64_t>(begin(r)), e = static_cast<int64_t>(m);
            return true;
          }
        }
        if (!steal) return false;
        int64_t v = -1;  // the thread with the most left
        uint64_t x = 0;
        for (int64_t u = 0; u < threads; ++u) {
          const uint64_t y = ranges[u].r.load(std::memory_order_acquire);
          if (u != t && left(y) > left(x)) v = u, x = y;
        }
        if (v < 0) return false;
        const uint64_t mid = end(x) - (left(x) + 1) / 2;
        if (ranges[v].r.compare_exchange_strong(x, pack(begin(x), mid), std::memory_order_acq_rel))
          ranges[t].r.store(pack(mid, end(x)), std::memory_order_release);
      }
    });
  });
}

// The loop every panel GEMM shares: panels split across threads, K in blocks of KC (a weight
// block stays in L1 while every row block uses it), rows in blocks of mr. body(p, k0, kc, m, r, acc)
// runs rows m..m+r of panel p over k0..k0+kc, with acc the running sums of those rows. A thread
// takes its share two panels at a time and one that runs out takes from another's (parallel_steal).
// With P > 1 a body call takes up to P consecutive panels of a share (fewer at its end):
// body(p, np, k0, kc, m, r, acc, lda), panel p + j's sums at acc + j * lda.
template <int P = 1, typename Body>
void panel_loop(int64_t M, int64_t K, int64_t NP, int64_t mr, const Body& body) {
  const int64_t lda = ((M + mr - 1) / mr) * mr * NR;
  parallel_steal(NP, 2, [&](const auto& next) {
    std::vector<float> acc(P * lda);
    for (int64_t p0, p1; next(p0, p1);)
      for (int64_t p = p0; p < p1; p += P) {
        const int64_t np = std::min<int64_t>(P, p1 - p);
        for (int64_t k0 = 0; k0 < K; k0 += KC)
          for (int64_t m = 0; m < M; m += mr) {
            const int64_t kc = std::min(KC, K - k0), r = std::min(mr, M - m);
            if constexpr (P == 1)
              body(p, k0, kc, m, r, acc.data() + m * NR);
            else
              body(p, np, k0, kc, m, r, acc.data() + m * NR, lda);
          }
      }
  });
}

// Rows 0 .. M - 1 in nrb blocks as even as they can be (the larger ones last): body(m, r) per block.
template <typename Body>
inline void even_row_blocks(int64_t M, int64_t nrb, const Body& body) {
  for (int64_t b = 0, m = 0; b < nrb; ++b) {
    const int64_t r = (M - m) / (nrb - b);
    body(m, r);
    m += r;
  }
}

// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) (+ res), W packed by skipdecode.kernels.pack_weight
// as [ceil(N / 16), K, 16] (zero padded). x and y are row-major and must not
// overlap; res may be y itself (an in-place residual add: each element is read
// once, just before it is written).
template <typename W>
void linear_panels(const float* xa, int64_t M, const W* wa, int64_t K, int64_t NP, const float* sa, const float* ba,
                   int64_t n, float* ya, const float* res) {
  panel_loop(M, K, NP, MR, [&](int64_t p, int64_t k0, int64_t kc, int64_t m, int64_t r, float* acc) {
    const int64_t ncols = std::min(NR, n - p * NR);
    const float* bp = ba ? ba + p * NR : nullptr;
    const float* sp = sa ? sa + p * NR : nullptr;
    const bool first = k0 == 0, last = k0 + kc == K;
    const W* w = wa + (p * K + k0) * NR;
    if (g_avx512)
      row_block512(r, xa + m * K + k0, K, w, kc, acc, first, last, ya + m * n + p * NR, n, ncols, sp, bp,
                   res ? res + m * n + p * NR : nullptr);
    else
      row_block(r, xa + m * K + k0, K, w, kc, acc, first, last, ya + m * n + p * NR, n, ncols, sp, bp,
                res ? res + m * n + p * NR : nullptr);
  });
}

// The activations of int4 panels, pre-scaled (layout above; scaled: the AVX2 form's): x *
// 16^-(k mod 8), and per group of G4 the 8 * sum of the x under nibbles 0-6 ([M, K / G4]).
void prescale_q4(const float* x, int64_t M, int64_t K, std::vector<float>& xp, std::vector<float>& sx,
                 bool scaled = true) {
  static const float f[8] = {1.f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 0x1p-28f};
  if (scaled) xp.resize(M * K);
  sx.resize(M * (K / G4));
  for (int64_t i = 0; i < M * K; i += G4) {
    float sum = 0.f;
    for (int64_t j = 0; j < G4; ++j) {
      if (scaled) xp[i + j] = x[i + j] * f[j % 8];
      if (j % 8 != 7) sum += x[i + j];
    }
    sx[i / G4] = 8.f * sum;
  }
}

// The same over int4 panels ([NP, K / 2, 16] bytes) with their group scales ([NP, K / G4, 16] bf16).
// The AVX-512 form takes rows 2 * MR at a time, two of the AVX2 form's row blocks on one decode of
// the weights (row_block_q4_512): the same blocks, the same sums, fewer decodes from 7 rows. On an
// Intel Xeon (AMX) decode steps ran 1.09x faster at 8 rows, 1.03x at 12, 1.05x at 16 and 1.06x at
// 8 rows and 3x (benchmarks/results/kernel-ab-int4-two-blocks.json).
void linear_panels_q4(const float* xa, int64_t M, const uint8_t* wa, int64_t K, int64_t NP, const uint16_t* sa,
                      const float* ba, int64_t n, float* ya, const float* res) {
  std::vector<float> xp, sx;
  // x scaled unless every row block takes the lookup (M itself within q4_lookup)
  prescale_q4(xa, M, K, xp, sx, !g_avx512 || !q4_lookup(M));
  const int64_t ng = K / G4;
  // rows m .. m + r of panels p .. p + np - 1 over k0 .. k0 + kc (acc: the first panel's sums, lda apart)
  const auto block = [&](int64_t p, int64_t np, int64_t k0, int64_t kc, int64_t m, int64_t r, float* acc,
                         int64_t lda) {
    const int64_t ncols = std::min(NR, n - p * NR);
    const float* bp = ba ? ba + p * NR : nullptr;
    const bool first = k0 == 0, last = k0 + kc == K;
    const uint8_t* w = wa + (p * K + k0) * (NR / 2);  // [NP, K / 2, 16] bytes
    const uint16_t* s = sa + (p * ng + k0 / G4) * NR;
    const float* xr = (g_avx512 && q4_lookup(r) ? xa : xp.data()) + m * K + k0;
    const float* sr = sx.data() + m * ng + k0 / G4;
    float* yr = ya + m * n + p * NR;
    const float* rr = res ? res + m * n + p * NR : nullptr;
    if (g_avx512)
      row_block_q4_512(r, xr, K, sr, ng, w, s, kc, acc, first, last, yr, n, ncols, bp, rr, np, K * (NR / 2), ng * NR,
                       lda, np == 2 ? std::min(NR, n - (p + 1) * NR) : 0);
    else
      row_block_q4(r, xr, K, sr, ng, w, s, kc, acc, first, last, yr, n, ncols, bp, rr);
  };
  if (!g_avx512 || q4_lookup(M)) {
    panel_loop(M, K, NP, g_avx512 ? 2 * MR : MR, [&](int64_t p, int64_t k0, int64_t kc, int64_t m, int64_t r,
                                                         float* acc) { block(p, 1, k0, kc, m, r, acc, 0); });
    return;
  }
  // The AVX-512 form from 2 rows: two panels a body call (a share's odd last alone)
  panel_loop<2>(M, K, NP, 2 * MR, [&](int64_t p, int64_t np, int64_t k0, int64_t kc, int64_t m, int64_t r,
                                      float* acc, int64_t lda) {
    if (np == 2 && !q4_pair(r)) {  // a panel at a time
      block(p, 1, k0, kc, m, r, acc, 0);
      block(p + 1, 1, k0, kc, m, r, acc + lda, 0);
    } else {
      block(p, np, k0, kc, m, r, acc, lda);
    }
  });
}

// y[M, N] = x @ W^T (+ bias) (+ res) for M >= WIDE_MIN_* rows, any panel dtype (wide_block above):
// panels split across threads in groups of WP, each K block of a group widened once (fp32 read in
// place), rows in blocks split evenly: at most 6 in the AVX-512 form, at most 4 in the AVX2 form.
// The AVX2 form's 5- and 6-row kernels (10-12 accumulators of 16 registers) ran well under its
// 4-row kernel's rate: in blocks of 4 a decode step in the AVX2 forms took 1.49x less time with
// int4 weights at 32 rows and 1.40x with bf16 on an AMD EPYC (Zen 5)
// (benchmarks/results/kernel-ab-avx2-wide-rows4.json); the blocking does not change any output.
// sa: int8 column scales; gs: int4 group scales.
template <typename W>
void linear_wide(const float* xa, int64_t M, const W* wa, int64_t K, int64_t NP, const float* sa,
                 const uint16_t* gs, const float* ba, int64_t n, float* ya, const float* res) {
  constexpr bool Q4 = std::is_same<W, uint8_t>::value, F32 = std::is_same<W, float>::value;
  static_assert(WIDE_ROWS_AVX2 == 4, "wide_block's AVX2 form has kernels for 1-4 rows");
  const int64_t rows = g_avx512 ? WIDE_ROWS_AVX512 : WIDE_ROWS_AVX2;
  const int64_t NG = (NP + WP - 1) / WP, nrb = (M + rows - 1) / rows;
  parallel_steal(NG, 1, [&](const auto& next) {
    thread_local std::vector<float> acc, buf;
    acc.resize(WP * M * NR);
    const int64_t kb = F32 ? KC : KW;
    if (!F32) buf.resize(WP * KW * NR);
    for (int64_t g0, g1; next(g0, g1);)
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t p0 = g * WP, np = std::min(WP, NP - p0);
        for (int64_t k0 = 0; k0 < K; k0 += kb) {
          const int64_t kc = std::min(kb, K - k0);
          const float* w;
          int64_t ldw;
          if constexpr (F32) {
            w = wa + (p0 * K + k0) * NR;
            ldw = K * NR;
          } else {
            for (int64_t j = 0; j < np; ++j) {
              const int64_t p = p0 + j;
              const W* wp = Q4 ? wa + (p * K + k0) * (NR / 2) : wa + (p * K + k0) * NR;
              const uint16_t* sp = Q4 ? gs + (p * (K / G4) + k0 / G4) * NR : nullptr;
              if (g_avx512)
                widen_block512(wp, sp, kc, buf.data() + j * KW * NR);
              else
                widen_block(wp, sp, kc, buf.data() + j * KW * NR);
            }
            w = buf.data();
            ldw = KW * NR;
          }
          even_row_blocks(M, nrb, [&](int64_t m, int64_t r) {
            wide_block(r, np, xa + m * K + k0, K, w, ldw, kc, acc.data() + m * NR, M * NR, k0 == 0);
          });
        }
        for (int64_t j = 0; j < np; ++j) {
          const int64_t p = p0 + j;
          store_rows(M, acc.data() + j * M * NR, ya + p * NR, n, std::min(NR, n - p * NR), sa ? sa + p * NR : nullptr,
                     ba ? ba + p * NR : nullptr, res ? res + p * NR : nullptr);
        }
      }
  });
}

// ---- fp32 panels at several rows: one weight stream per thread.
// With fp32 weights a decode step at 8 rows is bound by reading them, and the wide form above
// streamed them at well under the machine's read bandwidth: it reads WP panels at once (four
// streams per thread) and, at 32 rows, re-reads each K block from L1 for five more row blocks
// while nothing is asked of memory. Here each thread reads its panels one after another (one
// stream), every pass asks for a line ahead (so memory stays busy while later passes work from
// L1), and a row's activation is broadcast from a register (first in both forms, now the AVX2
// form's: four k of a pass's rows transposed into one 128-bit load, vpermilps per row) instead of
// a load per row and k: the loads a k takes stay few, so the core keeps more weight lines in flight.
// In a stand-alone loop over default-e2e's gate/up shapes (AMD EPYC Zen 5) this streamed 8 rows at
// about the pure read's time, the wide form well over it. Each output is still one FMA
// chain over k in order: the same bits as the wide form. A decode step of default-e2e at 8 rows
// took 1.21x less time than on the wide form, at 32 rows 1.02x, at 2-4 rows the same
// (benchmarks/results/kernel-ab-fp32-stream.json): from STREAM_MIN_F32 rows, where a pass has
// enough FMA chains (one per row) to keep up with the stream. The AVX2 form takes at most
// STREAM_ROWS_AVX2 rows a pass (8 sums, the two weight halves and the activations fit its 16
// registers; at 6 rows two passes of 3 ran a step 1.10x faster than one of 6, in the A/B below):
// at 4 rows a step ran 1.40x faster than on the wide form
// (kernel-ab-fp32-stream-avx2.json); from 5 rows, in passes of at most 4 rather than on the wide
// form (whose fp32 panels are read in place with no prefetch, four streams a thread: a step at 8
// rows ran its weights at 31% of the AVX2 FMA rate, where int8 and int4 ran at 63-66%), a step at
// 8 rows 1.45x faster and at 16 rows 1.17x (benchmarks/results/kernel-ab-fp32-stream-avx2-passes.json).
// The AVX-512 form runs two panels a pass (a thread's odd last panel alone) in passes of up to
// STREAM_ROWS_AVX512 rows: each k's row activations are broadcast loads, each feeding two FMAs,
// and up to 24 FMA chains are in flight; its prefetch asks for the line PF_BYTES (4 KB) ahead.
// On an Intel Xeon (AMX, 30 GB/s), two panels a pass from 9 rows (passes of up to 8) first ran
// decode steps of default-e2e 1.26x faster at 32 rows, 1.20x at 16, 1.16x at 12 than one panel
// (benchmarks/results/kernel-ab-fp32-stream-two-panels.json; broadcast loads in place of the
// one-panel form's permutes alone did not change its time). Two panels from 4 rows, passes of up
// to 12 and the prefetch 4 KB instead of 16 KB ahead then ran steps 1.15x faster at 4 rows, 1.11x
// at 8, 1.04x at 16, 1.10x at 32 and 1.05x at 32 rows and 3x
// (benchmarks/results/kernel-ab-fp32-stream-rows12.json). A single pass of up to 9 rows then runs
// three panels (27 sums, 3 weights and a broadcast of 32 registers): each broadcast feeds three
// FMAs and a thread streams three panels at once; steps 1.08x faster at 8 rows, 1.15x at 8 rows and
// 3x, 1.14x at 4 rows (benchmarks/results/xeon-amx/kernel-ab-stream-three-panels.json). Up to 6
// rows four panels (24 sums, 4 weights, a broadcast): 1.05x faster than three at 4 rows, 1.07x at 6
// (benchmarks/results/xeon-amx/kernel-ab-stream-four-panels.json).
// Same FMA chains in the same order whatever the passes or panels: the same bits.
constexpr int64_t STREAM_MIN_F32 = 4, STREAM_ROWS_AVX2 = 4, STREAM_ROWS_AVX512 = 12;
constexpr int64_t STREAM_FOUR_ROWS = 6, STREAM_THREE_ROWS = 9;  // most rows of a four- / three-panel pass
static_assert(4 * STREAM_FOUR_ROWS + 4 + 1 <= 32 && 3 * STREAM_THREE_ROWS + 3 + 1 <= 32 &&
              STREAM_THREE_ROWS <= STREAM_ROWS_AVX512, "a pass's sums, weights and broadcast in 32 registers, one pass");
constexpr int64_t STREAM_STEAL = 2;  // panels a thread takes from its share at a time (at least a pass's)
constexpr int64_t PF_STREAM = 16384;  // the AVX2 form's prefetch distance (timed on the AMD EPYC)

// x rows m .. m + r transposed by k with ld (>= r) floats per k: xt[k * ld + i] = x[m + i, k]
// (lanes r..ld-1 zero).
inline void transpose_rows(const float* x, int64_t r, int64_t K, int64_t ld, float* xt) {
  std::fill(xt, xt + K * ld, 0.f);
  for (int64_t i = 0; i < r; ++i)
    for (int64_t k = 0; k < K; ++k) xt[k * ld + i] = x[i * K + k];
}

// R rows (xt: transposed, R floats per k, at the block's first k) x P panels (the second ldw
// floats after the first) over kc k: acc [P][lda / NR rows][NR] running sums, the rows' at acc.
template <int R, int P>
SD_AVX512 static inline void stream_kernel512(const float* xt, const float* w, int64_t ldw, int64_t kc, float* acc,
                                              int64_t lda, bool first) {
  __m512 a[P][R];
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) a[p][r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + p * lda + r * NR);
  for (int64_t k = 0; k < kc; ++k) {
    __m512 wv[P];
    for (int p = 0; p < P; ++p) {
      _mm_prefetch(reinterpret_cast<const char*>(w + p * ldw + k * NR) + PF_BYTES, _MM_HINT_T0);
      wv[p] = _mm512_loadu_ps(w + p * ldw + k * NR);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(xt[k * R + r]);
      for (int p = 0; p < P; ++p) a[p][r] = _mm512_fmadd_ps(xv, wv[p], a[p][r]);
    }
  }
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + p * lda + r * NR, a[p][r]);
}

template <int P>
SD_AVX512 void stream_rows512(int64_t r, const float* xt, const float* w, int64_t ldw, int64_t kc, float* acc,
                              int64_t lda, bool first) {
  static_assert(STREAM_ROWS_AVX512 == 12, "stream_rows512 has kernels for 4-12 rows");
  switch (r) {
    case 12: return stream_kernel512<12, P>(xt, w, ldw, kc, acc, lda, first);
    case 11: return stream_kernel512<11, P>(xt, w, ldw, kc, acc, lda, first);
    case 10: return stream_kernel512<10, P>(xt, w, ldw, kc, acc, lda, first);
    case 9: return stream_kernel512<9, P>(xt, w, ldw, kc, acc, lda, first);
    case 8: return stream_kernel512<8, P>(xt, w, ldw, kc, acc, lda, first);
    case 7: return stream_kernel512<7, P>(xt, w, ldw, kc, acc, lda, first);
    case 6: return stream_kernel512<6, P>(xt, w, ldw, kc, acc, lda, first);
    case 5: return stream_kernel512<5, P>(xt, w, ldw, kc, acc, lda, first);
    default: return stream_kernel512<4, P>(xt, w, ldw, kc, acc, lda, first);
  }
}

// a0[i], a1[i] += (lane i of 4 rows' activations at one k, broadcast) * the two weight halves.
template <int... I>
static inline void stream_lanes(__m256* a0, __m256* a1, __m256 x, __m256 w0, __m256 w1,
                                std::integer_sequence<int, I...>) {
  ((a0[I] = _mm256_fmadd_ps(_mm256_permute_ps(x, I * 0x55), w0, a0[I]),
    a1[I] = _mm256_fmadd_ps(_mm256_permute_ps(x, I * 0x55), w1, a1[I])), ...);
}

// The AVX2 form: a panel row is two registers, so a pass takes at most STREAM_ROWS_AVX2 rows
// (xt: STREAM_ROWS_AVX2 floats per k, one 128-bit load); the same operations per output.
template <int R>
static inline void stream_kernel(const float* xt, const float* w, int64_t kc, float* acc, bool first) {
  static_assert(R >= 1 && R <= STREAM_ROWS_AVX2, "one 128-bit load holds a pass's activations at one k");
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) {
    a0[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * NR);
    a1[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * NR + 8);
  }
  for (int64_t k = 0; k < kc; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k * NR) + PF_STREAM, _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(w + k * NR), w1 = _mm256_loadu_ps(w + k * NR + 8);
    const __m256 x0 = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(xt + k * STREAM_ROWS_AVX2));
    stream_lanes(a0, a1, x0, w0, w1, std::make_integer_sequence<int, R>());
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc + r * NR, a0[r]);
    _mm256_storeu_ps(acc + r * NR + 8, a1[r]);
  }
}

void stream_rows(int64_t r, const float* xt, const float* w, int64_t kc, float* acc, bool first) {
  static_assert(STREAM_ROWS_AVX2 == 4, "stream_rows has AVX2 kernels for 1-4 rows");
  switch (r) {
    case 4: return stream_kernel<4>(xt, w, kc, acc, first);
    case 3: return stream_kernel<3>(xt, w, kc, acc, first);
    case 2: return stream_kernel<2>(xt, w, kc, acc, first);
    default: return stream_kernel<1>(xt, w, kc, acc, first);
  }
}

// y[M, N] = x @ W^T (+ bias) (+ res) on fp32 panels, M >= STREAM_MIN_F32: threads share the
// panels as parallel_steal hands them out (the AVX-512 form runs them four at a time up to
// STREAM_FOUR_ROWS rows, three up to STREAM_THREE_ROWS, in pairs above), K in blocks of KC (a
// block of the panels stays in L1 for every pass), rows in even passes of at most
// STREAM_ROWS_AVX512 or STREAM_ROWS_AVX2, each pass's rows transposed once (xt) so a k's
// activations are adjacent.
void linear_stream_f32(const float* xa, int64_t M, const float* wa, int64_t K, int64_t NP, const float* ba,
                       int64_t n, float* ya, const float* res) {
  const int64_t rows = g_avx512 ? STREAM_ROWS_AVX512 : STREAM_ROWS_AVX2, nrb = (M + rows - 1) / rows;
  const int64_t panels = !g_avx512 ? 1 : M <= STREAM_FOUR_ROWS ? 4 : M <= STREAM_THREE_ROWS ? 3 : 2;
  const auto ld = [&](int64_t r) { return g_avx512 ? r : STREAM_ROWS_AVX2; };  // floats per k of a pass's xt
  std::vector<float> xt(nrb * rows * K);  // pass b's rows at xt + b * rows * K
  int64_t pass = 0;
  even_row_blocks(M, nrb, [&](int64_t m, int64_t r) {
    transpose_rows(xa + m * K, r, K, ld(r), xt.data() + pass++ * rows * K);
  });
  parallel_steal(NP, std::max(panels, STREAM_STEAL), [&](const auto& next) {
    thread_local std::vector<float> acc;
    acc.resize(panels * M * NR);
    for (int64_t p0, p1; next(p0, p1);)
      for (int64_t p = p0, np; p < p1; p += np) {
        np = std::min(panels, p1 - p);
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
          const int64_t kc = std::min(KC, K - k0);
          const float* w = wa + (p * K + k0) * NR;
          int64_t pass = 0;
          even_row_blocks(M, nrb, [&](int64_t m, int64_t r) {
            const float* x = xt.data() + pass++ * rows * K + k0 * ld(r);
            float* a = acc.data() + m * NR;
            if (np == 4)
              stream_rows512<4>(r, x, w, K * NR, kc, a, M * NR, k0 == 0);
            else if (np == 3)
              stream_rows512<3>(r, x, w, K * NR, kc, a, M * NR, k0 == 0);
            else if (np == 2)
              stream_rows512<2>(r, x, w, K * NR, kc, a, M * NR, k0 == 0);
            else if (g_avx512)
              stream_rows512<1>(r, x, w, K * NR, kc, a, M * NR, k0 == 0);
            else
              stream_rows(r, x, w, kc, a, k0 == 0);
          });
        }
        for (int64_t q = 0; q < np; ++q)
          store_rows(M, acc.data() + q * M * NR, ya + (p + q) * NR, n, std::min(NR, n - (p + q) * NR), nullptr,
                     ba ? ba + (p + q) * NR : nullptr, res ? res + (p + q) * NR : nullptr);
      }
  });
}

// ---- int8 activations (w8a8, w4a8): llama.cpp's Q8_0 activations on the integer dot-product units.
// With fp32 activations, int8 and int4 decode is bound by widening each weight to fp32 and one FMA
// per 16 multiply-adds (int8 batch 1 reads 35% of the bandwidth, llamacpp.md). Quantizing each row's
// activations to int8 in blocks of QB = 32 along k (scale = max|x| / 127, round to nearest even)
// turns 4 k of 16 columns into one AVX512-VNNI vpdpbusd (64 multiply-adds, exact int32 sums).
// The weights are packed for it (kernels.pack_int8_vnni / pack_int4_vnni): per 4 k of a 16-column
// panel, each column's 4 weights are one dword. vpdpbusd takes unsigned x signed bytes, so the
// weights are stored offset to unsigned (int8: q + 128, int4: the code v + 8) and the offset times
// the block's sum of quantized activations is subtracted from each sum.
// CPUs without VNNI run the same integer sums on AVX2 (row_block_a8_avx2): the same outputs.
constexpr int64_t QB = 32;

// Quantized activations of M rows: q [M, K] int8, per block of QB: scale s and sum of q.
// Two limbs (w8a16, w4a16): each x rounds to an integer v in [-A16_MAX, A16_MAX] (scale = max|x| /
// A16_MAX, 15 bits of precision per block) held as v = 128 * q + l, q = v >> 7 in -127..127 and
// l = v & 127 in 0..127 (ql); sum is then the sum of v. Both limbs are vpdpbusd's signed operand;
// each block's exact sum is 128 * (weights . q) + (weights . l), so a product costs two integer
// dot products instead of a widening and an FMA per weight, with activations finer than bf16.
constexpr int32_t A16_MAX = 127 * 128;
struct QuantX {
  std::vector<int8_t> q;
  std::vector<int8_t> ql;
  std::vector<float> s;
  std::vector<int32_t> sum;
  int64_t K = 0, nb = 0;
};

// Rounding by cvtps (the default MXCSR mode: nearest, ties to even) in AVX2, which every CPU the
// kernels run on has; std::nearbyint is a libm call per element, a measurable share of a one-row call.
void quantize_rows(const float* x, int64_t M, int64_t K, QuantX& qx, bool a16 = false) {
  qx.K = K;
  qx.nb = K / QB;
  qx.q.resize(M * K);
  if (a16) qx.ql.resize(M * K);
  const float top = a16 ? static_cast<float>(A16_MAX) : 127.f;
  qx.s.resize(M * qx.nb);
  qx.sum.resize(M * qx.nb);
  const __m256 sign = _mm256_set1_ps(-0.f), lo = _mm256_set1_ps(-top), hi = _mm256_set1_ps(top);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < qx.nb; ++b) {
      const float* xb = x + r * K + b * QB;
      __m256 m = _mm256_setzero_ps();
      for (int64_t i = 0; i < QB; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
      m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
      m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4e));
      m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xb1));
      const float amax = _mm256_cvtss_f32(m);
      const float d = amax / top, inv = amax > 0.f ? top / amax : 0.f;
      const __m256 vinv = _mm256_set1_ps(inv);
      __m256i sum = _mm256_setzero_si256();
      alignas(32) int32_t q[QB];
      for (int64_t i = 0; i < QB; i += 8) {
        const __m256 v = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(xb + i), vinv)));
        const __m256i qi = _mm256_cvtps_epi32(v);
        sum = _mm256_add_epi32(sum, qi);
        _mm256_store_si256(reinterpret_cast<__m256i*>(q + i), qi);
      }
      int8_t* dst = qx.q.data() + r * K + b * QB;
      if (a16) {
        int8_t* low = qx.ql.data() + r * K + b * QB;
        for (int64_t i = 0; i < QB; ++i) {
          dst[i] = static_cast<int8_t>(q[i] >> 7);  // arithmetic: floor(v / 128)
          low[i] = static_cast<int8_t>(q[i] & 127);
        }
      } else {
        for (int64_t i = 0; i < QB; ++i) dst[i] = static_cast<int8_t>(q[i]);
      }
      alignas(32) int32_t part[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(part), sum);
      qx.s[r * qx.nb + b] = d;
      qx.sum[r * qx.nb + b] = part[0] + part[1] + part[2] + part[3] + part[4] + part[5] + part[6] + part[7];
    }
}

#define SD_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
// Which form computes the int8-activation sums (set_a8): AVX512-VNNI, AVX2, or plain C++ (the
// slow, obviously right one the tests hold the others to).
enum A8Form { A8_PORTABLE = 0, A8_AVX2 = 1, A8_VNNI = 2, A8_AMX = 3 };
int g_a8 = A8_AVX2;

// w8a8 panels (kernels.pack_int8_vnni): per 4 k, 16 columns x the 4 k as one dword each, offset to
// unsigned (q + 128): one 64-byte load is vpdpbusd's weight operand.
SD_VNNI static inline __m512i vnni_i8(const int8_t* w) { return _mm512_loadu_si512(w); }

// w4a8 panels (kernels.pack_int4_vnni): per 4 k, 32 bytes whose low nibbles are bytes 0-31 and high
// nibbles bytes 32-63 of the 64-byte operand (codes q = v + 8, 0..15). Broadcast to both halves,
// shift the upper half's 16-bit lanes right by 4, mask: 3 instructions per 64 weights.
SD_VNNI static inline __m512i vnni_i4(const uint8_t* w) {
  const __m512i t = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  const __m512i sh = _mm512_set_epi64(0x0004000400040004LL, 0x0004000400040004LL, 0x0004000400040004LL,
                                      0x0004000400040004LL, 0, 0, 0, 0);
  return _mm512_and_si512(_mm512_srlv_epi16(t, sh), _mm512_set1_epi8(0x0f));
}

// One finished block of 32 k of one row and panel: its exact int32 sum s (A16: high limbs' s, low
// limbs' t) less the weights' offset times the row's block sum xsum, in fp32, times the row's block
// scale xs (int4: and the column's group scale g, block_scale512), added to f. Every VNNI form
// (micro_kernel_a8, tile_a8) takes these steps in this order, so their outputs are the same bits.
template <bool Q4>
SD_VNNI static inline __m512 block_scale512(const uint16_t* gs) {
  return Q4 ? _mm512_mul_ps(load_w16(gs), _mm512_set1_ps(16.f)) : _mm512_set1_ps(1.f);
}
template <bool Q4, bool A16>
SD_VNNI static inline __m512 add_block512(__m512i s, __m512i t, int32_t xsum, float xs, __m512 g, __m512 f) {
  if constexpr (A16) s = _mm512_add_epi32(_mm512_slli_epi32(s, 7), t);
  const __m512 sumf = _mm512_cvtepi32_ps(_mm512_sub_epi32(s, _mm512_set1_epi32((Q4 ? 8 : 128) * xsum)));
  const __m512 xsv = _mm512_set1_ps(xs);
  return _mm512_fmadd_ps(sumf, Q4 ? _mm512_mul_ps(g, xsv) : xsv, f);
}

// rows x 16 outputs of one panel over one K block (kc a multiple of QB) with int8 activations.
// Q4: int4 pair panels with bf16 group scales gs ([kc / 32, 16], stored / 16), else int8 panels
// whose per-column scale applies at the end (finish512). Per block of 32 k and row, the exact
// int32 sum becomes fp32 once: f += float(sum - offset * xsum) * xs (* 16 * group scale).
// U sets of int32 sums take alternate k so that enough vpdpbusd chains are in flight.
// A16: xl holds the low limbs (QuantX); a second set of sums takes them.
template <int R, bool Q4, bool A16>
SD_VNNI static inline void micro_kernel_a8(const int8_t* xq, const int8_t* xl, const float* xs, const int32_t* xsum,
                                           int64_t K, int64_t nb, const void* wv, const uint16_t* gs, int64_t kc,
                                           float* acc, bool first, bool last, float* y, int64_t ldy, int64_t ncols,
                                           const float* scale, const float* bias, const float* res) {
  constexpr int U = A16 ? (R == 1 ? 2 : 1) : R == 1 ? 4 : R == 2 ? 2 : 1;
  constexpr int RL = A16 ? R : 1;
  __m512 f[R];
  for (int r = 0; r < R; ++r) f[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + r * NR);
  for (int64_t b = 0; b < kc; b += QB) {
    __m512i s[U][R], t[U][RL];
    for (int u = 0; u < U; ++u) {
      for (int r = 0; r < R; ++r) s[u][r] = _mm512_setzero_si512();
      for (int r = 0; r < RL; ++r) t[u][r] = _mm512_setzero_si512();
    }
    auto step = [&](int kk) SD_VNNI __attribute__((always_inline)) {  // inlined: the loop body it names
      const int64_t k = b + 4 * kk;
      const int u = kk % U;
      __m512i w;
      if constexpr (Q4) {
        const uint8_t* p = static_cast<const uint8_t*>(wv) + k * (NR / 2);
        _mm_prefetch(reinterpret_cast<const char*>(p) + PF_BYTES, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p) + PF_FAR_BYTES, _MM_HINT_T1);
        w = vnni_i4(p);
      } else {
        const int8_t* p = static_cast<const int8_t*>(wv) + k * NR;
        _mm_prefetch(reinterpret_cast<const char*>(p) + PF_BYTES, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p) + PF_FAR_BYTES, _MM_HINT_T1);
        w = vnni_i8(p);
      }
      for (int r = 0; r < R; ++r) {
        s[u][r] = _mm512_dpbusd_epi32(s[u][r], w, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xq + r * K + k)));
        if constexpr (A16)
          t[u][r] = _mm512_dpbusd_epi32(t[u][r], w, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xl + r * K + k)));
      }
    };
    // int4: the block's 8 steps whole (as in tile_a8; w4a8 / w4a16 decode steps 1.03-1.11x at 1-2
    // rows, benchmarks/results/kernel-ab-int4-a8-unrolled.json); int8 weights gained nothing so
    if constexpr (Q4) {
#pragma GCC unroll 8
      for (int kk = 0; kk < QB / 4; ++kk) step(kk);
    } else {
#pragma GCC unroll 1
      for (int kk = 0; kk < QB / 4; ++kk) step(kk);
    }
    const int64_t blk = b / QB;
    const __m512 g = block_scale512<Q4>(gs + blk * NR);
    for (int r = 0; r < R; ++r) {
      for (int u = 1; u < U; ++u) s[0][r] = _mm512_add_epi32(s[0][r], s[u][r]);
      if constexpr (A16)
        for (int u = 1; u < U; ++u) t[0][r] = _mm512_add_epi32(t[0][r], t[u][r]);
      f[r] = add_block512<Q4, A16>(s[0][r], t[0][A16 ? r : 0], xsum[r * nb + blk], xs[r * nb + blk], g, f[r]);
    }
  }
  finish512<R>(f, acc, last, y, ldy, ncols, scale, bias, res);
}

template <bool Q4, bool A16>
SD_VNNI void row_block_a8(int64_t r, const int8_t* xq, const int8_t* xl, const float* xs, const int32_t* xsum,
                          int64_t K, int64_t nb, const void* w, const uint16_t* gs, int64_t kc, float* acc, bool first,
                          bool last, float* y, int64_t N, int64_t ncols, const float* scale, const float* bias,
                          const float* res) {
  auto run = [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    if constexpr (A16 && R > 8)  // two int32 sums a row: linear_panels_a8 gives two limbs at most 8 rows
      check(false, "two-limb micro-kernels take at most 8 rows");
    else
      micro_kernel_a8<R, Q4, A16>(xq, xl, xs, xsum, K, nb, w, gs, kc, acc, first, last, y, N, ncols, scale, bias,
                                  res);
  };
  switch (r) {
    case 12: return run(std::integral_constant<int, 12>());
    case 11: return run(std::integral_constant<int, 11>());
    case 10: return run(std::integral_constant<int, 10>());
    case 9: return run(std::integral_constant<int, 9>());
    case 8: return run(std::integral_constant<int, 8>());
    case 7: return run(std::integral_constant<int, 7>());
    case 6: return run(std::integral_constant<int, 6>());
    case 5: return run(std::integral_constant<int, 5>());
    case 4: return run(std::integral_constant<int, 4>());
    case 3: return run(std::integral_constant<int, 3>());
    case 2: return run(std::integral_constant<int, 2>());
    default: return run(std::integral_constant<int, 1>());
  }
}

// Several rows on VNNI: tiles of up to 6 rows (4 with two limbs) x 2 panels. The one-panel form
// above, at 12 rows, kept a pointer per row and per-step bookkeeping in general registers the
// compiler had to spill and shuffle around every vpdpbusd. Here the activations are interleaved by 4 k ([K / 4, M, 4] bytes), so a
// tile's rows are dwords at fixed offsets from one pointer, each broadcast feeds two panels, and
// the 12 int32 sums, 12 fp32 sums and two weight operands stay in registers (the 8 steps of a
// block unrolled whole: left as a loop, GCC copied every sum between registers each step). Each
// step asks for the line the next pair of panels reads at the same k (two weight streams at once;
// a fixed 4 KB ahead left them waiting on memory). Each output takes the same fp32 steps in the
// same order as in micro_kernel_a8: the same bits.
inline void interleave_k4(const std::vector<int8_t>& q, int64_t M, int64_t K, std::vector<int8_t>& out) {
  out.resize(M * K);
  const int64_t K4 = K / 4;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t j = 0; j < K4; ++j) std::memcpy(out.data() + (j * M + r) * 4, q.data() + r * K + j * 4, 4);
}

// R rows x P panels over one K block (kc a multiple of QB). xi/xli: the rows' interleaved
// activations at the block's first k (ldxi bytes per 4 k); xs/xsum: their block scales and sums
// (nb per row); panel j's weights at w + j * ldw bytes, its int4 group scales at gs + j * ldg;
// acc: panel j's sums of row r at acc + j * lda + r * NR.
template <int R, int P, bool Q4, bool A16>
SD_VNNI static inline void tile_a8(const int8_t* xi, const int8_t* xli, int64_t ldxi, const float* xs,
                                   const int32_t* xsum, int64_t nb, const uint8_t* w, int64_t ldw, const uint16_t* gs,
                                   int64_t ldg, int64_t kc, float* acc, int64_t lda, bool first) {
  __m512 f[R][P];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j) f[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + j * lda + r * NR);
  constexpr int64_t WB = Q4 ? NR / 2 : NR;  // weight bytes per k of a panel
  for (int64_t b = 0; b < kc; b += QB) {
    __m512i s[R][P], t[A16 ? R : 1][P];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < P; ++j) {
        s[r][j] = _mm512_setzero_si512();
        if constexpr (A16) t[r][j] = _mm512_setzero_si512();
      }
#pragma GCC unroll 8
    for (int kk = 0; kk < QB / 4; ++kk) {  // whole: the sums stay in the registers they start in
      const int64_t k = b + 4 * kk;
      __m512i wv[P];
      for (int j = 0; j < P; ++j) {
        const uint8_t* p = w + j * ldw + k * WB;
        _mm_prefetch(reinterpret_cast<const char*>(p) + 2 * ldw, _MM_HINT_T0);  // the next pair's line
        wv[j] = Q4 ? vnni_i4(p) : _mm512_loadu_si512(p);
      }
      const int8_t* xk = xi + (k / 4) * ldxi;
      const int8_t* lk = A16 ? xli + (k / 4) * ldxi : nullptr;
      for (int r = 0; r < R; ++r) {
        int32_t xd;
        std::memcpy(&xd, xk + 4 * r, 4);
        const __m512i xb = _mm512_set1_epi32(xd);
        for (int j = 0; j < P; ++j) s[r][j] = _mm512_dpbusd_epi32(s[r][j], wv[j], xb);
        if constexpr (A16) {
          std::memcpy(&xd, lk + 4 * r, 4);
          const __m512i lb = _mm512_set1_epi32(xd);
          for (int j = 0; j < P; ++j) t[r][j] = _mm512_dpbusd_epi32(t[r][j], wv[j], lb);
        }
      }
    }
    const int64_t blk = b / QB;
    __m512 g[P];
    for (int j = 0; j < P; ++j) g[j] = block_scale512<Q4>(gs + j * ldg + blk * NR);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < P; ++j)
        f[r][j] = add_block512<Q4, A16>(s[r][j], t[A16 ? r : 0][j], xsum[r * nb + blk], xs[r * nb + blk], g[j], f[r][j]);
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j) _mm512_storeu_ps(acc + j * lda + r * NR, f[r][j]);
}

template <int P, bool Q4, bool A16>
SD_VNNI void tile_rows_a8(int64_t r, const int8_t* xi, const int8_t* xli, int64_t ldxi, const float* xs,
                          const int32_t* xsum, int64_t nb, const uint8_t* w, int64_t ldw, const uint16_t* gs,
                          int64_t ldg, int64_t kc, float* acc, int64_t lda, bool first) {
#define SD_TILE(R) return tile_a8<R, P, Q4, A16>(xi, xli, ldxi, xs, xsum, nb, w, ldw, gs, ldg, kc, acc, lda, first)
  switch (r) {
    case 6: if constexpr (!A16) SD_TILE(6); else break;
    case 5: if constexpr (!A16) SD_TILE(5); else break;
    case 4: SD_TILE(4);
    case 3: SD_TILE(3);
    case 2: SD_TILE(2);
    default: SD_TILE(1);
  }
#undef SD_TILE
  check(false, "two-limb tiles take at most 4 rows");
}

// From how many rows the tiles beat micro_kernel_a8 with weights streamed from memory (30 layers of
// default-e2e's shapes, AMD EPYC Zen 5, 2 threads): below it the one-panel form keeps the single
// weight stream the memory system serves best; int8 weights with int8 activations stream the
// most bytes per multiply-add, so they move over last. Both give the same bits on either side.
constexpr int64_t tile_min_rows(bool q4, bool a16) { return q4 ? (a16 ? 4 : 5) : (a16 ? 6 : 9); }

// y = x @ W^T (+ bias) (+ res) from quantized rows on VNNI in tiles (above): threads take pairs of
// panels, K in blocks of KC (two panels' weight block stays in L1 while every row tile uses it),
// rows in tiles of at most 6 (4) split evenly.
template <bool Q4, bool A16>
void linear_tiles_a8(const QuantX& qx, int64_t M, const void* wa, int64_t K, int64_t NP, const float* sa,
                     const uint16_t* gs, const float* ba, int64_t n, float* ya, const float* res) {
  constexpr int64_t RT = A16 ? 4 : 6;
  std::vector<int8_t> xi, xli;
  interleave_k4(qx.q, M, K, xi);
  if (A16) interleave_k4(qx.ql, M, K, xli);
  const int64_t nb = qx.nb, NT = (NP + 1) / 2, nrb = (M + RT - 1) / RT, ldxi = 4 * M;
  const int64_t ldw = Q4 ? K * NR / 2 : K * NR, ldg = (K / G4) * NR;
  const uint8_t* w8 = static_cast<const uint8_t*>(wa);
  parallel_steal(NT, 1, [&](const auto& next) {
    thread_local std::vector<float> acc;
    acc.resize(2 * M * NR);
    for (int64_t t0, t1; next(t0, t1);)
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t p0 = 2 * t, np = std::min<int64_t>(2, NP - p0);
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
          const int64_t kc = std::min(KC, K - k0);
          const uint8_t* w = w8 + p0 * ldw + k0 * (Q4 ? NR / 2 : NR);
          const uint16_t* g = Q4 ? gs + p0 * ldg + (k0 / G4) * NR : nullptr;
          even_row_blocks(M, nrb, [&](int64_t m, int64_t r) {
            const int8_t* x = xi.data() + k0 * M + 4 * m;
            const int8_t* xl = A16 ? xli.data() + k0 * M + 4 * m : nullptr;
            const float* xs = qx.s.data() + m * nb + k0 / QB;
            const int32_t* xsum = qx.sum.data() + m * nb + k0 / QB;
            if (np == 2)
              tile_rows_a8<2, Q4, A16>(r, x, xl, ldxi, xs, xsum, nb, w, ldw, g, ldg, kc, acc.data() + m * NR, M * NR,
                                       k0 == 0);
            else
              tile_rows_a8<1, Q4, A16>(r, x, xl, ldxi, xs, xsum, nb, w, ldw, g, ldg, kc, acc.data() + m * NR, M * NR,
                                       k0 == 0);
          });
        }
        for (int64_t j = 0; j < np; ++j) {
          const int64_t p = p0 + j;
          store_rows(M, acc.data() + j * M * NR, ya + p * NR, n, std::min(NR, n - p * NR), sa ? sa + p * NR : nullptr,
                     ba ? ba + p * NR : nullptr, res ? res + p * NR : nullptr);
        }
      }
  });
}

// The same arithmetic without VNNI (any x86-64 CPU): signed integer sums per block, the same
// fp32 steps in the same order (fmaf is the fused multiply-add vfmadd computes).
template <bool Q4, bool A16>
void row_block_a8_portable(int64_t R, const int8_t* xq, const int8_t* xl, const float* xs, const int32_t*, int64_t K,
                           int64_t nb,
                           const void* wv, const uint16_t* gs, int64_t kc, float* acc, bool first, bool last,
                           float* y, int64_t ldy, int64_t ncols, const float* scale, const float* bias,
                           const float* res) {
  for (int64_t r = 0; r < R; ++r) {
    float f[NR];
    for (int64_t c = 0; c < NR; ++c) f[c] = first ? 0.f : acc[r * NR + c];
    for (int64_t b = 0; b < kc; b += QB) {
      int32_t s[NR] = {0};
      for (int64_t k = b; k < b + QB; ++k) {
        const int32_t xv = A16 ? 128 * xq[r * K + k] + xl[r * K + k] : xq[r * K + k];
        for (int64_t c = 0; c < NR; ++c) {
          const int64_t v = c * 4 + k % 4;  // the weight's byte in its 4 k's 64-byte operand
          int32_t wq;
          if constexpr (Q4) {
            const uint8_t byte = static_cast<const uint8_t*>(wv)[(k / 4) * 32 + v % 32];
            wq = static_cast<int32_t>(v < 32 ? byte & 0x0f : byte >> 4) - 8;
          } else {
            wq = static_cast<int32_t>(static_cast<uint8_t>(static_cast<const int8_t*>(wv)[(k / 4) * 64 + v])) - 128;
          }
          s[c] += xv * wq;
        }
      }
      const int64_t blk = b / QB;
      const float xsc = xs[r * nb + blk];
      for (int64_t c = 0; c < NR; ++c) {
        float m = xsc;
        if constexpr (Q4) {
          uint32_t bits = static_cast<uint32_t>(gs[blk * NR + c]) << 16;
          float g;
          std::memcpy(&g, &bits, 4);
          m = (g * 16.f) * xsc;
        }
        f[c] = std::fmaf(static_cast<float>(s[c]), m, f[c]);
      }
    }
    for (int64_t c = 0; c < NR; ++c) acc[r * NR + c] = f[c];
    if (last) store_rows(1, acc + r * NR, y + r * ldy, ldy, ncols, scale, bias, res ? res + r * ldy : nullptr);
  }
}

// The same integer sums on AVX2 (CPUs without AVX512-VNNI: most AMD Zen 2/3 and older Intel), as
// llama.cpp's Q8_0 / Q4_0 dot products do there: vpmaddubsw multiplies unsigned by signed bytes and
// adds pairs into int16, vpmaddwd adds those pairs into int32. No pair may saturate: int4 codes
// (0..15) times x (|x| <= 127) stay under 3810 a pair; int8 weights go signed (q = byte ^ 0x80,
// |q| <= 127, kernels.pack_int8_vnni refuses -128) and take x's sign, so |x| * (+-q) <= 16129.
// Exact int32 sums and the same fp32 steps in the same order: bitwise the VNNI form's outputs.
// A panel's 16 columns are two registers: columns 0-7 (int8: bytes 0-31 of the 64-byte operand;
// int4: the low nibbles) and 8-15 (bytes 32-63; the high nibbles). Up to 4 rows per call.
// A16: the low limbs (0..127) multiply the same weights; each limb's int16 pairs widen to int32
// at once, the high limb's times 128 (vpmaddwd by 128: exact), into the same int32 sums.
template <int R, bool Q4, bool A16>
static inline void micro_kernel_a8_avx2(const int8_t* xq, const int8_t* xl, const float* xs, const int32_t* xsum,
                                        int64_t K, int64_t nb, const void* wv, const uint16_t* gs, int64_t kc,
                                        float* acc, bool first, bool last, float* y, int64_t ldy, int64_t ncols,
                                        const float* scale, const float* bias, const float* res) {
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0f), hi16 = _mm256_set1_epi16(128);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  if (first)
    for (int r = 0; r < R; ++r) std::fill(acc + r * NR, acc + (r + 1) * NR, 0.f);
  for (int64_t b = 0; b < kc; b += QB) {
    __m256i s0[R], s1[R];  // int32 sums (int8); int4: int16 pair sums until the block ends
    for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm256_setzero_si256();
    for (int64_t k = b; k < b + QB; k += 4) {
      __m256i w0, w1;
      if constexpr (Q4) {
        const uint8_t* p = static_cast<const uint8_t*>(wv) + k * (NR / 2);
        _mm_prefetch(reinterpret_cast<const char*>(p) + PF_BYTES, _MM_HINT_T0);
        const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        w0 = _mm256_and_si256(t, low4);
        w1 = _mm256_and_si256(_mm256_srli_epi16(t, 4), low4);
      } else {
        const int8_t* p = static_cast<const int8_t*>(wv) + k * NR;
        _mm_prefetch(reinterpret_cast<const char*>(p) + PF_BYTES, _MM_HINT_T0);
        w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), flip);
        w1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), flip);
      }
      for (int r = 0; r < R; ++r) {
        const __m256i xb = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xq + r * K + k));
        if constexpr (A16) {
          const __m256i lb = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xl + r * K + k));
          __m256i h0, h1, l0, l1;
          if constexpr (Q4) {  // codes 0..15 unsigned, limbs signed: pairs of at most 3810
            h0 = _mm256_maddubs_epi16(w0, xb);
            h1 = _mm256_maddubs_epi16(w1, xb);
            l0 = _mm256_maddubs_epi16(w0, lb);
            l1 = _mm256_maddubs_epi16(w1, lb);
          } else {  // signed weights take the high limb's sign; the low limb is >= 0
            const __m256i ax = _mm256_abs_epi8(xb);
            h0 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xb));
            h1 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xb));
            l0 = _mm256_maddubs_epi16(lb, w0);
            l1 = _mm256_maddubs_epi16(lb, w1);
          }
          s0[r] = _mm256_add_epi32(s0[r], _mm256_add_epi32(_mm256_madd_epi16(h0, hi16), _mm256_madd_epi16(l0, ones)));
          s1[r] = _mm256_add_epi32(s1[r], _mm256_add_epi32(_mm256_madd_epi16(h1, hi16), _mm256_madd_epi16(l1, ones)));
        } else if constexpr (Q4) {  // a pair is at most 2 * 15 * 127 = 3810: 8 of them fit int16
          s0[r] = _mm256_add_epi16(s0[r], _mm256_maddubs_epi16(w0, xb));
          s1[r] = _mm256_add_epi16(s1[r], _mm256_maddubs_epi16(w1, xb));
        } else {
          const __m256i ax = _mm256_abs_epi8(xb);
          const __m256i p0 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xb));
          const __m256i p1 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xb));
          s0[r] = _mm256_add_epi32(s0[r], _mm256_madd_epi16(p0, ones));
          s1[r] = _mm256_add_epi32(s1[r], _mm256_madd_epi16(p1, ones));
        }
      }
    }
    if constexpr (Q4 && !A16)
      for (int r = 0; r < R; ++r) {
        s0[r] = _mm256_madd_epi16(s0[r], ones);
        s1[r] = _mm256_madd_epi16(s1[r], ones);
      }
    const int64_t blk = b / QB;
    __m256 g0 = _mm256_set1_ps(1.f), g1 = g0;
    if constexpr (Q4) {
      load_w(gs + blk * NR, g0, g1);
      g0 = _mm256_mul_ps(g0, _mm256_set1_ps(16.f));
      g1 = _mm256_mul_ps(g1, _mm256_set1_ps(16.f));
    }
    for (int r = 0; r < R; ++r) {
      // int4 codes are v + 8: their sums carry 8 * sum(x), taken off as the VNNI form does
      const __m256i off = _mm256_set1_epi32(Q4 ? 8 * xsum[r * nb + blk] : 0);
      const __m256 xsc = _mm256_set1_ps(xs[r * nb + blk]);
      const __m256 m0 = Q4 ? _mm256_mul_ps(g0, xsc) : xsc, m1 = Q4 ? _mm256_mul_ps(g1, xsc) : xsc;
      float* a = acc + r * NR;
      _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(s0[r], off)), m0, _mm256_loadu_ps(a)));
      _mm256_storeu_ps(a + 8,
                       _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(s1[r], off)), m1, _mm256_loadu_ps(a + 8)));
    }
  }
  if (last) store_rows(R, acc, y, ldy, ncols, scale, bias, res);
}

template <bool Q4, bool A16>
void row_block_a8_avx2(int64_t R, const int8_t* xq, const int8_t* xl, const float* xs, const int32_t* xsum, int64_t K,
                       int64_t nb, const void* w, const uint16_t* gs, int64_t kc, float* acc, bool first, bool last,
                       float* y, int64_t ldy, int64_t ncols, const float* scale, const float* bias, const float* res) {
  for (int64_t i = 0; i < R; i += 4) {
    const int64_t r = std::min<int64_t>(4, R - i);
    const float* rp = res ? res + i * ldy : nullptr;
    auto run = [&](auto rows) {
      micro_kernel_a8_avx2<decltype(rows)::value, Q4, A16>(xq + i * K, A16 ? xl + i * K : nullptr, xs + i * nb,
                                                            xsum + i * nb, K, nb, w, gs, kc, acc + i * NR, first, last,
                                                            y + i * ldy, ldy, ncols, scale, bias, rp);
    };
    switch (r) {
      case 4: run(std::integral_constant<int, 4>()); break;
      case 3: run(std::integral_constant<int, 3>()); break;
      case 2: run(std::integral_constant<int, 2>()); break;
      default: run(std::integral_constant<int, 1>());
    }
  }
}

// ---- AMX (Intel Sapphire Rapids and later): the same integer sums on the tile unit, for several rows.
// One tdpbssd multiplies up to 16 rows of 32 int8 activations by a 32 x 16 block of int8 weights
// (the VNNI panels above are already its B-tile layout, 4 k x 16 columns per 64-byte row, once
// their offset is taken back out: amx_b_block) into exact int32 sums, what 8 vpdpbusd per row
// compute. Each block of 32 k has its own activation
// scale, so every block's sums leave the tile (tilestored) and take the same fp32 steps, in the
// same order, as micro_kernel_a8: the outputs are bitwise those of the VNNI, AVX2 and plain forms.
// With few rows the tile unit's fixed cost per block (the loads, the product's latency, the store
// of its sums) is not paid back: AMX runs from 12 rows with two limbs or int4 panels and from 16
// with int8 activations on int8 panels, where it beat VNNI in default-e2e's decode layers on a Xeon
// with AMX (benchmarks/a8_forms.py times the two; at 8 rows, and at 12 in w8a8, AMX was no faster
// when these thresholds were chosen).
#define SD_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")))
constexpr int64_t AMX_ROWS = 16;  // rows of an A / C tile
constexpr int64_t AMX_MIN_ROWS = 12, AMX_MIN_ROWS_W8A8 = 16;

struct AmxConfig {  // the 64-byte operand of ldtilecfg (palette 1)
  uint8_t palette = 1, start = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles, two sets that alternate from one (block, row block) unit to the next: B 4 / 5 the unit's
// block of weights, C 0 / 6 its high-limb sums and C 1 / 7 its low-limb sums; A 2 / 3 the high / low
// limbs of its activations (shared by both sets).
// h: rows of the A and C tiles (a row block), at most AMX_ROWS.
SD_AMX static void amx_configure(int64_t h) {
  AmxConfig c;
  for (int t : {0, 1, 6, 7}) c.rows[t] = static_cast<uint8_t>(h), c.colsb[t] = NR * 4;
  for (int t : {2, 3}) c.rows[t] = static_cast<uint8_t>(h), c.colsb[t] = QB;
  for (int t : {4, 5}) c.rows[t] = QB / 4, c.colsb[t] = NR * 4;
  // not _tile_loadconfig: GCC 12's form names only the first 8 bytes as read, and the rest of the
  // struct's stores are dropped as dead
  __asm__ volatile("ldtilecfg %0" ::"m"(c));
}
SD_AMX static void amx_release() { _tile_release(); }

// One block of 32 k of a panel as the B tile's bytes, in buf (512 bytes): the signed weights (int8:
// the stored q + 128 with its top bit flipped; int4: the code v + 8 less 8), so tdpbssd's sums need
// no offset term.
template <bool Q4>
SD_AMX static inline void amx_b_block(const void* wv, int64_t k, uint8_t* buf) {
  if constexpr (Q4) {
    const uint8_t* p = static_cast<const uint8_t*>(wv) + k * (NR / 2);
    for (int64_t i = 0; i < 4; ++i) _mm_prefetch(reinterpret_cast<const char*>(p) + PF_BYTES + i * 64, _MM_HINT_T0);
    for (int64_t i = 0; i < QB / 4; ++i)
      _mm512_storeu_si512(buf + i * 64, _mm512_sub_epi8(vnni_i4(p + i * 32), _mm512_set1_epi8(8)));
  } else {
    const char* p = reinterpret_cast<const char*>(static_cast<const int8_t*>(wv) + k * NR);
    for (int64_t i = 0; i < QB / 4; ++i) {
      _mm_prefetch(p + PF_BYTES + i * 64, _MM_HINT_T0);
      _mm512_storeu_si512(buf + i * 64, _mm512_xor_si512(_mm512_loadu_si512(p + i * 64),
                                                         _mm512_set1_epi8(static_cast<char>(0x80))));
    }
  }
}

// Rows m .. m + R - 1 (R a multiple of 4, rows past M zero padding) of one panel over all of K, its
// weights already in B-tile form in wb (amx_b_block per block, 512 bytes each): acc [R, NR] fp32
// sums, kept in registers. Software pipelined: block b's tile products are issued on one tile set,
// then block b - 1's sums are stored from the other and finished on the vector units meanwhile,
// with micro_kernel_a8's fp32 steps in its order.
#define SD_AMX_ISSUE(B, CQ, CL)                              \
  _tile_loadd(B, wb + b * 512, NR * 4);                      \
  _tile_loadd(2, xq + b * QB, K);                            \
  _tile_zero(CQ);                                            \
  _tile_dpbssd(CQ, 2, B);                                    \
  if constexpr (A16) {                                       \
    _tile_loadd(3, xl + b * QB, K);                          \
    _tile_zero(CL);                                          \
    _tile_dpbssd(CL, 3, B);                                  \
  }
#define SD_AMX_STORE(CQ, CL)                                 \
  _tile_stored(CQ, c, NR * 4);                               \
  if constexpr (A16) _tile_stored(CL, c + T, NR * 4);
// next: the next panel's weights, pulled toward the caches a block at a time meanwhile (the panel's
// B-tile form is made before its products run, so without this its reads and the products would
// take turns instead of overlapping); null for none.
template <int R, bool Q4, bool A16>
SD_AMX void amx_rows(const QuantX& qx, int64_t m, const uint8_t* wb, const uint16_t* gs, float* acc, int32_t* cbuf,
                     const char* next) {
  const int64_t K = qx.K, nb = qx.nb;
  const int8_t* xq = qx.q.data() + m * K;
  const int8_t* xl = A16 ? qx.ql.data() + m * K : nullptr;
  const float* xs = qx.s.data() + m * nb;
  constexpr int64_t T = AMX_ROWS * NR;  // int32 of one C tile; cbuf holds two blocks of 2 tiles
  __m512 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b <= nb; ++b) {
    const int set = b & 1;
    if (next && b < nb)  // block b of the next panel: 512 bytes (int8), 256 (int4)
      for (int64_t i = 0; i < (Q4 ? 4 : 8); ++i) _mm_prefetch(next + b * (Q4 ? 256 : 512) + i * 64, _MM_HINT_T0);
    if (b < nb) {
      if (set == 0) {
        SD_AMX_ISSUE(4, 0, 1)
      } else {
        SD_AMX_ISSUE(5, 6, 7)
      }
    }
    if (b == 0) continue;
    const int64_t pb = b - 1;
    int32_t* c = cbuf + (set ^ 1) * 2 * T;
    if (set == 0) {
      SD_AMX_STORE(6, 7)
    } else {
      SD_AMX_STORE(0, 1)
    }
    __m512 g = _mm512_set1_ps(1.f);
    if constexpr (Q4) g = _mm512_mul_ps(load_w16(gs + pb * NR), _mm512_set1_ps(16.f));
    for (int r = 0; r < R; ++r) {
      __m512i sum = _mm512_load_si512(c + r * NR);
      if constexpr (A16) sum = _mm512_add_epi32(_mm512_slli_epi32(sum, 7), _mm512_load_si512(c + T + r * NR));
      const __m512 x = _mm512_set1_ps(xs[r * nb + pb]);
      f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), Q4 ? _mm512_mul_ps(g, x) : x, f[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * NR, f[r]);
}
#undef SD_AMX_ISSUE
#undef SD_AMX_STORE

// linear_panels_a8 on AMX: panels split across threads, each configuring its tiles; a panel's
// weights are put in B-tile form once (amx_b_block) for all its row blocks. The rows split into
// the fewest blocks of at most 16, of equal height rounded up to 4 (12 rows: one tile of 12 rows,
// not 16 with 4 of padding; 20 rows: two of 12).
template <bool Q4, bool A16>
void linear_panels_amx(QuantX& qx, int64_t M, const void* wa, int64_t K, int64_t NP, const float* sa,
                       const uint16_t* gs, const float* ba, int64_t n, float* ya, const float* res) {
  const int64_t nrb = (M + AMX_ROWS - 1) / AMX_ROWS, h = ((M + nrb - 1) / nrb + 3) / 4 * 4, Mp = nrb * h;
  const int64_t nb = qx.nb;
  qx.q.resize(Mp * K, 0);  // zero rows: whole tiles load; the padding's sums are not stored
  if (A16) qx.ql.resize(Mp * K, 0);
  qx.s.resize(Mp * nb, 0.f);
  const int64_t wstride = Q4 ? K * (NR / 2) : K * NR;  // bytes of one panel
  parallel_steal(NP, 2, [&](const auto& next) {
    amx_configure(h);
    alignas(64) int32_t cbuf[2 * 2 * AMX_ROWS * NR];
    alignas(64) float acc[AMX_ROWS * NR];
    std::vector<__m512i> wb(nb * 8);  // 64-byte aligned B blocks of this panel
    for (int64_t p0, p1; next(p0, p1);)
      for (int64_t p = p0; p < p1; ++p) {
        const void* w = static_cast<const char*>(wa) + p * wstride;
        uint8_t* wbp = reinterpret_cast<uint8_t*>(wb.data());
        for (int64_t b = 0; b < nb; ++b) amx_b_block<Q4>(w, b * QB, wbp + b * 512);
        const uint16_t* g = Q4 ? gs + p * (K / G4) * NR : nullptr;
        for (int64_t m = 0; m < M; m += h) {
          const int64_t mr = std::min(h, M - m);
          // The next panel's weights are asked for past the range parallel_steal handed out too:
          // the thread's share goes on there, or another thread takes it (w8a8, w4a8, w8a16 at 32
          // rows 1.04-1.08x faster than asking within the range: xeon-amx/kernel-ab-amx-ahead.json).
          const char* ahead = m == 0 && p + 1 < NP ? static_cast<const char*>(w) + wstride : nullptr;
          switch (h / 4) {
            case 4: amx_rows<16, Q4, A16>(qx, m, wbp, g, acc, cbuf, ahead); break;
            case 3: amx_rows<12, Q4, A16>(qx, m, wbp, g, acc, cbuf, ahead); break;
            case 2: amx_rows<8, Q4, A16>(qx, m, wbp, g, acc, cbuf, ahead); break;
            default: amx_rows<4, Q4, A16>(qx, m, wbp, g, acc, cbuf, ahead);
          }
          store_rows(mr, acc, ya + m * n + p * NR, n, std::min(NR, n - p * NR), sa ? sa + p * NR : nullptr,
                     ba ? ba + p * NR : nullptr, res ? res + m * n + p * NR : nullptr);
        }
      }
    amx_release();
  });
}

// Whether this process may use the AMX tile registers (Linux asks a process to request them once).
bool amx_permitted() {
#ifdef __linux__
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
#else
  return false;
#endif
}

// ---- AMX-BF16 (Intel Sapphire Rapids and later): fp32 activations on the tile unit, for several rows.
// With fp32 activations a batched step's weights (fp32 or widened) each take one fp32 FMA per row
// (16 lanes, two ports); tdpbf16ps multiplies up to 16 rows x 32 k by 32 k x 16 columns of bf16
// into fp32 sums (8192 products) per instruction. Nothing is rounded away: an fp32 x is h + m + l
// exactly (three bf16 limbs, each the top 8 significant bits of what the one before left), a bf16
// or int8 weight is one limb, and so is an int4 weight's code v (-8..7): its group's scale
// multiplies the block's tile sums instead (a group is one 32-k block), in fp32, into sums kept in
// registers or memory (amxb_rows). Three tdpbf16ps per block and panel. An fp32 weight is three
// limbs too, and the six products whose limb orders add to at most 2 are summed (the three left out
// are each under 2^-24 of their product, the size of an FMA's rounding). Every product summed is
// exact, in fp32 in the tile's own order, so the outputs are not the FMA forms' bits: they agree to
// fp32 rounding (tests/test_kernels.py), and a row's outputs do not depend on the other rows of the
// call. The low limbs of an x under 2^-110 fall below bf16's normal range and count as zero, as the
// tile unit treats subnormals (an error under 2^-126 times the weight). fp32 weights take the tiles
// from 32 rows, where two row blocks of 16 fill them (below 16 rows making three weight limbs costs
// more than the FMA forms spend). They had started at 24, timed against the stream form at 32 rows
// on one Intel Xeon host; on another with the same CPU name, decode steps at 24 rows (two blocks of
// 12) ran 1.21x faster on the stream form (1.14x at 3x) and at 28 rows 1.29x, where the same run's
// controls (both sources in one form) read 1.10x at 16 rows and 1.02x at 32
// (benchmarks/results/xeon-amx/kernel-ab-f32-tiles-from-32.json). At 32 rows, trials of the tiles
// against the stream form went either way from run to run there, so the tiles keep 32. That A/B's
// other source ran without the native decode loop (kernel_ab.py put it on the layers alone, not on
// the final norm and LM head; fixed), which its 16-row control shows. A third host, timed with the
// fixed script, ran steps at 24 rows 1.05x and at 28 rows 1.16x faster on the tiles, its 16-row
// control 1.00x (kernel-ab-f32-tiles-from-32-native.json): where the tiles start to pay differs
// between hosts of one CPU name, and one constant is off by 5-20% at 24-31 rows on one or the other.
#define SD_AMXBF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))
bool g_amx_bf16 = false;
// Rows from which the tiles run, per weight dtype; below them the FMA forms do.
constexpr int64_t AMXB_MIN_F32 = 32, AMXB_MIN_BF16 = 8, AMXB_MIN_INT8 = 8, AMXB_MIN_INT4 = 8;
constexpr int64_t AMXB_K = 32;  // k of one tile block: 16 tile rows of 2 k x 16 columns

// What the bf16 limb of each fp32 value (its top half) leaves out: exact, the next limb's value.
SD_AVX512 static inline __m512 limb_rest(__m512 v) {
  const __m512i top = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  return _mm512_sub_ps(v, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), top)));
}

// x [M, K] as its three bf16 limbs in A-tile form: per 32-k block b and limb i, the Mp rows' 32 k
// (rows M .. Mp - 1 zero) at out + ((b * 3 + i) * Mp + m) * AMXB_K, so that a block's tiles are one
// contiguous run the caches stream in. A limb's 32 words are the top halves of 32 fp32 values: one
// two-source permutation picks them.
SD_AVX512 void split_rows_bf16(const float* x, int64_t M, int64_t Mp, int64_t K, uint16_t* out) {
  const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23,
                                       21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  for (int64_t b = 0; b < K / AMXB_K; ++b)  // the padding rows
    for (int i = 0; i < 3; ++i) std::fill(out + ((b * 3 + i) * Mp + M) * AMXB_K, out + ((b * 3 + i) + 1) * Mp * AMXB_K, 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / AMXB_K; ++b) {
      __m512 v0 = _mm512_loadu_ps(x + m * K + b * AMXB_K), v1 = _mm512_loadu_ps(x + m * K + b * AMXB_K + 16);
      for (int i = 0; i < 3; ++i) {
        _mm512_storeu_si512(out + ((b * 3 + i) * Mp + m) * AMXB_K,
                            _mm512_permutex2var_epi16(_mm512_castps_si512(v0), odd, _mm512_castps_si512(v1)));
        if (i < 2) v0 = limb_rest(v0), v1 = limb_rest(v1);
      }
    }
}

// Tiles: C 0-3 the sums of (panel q, row block rb) at 2 * q + rb; B 4 / 5 one weight limb of panel
// 0 / 1; A 6 / 7 one activation limb of a row block, alternating. h rows per row block.
SD_AMXBF16 static void amxb_configure(int64_t h) {
  AmxConfig c;
  for (int t : {0, 1, 2, 3, 6, 7}) c.rows[t] = static_cast<uint8_t>(h), c.colsb[t] = 64;
  for (int t : {4, 5}) c.rows[t] = 16, c.colsb[t] = 64;
  __asm__ volatile("ldtilecfg %0" ::"m"(c));  // see amx_configure
}

// Tile row t of a B tile from panel rows 2t and 2t + 1 as bf16 (ev: row 2t in words 0-15, row
// 2t + 1 in words 16-31): each column's pair of words side by side, as vdpbf16ps takes them too
// (dot_rows_bf16).
SD_AVX512 static inline __m512i pair_words(__m512i ev) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, ev);
}

// Tile row t of a B tile from two panel rows (e: row 2t, d: row 2t + 1) in fp32 whose values are
// exact in bf16 (widened int8, or one limb of fp32), i.e. their top halves: a shift and a blend
// pair them per column.
SD_AMXBF16 static inline __m512i pair_tops(__m512 e, __m512 d) {
  return _mm512_ternarylogic_epi32(_mm512_set1_epi32(0xFFFF), _mm512_srli_epi32(_mm512_castps_si512(e), 16),
                                   _mm512_castps_si512(d), 0xCA);  // low word from e, high word from d
}

// One 32-k block (at k0) of np panels (wstride apart) in B-tile form, amxb_limbs bf16 limbs each:
// panel q's limb j at out + (q * L + j) * 512. fp32 panels in three (each the top half of what the
// one before left), bf16 panels as they are (two panel rows are one 64-byte line: a permutation
// makes it a tile row), int8 converted exactly, int4 as its codes v (the scale stays out: see
// amxb_rows): a 64-byte line holds 8 k of the 16 columns, a dword each, k0 + j in nibble j
// (j < 7: v + 8; j = 7: v in two's complement, flipped to v + 8 by xor-ing its top bit), so tile
// row 4g + j takes byte j of each dword, its low nibble to the low word; vpermw looks each nibble
// up in a table of the bf16 of v (it reads 5 bits of a word: the table is the 16 values twice).
template <typename W>
constexpr int amxb_limbs = std::is_same<W, float>::value ? 3 : 1;

template <typename W>
SD_AMXBF16 static inline void amxb_block(const W* w, int64_t wstride, int64_t np, int64_t k0, uint16_t* out) {
  for (int64_t q = 0; q < np; ++q) {
    uint16_t* o = out + q * amxb_limbs<W> * 512;
    if constexpr (std::is_same<W, float>::value) {
      const float* p = w + q * wstride + k0 * NR;
      for (int t = 0; t < 16; ++t) {
        __m512 e = _mm512_loadu_ps(p + t * 32), d = _mm512_loadu_ps(p + t * 32 + 16);
        for (int j = 0; j < 3; ++j) {
          _mm512_storeu_si512(o + j * 512 + t * 32, pair_tops(e, d));
          if (j < 2) e = limb_rest(e), d = limb_rest(d);
        }
      }
    } else if constexpr (std::is_same<W, uint16_t>::value) {
      const uint16_t* p = w + q * wstride + k0 * NR;
      for (int t = 0; t < 16; ++t) {
        _mm_prefetch(reinterpret_cast<const char*>(p + t * 32) + PF_BYTES, _MM_HINT_T0);
        _mm512_storeu_si512(o + t * 32, pair_words(_mm512_loadu_si512(p + t * 32)));
      }
    } else if constexpr (std::is_same<W, int8_t>::value) {
      const int8_t* p = w + q * wstride + k0 * NR;
      for (int t = 0; t < 16; ++t) {
        const __m512 e = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + t * 32))));
        const __m512 d = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + t * 32 + 16))));
        _mm512_storeu_si512(o + t * 32, pair_tops(e, d));
      }
    } else {
      static_assert(std::is_same<W, uint8_t>::value, "bf16, int8 or int4 panels");
      alignas(64) static const uint16_t codes[32] = {  // bf16 of -8 .. 7, twice
          0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000,
          0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040,
          0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};
      const __m512i table = _mm512_load_si512(codes), top = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u)),
                    low = _mm512_set1_epi32(0xFFFF);
      const uint8_t* p = w + q * wstride + k0 * (NR / 2);
      for (int g = 0; g < 4; ++g) {
        const __m512i d = _mm512_xor_si512(_mm512_loadu_si512(p + g * 64), top);
        // byte j of each dword: its low nibble at bit 0 (lo), its high nibble at bit 16 (hi)
        const __m512i lo[4] = {d, _mm512_srli_epi32(d, 8), _mm512_srli_epi32(d, 16), _mm512_srli_epi32(d, 24)};
        const __m512i hi[4] = {_mm512_slli_epi32(d, 12), _mm512_slli_epi32(d, 4), _mm512_srli_epi32(d, 4),
                               _mm512_srli_epi32(d, 12)};
        for (int j = 0; j < 4; ++j)
          _mm512_storeu_si512(o + (4 * g + j) * 32,
                              _mm512_permutexvar_epi16(_mm512_ternarylogic_epi32(low, lo[j], hi[j], 0xCA), table));
      }
    }
  }
}

// Rows m0 .. m0 + nrb * h - 1 (nrb 1 or 2 row blocks of h) x np (1 or 2) panels over all of K: the
// limbs of x in xl (split_rows_bf16, Mp rows a limb), the panels' weights at w (np of them, wstride
// apart; amxb_block). The sums go to acc [np][nrb * h][NR]. Activation limb i times weight limb j
// for i + j <= 2; the next block's B tiles are made (in the other of two buffers) after the tile
// products of this one are issued. fp32, bf16 and int8 panels keep their sums in the tiles over all
// of K; int4 panels (gs: group scales) sum one block in the tiles, which go through tmp to acc
// times the block's scales (an fp32 FMA per row and panel), or, RS > 0 (up to RS rows), to
// registers. XL 1: x's first limb alone (its top bf16 half; greedy_head's approximate pass).
template <typename W, int RS = 0, int XL = 3>
SD_AMXBF16 void amxb_rows(const uint16_t* xl, int64_t Mp, int64_t m0, int64_t h, int64_t nrb, int64_t K, const W* w,
                          int64_t wstride, const uint16_t* gs, int64_t gstride, int64_t np, float* acc) {
  constexpr bool Q4 = std::is_same<W, uint8_t>::value;
  constexpr int L = amxb_limbs<W>;
  alignas(64) uint16_t bl[2][2 * L * 512];
  alignas(64) float tmp[4 * AMX_ROWS * NR];
  const int64_t R = nrb * h, nb = K / AMXB_K;
  static_assert(RS == 0 || Q4, "register sums are int4's");
  __m512 ra[2][RS > 0 ? RS : 1];
  if constexpr (RS > 0) {
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q)
#pragma GCC unroll 16
      for (int r = 0; r < RS; ++r) ra[q][r] = _mm512_setzero_ps();
  } else if constexpr (Q4) {
    for (int64_t i = 0; i < np * R; ++i) _mm512_storeu_ps(acc + i * NR, _mm512_setzero_ps());
  }
  float* const sums = Q4 ? tmp : acc;  // where the tiles are stored: [np][R][NR]
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  amxb_block(w, wstride, np, 0, bl[0]);
  for (int64_t b = 0; b < nb; ++b) {
    const uint16_t* B = bl[b & 1];
    if (Q4 && b > 0) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    int round = 0;  // of the block's tile products
    for (int j = 0; j < L; ++j) {
      _tile_loadd(4, B + j * 512, 64);
      if (np == 2) _tile_loadd(5, B + (L + j) * 512, 64);
      for (int i = 0; i + j <= 2 && i < XL; ++i) {
        const uint16_t* a = xl + ((b * 3 + i) * Mp + m0) * AMXB_K;
        _tile_loadd(6, a, AMXB_K * 2);
        if (nrb == 2) _tile_loadd(7, a + h * AMXB_K, AMXB_K * 2);
        _tile_dpbf16ps(0, 6, 4);
        if (nrb == 2) _tile_dpbf16ps(1, 7, 4);
        if (np == 2) _tile_dpbf16ps(2, 6, 5);
        if (nrb == 2 && np == 2) _tile_dpbf16ps(3, 7, 5);
        if constexpr (!std::is_same<W, uint16_t>::value) {
          // The lines of the block PF_BYTES ahead (both panels), a share of them after each of this
          // block's rounds of tile products (six with fp32 panels, three with int8 and int4; past
          // the pair's last block, the next pair's first: the panels after these in memory). Asked
          // for as the B tiles were made, they came in one burst a block, and a profile at 32 rows
          // had the making wait on those requests. Spread, fp32 decode steps at 32 rows ran 1.038x
          // faster at full depth, 1.043x at 3x, 1.027x at 5x; bf16 (unchanged) 1.010x
          // (benchmarks/results/xeon-amx/kernel-ab-f32-tiles-spread-prefetch.json); int8 1.089x
          // faster at 8 rows and 1.051x at 32, int4 1.078x and 1.022x
          // (xeon-amx/kernel-ab-tiles-spread-prefetch-int8-int4.json). bf16 panels keep their
          // requests: spread, their steps at 32 rows ran 0.960x (4 blocks ahead) and 0.985x (2), at
          // 8 rows 1.068x and 1.035x (kernel-ab-tiles-spread-prefetch-bf16-int8-int4.json,
          // -bf16-2-blocks.json).
          constexpr int64_t BB = AMXB_K * NR * sizeof(W) / (Q4 ? 2 : 1);  // bytes of a panel's block
          constexpr int64_t D = PF_BYTES / BB, LB = BB / 64, ROUNDS = L == 3 ? 6 : 3;
          constexpr int64_t PER = (2 * LB + ROUNDS - 1) / ROUNDS;
          const char* base = reinterpret_cast<const char*>(w);
          const int64_t ps = wstride * static_cast<int64_t>(sizeof(W));
          const char* f = b + D < nb ? base + (b + D) * BB : base + np * ps + (b + D - nb) * BB;
          for (int64_t l = round * PER; l < std::min<int64_t>(2 * LB, (round + 1) * PER); ++l)
            _mm_prefetch(f + (l / LB) * ps + (l % LB) * 64, _MM_HINT_T0);
        }
        ++round;
      }
    }
    if (b + 1 < nb) amxb_block(w, wstride, np, (b + 1) * AMXB_K, bl[(b + 1) & 1]);
    if (Q4 || b + 1 == nb) {
      _tile_stored(0, sums, NR * 4);
      if (nrb == 2) _tile_stored(1, sums + h * NR, NR * 4);
      if (np == 2) {
        _tile_stored(2, sums + R * NR, NR * 4);
        if (nrb == 2) _tile_stored(3, sums + (R + h) * NR, NR * 4);
      }
    }
    if constexpr (RS > 0) {
#pragma GCC unroll 2
      for (int q = 0; q < 2; ++q)
        if (q < np) {
          const __m512 sc = load_w16(gs + q * gstride + b * NR);
#pragma GCC unroll 16
          for (int r = 0; r < RS; ++r)
            if (r < R) ra[q][r] = _mm512_fmadd_ps(_mm512_load_ps(tmp + (q * R + r) * NR), sc, ra[q][r]);
        }
    } else if constexpr (Q4) {
      for (int64_t q = 0; q < np; ++q) {
        const __m512 sc = load_w16(gs + q * gstride + b * NR);
        for (int64_t r = 0; r < R; ++r) {
          float* a = acc + (q * R + r) * NR;
          _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_load_ps(tmp + (q * R + r) * NR), sc, _mm512_loadu_ps(a)));
        }
      }
    }
  }
  if constexpr (RS > 0) {
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q)
#pragma GCC unroll 16
      for (int r = 0; r < RS; ++r)
        if (q < np && r < R) _mm512_storeu_ps(acc + (q * R + r) * NR, ra[q][r]);
  }
}

// y = x @ W^T (+ bias) (+ res) on the tile unit, any panel dtype (sa: int8 column scales; gs: int4
// group scales): threads take pairs of panels; rows in groups of up to two row blocks of at most 16
// (as even as they can be), each group running over all of K with its sums in the tiles. XL: as
// amxb_rows's.
template <typename W, int XL = 3>
void linear_amx_bf16(const float* xa, int64_t M, const W* wa, int64_t K, int64_t NP, const float* sa,
                     const uint16_t* gs, const float* ba, int64_t n, float* ya, const float* res) {
  constexpr bool Q4 = std::is_same<W, uint8_t>::value;
  const int64_t nrb = (M + AMX_ROWS - 1) / AMX_ROWS, h = (M + nrb - 1) / nrb, Mp = nrb * h;
  const int64_t wstride = Q4 ? K * (NR / 2) : K * NR, gstride = (K / G4) * NR;
  const int64_t NPP = (NP + 1) / 2;
  parallel_steal(NPP, 1, [&](const auto& next) {
    // Each thread splits x into limbs of its own: written where it reads them, where one copy made
    // before the threads start kept the others waiting and went to their caches line by line.
    thread_local std::vector<uint16_t> limbs;
    limbs.resize(3 * Mp * K);
    const uint16_t* xl = limbs.data();
    split_rows_bf16(xa, M, Mp, K, limbs.data());
    amxb_configure(h);
    alignas(64) float acc[2 * 2 * AMX_ROWS * NR];  // two panels x two row blocks, as linear_panels_amx keeps its sums
    for (int64_t p0, p1; next(p0, p1);)
      for (int64_t pp = p0; pp < p1; ++pp) {
        const int64_t p = 2 * pp, np = std::min<int64_t>(2, NP - p);
        for (int64_t g = 0; g < nrb; g += 2) {
          const int64_t gb = std::min<int64_t>(2, nrb - g), m0 = g * h, rows = std::min(gb * h, M - m0);
          const uint16_t* g4 = Q4 ? gs + p * gstride : nullptr;
          if (Q4 && gb * h <= 8)  // 16 registers hold the int4 sums of two panels
            amxb_rows<W, Q4 ? 8 : 0>(xl, Mp, m0, h, gb, K, wa + p * wstride, wstride, g4, gstride, np, acc);
          else
            amxb_rows<W, 0, XL>(xl, Mp, m0, h, gb, K, wa + p * wstride, wstride, g4, gstride, np, acc);
          for (int64_t q = 0; q < np; ++q)
            store_rows(rows, acc + q * gb * h * NR, ya + m0 * n + (p + q) * NR, n,
                       std::min(NR, n - (p + q) * NR), sa ? sa + (p + q) * NR : nullptr,
                       ba ? ba + (p + q) * NR : nullptr, res ? res + m0 * n + (p + q) * NR : nullptr);
        }
      }
    amx_release();
  });
}

// A few rows (3 M <= 16) of int4 panels on the tiles with each row's three limbs stacked in one A
// tile: split_rows_bf16 with Mp = M puts limb i of row m at tile row i M + m of its block, so one
// tile product per block and panel takes all three limbs of every row, where amxb_rows takes three
// (one a limb). Tiles: C 0 / 2 the sums of panel 0 / 1, each limb's apart (3 M rows); B 4 / 5 the
// panels' block; A 6 the block's limbs. Per block, a row's limbs are added (limb 2 + limb 1, then +
// limb 0) as its sums leave the tiles, times the group scales, into registers. Each row's sums are
// its own tile rows: a row's outputs are the same bits in calls of 4 and 5 rows. Decode steps on an
// Intel Xeon (AMX) against the FMA forms: 1.10x faster at 4 rows, 1.12x at 5, 1.09x at 4 rows and
// 3x (benchmarks/results/xeon-amx/kernel-ab-int4-stacked-limbs.json, whose 1- and 3-row cases run
// the FMA forms in both and read 1.00x and 0.98x). At 3 rows a first run had the stacked form even
// with the FMA forms; at 1-2 rows the codes' widening to bf16 costs what the FMA forms' widening and
// FMAs do while the tile products have little to do. A cheaper widening (a shift and one ternary
// logic op a tile row, the bf16 of 16 + the code) did not change that: 0.90x at 1 row, 0.99x at 2,
// 1.04x at 3, 1.02x at 4 (xeon-amx/kernel-ab-int4-stacked-from-1.json). int8 and bf16 panels (one
// limb too) were no faster in GEMMs of 1-5 rows, so this form is int4's alone.
constexpr int64_t AMXS_MAX = AMX_ROWS / 3, AMXS_MIN_INT4 = 4;

// Row r's sum over its three limbs from stored C-tile rows t (3 M rows of NR).
SD_AVX512 static inline __m512 limb_sum(const float* t, int64_t r, int64_t M) {
  return _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(t + (2 * M + r) * NR), _mm512_load_ps(t + (M + r) * NR)),
                       _mm512_load_ps(t + r * NR));
}

// Rows 0 .. M - 1 x np (1 or 2) int4 panels over all of K: x's limbs in xl (split_rows_bf16, Mp =
// M), the panels' codes at w (wstride apart; amxb_block), their group scales at gs (gstride apart).
// Sums to acc [np][M][NR].
SD_AMXBF16 void amxs_rows(const uint16_t* xl, int64_t M, int64_t K, const uint8_t* w, int64_t wstride,
                          const uint16_t* gs, int64_t gstride, int64_t np, float* acc) {
  alignas(64) uint16_t bl[2][2 * 512];
  alignas(64) float tmp[2][AMX_ROWS * NR];
  const int64_t nb = K / AMXB_K, M3 = 3 * M;
  __m512 ra[2][AMXS_MAX];
#pragma GCC unroll 2
  for (int q = 0; q < 2; ++q)
#pragma GCC unroll 5
    for (int r = 0; r < AMXS_MAX; ++r) ra[q][r] = _mm512_setzero_ps();
  amxb_block(w, wstride, np, 0, bl[0]);
  for (int64_t b = 0; b < nb; ++b) {
    const uint16_t* B = bl[b & 1];
    _tile_zero(0);
    _tile_zero(2);
    _tile_loadd(4, B, 64);
    if (np == 2) _tile_loadd(5, B + 512, 64);
    _tile_loadd(6, xl + b * M3 * AMXB_K, AMXB_K * 2);
    _tile_dpbf16ps(0, 6, 4);
    if (np == 2) _tile_dpbf16ps(2, 6, 5);
    if (b + 1 < nb) amxb_block(w, wstride, np, (b + 1) * AMXB_K, bl[(b + 1) & 1]);
    _tile_stored(0, tmp[0], NR * 4);
    if (np == 2) _tile_stored(2, tmp[1], NR * 4);
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q)
      if (q < np) {
        const __m512 sc = load_w16(gs + q * gstride + b * NR);
#pragma GCC unroll 5
        for (int r = 0; r < AMXS_MAX; ++r)
          if (r < M) ra[q][r] = _mm512_fmadd_ps(limb_sum(tmp[q], r, M), sc, ra[q][r]);
      }
  }
#pragma GCC unroll 2
  for (int q = 0; q < 2; ++q)
#pragma GCC unroll 5
    for (int r = 0; r < AMXS_MAX; ++r)
      if (q < np && r < M) _mm512_storeu_ps(acc + (q * M + r) * NR, ra[q][r]);
}

// y = x @ W^T (+ bias) (+ res) for M <= AMXS_MAX rows of int4 panels (amxs_rows): threads take
// pairs of panels, each splitting x into limbs of its own (as linear_amx_bf16).
void linear_amx_stacked(const float* xa, int64_t M, const uint8_t* wa, int64_t K, int64_t NP, const uint16_t* gs,
                        const float* ba, int64_t n, float* ya, const float* res) {
  const int64_t wstride = K * (NR / 2), gstride = (K / G4) * NR, NPP = (NP + 1) / 2;
  parallel_steal(NPP, 1, [&](const auto& next) {
    thread_local std::vector<uint16_t> limbs;
    limbs.resize(3 * M * K);
    split_rows_bf16(xa, M, M, K, limbs.data());
    amxb_configure(3 * M);  // A / C tiles of 3 M rows (1, 3 and 7 go unused)
    alignas(64) float acc[2 * AMXS_MAX * NR];
    for (int64_t p0, p1; next(p0, p1);)
      for (int64_t pp = p0; pp < p1; ++pp) {
        const int64_t p = 2 * pp, np = std::min<int64_t>(2, NP - p);
        amxs_rows(limbs.data(), M, K, wa + p * wstride, wstride, gs + p * gstride, gstride, np, acc);
        for (int64_t q = 0; q < np; ++q)
          store_rows(M, acc + q * M * NR, ya + (p + q) * NR, n, std::min(NR, n - (p + q) * NR), nullptr,
                     ba ? ba + (p + q) * NR : nullptr, res ? res + (p + q) * NR : nullptr);
      }
    amx_release();
  });
}

// The rows from which linear_into takes the tiles for panels of this dtype (0: never).
int64_t amx_bf16_min_rows(at::ScalarType dt) {
  if (!g_amx_bf16 || !g_avx512) return 0;  // the AVX2 form (SKIPDECODE_ISA=avx2) runs what an AVX2 CPU does
  switch (dt) {
    case torch::kBFloat16: return AMXB_MIN_BF16;
    case torch::kChar: return AMXB_MIN_INT8;
    case torch::kByte: return AMXB_MIN_INT4;
    case torch::kFloat: return AMXB_MIN_F32;
    default: return 0;
  }
}

// y = x @ W^T (+ bias) (+ res) over int8 panels (sa: per-column scales) or int4 panels (gs: group
// scales), the activations quantized to int8 first (QuantX; A16: in two limbs).
template <bool Q4, bool A16>
void linear_panels_a8(const float* xa, int64_t M, const void* wa, int64_t K, int64_t NP, const float* sa,
                      const uint16_t* gs, const float* ba, int64_t n, float* ya, const float* res) {
  QuantX qx;
  quantize_rows(xa, M, K, qx, A16);
  if (g_a8 == A8_AMX && M >= (Q4 || A16 ? AMX_MIN_ROWS : AMX_MIN_ROWS_W8A8))
    return linear_panels_amx<Q4, A16>(qx, M, wa, K, NP, sa, gs, ba, n, ya, res);
  if (g_a8 >= A8_VNNI && M >= tile_min_rows(Q4, A16))
    return linear_tiles_a8<Q4, A16>(qx, M, wa, K, NP, sa, gs, ba, n, ya, res);
  const int64_t nb = qx.nb;
  // 12 rows per micro-kernel (12 int32 and 12 fp32 sums of 32 registers): each 4 k of weights is
  // loaded (and int4 decoded) once for up to 12 rows; 8 with two limbs (two int32 sums a row)
  panel_loop(M, K, NP, A16 ? 8 : 12, [&](int64_t p, int64_t k0, int64_t kc, int64_t m, int64_t r, float* acc) {
    const int64_t ncols = std::min(NR, n - p * NR);
    const float* bp = ba ? ba + p * NR : nullptr;
    const float* sp = sa ? sa + p * NR : nullptr;
    const bool first = k0 == 0, last = k0 + kc == K;
    const void* w = Q4 ? static_cast<const void*>(static_cast<const uint8_t*>(wa) + (p * K + k0) * (NR / 2))
                       : static_cast<const void*>(static_cast<const int8_t*>(wa) + (p * K + k0) * NR);
    const uint16_t* g = Q4 ? gs + (p * (K / G4) + k0 / G4) * NR : nullptr;
    const int8_t* xq = qx.q.data() + m * K + k0;
    const int8_t* xl = A16 ? qx.ql.data() + m * K + k0 : nullptr;
    const float* xs = qx.s.data() + m * nb + k0 / QB;
    const int32_t* xsum = qx.sum.data() + m * nb + k0 / QB;
    float* yp = ya + m * n + p * NR;
    const float* rp = res ? res + m * n + p * NR : nullptr;
    if (g_a8 >= A8_VNNI)
      row_block_a8<Q4, A16>(r, xq, xl, xs, xsum, K, nb, w, g, kc, acc, first, last, yp, n, ncols, sp, bp, rp);
    else if (g_a8 == A8_AVX2)
      row_block_a8_avx2<Q4, A16>(r, xq, xl, xs, xsum, K, nb, w, g, kc, acc, first, last, yp, n, ncols, sp, bp, rp);
    else
      row_block_a8_portable<Q4, A16>(r, xq, xl, xs, xsum, K, nb, w, g, kc, acc, first, last, yp, n, ncols, sp, bp,
                                     rp);
  });
}

// int8 (kChar, per-column scales) or int4 (kByte, group scales) panels with integer activations.
template <bool A16>
void linear_into_a8(const float* xa, int64_t M, const torch::Tensor& packed, const c10::optional<torch::Tensor>& scale,
                    int64_t K, int64_t NP, const float* ba, int64_t n, float* ya, const float* res) {
  if (packed.scalar_type() == torch::kByte)
    return linear_panels_a8<true, A16>(xa, M, packed.data_ptr<uint8_t>(), K, NP, nullptr,
                                       reinterpret_cast<const uint16_t*>(scale->data_ptr<at::BFloat16>()), ba, n, ya,
                                       res);
  linear_panels_a8<false, A16>(xa, M, packed.data_ptr<int8_t>(), K, NP, scale->data_ptr<float>(), nullptr, ba, n, ya,
                               res);
}

// a8: how int8 or int4 panels take the activations (linear_panels_a8; K % 32 == 0): A_FP32 as they
// are (widened weights), A_INT8 quantized to int8, A_TWO_LIMBS to 15 bits in two int8 limbs.
enum ActForm { A_FP32 = 0, A_INT8 = 1, A_TWO_LIMBS = 2 };
void linear_into(const float* xa, int64_t M, const torch::Tensor& packed, const c10::optional<torch::Tensor>& scale,
                 const float* ba, int64_t n, float* ya, const float* res, int64_t a8 = A_FP32) {
  const int64_t K = packed.size(1) * (packed.scalar_type() == torch::kByte ? 2 : 1), NP = packed.size(0);
  if (M == 0) return;
  if (a8)  // check_a8: int8 or int4 panels
    return a8 == A_TWO_LIMBS ? linear_into_a8<true>(xa, M, packed, scale, K, NP, ba, n, ya, res)
                             : linear_into_a8<false>(xa, M, packed, scale, K, NP, ba, n, ya, res);
  const auto dt = packed.scalar_type();
  const int64_t amx = amx_bf16_min_rows(dt);
  if (amx && dt == torch::kByte && M >= AMXS_MIN_INT4 && M <= AMXS_MAX && K % AMXB_K == 0)
    return linear_amx_stacked(xa, M, packed.data_ptr<uint8_t>(), K, NP,
                              reinterpret_cast<const uint16_t*>(scale->data_ptr<at::BFloat16>()), ba, n, ya, res);
  if (amx && M >= amx && K % AMXB_K == 0) {
    const float* sa = dt == torch::kChar ? scale->data_ptr<float>() : nullptr;
    switch (dt) {
      case torch::kByte:
        return linear_amx_bf16(xa, M, packed.data_ptr<uint8_t>(), K, NP, sa,
                               reinterpret_cast<const uint16_t*>(scale->data_ptr<at::BFloat16>()), ba, n, ya, res);
      case torch::kBFloat16:
        return linear_amx_bf16(xa, M, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), K, NP, sa,
                               nullptr, ba, n, ya, res);
      case torch::kFloat:
        return linear_amx_bf16(xa, M, packed.data_ptr<float>(), K, NP, sa, nullptr, ba, n, ya, res);
      default:  // kChar (amx_bf16_min_rows takes no other dtype)
        return linear_amx_bf16(xa, M, packed.data_ptr<int8_t>(), K, NP, sa, nullptr, ba, n, ya, res);
    }
  }
  if (M >= (dt == torch::kFloat ? WIDE_MIN_F32 : dt == torch::kByte ? WIDE_MIN_INT4 : WIDE_MIN_INT8)) {
    const float* sa = packed.scalar_type() == torch::kChar ? scale->data_ptr<float>() : nullptr;
    switch (packed.scalar_type()) {
      case torch::kByte:
        return linear_wide(xa, M, packed.data_ptr<uint8_t>(), K, NP, sa,
                           reinterpret_cast<const uint16_t*>(scale->data_ptr<at::BFloat16>()), ba, n, ya, res);
      case torch::kBFloat16:
        return linear_wide(xa, M, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), K, NP, sa,
                           nullptr, ba, n, ya, res);
      case torch::kChar:
        return linear_wide(xa, M, packed.data_ptr<int8_t>(), K, NP, sa, nullptr, ba, n, ya, res);
      default:
        if (M >= STREAM_MIN_F32)
          return linear_stream_f32(xa, M, packed.data_ptr<float>(), K, NP, ba, n, ya, res);
        return linear_wide(xa, M, packed.data_ptr<float>(), K, NP, sa, nullptr, ba, n, ya, res);
    }
  }
  if (packed.scalar_type() == torch::kByte)
    linear_panels_q4(xa, M, packed.data_ptr<uint8_t>(), K, NP,
                     reinterpret_cast<const uint16_t*>(scale->data_ptr<at::BFloat16>()), ba, n, ya, res);
  else if (packed.scalar_type() == torch::kBFloat16)
    linear_panels(xa, M, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), K, NP, nullptr, ba, n,
                  ya, res);
  else if (packed.scalar_type() == torch::kChar)
    linear_panels(xa, M, packed.data_ptr<int8_t>(), K, NP, scale->data_ptr<float>(), ba, n, ya, res);
  else
    linear_panels(xa, M, packed.data_ptr<float>(), K, NP, nullptr, ba, n, ya, res);
}

void check_packed(const torch::Tensor& packed, int64_t k, int64_t n, const c10::optional<torch::Tensor>& bias,
                  const c10::optional<torch::Tensor>& scale) {
  const auto t = packed.scalar_type();
  check(t == torch::kFloat || t == torch::kBFloat16 || t == torch::kChar || t == torch::kByte,
        "weight panels must be float32, bfloat16, int8 or int4 (two per uint8)");
  check(packed.dim() == 3 && packed.size(2) == NR && packed.is_contiguous(), "weight is not packed");
  check(packed.size(1) == (t == torch::kByte ? k / 2 : k) && (n + NR - 1) / NR == packed.size(0), "shape mismatch");
  if (bias.has_value())
    check(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == n, "bias");
  check((t == torch::kChar || t == torch::kByte) == scale.has_value(),
        "int8 and int4 panels take their scales, other panels none");
  if (scale.has_value() && t == torch::kChar)
    check(scale->scalar_type() == torch::kFloat && scale->is_contiguous() && scale->numel() == packed.size(0) * NR,
          "scales must be contiguous float32, one per padded output column");
  if (scale.has_value() && t == torch::kByte)
    check(k % G4 == 0 && scale->scalar_type() == torch::kBFloat16 && scale->is_contiguous() &&
          scale->numel() == packed.size(0) * (k / G4) * NR,
          "int4 panels need K divisible by 32 and contiguous bfloat16 scales [panels, K / 32, 16]");
}

void check_a8(const torch::Tensor& packed, int64_t k, int64_t a8) {
  check(a8 >= A_FP32 && a8 <= A_TWO_LIMBS, "a8 must be 0 (fp32 activations), 1 (int8) or 2 (two int8 limbs)");
  if (a8)
    check((packed.scalar_type() == torch::kChar || packed.scalar_type() == torch::kByte) && k % QB == 0,
          "int8 activations need int8 or int4 panels and K divisible by 32");
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                     int64_t n, const c10::optional<torch::Tensor>& scale, int64_t a8) {
  check(x.scalar_type() == torch::kFloat, "float32 only");
  const int64_t K = x.size(-1);
  check_packed(packed, K, n, bias, scale);
  check_a8(packed, K, a8);
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  const auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto y = torch::empty({M, n}, x.options());
  linear_into(x2.data_ptr<float>(), M, packed, scale, bias.has_value() ? bias->data_ptr<float>() : nullptr, n,
              y.data_ptr<float>(), nullptr, a8);
  return y.view(out_shape);
}

// linear's GEMM `repeats` times on the same x and weights, no Python between the calls (time it):
// weights of up to a few MB stay in the caches from the second call on, so the rate is what the
// kernels' arithmetic allows a call (threads, decode, FMAs), the roof a call streaming its weights
// from memory cannot pass. For the benchmarks; returns the last call's output.
torch::Tensor linear_repeat(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                            const c10::optional<torch::Tensor>& scale, int64_t a8, int64_t repeats) {
  check(x.scalar_type() == torch::kFloat, "float32 only");
  check(repeats >= 1, "repeats must be >= 1");
  const int64_t K = x.size(-1);
  check_packed(packed, K, n, c10::nullopt, scale);
  check_a8(packed, K, a8);
  const auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto y = torch::empty({M, n}, x.options());
  for (int64_t i = 0; i < repeats; ++i)
    linear_into(x2.data_ptr<float>(), M, packed, scale, nullptr, n, y.data_ptr<float>(), nullptr, a8);
  return y;
}

// Llama's RMSNorm in HF's order: w * (x * rsqrt(mean(x^2) + eps)), of `rows` rows of D.
void rms_norm_rows(const float* xa, int64_t rows, int64_t D, const float* wa, float eps, float* ya) {
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xa + r * D;
      float* yr = ya + r * D;
      __m256 acc = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= D; i += 8) {
        const __m256 v = _mm256_loadu_ps(xr + i);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      float ss = hsum(acc);
      for (; i < D; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / float(D) + eps);
      const __m256 iv = _mm256_set1_ps(inv);
      for (i = 0; i + 8 <= D; i += 8)
        _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_loadu_ps(wa + i), _mm256_mul_ps(_mm256_loadu_ps(xr + i), iv)));
      for (; i < D; ++i) yr[i] = wa[i] * (xr[i] * inv);
    }
  });
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat, "float32 only");
  const int64_t D = x.size(-1);
  check(weight.numel() == D, "norm weight size");
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  auto y = torch::empty_like(xc);
  rms_norm_rows(xc.data_ptr<float>(), xc.numel() / D, D, wc.data_ptr<float>(), float(eps), y.data_ptr<float>());
  return y;
}

// A KV pool's element: float32, or float16 / bfloat16 (half the bytes a decode step reads per
// key and value; llama.cpp's default cache type is float16). Keys and values are rounded to
// nearest-even when stored, exactly as torch's .to(dtype), and widened to fp32 when read, so
// attention runs in fp32 on the stored values whatever the pool's type.
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const c10::Half* p) {  // F16C
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline __m256 load8(const c10::BFloat16* p) {  // a bf16 is the high half of its fp32
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
// n values (n a multiple of 8: a head) rounded to the pool's element as c10's conversions round
// them (to nearest-even; a NaN stays a NaN), 8 at a time: c10's scalar conversions had taken 1.4-1.8 ms
// of a 32-row step on an AMD EPYC (benchmarks/results/epyc/kernel-ab-kv-store-vectorized.json).
static inline void store_kv(const float* src, int64_t n, float* dst) { std::memcpy(dst, src, n * sizeof(float)); }
static inline void store_kv(const float* src, int64_t n, c10::Half* dst) {  // F16C
  for (int64_t i = 0; i < n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline void store_kv(const float* src, int64_t n, c10::BFloat16* dst) {
  const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7FFF), qnan = _mm256_set1_epi32(0x7FC0);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);  // ties to the even bf16
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, half), lsb), 16);
    r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);  // 8 x 16 bits, in order
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(packed));
  }
}

// Weighted values of one (row, KV head) task for NG query heads and NV * 8
// dimensions: NG x NV accumulators stay in registers while every value row is
// read once. p holds the softmax weights (row stride sp); masked keys are not read.
// pf: rows (pfs bytes apart, pfn of them) to ask for while the values are read: the next task's keys.
template <int NG, int NV, typename KT>
static inline void weighted_values(const float* p, int64_t sp, const KT* v, int64_t vs, int64_t S, const bool* mb,
                                   float* o, int64_t hd, const char* pf, int64_t pfs, int64_t pfn) {
  __m256 acc[NG][NV];
  for (int i = 0; i < NG; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    if (s < pfn)
      for (int64_t l = 0; l < pfs; l += 64) _mm_prefetch(pf + s * pfs + l, _MM_HINT_T0);
    if (mb && !mb[s]) continue;
    const KT* vr = v + s * vs;
    __m256 vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load8(vr + 8 * j);
    for (int i = 0; i < NG; ++i) {
      const __m256 w = _mm256_set1_ps(p[i * sp + s]);
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_fmadd_ps(w, vv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < NG; ++i)
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(o + i * hd + 8 * j, acc[i][j]);
}

template <int NV, typename KT>
static inline void weighted_values_ng(int ng, const float* p, int64_t sp, const KT* v, int64_t vs, int64_t S,
                                      const bool* mb, float* o, int64_t hd, const char* pf, int64_t pfs, int64_t pfn) {
  switch (ng) {
    case 3: return weighted_values<3, NV>(p, sp, v, vs, S, mb, o, hd, pf, pfs, pfn);
    case 2: return weighted_values<2, NV>(p, sp, v, vs, S, mb, o, hd, pf, pfs, pfn);
    default: return weighted_values<1, NV>(p, sp, v, vs, S, mb, o, hd, pf, pfs, pfn);
  }
}

// Each of the G rows of p (its first S scores, Sp a multiple of 8; masked keys' scores taken as
// -inf) turned into its softmax in place, the padding to Sp zero.
static inline void softmax_rows(float* p, int64_t G, int64_t S, int64_t Sp, const bool* mb) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < G; ++i) {
    float* pi = p + i * Sp;
    if (mb)
      for (int64_t s2 = 0; s2 < S; ++s2)
        if (!mb[s2]) pi[s2] = ninf;
    for (int64_t s2 = S; s2 < Sp; ++s2) pi[s2] = ninf;
    __m256 mx = _mm256_set1_ps(ninf);
    for (int64_t s2 = 0; s2 < Sp; s2 += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(pi + s2));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_shuffle_ps(m4, m4, 0x4e));
    m4 = _mm_max_ps(m4, _mm_shuffle_ps(m4, m4, 0xb1));
    const __m256 m8 = _mm256_set1_ps(_mm_cvtss_f32(m4));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t s2 = 0; s2 < Sp; s2 += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(pi + s2), m8));
      _mm256_storeu_ps(pi + s2, e);
      sum = _mm256_add_ps(sum, e);
    }
    const __m256 inv = _mm256_set1_ps(1.f / hsum(sum));
    for (int64_t s2 = 0; s2 < Sp; s2 += 8) _mm256_storeu_ps(pi + s2, _mm256_mul_ps(_mm256_loadu_ps(pi + s2), inv));
  }
}

// Where one row's keys and values are: row b, KV head g reads len(b) slots
// from kptr(b, g) on, `ks`/`vs` elements apart. Either a dense cache
// [B, KVH, S, hd] (every row S slots from slot 0) or a KV pool [KVH, slots, hd]
// where row b owns slots start(b) .. start(b) + len(b) - 1. KT: the element (load8's types).
template <typename KT>
struct KVView {
  const KT* k;
  const KT* v;
  int64_t kb, kg, ks, vb, vg, vs;  // strides in elements: row, head, slot
  const int64_t* rows = nullptr;   // pool: [B, 2] (start, len); dense: null
  int64_t S = 0;                   // dense: slots per row
  const KT* kptr(int64_t b, int64_t g) const { return k + (rows ? rows[2 * b] * ks : b * kb) + g * kg; }
  const KT* vptr(int64_t b, int64_t g) const { return v + (rows ? rows[2 * b] * vs : b * vb) + g * vg; }
  int64_t len(int64_t b) const { return rows ? rows[2 * b + 1] : S; }
};

// ---- The AVX-512 form of attention (hd a multiple of 16, up to 128; set_isa chooses it as it
// chooses the micro-kernels'). A key is loaded and widened once for every query of its group
// (the AVX2 form widens it once per query), 8 keys at a time: NG x 8 accumulators, one FMA chain
// per (query, key) over the head's 16-wide chunks, then each chain's 16 lanes added in one tree.
// A key's score does not depend on where it falls among the 8 (the tail's single keys take the
// same tree), so a row's scores are the same whatever its length or padding. The softmax is the
// AVX2 form's and the weighted values are the same FMA chains, 16 dimensions a register: outputs
// differ from the AVX2 form's only in how each score's products are added.
SD_AVX512 static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
SD_AVX512 static inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
SD_AVX512 static inline __m512 load16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// The 16 lanes of a halved to 8 (lane m + lane m + 8): the first step of every score's tree.
SD_AVX512 static inline __m256 fold16(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
}

// The sums of 8 chains' lanes, one per lane: ((h0 + h1) + (h2 + h3)) + ((h4 + h5) + (h6 + h7))
// of each chain's folded lanes h.
SD_AVX512 static inline __m256 sums8(const __m512* a) {
  const __m256 t0 = _mm256_hadd_ps(fold16(a[0]), fold16(a[1])), t1 = _mm256_hadd_ps(fold16(a[2]), fold16(a[3]));
  const __m256 t2 = _mm256_hadd_ps(fold16(a[4]), fold16(a[5])), t3 = _mm256_hadd_ps(fold16(a[6]), fold16(a[7]));
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The same tree for one chain.
SD_AVX512 static inline float sum1(__m512 a) {
  const __m256 h = fold16(a);
  const __m256 t = _mm256_hadd_ps(h, h), u = _mm256_hadd_ps(t, t);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
}

// Scores of 8 keys (k, ks elements apart) for NG queries (q, hd apart), times sc, into p[i * sp + j].
template <int NG, int ND, typename KT>
SD_AVX512 static inline void scores8(const float* q, int64_t hd, const KT* k, int64_t ks, float sc, float* p,
                                     int64_t sp) {
  __m512 a[NG][8];
#pragma GCC unroll 8
  for (int c = 0; c < ND; ++c) {
    __m512 qc[NG];
    for (int i = 0; i < NG; ++i) qc[i] = _mm512_loadu_ps(q + i * hd + 16 * c);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512 kv = load16(k + j * ks + 16 * c);
      for (int i = 0; i < NG; ++i) a[i][j] = c == 0 ? _mm512_mul_ps(qc[i], kv) : _mm512_fmadd_ps(qc[i], kv, a[i][j]);
    }
  }
  for (int i = 0; i < NG; ++i) _mm256_storeu_ps(p + i * sp, _mm256_mul_ps(sums8(a[i]), _mm256_set1_ps(sc)));
}

template <int ND, typename KT>
SD_AVX512 static inline float score1(const float* q, const KT* k) {
  __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), load16(k));
  for (int c = 1; c < ND; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), load16(k + 16 * c), a);
  return sum1(a);
}

// weighted_values with 16 dimensions a register: NG queries x NV registers of dimensions.
// pf: rows (pfs bytes apart, pfn of them) to ask for while the values are read: the next task's keys.
template <int NG, int NV, typename KT>
SD_AVX512 static inline void weighted_values512(const float* p, int64_t sp, const KT* v, int64_t vs, int64_t S,
                                                const bool* mb, float* o, int64_t hd, const char* pf,
                                                int64_t pfs, int64_t pfn) {
  __m512 acc[NG][NV];
  for (int i = 0; i < NG; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    if (s < pfn)
      for (int64_t l = 0; l < pfs; l += 64) _mm_prefetch(pf + s * pfs + l, _MM_HINT_T0);
    if (mb && !mb[s]) continue;
    const KT* vr = v + s * vs;
    __m512 vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load16(vr + 16 * j);
    for (int i = 0; i < NG; ++i) {
      const __m512 w = _mm512_set1_ps(p[i * sp + s]);
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(w, vv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < NG; ++i)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(o + i * hd + 16 * j, acc[i][j]);
}

template <int NG, typename KT>
SD_AVX512 static inline void weighted_values512_nv(int nv, const float* p, int64_t sp, const KT* v, int64_t vs,
                                                   int64_t S, const bool* mb, float* o, int64_t hd, const char* pf,
                                                   int64_t pfs, int64_t pfn) {
  switch (nv) {
    case 4: return weighted_values512<NG, 4>(p, sp, v, vs, S, mb, o, hd, pf, pfs, pfn);
    case 3: return weighted_values512<NG, 3>(p, sp, v, vs, S, mb, o, hd, pf, pfs, pfn);
    case 2: return weighted_values512<NG, 2>(p, sp, v, vs, S, mb, o, hd, pf, pfs, pfn);
    default: return weighted_values512<NG, 1>(p, sp, v, vs, S, mb, o, hd, pf, pfs, pfn);
  }
}

// One (row, KV head) task: the G queries at qg, keys kb / values vb (ks / vs apart), S of them
// (mb: which to attend to, or null), outputs at ob; p: G rows of Sp scores. nk: the next task's
// first nS keys (or null), asked for while this task reads its values.
template <int ND, typename KT>
SD_AVX512 void attend_task512(const float* qg, int64_t G, const KT* kb, int64_t ks, const KT* vb, int64_t vs,
                              int64_t S, const bool* mb, float sc, float* p, int64_t Sp, float* ob, const KT* nk,
                              int64_t nS) {
  constexpr int64_t hd = 16 * ND, LINE = 64 / sizeof(KT);
  const float ninf = -std::numeric_limits<float>::infinity();
  int64_t s = 0;
  for (; s + 8 <= S; s += 8) {
    bool any = !mb;
    for (int j = 0; j < 8 && !any; ++j) any = mb[s + j];
    if (!any) {
      for (int64_t i = 0; i < G; ++i)
        for (int j = 0; j < 8; ++j) p[i * Sp + s + j] = ninf;
      continue;
    }
    const KT* k0 = kb + s * ks;
    for (int64_t j = 0; j < 8; ++j)  // streams too short for the hardware prefetcher alone
      for (int64_t d = 0; d < hd; d += LINE) {
        if (s + 16 + j < S) _mm_prefetch(reinterpret_cast<const char*>(k0 + (16 + j) * ks + d), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vb + (s + j) * vs + d), _MM_HINT_T1);
      }
    int64_t i = 0;
    for (; i + 3 <= G; i += 3) scores8<3, ND>(qg + i * hd, hd, k0, ks, sc, p + i * Sp + s, Sp);
    if (G - i == 2) scores8<2, ND>(qg + i * hd, hd, k0, ks, sc, p + i * Sp + s, Sp);
    if (G - i == 1) scores8<1, ND>(qg + i * hd, hd, k0, ks, sc, p + i * Sp + s, Sp);
  }
  for (; s < S; ++s)
    for (int64_t i = 0; i < G; ++i) p[i * Sp + s] = score1<ND>(qg + i * hd, kb + s * ks) * sc;
  softmax_rows(p, G, S, Sp, mb);
  for (int64_t d = 0; d < hd; d += 64) {  // weighted values, 64 (or fewer) dimensions x 3 queries in registers
    const int nv = int(std::min<int64_t>(4, (hd - d) / 16));
    for (int64_t i = 0; i < G; i += 3) {
      const float* pi = p + i * Sp;
      const char* pk = reinterpret_cast<const char*>(nk);  // the next task's keys, in the first pass
      const int64_t pfs = hd * int64_t(sizeof(KT)), pfn = d == 0 && i == 0 ? std::min(nS, S) : 0;
      switch (std::min<int64_t>(3, G - i)) {
        case 3: weighted_values512_nv<3>(nv, pi, Sp, vb + d, vs, S, mb, ob + i * hd + d, hd, pk, pfs, pfn); break;
        case 2: weighted_values512_nv<2>(nv, pi, Sp, vb + d, vs, S, mb, ob + i * hd + d, hd, pk, pfs, pfn); break;
        default: weighted_values512_nv<1>(nv, pi, Sp, vb + d, vs, S, mb, ob + i * hd + d, hd, pk, pfs, pfn); break;
      }
    }
  }
}

template <typename KT>
using AttendTask = void (*)(const float*, int64_t, const KT*, int64_t, const KT*, int64_t, int64_t, const bool*, float,
                            float*, int64_t, float*, const KT*, int64_t);

// attend_task512 for a head of hd dimensions, or null where the AVX-512 form has none.
template <typename KT>
AttendTask<KT> attend_task512_for(int64_t hd) {
  switch (hd) {
    case 128: return attend_task512<8, KT>;
    case 112: return attend_task512<7, KT>;
    case 96: return attend_task512<6, KT>;
    case 80: return attend_task512<5, KT>;
    case 64: return attend_task512<4, KT>;
    case 48: return attend_task512<3, KT>;
    case 32: return attend_task512<2, KT>;
    case 16: return attend_task512<1, KT>;
    default: return nullptr;
  }
}

// One decode step of attention, T = 1, q [B, H, hd] contiguous; mask [B, S]
// (dense views only; true = attend) or null. Each task (row, KV head) reads
// its keys and values once for all H / KVH query heads of its group, and skips
// the keys/values of masked (padding) slots. out: [B, H * hd].
template <typename KT>
void attend(const float* qa, int64_t B, int64_t H, int64_t hd, int64_t KVH, const KVView<KT>& kv, const bool* ma,
            float sc, float* oa) {
  const int64_t G = H / KVH;
  constexpr int64_t LINE = 64 / sizeof(KT);  // elements of a 64-byte cache line
  int64_t maxS = 1;
  for (int64_t b = 0; b < B; ++b) maxS = std::max(maxS, kv.len(b));
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t ks = kv.ks, vs = kv.vs;
  const AttendTask<KT> task512 = g_avx512 ? attend_task512_for<KT>(hd) : nullptr;
  at::parallel_for(0, B * KVH, 1, [&](int64_t t0, int64_t t1) {
    const int64_t Spmax = (maxS + 7) / 8 * 8;
    std::vector<float> p(G * Spmax);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / KVH, g = t % KVH;
      const int64_t S = kv.len(b), Sp = (S + 7) / 8 * 8;
      const KT* kb = kv.kptr(b, g);
      const KT* vb = kv.vptr(b, g);
      const float* qg = qa + (b * H + g * G) * hd;
      const bool* mb = ma ? ma + b * kv.S : nullptr;
      // the keys of this thread's next task, asked for while this one reads its values (rows of
      // contiguous keys only): a task's keys are too short a stream for the hardware prefetcher
      const bool more = t + 1 < t1 && ks == hd;
      const KT* nk = more ? kv.kptr((t + 1) / KVH, (t + 1) % KVH) : nullptr;
      const int64_t nS = more ? kv.len((t + 1) / KVH) : 0;
      if (task512) {
        task512(qg, G, kb, ks, vb, vs, S, mb, sc, p.data(), Sp, oa + (b * H + g * G) * hd, nk, nS);
        continue;
      }
      int64_t s = 0;
      for (; s + 4 <= S; s += 4) {  // scores, four keys at a time for every query of the group
        if (mb && !(mb[s] | mb[s + 1] | mb[s + 2] | mb[s + 3])) {
          for (int64_t i = 0; i < G; ++i)
            for (int j = 0; j < 4; ++j) p[i * Sp + s + j] = ninf;
          continue;
        }
        const KT* k0 = kb + s * ks;
        for (int64_t j = 0; j < 4; ++j)  // streams too short for the hardware prefetcher alone
          for (int64_t d = 0; d < hd; d += LINE) {  // (row by row: no integer division per line)
            if (s + 12 <= S) _mm_prefetch(reinterpret_cast<const char*>(k0 + (8 + j) * ks + d), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(vb + (s + j) * vs + d), _MM_HINT_T1);
          }
        for (int64_t i = 0; i < G; ++i) {
          const float* qi = qg + i * hd;
          __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
          for (int64_t d = 0; d < hd; d += 8) {
            const __m256 qd = _mm256_loadu_ps(qi + d);
            a0 = _mm256_fmadd_ps(qd, load8(k0 + d), a0);
            a1 = _mm256_fmadd_ps(qd, load8(k0 + ks + d), a1);
            a2 = _mm256_fmadd_ps(qd, load8(k0 + 2 * ks + d), a2);
            a3 = _mm256_fmadd_ps(qd, load8(k0 + 3 * ks + d), a3);
          }
          const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
          const __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
          _mm_storeu_ps(p.data() + i * Sp + s, _mm_mul_ps(sum4, _mm_set1_ps(sc)));
        }
      }
      for (; s < S; ++s) {
        const KT* kr = kb + s * ks;
        for (int64_t i = 0; i < G; ++i) {
          const float* qi = qg + i * hd;
          __m256 acc = _mm256_setzero_ps();
          for (int64_t d = 0; d < hd; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qi + d), load8(kr + d), acc);
          p[i * Sp + s] = hsum(acc) * sc;
        }
      }
      softmax_rows(p.data(), G, S, Sp, mb);
      float* ob = oa + (b * H + g * G) * hd;
      for (int64_t d = 0; d < hd;) {  // weighted values, 32 (or 8) dimensions x 3 queries in registers
        const bool wide = hd - d >= 32;
        for (int64_t i = 0; i < G; i += 3) {
          const int ng = int(std::min<int64_t>(3, G - i));
          const float* pi = p.data() + i * Sp;
          const char* pk = reinterpret_cast<const char*>(nk);
          const int64_t pfs = hd * int64_t(sizeof(KT)), pfn = d == 0 && i == 0 ? std::min(nS, S) : 0;
          if (wide)
            weighted_values_ng<4>(ng, pi, Sp, vb + d, vs, S, mb, ob + i * hd + d, hd, pk, pfs, pfn);
          else
            weighted_values_ng<1>(ng, pi, Sp, vb + d, vs, S, mb, ob + i * hd + d, hd, pk, pfs, pfn);
        }
        d += wide ? 32 : 8;
      }
    }
  });
}

void check_rows(const torch::Tensor& rows, int64_t B, int64_t slots) {
  check(rows.scalar_type() == torch::kLong && rows.dim() == 2 && rows.size(0) == B && rows.size(1) == 2 &&
        rows.is_contiguous(), "rows must be a contiguous [B, 2] int64 tensor of (start, length)");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    check(r[2 * b] >= 0 && r[2 * b + 1] >= 1 && r[2 * b] + r[2 * b + 1] <= slots, "row slots outside the KV pool");
}

// f(KT{}) with KT the C++ element of a KV pool's dtype (float32, float16 or bfloat16).
template <typename F>
void with_kv_type(const torch::Tensor& t, F&& f) {
  switch (t.scalar_type()) {
    case torch::kFloat: return f(float{});
    case torch::kHalf: return f(c10::Half{});
    case torch::kBFloat16: return f(c10::BFloat16{});
    default: check(false, "keys and values must be float32, float16 or bfloat16");
  }
}

// x (float32, contiguous, a multiple of 8 values) as a decode step stores it into a KV pool of
// dtype's element: the rounding store_kv applies, for tests against torch's .to(dtype).
torch::Tensor kv_round(const torch::Tensor& x, const torch::Tensor& like) {
  check(x.scalar_type() == torch::kFloat && x.is_contiguous() && x.numel() % 8 == 0,
        "kv_round takes a contiguous float32 tensor of a multiple of 8 values");
  auto out = torch::empty(x.sizes(), x.options().dtype(like.scalar_type()));
  with_kv_type(like, [&](auto tag) {
    using KT = decltype(tag);
    store_kv(x.data_ptr<float>(), x.numel(), static_cast<KT*>(out.data_ptr()));
  });
  return out;
}

// Attention of one query position per row. Dense: keys/values [B, KVH, S, hd]
// (any strides along B, KVH and S, e.g. a view of a cache) with an optional
// mask [B, S]. Pool (`rows` given): keys/values [KVH, slots, hd] and row b
// attends to its own slots rows[b, 0] .. rows[b, 0] + rows[b, 1] - 1, so no
// row reads another's slots nor any empty one. Queries float32; keys and values
// float32, float16 or bfloat16 (both the same). Returns [B, 1, H * hd], the
// layout the output projection takes.
torch::Tensor decode_attention(const torch::Tensor& q_in, const torch::Tensor& k, const torch::Tensor& v,
                               const c10::optional<torch::Tensor>& mask_in, double scale,
                               const c10::optional<torch::Tensor>& rows) {
  check(q_in.scalar_type() == torch::kFloat, "queries must be float32");
  check(k.scalar_type() == v.scalar_type(), "keys and values must have one dtype");
  const auto q = q_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), hd = q.size(2);
  check(k.sizes() == v.sizes() && k.size(-1) == hd, "attention shapes");
  check(hd % 8 == 0 && k.stride(-1) == 1 && v.stride(-1) == 1, "head_dim must be a multiple of 8, rows contiguous");
  torch::Tensor mask;
  int64_t KVH;
  int64_t kb = 0, kg, ks, vb = 0, vg, vs, S = 0;
  const int64_t* ra = nullptr;
  if (rows.has_value()) {
    check(k.dim() == 3 && !mask_in.has_value(), "a KV pool is [kv_heads, slots, head_dim], with no mask");
    KVH = k.size(0);
    check_rows(*rows, B, k.size(1));
    kg = k.stride(0), ks = k.stride(1), vg = v.stride(0), vs = v.stride(1);
    ra = rows->data_ptr<int64_t>();
  } else {
    check(k.dim() == 4 && k.size(0) == B, "a dense cache is [B, kv_heads, slots, head_dim]");
    KVH = k.size(1);
    kb = k.stride(0), kg = k.stride(1), ks = k.stride(2);
    vb = v.stride(0), vg = v.stride(1), vs = v.stride(2);
    S = k.size(2);
    if (mask_in.has_value()) {
      mask = mask_in->reshape({B, -1}).to(torch::kBool).contiguous();
      check(mask.size(1) == S, "mask length");
    }
  }
  check(H % KVH == 0, "query heads must be a multiple of KV heads");
  auto out = torch::empty({B, 1, H * hd}, q.options());
  with_kv_type(k, [&](auto tag) {
    using KT = decltype(tag);
    const KVView<KT> kv{static_cast<const KT*>(k.data_ptr()), static_cast<const KT*>(v.data_ptr()), kb, kg, ks, vb,
                        vg, vs, ra, S};
    attend(q.data_ptr<float>(), B, H, hd, KVH, kv, mask.defined() ? mask.data_ptr<bool>() : nullptr, float(scale),
           out.data_ptr<float>());
  });
  return out;
}

// HF's rotate-half RoPE, in place: x[..., :h] = x1 cos - x2 sin and
// x[..., h:] = x2 cos + x1 sin, with cos/sin [B, T, 1, hd] (both halves equal).
// x [B, T, heads, hd] may be a strided view (the q/k part of the fused qkv).
// The same on raw pointers: x rows r = b * T + t at strides sb, st (elements), NH heads at stride sh;
// cos/sin [B * T, hd] contiguous.
void rope_rows(float* xa, int64_t B, int64_t T, int64_t NH, int64_t hd, int64_t sb, int64_t st, int64_t sh,
               const float* ca, const float* sa) {
  const int64_t h = hd / 2;
  at::parallel_for(0, B * T, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / T, t = r % T;
      const float* cr = ca + r * hd;
      const float* sr = sa + r * hd;
      for (int64_t n = 0; n < NH; ++n) {
        float* xr = xa + b * sb + t * st + n * sh;
        for (int64_t i = 0; i < h; ++i) {
          const float x1 = xr[i], x2 = xr[i + h];
          xr[i] = x1 * cr[i] - x2 * sr[i];
          xr[i + h] = x2 * cr[i + h] + x1 * sr[i + h];
        }
      }
    }
  });
}

void rope_(torch::Tensor x, const torch::Tensor& cos_in, const torch::Tensor& sin_in) {
  check(x.scalar_type() == torch::kFloat && x.dim() == 4 && x.stride(3) == 1, "rope input");
  const int64_t B = x.size(0), T = x.size(1), NH = x.size(2), hd = x.size(3);
  const auto c = cos_in.expand({B, T, 1, hd}).contiguous(), s = sin_in.expand({B, T, 1, hd}).contiguous();
  rope_rows(x.data_ptr<float>(), B, T, NH, hd, x.stride(0), x.stride(1), x.stride(2), c.data_ptr<float>(),
            s.data_ptr<float>());
}

// SwiGLU's activation: silu(gate) * up, with [gate | up] the fused w13 output.
void silu_mul_rows(const float* ga, int64_t rows, int64_t I, float* ya) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = ga + r * 2 * I;
      const float* u = g + I;
      float* o = ya + r * I;
      int64_t i = 0;
      const __m256 one = _mm256_set1_ps(1.f);
      for (; i + 8 <= I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
      }
      for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
}

torch::Tensor silu_mul(const torch::Tensor& gu_in) {
  check(gu_in.scalar_type() == torch::kFloat, "float32 only");
  const auto gu = gu_in.contiguous();
  const int64_t I = gu.size(-1) / 2, rows = gu.numel() / (2 * I);
  auto shape = gu.sizes().vec();
  shape.back() = I;
  auto y = torch::empty(shape, gu.options());
  silu_mul_rows(gu.data_ptr<float>(), rows, I, y.data_ptr<float>());
  return y;
}

// Greedy decoding's argmax over the last dimension, with torch.argmax's rules:
// the first maximal index, and the first NaN if there is one. Row-parallel
// and vectorized: torch's took ~0.8 ms for 32 x 49152 logits here.
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  check(logits.scalar_type() == torch::kFloat && logits.dim() == 2, "argmax_rows takes [rows, vocab] float32");
  const auto x = logits.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  check(V > 0, "empty rows");
  auto out = torch::empty({R}, x.options().dtype(torch::kLong));
  const float* xa = x.data_ptr<float>();
  int64_t* oa = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xa + r * V;
      // four independent max chains (a maximum does not depend on the order it is taken in)
      __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      __m256 m1 = mx, m2 = mx, m3 = mx;
      __m256 nan = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 32 <= V; i += 32) {
        const __m256 v0 = _mm256_loadu_ps(xr + i), v1 = _mm256_loadu_ps(xr + i + 8);
        const __m256 v2 = _mm256_loadu_ps(xr + i + 16), v3 = _mm256_loadu_ps(xr + i + 24);
        mx = _mm256_max_ps(mx, v0);
        m1 = _mm256_max_ps(m1, v1);
        m2 = _mm256_max_ps(m2, v2);
        m3 = _mm256_max_ps(m3, v3);
        nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(v0, v1, _CMP_UNORD_Q), _mm256_cmp_ps(v2, v3, _CMP_UNORD_Q)));
      }
      mx = _mm256_max_ps(_mm256_max_ps(mx, m1), _mm256_max_ps(m2, m3));
      for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(xr + i);
        mx = _mm256_max_ps(mx, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      }
      float m = -std::numeric_limits<float>::infinity();
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, mx);
      for (float l : lanes) m = std::max(m, l);
      bool has_nan = _mm256_movemask_ps(nan) != 0;
      for (; i < V; ++i) {
        if (std::isnan(xr[i])) has_nan = true;
        else m = std::max(m, xr[i]);
      }
      int64_t best = -1, j = 0;
      if (!has_nan) {  // the first maximal index, eight at a time
        const __m256 m8 = _mm256_set1_ps(m);
        for (; j + 8 <= V; j += 8) {
          const int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(xr + j), m8, _CMP_EQ_OQ));
          if (bits) { best = j + __builtin_ctz(bits); break; }
        }
      }
      for (; best < 0 && j < V; ++j)
        if (has_nan ? std::isnan(xr[j]) : xr[j] == m) best = j;
      oa[r] = best;
    }
  });
  return out;
}

// ---- Greedy picks from a bf16 pass over an fp32 LM head. The head is about a fifth of the bytes
// a decode step of a small model reads (SmolLM2-135M: 113 of 540 MB), and a greedy step needs only
// each row's argmax. approx holds the head's weights rounded to bf16 (half the bytes) and bound
// [V] a c_n with |approx_n(x) - head_n(x)| <= ||x||_2 c_n for every x, whatever form computes either
// (model.head_bound: the rounding's own norm, fp32 summation, and on the tiles x cut to its top bf16
// half, which takes a third of the tile products x's three limbs would: on an Intel Xeon fp32 steps
// 1.024x faster at 32 rows, 1.032x at 8 rows and 3x, 1.00x at 8 rows at full depth,
// benchmarks/results/xeon-amx/kernel-ab-greedy-head-one-limb.json). So a row's argmax over the exact
// logits lies among the n with a_n + B_n >= max_m (a_m - B_m), B_n = ||x||_2 c_n: on default-e2e
// about 2 token ids a step at one row and 12-21 over 8 rows on average, 48 at most
// (benchmarks/results/xeon-amx/greedy-head-ab.json). Their exact logits are the head's own:
// their fp32 rows (rows [V, K], the dense weight the panels were packed from) packed into panels
// and run through the same linear at the same row count, which picks its form by rows and K alone,
// so each logit is the bits the full head gives it, and the pick is argmax_rows' (the first
// maximal id). A call with a row whose approximate logits are not all finite (or past 1e30), or
// whose x is all but zero, or with more than GREEDY_HEAD_MAX_IDS ids in doubt in all, takes the
// full head.
constexpr int64_t GREEDY_HEAD_MAX_IDS = 4096;

// ---- The bf16 pass of greedy_head by AVX512-BF16 pair dot products (CPUs with them and no turn of
// the tiles: an AMD EPYC's Zen 4 or 5, an Intel Xeon below the tiles' row count). x's top bf16
// half, as the tiles take it and head_bound counts it, times the bf16 panels: vdpbf16ps adds two
// exact products a lane (16 columns, k and k + 1), against an FMA form's widening of each weight
// and one product a lane. The sums are fp32 sums of exact products, as the bound assumes.
#define SD_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
bool g_bf16_dot = false;

// R rows (xp: each row's K / 2 dwords, the top bf16 halves of x[k] low and x[k + 1] high) of one
// bf16 panel w ([K, 16]) into y (row stride ldy, ncols of the 16 columns).
template <int R>
SD_AVX512BF16 static void dot_rows_bf16(const uint32_t* xp, int64_t ldx, const uint16_t* w, int64_t K, float* y,
                                        int64_t ldy, int64_t ncols) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k * NR) + PF_BYTES, _MM_HINT_T0);
    // two panel rows (k, k + 1) are one 64-byte line: word 2 c of the pair takes row k's column c,
    // word 2 c + 1 row k + 1's
    const __m512bh wv = (__m512bh)pair_words(_mm512_loadu_si512(w + k * NR));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], wv, (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(xp[r * ldx + k / 2])));
  }
  const __mmask16 m = ncols >= NR ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, m, acc[r]);
}

SD_AVX512BF16 static void dot_block_bf16(int64_t r, const uint32_t* xp, int64_t ldx, const uint16_t* w, int64_t K,
                                         float* y, int64_t ldy, int64_t ncols) {
  switch (r) {
#define SD_DOT_CASE(n) case n: return dot_rows_bf16<n>(xp, ldx, w, K, y, ldy, ncols);
    SD_DOT_CASE(12) SD_DOT_CASE(11) SD_DOT_CASE(10) SD_DOT_CASE(9) SD_DOT_CASE(8) SD_DOT_CASE(7) SD_DOT_CASE(6)
    SD_DOT_CASE(5) SD_DOT_CASE(4) SD_DOT_CASE(3) SD_DOT_CASE(2)
#undef SD_DOT_CASE
    default: return dot_rows_bf16<1>(xp, ldx, w, K, y, ldy, ncols);
  }
}

// y[M, n] = (x's top bf16 half) @ W^T for bf16 panels W ([NP, K, 16], K even): panels shared as
// the threads go, rows in even blocks of at most 12 (a panel of a 576-wide head, 18 KB, stays in
// L1 across them).
void linear_bf16_dot(const float* x, int64_t M, const uint16_t* w, int64_t K, int64_t NP, int64_t n, float* y) {
  std::vector<uint32_t> xp(M * K / 2);
  for (int64_t i = 0; i < M * K / 2; ++i) {
    uint32_t lo, hi;
    std::memcpy(&lo, x + 2 * i, 4);
    std::memcpy(&hi, x + 2 * i + 1, 4);
    xp[i] = (lo >> 16) | (hi & 0xFFFF0000u);
  }
  const int64_t nrb = (M + 11) / 12;
  parallel_steal(NP, 2, [&](const auto& next) {
    for (int64_t p0, p1; next(p0, p1);)
      for (int64_t p = p0; p < p1; ++p)
        even_row_blocks(M, nrb, [&](int64_t m, int64_t r) {
          dot_block_bf16(r, xp.data() + m * K / 2, K / 2, w + p * K * NR, K, y + m * n + p * NR, n,
                         std::min(NR, n - p * NR));
        });
  });
}

// The approximate logits greedy_head picks from ([R, vocab]): the bf16 copy on the tiles (from
// their row count, x's top bf16 half), by pair dot products (set_bf16_dot, x's top half too), else
// the panels' own form on x as it is.
torch::Tensor greedy_head_pass(const torch::Tensor& x, const torch::Tensor& approx, int64_t V) {
  const int64_t R = x.size(0), K = x.size(1);
  auto a = torch::empty({R, V}, x.options());
  const int64_t amx = amx_bf16_min_rows(torch::kBFloat16);
  const uint16_t* ap = reinterpret_cast<const uint16_t*>(approx.data_ptr<at::BFloat16>());
  if (amx && R >= amx && K % AMXB_K == 0)
    linear_amx_bf16<uint16_t, 1>(x.data_ptr<float>(), R, ap, K, approx.size(0), nullptr, nullptr, nullptr, V,
                                 a.data_ptr<float>(), nullptr);
  else if (g_bf16_dot && g_avx512 && K % 2 == 0)
    linear_bf16_dot(x.data_ptr<float>(), R, ap, K, approx.size(0), V, a.data_ptr<float>());
  else
    linear_into(x.data_ptr<float>(), R, approx, c10::nullopt, nullptr, V, a.data_ptr<float>(), nullptr, A_FP32);
  return a;
}

// Per row of x [R, K], the factor nx_r of the int8-activation pass's bound (greedy_head_int8 says
// why): the row's own quantization error as the pass quantizes it (x~), plus, for a head on two
// int8 limbs (a8 2), as that head does (x^), plus both sides' fp32 summation, 5% over; and, where
// norms is given, ||x_r||_2 rounded up.
void int8_pass_factors(const float* xa, int64_t R, int64_t K, int64_t a8, std::vector<float>& nx,
                       std::vector<float>* norms = nullptr) {
  QuantX q8, q16;
  quantize_rows(xa, R, K, q8, false);
  if (a8 == A_TWO_LIMBS) quantize_rows(xa, R, K, q16, true);
  nx.assign(R, 0.f);
  if (norms) norms->assign(R, 0.f);
  const double sum_err = 4.0 * double(K + 4) * 0x1p-24;
  for (int64_t r = 0; r < R; ++r) {
    double ss = 0.0, e8 = 0.0, e16 = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = r * K + k, blk = r * q8.nb + k / QB;
      const double xk = xa[i], d8 = xk - double(q8.q[i]) * q8.s[blk];
      ss += xk * xk;
      e8 += d8 * d8;
      if (a8 == A_TWO_LIMBS) {
        const double d16 = xk - (128.0 * q16.q[i] + q16.ql[i]) * q16.s[blk];
        e16 += d16 * d16;
      }
    }
    const double nrm = std::sqrt(ss), e = std::sqrt(e8) + std::sqrt(e16);
    nx[r] = static_cast<float>((1.05 * (e + sum_err * (nrm + e)) + 0x1p-40 * nrm) * (1.0 + 1e-6));
    if (norms) (*norms)[r] = static_cast<float>(nrm * (1.0 + 1e-6));
  }
}

// The ids a greedy pick is in doubt between, over every row (sorted, each once): per row r the n with
// a_n + B_n >= max_m (a_m - B_m), from approximate logits a [R, V] whose error is at most
// B_n = nx_r c_n (+ mx_r d_n where mxa and da are given: a bound of two terms). False where a row
// is out of the bound's range (an approximate logit not finite or past 1e30, nx_r not finite or
// under 2^-60, mx_r not finite): the caller takes the full head.
bool ids_in_doubt(const float* aa, int64_t R, int64_t V, const float* nxa, const float* ca, std::vector<int64_t>& all,
                  const float* mxa = nullptr, const float* da = nullptr) {
  std::vector<std::vector<int64_t>> ids(R);
  std::vector<char> bad(R, 0);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float nx = nxa[r], mx = mxa ? mxa[r] : 0.f;
      const float* ar = aa + r * V;
      // B_n: nx c_n, plus mx d_n for a two-term bound
      const auto bound8 = [&](int64_t i) {
        const __m256 b = _mm256_mul_ps(_mm256_set1_ps(nx), _mm256_loadu_ps(ca + i));
        return da ? _mm256_fmadd_ps(_mm256_set1_ps(mx), _mm256_loadu_ps(da + i), b) : b;
      };
      const auto bound1 = [&](int64_t i) { return nx * ca[i] + (da ? mx * da[i] : 0.f); };
      const __m256 huge = _mm256_set1_ps(1e30f), sign = _mm256_set1_ps(-0.f);
      __m256 lo = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), off = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= V; i += 8) {  // the largest a_m - B_m; any a_m not finite (or past 1e30) marks the row
        const __m256 av = _mm256_loadu_ps(ar + i);
        lo = _mm256_max_ps(lo, _mm256_sub_ps(av, bound8(i)));
        off = _mm256_or_ps(off, _mm256_cmp_ps(_mm256_andnot_ps(sign, av), huge, _CMP_NLT_UQ));
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, lo);
      float t = -std::numeric_limits<float>::infinity();
      for (float l : lanes) t = std::max(t, l);
      bool b = _mm256_movemask_ps(off) != 0 || !(nx >= 0x1p-60f) || !std::isfinite(nx) ||
               !(mx >= 0.f && std::isfinite(mx));  // the bound's range
      for (; i < V; ++i) {
        b = b || !(std::fabs(ar[i]) < 1e30f);
        t = std::max(t, ar[i] - bound1(i));
      }
      if (b || !std::isfinite(t)) {
        bad[r] = 1;
        continue;
      }
      t -= 0x1p-20f * std::fabs(t);  // past the rounding of a_n +- B_n
      const __m256 t8 = _mm256_set1_ps(t);
      for (i = 0; i + 8 <= V; i += 8) {
        const __m256 up = _mm256_add_ps(_mm256_loadu_ps(ar + i), bound8(i));
        for (int bits = _mm256_movemask_ps(_mm256_cmp_ps(up, t8, _CMP_GE_OQ)); bits; bits &= bits - 1)
          ids[r].push_back(i + __builtin_ctz(bits));
      }
      for (; i < V; ++i)
        if (ar[i] + bound1(i) >= t) ids[r].push_back(i);
    }
  });
  for (int64_t r = 0; r < R; ++r) all.insert(all.end(), ids[r].begin(), ids[r].end());
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  const int64_t C = static_cast<int64_t>(all.size());
  return std::none_of(bad.begin(), bad.end(), [](char c) { return c != 0; }) && C > 0 && C <= GREEDY_HEAD_MAX_IDS;
}

// Each row's pick among the ids `all` from their exact logits z [R, C].
torch::Tensor picks_among(const torch::Tensor& z, const std::vector<int64_t>& all) {
  const int64_t R = z.size(0);
  const auto pick = argmax_rows(z);
  auto out = torch::empty({R}, torch::kLong);
  for (int64_t r = 0; r < R; ++r) out.data_ptr<int64_t>()[r] = all[pick.data_ptr<int64_t>()[r]];
  return out;
}

// greedy_head's int8 copy of an fp32 head (pack_int8_vnni, per-row scales s_n: w~_n = s_n q_n): its
// int8-activation pass reads a quarter of the head's bytes, where the bf16 copy reads half. With x~
// as the pass quantizes x, the pass is off from the head's fp32 logit by at most
// |x~ . w~_n - x . w~_n| + |x . (w~_n - w_n)| <= ||x - x~||_2 ||w~_n||_2 + ||x||_2 ||w~_n - w_n||_2
// (Cauchy-Schwarz) plus each side's fp32 summation: B_n = nx_r c_n + mx_r d_n, with c_n = ||w~_n||_2
// and nx_r as greedy_head_int8 takes them, mx_r = ||x_r||_2 (5% over) and d_n the weight rounding's
// share with the exact side's summation (fp32_head_int8_bound). The copy's rounding is larger than
// bf16's, so the bound leaves more ids in doubt: on default-e2e's E2E prompts at one row 4.6 a step
// on average at full depth and 22 at 3x (bf16: 1.7 and 4.1), over 8 rows 36 and 115; each is one
// exact row of 2.3 KB, against the 28 MB the pass reads less. On an AMD EPYC (Zen 5) greedy steps
// ran 1.035x faster than on the bf16 copy at one row, 1.108x at one row and 3x, 1.022-1.085x at 8
// and 32 rows (benchmarks/results/epyc/greedy-head-fp32-int8-copy-ab.json).
torch::Tensor greedy_head(const torch::Tensor& h, const torch::Tensor& head, int64_t vocab, const torch::Tensor& approx,
                          const torch::Tensor& bound, const torch::Tensor& rows,
                          const c10::optional<torch::Tensor>& approx_scale) {
  check(h.scalar_type() == torch::kFloat, "float32 only");
  const int64_t K = h.size(-1), V = vocab;
  // the copy: bf16 (bound [V]: c_n) or int8 with its row scales (bound [2, V]: c_n and d_n)
  const bool copy8 = approx.scalar_type() == torch::kChar;
  check(head.scalar_type() == torch::kFloat &&
            (copy8 ? approx_scale.has_value() : approx.scalar_type() == torch::kBFloat16 && !approx_scale.has_value()),
        "greedy_head takes float32 head panels and their bfloat16 copy, or their int8 copy "
        "(kernels.pack_int8_vnni) with its scales");
  check_packed(head, K, V, c10::nullopt, c10::nullopt);
  check_packed(approx, K, V, c10::nullopt, approx_scale);
  if (copy8) check_a8(approx, K, A_INT8);
  check(bound.scalar_type() == torch::kFloat && bound.is_contiguous() &&
            (copy8 ? bound.dim() == 2 && bound.size(0) == 2 && bound.size(1) == V : bound.dim() == 1 && bound.size(0) == V),
        copy8 ? "bound must be [2, vocab] float32 for an int8 copy" : "bound must be [vocab] float32");
  check(rows.scalar_type() == torch::kFloat && rows.dim() == 2 && rows.size(0) == V && rows.size(1) == K &&
        rows.is_contiguous(), "rows must be the head's dense [vocab, in_features] float32 weight");
  const auto x = h.reshape({-1, K}).contiguous();
  const int64_t R = x.size(0);
  const float* ca = bound.data_ptr<float>();
  std::vector<float> nx(R), mx;
  std::vector<int64_t> all;
  bool ok;
  if (copy8) {  // B_n = nx_r c_n + mx_r d_n (fp32_head_int8_bound)
    const auto a = linear(x, approx, c10::nullopt, V, *approx_scale, A_INT8);
    int8_pass_factors(x.data_ptr<float>(), R, K, A_FP32, nx, &mx);
    for (float& m : mx) m *= 1.05f * (1.f + 0x1p-20f);
    ok = ids_in_doubt(a.data_ptr<float>(), R, V, nx.data(), ca, all, mx.data(), ca + V);
  } else {
    const auto a = greedy_head_pass(x, approx, V);  // x's top bf16 half alone in two forms (head_bound counts it)
    for (int64_t r = 0; r < R; ++r) {  // B_n = ||x||_2 c_n
      const float* xr = x.data_ptr<float>() + r * K;
      double ss = 0.0;
      for (int64_t k = 0; k < K; ++k) ss += double(xr[k]) * xr[k];
      nx[r] = static_cast<float>(std::sqrt(ss) * (1.0 + 1e-6));  // rounded up past fp32's rounding
    }
    ok = ids_in_doubt(a.data_ptr<float>(), R, V, nx.data(), ca, all);
  }
  if (!ok) return argmax_rows(linear(x, head, c10::nullopt, V, c10::nullopt, A_FP32).view({R, V}));
  const int64_t C = static_cast<int64_t>(all.size());
  auto panels = torch::zeros({(C + NR - 1) / NR, K, NR}, x.options());
  float* pa = panels.data_ptr<float>();
  const float* wa = rows.data_ptr<float>();
  for (int64_t j = 0; j < C; ++j) {
    const float* src = wa + all[j] * K;
    float* dst = pa + (j / NR) * K * NR + j % NR;
    for (int64_t k = 0; k < K; ++k) dst[k * NR] = src[k];
  }
  return picks_among(linear(x, panels, c10::nullopt, C, c10::nullopt, A_FP32).view({R, C}), all);
}

// ---- Greedy picks from an int8 LM head: int8 weights with fp32 activations (the int8 and int4
// dtypes' head) or with activations in two int8 limbs (w8a16 and w4a16's). At 32 rows the int8
// head's full product was a fifth of a step (benchmarks/results/epyc/step-phases-b32-f16.json),
// bound by one widening and one FMA per 16 multiply-adds; the two-limb head takes two integer dot
// products per 4 k. The pass here runs the same int8 weights packed for int8 activations
// (pack_int8_vnni: w8a8's panels, which a two-limb head already is) with x quantized as w8a8
// quantizes it: x~ (blocks of 32, scale max|x| / 127). With w_n = s_n q_n the exact weight row, the
// exact head's logit is w_n . x (fp32 activations) or w_n . x^ (two limbs: x^ as that form
// quantizes x), so the pass is off by at most |(x~ - x^) . w_n| <= (||x - x~||_2 + ||x - x^||_2)
// ||w_n||_2 (Cauchy-Schwarz; x^ = x for fp32 activations) plus each side's fp32 rounding: the pass
// and the two-limb form sum exact int32 block sums over K / 32 blocks, the fp32 form K products,
// each within (K + 4) 2^-24 ||w_n||_2 times the norm of the x it takes (at most ||x|| + its
// quantization error), counted twice over as head_bound counts it; 5% over the whole, plus 2^-40
// ||x|| for products a tile unit flushes to zero. So B_n = nx_r c_n with c_n = ||w_n||_2
// (int8_head_bound, rounded up) and nx_r from this row's own quantization errors, measured from
// the quantizations the two forms run. On default-e2e's E2E prompts that leaves 12-13 ids a step
// in doubt over all rows on average (benchmarks/results/epyc/greedy-head-int8-ab.json); their exact
// logits come from the head's own int8 columns, through the same linear at the same row count.
torch::Tensor greedy_head_int8(const torch::Tensor& h, const torch::Tensor& head, const torch::Tensor& scale,
                               int64_t vocab, const torch::Tensor& approx, const torch::Tensor& bound, int64_t a8) {
  check(h.scalar_type() == torch::kFloat, "float32 only");
  const int64_t K = h.size(-1), V = vocab;
  check(a8 == A_FP32 || a8 == A_TWO_LIMBS, "greedy_head_int8 takes a head on fp32 activations (a8 0) or two "
        "int8 limbs (a8 2)");
  check(head.scalar_type() == torch::kChar && approx.scalar_type() == torch::kChar,
        "greedy_head_int8 takes int8 head panels and their int8-activation copy (kernels.pack_int8_vnni)");
  check_packed(head, K, V, c10::nullopt, scale);
  check_packed(approx, K, V, c10::nullopt, scale);
  check_a8(approx, K, A_INT8);
  check_a8(head, K, a8);
  check(bound.scalar_type() == torch::kFloat && bound.dim() == 1 && bound.size(0) == V && bound.is_contiguous(),
        "bound must be [vocab] float32");
  const auto x = h.reshape({-1, K}).contiguous();
  const int64_t R = x.size(0);
  const float* xa = x.data_ptr<float>();
  const auto a = linear(x, approx, c10::nullopt, V, scale, A_INT8);
  std::vector<float> nx;
  int8_pass_factors(xa, R, K, a8, nx);
  const float* sa = scale.data_ptr<float>();
  std::vector<int64_t> all;
  if (!ids_in_doubt(a.data_ptr<float>(), R, V, nx.data(), bound.data_ptr<float>(), all))
    return argmax_rows(linear(x, head, c10::nullopt, V, scale, a8).view({R, V}));
  const int64_t C = static_cast<int64_t>(all.size()), CP = (C + NR - 1) / NR;
  auto panels = torch::zeros({CP, K, NR}, torch::kChar);
  if (a8 == A_TWO_LIMBS) panels.fill_(static_cast<int8_t>(-128));  // the byte of a zero weight, offset by 128
  auto sc = torch::zeros({CP * NR}, torch::kFloat);
  int8_t* pa = panels.data_ptr<int8_t>();
  const int8_t* wa = head.data_ptr<int8_t>();
  for (int64_t j = 0; j < C; ++j) {  // column n of the head's panels: panel n / 16, lane n % 16
    const int64_t n = all[j];
    const int8_t* src = wa + (n / NR) * K * NR;
    int8_t* dst = pa + (j / NR) * K * NR;
    if (a8 == A_TWO_LIMBS) {  // per 4 k: 16 columns x 4 bytes
      for (int64_t k = 0; k < K; k += 4) std::memcpy(dst + k * NR + 4 * (j % NR), src + k * NR + 4 * (n % NR), 4);
    } else {
      for (int64_t k = 0; k < K; ++k) dst[k * NR + j % NR] = src[k * NR + n % NR];
    }
    sc.data_ptr<float>()[j] = sa[n];
  }
  return picks_among(linear(x, panels, c10::nullopt, C, sc, a8).view({R, C}), all);
}

// Where a decode step's time goes, phase by phase (set_phase_timing; off by default, when a phase
// costs one branch): layer_into's parts and greedy's head and whole step, summed over calls until
// phase_times reads them. For benchmarks/step_phases.py, which runs steps on one thread of control.
enum Phase { PH_NORM1, PH_QKV, PH_ROPE, PH_ATTEND, PH_O, PH_NORM2, PH_GATE_UP, PH_SILU, PH_DOWN, PH_HEAD, PH_STEP,
             PH_COUNT };
const char* const PHASE_NAMES[PH_COUNT] = {"norm1", "qkv",  "rope",   "attention", "o",   "norm2",
                                           "gate_up", "silu", "down", "head",      "step"};
std::atomic<bool> g_phase_timing{false};
std::array<double, PH_COUNT> g_phase_seconds{};
std::array<int64_t, PH_COUNT> g_phase_calls{};

struct PhaseClock {
  using clock = std::chrono::steady_clock;
  const bool on = g_phase_timing.load(std::memory_order_relaxed);
  clock::time_point t = on ? clock::now() : clock::time_point{};
  // The time since the last mark (or since the clock started) goes to phase p.
  void mark(Phase p) {
    if (!on) return;
    const auto now = clock::now();
    g_phase_seconds[p] += std::chrono::duration<double>(now - t).count();
    g_phase_calls[p] += 1;
    t = now;
  }
};

// One fused layer's fixed arguments: its norms' weights, its four linears' panels, biases and
// scales, its query heads and attention scale, and how its linears take their activations.
struct FusedLayer {
  torch::Tensor attn_norm, mlp_norm;
  double eps;
  torch::Tensor wqkv;
  c10::optional<torch::Tensor> bqkv;
  torch::Tensor wo;
  c10::optional<torch::Tensor> bo;
  torch::Tensor w13;
  c10::optional<torch::Tensor> b13;
  torch::Tensor w2;
  c10::optional<torch::Tensor> b2;
  int64_t H;
  double scale;
  c10::optional<torch::Tensor> sqkv, so, s13, s2;
  int64_t a8;
};

void check_pool(const torch::Tensor& kpool, const torch::Tensor& vpool) {
  const auto t = kpool.scalar_type();
  check(kpool.dim() == 3 && kpool.sizes() == vpool.sizes() && kpool.is_contiguous() && vpool.is_contiguous() &&
        vpool.scalar_type() == t && (t == torch::kFloat || t == torch::kHalf || t == torch::kBFloat16),
        "KV pool must be contiguous [kv_heads, slots, head_dim] of float32, float16 or bfloat16 (keys and values alike)");
}

// The layer's weights against the hidden size D and its pool's KV heads and head size.
void check_layer(const FusedLayer& L, int64_t D, int64_t KVH, int64_t hd) {
  check(hd % 8 == 0, "head_dim must be a multiple of 8");
  const int64_t nqkv = (L.H + 2 * KVH) * hd, I = L.w2.size(1) * (L.w2.scalar_type() == torch::kByte ? 2 : 1);
  check_packed(L.wqkv, D, nqkv, L.bqkv, L.sqkv);
  check_packed(L.wo, L.H * hd, D, L.bo, L.so);
  check_packed(L.w13, D, 2 * I, L.b13, L.s13);
  check_packed(L.w2, I, D, L.b2, L.s2);
  check_a8(L.wqkv, D, L.a8);
  check_a8(L.wo, L.H * hd, L.a8);
  check_a8(L.w13, D, L.a8);
  check_a8(L.w2, I, L.a8);
  check(L.attn_norm.numel() == D && L.mlp_norm.numel() == D && L.attn_norm.scalar_type() == torch::kFloat &&
        L.mlp_norm.scalar_type() == torch::kFloat && L.attn_norm.is_contiguous() && L.mlp_norm.is_contiguous(),
        "norm weights must be contiguous float32 of the hidden size");
}

// The layer on the residual stream ha [B, D] in place (checked by the caller): this position's
// keys and values go to each row's last slot of its pool (rows [B, 2]: start, length); cc / sc
// are the RoPE tables [B, hd]. Nothing of the next layer is prefetched here: asking for its
// keys/values during this layer's gate/up GEMM (as skipdecode did up to 1 MB of them) slowed the
// GEMM's weight stream by more than attention gained, at every row count timed on an Intel Xeon
// (int8 decode steps at batch 1 1.18x faster without it, w8a8 1.16x, int4 1.09x, fp32 1.04x; at
// 2-8 rows 1.04-1.10x: benchmarks/results/xeon-amx/kernel-ab-kv-prefetch-off.json).
void layer_into(float* ha, int64_t B, int64_t D, const FusedLayer& L, torch::Tensor& kpool, torch::Tensor& vpool,
                const int64_t* ra, const float* cc, const float* sc) {
  const int64_t H = L.H, KVH = kpool.size(0), slots = kpool.size(1), hd = kpool.size(2);
  const int64_t nqkv = (H + 2 * KVH) * hd, I = L.w2.size(1) * (L.w2.scalar_type() == torch::kByte ? 2 : 1);
  const int64_t a8 = L.a8;
  const float* nul = nullptr;
  auto bp = [&](const c10::optional<torch::Tensor>& b) { return b.has_value() ? b->data_ptr<float>() : nul; };
  // Every intermediate lives in one scratch buffer kept between calls rather than a tensor of
  // its own: a dozen fewer allocations and dispatches per layer and step.
  const int64_t NQ = H + 2 * KVH;
  thread_local std::vector<float> scratch;
  const int64_t n_norm = B * D, n_qkv = B * NQ * hd, n_att = B * H * hd, n_gu = B * 2 * I, n_a = B * I;
  scratch.resize(n_norm + n_qkv + 2 * n_att + n_gu + n_a);
  float* nrm = scratch.data();  // n1, then n2
  float* qkv = nrm + n_norm;    // [B, H + 2 KVH, hd]
  float* qs = qkv + n_qkv;      // [B, H, hd], the queries contiguous for attend
  float* att = qs + n_att;      // [B, H * hd]
  float* gu = att + n_att;      // [B, 2 I]
  float* act = gu + n_gu;       // [B, I]
  const float* anw = L.attn_norm.data_ptr<float>();
  const float* mnw = L.mlp_norm.data_ptr<float>();
  PhaseClock ph;
  rms_norm_rows(ha, B, D, anw, float(L.eps), nrm);
  ph.mark(PH_NORM1);
  linear_into(nrm, B, L.wqkv, L.sqkv, bp(L.bqkv), nqkv, qkv, nullptr, a8);
  ph.mark(PH_QKV);
  rope_rows(qkv, B, 1, H + KVH, hd, NQ * hd, NQ * hd, hd, cc, sc);
  for (int64_t b = 0; b < B; ++b) {  // the queries contiguous for attend
    const float* qrow = qkv + b * NQ * hd;
    std::copy(qrow, qrow + H * hd, qs + b * H * hd);
  }
  ph.mark(PH_ROPE);
  with_kv_type(kpool, [&](auto tag) {
    using KT = decltype(tag);
    KT* ka = static_cast<KT*>(kpool.data_ptr());
    KT* va = static_cast<KT*>(vpool.data_ptr());
    for (int64_t b = 0; b < B; ++b) {  // this position's keys and values into each row's last slot
      const int64_t slot = ra[2 * b] + ra[2 * b + 1] - 1;
      const float* qrow = qkv + b * NQ * hd;
      for (int64_t g = 0; g < KVH; ++g) {
        const float* src = qrow + (H + g) * hd;
        store_kv(src, hd, ka + (g * slots + slot) * hd);
        store_kv(src + KVH * hd, hd, va + (g * slots + slot) * hd);
      }
    }
    const KVView<KT> kv{ka, va, 0, slots * hd, hd, 0, slots * hd, hd, ra};
    attend(qs, B, H, hd, KVH, kv, nullptr, float(L.scale), att);
  });
  ph.mark(PH_ATTEND);
  linear_into(att, B, L.wo, L.so, bp(L.bo), D, ha, ha, a8);
  ph.mark(PH_O);
  rms_norm_rows(ha, B, D, mnw, float(L.eps), nrm);
  ph.mark(PH_NORM2);
  linear_into(nrm, B, L.w13, L.s13, bp(L.b13), 2 * I, gu, nullptr, a8);
  ph.mark(PH_GATE_UP);
  silu_mul_rows(gu, B, I, act);
  ph.mark(PH_SILU);
  linear_into(act, B, L.w2, L.s2, bp(L.b2), D, ha, ha, a8);
  ph.mark(PH_DOWN);
}

void check_decode_input(const torch::Tensor& x) {
  check(x.scalar_type() == torch::kFloat && x.dim() == 3 && x.size(1) == 1, "decode_block takes [B, 1, D] float32");
}

// The RoPE tables of B rows, [B, hd] contiguous (cos / sin come as [B or 1, 1, 1, hd]).
torch::Tensor rope_table(const torch::Tensor& t, int64_t B, int64_t hd) {
  return t.expand({B, 1, 1, hd}).contiguous();
}

// One pre-norm Llama-family layer (RMSNorm, RoPE, GQA, SwiGLU) for one decode
// position per row, in one call instead of ~25 dispatched ops, with the
// residual adds done by the output GEMMs. x [B, 1, D]; the layer's KV pool is
// [KVH, slots, hd] and row b owns slots rows[b, 0] .. rows[b, 0] + rows[b, 1] - 1:
// its new key/value goes to the last of them and attention reads all of them.
// Returns the new hidden state; x is not modified.
torch::Tensor decode_block(const torch::Tensor& x, const torch::Tensor& attn_norm, const torch::Tensor& mlp_norm,
                           double eps, const torch::Tensor& wqkv, const c10::optional<torch::Tensor>& bqkv,
                           const torch::Tensor& wo, const c10::optional<torch::Tensor>& bo, const torch::Tensor& w13,
                           const c10::optional<torch::Tensor>& b13, const torch::Tensor& w2,
                           const c10::optional<torch::Tensor>& b2, torch::Tensor kpool, torch::Tensor vpool,
                           const torch::Tensor& rows, const torch::Tensor& cos, const torch::Tensor& sin, int64_t H,
                           double scale, const c10::optional<torch::Tensor>& sqkv,
                           const c10::optional<torch::Tensor>& so, const c10::optional<torch::Tensor>& s13,
                           const c10::optional<torch::Tensor>& s2, int64_t a8) {
  check_decode_input(x);
  check_pool(kpool, vpool);
  const int64_t B = x.size(0), D = x.size(2), KVH = kpool.size(0), hd = kpool.size(2);
  check_rows(rows, B, kpool.size(1));
  const FusedLayer L{attn_norm.contiguous(), mlp_norm.contiguous(), eps, wqkv, bqkv, wo, bo, w13, b13, w2, b2, H,
                     scale, sqkv, so, s13, s2, a8};
  check_layer(L, D, KVH, hd);
  auto h = x.contiguous().clone();  // the residual stream, updated in place, and the result
  const auto cc = rope_table(cos, B, hd), sc = rope_table(sin, B, hd);
  layer_into(h.data_ptr<float>(), B, D, L, kpool, vpool, rows.data_ptr<int64_t>(), cc.data_ptr<float>(),
             sc.data_ptr<float>());
  return h;
}

// A model's fused layers, their fixed arguments gathered once (add, in layer order), so that a
// decode step whose every row runs the same layers is one call (run) rather than one per layer:
// the arguments of 30 calls are not converted again each step, nor the RoPE tables expanded, nor
// the residual stream copied, per layer. Each layer is decode_block's, with the same checks.
struct LayerStack {
  std::vector<FusedLayer> layers;

  void add(const torch::Tensor& attn_norm, const torch::Tensor& mlp_norm, double eps, const torch::Tensor& wqkv,
           const c10::optional<torch::Tensor>& bqkv, const torch::Tensor& wo, const c10::optional<torch::Tensor>& bo,
           const torch::Tensor& w13, const c10::optional<torch::Tensor>& b13, const torch::Tensor& w2,
           const c10::optional<torch::Tensor>& b2, int64_t H, double scale,
           const c10::optional<torch::Tensor>& sqkv, const c10::optional<torch::Tensor>& so,
           const c10::optional<torch::Tensor>& s13, const c10::optional<torch::Tensor>& s2, int64_t a8) {
    layers.push_back(FusedLayer{attn_norm.contiguous(), mlp_norm.contiguous(), eps, wqkv, bqkv, wo, bo, w13, b13, w2,
                                b2, H, scale, sqkv, so, s13, s2, a8});
  }

  // x [B, 1, D] through layers ids[0], ids[1], ... in turn: layer ids[i] runs the leading
  // counts[i] rows (rows ordered by depth; a row that skips it carries its hidden state) on its
  // pool kpools[i] / vpools[i] with their slots rows[i] ([counts[i], 2]); returns the new residual stream.
  torch::Tensor run(const torch::Tensor& x, const std::vector<int64_t>& ids, const std::vector<int64_t>& counts,
                    std::vector<torch::Tensor> kpools, std::vector<torch::Tensor> vpools,
                    const std::vector<torch::Tensor>& rows, const torch::Tensor& cos, const torch::Tensor& sin) {
    check_decode_input(x);
    const size_t n = ids.size();
    check(counts.size() == n && kpools.size() == n && vpools.size() == n && rows.size() == n,
          "run takes one row count, key pool, value pool and rows tensor per layer it runs");
    const int64_t B = x.size(0), D = x.size(2);
    auto h = x.contiguous().clone();
    if (n == 0) return h;
    for (size_t i = 0; i < n; ++i) {
      check(ids[i] >= 0 && ids[i] < static_cast<int64_t>(layers.size()), "layer index outside the stack");
      check(counts[i] >= 1 && counts[i] <= B, "a layer's row count must be 1 to the rows of x");
      check_pool(kpools[i], vpools[i]);
      check(kpools[i].size(2) == kpools[0].size(2), "every layer's pool has the same head size");
      check_rows(rows[i], counts[i], kpools[i].size(1));
      check_layer(layers[ids[i]], D, kpools[i].size(0), kpools[i].size(2));
    }
    const int64_t hd = kpools[0].size(2);
    const auto cc = rope_table(cos, B, hd), sc = rope_table(sin, B, hd);
    float* ha = h.data_ptr<float>();
    for (size_t i = 0; i < n; ++i) {
      layer_into(ha, counts[i], D, layers[ids[i]], kpools[i], vpools[i], rows[i].data_ptr<int64_t>(),
                 cc.data_ptr<float>(), sc.data_ptr<float>());
    }
    return h;
  }

  // Greedy decode steps in one call, every row running the same layers at each step (the steady
  // state of a batch on one skip schedule). Step s: each row's token embedded (a row of emb
  // [V, D]), at its position (pos, its RoPE rows of cos / sin [P, hd]), through the layers
  // step_layers[s] (run's loop: every row, slots (starts[l, row], pos + 1) of pools[l]), the final
  // RMSNorm (norm_w, eps), the LM head (linear's panels: head, head_bias, vocab, head_scale, a8) and
  // each row's argmax (greedy_head's where head_approx, head_bound and head_rows are given for an
  // fp32 head, greedy_head_int8's where head_approx and head_bound are given for an int8 one: the
  // same picks), which the next step feeds at pos + 1. The same calls as a Python step, so the
  // same tokens; what it saves is the Python between them, which after each step's weight stream
  // runs on cold caches. Returns the tokens [steps run, R]; it stops after a step in which a row
  // picked one of eos. Bound without the GIL (a burst holds the CPU for many steps; ATen needs no GIL).
  torch::Tensor greedy(const torch::Tensor& tokens, const torch::Tensor& positions,
                       const std::vector<std::vector<int64_t>>& step_layers, const std::vector<torch::Tensor>& kpools,
                       const std::vector<torch::Tensor>& vpools, const torch::Tensor& starts, const torch::Tensor& emb,
                       const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& norm_w, double eps,
                       const torch::Tensor& head, const c10::optional<torch::Tensor>& head_bias, int64_t vocab,
                       const c10::optional<torch::Tensor>& head_scale, int64_t a8, const std::vector<int64_t>& eos,
                       const c10::optional<torch::Tensor>& head_approx, const c10::optional<torch::Tensor>& head_bound,
                       const c10::optional<torch::Tensor>& head_rows,
                       const c10::optional<torch::Tensor>& head_approx_scale) {
    const int64_t L = static_cast<int64_t>(layers.size()), S = static_cast<int64_t>(step_layers.size());
    check(tokens.scalar_type() == torch::kLong && tokens.dim() == 1 && positions.sizes() == tokens.sizes() &&
          positions.scalar_type() == torch::kLong, "greedy takes tokens and positions as [R] int64");
    const int64_t R = tokens.size(0);
    check(R >= 1, "greedy needs at least one row");
    const bool head8 = head.scalar_type() == torch::kChar;  // an int8 head's picks: greedy_head_int8
    check(head_approx.has_value() == head_bound.has_value() &&
          (!head_approx.has_value() || head_rows.has_value() == !head8) &&
          (!head_approx.has_value() || (!head_bias.has_value() && (a8 == A_FP32 || (head8 && a8 == A_TWO_LIMBS)))),
          "head_approx and head_bound come together (with head_rows for an fp32 head), for a head without bias "
          "on fp32 activations (or two int8 limbs, an int8 head)");
    check(!head_approx_scale.has_value() || (head_approx.has_value() && !head8),
          "head_approx_scale is an fp32 head's int8 copy's scales");
    check(static_cast<int64_t>(kpools.size()) == L && static_cast<int64_t>(vpools.size()) == L,
          "greedy takes every layer's key and value pool");
    check(starts.scalar_type() == torch::kLong && starts.dim() == 2 && starts.size(0) == L && starts.size(1) == R,
          "starts must be [layers, R] int64");
    check(emb.scalar_type() == torch::kFloat && emb.dim() == 2 && emb.is_contiguous(), "emb must be [V, D] float32");
    check(cos.scalar_type() == torch::kFloat && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.is_contiguous() &&
          sin.is_contiguous(), "cos and sin must be contiguous [positions, head_dim] float32");
    const int64_t V = emb.size(0), D = emb.size(1), P = cos.size(0), hd = cos.size(1);
    const auto st = starts.contiguous();
    const int64_t* sa = st.data_ptr<int64_t>();
    const auto tc = tokens.contiguous(), pc = positions.contiguous();
    std::vector<int64_t> tok(tc.data_ptr<int64_t>(), tc.data_ptr<int64_t>() + R);
    std::vector<int64_t> pos(pc.data_ptr<int64_t>(), pc.data_ptr<int64_t>() + R);
    std::vector<torch::Tensor> rows(L);  // layer l's (start, length) per row, lengths rewritten each step
    for (int64_t l = 0; l < L; ++l) {
      rows[l] = torch::empty({R, 2}, torch::kLong);
      for (int64_t r = 0; r < R; ++r) rows[l].data_ptr<int64_t>()[2 * r] = sa[l * R + r];
    }
    auto out = torch::empty({S, R}, torch::kLong);
    int64_t* oa = out.data_ptr<int64_t>();
    int64_t done = 0;
    for (int64_t s = 0; s < S; ++s) {
      PhaseClock step;
      auto x = torch::empty({R, 1, D}), c = torch::empty({R, 1, 1, hd}), sn = torch::empty({R, 1, 1, hd});
      for (int64_t r = 0; r < R; ++r) {
        check(tok[r] >= 0 && tok[r] < V, "a token id outside the embedding");
        check(pos[r] >= 0 && pos[r] < P, "a position outside the RoPE tables");
        std::copy_n(emb.data_ptr<float>() + tok[r] * D, D, x.data_ptr<float>() + r * D);
        std::copy_n(cos.data_ptr<float>() + pos[r] * hd, hd, c.data_ptr<float>() + r * hd);
        std::copy_n(sin.data_ptr<float>() + pos[r] * hd, hd, sn.data_ptr<float>() + r * hd);
      }
      const auto& ids = step_layers[s];
      std::vector<torch::Tensor> kp, vp, rw;
      for (int64_t l : ids) {
        check(l >= 0 && l < L, "layer index outside the stack");
        for (int64_t r = 0; r < R; ++r) rows[l].data_ptr<int64_t>()[2 * r + 1] = pos[r] + 1;
        kp.push_back(kpools[l]);
        vp.push_back(vpools[l]);
        rw.push_back(rows[l]);
      }
      const auto h = run(x, ids, std::vector<int64_t>(ids.size(), R), kp, vp, rw, c, sn);
      PhaseClock head_clock;
      const auto hn = rms_norm(h, norm_w, eps);
      const auto pick = !head_approx.has_value()
                            ? argmax_rows(linear(hn, head, head_bias, vocab, head_scale, a8).view({R, vocab}))
                        : head8 ? greedy_head_int8(hn, head, *head_scale, vocab, *head_approx, *head_bound, a8)
                                : greedy_head(hn, head, vocab, *head_approx, *head_bound, *head_rows, head_approx_scale);
      head_clock.mark(PH_HEAD);
      bool stop = false;
      for (int64_t r = 0; r < R; ++r) {
        tok[r] = pick.data_ptr<int64_t>()[r];
        oa[s * R + r] = tok[r];
        pos[r] += 1;
        stop = stop || std::find(eos.begin(), eos.end(), tok[r]) != eos.end();
      }
      done = s + 1;
      step.mark(PH_STEP);
      if (stop) break;
    }
    return out.narrow(0, 0, done);
  }
};

// ---- The machine's fp32 multiply-add rate in the form set_isa chose: the roof of the
// fp32-activation forms when a step has many rows (benchmarks report a step's weight FLOPs over
// it, as they report its weight bytes over the read bandwidth). Each thread runs `iters` rounds
// of 12 independent FMA chains (more than two FMA units' latency needs) on registers only.
constexpr int FMA_CHAINS = 12;
SD_AVX512 float fma_chains512(int64_t iters) {
  __m512 a[FMA_CHAINS];
  const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-3f);
  for (int i = 0; i < FMA_CHAINS; ++i) a[i] = _mm512_set1_ps(static_cast<float>(i));
  for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < FMA_CHAINS; ++i) a[i] = _mm512_fmadd_ps(a[i], x, y);
  float s = 0.f;
  for (int i = 0; i < FMA_CHAINS; ++i) s += _mm512_reduce_add_ps(a[i]);
  return s;
}
float fma_chains256(int64_t iters) {
  __m256 a[FMA_CHAINS];
  const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-3f);
  for (int i = 0; i < FMA_CHAINS; ++i) a[i] = _mm256_set1_ps(static_cast<float>(i));
  for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < FMA_CHAINS; ++i) a[i] = _mm256_fmadd_ps(a[i], x, y);
  alignas(32) float v[8];
  __m256 t = a[0];
  for (int i = 1; i < FMA_CHAINS; ++i) t = _mm256_add_ps(t, a[i]);
  _mm256_store_ps(v, t);
  return v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
}

// The read-bandwidth probe: n floats summed in 256-byte strides (four independent sums), asking for
// the lines pf bytes ahead (pf 0: the hardware prefetcher alone). Why native: torch's reductions
// read a large tensor slower than the decode kernels stream their weights (batch-1 steps read
// "over 100%" of what a torch sum measured), so the fraction of bandwidth needs a faster reader.
static inline void read_lines_pf(const float* p, int64_t pf) {
  for (int64_t j = 0; j < 256; j += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + pf + j, _MM_HINT_T0);
}
SD_AVX512 float read_sum512(const float* p, int64_t n, int64_t pf) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    if (pf) read_lines_pf(p + i, pf);
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 48));
  }
  float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  for (; i < n; ++i) s += p[i];
  return s;
}
float read_sum256(const float* p, int64_t n, int64_t pf) {
  __m256 a[8];
  for (auto& x : a) x = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    if (pf) read_lines_pf(p + i, pf);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_add_ps(a[j], _mm256_loadu_ps(p + i + 8 * j));
  }
  for (int j = 1; j < 8; ++j) a[0] = _mm256_add_ps(a[0], a[j]);
  float s = hsum(a[0]);
  for (; i < n; ++i) s += p[i];
  return s;
}

// Reads x (contiguous float32) once, each of torch's threads its contiguous share, in the kernels'
// form (AVX-512 or AVX2), asking for lines prefetch_bytes ahead; returns the sum (time the call).
double read_stream(const torch::Tensor& x, int64_t prefetch_bytes) {
  check(x.scalar_type() == torch::kFloat && x.is_contiguous(), "the probe must be a contiguous float32 tensor");
  check(prefetch_bytes >= 0 && prefetch_bytes % 64 == 0, "prefetch_bytes must be a non-negative multiple of 64");
  const float* p = x.data_ptr<float>();
  const int64_t n = x.numel(), threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / 64));
  std::vector<double> part(threads);
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t lo = n * t / threads / 64 * 64, hi = t + 1 == threads ? n : n * (t + 1) / threads / 64 * 64;
      part[t] = g_avx512 ? read_sum512(p + lo, hi - lo, prefetch_bytes) : read_sum256(p + lo, hi - lo, prefetch_bytes);
    }
  });
  return std::accumulate(part.begin(), part.end(), 0.0);
}

// How many times parallel_steal hands out each of 0 .. n - 1 (each must be once), then how many
// ranges it handed them out in; for the tests.
std::vector<int64_t> steal_counts(int64_t n, int64_t chunk) {
  check(n >= 0 && n < (int64_t(1) << 32), "n must be in [0, 2^32)");
  std::vector<std::atomic<int64_t>> seen(n);
  std::atomic<int64_t> ranges{0};
  parallel_steal(n, chunk, [&](const auto& next) {
    for (int64_t b, e; next(b, e);) {
      ranges.fetch_add(1);
      for (int64_t i = b; i < e; ++i) seen[i].fetch_add(1);
    }
  });
  std::vector<int64_t> out(n + 1);
  for (int64_t i = 0; i < n; ++i) out[i] = seen[i].load();
  out[n] = ranges.load();
  return out;
}

// FLOPs of `iters` rounds on every thread of torch's pool (one range per thread); time it to get the rate.
double fma_flops(int64_t iters) {
  check(iters >= 1, "iters must be >= 1");
  const int64_t threads = at::get_num_threads();
  std::vector<float> sink(threads);
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) sink[t] = g_avx512 ? fma_chains512(iters) : fma_chains256(iters);
  });
  volatile float keep = std::accumulate(sink.begin(), sink.end(), 0.f);
  (void)keep;
  return 2.0 * FMA_CHAINS * (g_avx512 ? 16 : 8) * static_cast<double>(iters) * threads;
}

// Which form of the panel micro-kernels runs: AVX-512 where the CPU has it (the caller checks
// its flags), AVX2 + FMA otherwise. Returns the previous setting.
bool set_isa(bool avx512) {
  const bool prev = g_avx512;
  g_avx512 = avx512;
  return prev;
}

// Which form the int8-activation kernels use: "amx" (AMX tiles from 12 or 16 rows, VNNI below)
// or "vnni" (the caller checks the CPU's flags), "avx2" or "portable". Returns the previous setting.
std::string set_a8(const std::string& form) {
  static const std::string names[] = {"portable", "avx2", "vnni", "amx"};  // indexed by A8Form
  const std::string prev = names[g_a8];
  const auto it = std::find(std::begin(names), std::end(names), form);
  check(it != std::end(names), "a8 form must be portable, avx2, vnni or amx");
  check(form != "amx" || amx_permitted(), "the OS did not grant this process the AMX tile registers");
  g_a8 = static_cast<int>(it - std::begin(names));
  return prev;
}

// Whether fp32-activation linears of several rows run on the AMX-BF16 tiles (linear_amx_bf16; the
// caller checks the CPU's flags). Returns the previous setting.
bool set_amx_bf16(bool on) {
  check(!on || amx_permitted(), "the OS did not grant this process the AMX tile registers");
  const bool prev = g_amx_bf16;
  g_amx_bf16 = on;
  return prev;
}

// Whether layer_into and greedy time their phases (PhaseClock). Returns the previous setting.
bool set_phase_timing(bool on) { return g_phase_timing.exchange(on); }

// Each phase's seconds and calls since the last reset (reset: start again from zero).
std::map<std::string, std::pair<double, int64_t>> phase_times(bool reset) {
  std::map<std::string, std::pair<double, int64_t>> out;
  for (int p = 0; p < PH_COUNT; ++p) out[PHASE_NAMES[p]] = {g_phase_seconds[p], g_phase_calls[p]};
  if (reset) g_phase_seconds.fill(0.0), g_phase_calls.fill(0);
  return out;
}

// Whether greedy_head's bf16 pass below the tiles' row count runs on vdpbf16ps (linear_bf16_dot; the
// caller checks the CPU's flags). Returns the previous setting.
bool set_bf16_dot(bool on) {
  const bool prev = g_bf16_dot;
  g_bf16_dot = on;
  return prev;
}

torch::Tensor greedy_head_pass_checked(const torch::Tensor& h, const torch::Tensor& approx, int64_t vocab) {
  check(h.scalar_type() == torch::kFloat && h.dim() == 2 && approx.scalar_type() == torch::kBFloat16,
        "greedy_head_pass takes float32 rows and bfloat16 panels");
  check_packed(approx, h.size(1), vocab, c10::nullopt, c10::nullopt);
  return greedy_head_pass(h.contiguous(), approx, vocab);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_phase_timing", &set_phase_timing, "time layer_into's and greedy's phases (true) or not; returns the "
        "previous setting", py::arg("on"));
  m.def("phase_times", &phase_times, "each phase's {name: (seconds, calls)} since the last reset",
        py::arg("reset") = false);
  m.def("set_bf16_dot", &set_bf16_dot, "run greedy_head's bf16 pass on AVX512-BF16 dot products (true) or not",
        py::arg("on"));
  m.def("greedy_head_pass", &greedy_head_pass_checked, "the approximate logits greedy_head picks from",
        py::arg("h"), py::arg("approx"), py::arg("vocab"));
  m.def("set_amx_bf16", &set_amx_bf16, "run fp32-activation linears of several rows on AMX-BF16 tiles (true) or not",
        py::arg("on"));
  m.def("set_a8", &set_a8, "the int8-activation kernels' form: amx, vnni, avx2 or portable", py::arg("form"));
  m.def("set_isa", &set_isa, "use the AVX-512 micro-kernels (true) or the AVX2 ones (false)", py::arg("avx512"));
  m.def("linear", &linear, "small-M linear on a panel-packed weight (int8 and int4 panels with their scales)", py::arg("x"),
        py::arg("packed"), py::arg("bias"), py::arg("n"), py::arg("scale") = py::none(), py::arg("a8") = 0);
  m.def("rms_norm", &rms_norm, "RMSNorm, HF's order of operations");
  m.def("rope_", &rope_, "rotate-half RoPE in place");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused [gate | up] tensor");
  m.def("kv_round", &kv_round, "x rounded as a decode step stores it into a KV pool of like's dtype",
        py::arg("x"), py::arg("like"));
  m.def("decode_attention", &decode_attention, "one query position per row, grouped KV heads read once",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("scale"), py::arg("rows") = py::none());
  m.def("steal_counts", &steal_counts, "times parallel_steal hands out each index, then the ranges it handed out",
        py::arg("n"), py::arg("chunk"));
  m.def("linear_repeat", &linear_repeat, "linear's GEMM repeats times on the same x and weights (time it)",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("scale") = py::none(), py::arg("a8") = 0,
        py::arg("repeats") = 1);
  m.def("read_stream", &read_stream, "sum of a float32 tensor read once by every thread's share, lines asked for "
        "prefetch_bytes ahead (time it for the read bandwidth)", py::arg("x"), py::arg("prefetch_bytes"));
  m.def("fma_flops", &fma_flops, "FLOPs of iters rounds of fp32 FMA chains on every thread (time it for the peak)",
        py::arg("iters"));
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, -1) of a [rows, vocab] tensor");
  m.def("greedy_head_int8", &greedy_head_int8, "argmax of an int8 LM head's logits per row, from "
        "an int8-activation pass and the few exact logits its bound leaves in doubt; a8: the head's own activations "
        "(0 fp32, 2 two int8 limbs)", py::arg("h"), py::arg("head"), py::arg("scale"), py::arg("vocab"),
        py::arg("approx"), py::arg("bound"), py::arg("a8") = 0);
  m.def("greedy_head", &greedy_head, "argmax of an fp32 LM head's logits per row, from a pass over its bf16 or int8 "
        "copy and the few exact logits it leaves in doubt", py::arg("h"), py::arg("head"), py::arg("vocab"),
        py::arg("approx"), py::arg("bound"), py::arg("rows"), py::arg("approx_scale") = py::none());
  m.def("decode_block", &decode_block, "one pre-norm Llama-family layer, one decode position per row, on a KV pool",
        py::arg("x"), py::arg("attn_norm"), py::arg("mlp_norm"), py::arg("eps"), py::arg("wqkv"), py::arg("bqkv"),
        py::arg("wo"), py::arg("bo"), py::arg("w13"), py::arg("b13"), py::arg("w2"), py::arg("b2"), py::arg("kpool"),
        py::arg("vpool"), py::arg("rows"), py::arg("cos"), py::arg("sin"), py::arg("H"), py::arg("scale"),
        py::arg("sqkv") = py::none(),
        py::arg("so") = py::none(), py::arg("s13") = py::none(), py::arg("s2") = py::none(), py::arg("a8") = 0);
  // module_local: each build of these kernels (another source, another cache directory) loaded in one
  // process registers its own LayerStack type rather than failing on the first one's
  py::class_<LayerStack>(m, "LayerStack", py::module_local(),
                         "a model's fused layers, one call per decode step (decode_block's layers)")
      .def(py::init<>())
      .def("add", &LayerStack::add, "append a layer (decode_block's fixed arguments)", py::arg("attn_norm"),
           py::arg("mlp_norm"), py::arg("eps"), py::arg("wqkv"), py::arg("bqkv"), py::arg("wo"), py::arg("bo"),
           py::arg("w13"), py::arg("b13"), py::arg("w2"), py::arg("b2"), py::arg("H"), py::arg("scale"),
           py::arg("sqkv") = py::none(), py::arg("so") = py::none(), py::arg("s13") = py::none(),
           py::arg("s2") = py::none(), py::arg("a8") = 0)
      .def("run", &LayerStack::run, "x through the given layers, each on its leading rows, pool and slots",
           py::arg("x"), py::arg("ids"), py::arg("counts"), py::arg("kpools"), py::arg("vpools"), py::arg("rows"),
           py::arg("cos"), py::arg("sin"))
      .def("greedy", &LayerStack::greedy, "greedy decode steps, every row on the same layers, in one call",
           py::arg("tokens"), py::arg("positions"), py::arg("step_layers"), py::arg("kpools"), py::arg("vpools"),
           py::arg("starts"), py::arg("emb"), py::arg("cos"), py::arg("sin"), py::arg("norm_w"), py::arg("eps"),
           py::arg("head"), py::arg("head_bias"), py::arg("vocab"), py::arg("head_scale"), py::arg("a8"),
           py::arg("eos"), py::arg("head_approx") = py::none(), py::arg("head_bound") = py::none(),
           py::arg("head_rows") = py::none(), py::arg("head_approx_scale") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def("__len__", [](const LayerStack& s) { return s.layers.size(); });
}
