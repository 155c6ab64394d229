// hyprefix::bf16_linear: x [..., K] (bfloat16) times a bfloat16 weight [N, K] held in 16-row
// tiles, out [..., N] in bfloat16: the matmuls of a compiled bf16 decode step, where a batch-1
// step streams every weight once and its time is the time to read them.
//
// Layout: tiles [ceil(N/16), K/2, 16, 2]: tile t holds rows 16t..16t+15, one 64-byte line per
// pair of columns (each row's two values side by side), rows past N zero. A tile is one
// contiguous stream: each line feeds one VDPBF16PS against the broadcast pair of x, which adds
// both products into the 16 rows' float32 sums; no horizontal sums. Each thread takes a run of
// whole tiles (and then the others' last ones) and prefetches kAhead bytes ahead of its reads.
// Why not the plain [N, K] rows: a 4-row GEMV over them reads 4 short streams at once (2 KB
// rows), and each new block restarts the hardware prefetcher; one stream a tile reads faster.
//
// Arithmetic: float32 sums of exact bf16 products (VDPBF16PS rounds each pair's sum to float32,
// denormal inputs read as zero), split over 4 interleaved accumulators per row and added at
// the end, plus the bias (if any), then rounded to bfloat16 once: oneDNN's bf16 matmul does the
// same up to the order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kTile = 16;
constexpr int64_t kRowBlock = 8;  // rows of x per pass over a tile
// Pairs of columns in flight per row (VDPBF16PS latency over its throughput). The same for every
// row count: a row's sums then run in one order whatever the other rows (the batch-invariant mode).
constexpr int kUnroll = 2;
constexpr int64_t kAhead = 2048;  // prefetch distance in bytes (docs/perf-log.md)

// Rows m0..m0+MB-1 of x (as int32 pairs, `pairs` per row) times one tile: 16 sums per row.
template <int MB>
inline void tile_rows(const char* tile, const int32_t* x, int64_t pairs, int64_t m0, float (*out)[kTile]) {
  __m512 acc[MB][kUnroll];
  for (int i = 0; i < MB; ++i)
    for (int u = 0; u < kUnroll; ++u) acc[i][u] = _mm512_setzero_ps();
  const int32_t* rows[MB];
  for (int i = 0; i < MB; ++i) rows[i] = x + (m0 + i) * pairs;
  int64_t p = 0;
  for (; p + kUnroll <= pairs; p += kUnroll) {
    const char* line = tile + p * 64;
    for (int u = 0; u < kUnroll; ++u) _mm_prefetch(line + kAhead + u * 64, _MM_HINT_T0);
    for (int u = 0; u < kUnroll; ++u) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512(line + u * 64);
      for (int i = 0; i < MB; ++i)
        acc[i][u] = _mm512_dpbf16_ps(acc[i][u], w, (__m512bh)_mm512_set1_epi32(rows[i][p + u]));
    }
  }
  for (; p < pairs; ++p) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512(tile + p * 64);
    for (int i = 0; i < MB; ++i) acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w, (__m512bh)_mm512_set1_epi32(rows[i][p]));
  }
  for (int i = 0; i < MB; ++i) {
    __m512 sum = acc[i][0];
    for (int u = 1; u < kUnroll; ++u) sum = _mm512_add_ps(sum, acc[i][u]);
    _mm512_storeu_ps(out[i], sum);
  }
}

