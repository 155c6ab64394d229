// The 8-bit K/V cache's rows as the attention kernels read them in place (decode_attention.h,
// prefill_attention.cpp; --kv-cache-dtype; the format is hyprefix/models/kv_quant.py's): a
// (token, KV head) row is D one-byte codes, then its scale as float16 bits in the next two bytes
// (little-endian), value = code * scale. A cache of such rows is a tensor of torch.int8 (int8
// codes) or torch.float8_e4m3fn (OCP E4M3 codes) whose last dim is D + 2. Its element type here
// is a one-byte tag per format (Int8Code, E4m3Code), so the kernel's pointer arithmetic stays in
// elements: a row is D + kRowExtra<C> of them.
//
// A row converts to float32 exactly: int8 codes and E4M3 codes are exact in float32, and so is
// their product with a float16 scale (at most 4 + 11 significant bits), so the dequantized row is
// bit for bit kv_quant.dequantize_rows(row, torch.float32), and the attention over it the
// attention of the float32 path over that cache.
//
// Written on ATen's vector types with the ISA's intrinsics for the widening loads: one build per
// CPU capability (AVX512, AVX2), included by decode_attention.h and prefill_attention.cpp.
#pragma once
#include <ATen/cpu/vec/functional.h>  // convert_from_float
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

struct Int8Code {  // an int8 code: value = code * scale
  int8_t bits;
};
struct E4m3Code {  // an OCP E4M3 code (bias 7, 3 mantissa bits, subnormals, 0x7f / 0xff NaN)
  uint8_t bits;
};
static_assert(sizeof(Int8Code) == 1 && sizeof(E4m3Code) == 1, "a code is one byte of the cache");

template <typename C>
inline constexpr bool kPacked = std::is_same_v<C, Int8Code> || std::is_same_v<C, E4m3Code>;

// Elements of a stored row after its D values: the scale's two bytes in a packed row, else none.
template <typename C>
inline constexpr int64_t kRowExtra = kPacked<C> ? 2 : 0;

namespace kv8 {

using Vec = at::vec::Vectorized<float>;

// The scale of the packed row whose D codes start at `row`.
template <typename C>
inline float row_scale(const C* row, int64_t d) {
  uint16_t bits;
  std::memcpy(&bits, row + d, sizeof(bits));  // little-endian, as x86 loads it
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline float code_value(Int8Code c) { return static_cast<float>(c.bits); }
inline float code_value(E4m3Code c) {
  return static_cast<float>(c10::Float8_e4m3fn(c.bits, c10::Float8_e4m3fn::from_bits()));
}

// Vec::size() codes from p as floats, not yet scaled: the codes' values / kCodeUnit<C>.
inline Vec lanes(const Int8Code* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  float f[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i) f[i] = code_value(p[i]);
  return Vec::loadu(f);
#endif
}

// E4M3 by its bits, every lane at once (a table lookup would be a gather, slow on these ISAs),
// through float16: a code's exponent and mantissa fields (e, m: 4 and 3 bits, bias 7), shifted
// left 7 within a 16-bit lane, become a float16's (5 and 10 bits, bias 15) of value code * 2^-8,
// normal (e > 0) and subnormal (e = 0) alike, since 15 - 7 = 8 and float16's subnormal unit is
// E4M3's times 2^-8; the sign bit moves from bit 7 to 15 as (x + (x & 0x80)) << 7 carries it. The
// hardware's float16 conversion (vcvtph2ps, F16C) then gives float32 exactly, and the caller's
// scale carries the 2^8 back (kCodeUnit: exact, a power of two). E4M3's NaN (e and m all ones)
// would be float16's 1.875; it is set to float16's NaN (0x7e00) first, so a NaN code stays NaN.
template <typename C>
inline constexpr float kCodeUnit = std::is_same_v<C, E4m3Code> ? 256.0f : 1.0f;

inline Vec lanes(const E4m3Code* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_slli_epi16(_mm256_add_epi16(x, _mm256_and_si256(x, _mm256_set1_epi16(0x80))), 7);
  const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), _mm256_set1_epi16(0x7f));
  return _mm512_cvtph_ps(_mm256_mask_mov_epi16(h, nan, _mm256_set1_epi16(0x7e00)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_slli_epi16(_mm_add_epi16(x, _mm_and_si128(x, _mm_set1_epi16(0x80))), 7);
  const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7f));
  return _mm256_cvtph_ps(_mm_blendv_epi8(h, _mm_set1_epi16(0x7e00), nan));
#else
  float f[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i) f[i] = code_value(p[i]) / kCodeUnit<E4m3Code>;
  return Vec::loadu(f);
#endif
}

// A packed row of D values (D a multiple of Vec::size()) into registers, dequantized.
template <int64_t D, typename C>
inline void load_row(const C* p, Vec (&r)[D / Vec::size()]) {
  const Vec scale(row_scale(p, D) * kCodeUnit<C>);
  for (int64_t i = 0; i < D / Vec::size(); ++i) r[i] = lanes(p + i * Vec::size()) * scale;
}

// A packed row of any n values into dst, dequantized: whole vectors, then the tail one by one.
template <typename C>
inline void to_float(const C* src, float* dst, int64_t n) {
  const float scale = row_scale(src, n);
  const Vec s(scale * kCodeUnit<C>);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) (lanes(src + i) * s).store(dst + i);
  for (; i < n; ++i) dst[i] = code_value(src[i]) * scale;
}

// A packed row of any n values into dst as T (float, c10::BFloat16 or c10::Half), dequantized
// (exact in float32) and then rounded to T to nearest even, as torch's .to(T) rounds: bit for bit
// kv_quant.dequantize_rows(row, T), the values a gathered-and-dequantized cache of T holds.
template <typename T, typename C>
inline void to_type(const C* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    to_float(src, dst, n);
  } else {
    constexpr int64_t w = Vec::size();
    const float scale = row_scale(src, n);
    const Vec s(scale * kCodeUnit<C>);
    int64_t i = 0;
    for (; i + 2 * w <= n; i += 2 * w)
      at::vec::convert_from_float<T>(lanes(src + i) * s, lanes(src + i + w) * s).store(dst + i);
    for (; i < n; ++i) dst[i] = T(code_value(src[i]) * scale);
  }
}

}  // namespace kv8
}  // namespace
