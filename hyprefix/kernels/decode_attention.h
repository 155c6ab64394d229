// The arithmetic of hyprefix::decode_attention (decode_attention.cpp, which documents it) as
// planned work, also run inside hyprefix::DecodeModel (decode_layers.cpp). Written on ATen's
// vector types: one build per CPU capability, included by one translation unit each.
//
// The caches' element type C is q's T (float, bfloat16, float16) or a packed 8-bit code
// (kv8_rows.h: a row of D codes and its scale, D + kRowExtra<C> elements), which the row loads
// (load_row, to_float) dequantize into float32; everything after them is the same arithmetic.
#pragma once
#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kv8_rows.h"
#include "latent_attention.h"

namespace {

using Vec = at::vec::Vectorized<float>;

// Below this many (key, KV head) pairs in a call, one thread does it all. In a decode step the
// K/V is cold (the weights streamed through the caches since its last read) and one thread
// alone reads it latency-bound, so short contexts split too. The threshold and runs per thread
// are flat optima (docs/perf-log.md); always-serial was slowest.
constexpr int64_t kSerialWork = 192;
constexpr int64_t kRunsPerThread = 4;
// Query heads per pass over a KV head's rows: their vectors and accumulators stay in registers.
constexpr int64_t kHeadsPerPass = 4;

// Memory another phase will read (spans of bytes, in order), pulled into L2 a few lines per K/V
// row while the attention's own loads wait: the attention of a short context is bound by their
// latency and leaves the memory's bandwidth partly idle. Empty (no spans) outside DecodeModel.
struct Prefetcher {
  static constexpr int kSpans = 3;
  const char* next[kSpans] = {};
  const char* end[kSpans] = {};
  int span = kSpans;  // the span being read; kSpans: done
  int64_t lines_per_row = 0;

