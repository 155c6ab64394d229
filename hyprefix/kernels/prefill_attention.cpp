// hyprefix::prefill_attention: causal (optionally sliding-window) softmax attention of a
// prefill chunk, q [T, H, D] over k, v [S, KVH, D], out [T, H, D] in q's dtype.
//
// Query t sits at position q_pos0 + t and key j at k_pos0 + j; key j is visible to query t
// when its position is <= the query's and, with window > 0, > the query's minus window.
//
// With a block table, k and v are paged caches [blocks, block_size, KVH, D] and key j is row
// j % block_size of block table[j / block_size]: the keys are read where they lie, with no
// gather into a contiguous copy first.
//
// k and v hold q's dtype, or both 8-bit packed rows (--kv-cache-dtype int8 / fp8_e4m3, the
// format of hyprefix/models/kv_quant.py and kv8_rows.h): int8 or float8_e4m3fn with a last dim of
// D + 2, each (key, KV head) row D codes and its float16 scale. Such rows are dequantized where
// K and V are packed (pack_head: a key block's rows into a scratch of q's dtype, code * scale
// exact in float32, then rounded to q's dtype as kv_quant.dequantize_rows rounds), so the packed
// operands and the result are bit for bit the kernel's over kv_quant.dequantize_rows(cache,
// q.dtype), with no gathered or dequantized copy of the cache.
//
// Flash attention on oneDNN's batch-reduce GEMM micro-kernel (ATen's cpublas::brgemm:
// bfloat16 x bfloat16 -> float32 on AVX512-BF16 or AMX, float32 on AVX2 / AVX-512):
// - K^T and V of each KV head are packed once per call, in blocks of 128 keys (bfloat16: VNNI
//   pairs along the reduction; float32: plain rows).
// - A task is one KV head and one block of query tokens; the group's query heads are stacked
//   into the GEMM's rows (GQA), so every packed K/V block is used by all of them at once.
// - Key blocks run from the block's first visible key to its last; masked entries (the
//   diagonal block, and a window's first block) get probability 0. The running max / sum
//   (float32) rescale the float32 output accumulator, which P x V adds into.
// - Tasks are taken heaviest first from a shared counter by ATen's intra-op threads.
// - sinks [H] (gpt-oss): each query head's logit joins its softmax's denominator at the end,
//   exp(sink - running max), once per query row over all of its keys.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "kv8_rows.h"

namespace {

using Vec = at::vec::Vectorized<float>;
using at::native::cpublas::brgemm;

// Keys per block and GEMM rows per task: the best of {128, 256}^2, natively and under AVX2
// limits (docs/perf-log.md).
constexpr int64_t kKeyBlock = 128;
constexpr int64_t kRows = 128;

struct Shape {
  int64_t tokens, heads, dim, keys, kv_heads, group;
  int64_t q_t, q_h, k_t, k_h, v_t, v_h;  // strides (elements); the last dim is contiguous
  int64_t q_pos0, k_pos0, window;
  float scale;
  const int64_t* table = nullptr;  // paged keys: the block of every block_size keys
  int64_t block_size = 0, k_b = 0, v_b = 0;  // and the caches' block strides
  const float* sinks = nullptr;  // a logit per query head in each softmax's denominator (gpt-oss)

