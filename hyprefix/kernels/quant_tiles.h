// Low-bit weight tiles (GGUF's 4- and 6-bit blocks kept in the form a dot product reads) and their
// matmul with activations quantized to int8 per 32 (int8_tiles.h's GroupedActivations): the
// arithmetic of hyprefix::quant_linear (quant_linear.cpp) and of DecodeModel's low-bit matrices.
//
// A matrix of n rows and k columns (k a multiple of 32) is a list of parts, each a run of 16-row
// tiles in one format, so a fused matrix (q/k/v) whose pieces a file stored in different types
// keeps each piece's own. The formats:
//
//   Q4 (GGUF Q4_0, Q4_1; Q5_K rounded to it): per group of 32 columns of a row an unsigned
//      4-bit q, a float16 scale s and a float16 offset o: the value is s * q + o. data uint8
//      [tiles, k/32, 4, 64]: nibble line p of a group holds, at byte r * 4 + b (row r of the tile),
//      q of column 8p + b in its low nibble and of column 8p + 4 + b in its high nibble. scales,
//      offsets float16 [tiles, k/32, 16].
//   Q4K (GGUF Q4_K, exactly): Q4's codes and data with two levels of scales, as Q4_K has them: per
//      group of 32 columns of a row an unsigned 8-bit scale code sc and min code m, per 256 a
//      float16 d and dmin: the value is d * sc * q - dmin * m. scales uint8 [tiles, k/32, 32] (sc of
//      rows 0-15, then m of rows 0-15), extra float16 [tiles, k/256, 32] (d of rows 0-15, then dmin).
//      4.625 bits a weight (Q4_K: 4.5) where Q4 spends 5.
//   Q6 (GGUF Q6_K, exactly): an unsigned 6-bit q, an int8 scale per run of 16 columns and a
//      float16 d per 256: the value is d * scale * (q - 32). data uint8 [tiles, k/32, 6, 64]: the
//      low 4 bits as Q4's 4 nibble lines, then 2 lines of the high 2 bits: line c, byte r * 4 + b,
//      bits 2i and 2i + 1 are those of column 16c + 4i + b. scales int8 [tiles, k/16, 16], d
//      float16 [tiles, k/256, 16].
//   MX4 (GGUF MXFP4, OCP's MX FP4, exactly): per group of 32 columns of a row a 4-bit E2M1 code
//      and an E8M0 scale e: the value is kMxfp4Values[code] * 2^(e - 128) (the code's E2M1 value
//      doubled, as ggml writes it). Q4's data (the codes' nibble lines); scales uint8
//      [tiles, K/32, 16] (e per row), no extra. 4.25 bits a weight, as the file.
//   Int8 (GGUF Q8_0): int8_tiles.h's tiles with float16 scales per group.
//
// The four bytes of each row a 64-byte line holds are the columns one broadcast activation word
// multiplies, as in int8_tiles.h: after unpacking a line (mask and shift) it is int8_tiles.h's line
// of unsigned bytes. A group's sum over its 32 columns is exact in int32 (AVX512-VNNI: VPDPBUSD of
// the unsigned weights and signed activations; AVX2: VPMADDUBSW, whose pairs cannot saturate as the
// weights are below 64, then VPMADDWD), then scaled in float: Q4 adds s * x_scale * sum(q x) and
// o * x_scale * sum(x) (Q4K the same, its s and o made from the two levels; AVX-512 keeps each
// line's high nibbles in place, 16 times their value, and sums Q4K's scale codes over a super-block
// before d and dmin: q4_tile_rows); Q6 starts each half's int32 sum at -32 * sum(x) of its 16 activations and
// adds d * scale * x_scale * sum; MX4 looks each code up (VPSHUFB) as its value plus 12, an unsigned
// byte below 25, and adds 2^(e - 128) * x_scale * (sum - 12 * sum(x)). Up to 4 activation rows share
// each weight load (prefill).
#pragma once
#include "int8_tiles.h"

#include <c10/util/Half.h>

#include <cstring>

