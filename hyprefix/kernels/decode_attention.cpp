// hyprefix::decode_attention: one query token per row over its paged K/V, read in place
// through its block table (no gather, no padding, no mask tensor).
//
//   q            [B, H, D]                 float32 / bfloat16 / float16 (the caches' dtype)
//   k/v_cache    [blocks, block_size, KVH, D], contiguous
//   tables       [B, W] int64: row b's key slot j lives in block tables[b, j / block_size]
//   context_lens [B] int64
//   first_pos    [B] int64 or None (0): slot j holds position j + first_pos[b]
//   window       0, or a sliding window: slot j is visible when its position is
//                < context_lens[b] and, with a window, >= context_lens[b] - window
//   -> out [B, H, D] in q's dtype, lse [B, H] float32 (-inf where a row sees no key, with out 0)
//
// A task is one row and one run of whole blocks of its visible keys, every KV head: a block's
// K (then V) rows of all heads lie together, so the task reads each block as one contiguous
// stretch of memory (software prefetch of the next block measured slower). Per KV head, the
// group's query heads (GQA) share each K/V row load: scores q_g . k_j for the run (float32),
// their max, exp and sum, then sum_j p_gj v_j, with the query vectors and the output
// accumulators in registers for a head dim of 64, 128 or 256. Threads take runs from a shared
// counter; partial results merge through their max and sum (the log-sum-exp). A very short
// context runs on the calling thread.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// Below this many (key, KV head) pairs in a call, one thread does it all. In a decode step the
// K/V is cold (the weights streamed through the caches since its last read) and one thread
// read it at ~10 GB/s (SmolLM2 at 128-160 tokens, 2-core Zen 4), so short contexts split too.
// Thresholds of 64 to 384 pairs and 4 or 8 runs a thread measured even within noise (±0.5 ms a
// step); always-serial was slowest at 512 tokens.
constexpr int64_t kSerialWork = 192;
constexpr int64_t kRunsPerThread = 4;
// Query heads per pass over a KV head's rows: their vectors and accumulators stay in registers.
constexpr int64_t kHeadsPerPass = 4;

struct Shape {
  int64_t rows, heads, dim, kv_heads, group, block_size, width;
  int64_t q_b, q_h, t_b;  // strides (elements)
  int64_t window;
  float scale;
};

// Row b's visible key slots [lo, hi).
inline void visible(const Shape& s, int64_t ctx, int64_t first, int64_t& lo, int64_t& hi) {
  hi = std::min(ctx - first, s.width * s.block_size);
  lo = s.window > 0 ? std::max<int64_t>(0, ctx - s.window - first) : 0;
}

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy_n(src, n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}

// One task's result, per query head of the row (H of them): sum_j exp(s_j - max) v_j, max, sum.
struct Partial {
  float* acc;  // [H, D]
  float* max;  // [H]
  float* sum;  // [H]
};

// Calls fn(j, count, offset) for each block's share of the slots [j0, j1) of one row's table:
// slots j .. j + count - 1, whose rows (all KV heads) start at element offset `offset`.
template <typename F>
inline void each_block(const Shape& s, const int64_t* table, int64_t j0, int64_t j1, F fn) {
  const int64_t row_stride = s.kv_heads * s.dim;
  for (int64_t j = j0; j < j1;) {
    const int64_t block = j / s.block_size, end = std::min(j1, (block + 1) * s.block_size);
    fn(j, end - j, (table[block] * s.block_size + j % s.block_size) * row_stride);
    j = end;
  }
}

// Max, exp and sum of each of the m score rows (of n, ld apart), in place.
inline void softmax_rows(float* scores, int64_t m, int64_t n, int64_t ld, Partial out) {
  for (int64_t r = 0; r < m; ++r) {
    float* sc = scores + r * ld;
    const float top = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, sc, n);
    at::vec::map([&](Vec x) { return (x - Vec(top)).exp_u20(); }, sc, sc, n);
    out.max[r] = top;
    out.sum[r] = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sc, n);
  }
}

// A head dim D known at compile time: a K/V row is D / Vec::size() registers.
template <int64_t D, typename T>
inline void load_row(const T* p, Vec (&r)[D / Vec::size()]) {
  constexpr int64_t n = D / Vec::size();
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t i = 0; i < n; ++i) r[i] = Vec::loadu(p + i * Vec::size());
  } else {
    for (int64_t i = 0; i < n; i += 2) {
      auto [a, b] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p + i * Vec::size()));
      r[i] = a;
      r[i + 1] = b;
    }
  }
}

