// The arithmetic of hyprefix::int8_linear (int8_linear.cpp) and of the int8 matmuls inside
// hyprefix::DecodeModel (decode_layers.cpp): see int8_linear.cpp for the layout and the method.
// Included by one translation unit per build (its flags pick the AVX512-VNNI or AVX2 path).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
// Each group's weight lines are prefetched this many bytes ahead of their loads: the tile is one
// stream, and the hardware prefetchers alone left each core's reads latency-bound (the distance
// was chosen on batch-1 decode: docs/perf-log.md). Only a tile's first block of
// rows prefetches: prefill's later blocks reread the tile from cache.
constexpr int64_t kAheadBytes = 2048;

// Pulls the `lines` 64-byte lines `ahead` bytes past `at` into L2, not L1: in a VM's slow read
// mode streamed tiles read faster so than with the same prefetches into L1; in its fast mode no
// hint differed within the noise (docs/perf-log.md, 2026-12-07 and 2026-11-29).
inline void prefetch_ahead(const uint8_t* at, int lines, int64_t ahead = kAheadBytes) {
  for (int j = 0; j < lines; ++j) _mm_prefetch(reinterpret_cast<const char*>(at) + ahead + j * 64, _MM_HINT_T1);
}

struct GroupedActivations {  // per row: K int8 values, and per group its scale (and, for VNNI, -128 * sum)
  std::vector<int8_t> values;
  std::vector<float> scales;
  std::vector<int32_t> starts;
  std::vector<int32_t> halves;  // per group, the sums of its two runs of 16 values (quant_tiles.h's offsets)
  std::vector<float> sums;      // per group, scale * the sum of its 32 values (quant_tiles.h's Q4 and Q4K offsets)
};

// Per-group weight scales are float16 (bits), per-row ones float32.
template <bool kPerGroup>
using WeightScale = std::conditional_t<kPerGroup, uint16_t, float>;

#if defined(__AVX512VNNI__)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// One group of 32 values: its int8 values to dst, its scale, the sums of its two halves; returns
// -128 * sum of the values.
template <typename T>
inline int32_t quantize_group(const T* src, int8_t* dst, float* scale, int32_t* halves) {
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  __m512 a = load16(src), b = load16(src + 16);
  float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(a, sign_off), _mm512_and_ps(b, sign_off)));
  float d = amax / 127.0f;
  float id = d != 0.0f ? 1.0f / d : 0.0f;
  __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
  __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qb));
  *scale = d;
  halves[0] = _mm512_reduce_add_epi32(qa);
  halves[1] = _mm512_reduce_add_epi32(qb);
  return -128 * (halves[0] + halves[1]);
}

// MB activation rows times one tile: the 16 rows' results of each into out[i].
template <bool kPerGroup, int MB>
inline void tile_rows(const uint8_t* tile, const WeightScale<kPerGroup>* tile_scales, int64_t k,
                      const GroupedActivations& q, int64_t m0, float (*out)[16]) {
  const int64_t groups = k / kGroup;
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i even[MB], odd[MB];
    for (int i = 0; i < MB; ++i) {
      even[i] = _mm512_set1_epi32(q.starts[(m0 + i) * groups + g]);
      odd[i] = _mm512_setzero_si512();
    }
    const uint8_t* wg = tile + g * kGroup * 16;
    if (m0 == 0)  // later row blocks find the tile in cache
      prefetch_ahead(wg, 8);
#pragma GCC unroll 4
    for (int j = 0; j < 8; j += 2) {
      __m512i w0 = _mm512_loadu_si512(wg + j * 64), w1 = _mm512_loadu_si512(wg + (j + 1) * 64);
      for (int i = 0; i < MB; ++i) {
        const int32_t* xi = reinterpret_cast<const int32_t*>(q.values.data() + (m0 + i) * k + g * kGroup);
        even[i] = _mm512_dpbusd_epi32(even[i], w0, _mm512_set1_epi32(xi[j]));
        odd[i] = _mm512_dpbusd_epi32(odd[i], w1, _mm512_set1_epi32(xi[j + 1]));
      }
    }
    __m512 wscale = _mm512_set1_ps(1.0f);
    if constexpr (kPerGroup) {
      wscale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile_scales + g * 16)));
    }
    for (int i = 0; i < MB; ++i) {
      __m512 scale = _mm512_mul_ps(wscale, _mm512_set1_ps(q.scales[(m0 + i) * groups + g]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(even[i], odd[i])), scale, acc[i]);
    }
  }
  __m512 row_scale = _mm512_set1_ps(1.0f);
  if constexpr (!kPerGroup) row_scale = _mm512_loadu_ps(tile_scales);
  for (int i = 0; i < MB; ++i) _mm512_storeu_ps(out[i], _mm512_mul_ps(acc[i], row_scale));
}