namespace {

enum class TileFormat : int { kInt8 = 0, kQ4 = 1, kQ6 = 2, kQ4K = 3, kMX4 = 4 };

// MXFP4's E2M1 values doubled (ggml's kvalues_mxfp4), and their lookup bytes (value + 12).
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr int kMxfp4Lift = 12;
#define HYPREFIX_MXFP4_LIFTED 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0

// 2^(e - 128), an E8M0 scale halved (kMxfp4Values are doubled); 0 for e = 0.
inline float e8m0_half(uint8_t e) {
  uint32_t bits = static_cast<uint32_t>(e) << 23;
  float v;
  std::memcpy(&v, &bits, 4);
  return 0.5f * v;
}

// Bytes of one tile's group of 32 columns, per format.
constexpr int64_t group_bytes(TileFormat f) { return f == TileFormat::kQ6 ? 384 : f == TileFormat::kInt8 ? 512 : 256; }

// Bytes of scales (Q4, Int8: float16 a row and group; Q4K, Q6, MX4: one-byte codes) and elements
// of extra (float16; Int8 and MX4 have none) per tile, per format.
constexpr int64_t scale_bytes_per_tile(TileFormat f, int64_t k) {
  return f == TileFormat::kQ6 ? 2 * (k / 32) * 16 : f == TileFormat::kQ4K ? (k / 32) * 32
         : f == TileFormat::kMX4 ? (k / 32) * 16 : (k / 32) * 16 * 2;
}
constexpr int64_t extra_per_tile(TileFormat f, int64_t k) {
  return f == TileFormat::kQ6 ? (k / 256) * 16 : f == TileFormat::kQ4K ? (k / 256) * 32
         : f == TileFormat::kMX4 || f == TileFormat::kInt8 ? 0 : (k / 32) * 16;
}

struct TilePart {  // tiles [tile0, tile0 + tiles) of a matrix in one format
  TileFormat format;
  const uint8_t* data;
  const void* scales;  // Int8: float16 per group; Q4: float16 s; Q6: int8 per 16; Q4K: uint8 sc, m per group;
                       // MX4: uint8 e per group
  const void* extra;   // Q4: float16 offsets; Q6: float16 d per 256; Q4K: float16 d, dmin per 256; Int8, MX4: unused
  int64_t tile0, tiles;

  int64_t tile_bytes(int64_t k) const { return (k / kGroup) * group_bytes(format); }
};

// The format of a part's data tensor (its third dimension: 16 for int8 tiles [T, K/4, 16, 4], 4 for
// Q4, Q4K and MX4 (float16 scales; uint8 codes, 32 or 16 a group), 6 for Q6) and checks of its shapes and dtypes for an `rows`-row part of k columns.
inline TileFormat check_part(const at::Tensor& data, const at::Tensor& scales, const at::Tensor& extra, int64_t rows,
                             int64_t k, const char* op) {
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 4 && data.is_contiguous() && scales.is_contiguous() &&
                  extra.is_contiguous() && data.device().is_cpu() && scales.device().is_cpu(),
              op, ": tiles must be contiguous uint8 CPU tensors");
  const int64_t tiles = data.size(0);
  TORCH_CHECK(rows > (tiles - 1) * 16 && rows <= tiles * 16, op, ": ", rows, " rows in ", tiles, " tiles");
  if (data.size(2) == 16) {
    TORCH_CHECK(check_tiles(data, scales, rows, op), op, ": int8 parts take scales per group");
    TORCH_CHECK(data.size(1) * 4 == k, op, ": a part of ", data.size(1) * 4, " columns in a matrix of ", k);
    return TileFormat::kInt8;
  }
  const int64_t groups = k / kGroup;
  TORCH_CHECK(k % kGroup == 0 && data.size(1) == groups && data.size(3) == 64, op, ": tiles of ", k, " columns");
  if (data.size(2) == 4 && scales.scalar_type() == at::kByte && scales.numel() == tiles * groups * 16) {
    TORCH_CHECK(extra.numel() == 0, op, ": MX4 tiles take uint8 scales [tiles, K/32, 16] and no extra");
    return TileFormat::kMX4;
  }
  if (data.size(2) == 4 && scales.scalar_type() == at::kByte) {
    TORCH_CHECK(k % 256 == 0 && extra.scalar_type() == at::kHalf && scales.numel() == tiles * groups * 32 &&
                    extra.numel() == tiles * (k / 256) * 32,
                op, ": Q4K tiles take uint8 scales [tiles, K/32, 32] and float16 d [tiles, K/256, 32] (K a multiple "
                "of 256)");
    return TileFormat::kQ4K;
  }
  if (data.size(2) == 4) {
    TORCH_CHECK(scales.scalar_type() == at::kHalf && extra.scalar_type() == at::kHalf &&
                    scales.numel() == tiles * groups * 16 && extra.numel() == tiles * groups * 16,
                op, ": Q4 tiles take float16 scales and offsets [tiles, K/32, 16]");
    return TileFormat::kQ4;
  }
  TORCH_CHECK(data.size(2) == 6 && k % 256 == 0, op, ": Q6 tiles need K a multiple of 256");
  TORCH_CHECK(scales.scalar_type() == at::kChar && extra.scalar_type() == at::kHalf &&
                  scales.numel() == tiles * 2 * groups * 16 && extra.numel() == tiles * (k / 256) * 16,
              op, ": Q6 tiles take int8 scales [tiles, K/16, 16] and float16 d [tiles, K/256, 16]");
  return TileFormat::kQ6;
}

