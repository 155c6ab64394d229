// A tile format's rows as codes and back: a GGUF tensor's blocks (or unpacked codes) decoded per
// row and placed into quant_tiles.h's tiles (quant_pack, quant_pack_gguf), and a tile row
// dequantized (quant_rows; the decode model's embedding lookups). Plain C++, no SIMD: packing
// runs once at load, a task per tile; dequantizing a row is an embedding's lookup.
#pragma once
#include "quant_tiles.h"

#include <c10/util/Half.h>

#include <cstring>

namespace {

constexpr int64_t kTypeQ4_0 = 2, kTypeQ4_1 = 3, kTypeQ5_K = 13, kTypeQ4_K = 12, kTypeQ6_K = 14, kTypeMXFP4 = 39;

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline uint16_t half_bits(float v) { return c10::Half(v).x; }

// One row unpacked: q per column, and per group (Q4: s, o as float16 bits; Q4K: sc, m codes) or per
// run of 16 (Q6: int8 scales) and per 256 (Q6: float16 d bits; Q4K: d and dmin bits).
struct RowCodes {
  std::vector<uint8_t> q;
  std::vector<uint16_t> s, o;    // Q4 per 32
  std::vector<uint8_t> sc4, m4;  // Q4K per 32 (MX4: its E8M0 scales in sc4)
  std::vector<int8_t> sc;        // Q6 per 16
  std::vector<uint16_t> d, dmin;  // Q6 (d) and Q4K per 256
};

// The tile format a GGUF type is packed into.
inline TileFormat format_of_type(int64_t type) {
  return type == kTypeQ6_K    ? TileFormat::kQ6
         : type == kTypeQ4_K  ? TileFormat::kQ4K
         : type == kTypeMXFP4 ? TileFormat::kMX4
                              : TileFormat::kQ4;
}

// Q4_K / Q5_K's 6-bit scale and min of sub-block j from the 12 packed bytes.
inline void scale_min_k4(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Group g of a row (32 values s * q5 + o with q5 < 32) to 4 bits: the span of its codes mapped onto 0..15.
inline void round_q5_group(uint8_t* q, float s, float o, RowCodes& out, int64_t g) {
  int lo = 31, hi = 0;
  for (int i = 0; i < 32; ++i) {
    lo = std::min<int>(lo, q[i]);
    hi = std::max<int>(hi, q[i]);
  }
  const float step = hi - lo <= 15 ? 1.0f : static_cast<float>(hi - lo) / 15.0f;
  for (int i = 0; i < 32; ++i) q[i] = static_cast<uint8_t>(std::lround((q[i] - lo) / step));
  out.s[g] = half_bits(s * step);
  out.o[g] = half_bits(o + s * static_cast<float>(lo));
}

// Decodes one GGUF row of k values of `type` into codes (q, s, o for Q4; q, sc, d for Q6).
void decode_row(const uint8_t* row, int64_t type, int64_t k, RowCodes& out) {
  uint8_t* q = out.q.data();
  if (type == kTypeQ4_0 || type == kTypeQ4_1) {
    const int64_t bytes = type == kTypeQ4_0 ? 18 : 20;
    for (int64_t b = 0; b < k / 32; ++b) {
      const uint8_t* blk = row + b * bytes;
      const float d = half_at(blk);
      const uint8_t* qs = blk + (type == kTypeQ4_0 ? 2 : 4);
      for (int j = 0; j < 16; ++j) {
        q[b * 32 + j] = qs[j] & 0xF;
        q[b * 32 + j + 16] = qs[j] >> 4;
      }
      out.s[b] = half_bits(d);
      out.o[b] = type == kTypeQ4_0 ? half_bits(-8.0f * d) : half_bits(half_at(blk + 2));
    }
    return;
  }
  if (type == kTypeMXFP4) {  // blocks of 17 bytes: e, then 16 bytes of elements j (low) and j + 16 (high)
    for (int64_t b = 0; b < k / 32; ++b) {
      const uint8_t* blk = row + b * 17;
      out.sc4[b] = blk[0];
      for (int j = 0; j < 16; ++j) {
        q[b * 32 + j] = blk[1 + j] & 0xF;
        q[b * 32 + j + 16] = blk[1 + j] >> 4;
      }
    }
    return;
  }
  if (type == kTypeQ4_K || type == kTypeQ5_K) {
    const int64_t bytes = type == kTypeQ4_K ? 144 : 176;
    for (int64_t b = 0; b < k / 256; ++b) {
      const uint8_t* blk = row + b * bytes;
      const float d = half_at(blk), dmin = half_at(blk + 2);
      if (type == kTypeQ4_K) {
        std::memcpy(&out.d[b], blk, 2);
        std::memcpy(&out.dmin[b], blk + 2, 2);
      }
      const uint8_t* scales = blk + 4;
      const uint8_t* qh = blk + 16;  // Q5_K only
      const uint8_t* qs = blk + (type == kTypeQ4_K ? 16 : 48);
      for (int c = 0; c < 4; ++c) {
        for (int half = 0; half < 2; ++half) {
          const int j = 2 * c + half;
          int sc, m;
          scale_min_k4(j, scales, &sc, &m);
          uint8_t* dst = q + b * 256 + j * 32;
          for (int l = 0; l < 32; ++l) {
            int v = half ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 0xF;
            if (type == kTypeQ5_K) v += ((qh[l] >> j) & 1) << 4;
            dst[l] = static_cast<uint8_t>(v);
          }
          const int64_t g = b * 8 + j;
          if (type == kTypeQ4_K) {
            out.sc4[g] = static_cast<uint8_t>(sc);
            out.m4[g] = static_cast<uint8_t>(m);
          } else {
            round_q5_group(dst, d * static_cast<float>(sc), -dmin * static_cast<float>(m), out, g);
          }
        }
      }
    }
    return;
  }
  TORCH_CHECK(type == kTypeQ6_K, "quant_pack_gguf: ggml type ", type, " is not one of Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, MXFP4");
  for (int64_t b = 0; b < k / 256; ++b) {
    const uint8_t* blk = row + b * 210;
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    out.d[b] = half_bits(half_at(blk + 208));
    for (int j = 0; j < 16; ++j) out.sc[b * 16 + j] = sc[j];
    uint8_t* y = q + b * 256;
    for (int n = 0; n < 2; ++n) {  // halves of 128: ql 64 bytes, qh 32 bytes each
      for (int l = 0; l < 32; ++l) {
        y[l] = (ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4);
        y[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
        y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
        y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
      }
      y += 128;
      ql += 64;
      qh += 32;
    }
  }
}

// Row r of a tile (of format Q4, Q4K or Q6) from its codes: the data bytes of the row, and its
// scales and extras into the tile's (scales, extra).
void place_row(const RowCodes& codes, TileFormat format, int64_t k, int64_t r, uint8_t* tile, void* tile_scales,
               uint16_t* tile_extra) {
  const int64_t groups = k / kGroup;
  const bool q6 = format == TileFormat::kQ6;
  const uint8_t* q = codes.q.data();
  for (int64_t g = 0; g < groups; ++g) {
    uint8_t* wg = tile + g * (q6 ? 384 : 256);
    const uint8_t* qg = q + g * kGroup;
    for (int p = 0; p < 4; ++p)
      for (int b = 0; b < 4; ++b)
        wg[p * 64 + r * 4 + b] = (qg[8 * p + b] & 0xF) | ((qg[8 * p + 4 + b] & 0xF) << 4);
    if (q6) {
      for (int c = 0; c < 2; ++c)
        for (int b = 0; b < 4; ++b) {
          uint8_t v = 0;
          for (int i = 0; i < 4; ++i) v |= ((qg[16 * c + 4 * i + b] >> 4) & 3) << (2 * i);
          wg[(4 + c) * 64 + r * 4 + b] = v;
        }
      int8_t* sc = static_cast<int8_t*>(tile_scales);
      sc[(2 * g) * 16 + r] = codes.sc[2 * g];
      sc[(2 * g + 1) * 16 + r] = codes.sc[2 * g + 1];
    } else if (format == TileFormat::kQ4K) {
      uint8_t* sm = static_cast<uint8_t*>(tile_scales) + g * 32;
      sm[r] = codes.sc4[g];
      sm[16 + r] = codes.m4[g];
    } else if (format == TileFormat::kMX4) {
      static_cast<uint8_t*>(tile_scales)[g * 16 + r] = codes.sc4[g];
    } else {
      static_cast<uint16_t*>(tile_scales)[g * 16 + r] = codes.s[g];
      tile_extra[g * 16 + r] = codes.o[g];
    }
  }
  if (q6)
    for (int64_t b = 0; b < k / 256; ++b) tile_extra[b * 16 + r] = codes.d[b];
  if (format == TileFormat::kQ4K)
    for (int64_t b = 0; b < k / 256; ++b) {
      tile_extra[b * 32 + r] = codes.d[b];
      tile_extra[b * 32 + 16 + r] = codes.dmin[b];
    }
}

struct PackedPart {
  at::Tensor data, scales, extra;
};

PackedPart allocate(int64_t n, int64_t k, TileFormat format) {
  const int64_t tiles = (n + 15) / 16, groups = k / kGroup;
  auto bytes = at::TensorOptions().dtype(at::kByte);
  PackedPart p;
  p.data = at::zeros({tiles, groups, format == TileFormat::kQ6 ? 6 : 4, 64}, bytes);
  if (format == TileFormat::kQ6) {
    p.scales = at::zeros({tiles, 2 * groups, 16}, bytes.dtype(at::kChar));
    p.extra = at::zeros({tiles, k / 256, 16}, bytes.dtype(at::kHalf));
  } else if (format == TileFormat::kQ4K) {
    p.scales = at::zeros({tiles, groups, 32}, bytes);
    p.extra = at::zeros({tiles, k / 256, 32}, bytes.dtype(at::kHalf));
  } else if (format == TileFormat::kMX4) {
    p.scales = at::zeros({tiles, groups, 16}, bytes);
    p.extra = at::empty({0}, bytes.dtype(at::kHalf));
  } else {
    p.scales = at::zeros({tiles, groups, 16}, bytes.dtype(at::kHalf));
    p.extra = at::zeros({tiles, groups, 16}, bytes.dtype(at::kHalf));
  }
  return p;
}

// Fills p's tiles, a task per tile, with decode(row, codes) giving each row's codes.
template <typename Decode>
void fill(PackedPart& p, int64_t n, int64_t k, TileFormat format, const Decode& decode) {
  const int64_t groups = k / kGroup;
  uint8_t* data = p.data.mutable_data_ptr<uint8_t>();
  uint8_t* scales = static_cast<uint8_t*>(p.scales.mutable_data_ptr());
  uint16_t* extra = reinterpret_cast<uint16_t*>(p.extra.mutable_data_ptr<at::Half>());
  at::parallel_for(0, p.data.size(0), 1, [&](int64_t t0, int64_t t1) {
    RowCodes codes;
    codes.q.resize(k);
    codes.s.resize(groups);
    codes.o.resize(groups);
    codes.sc4.resize(groups);
    codes.m4.resize(groups);
    codes.sc.resize(2 * groups);
    codes.d.resize(k / 256 + 1);
    codes.dmin.resize(k / 256 + 1);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t r = 0; r < 16 && t * 16 + r < n; ++r) {
        decode(t * 16 + r, codes);
        place_row(codes, format, k, r, data + t * groups * group_bytes(format),
                  scales + t * scale_bytes_per_tile(format, k), extra + t * extra_per_tile(format, k));
      }
    }
  });
}


// Row r of a part (counted from the part's first row), dequantized into dst (k values).
inline void dequantize_row(const TilePart& part, int64_t r, int64_t k, float* dst) {
  const int64_t groups = k / kGroup, t = r / 16, rr = r % 16;
  if (part.format == TileFormat::kInt8) {
    const uint8_t* tile = part.data + t * 16 * k;
    const uint16_t* s = static_cast<const uint16_t*>(part.scales) + t * groups * 16;
#if defined(__AVX512VNNI__)
    const int bias = 128;
#else
    const int bias = 0;
#endif
    for (int64_t c = 0; c < k; ++c) {
      const uint8_t byte = tile[(c / 4) * 64 + rr * 4 + c % 4];
      const int v = bias ? static_cast<int>(byte) - bias : static_cast<int>(static_cast<int8_t>(byte));
      dst[c] = static_cast<float>(v) * static_cast<float>(c10::Half(s[(c / kGroup) * 16 + rr], c10::Half::from_bits()));
    }
    return;
  }
  const bool q6 = part.format == TileFormat::kQ6;
  const uint8_t* tile = part.data + t * part.tile_bytes(k);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = tile + g * (q6 ? 384 : 256);
    for (int c = 0; c < 32; ++c) {
      const int line = c / 4, b = c % 4;
      int v = (wg[(line / 2) * 64 + rr * 4 + b] >> (4 * (line % 2))) & 0xF;
      if (q6) v |= ((wg[(4 + line / 4) * 64 + rr * 4 + b] >> (2 * (line % 4))) & 3) << 4;
      float value;
      if (q6) {
        const int8_t sc = static_cast<const int8_t*>(part.scales)[t * 2 * groups * 16 + (2 * g + c / 16) * 16 + rr];
        const uint16_t d = static_cast<const uint16_t*>(part.extra)[t * (k / 256) * 16 + (g / 8) * 16 + rr];
        value = static_cast<float>(c10::Half(d, c10::Half::from_bits())) * static_cast<float>(sc) *
                static_cast<float>(v - 32);
      } else if (part.format == TileFormat::kMX4) {
        const uint8_t e = static_cast<const uint8_t*>(part.scales)[t * groups * 16 + g * 16 + rr];
        value = static_cast<float>(kMxfp4Values[v]) * e8m0_half(e);
      } else if (part.format == TileFormat::kQ4K) {
        const uint8_t* sm = static_cast<const uint8_t*>(part.scales) + t * groups * 32 + g * 32;
        const uint16_t* dd = static_cast<const uint16_t*>(part.extra) + t * (k / 256) * 32 + (g / 8) * 32;
        value = static_cast<float>(c10::Half(dd[rr], c10::Half::from_bits())) * static_cast<float>(sm[rr]) *
                    static_cast<float>(v) -
                static_cast<float>(c10::Half(dd[16 + rr], c10::Half::from_bits())) * static_cast<float>(sm[16 + rr]);
      } else {
        const uint16_t s = static_cast<const uint16_t*>(part.scales)[t * groups * 16 + g * 16 + rr];
        const uint16_t o = static_cast<const uint16_t*>(part.extra)[t * groups * 16 + g * 16 + rr];
        value = static_cast<float>(c10::Half(s, c10::Half::from_bits())) * static_cast<float>(v) +
                static_cast<float>(c10::Half(o, c10::Half::from_bits()));
      }
      dst[g * kGroup + c] = value;
    }
  }
}

// Row `row` of the matrix of `parts`, dequantized into dst (k values).
inline void matrix_row(const std::vector<TilePart>& parts, int64_t row, int64_t k, float* dst) {
  for (const TilePart& part : parts)
    if (row < (part.tile0 + part.tiles) * 16) return dequantize_row(part, row - part.tile0 * 16, k, dst);
}


}  // namespace