  // Offsets (elements) of key j's row in k and in v, before the head's.
  int64_t k_row(int64_t j) const { return table ? table[j / block_size] * k_b + j % block_size * k_t : j * k_t; }
  int64_t v_row(int64_t j) const { return table ? table[j / block_size] * v_b + j % block_size * v_t : j * v_t; }
  // Keys from j on that lie in consecutive rows (to the end of j's block), at most n.
  int64_t run(int64_t j, int64_t n) const { return table ? std::min(n, block_size - j % block_size) : n; }
};

// Visible key columns [lo, hi) of the query at token index t.
inline void visible(const Shape& s, int64_t t, int64_t& lo, int64_t& hi) {
  const int64_t qp = s.q_pos0 + t;
  hi = std::min(s.keys, qp - s.k_pos0 + 1);
  lo = s.window > 0 ? std::max<int64_t>(0, qp - s.window + 1 - s.k_pos0) : 0;
}

// Leading dims get 16 spare elements, so rows are not 4 KiB apart (L1 set aliasing).
constexpr int64_t kPad = 16;
constexpr int64_t kKeyLd = kKeyBlock + kPad;  // rows of packed K^T, of the scores and of P

// Rows of packed V, of the gathered Q and of the output accumulator.
constexpr int64_t head_ld(int64_t dim) { return dim + kPad; }

// Per KV head, key block by key block (zero padded), the layouts brgemm's B operand takes:
// bfloat16 K^T [D/2, kKeyLd, 2] and V [kKeyBlock/2, head_ld(D), 2] (VNNI pairs along the
// reduction); float32 K^T [D, kKeyLd] and V [kKeyBlock, head_ld(D)].
template <typename T>
struct Packed {
  std::vector<T> k, v;
};

// Rows a and b of V as VNNI pairs: dst[2i] = a[i], dst[2i + 1] = b[i], i < d.
inline void interleave_rows(const c10::BFloat16* a, const c10::BFloat16* b, c10::BFloat16* dst, int64_t d) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  for (; i + 32 <= d; i += 32) {
    const __m512i x = _mm512_loadu_si512(a + i), y = _mm512_loadu_si512(b + i);
    const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);  // per 128-bit lane
    _mm512_storeu_si512(dst + 2 * i, _mm512_permutex2var_epi64(lo, first, hi));
    _mm512_storeu_si512(dst + 2 * i + 32, _mm512_permutex2var_epi64(lo, second, hi));
  }
#endif
  for (; i < d; ++i) {
    dst[2 * i] = a[i];
    dst[2 * i + 1] = b[i];
  }
}

// n rows of d values of T (row stride ld elements) as columns [c, c + n) of one key block's
// K^T (dst): a transpose of 32-bit units (a bfloat16 VNNI pair is one), key rows to columns.
template <typename T>
void transpose_rows(const T* src, int64_t ld, T* dst, int64_t c, int64_t n, int64_t d) {
  constexpr int64_t pair = std::is_same_v<T, c10::BFloat16> ? 2 : 1;
  static_assert(sizeof(T) * pair == sizeof(float));
  at::vec::transpose_mxn<float>(reinterpret_cast<const float*>(src), ld / pair, reinterpret_cast<float*>(dst) + c,
                                kKeyLd, n, d / pair);
}

// Keys [j0, j0 + n) of one head's packed 8-bit cache (kv8_rows.h; `row(j)`: key j's row offset)
// into dst [n, d] of T, each row dequantized and rounded to T as kv_quant.dequantize_rows(., T)
// rounds it (exact in float32): the values the gathered-and-dequantized cache would hold.
template <typename T, typename C, typename Row>
void dequantize_keys(const C* cache, Row row, int64_t j0, int64_t n, int64_t d, T* dst) {
  for (int64_t i = 0; i < n; ++i) kv8::to_type(cache + row(j0 + i), dst + i * d, d);
}

// One head's K and V (caches of C: q's T, or packed 8-bit rows) into p, key block by key block.
// A packed cache's block of rows is dequantized into a [kKeyBlock, D] scratch of T first, then
// packed from there as rows of T are, so the panels, and every result after them, are those of
// the same kernel over kv_quant.dequantize_rows(cache, T).
template <typename T, typename C>
void pack_head(const Shape& s, const C* k, const C* v, Packed<T>& p) {
  constexpr int64_t pair = std::is_same_v<T, c10::BFloat16> ? 2 : 1;
  constexpr bool kDequantize = kPacked<C>;
  const int64_t d = s.dim, ldv = head_ld(d), blocks = (s.keys + kKeyBlock - 1) / kKeyBlock;
  p.k.assign(blocks * d * kKeyLd, T(0.0f));
  p.v.assign(blocks * kKeyBlock * ldv, T(0.0f));
  std::vector<T> rows(kDequantize ? kKeyBlock * d : 0);
  const auto k_row = [&](int64_t j) { return s.k_row(j); };
  const auto v_row = [&](int64_t j) { return s.v_row(j); };
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t j0 = b * kKeyBlock, n = std::min(kKeyBlock, s.keys - j0);
    T* kt = p.k.data() + b * d * kKeyLd;
    if constexpr (kDequantize) {
      dequantize_keys(k, k_row, j0, n, d, rows.data());
      transpose_rows(rows.data(), d, kt, 0, n, d);
      dequantize_keys(v, v_row, j0, n, d, rows.data());
    } else {
      for (int64_t j = j0; j < j0 + n;) {  // runs of consecutive rows in the cache
        const int64_t m = s.run(j, j0 + n - j);
        transpose_rows(k + s.k_row(j), s.k_t, kt, j - j0, m, d);
        j += m;
      }
    }
    // Key j's V row of T: in the scratch, or where it lies.
    const auto v_of = [&](int64_t j) -> const T* {
      if constexpr (kDequantize) return rows.data() + (j - j0) * d;
      else return v + s.v_row(j);
    };
    for (int64_t j = j0; j < j0 + n; j += pair) {  // kKeyBlock is even: no pair spans two blocks
      T* vb = p.v.data() + b * kKeyBlock * ldv + (j - j0) * ldv;
      if constexpr (pair == 2) {
        if (j + 1 < j0 + n) {
          interleave_rows(v_of(j), v_of(j + 1), vb, d);
        } else {  // an odd last key: its pair partner stays 0
          for (int64_t i = 0; i < d; ++i) vb[2 * i] = v_of(j)[i];
        }
      } else {
        std::copy_n(v_of(j), d, vb);
      }
    }
  }
}