// The parts of an n-row, k-column matrix from the flat list [data, scales, extra] * parts.
inline std::vector<TilePart> parts_of(const std::vector<at::Tensor>& flat, int64_t n, int64_t k, const char* op) {
  TORCH_CHECK(!flat.empty() && flat.size() % 3 == 0, op, ": parts come as [data, scales, extra] each");
  std::vector<TilePart> parts;
  int64_t tile0 = 0;
  for (size_t i = 0; i < flat.size(); i += 3) {
    const at::Tensor &data = flat[i], &scales = flat[i + 1], &extra = flat[i + 2];
    const bool last = i + 3 == flat.size();
    const int64_t rows = last ? n - tile0 * 16 : data.size(0) * 16;
    const TileFormat format = check_part(data, scales, extra, rows, k, op);
    parts.push_back({format, data.const_data_ptr<uint8_t>(), scales.const_data_ptr(), extra.const_data_ptr(), tile0,
                     data.size(0)});
    tile0 += data.size(0);
  }
  TORCH_CHECK(tile0 == (n + 15) / 16, op, ": the parts hold ", tile0, " tiles for ", n, " rows");
  return parts;
}

// How far ahead the low-bit tiles prefetch: further than the int8 tiles' kAheadBytes. Where memory
// reads about as fast as these kernels compute, a core's misses must be issued earlier to overlap
// the two; where memory is the bound, the distance does not matter (the A/B: docs/perf-log.md,
// 2026-12-07, tenth session).
constexpr int64_t kLowBitAheadBytes = 6144;

// Group g of a tile in format F: returns its codes, after pulling the lines kLowBitAheadBytes on
// toward L2 where `prefetch` (only a tile's first pass streams it: later row blocks find it in
// cache), and points x at the MB activation rows' words of the group (4 int8 values each, for
// broadcasting).
template <TileFormat F, int MB>
inline const uint8_t* start_group(const uint8_t* tile, int64_t g, bool prefetch, const GroupedActivations& q,
                                  int64_t m0, int64_t groups, const int32_t* (&x)[MB]) {
  const uint8_t* wg = tile + g * group_bytes(F);
  if (prefetch) prefetch_ahead(wg, group_bytes(F) / 64, kLowBitAheadBytes);
  for (int i = 0; i < MB; ++i) x[i] = reinterpret_cast<const int32_t*>(q.values.data() + ((m0 + i) * groups + g) * kGroup);
  return wg;
}

#if defined(__AVX512VNNI__)