// A thread's run of tiles [front, back): its owner takes from the front, a thread done with its
// own takes from the back. One 64-bit word, so a take is one compare-and-swap.
struct alignas(64) Range {
  std::atomic<uint64_t> word{0};
  void set(int64_t front, int64_t back) { word.store(static_cast<uint64_t>(front) << 32 | static_cast<uint64_t>(back)); }
  int64_t take_front() {
    uint64_t w = word.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(w >> 32), back = static_cast<int64_t>(w & 0xffffffffu);
      if (front >= back) return -1;
      if (word.compare_exchange_weak(w, static_cast<uint64_t>(front + 1) << 32 | static_cast<uint64_t>(back))) return front;
    }
  }
  int64_t take_back() {
    uint64_t w = word.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(w >> 32), back = static_cast<int64_t>(w & 0xffffffffu);
      if (front >= back) return -1;
      if (word.compare_exchange_weak(w, static_cast<uint64_t>(front) << 32 | static_cast<uint64_t>(back - 1))) return back - 1;
    }
  }
};

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && tiles.device().is_cpu(), "bf16_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && tiles.scalar_type() == at::kBFloat16,
              "bf16_linear: x and tiles must be bfloat16");
  TORCH_CHECK(tiles.dim() == 4 && tiles.size(2) == kTile && tiles.size(3) == 2 && tiles.is_contiguous(),
              "bf16_linear: tiles must be contiguous bfloat16 [N/16, K/2, 16, 2]");
  const int64_t k = tiles.size(1) * 2, num_tiles = tiles.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "bf16_linear: x has ", x.size(-1), " columns, the weight ", k);
  TORCH_CHECK(n > (num_tiles - 1) * kTile && n <= num_tiles * kTile, "bf16_linear: ", n, " rows in ", num_tiles,
              " tiles");
  TORCH_CHECK(k > 0, "bf16_linear: empty rows");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->numel() == n),
              "bf16_linear: bias must be bfloat16 [", n, "]");
  at::Tensor xc = x.contiguous();
  if (reinterpret_cast<uintptr_t>(xc.const_data_ptr()) % 4 != 0) xc = xc.clone();  // read as pairs (int32)
  std::vector<float> bias_f;  // added before the one rounding to bf16
  if (bias.has_value()) {
    const at::Tensor b = bias->contiguous();
    bias_f.resize(kTile * num_tiles, 0.0f);
    for (int64_t c = 0; c < n; ++c) bias_f[c] = static_cast<float>(b.const_data_ptr<c10::BFloat16>()[c]);
  }
  const int64_t rows = xc.numel() / k, pairs = k / 2;
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  if (rows == 0) return out;
  const int32_t* xv = reinterpret_cast<const int32_t*>(xc.const_data_ptr<c10::BFloat16>());
  const char* packed = reinterpret_cast<const char*>(tiles.const_data_ptr<c10::BFloat16>());
  c10::BFloat16* o = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t tile_bytes = kTile * k * 2;
  auto run = [&](int64_t t0, int64_t t1) {
    alignas(64) float res[kRowBlock][kTile];
    for (int64_t t = t0; t < t1; ++t) {
      const char* tile = packed + t * tile_bytes;
      const int64_t count = std::min<int64_t>(kTile, n - t * kTile);
      for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
        const int64_t mb = std::min<int64_t>(kRowBlock, rows - m0);
        switch (mb) {
          case 8: tile_rows<8>(tile, xv, pairs, m0, res); break;
          case 7: tile_rows<7>(tile, xv, pairs, m0, res); break;
          case 6: tile_rows<6>(tile, xv, pairs, m0, res); break;
          case 5: tile_rows<5>(tile, xv, pairs, m0, res); break;
          case 4: tile_rows<4>(tile, xv, pairs, m0, res); break;
          case 3: tile_rows<3>(tile, xv, pairs, m0, res); break;
          case 2: tile_rows<2>(tile, xv, pairs, m0, res); break;
          default: tile_rows<1>(tile, xv, pairs, m0, res); break;
        }
        if (!bias_f.empty())
          for (int64_t i = 0; i < mb; ++i)
            for (int64_t c = 0; c < kTile; ++c) res[i][c] += bias_f[t * kTile + c];
        for (int64_t i = 0; i < mb; ++i)
          for (int64_t c = 0; c < count; ++c) o[(m0 + i) * n + t * kTile + c] = c10::BFloat16(res[i][c]);
      }
    }
  };
  // Each thread starts on an even run of tiles and, done with it, takes the others' last tiles,
  // so no thread waits at the end of these loops for a slower one. (Chunks from one shared
  // counter instead were slower than static runs.)
  const int threads = std::max<int>(1, std::min<int64_t>(at::get_num_threads(), num_tiles));
  std::vector<Range> ranges(threads);
  for (int t = 0; t < threads; ++t) ranges[t].set(num_tiles * t / threads, num_tiles * (t + 1) / threads);
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t me = b; me < e; ++me) {
      for (int64_t t; (t = ranges[me].take_front()) >= 0;) run(t, t + 1);
      for (int64_t other = 1; other < threads; ++other) {
        Range& victim = ranges[(me + other) % threads];
        for (int64_t t; (t = victim.take_back()) >= 0;) run(t, t + 1);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hyprefix, m) { m.def("bf16_linear(Tensor x, Tensor tiles, int n, Tensor? bias=None) -> Tensor"); }

TORCH_LIBRARY_IMPL(hyprefix, CPU, m) { m.impl("bf16_linear", &bf16_linear); }