// p[lo, hi) = exp(scale * s - max) in T; returns their sum (of the float32 values).
template <typename T>
float exp_row(const float* srow, T* prow, int64_t lo, int64_t hi, float scale, float max) {
  constexpr int64_t w = Vec::size();
  const Vec by(scale), shift(max);
  Vec acc(0.0f);
  for (int64_t i = lo; i < hi; i += 2 * w) {
    const int64_t n = std::min(2 * w, hi - i);
    Vec x = (Vec::loadu(srow + i, std::min(w, n)) * by - shift).exp_u20();
    Vec y = n > w ? (Vec::loadu(srow + i + w, n - w) * by - shift).exp_u20() : Vec(0.0f);
    if (n < 2 * w) {  // lanes past hi loaded as 0: their exp is not
      x = Vec::set(Vec(0.0f), x, std::min(w, n));
      y = Vec::set(Vec(0.0f), y, std::max<int64_t>(0, n - w));
    }
    acc = acc + x + y;
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      at::vec::convert_from_float<c10::BFloat16>(x, y).store(prow + i, n);
    } else {
      x.store(prow + i, std::min(w, n));
      if (n > w) y.store(prow + i + w, n - w);
    }
  }
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
}

// A task's g * qn output rows (KV head h, query tokens from t0; the accumulator obuf, rows of
// head_ld(D)) divided by their softmax denominators, a sink's term included, into out in T.
template <typename T>
void store_rows(const Shape& s, int64_t h, int64_t t0, int64_t qn, float* obuf, const float* run_max,
                const float* run_sum, T* out) {
  const int64_t d = s.dim, g = s.group, ld = head_ld(d);
  for (int64_t m = 0; m < g * qn; ++m) {
    const int64_t gi = m / qn, r = m % qn;
    T* dst = out + ((t0 + r) * s.heads + h * g + gi) * d;
    const float total = run_sum[m] + (s.sinks ? std::exp(s.sinks[h * g + gi] - run_max[m]) : 0.0f);
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    const Vec by(inv);
    float* orow = obuf + m * ld;
    at::vec::map([&](Vec x) { return x * by; }, orow, orow, d);
    at::vec::convert(orow, dst, d);
  }
}