inline __m512 half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512 int8x16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512 uint8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// MB activation rows times one Q4 or Q4K tile (AVX-512). Each line's high nibbles stay in place
// (masked, not shifted: 16 times their value), so a group's dot is 16 * first + second, and the
// 1/16 is applied once: Q4K per super-block with d, Q4 at the end. Q4K sums a super-block's 8
// groups as sum(sc * dot * x_scale) and sum(m * x_scale * sum(x)), then adds d / 16 and -dmin
// times them: fewer operations a group, which set the kernel's rate once its codes are in cache
// (docs/perf-log.md, 2026-12-07). A row's operations are the same whatever MB is.
template <TileFormat F, int MB>
inline void q4_tile_rows(const uint8_t* tile, const void* tile_scales, const void* tile_extra, int64_t k,
                         const GroupedActivations& q, int64_t m0, float (*out)[16]) {
  const int64_t groups = k / kGroup;
  const int64_t run = F == TileFormat::kQ4K ? 8 : groups;  // groups a scale sum spans
  const __m512i low4 = _mm512_set1_epi8(0x0f), high4 = _mm512_set1_epi8(static_cast<char>(0xf0));
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < groups; g0 += run) {
    __m512 scaled[MB], offsets[MB];  // sum(scale * dot * x_scale), sum(offset * x_scale * sum(x))
    for (int i = 0; i < MB; ++i) scaled[i] = offsets[i] = _mm512_setzero_ps();
    for (int64_t g = g0; g < g0 + run; ++g) {
      const int32_t* x[MB];
      const uint8_t* wg = start_group<F, MB>(tile, g, m0 == 0, q, m0, groups, x);
      __m512i first[MB], second[MB];  // the low nibbles' dot, the high nibbles' (times 16)
      for (int i = 0; i < MB; ++i) first[i] = second[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m512i v = _mm512_loadu_si512(wg + p * 64);
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(v, high4);
        for (int i = 0; i < MB; ++i) {
          first[i] = _mm512_dpbusd_epi32(first[i], lo, _mm512_set1_epi32(x[i][2 * p]));
          second[i] = _mm512_dpbusd_epi32(second[i], hi, _mm512_set1_epi32(x[i][2 * p + 1]));
        }
      }
      __m512 s, o;  // Q4K: the codes sc and m as floats; Q4: s and o
      if constexpr (F == TileFormat::kQ4K) {
        const uint8_t* sm = static_cast<const uint8_t*>(tile_scales) + g * 32;
        s = uint8x16(sm);
        o = uint8x16(sm + 16);
      } else {
        s = half16(static_cast<const uint16_t*>(tile_scales) + g * 16);
        o = half16(static_cast<const uint16_t*>(tile_extra) + g * 16);
      }
      for (int i = 0; i < MB; ++i) {
        const int64_t at = (m0 + i) * groups + g;
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(first[i], 4), second[i]));
        scaled[i] = _mm512_fmadd_ps(_mm512_mul_ps(dot, s), _mm512_set1_ps(q.scales[at]), scaled[i]);
        offsets[i] = _mm512_fmadd_ps(o, _mm512_set1_ps(q.sums[at]), offsets[i]);
      }
    }
    if constexpr (F == TileFormat::kQ4K) {
      const uint16_t* dd = static_cast<const uint16_t*>(tile_extra) + (g0 / 8) * 32;
      const __m512 d = _mm512_mul_ps(half16(dd), _mm512_set1_ps(1.0f / 16)), dmin = half16(dd + 16);
      for (int i = 0; i < MB; ++i) acc[i] = _mm512_fnmadd_ps(dmin, offsets[i], _mm512_fmadd_ps(d, scaled[i], acc[i]));
    } else {
      for (int i = 0; i < MB; ++i)
        acc[i] = _mm512_fmadd_ps(scaled[i], _mm512_set1_ps(1.0f / 16), _mm512_add_ps(acc[i], offsets[i]));
    }
  }
  for (int i = 0; i < MB; ++i) _mm512_storeu_ps(out[i], acc[i]);
}