#else  // AVX2

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline int32_t sum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

template <typename T>
inline int32_t quantize_group(const T* src, int8_t* dst, float* scale, int32_t* halves) {
  const __m256 sign_off = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4];
  __m256 amax8 = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(src + 8 * i);
    amax8 = _mm256_max_ps(amax8, _mm256_and_ps(v[i], sign_off));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  float d = _mm_cvtss_f32(m4) / 127.0f;
  float id = d != 0.0f ? 1.0f / d : 0.0f;
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
  // packs work per 128-bit lane: the dwords come out as q0[0:4] q1[0:4] q2[0:4] q3[0:4] | q0[4:8] ...
  __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bytes);
  *scale = d;
  halves[0] = sum8(_mm256_add_epi32(q[0], q[1]));
  halves[1] = sum8(_mm256_add_epi32(q[2], q[3]));
  return 0;  // the AVX2 tiles hold signed weights: nothing to take back
}

template <bool kPerGroup, int MB>
inline void tile_rows(const uint8_t* tile, const WeightScale<kPerGroup>* tile_scales, int64_t k,
                      const GroupedActivations& q, int64_t m0, float (*out)[16]) {
  const int64_t groups = k / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i sum[MB][2];
    for (int i = 0; i < MB; ++i) sum[i][0] = sum[i][1] = _mm256_setzero_si256();
    const uint8_t* wg = tile + g * kGroup * 16;
    if (m0 == 0)  // later row blocks find the tile in cache
      prefetch_ahead(wg, 8);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m256i x_bytes[MB], x_abs[MB];  // 4 activation bytes, broadcast
      for (int i = 0; i < MB; ++i) {
        const int32_t* xi = reinterpret_cast<const int32_t*>(q.values.data() + (m0 + i) * k + g * kGroup);
        x_bytes[i] = _mm256_set1_epi32(xi[j]);
        x_abs[i] = _mm256_abs_epi8(x_bytes[i]);
      }
      for (int h = 0; h < 2; ++h) {  // rows 0-7, rows 8-15
        __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64 + h * 32));
        for (int i = 0; i < MB; ++i) {
          __m256i pairs = _mm256_maddubs_epi16(x_abs[i], _mm256_sign_epi8(w, x_bytes[i]));
          sum[i][h] = _mm256_add_epi32(sum[i][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    __m256 wscale[2] = {_mm256_set1_ps(1.0f), _mm256_set1_ps(1.0f)};
    if constexpr (kPerGroup) {
      for (int h = 0; h < 2; ++h) {
        wscale[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile_scales + g * 16 + h * 8)));
      }
    }
    for (int i = 0; i < MB; ++i) {
      __m256 xscale = _mm256_set1_ps(q.scales[(m0 + i) * groups + g]);
      for (int h = 0; h < 2; ++h) {
        acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i][h]), _mm256_mul_ps(wscale[h], xscale), acc[i][h]);
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    __m256 row_scale = _mm256_set1_ps(1.0f);
    if constexpr (!kPerGroup) row_scale = _mm256_loadu_ps(tile_scales + h * 8);
    for (int i = 0; i < MB; ++i) _mm256_storeu_ps(out[i] + h * 8, _mm256_mul_ps(acc[i][h], row_scale));
  }
}

#endif

// Groups [begin, end) of x (rows of k values, groups numbered row-major) into q, sized for them.
template <typename T>
inline void quantize_span(const T* x, int64_t begin, int64_t end, GroupedActivations& q) {
  for (int64_t i = begin; i < end; ++i) {
    q.starts[i] = quantize_group(x + i * kGroup, q.values.data() + i * kGroup, &q.scales[i], &q.halves[2 * i]);
    q.sums[i] = q.scales[i] * static_cast<float>(q.halves[2 * i] + q.halves[2 * i + 1]);
  }
}

inline void size_for(GroupedActivations& q, int64_t rows, int64_t k) {
  q.values.resize(rows * k);
  q.scales.resize(rows * (k / kGroup));
  q.starts.resize(rows * (k / kGroup));
  q.halves.resize(2 * rows * (k / kGroup));
  q.sums.resize(rows * (k / kGroup));
}

template <typename T>
GroupedActivations quantize_groups(const T* x, int64_t rows, int64_t k) {
  GroupedActivations q;
  size_for(q, rows, k);
  at::parallel_for(0, rows * (k / kGroup), 1 << 12, [&](int64_t begin, int64_t end) {  // 4096 groups a task
    quantize_span(x, begin, end, q);
  });
  return q;
}