// scores[g * ld + i] = q_g . k_i for GB query heads and `count` K rows `stride` apart.
template <int64_t D, int64_t GB, typename T>
inline void block_scores(const float* q, const T* k, int64_t stride, int64_t count, float* scores, int64_t ld) {
  constexpr int64_t n_vec = D / Vec::size();
  Vec qv[GB][n_vec];
  for (int64_t g = 0; g < GB; ++g)
    for (int64_t i = 0; i < n_vec; ++i) qv[g][i] = Vec::loadu(q + g * D + i * Vec::size());
  for (int64_t j = 0; j < count; ++j) {
    Vec kr[n_vec];
    load_row<D>(k + j * stride, kr);
    for (int64_t g = 0; g < GB; ++g) {
      Vec a = qv[g][0] * kr[0];
      for (int64_t i = 1; i < n_vec; ++i) a = at::vec::fmadd(qv[g][i], kr[i], a);
      scores[g * ld + j] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, a);
    }
  }
}

// acc_g += sum_i p[g * ld + i] v_i for GB query heads and `count` V rows `stride` apart.
template <int64_t D, int64_t GB, typename T>
inline void block_values(const float* p, int64_t ld, const T* v, int64_t stride, int64_t count, float* acc) {
  constexpr int64_t n_vec = D / Vec::size();
  Vec a[GB][n_vec];
  for (int64_t g = 0; g < GB; ++g)
    for (int64_t i = 0; i < n_vec; ++i) a[g][i] = Vec::loadu(acc + g * D + i * Vec::size());
  for (int64_t j = 0; j < count; ++j) {
    Vec vr[n_vec];
    load_row<D>(v + j * stride, vr);
    for (int64_t g = 0; g < GB; ++g) {
      const Vec pj(p[g * ld + j]);
      for (int64_t i = 0; i < n_vec; ++i) a[g][i] = at::vec::fmadd(pj, vr[i], a[g][i]);
    }
  }
  for (int64_t g = 0; g < GB; ++g)
    for (int64_t i = 0; i < n_vec; ++i) a[g][i].store(acc + g * D + i * Vec::size());
}

// Runs fn.template operator()<GB>(g0) over the query heads of a group, kHeadsPerPass at a time.
template <typename F>
inline void by_passes(int64_t group, F fn) {
  for (int64_t g0 = 0; g0 < group; g0 += kHeadsPerPass) {
    switch (std::min(kHeadsPerPass, group - g0)) {
      case 1: fn.template operator()<1>(g0); break;
      case 2: fn.template operator()<2>(g0); break;
      case 3: fn.template operator()<3>(g0); break;
      default: fn.template operator()<4>(g0); break;
    }
  }
}

// One task over slots [j0, j1): scores of every query head (rows of `scores`, n apart), their
// softmax, then the weighted V rows into out.acc. q: the row's H scaled query vectors.
template <int64_t D, typename T>
void run_fixed(const Shape& s, const float* q, const T* k_cache, const T* v_cache, const int64_t* table,
               int64_t j0, int64_t j1, float* scores, Partial out) {
  const int64_t n = j1 - j0, g = s.group, stride = s.kv_heads * D;
  each_block(s, table, j0, j1, [&](int64_t j, int64_t count, int64_t off) {
    for (int64_t h = 0; h < s.kv_heads; ++h)
      by_passes(g, [&]<int64_t GB>(int64_t g0) {
        const int64_t head = h * g + g0;
        block_scores<D, GB>(q + head * D, k_cache + off + h * D, stride, count, scores + head * n + j - j0, n);
      });
  });
  softmax_rows(scores, s.heads, n, n, out);
  std::fill_n(out.acc, s.heads * D, 0.0f);
  each_block(s, table, j0, j1, [&](int64_t j, int64_t count, int64_t off) {
    for (int64_t h = 0; h < s.kv_heads; ++h)
      by_passes(g, [&]<int64_t GB>(int64_t g0) {
        const int64_t head = h * g + g0;
        block_values<D, GB>(scores + head * n + j - j0, n, v_cache + off + h * D, stride, count,
                            out.acc + head * D);
      });
  });
}