// MB activation rows times one Q6 tile (AVX-512): each line's 2 high bits or'ed onto its nibbles.
// (Scaling a super-block's runs in int32 or float before d, as q4_tile_rows does, measured no
// faster within the VM's noise: docs/perf-log.md, 2026-12-07.)
template <int MB>
inline void q6_tile_rows(const uint8_t* tile, const void* tile_scales, const void* tile_extra, int64_t k,
                         const GroupedActivations& q, int64_t m0, float (*out)[16]) {
  const int64_t groups = k / kGroup;
  const __m512i low4 = _mm512_set1_epi8(0x0f), high2 = _mm512_set1_epi8(0x30);
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  __m512 d = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int32_t* x[MB];
    const uint8_t* wg = start_group<TileFormat::kQ6, MB>(tile, g, m0 == 0, q, m0, groups, x);
    __m512i first[MB], second[MB];  // the two runs of 16 columns
    for (int i = 0; i < MB; ++i) {
      const int64_t at = (m0 + i) * groups + g;
      first[i] = _mm512_set1_epi32(-32 * q.halves[2 * at]);
      second[i] = _mm512_set1_epi32(-32 * q.halves[2 * at + 1]);
    }
    const __m512i crumbs[2] = {_mm512_loadu_si512(wg + 4 * 64), _mm512_loadu_si512(wg + 5 * 64)};
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {  // lines 2p and 2p + 1: crumbs 2p % 4 and 2p % 4 + 1 of line p / 2
      const __m512i v = _mm512_loadu_si512(wg + p * 64), c = crumbs[p / 2];
      const bool even = p % 2 == 0;  // line 2p's crumb sits at bits 0 (even p) or 4, 2p + 1's 2 higher
      const __m512i lo = _mm512_or_si512(_mm512_and_si512(v, low4),
                                         _mm512_and_si512(even ? _mm512_slli_epi16(c, 4) : c, high2));
      const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4),
                                         _mm512_and_si512(even ? _mm512_slli_epi16(c, 2) : _mm512_srli_epi16(c, 2), high2));
      for (int i = 0; i < MB; ++i) {
        __m512i& sum = p < 2 ? first[i] : second[i];
        sum = _mm512_dpbusd_epi32(sum, lo, _mm512_set1_epi32(x[i][2 * p]));
        sum = _mm512_dpbusd_epi32(sum, hi, _mm512_set1_epi32(x[i][2 * p + 1]));
      }
    }
    if (g % 8 == 0) d = half16(static_cast<const uint16_t*>(tile_extra) + (g / 8) * 16);
    const int8_t* sc = static_cast<const int8_t*>(tile_scales) + g * 32;
    const __m512 s0 = _mm512_mul_ps(d, int8x16(sc)), s1 = _mm512_mul_ps(d, int8x16(sc + 16));
    for (int i = 0; i < MB; ++i) {
      const __m512 xs = _mm512_set1_ps(q.scales[(m0 + i) * groups + g]);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(first[i]), _mm512_mul_ps(s0, xs), acc[i]);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(second[i]), _mm512_mul_ps(s1, xs), acc[i]);
    }
  }
  for (int i = 0; i < MB; ++i) _mm512_storeu_ps(out[i], acc[i]);
}

// MB activation rows times one MX4 tile (AVX-512): each code looked up as its value plus 12.
template <int MB>
inline void mx4_tile_rows(const uint8_t* tile, const void* tile_scales, int64_t k, const GroupedActivations& q,
                          int64_t m0, float (*out)[16]) {
  const int64_t groups = k / kGroup;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i lifted = _mm512_broadcast_i32x4(_mm_setr_epi8(HYPREFIX_MXFP4_LIFTED));
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int32_t* x[MB];
    const uint8_t* wg = start_group<TileFormat::kMX4, MB>(tile, g, m0 == 0, q, m0, groups, x);
    __m512i first[MB], second[MB];  // even and odd lines
    for (int i = 0; i < MB; ++i) first[i] = second[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_loadu_si512(wg + p * 64);
      const __m512i lo = _mm512_shuffle_epi8(lifted, _mm512_and_si512(v, low4));
      const __m512i hi = _mm512_shuffle_epi8(lifted, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
      for (int i = 0; i < MB; ++i) {
        first[i] = _mm512_dpbusd_epi32(first[i], lo, _mm512_set1_epi32(x[i][2 * p]));
        second[i] = _mm512_dpbusd_epi32(second[i], hi, _mm512_set1_epi32(x[i][2 * p + 1]));
      }
    }
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(tile_scales) + g * 16)));
    const __m512 s = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(e, 23)), _mm512_set1_ps(0.5f));
    for (int i = 0; i < MB; ++i) {
      const int64_t at = (m0 + i) * groups + g;
      const __m512i lift = _mm512_set1_epi32(kMxfp4Lift * (q.halves[2 * at] + q.halves[2 * at + 1]));
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(first[i], second[i]), lift));
      acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(s, _mm512_set1_ps(q.scales[at])), acc[i]);
    }
  }
  for (int i = 0; i < MB; ++i) _mm512_storeu_ps(out[i], acc[i]);
}

