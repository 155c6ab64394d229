// The arithmetic of hyprefix::decode_attention over a latent cache (MLA; decode_attention.cpp
// documents the op): K and V are the same tensor, one KV head of D values a token (DeepSeek's
// [c, k_pe], 576), and every query head attends over it; each head's output is the first `vd`
// values of the weighted rows (the latent c, kv_lora_rank values; the rope part is never a value).
//
// A task's keys go in chunks of up to kChunk rows (a block's rows lie together): the chunk is
// read once (bfloat16 / float16 converted to float32 into scratch; 8-bit packed rows, kv8_rows.h,
// dequantized into the same scratch, code * scale exact in float32; float32 read in place) and
// serves every head twice while it sits in L1/L2, as two small GEMMs:
//   scores S[c, H] = K[c, D] Q^T[D, H]        heads across the vector lanes: the row's scaled
//                                              queries transposed once a task (qt, [D][hp], the
//                                              heads padded to whole vectors with zeros); each K
//                                              value is broadcast against a vector of heads
//   acc[H, vd]    += P^T[H, c] K[c, :vd]       the values along the lanes, a probability broadcast
// with an online softmax between them (each head's running max and sum; its accumulator is
// rescaled when a chunk raises its max). Register tiles: accumulators, the loaded vectors and a
// broadcast fit the ISA's registers (AVX-512: 32, AVX2: 16); smaller tiles take the tails.
// Reading K once for all heads is the point: the general path (run_any) converts each row once
// per pass (scores, then values) and reduces each head's dot product across the lanes.
//
// Written on ATen's vector types: one build per CPU capability, included by decode_attention.h.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kv8_rows.h"