template <typename T, typename C>
void attend(const Shape& s, const T* q, const C* k, const C* v, T* out) {
  constexpr bool kVnni = std::is_same_v<T, c10::BFloat16>;
  const int64_t d = s.dim, g = s.group;
  const int64_t threads = at::get_num_threads();

  std::vector<Packed<T>> packed(s.kv_heads);
  at::parallel_for(0, s.kv_heads, 1, [&](int64_t b, int64_t e) {
    for (int64_t h = b; h < e; ++h) pack_head(s, k + h * s.k_h, v + h * s.v_h, packed[h]);
  });

  // Query blocks: about kRows GEMM rows, small enough that every thread gets several tasks.
  int64_t block = std::max<int64_t>(1, kRows / g);
  const int64_t want = 4 * threads;
  while (block > 16 && s.kv_heads * ((s.tokens + block - 1) / block) < want) block /= 2;
  const int64_t blocks = (s.tokens + block - 1) / block;
  std::vector<int64_t> order(s.kv_heads * blocks);
  for (int64_t i = 0; i < (int64_t)order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return a % blocks > b % blocks;  // later query blocks see more keys (windows aside)
  });
  std::atomic<int64_t> next{0};

  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const int64_t rows_max = g * block;
    const int64_t ld = head_ld(d);
    std::vector<T> qbuf(rows_max * ld), pbuf(rows_max * kKeyLd);
    std::vector<float> sbuf(rows_max * kKeyLd), obuf(rows_max * ld), run_max(rows_max), run_sum(rows_max);
    for (int64_t n = next.fetch_add(1); n < (int64_t)order.size(); n = next.fetch_add(1)) {
      const int64_t h = order[n] / blocks, t0 = (order[n] % blocks) * block;
      const int64_t qn = std::min(block, s.tokens - t0), rows = g * qn;
      for (int64_t gi = 0; gi < g; ++gi)
        for (int64_t r = 0; r < qn; ++r)
          std::copy_n(q + (t0 + r) * s.q_t + (h * g + gi) * s.q_h, d, qbuf.data() + (gi * qn + r) * ld);
      std::fill_n(obuf.data(), rows * ld, 0.0f);
      std::fill_n(run_max.data(), rows, -std::numeric_limits<float>::infinity());
      std::fill_n(run_sum.data(), rows, 0.0f);
      int64_t first_lo, first_hi, last_lo, last_hi;
      visible(s, t0, first_lo, first_hi);
      visible(s, t0 + qn - 1, last_lo, last_hi);
      const Packed<T>& p = packed[h];
      for (int64_t j0 = first_lo / kKeyBlock * kKeyBlock; j0 < last_hi; j0 += kKeyBlock) {
        const int64_t cols = std::min(kKeyBlock, last_hi - j0);
        const int64_t depth = kVnni ? (cols + 1) / 2 * 2 : cols;  // P x V's reduction length
        const int64_t kb = j0 / kKeyBlock;
        brgemm(rows, cols, d, ld, kKeyLd, kKeyLd, false, qbuf.data(), p.k.data() + kb * d * kKeyLd, sbuf.data());
        for (int64_t m = 0; m < rows; ++m) {
          int64_t lo, hi;
          visible(s, t0 + m % qn, lo, hi);
          lo = std::max<int64_t>(lo - j0, 0);
          hi = std::min<int64_t>(hi - j0, cols);
          T* prow = pbuf.data() + m * kKeyLd;
          if (hi <= lo) {
            std::fill_n(prow, depth, T(0.0f));
            continue;
          }
          float* srow = sbuf.data() + m * kKeyLd;
          const float top = s.scale * at::vec::reduce_all<float>(
              [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, srow + lo, hi - lo);
          const float new_max = std::max(run_max[m], top);
          const float sum = exp_row(srow, prow, lo, hi, s.scale, new_max);
          const float rescale = std::exp(run_max[m] - new_max);  // 0 for the first visible block
          if (rescale != 1.0f) {
            float* orow = obuf.data() + m * ld;
            const Vec by(rescale);
            at::vec::map([&](Vec x) { return x * by; }, orow, orow, d);
          }
          run_sum[m] = run_sum[m] * rescale + sum;
          run_max[m] = new_max;
          std::fill_n(prow, lo, T(0.0f));
          std::fill_n(prow + hi, depth - hi, T(0.0f));
        }
        brgemm(rows, d, depth, kKeyLd, ld, ld, true, pbuf.data(), p.v.data() + kb * kKeyBlock * ld, obuf.data());
      }
      store_rows(s, h, t0, qn, obuf.data(), run_max.data(), run_sum.data(), out);
    }
    at::native::cpublas::brgemm_release(kVnni);
  });
}