// MB activation rows times one Q4, Q4K, Q6 or MX4 tile: the 16 rows' results of each into out[i].
template <TileFormat F, int MB, int NH>  // NH: the AVX2 version's halves a pass (a zmm holds all 16 rows)
inline void quant_tile_rows(const uint8_t* tile, const void* tile_scales, const void* tile_extra, int64_t k,
                            const GroupedActivations& q, int64_t m0, float (*out)[16]) {
  if constexpr (F == TileFormat::kQ6) {
    q6_tile_rows<MB>(tile, tile_scales, tile_extra, k, q, m0, out);
  } else if constexpr (F == TileFormat::kMX4) {
    mx4_tile_rows<MB>(tile, tile_scales, k, q, m0, out);
  } else {
    q4_tile_rows<F, MB>(tile, tile_scales, tile_extra, k, q, m0, out);
  }
}

#else  // AVX2

inline __m256 half8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline __m256 int8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline __m256 uint8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// NH of a tile's two 8-row halves (rows 0-7, rows 8-15) at a time, over every group. NH = 1 when the
// tile is reused from cache by many activation rows (prefill): one half's MB accumulators and scales
// fit AVX2's 16 registers, both halves at once spill to the stack. NH = 2 when the tile streams from
// memory for a few rows (decode): one pass reads each line once.
template <TileFormat F, int MB, int NH>
inline void quant_tile_rows(const uint8_t* tile, const void* tile_scales, const void* tile_extra, int64_t k,
                            const GroupedActivations& q, int64_t m0, float (*out)[16]) {
  const int64_t groups = k / kGroup;
  const __m256i low4 = _mm256_set1_epi8(0x0f), high2 = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
  const __m256i lifted = _mm256_broadcastsi128_si256(_mm_setr_epi8(HYPREFIX_MXFP4_LIFTED));
  for (int h0 = 0; h0 < 2; h0 += NH) {
    __m256 acc[MB][NH];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NH; ++j) acc[i][j] = _mm256_setzero_ps();
    __m256 d[NH], dmin[NH];
    for (int j = 0; j < NH; ++j) d[j] = dmin[j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const int32_t* x[MB];
      const uint8_t* wg = start_group<F, MB>(tile, g, m0 == 0 && h0 == 0, q, m0, groups, x);
      if (g % 8 == 0) {
        for (int j = 0; j < NH; ++j) {
          const int h = h0 + j;
          if constexpr (F == TileFormat::kQ6) {
            d[j] = half8(static_cast<const uint16_t*>(tile_extra) + (g / 8) * 16 + h * 8);
          } else if constexpr (F == TileFormat::kQ4K) {
            d[j] = half8(static_cast<const uint16_t*>(tile_extra) + (g / 8) * 32 + h * 8);
            dmin[j] = half8(static_cast<const uint16_t*>(tile_extra) + (g / 8) * 32 + 16 + h * 8);
          }
        }
      }
      for (int j = 0; j < NH; ++j) {
        const int h = h0 + j;
        // Q4: all 8 lines' pairs summed in int16 (8 * 2 * 15 * 127 < 2^15); Q6: per run of 16 (2 lines a
        // sum); MX4 (bytes to 24): each pair of lines widened to int32 (2 * 2 * 24 * 127 < 2^15)
        __m256i pairs[MB];
        __m256i run[MB][2];  // Q6's int32 sums per run; MX4's in run[i][0]
        for (int i = 0; i < MB; ++i) pairs[i] = run[i][0] = run[i][1] = _mm256_setzero_si256();
        __m256i crumbs[2];
        if constexpr (F == TileFormat::kQ6) {
          crumbs[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 4 * 64 + h * 32));
          crumbs[1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 5 * 64 + h * 32));
        }
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + p * 64 + h * 32));
          __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          if constexpr (F == TileFormat::kQ6) {
            const __m256i c = crumbs[p / 2];
            const int s = 2 * (p % 2);
            lo = _mm256_or_si256(lo, _mm256_and_si256(s == 0 ? _mm256_slli_epi16(c, 4) : c, high2));
            hi = _mm256_or_si256(hi,
                                 _mm256_and_si256(s == 0 ? _mm256_slli_epi16(c, 2) : _mm256_srli_epi16(c, 2), high2));
          } else if constexpr (F == TileFormat::kMX4) {
            lo = _mm256_shuffle_epi8(lifted, lo);
            hi = _mm256_shuffle_epi8(lifted, hi);
          }
          for (int i = 0; i < MB; ++i) {
            const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x[i][2 * p])),
                                                  _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x[i][2 * p + 1])));
            if constexpr (F == TileFormat::kQ6) {
              run[i][p / 2] = _mm256_add_epi32(run[i][p / 2], _mm256_madd_epi16(pair, ones));
            } else if constexpr (F == TileFormat::kMX4) {
              run[i][0] = _mm256_add_epi32(run[i][0], _mm256_madd_epi16(pair, ones));
            } else {
              pairs[i] = _mm256_add_epi16(pairs[i], pair);
            }
          }
        }
        if constexpr (F == TileFormat::kMX4) {
          const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
              reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(tile_scales) + g * 16 + h * 8)));
          const __m256 s = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(e, 23)), _mm256_set1_ps(0.5f));
          for (int i = 0; i < MB; ++i) {
            const int64_t at = (m0 + i) * groups + g;
            const __m256i lift = _mm256_set1_epi32(kMxfp4Lift * (q.halves[2 * at] + q.halves[2 * at + 1]));
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_sub_epi32(run[i][0], lift));
            acc[i][j] = _mm256_fmadd_ps(dot, _mm256_mul_ps(s, _mm256_set1_ps(q.scales[at])), acc[i][j]);
          }
        } else if constexpr (F == TileFormat::kQ4 || F == TileFormat::kQ4K) {
          __m256 s, o;
          if constexpr (F == TileFormat::kQ4K) {
            const uint8_t* sm = static_cast<const uint8_t*>(tile_scales) + g * 32 + h * 8;
            s = _mm256_mul_ps(d[j], uint8x8(sm));
            o = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin[j], uint8x8(sm + 16)));
          } else {
            s = half8(static_cast<const uint16_t*>(tile_scales) + g * 16 + h * 8);
            o = half8(static_cast<const uint16_t*>(tile_extra) + g * 16 + h * 8);
          }
          for (int i = 0; i < MB; ++i) {
            const int64_t at = (m0 + i) * groups + g;
            const float xs = q.scales[at];
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[i], ones));
            acc[i][j] = _mm256_fmadd_ps(dot, _mm256_mul_ps(s, _mm256_set1_ps(xs)), acc[i][j]);
            acc[i][j] = _mm256_fmadd_ps(
                o, _mm256_set1_ps(xs * static_cast<float>(q.halves[2 * at] + q.halves[2 * at + 1])), acc[i][j]);
          }
        } else {
          const int8_t* sc = static_cast<const int8_t*>(tile_scales) + g * 32 + h * 8;
          const __m256 s0 = _mm256_mul_ps(d[j], int8x8(sc)), s1 = _mm256_mul_ps(d[j], int8x8(sc + 16));
          for (int i = 0; i < MB; ++i) {
            const int64_t at = (m0 + i) * groups + g;
            const __m256 xs = _mm256_set1_ps(q.scales[at]);
            const __m256i r0 = _mm256_sub_epi32(run[i][0], _mm256_set1_epi32(32 * q.halves[2 * at]));
            const __m256i r1 = _mm256_sub_epi32(run[i][1], _mm256_set1_epi32(32 * q.halves[2 * at + 1]));
            acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(r0), _mm256_mul_ps(s0, xs), acc[i][j]);
            acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(r1), _mm256_mul_ps(s1, xs), acc[i][j]);
          }
        }
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NH; ++j) _mm256_storeu_ps(out[i] + (h0 + j) * 8, acc[i][j]);
  }
}