namespace {
namespace latent {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
constexpr bool kWide = kLanes == 16;  // AVX-512: 32 vector registers; AVX2: 16
// Key rows a chunk (DeepSeek, float32: 16 x 576 x 4 = 36 KiB): the default block size.
constexpr int64_t kChunk = 16;
// The work of a latent cache is its (key, query head) pairs, each 2 * (D + vd) flops: compute,
// not the latency of the loads, bounds it. A run of a row's keys holds at least this many
// (64 keys of DeepSeek-V2's 16 heads; a shorter run costs more in its setup and merge than it
// spreads), and a call of fewer than twice as many runs on the calling thread (docs/perf-log.md).
constexpr int64_t kRunWork = 1024;
// Score tiles: up to kScoreVecs vectors of heads by (kWide ? 16 : 8) / vectors keys.
constexpr int64_t kScoreVecs = 2;
// Value tiles: kValueHeads heads by kValueVecs vectors of columns.
constexpr int64_t kValueHeads = 4;
constexpr int64_t kValueVecs = kWide ? 4 : 2;

// st[kk * hp + lane] = sum_i k[kk * d + i] qt[i * hp + lane], NK keys by HV vectors of heads.
template <int64_t HV, int64_t NK>
inline void score_tile(const float* qt, int64_t hp, const float* k, int64_t d, float* st) {
  Vec acc[NK][HV];
  for (int64_t kk = 0; kk < NK; ++kk)
    for (int64_t v = 0; v < HV; ++v) acc[kk][v] = Vec(0.0f);
  for (int64_t i = 0; i < d; ++i) {
    Vec q[HV];
    for (int64_t v = 0; v < HV; ++v) q[v] = Vec::loadu(qt + i * hp + v * kLanes);
    for (int64_t kk = 0; kk < NK; ++kk) {
      const Vec b(k[kk * d + i]);
      for (int64_t v = 0; v < HV; ++v) acc[kk][v] = at::vec::fmadd(b, q[v], acc[kk][v]);
    }
  }
  for (int64_t kk = 0; kk < NK; ++kk)
    for (int64_t v = 0; v < HV; ++v) acc[kk][v].store(st + kk * hp + v * kLanes);
}

// score_tile over c keys: NK at a time, then the rest by halves.
template <int64_t HV, int64_t NK>
inline void score_rows(const float* qt, int64_t hp, const float* k, int64_t d, int64_t c, float* st) {
  for (; c >= NK; c -= NK, k += NK * d, st += NK * hp) score_tile<HV, NK>(qt, hp, k, d, st);
  if constexpr (NK > 1) {
    if (c > 0) score_rows<HV, NK / 2>(qt, hp, k, d, c, st);
  }
}

// Scores of c key rows (d apart) for every (padded) head: st [c][hp].
inline void chunk_scores(const float* qt, int64_t hp, const float* k, int64_t d, int64_t c, float* st) {
  const int64_t vecs = hp / kLanes;
  int64_t v = 0;
  for (; v + kScoreVecs <= vecs; v += kScoreVecs)
    score_rows<kScoreVecs, (kWide ? 16 : 8) / kScoreVecs>(qt + v * kLanes, hp, k, d, c, st + v * kLanes);
  for (; v < vecs; ++v) score_rows<1, (kWide ? 16 : 8)>(qt + v * kLanes, hp, k, d, c, st + v * kLanes);
}

// acc[mh * vd + col] += sum_j p[j * hp + mh] k[j * d + col] for MH heads and NV vectors of
// columns; Full false: one vector of `lanes` (< kLanes) columns, the last of a row.
template <int64_t MH, int64_t NV, bool Full>
inline void value_tile(const float* p, int64_t hp, const float* k, int64_t d, int64_t c, float* acc, int64_t vd,
                       int64_t lanes) {
  static_assert(Full || NV == 1);
  const auto load = [&](const float* at) { return Full ? Vec::loadu(at) : Vec::loadu(at, lanes); };
  Vec a[MH][NV];
  for (int64_t m = 0; m < MH; ++m)
    for (int64_t v = 0; v < NV; ++v) a[m][v] = load(acc + m * vd + v * kLanes);
  for (int64_t j = 0; j < c; ++j) {
    Vec kv[NV];
    for (int64_t v = 0; v < NV; ++v) kv[v] = load(k + j * d + v * kLanes);
    for (int64_t m = 0; m < MH; ++m) {
      const Vec pj(p[j * hp + m]);
      for (int64_t v = 0; v < NV; ++v) a[m][v] = at::vec::fmadd(pj, kv[v], a[m][v]);
    }
  }
  for (int64_t m = 0; m < MH; ++m)
    for (int64_t v = 0; v < NV; ++v) {
      if constexpr (Full) {
        a[m][v].store(acc + m * vd + v * kLanes);
      } else {
        a[m][v].store(acc + m * vd, lanes);
      }
    }
}

// value_tile over every head for one stretch of columns: kValueHeads at a time, then 2, then 1.
template <int64_t NV, bool Full>
inline void value_columns(const float* p, int64_t hp, const float* k, int64_t d, int64_t c, float* acc,
                          int64_t vd, int64_t heads, int64_t lanes) {
  int64_t h = 0;
  for (; h + kValueHeads <= heads; h += kValueHeads)
    value_tile<kValueHeads, NV, Full>(p + h, hp, k, d, c, acc + h * vd, vd, lanes);
  if (h + 2 <= heads) {
    value_tile<2, NV, Full>(p + h, hp, k, d, c, acc + h * vd, vd, lanes);
    h += 2;
  }
  if (h < heads) value_tile<1, NV, Full>(p + h, hp, k, d, c, acc + h * vd, vd, lanes);
}

// acc [heads][vd] += P^T K[:, :vd] for c key rows (d apart), P as st [c][hp]. Columns outer: a
// stretch of the chunk's columns stays in L1 while every head takes it.
inline void chunk_values(const float* p, int64_t hp, const float* k, int64_t d, int64_t c, float* acc, int64_t vd,
                         int64_t heads) {
  constexpr int64_t wide = kValueVecs * kLanes;
  int64_t col = 0;
  for (; col + wide <= vd; col += wide)
    value_columns<kValueVecs, true>(p, hp, k + col, d, c, acc + col, vd, heads, kLanes);
  for (; col + kLanes <= vd; col += kLanes) value_columns<1, true>(p, hp, k + col, d, c, acc + col, vd, heads, kLanes);
  if (col < vd) value_columns<1, false>(p, hp, k + col, d, c, acc + col, vd, heads, vd - col);
}

// dst[i] = src[i] as float32, i < n (ATen's convert from a pointer is a scalar loop on x86).
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    auto [a, b] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(src + i));
    a.store(dst + i);
    b.store(dst + i + kLanes);
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// One thread's buffers (grown, never shrunk: a thread's tasks of one call reuse them).
struct Scratch {
  std::vector<float> qt, k, st, max, sum;
};

// One task of one row: construct (transposes the queries), `rows` for each stretch of its
// keys in order, then `finish`. Its result is the task's share of the Partial contract
// (decode_attention.h): acc [heads][vd] = sum_j e^(s_j - max) v_j[:vd], max and sum per head.
// T: q's type; C: the cache's elements, T or a packed 8-bit code (a stored row of d + 2: its
// codes, then its scale), whose chunk of rows is dequantized once and then takes the same
// arithmetic, so the result is bit for bit that of a float32 cache of kv_quant.dequantize_rows.
template <typename T, typename C = T>
struct Task {
  Scratch& w;
  int64_t heads, d, vd, hp;
  float* acc;  // [heads][vd]

