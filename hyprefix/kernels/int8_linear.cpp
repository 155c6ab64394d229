// hyprefix::int8_linear: x [.., K] (float32 or bfloat16) @ int8 weight [N, K]^T on AVX512-VNNI.
//
// The activations are quantized to int8 per group of 32 (scale = max|x| / 127, rounded to
// nearest even), as llama.cpp does for its Q8_0 dot products; the weight keeps its own scales
// (one per row, or one per group of 32: GGUF Q8_0's blocks).
//
// The weight is packed in tiles of 16 rows: uint8 [N/16, K/4, 16, 4] holding w + 128, so one
// 64-byte load is 4 consecutive k of 16 rows, and one VPDPBUSD with the 4 activation bytes
// broadcast adds them into the 16 rows' own int32 lanes. A group of 32 is 8 such instructions
// into one accumulator, which starts at -128 * sum(x_q) of the group (the + 128 of the weight
// bytes, taken back exactly); it is then scaled (activation scale times the 16 rows' weight
// scales) and summed in float. Scales are float16 [N/16, K/32, 16] per group (Q8_0's own
// precision), or float32 [N/16 * 16] per row (applied at the end). Tiles are split over
// ATen's intra-op threads; up to 4 activation rows share each weight load, so prefill-sized
// calls run as an int8 GEMM.
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

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

struct GroupedActivations {  // per row: K int8 values, and per group its scale and -128 * sum
  std::vector<int8_t> values;
  std::vector<float> scales;
  std::vector<int32_t> starts;
};

template <typename T>
GroupedActivations quantize_groups(const T* x, int64_t rows, int64_t k) {
  const int64_t groups = k / kGroup;
  GroupedActivations q;
  q.values.resize(rows * k);
  q.scales.resize(rows * groups);
  q.starts.resize(rows * groups);
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  at::parallel_for(0, rows * groups, 1 << 12, [&](int64_t begin, int64_t end) {  // 4096 groups a task
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / groups, g = i % groups;
      const T* src = x + m * k + g * kGroup;
      __m512 a = load16(src), b = load16(src + 16);
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(a, sign_off), _mm512_and_ps(b, sign_off)));
      float d = amax / 127.0f;
      float id = d != 0.0f ? 1.0f / d : 0.0f;
      __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
      __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
      int8_t* dst = q.values.data() + m * k + g * kGroup;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qb));
      q.scales[m * groups + g] = d;
      q.starts[m * groups + g] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
  });
  return q;
}

// Per-group weight scales are float16 (bits), per-row ones float32.
template <bool kPerGroup>
using WeightScale = std::conditional_t<kPerGroup, uint16_t, float>;

template <bool kPerGroup, int MB>
inline void tile_rows(const uint8_t* tile, const WeightScale<kPerGroup>* tile_scales, int64_t k,
                      const GroupedActivations& q, int64_t m0, __m512* out) {
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
  for (int i = 0; i < MB; ++i) out[i] = _mm512_mul_ps(acc[i], row_scale);
}

inline void store16(float* dst, __m512 v, int64_t count) {
  _mm512_mask_storeu_ps(dst, static_cast<__mmask16>((1u << count) - 1), v);
}

inline void store16(c10::BFloat16* dst, __m512 v, int64_t count) {
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int64_t i = 0; i < count; ++i) dst[i] = c10::BFloat16(tmp[i]);
}

template <bool kPerGroup, typename T>
void run_tiles(const GroupedActivations& q, const uint8_t* packed, const WeightScale<kPerGroup>* scales,
               int64_t rows, int64_t n, int64_t k, T* out) {
  const int64_t tiles = (n + 15) / 16;
  const int64_t tile_scale_stride = kPerGroup ? (k / kGroup) * 16 : 16;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (16 * k));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    __m512 res[4];
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
        for (int64_t i = 0; i < mb; ++i) store16(out + (m0 + i) * n + t * 16, res[i], count);
      }
    }
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && tiles.device().is_cpu() && scales.device().is_cpu(),
              "int8_linear: CPU tensors only");
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.dim() == 4 && tiles.size(2) == 16 && tiles.size(3) == 4,
              "int8_linear: tiles must be uint8 [N/16, K/4, 16, 4]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int8_linear: x must be float32 or bfloat16");
  const int64_t k = tiles.size(1) * 4, num_tiles = tiles.size(0);
  TORCH_CHECK(k % kGroup == 0, "int8_linear: K must be a multiple of 32, got ", k);
  TORCH_CHECK(x.size(-1) == k, "int8_linear: x has ", x.size(-1), " features, the weight ", k);
  TORCH_CHECK(n > (num_tiles - 1) * 16 && n <= num_tiles * 16, "int8_linear: ", n, " rows in ", num_tiles, " tiles");
  const bool per_group = scales.dim() == 3;
  TORCH_CHECK(per_group ? (scales.size(0) == num_tiles && scales.size(1) == k / kGroup && scales.size(2) == 16)
                        : (scales.dim() == 1 && scales.size(0) == num_tiles * 16),
              "int8_linear: scales must be [N/16, K/32, 16] or [N/16 * 16]");
  TORCH_CHECK(scales.scalar_type() == (per_group ? at::kHalf : at::kFloat),
              "int8_linear: scales must be float16 per group, float32 per row");
  at::Tensor xc = x.contiguous(), pc = tiles.contiguous(), sc = scales.contiguous();
  const int64_t rows = xc.numel() / k;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  if (rows == 0) return out;
  auto compute = [&](auto* xp, auto* op) {
    GroupedActivations q = quantize_groups(xp, rows, k);
    if (per_group) {
      run_tiles<true>(q, pc.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(sc.data_ptr<at::Half>()), rows,
                      n, k, op);
    } else {
      run_tiles<false>(q, pc.data_ptr<uint8_t>(), sc.data_ptr<float>(), rows, n, k, op);
    }
  };
  if (x.scalar_type() == at::kFloat) {
    compute(xc.data_ptr<float>(), out.data_ptr<float>());
  } else {
    compute(xc.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(hyprefix, m) {
  m.def("int8_linear(Tensor x, Tensor tiles, Tensor scales, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(hyprefix, CPU, m) {
  m.impl("int8_linear", &int8_linear);
}