inline void store16(float* dst, const float* v, int64_t count) { std::copy(v, v + count, dst); }

inline void store16(c10::BFloat16* dst, const float* v, int64_t count) {
  for (int64_t i = 0; i < count; ++i) dst[i] = c10::BFloat16(v[i]);
}

// Checks that tiles (uint8 [N/16, K/4, 16, 4], K a multiple of 32) and their scales (float16
// [N/16, K/32, 16] per group, or float32 [N/16 * 16] per row) hold an n-row weight; `op` names
// the caller in the messages. Returns whether the scales are per group.
inline bool check_tiles(const at::Tensor& tiles, const at::Tensor& scales, int64_t n, const char* op) {
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.dim() == 4 && tiles.size(2) == 16 && tiles.size(3) == 4,
              op, ": tiles must be uint8 [N/16, K/4, 16, 4]");
  const int64_t k = tiles.size(1) * 4, num_tiles = tiles.size(0);
  TORCH_CHECK(k % kGroup == 0, op, ": K must be a multiple of 32, got ", k);
  TORCH_CHECK(n > (num_tiles - 1) * 16 && n <= num_tiles * 16, op, ": ", n, " rows in ", num_tiles, " tiles");
  const bool per_group = scales.dim() == 3;
  TORCH_CHECK(per_group ? (scales.size(0) == num_tiles && scales.size(1) == k / kGroup && scales.size(2) == 16)
                        : (scales.dim() == 1 && scales.size(0) == num_tiles * 16),
              op, ": scales must be [N/16, K/32, 16] or [N/16 * 16]");
  TORCH_CHECK(scales.scalar_type() == (per_group ? at::kHalf : at::kFloat),
              op, ": scales must be float16 per group, float32 per row");
  return per_group;
}

// Tiles [t0, t1) of the n-row weight times the rows of q: their columns of out, whose rows are ld apart
// (ld = n for an [rows, n] output; more where the weight is one part of a wider matrix).
template <bool kPerGroup, typename T>
void tile_span(const GroupedActivations& q, const uint8_t* packed, const WeightScale<kPerGroup>* scales,
               int64_t rows, int64_t n, int64_t ld, int64_t k, T* out, int64_t t0, int64_t t1) {
  const int64_t tile_scale_stride = kPerGroup ? (k / kGroup) * 16 : 16;
  alignas(64) float res[4][16];
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = packed + t * 16 * k;
    const WeightScale<kPerGroup>* ts = scales + t * tile_scale_stride;
    const int64_t count = std::min<int64_t>(16, n - t * 16);
    for (int64_t m0 = 0; m0 < rows; m0 += 4) {
      const int64_t mb = std::min<int64_t>(4, rows - m0);
      switch (mb) {
        case 4: tile_rows<kPerGroup, 4>(tile, ts, k, q, m0, res); break;
        case 3: tile_rows<kPerGroup, 3>(tile, ts, k, q, m0, res); break;
        case 2: tile_rows<kPerGroup, 2>(tile, ts, k, q, m0, res); break;
        default: tile_rows<kPerGroup, 1>(tile, ts, k, q, m0, res); break;
      }
      for (int64_t i = 0; i < mb; ++i) store16(out + (m0 + i) * ld + t * 16, res[i], count);
    }
  }
}

// An op's output [.., n] for x [.., k] (float32 or bfloat16 on the CPU; `op` names the caller in
// the messages): compute(x_data, out_data, rows) fills it, x's rows contiguous, in x's dtype.
template <typename Compute>
at::Tensor linear_output(const at::Tensor& x, int64_t n, int64_t k, const char* op, const Compute& compute) {
  TORCH_CHECK(x.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16");
  TORCH_CHECK(x.size(-1) == k, op, ": x has ", x.size(-1), " features, the weight ", k);
  at::Tensor xc = x.contiguous();
  const int64_t rows = xc.numel() / k;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  if (rows == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    compute(xc.const_data_ptr<float>(), out.mutable_data_ptr<float>(), rows);
  } else {
    compute(xc.const_data_ptr<c10::BFloat16>(), out.mutable_data_ptr<c10::BFloat16>(), rows);
  }
  return out;
}

template <bool kPerGroup, typename T>
void run_tiles(const GroupedActivations& q, const uint8_t* packed, const WeightScale<kPerGroup>* scales,
               int64_t rows, int64_t n, int64_t k, T* out) {
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (16 * k));
  at::parallel_for(0, (n + 15) / 16, grain, [&](int64_t t0, int64_t t1) {
    tile_span<kPerGroup>(q, packed, scales, rows, n, n, k, out, t0, t1);
  });
}

}  // namespace