// Any head dim: the same arithmetic, one K/V row at a time converted into `row`.
template <typename T>
void run_any(const Shape& s, const float* q, const T* k_cache, const T* v_cache, const int64_t* table,
             int64_t j0, int64_t j1, float* scores, float* row, Partial out) {
  const int64_t n = j1 - j0, d = s.dim, g = s.group;
  each_block(s, table, j0, j1, [&](int64_t j, int64_t count, int64_t off) {
    for (int64_t i = 0; i < count; ++i)
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        to_float(k_cache + off + (i * s.kv_heads + h) * d, row, d);
        for (int64_t head = h * g; head < (h + 1) * g; ++head)
          scores[head * n + j - j0 + i] = at::vec::map2_reduce_all<float>(
              [](Vec x, Vec y) { return x * y; }, [](Vec x, Vec y) { return x + y; }, q + head * d, row, d);
      }
  });
  softmax_rows(scores, s.heads, n, n, out);
  std::fill_n(out.acc, s.heads * d, 0.0f);
  each_block(s, table, j0, j1, [&](int64_t j, int64_t count, int64_t off) {
    for (int64_t i = 0; i < count; ++i)
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        to_float(v_cache + off + (i * s.kv_heads + h) * d, row, d);
        for (int64_t head = h * g; head < (h + 1) * g; ++head) {
          const Vec p(scores[head * n + j - j0 + i]);
          float* acc = out.acc + head * d;
          at::vec::map2([&](Vec x, Vec y) { return at::vec::fmadd(p, x, y); }, acc, row, acc, d);
        }
      }
  });
}

template <typename T>
void attend(const Shape& s, const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
            const int64_t* context_lens, const int64_t* first_pos, T* out, float* lse) {
  const int64_t d = s.dim, heads = s.heads, bs = s.block_size;
  std::vector<int64_t> lo(s.rows), hi(s.rows);
  int64_t work = 0, widest = 0;  // widest: the most blocks a row's visible slots touch
  for (int64_t b = 0; b < s.rows; ++b) {
    visible(s, context_lens[b], first_pos ? first_pos[b] : 0, lo[b], hi[b]);
    if (hi[b] <= lo[b]) continue;
    work += (hi[b] - lo[b]) * s.kv_heads;
    widest = std::max(widest, (hi[b] - 1) / bs - lo[b] / bs + 1);
  }
  const int64_t threads = at::get_num_threads();
  const bool serial = work < kSerialWork || threads == 1;
  // Runs of whole blocks: about kRunsPerThread a thread, taken as threads free up (the widest
  // row's runs all hold keys; a shorter row's last ones may be empty).
  const int64_t want = serial ? 1 : std::max<int64_t>(1, std::min(widest, (kRunsPerThread * threads + s.rows - 1) / s.rows));
  const int64_t run_blocks = std::max<int64_t>(1, (widest + want - 1) / want);
  const int64_t runs = std::max<int64_t>(1, (widest + run_blocks - 1) / run_blocks);
  const int64_t tasks = s.rows * runs;
  std::vector<float> acc(tasks * heads * d), max(tasks * heads), sum(tasks * heads);

  struct Scratch {
    std::vector<float> qs, scores, row;
  };
  auto task = [&](int64_t t, Scratch& w) {
    const int64_t b = t / runs, r = t % runs;
    Partial p{acc.data() + t * heads * d, max.data() + t * heads, sum.data() + t * heads};
    const int64_t first = lo[b] / bs * bs;
    const int64_t j0 = std::max(lo[b], first + r * run_blocks * bs);
    const int64_t j1 = std::min(hi[b], first + (r + 1) * run_blocks * bs);
    if (j1 <= j0) {
      std::fill_n(p.max, heads, -std::numeric_limits<float>::infinity());
      std::fill_n(p.sum, heads, 0.0f);
      return;
    }
    w.qs.resize(heads * d);
    w.row.resize(d);
    w.scores.resize(heads * (j1 - j0));
    for (int64_t head = 0; head < heads; ++head) {
      float* qh = w.qs.data() + head * d;
      to_float(q + b * s.q_b + head * s.q_h, qh, d);
      at::vec::map([&](Vec x) { return x * Vec(s.scale); }, qh, qh, d);
    }
    const int64_t* table = tables + b * s.t_b;
    const float* qs = w.qs.data();
    float* scores = w.scores.data();
    switch (d) {
      case 64: run_fixed<64>(s, qs, k_cache, v_cache, table, j0, j1, scores, p); break;
      case 128: run_fixed<128>(s, qs, k_cache, v_cache, table, j0, j1, scores, p); break;
      case 256: run_fixed<256>(s, qs, k_cache, v_cache, table, j0, j1, scores, p); break;
      default: run_any(s, qs, k_cache, v_cache, table, j0, j1, scores, w.row.data(), p);
    }
  };
  if (serial) {
    Scratch w;
    for (int64_t t = 0; t < tasks; ++t) task(t, w);
  } else {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      Scratch w;
      for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) task(t, w);
    });
  }

  // Merge each row's runs: out = sum_r acc_r e^(max_r - M) / sum_r sum_r e^(max_r - M).
  std::vector<float> merged(d);
  for (int64_t b = 0; b < s.rows; ++b) {
    for (int64_t head = 0; head < heads; ++head) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t r = 0; r < runs; ++r) top = std::max(top, max[(b * runs + r) * heads + head]);
      float total = 0.0f;
      std::fill_n(merged.data(), d, 0.0f);
      if (top != -std::numeric_limits<float>::infinity()) {
        for (int64_t r = 0; r < runs; ++r) {
          const int64_t i = (b * runs + r) * heads + head;
          if (sum[i] == 0.0f) continue;  // an empty run (its acc is unset)
          const float by = std::exp(max[i] - top);
          total += sum[i] * by;
          const Vec w(by);
          at::vec::map2([&](Vec x, Vec y) { return at::vec::fmadd(w, x, y); }, merged.data(), acc.data() + i * d,
                        merged.data(), d);
        }
      }
      const float inv = total > 0.0f ? 1.0f / total : 0.0f;
      at::vec::map([&](Vec x) { return x * Vec(inv); }, merged.data(), merged.data(), d);
      T* dst = out + (b * heads + head) * d;
      if constexpr (std::is_same_v<T, float>) {
        std::copy_n(merged.data(), d, dst);
      } else {
        at::vec::convert(merged.data(), dst, d);
      }
      lse[b * heads + head] = total > 0.0f ? top + std::log(total) : -std::numeric_limits<float>::infinity();
    }
  }
}