  // q: the row's queries, head h's D values at q + h * q_h; scale: the softmax's.
  Task(Scratch& scratch, const T* q, int64_t q_h, float scale, int64_t heads_, int64_t d_, int64_t vd_, float* acc_)
      : w(scratch), heads(heads_), d(d_), vd(vd_), hp((heads_ + kLanes - 1) / kLanes * kLanes), acc(acc_) {
    w.qt.resize(d * hp);
    for (int64_t i = 0; i < d; ++i) {  // written in order; the padding lanes 0
      float* row = w.qt.data() + i * hp;
      for (int64_t h = 0; h < heads; ++h) row[h] = static_cast<float>(q[h * q_h + i]) * scale;
      std::fill(row + heads, row + hp, 0.0f);
    }
    w.st.resize(kChunk * hp);
    w.max.assign(hp, -std::numeric_limits<float>::infinity());
    w.sum.assign(hp, 0.0f);
    if constexpr (!std::is_same_v<C, float>) w.k.resize(kChunk * d);
    std::fill_n(acc, heads * vd, 0.0f);
  }

  // `count` key rows from `rows`, one stored row (d + kRowExtra<C> elements) apart: a block's
  // share of the task's slots.
  void rows(const C* rows, int64_t count) {
    for (int64_t i = 0; i < count; i += kChunk) chunk(rows + i * (d + kRowExtra<C>), std::min(kChunk, count - i));
  }

  void chunk(const C* rows, int64_t c) {
    const float* k;
    if constexpr (std::is_same_v<C, float>) {
      k = rows;
    } else if constexpr (kPacked<C>) {  // each row by its own scale; the scratch holds c rows of d
      for (int64_t j = 0; j < c; ++j) kv8::to_float(rows + j * (d + kRowExtra<C>), w.k.data() + j * d, d);
      k = w.k.data();
    } else {
      to_float(rows, w.k.data(), c * d);
      k = w.k.data();
    }
    float* st = w.st.data();
    chunk_scores(w.qt.data(), hp, k, d, c, st);
    softmax(st, c);
    chunk_values(st, hp, k, d, c, acc, vd, heads);
  }

  // st [c][hp] -> e^(s - max) with each head's running max raised to the chunk's; the sums and
  // the accumulators of heads whose max rose rescaled by e^(old - new).
  void softmax(float* st, int64_t c) {
    for (int64_t v = 0; v < hp; v += kLanes) {
      Vec top = Vec::loadu(st + v);
      for (int64_t j = 1; j < c; ++j) top = at::vec::maximum(top, Vec::loadu(st + j * hp + v));
      top = at::vec::maximum(top, Vec::loadu(w.max.data() + v));
      float tops[kLanes];
      top.store(tops);
      for (int64_t h = v; h < std::min(heads, v + kLanes); ++h) {
        const float old = w.max[h], now = tops[h - v];
        if (now <= old || old == -std::numeric_limits<float>::infinity()) continue;  // acc and sum still 0
        const float by = std::exp(old - now);
        w.sum[h] *= by;
        float* row = acc + h * vd;
        at::vec::map([&](Vec x) { return x * Vec(by); }, row, row, vd);
      }
      top.store(w.max.data() + v);
      Vec total = Vec::loadu(w.sum.data() + v);
      for (int64_t j = 0; j < c; ++j) {
        const Vec e = (Vec::loadu(st + j * hp + v) - top).exp_u20();
        e.store(st + j * hp + v);
        total = total + e;
      }
      total.store(w.sum.data() + v);
    }
  }

  void finish(float* max, float* sum) const {
    std::copy_n(w.max.data(), heads, max);
    std::copy_n(w.sum.data(), heads, sum);
  }
};

}  // namespace latent
}  // namespace