// Checks q, k, v; returns whether k and v hold 8-bit packed rows (last dim D + 2).
bool check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool paged) {
  const int64_t kd = paged ? 4 : 3;  // [blocks, block_size, KVH, D(+2)] or [S, KVH, D(+2)]
  TORCH_CHECK(q.dim() == 3 && k.dim() == kd && v.dim() == kd,
              "prefill_attention: q must be [tokens, heads, dim], k and v [keys, heads, dim] or, with a block table, "
              "[blocks, block_size, heads, dim]");
  const bool packed = k.scalar_type() == at::kChar || k.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (packed || q.scalar_type() == k.scalar_type()),
              "prefill_attention: q, k, v must share a dtype, or k and v hold 8-bit packed rows (int8 / "
              "float8_e4m3fn)");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "prefill_attention: float32 or bfloat16 only");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(kd - 1) == 1 && v.stride(kd - 1) == 1,
              "prefill_attention: the head dim must be contiguous");
  const int64_t extra = packed ? 2 : 0;  // a packed row: D codes, then the scale's two bytes
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(2) + extra == k.size(kd - 1) && q.size(1) % k.size(kd - 2) == 0,
              "prefill_attention: shapes do not match",
              packed ? " (packed 8-bit rows hold head dim + 2 elements)" : "");
  return packed;
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                             int64_t q_pos0, int64_t k_pos0, int64_t window,
                             const std::optional<at::Tensor>& block_table, int64_t keys,
                             const std::optional<at::Tensor>& sinks) {
  const bool paged = block_table.has_value();
  const bool packed = check_inputs(q, k, v, paged);
  const int64_t kd = paged ? 4 : 3;
  Shape s{q.size(0), q.size(1), q.size(2), paged ? keys : k.size(0), k.size(kd - 2), q.size(1) / k.size(kd - 2),
          q.stride(0), q.stride(1), k.stride(kd - 3), k.stride(kd - 2), v.stride(kd - 3), v.stride(kd - 2),
          q_pos0, k_pos0, window, static_cast<float>(scale)};
  at::Tensor table;
  if (paged) {
    table = block_table->contiguous();
    TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 1, "prefill_attention: the block table must be int64 [n]");
    TORCH_CHECK(keys >= 0 && keys <= table.size(0) * k.size(1), "prefill_attention: more keys than the table's blocks hold");
    const int64_t* ids = table.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < (keys + k.size(1) - 1) / k.size(1); ++i)
      TORCH_CHECK(ids[i] >= 0 && ids[i] < k.size(0), "prefill_attention: block id out of range");
    s.table = ids;
    s.block_size = k.size(1);
    s.k_b = k.stride(0);
    s.v_b = v.stride(0);
  }
  at::Tensor sink_values;
  if (sinks) {
    sink_values = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(sink_values.dim() == 1 && sink_values.size(0) == s.heads, "prefill_attention: sinks must be [heads]");
    s.sinks = sink_values.const_data_ptr<float>();
  }
  at::Tensor out = at::empty({s.tokens, s.heads, s.dim}, q.options());
  if (s.tokens == 0) return out;
  // bfloat16 K^T is a transpose of pairs: of the cache's rows in place (even strides), or of the
  // packed rows dequantized into a scratch of D per row.
  TORCH_CHECK(q.scalar_type() != at::kBFloat16 || (s.dim % 2 == 0 && (packed || s.k_t % 2 == 0)),
              "prefill_attention: bfloat16 needs an even head dim and K row stride");
  // T: q's type; C: the caches' element, T or a packed code (its bytes read as that type).
  auto run = [&](auto q_tag, auto cache_tag) {
    using T = decltype(q_tag);
    using C = decltype(cache_tag);
    attend(s, q.const_data_ptr<T>(), static_cast<const C*>(k.const_data_ptr()),
           static_cast<const C*>(v.const_data_ptr()), out.mutable_data_ptr<T>());
  };
  auto with_cache = [&](auto q_tag) {
    switch (k.scalar_type()) {
      case at::kChar: run(q_tag, Int8Code{}); break;
      case at::kFloat8_e4m3fn: run(q_tag, E4m3Code{}); break;
      default: run(q_tag, q_tag);
    }
  };
  if (q.scalar_type() == at::kBFloat16) with_cache(c10::BFloat16{});
  else with_cache(float{});
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hyprefix, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, int q_pos0, int k_pos0, int window, "
        "Tensor? block_table=None, int keys=-1, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(hyprefix, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