  void start(int64_t lines) {
    span = 0;
    lines_per_row = lines;
    std::fill_n(next, kSpans, nullptr);
    std::fill_n(end, kSpans, nullptr);
  }
  void add(int i, const void* from, int64_t bytes) {
    next[i] = static_cast<const char*>(from);
    end[i] = next[i] + std::max<int64_t>(0, bytes);
  }
  inline void row() {
    for (int64_t n = 0; n < lines_per_row && span < kSpans;) {
      if (next[span] >= end[span]) {
        ++span;
        continue;
      }
      __builtin_prefetch(next[span], 0, 2);  // into L2 (prefetcht1 on x86)
      next[span] += 64;
      ++n;
    }
  }
};

struct Shape {
  int64_t rows, heads, dim, kv_heads, group, block_size, width;
  int64_t q_b, q_h, t_b;  // strides (elements)
  int64_t window;
  float scale;
  // A latent cache (K is V, one KV head: latent_attention.h) and the values a head's output
  // takes from each row there, the first value_dim (0: all dim); elsewhere every head's dim.
  bool latent = false;
  int64_t value_dim = 0;
  int64_t vd() const { return latent && value_dim > 0 ? value_dim : dim; }
};

// Row b's visible key slots [lo, hi).
inline void visible(const Shape& s, int64_t ctx, int64_t first, int64_t& lo, int64_t& hi) {
  hi = std::min(ctx - first, s.width * s.block_size);
  lo = s.window > 0 ? std::max<int64_t>(0, ctx - s.window - first) : 0;
}

// n values from src as float32; a packed row: its n codes and its scale, dequantized.
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  if constexpr (kPacked<T>) {
    kv8::to_float(src, dst, n);
  } else if constexpr (std::is_same_v<T, float>) {
    std::copy_n(src, n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}

// One task's result, per query head of the row (H of them): sum_j exp(s_j - max) v_j, max, sum.
struct Partial {
  float* acc;  // [H, Shape::vd()]
  float* max;  // [H]
  float* sum;  // [H]
};

// Calls fn(j, count, offset) for each block's share of the slots [j0, j1) of one row's table:
// slots j .. j + count - 1, whose rows (all KV heads) start at element offset `offset` of a
// cache of C (a token's rows: kv_heads rows of dim + kRowExtra<C> elements).
template <typename C, typename F>
inline void each_block(const Shape& s, const int64_t* table, int64_t j0, int64_t j1, F fn) {
  const int64_t row_stride = s.kv_heads * (s.dim + kRowExtra<C>);
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

// A head dim D known at compile time: a K/V row is D / Vec::size() registers (a packed row
// dequantized: its codes times its scale).
template <int64_t D, typename T>
inline void load_row(const T* p, Vec (&r)[D / Vec::size()]) {
  constexpr int64_t n = D / Vec::size();
  if constexpr (kPacked<T>) {
    kv8::load_row<D>(p, r);
  } else if constexpr (std::is_same_v<T, float>) {
    for (int64_t i = 0; i < n; ++i) r[i] = Vec::loadu(p + i * Vec::size());
  } else {
    for (int64_t i = 0; i < n; i += 2) {
      auto [a, b] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p + i * Vec::size()));
      r[i] = a;
      r[i + 1] = b;
    }
  }
}

// The row at next + offset (a head's D values, and a packed row's scale) into L1, where next is
// set: the same head's row of the task's next block, fetched while this block's rows are
// computed. A block's rows start cold (the weights streamed through the caches since the last step
// read them) and a task's loads alone keep few misses in flight; it pays even where a task holds
// one or two blocks. Every 64-byte line the row touches: a packed row (D + 2 bytes) need not
// start on one.
template <int64_t D, typename T>
inline void prefetch_row(const T* next, int64_t offset) {
  if (next == nullptr) return;
  const char* p = reinterpret_cast<const char*>(next + offset);
  const char* end = p + (D + kRowExtra<T>) * static_cast<int64_t>(sizeof(T));
  for (p -= reinterpret_cast<uintptr_t>(p) % 64; p < end; p += 64) __builtin_prefetch(p, 0, 3);
}

// out[t] = the sum of the lanes of tile[t] for the Vec::size() vectors of a tile (one vector a
// key): a transposed sum, every key's sum at once. Per key it is about 3 shuffles and adds where
// reducing each vector alone takes 8 or more in a dependent chain; the order of the additions
// differs from vec_reduce_all's (a float32 rounding difference, the same for every cache format).
inline Vec sum_lanes(const float* tile) {
  constexpr int64_t w = Vec::size();
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r[8], t[4], u[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit block: keys 2i, 2i+1, lanes 0+2 and 1+3
    const __m512 x = _mm512_load_ps(tile + 2 * i * w), y = _mm512_load_ps(tile + (2 * i + 1) * w);
    r[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit block: keys 4i .. 4i+3, that block's sum
    const __m512d x = _mm512_castps_pd(r[2 * i]), y = _mm512_castps_pd(r[2 * i + 1]);
    t[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // blocks: keys 8i..8i+3 over blocks 0+1, 2+3; keys 8i+4.. likewise
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 r[4], t[2];
  for (int i = 0; i < 4; ++i) {
    const __m256 x = _mm256_load_ps(tile + 2 * i * w), y = _mm256_load_ps(tile + (2 * i + 1) * w);
    r[i] = _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 2; ++i) {
    const __m256d x = _mm256_castps_pd(r[2 * i]), y = _mm256_castps_pd(r[2 * i + 1]);
    t[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(t[0], t[1], 0x20), _mm256_permute2f128_ps(t[0], t[1], 0x31));
#else
  float out[w];
  for (int64_t t = 0; t < w; ++t)
    out[t] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, Vec::loadu(tile + t * w));
  return Vec::loadu(out);
#endif
}

// scores[g * ld + i] = q_g . k_i for GB query heads and `count` K rows `stride` apart; next: where
// the same rows of the next block start (prefetch_row), or nullptr. Vec::size() keys at a time:
// each key's GB products go to a tile (a vector each), summed per head by sum_lanes; the keys
// left over one at a time.
template <int64_t D, int64_t GB, typename T>
inline void block_scores(const float* q, const T* k, int64_t stride, int64_t count, float* scores, int64_t ld,
                         Prefetcher& ahead, const T* next) {
  constexpr int64_t n_vec = D / Vec::size(), w = Vec::size();
  Vec qv[GB][n_vec];
  for (int64_t g = 0; g < GB; ++g)
    for (int64_t i = 0; i < n_vec; ++i) qv[g][i] = Vec::loadu(q + g * D + i * Vec::size());
  const auto products = [&](int64_t j, Vec (&a)[GB]) {  // key j's products with each head, unsummed
    Vec kr[n_vec];
    ahead.row();
    prefetch_row<D>(next, j * stride);
    load_row<D>(k + j * stride, kr);
    for (int64_t g = 0; g < GB; ++g) {
      a[g] = qv[g][0] * kr[0];
      for (int64_t i = 1; i < n_vec; ++i) a[g] = at::vec::fmadd(qv[g][i], kr[i], a[g]);
    }
  };
  alignas(64) float tile[GB][w * w];
  int64_t j = 0;
  for (; j + w <= count; j += w) {
    for (int64_t t = 0; t < w; ++t) {
      Vec a[GB];
      products(j + t, a);
      for (int64_t g = 0; g < GB; ++g) a[g].store(tile[g] + t * w);
    }
    for (int64_t g = 0; g < GB; ++g) sum_lanes(tile[g]).store(scores + g * ld + j);
  }
  for (; j < count; ++j) {
    Vec a[GB];
    products(j, a);
    for (int64_t g = 0; g < GB; ++g)
      scores[g * ld + j] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, a[g]);
  }
}

// acc_g += sum_i p[g * ld + i] v_i for GB query heads and `count` V rows `stride` apart; next as in
// block_scores.
template <int64_t D, int64_t GB, typename T>
inline void block_values(const float* p, int64_t ld, const T* v, int64_t stride, int64_t count, float* acc,
                         Prefetcher& ahead, const T* next) {
  constexpr int64_t n_vec = D / Vec::size();
  Vec a[GB][n_vec];
  for (int64_t g = 0; g < GB; ++g)
    for (int64_t i = 0; i < n_vec; ++i) a[g][i] = Vec::loadu(acc + g * D + i * Vec::size());
  for (int64_t j = 0; j < count; ++j) {
    Vec vr[n_vec];
    ahead.row();
    prefetch_row<D>(next, j * stride);
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
               int64_t j0, int64_t j1, float* scores, Partial out, Prefetcher& ahead) {
  constexpr int64_t row = D + kRowExtra<T>;  // a stored K/V row, elements
  const int64_t n = j1 - j0, g = s.group, stride = s.kv_heads * row;
  // element offset of the block after slots [j, j + count) within the task, or -1
  const auto next_block = [&](int64_t j, int64_t count) -> int64_t {
    const int64_t after = j + count;
    return after < j1 ? table[after / s.block_size] * s.block_size * stride : -1;
  };
  each_block<T>(s, table, j0, j1, [&](int64_t j, int64_t count, int64_t off) {
    const int64_t next = next_block(j, count);
    for (int64_t h = 0; h < s.kv_heads; ++h)
      by_passes(g, [&]<int64_t GB>(int64_t g0) {
        const int64_t head = h * g + g0;
        block_scores<D, GB>(q + head * D, k_cache + off + h * row, stride, count, scores + head * n + j - j0, n,
                            ahead, next >= 0 && g0 == 0 ? k_cache + next + h * row : nullptr);
      });
  });
  softmax_rows(scores, s.heads, n, n, out);
  std::fill_n(out.acc, s.heads * D, 0.0f);
  each_block<T>(s, table, j0, j1, [&](int64_t j, int64_t count, int64_t off) {
    const int64_t next = next_block(j, count);
    for (int64_t h = 0; h < s.kv_heads; ++h)
      by_passes(g, [&]<int64_t GB>(int64_t g0) {
        const int64_t head = h * g + g0;
        block_values<D, GB>(scores + head * n + j - j0, n, v_cache + off + h * row, stride, count,
                            out.acc + head * D, ahead, next >= 0 && g0 == 0 ? v_cache + next + h * row : nullptr);
      });
  });
}

// Any head dim: the same arithmetic, one K/V row at a time converted into `row`.
template <typename T>
void run_any(const Shape& s, const float* q, const T* k_cache, const T* v_cache, const int64_t* table,
             int64_t j0, int64_t j1, float* scores, float* row, Partial out) {
  const int64_t n = j1 - j0, d = s.dim, g = s.group, stored = d + kRowExtra<T>;
  each_block<T>(s, table, j0, j1, [&](int64_t j, int64_t count, int64_t off) {
    for (int64_t i = 0; i < count; ++i)
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        to_float(k_cache + off + (i * s.kv_heads + h) * stored, row, d);
        for (int64_t head = h * g; head < (h + 1) * g; ++head)
          scores[head * n + j - j0 + i] = at::vec::map2_reduce_all<float>(
              [](Vec x, Vec y) { return x * y; }, [](Vec x, Vec y) { return x + y; }, q + head * d, row, d);
      }
  });
  softmax_rows(scores, s.heads, n, n, out);
  std::fill_n(out.acc, s.heads * d, 0.0f);
  each_block<T>(s, table, j0, j1, [&](int64_t j, int64_t count, int64_t off) {
    for (int64_t i = 0; i < count; ++i)
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        to_float(v_cache + off + (i * s.kv_heads + h) * stored, row, d);
        for (int64_t head = h * g; head < (h + 1) * g; ++head) {
          const Vec p(scores[head * n + j - j0 + i]);
          float* acc = out.acc + head * d;
          at::vec::map2([&](Vec x, Vec y) { return at::vec::fmadd(p, x, y); }, acc, row, acc, d);
        }
      }
  });
}

struct Scratch {  // one thread's buffers for its tasks
  std::vector<float> qs, scores, row;
  std::vector<float> run_acc, run_max, run_sum, merged;  // a whole row's runs (DecodeWork::row)
  Prefetcher ahead;  // what to prefetch meanwhile (set by DecodeModel; none elsewhere)
  latent::Scratch latent;
};

// A fixed plan (DecodeWork with fixed_run_blocks) gives each thread whole rows, a row's runs in
// order, when there are at least this many rows a thread.
constexpr int64_t kRowsPerThread = 4;

// One call's work, planned: tasks (a row and a run of its blocks) that any thread may take,
// then a merge of each (row, head)'s partial results. Used by hyprefix::decode_attention
// (decode_attention.cpp) and inside hyprefix::DecodeModel's parallel region (decode_layers.cpp),
// which plans once a step and points q and the caches at each layer's.
//
// The plan picks the runs by the thread count and the widest row, so a row's result depends on
// both. With fixed_run_blocks > 0 (the batch-invariant mode) it does not: a row's runs are the
// runs of that many blocks at fixed positions (run i holds positions [i, i + 1) * fixed_run_blocks
// * block_size, whatever the table's first position), cut to its visible keys; only non-empty
// runs are tasks, and a row's runs merge in order. Each run's partial and each merge go through
// one compiled copy of their code (``partial``, ``merge_runs``), so a row's result is the same
// bits whether its runs ran as tasks of their own (few rows: ``tasks``, then ``merge``) or in one
// task for the whole row (``per_row``: ``row``). ``whole_rows`` false keeps every run a task of its
// own whatever the row count, for a caller that runs ``task`` and then ``merge`` (DecodeModel).
//
// T: q's and the output's type; C: the caches' elements, T or a packed code (kv8_rows.h).
template <typename T, typename C = T>
struct DecodeWork {
  Shape s;
  const T* q;
  const C *k_cache, *v_cache;
  const int64_t *tables, *context_lens, *first_pos;
  std::vector<int64_t> lo, hi;
  int64_t run_blocks = 1, runs = 1, tasks = 0;
  bool serial = true;
  std::vector<float> acc, max, sum;
  // fixed plan: its runs' size in blocks; each row's first run (by position) and first task
  int64_t fixed = 0;
  std::vector<int64_t> first_run, row_task;
  bool per_row = false;  // fixed plan: a task is a whole row (``row``)

  DecodeWork(const Shape& shape, const T* q_, const C* k, const C* v, const int64_t* tables_,
             const int64_t* context_lens_, const int64_t* first_pos_, int64_t threads,
             int64_t fixed_run_blocks = 0, bool whole_rows = true)
      : s(shape), q(q_), k_cache(k), v_cache(v), tables(tables_), context_lens(context_lens_),
        first_pos(first_pos_), lo(shape.rows), hi(shape.rows), fixed(fixed_run_blocks) {
    const int64_t bs = s.block_size;
    int64_t work = 0, widest = 0;  // widest: the most blocks a row's visible slots touch
    for (int64_t b = 0; b < s.rows; ++b) {
      visible(s, context_lens[b], first_pos ? first_pos[b] : 0, lo[b], hi[b]);
      if (hi[b] <= lo[b]) continue;
      work += (hi[b] - lo[b]) * (s.latent ? s.heads : s.kv_heads);
      widest = std::max(widest, (hi[b] - 1) / bs - lo[b] / bs + 1);
    }
    serial = work < (s.latent ? 2 * latent::kRunWork : kSerialWork) || threads == 1;
    if (fixed > 0) {
      plan_fixed(threads, whole_rows);
      return;
    }
    // Runs of whole blocks: about kRunsPerThread a thread, taken as threads free up (the widest
    // row's runs all hold keys; a shorter row's last ones may be empty).
    int64_t want =
        serial ? 1 : std::max<int64_t>(1, std::min(widest, (kRunsPerThread * threads + s.rows - 1) / s.rows));
    if (s.latent)  // runs of at least kRunWork (key, head) pairs
      want = std::min(want, std::max<int64_t>(1, widest * bs * s.heads / latent::kRunWork));
    run_blocks = std::max<int64_t>(1, (widest + want - 1) / want);
    runs = std::max<int64_t>(1, (widest + run_blocks - 1) / run_blocks);
    tasks = s.rows * runs;
    acc.resize(tasks * s.heads * s.vd());
    max.resize(tasks * s.heads);
    sum.resize(tasks * s.heads);
  }

  void plan_fixed(int64_t threads, bool whole_rows) {
    const int64_t span = fixed * s.block_size;
    first_run.assign(s.rows, 0);
    row_task.assign(s.rows + 1, 0);
    for (int64_t b = 0; b < s.rows; ++b) {
      int64_t n = 0;
      if (hi[b] > lo[b]) {
        const int64_t f = first_pos ? first_pos[b] : 0;
        first_run[b] = (lo[b] + f) / span;
        n = (hi[b] - 1 + f) / span + 1 - first_run[b];
      }
      row_task[b + 1] = row_task[b] + n;
    }
    run_blocks = fixed;
    tasks = row_task[s.rows];
    per_row = whole_rows && !serial && s.rows >= kRowsPerThread * threads;
    if (!per_row) {
      acc.resize(tasks * s.heads * s.vd());
      max.resize(tasks * s.heads);
      sum.resize(tasks * s.heads);
    }
  }

  // Fixed plan: run r of row b's runs as slots [j0, j1).
  void fixed_slots(int64_t b, int64_t r, int64_t& j0, int64_t& j1) const {
    const int64_t span = fixed * s.block_size, f = first_pos ? first_pos[b] : 0, run = first_run[b] + r;
    j0 = std::max(lo[b], run * span - f);
    j1 = std::min(hi[b], (run + 1) * span - f);
  }

  // Task t's row and its slots [j0, j1) (empty where the row's keys end before the run).
  void task_slots(int64_t t, int64_t& b, int64_t& j0, int64_t& j1) const {
    if (fixed > 0) {
      b = std::upper_bound(row_task.begin(), row_task.end(), t) - row_task.begin() - 1;
      fixed_slots(b, t - row_task[b], j0, j1);
      return;
    }
    const int64_t bs = s.block_size, r = t % runs;
    b = t / runs;
    const int64_t first = lo[b] / bs * bs;
    j0 = std::max(lo[b], first + r * run_blocks * bs);
    j1 = std::min(hi[b], first + (r + 1) * run_blocks * bs);
  }

  void task(int64_t t, Scratch& w) {
    const int64_t d = s.vd(), heads = s.heads;
    int64_t b, j0, j1;
    task_slots(t, b, j0, j1);
    partial(b, j0, j1, Partial{acc.data() + t * heads * d, max.data() + t * heads, sum.data() + t * heads}, w);
  }

  // Fixed plan, per_row: row b whole (its runs in order, then merged) into dst [H, vd] and lse [H].
  void row(int64_t b, Scratch& w, T* dst, float* lse) {
    const int64_t d = s.vd(), heads = s.heads, n = row_task[b + 1] - row_task[b];
    w.run_acc.resize(n * heads * d);
    w.run_max.resize(n * heads);
    w.run_sum.resize(n * heads);
    w.merged.resize(d);
    for (int64_t r = 0; r < n; ++r) {
      int64_t j0, j1;
      fixed_slots(b, r, j0, j1);
      partial(b, j0, j1, Partial{w.run_acc.data() + r * heads * d, w.run_max.data() + r * heads,
                                 w.run_sum.data() + r * heads}, w);
    }
    for (int64_t head = 0; head < heads; ++head)
      merge_runs(w.run_acc.data(), w.run_max.data(), w.run_sum.data(), n, head, dst + head * d, lse + head,
                 w.merged.data());
  }

  // Row b's slots [j0, j1), every head, into p (max -inf and sum 0 where empty).
  __attribute__((noinline)) void partial(int64_t b, int64_t j0, int64_t j1, Partial p, Scratch& w) {
    const int64_t d = s.dim, heads = s.heads;
    if (j1 <= j0) {
      std::fill_n(p.max, heads, -std::numeric_limits<float>::infinity());
      std::fill_n(p.sum, heads, 0.0f);
      return;
    }
    const int64_t* table = tables + b * s.t_b;
    if (s.latent) {  // k_cache is v_cache, one KV head: every head from one read of each row
      latent::Task<T, C> run(w.latent, q + b * s.q_b, s.q_h, s.scale, heads, d, s.vd(), p.acc);
      each_block<C>(s, table, j0, j1, [&](int64_t, int64_t count, int64_t off) { run.rows(k_cache + off, count); });
      run.finish(p.max, p.sum);
      return;
    }
    w.qs.resize(heads * d);
    for (int64_t head = 0; head < heads; ++head) {
      float* qh = w.qs.data() + head * d;
      to_float(q + b * s.q_b + head * s.q_h, qh, d);
      at::vec::map([&](Vec x) { return x * Vec(s.scale); }, qh, qh, d);
    }
    const float* qs = w.qs.data();
    w.row.resize(d);
    w.scores.resize(heads * (j1 - j0));
    float* scores = w.scores.data();
    switch (d) {
      case 64: run_fixed<64>(s, qs, k_cache, v_cache, table, j0, j1, scores, p, w.ahead); break;
      case 128: run_fixed<128>(s, qs, k_cache, v_cache, table, j0, j1, scores, p, w.ahead); break;
      case 256: run_fixed<256>(s, qs, k_cache, v_cache, table, j0, j1, scores, p, w.ahead); break;
      default: run_any(s, qs, k_cache, v_cache, table, j0, j1, scores, w.row.data(), p);
    }
  }

  // Row b's runs merged for one head: out = sum_r acc_r e^(max_r - M) / sum_r sum_r e^(max_r - M),
  // into dst [vd] (q's dtype) and its log-sum-exp; `merged`: vd floats of scratch.
  void merge(int64_t b, int64_t head, T* dst, float* lse, float* merged) const {
    const int64_t d = s.vd(), heads = s.heads;
    const int64_t first = fixed > 0 ? row_task[b] : b * runs, n = fixed > 0 ? row_task[b + 1] - first : runs;
    merge_runs(acc.data() + first * heads * d, max.data() + first * heads, sum.data() + first * heads, n, head, dst,
               lse, merged);
  }

  // merge over `runs` partials, run r's at part_acc [r][H][vd], part_max and part_sum [r][H].
  __attribute__((noinline)) void merge_runs(const float* part_acc, const float* part_max, const float* part_sum,
                                            int64_t runs, int64_t head, T* dst, float* lse, float* merged) const {
    const int64_t d = s.vd(), heads = s.heads;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < runs; ++r) top = std::max(top, part_max[r * heads + head]);
    float total = 0.0f;
    std::fill_n(merged, d, 0.0f);
    if (top != -std::numeric_limits<float>::infinity()) {
      for (int64_t r = 0; r < runs; ++r) {
        const int64_t i = r * heads + head;
        if (part_sum[i] == 0.0f) continue;  // an empty run (its acc is unset)
        const float by = std::exp(part_max[i] - top);
        total += part_sum[i] * by;
        const Vec w(by);
        at::vec::map2([&](Vec x, Vec y) { return at::vec::fmadd(w, x, y); }, merged, part_acc + i * d, merged, d);
      }
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    at::vec::map([&](Vec x) { return x * Vec(inv); }, merged, merged, d);
    if constexpr (std::is_same_v<T, float>) {
      std::copy_n(merged, d, dst);
    } else {
      at::vec::convert(merged, dst, d);
    }
    *lse = total > 0.0f ? top + std::log(total) : -std::numeric_limits<float>::infinity();
  }
};

}  // namespace