std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                    const at::Tensor& v_cache, const at::Tensor& tables,
                                                    const at::Tensor& context_lens,
                                                    const std::optional<at::Tensor>& first_pos, double scale,
                                                    int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "decode_attention: q must be [rows, heads, dim] and the caches [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "decode_attention: q and the caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && q.stride(2) == 1,
              "decode_attention: the caches must be contiguous and q's head dim too");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "decode_attention: head dims or head counts do not match");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) && tables.stride(1) == 1 &&
                  tables.scalar_type() == at::kLong,
              "decode_attention: tables must be int64 [rows, width] with contiguous rows");
  TORCH_CHECK(context_lens.is_contiguous() && context_lens.numel() == q.size(0) &&
                  context_lens.scalar_type() == at::kLong,
              "decode_attention: context_lens must be int64 [rows]");
  const int64_t* first = nullptr;
  if (first_pos.has_value()) {
    TORCH_CHECK(first_pos->is_contiguous() && first_pos->numel() == q.size(0) &&
                    first_pos->scalar_type() == at::kLong,
                "decode_attention: first_pos must be int64 [rows]");
    first = first_pos->const_data_ptr<int64_t>();
  }
  Shape s{q.size(0), q.size(1), q.size(2), k_cache.size(2), q.size(1) / k_cache.size(2), k_cache.size(1),
          tables.size(1), q.stride(0), q.stride(1), tables.stride(0), window, static_cast<float>(scale)};
  at::Tensor out = at::empty({s.rows, s.heads, s.dim}, q.options());
  at::Tensor lse = at::empty({s.rows, s.heads}, q.options().dtype(at::kFloat));
  if (s.rows == 0) return {out, lse};
  auto run = [&](auto tag) {
    using T = decltype(tag);
    attend(s, q.const_data_ptr<T>(), k_cache.const_data_ptr<T>(), v_cache.const_data_ptr<T>(),
           tables.const_data_ptr<int64_t>(), context_lens.const_data_ptr<int64_t>(), first,
           out.mutable_data_ptr<T>(), lse.mutable_data_ptr<float>());
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "decode_attention: float32, bfloat16 or float16 only");
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hyprefix, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor context_lens, "
        "Tensor? first_pos, float scale, int window) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hyprefix, CPU, m) { m.impl("decode_attention", &decode_attention); }