#endif

// Up to this many activation rows a tile is streamed in one pass (AVX2: both halves at once).
constexpr int64_t kStreamRows = 4;

// Tiles [t0, t1) of the matrix (indices over all its parts) that lie in `part`, times q's rows:
// their columns of out ([rows, n]).
template <typename T>
void part_span(const TilePart& part, const GroupedActivations& q, int64_t rows, int64_t n, int64_t k, T* out,
               int64_t t0, int64_t t1) {
  t0 = std::max(t0, part.tile0);
  t1 = std::min(t1, part.tile0 + part.tiles);
  if (t0 >= t1) return;
  if (part.format == TileFormat::kInt8) {  // int8_tiles.h's loop over the part's own tiles and columns
    const int64_t local_n = std::min(n - part.tile0 * 16, part.tiles * 16);
    tile_span<true>(q, part.data, static_cast<const uint16_t*>(part.scales), rows, local_n, n, k,
                    out + part.tile0 * 16, t0 - part.tile0, t1 - part.tile0);
    return;
  }
  alignas(64) float res[4][16];
  const bool stream = rows <= kStreamRows;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t local = t - part.tile0;
    const uint8_t* tile = part.data + local * part.tile_bytes(k);
    const void* scales = static_cast<const uint8_t*>(part.scales) + local * scale_bytes_per_tile(part.format, k);
    const void* extra = static_cast<const uint16_t*>(part.extra) + local * extra_per_tile(part.format, k);
    const int64_t count = std::min<int64_t>(16, n - t * 16);
    for (int64_t m0 = 0; m0 < rows; m0 += 4) {
      const int64_t mb = std::min<int64_t>(4, rows - m0);
#define HYPREFIX_QUANT_ROWS(F)                                                                          \
  switch (mb) {                                                                                         \
    case 4:                                                                                             \
      stream ? quant_tile_rows<F, 4, 2>(tile, scales, extra, k, q, m0, res)                             \
             : quant_tile_rows<F, 4, 1>(tile, scales, extra, k, q, m0, res);                            \
      break;                                                                                            \
    case 3:                                                                                             \
      stream ? quant_tile_rows<F, 3, 2>(tile, scales, extra, k, q, m0, res)                             \
             : quant_tile_rows<F, 3, 1>(tile, scales, extra, k, q, m0, res);                            \
      break;                                                                                            \
    case 2: quant_tile_rows<F, 2, 2>(tile, scales, extra, k, q, m0, res); break; /* fit: both halves */ \
    default: quant_tile_rows<F, 1, 2>(tile, scales, extra, k, q, m0, res); break;                       \
  }
      if (part.format == TileFormat::kQ6) {
        HYPREFIX_QUANT_ROWS(TileFormat::kQ6)
      } else if (part.format == TileFormat::kQ4K) {
        HYPREFIX_QUANT_ROWS(TileFormat::kQ4K)
      } else if (part.format == TileFormat::kMX4) {
        HYPREFIX_QUANT_ROWS(TileFormat::kMX4)
      } else {
        HYPREFIX_QUANT_ROWS(TileFormat::kQ4)
      }
#undef HYPREFIX_QUANT_ROWS
      for (int64_t i = 0; i < mb; ++i) store16(out + (m0 + i) * n + t * 16, res[i], count);
    }
  }
}

// Tiles [t0, t1) of a matrix of parts times q's rows into out [rows, n].
template <typename T>
void parts_span(const std::vector<TilePart>& parts, const GroupedActivations& q, int64_t rows, int64_t n, int64_t k,
                T* out, int64_t t0, int64_t t1) {
  for (const TilePart& part : parts) part_span(part, q, rows, n, k, out, t0, t1);
}

}  // namespace
