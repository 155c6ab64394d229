// DecodeModel's weights and the row-wide steps of its layers (decode_layers.cpp): a weight as
// int8 tiles or low-bit parts and its tiles' matmul, the thread shares, RMSNorm, the residual add,
// the activations' int8 groups, the argmax; and how much a thread prefetches during attention.
#pragma once
#include "decode_attention.h"
#include "quant_codes.h"

#include <unistd.h>

#include <optional>

namespace {

// A weight: int8 tiles (int8_tiles.h, scales per row or per group: ``Int8Tiles``), or a list of
// parts in quant_tiles.h's formats (``QuantTiles``: a GGUF's low-bit and Q8_0 blocks).
struct Matrix {
  std::vector<TilePart> parts;  // empty: the int8 tiles below
  const uint8_t* tiles = nullptr;
  const void* scales = nullptr;
  bool per_group = false;
  const float* bias = nullptr;  // or nullptr
  int64_t n = 0, k = 0;

  // Where tile t's bytes start, and how many of tiles [t, t1) lie in a row from there (one part).
  const uint8_t* tile(int64_t t) const {
    if (parts.empty()) return tiles + t * 16 * k;
    const TilePart& p = part_of(t);
    return p.data + (t - p.tile0) * p.tile_bytes(k);
  }
  int64_t bytes(int64_t t, int64_t t1) const {
    if (t >= t1) return 0;
    if (parts.empty()) return (t1 - t) * 16 * k;
    const TilePart& p = part_of(t);
    return (std::min(t1, p.tile0 + p.tiles) - t) * p.tile_bytes(k);
  }
  const TilePart& part_of(int64_t t) const {
    for (const TilePart& p : parts)
      if (t < p.tile0 + p.tiles) return p;
    return parts.back();
  }
};

// A weight from its tensors: [tiles, scales] (int8 tiles) or [data, scales, extra] per part.
Matrix matrix(const std::vector<at::Tensor>& tensors, const std::optional<at::Tensor>& bias, int64_t n,
              const char* name) {
  Matrix w;
  w.n = n;
  if (tensors.size() == 2) {
    const at::Tensor &tiles = tensors[0], &scales = tensors[1];
    w.per_group = check_tiles(tiles, scales, n, "DecodeModel");
    TORCH_CHECK(tiles.is_contiguous() && scales.is_contiguous(), "DecodeModel: ", name,
                " tiles and scales must be contiguous");
    w.tiles = tiles.const_data_ptr<uint8_t>();
    w.scales = scales.const_data_ptr();
    w.k = tiles.size(1) * 4;
  } else {
    TORCH_CHECK(!tensors.empty() && tensors.size() % 3 == 0, "DecodeModel: ", name,
                " takes [tiles, scales] or [data, scales, extra] per part");
    const at::Tensor& data = tensors[0];
    w.k = data.size(2) == 16 ? data.size(1) * 4 : data.size(1) * kGroup;
    w.parts = parts_of(tensors, n, w.k, "DecodeModel");
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "DecodeModel: ", name, " bias must be float32 [", n, "]");
    w.bias = bias->const_data_ptr<float>();
  }
  return w;
}

// Tiles [t0, t1) of w times q's rows: their columns of out [rows, w.n], plus the bias.
void matmul_tiles(const Matrix& w, const GroupedActivations& q, int64_t rows, float* out, int64_t t0, int64_t t1) {
  if (t0 >= t1) return;
  if (!w.parts.empty()) {
    parts_span(w.parts, q, rows, w.n, w.k, out, t0, t1);
  } else if (w.per_group) {
    tile_span<true>(q, w.tiles, static_cast<const uint16_t*>(w.scales), rows, w.n, w.n, w.k, out, t0, t1);
  } else {
    tile_span<false>(q, w.tiles, static_cast<const float*>(w.scales), rows, w.n, w.n, w.k, out, t0, t1);
  }
  if (w.bias == nullptr) return;
  const int64_t c0 = t0 * 16, c1 = std::min(t1 * 16, w.n);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = c0; c < c1; ++c) out[r * w.n + c] += w.bias[c];
}

// Weight lines prefetched per K/V row an attention task reads, and at most how many bytes a
// thread prefetches during one layer's attention: 384 KB, or half of L2 where it is smaller.
constexpr int64_t kAheadLinesPerRow = 8;

int64_t ahead_budget() {
  static const int64_t budget = [] {
    int64_t bytes = 384 << 10;
#ifdef _SC_LEVEL2_CACHE_SIZE
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (l2 > 0) bytes = std::min<int64_t>(bytes, l2 / 2);
#endif
    return bytes;
  }();
  return budget;
}

// Thread tid's even share [lo, hi) of n items.
inline std::pair<int64_t, int64_t> share(int64_t n, int tid, int threads) {
  return {n * tid / threads, n * (tid + 1) / threads};
}

// dst = weight * (src * rsqrt(mean(src^2) + eps)) over n values, as models/fused.py's rms_norm.
void rms_norm(const float* src, const float* weight, float eps, int64_t n, float* dst) {
  const float ss = at::vec::map_reduce_all<float>([](Vec x) { return x * x; },
                                                  [](Vec a, Vec b) { return a + b; }, src, n);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  at::vec::map2([&](Vec x, Vec w) { return w * (x * Vec(r)); }, dst, src, weight, n);
}

// res += out * scale over n values (scale 1: a plain add, as a layer without a residual multiplier).
inline void add_scaled(float* res, const float* out, float scale, int64_t n) {
  if (scale == 1.0f) {
    for (int64_t j = 0; j < n; ++j) res[j] += out[j];
  } else {
    for (int64_t j = 0; j < n; ++j) res[j] += out[j] * scale;
  }
}

// Every row's norm of res [rows, n], quantized into q (sized for it) for the next matmul; h: scratch.
void norm_rows(const float* res, const float* weight, float eps, int64_t rows, int64_t n, float* h,
               GroupedActivations& q) {
  for (int64_t r = 0; r < rows; ++r) rms_norm(res + r * n, weight, eps, n, h + r * n);
  quantize_span(h, 0, rows * (n / kGroup), q);
}

// The first index of x's largest value (a NaN counts as larger than any number) into best/index
// where it beats them; n values from column `first`.
void argmax_span(const float* x, int64_t n, int64_t first, float& best, int64_t& index) {
  constexpr int64_t kChunk = 256;
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t len = std::min(kChunk, n - c);
    const float top = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x + c, len);
    const bool nan = std::isnan(top);
    if (index >= 0 && !(top > best) && !(nan && !std::isnan(best))) continue;
    for (int64_t i = c; i < c + len; ++i) {
      if (x[i] == top || (nan && std::isnan(x[i]))) {
        best = x[i];
        index = first + i;
        break;
      }
    }
  }
}

}  // namespace
