// The batch-invariant mode's matmul and gated activation (EngineArgs.batch_invariant): ops whose
// result for one row is the same bits whatever the other rows of the call are, how many there
// are, and how many threads run it. Written on ATen's vector types: one build per CPU capability
// (the reduction order is fixed per build, so invariance holds per machine and ISA).
//
// hyprefix::invariant_linear(x [.., K], w [N, K], bias [N] or None) -> [.., N] in x's dtype:
//   y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]). x and w are float32, bfloat16 or float16 (the
//   same dtype); both are read as float32 and every product is accumulated in float32. Each
//   output has one vector accumulator: K is walked in chunks of two float vectors (zero-padded
//   at the end), each chunk adds its low then its high vector of products by a fused multiply-add,
//   and the accumulator's lanes are summed by at::vec's fixed tree; the bias is added after, then
//   one rounding to x's dtype. That sequence depends on K only. Threads split the rows and
//   columns (tasks of whole output blocks), never K; register blocking (up to kRows rows times
//   kCols columns share each load) changes which outputs are computed together, not any
//   output's operations.
//
// hyprefix::invariant_gated_act(gate_up [.., 2I], activation) -> [.., I]: act(gate) * up in
//   float32 with one rounding to the input's dtype, activation 0 = SiLU, 1 = tanh-GELU. Every
//   element goes through the same vector code (a row's tail is a zero-padded partial vector),
//   where torch's elementwise kernels compute a run's leftover elements with scalar code whose
//   exp differs in the last bit, and the runs follow the split of the whole tensor over threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
constexpr int64_t kChunk = 2 * kVec;  // K per step of an accumulator: two float vectors
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kRows = 4, kCols = 4;  // 16 accumulators and a chunk of 4 columns in 32 registers
#else
constexpr int kRows = 2, kCols = 4;  // 8 accumulators in 16 registers
#endif
// Output block of one task: rows x columns. A block's x rows (as float) stay in L1/L2 while its
// columns' weights stream through.
constexpr int64_t kBlockRows = 64;
constexpr int64_t kMaxBlockCols = 64;
// A call of fewer multiply-adds runs on the calling thread: waking the others costs more.
constexpr int64_t kSerialMacs = 1 << 16;

// The chunk of `count` (<= kChunk) values at p as two float vectors, zeros past count.
template <typename T>
inline void load_chunk(const T* p, int64_t count, Vec& lo, Vec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    if (count == kChunk) {
      lo = Vec::loadu(p);
      hi = Vec::loadu(p + kVec);
    } else {
      lo = Vec::loadu(p, std::min(count, kVec));
      hi = count > kVec ? Vec::loadu(p + kVec, count - kVec) : Vec(0.0f);
    }
  } else {
    using RVec = at::vec::Vectorized<T>;  // kChunk reduced-precision lanes
    static_assert(RVec::size() == kChunk);
    auto [a, b] = at::vec::convert_to_float<T>(count == kChunk ? RVec::loadu(p) : RVec::loadu(p, count));
    lo = a;
    hi = b;
  }
}

// acc[r][c] += chunk k0 (count values; zeros past them) of row r of xs times weight row c: its low
// vector of products, then its high one. kAhead: also prefetch the same chunk of the weight rows
// kCols further on (the next group's, which follow these in memory), for a decode step, which
// reads each weight once from memory in several short streams at a time.
template <int MR, int NC, bool kFull, bool kAhead, typename W>
__attribute__((always_inline)) inline void chunk(Vec (&acc)[MR][NC], const float* xs, int64_t ldx, const W* w,
                                                 int64_t ldw, int64_t k0, int64_t count) {
  Vec lo[NC], hi[NC];
  _Pragma("GCC unroll 16") for (int c = 0; c < NC; ++c) {
    if constexpr (kAhead) {
      const char* ahead = reinterpret_cast<const char*>(w + (c + kCols) * ldw + k0);
      _Pragma("GCC unroll 4") for (int64_t b = 0; b < kChunk * static_cast<int64_t>(sizeof(W)); b += 64)
        __builtin_prefetch(ahead + b, 0, 3);
    }
    load_chunk(w + c * ldw + k0, kFull ? kChunk : count, lo[c], hi[c]);
  }
  _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r) {
    const Vec x = Vec::loadu(xs + r * ldx + k0);
    _Pragma("GCC unroll 16") for (int c = 0; c < NC; ++c) acc[r][c] = at::vec::fmadd(x, lo[c], acc[r][c]);
  }
  _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r) {
    const Vec x = Vec::loadu(xs + r * ldx + k0 + kVec);
    _Pragma("GCC unroll 16") for (int c = 0; c < NC; ++c) acc[r][c] = at::vec::fmadd(x, hi[c], acc[r][c]);
  }
}

// out[r * ldo + c] = the sums of MR rows of xs (float, zero-padded to a whole chunk, ldx apart)
// times NC weight rows (ldw apart), K values each: the whole chunks, then the partial one (the
// same operations as a whole chunk on zeros; the split only keeps a test out of the loop, whose
// code the compiler laid out far slower with it).
template <int MR, int NC, bool kAhead, typename W>
inline void tile(const float* xs, int64_t ldx, const W* w, int64_t ldw, int64_t k, float* out, int64_t ldo) {
  Vec acc[MR][NC];
  _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r)
    _Pragma("GCC unroll 16") for (int c = 0; c < NC; ++c) acc[r][c] = Vec(0.0f);
  int64_t k0 = 0;
  for (; k0 + kChunk <= k; k0 += kChunk) chunk<MR, NC, true, kAhead>(acc, xs, ldx, w, ldw, k0, kChunk);
  if (k0 < k) chunk<MR, NC, false, false>(acc, xs, ldx, w, ldw, k0, k - k0);
  _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r)
    _Pragma("GCC unroll 16") for (int c = 0; c < NC; ++c)
      out[r * ldo + c] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[r][c]);
}

template <int MR, bool kAhead, typename W>
inline void tile_cols(int nc, const float* xs, int64_t ldx, const W* w, int64_t ldw, int64_t k, float* out,
                      int64_t ldo) {
  switch (nc) {
    case 1: tile<MR, 1, kAhead>(xs, ldx, w, ldw, k, out, ldo); break;
    case 2: tile<MR, 2, kAhead>(xs, ldx, w, ldw, k, out, ldo); break;
    case 3: tile<MR, 3, kAhead>(xs, ldx, w, ldw, k, out, ldo); break;
    default: tile<MR, kCols, kAhead>(xs, ldx, w, ldw, k, out, ldo); break;
  }
}

// One register tile of mr (<= kRows) rows and nc (<= kCols) columns.
template <bool kAhead, typename W>
inline void tile_any(int mr, int nc, const float* xs, int64_t ldx, const W* w, int64_t ldw, int64_t k, float* out,
                     int64_t ldo) {
  static_assert(kRows == 2 || kRows == 4);
  switch (mr) {
    case 1: tile_cols<1, kAhead>(nc, xs, ldx, w, ldw, k, out, ldo); break;
    case 2: tile_cols<2, kAhead>(nc, xs, ldx, w, ldw, k, out, ldo); break;
#if defined(CPU_CAPABILITY_AVX512)
    case 3: tile_cols<3, kAhead>(nc, xs, ldx, w, ldw, k, out, ldo); break;
    default: tile_cols<4, kAhead>(nc, xs, ldx, w, ldw, k, out, ldo); break;
#else
    default: tile_cols<2, kAhead>(nc, xs, ldx, w, ldw, k, out, ldo); break;
#endif
  }
}

// The call's outputs in tasks of whole blocks, each task's rows of x as float (zero-padded to
// whole chunks) in a buffer of its thread.
template <typename T>
void linear(const T* x, const T* w, const T* bias, T* y, int64_t m, int64_t n, int64_t k) {
  const int64_t kp = (k + kChunk - 1) / kChunk * kChunk;  // a row of xs, zero-padded to whole chunks
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t row_blocks = (m + kBlockRows - 1) / kBlockRows;
  // Columns per task: enough tasks for every thread where the call is small (a decode step),
  // whole kCols groups, at most kMaxBlockCols. Only who computes an output depends on this.
  const int64_t want = (n + kCols - 1) / kCols;
  const int64_t per_task = std::max<int64_t>(1, (want * row_blocks + 4 * threads - 1) / (4 * threads));
  const int64_t block_cols = std::min<int64_t>(kMaxBlockCols, std::min(want, per_task) * kCols);
  const int64_t col_blocks = (n + block_cols - 1) / block_cols;
  const int64_t tasks = row_blocks * col_blocks;
  // The loop order and the columns per register tile: a decode step's few rows read each weight
  // once from memory (one row of the weight at a time where there are fewer rows than a tile:
  // one stream, which the hardware prefetches best); a prefill's many rows reuse each block.
  const bool few_rows = m <= 2 * kRows;
  const int64_t cols = m < kRows ? 1 : kCols;
  const bool ahead = few_rows && cols > 1;
  at::parallel_for(0, tasks, m * n * k < kSerialMacs ? tasks : 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> xs(std::min(m, kBlockRows) * kp, 0.0f);
    float part[kRows * kCols];
    int64_t converted = -1;  // the row block whose rows xs holds
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t rb = t / col_blocks, cb = t % col_blocks;
      const int64_t r0 = rb * kBlockRows, r1 = std::min(m, r0 + kBlockRows);
      const int64_t c0 = cb * block_cols, c1 = std::min(n, c0 + block_cols);
      if (converted != rb) {
        for (int64_t r = r0; r < r1; ++r) {
          float* dst = xs.data() + (r - r0) * kp;
          if constexpr (std::is_same_v<T, float>) {
            std::copy_n(x + r * k, k, dst);
          } else {
            at::vec::convert(x + r * k, dst, k);
          }
        }
        converted = rb;
      }
      const auto one = [&](int64_t r, int64_t c) {
        const int mr = static_cast<int>(std::min<int64_t>(kRows, r1 - r));
        const int nc = static_cast<int>(std::min<int64_t>(cols, c1 - c));
        if (ahead) {
          tile_any<true>(mr, nc, xs.data() + (r - r0) * kp, kp, w + c * k, k, k, part, kCols);
        } else {
          tile_any<false>(mr, nc, xs.data() + (r - r0) * kp, kp, w + c * k, k, k, part, kCols);
        }
        for (int i = 0; i < mr; ++i)
          for (int j = 0; j < nc; ++j) {
            float v = part[i * kCols + j];
            if (bias != nullptr) v += static_cast<float>(bias[c + j]);
            y[(r + i) * n + c + j] = static_cast<T>(v);
          }
      };
      if (few_rows) {  // each weight group read from memory once, for every row while it is in L1
        for (int64_t c = c0; c < c1; c += cols)
          for (int64_t r = r0; r < r1; r += kRows) one(r, c);
      } else {  // each group of rows kept in L1 while the block's weights come from L2
        for (int64_t r = r0; r < r1; r += kRows)
          for (int64_t c = c0; c < c1; c += cols) one(r, c);
      }
    }
  });
}

// run(T{}) for the element type T of a float32, bfloat16 or float16 tensor; other types: an error.
template <typename F>
void by_float_type(at::ScalarType type, const char* op, F&& run) {
  switch (type) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": float32, bfloat16 or float16 only");
  }
}

at::Tensor invariant_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "invariant_linear: CPU tensors only");
  TORCH_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1),
              "invariant_linear: x [.., K] times weight [N, K]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "invariant_linear: x and weight must share a dtype");
  const int64_t n = weight.size(0), k = weight.size(1);
  at::Tensor xc = x.contiguous(), wc = weight.contiguous(), bc;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == x.scalar_type(),
                "invariant_linear: bias must be [N] in x's dtype");
    bc = bias->contiguous();
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  if (out.numel() == 0) return out;
  if (k == 0) {
    out.zero_();
    return bc.defined() ? out.add_(bc) : out;
  }
  const int64_t m = out.numel() / n;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* b = bc.defined() ? bc.const_data_ptr<T>() : nullptr;
    linear<T>(xc.const_data_ptr<T>(), wc.const_data_ptr<T>(), b, out.mutable_data_ptr<T>(), m, n, k);
  };
  by_float_type(x.scalar_type(), "invariant_linear", run);
  return out;
}

inline Vec gated(Vec g, Vec u, int64_t activation) {
  const Vec one(1.0f), half(0.5f);
  if (activation == 0) return g / (one + g.neg().exp()) * u;
  const Vec inner = Vec(0.7978845608028654f) * at::vec::fmadd(Vec(0.044715f) * g * g, g, g);
  return half * g * (one + inner.tanh()) * u;
}

template <typename T>
inline void load_floats(const T* p, int64_t count, Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    v = count == kVec ? Vec::loadu(p) : Vec::loadu(p, count);
  } else {
    float tmp[kVec] = {};
    at::vec::convert(p, tmp, count);
    v = Vec::loadu(tmp);
  }
}

template <typename T>
void gated_rows(const T* in, T* out, int64_t rows, int64_t inter, int64_t activation) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, inter)), [&](int64_t r0, int64_t r1) {
    float res[kVec];
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = in + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      for (int64_t i = 0; i < inter; i += kVec) {
        const int64_t count = std::min(kVec, inter - i);
        Vec gv, uv;
        load_floats(g + i, count, gv);
        load_floats(u + i, count, uv);
        gated(gv, uv, activation).store(res);
        if constexpr (std::is_same_v<T, float>) {
          std::copy_n(res, count, o + i);
        } else {
          at::vec::convert(res, o + i, count);
        }
      }
    }
  });
}

at::Tensor invariant_gated_act(const at::Tensor& gate_up, int64_t activation) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "invariant_gated_act: gate_up [.., 2I] on CPU");
  TORCH_CHECK(activation == 0 || activation == 1, "invariant_gated_act: activation 0 (SiLU) or 1 (tanh-GELU)");
  const int64_t inter = gate_up.size(-1) / 2;
  at::Tensor in = gate_up.contiguous();
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = inter;
  at::Tensor out = at::empty(shape, gate_up.options());
  if (out.numel() == 0) return out;
  const int64_t rows = out.numel() / inter;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    gated_rows<T>(in.const_data_ptr<T>(), out.mutable_data_ptr<T>(), rows, inter, activation);
  };
  by_float_type(gate_up.scalar_type(), "invariant_gated_act", run);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hyprefix, m) {
  m.def("invariant_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("invariant_gated_act(Tensor gate_up, int activation) -> Tensor");
}

TORCH_LIBRARY_IMPL(hyprefix, CPU, m) {
  m.impl("invariant_linear", &invariant_linear);
  m.impl("invariant_gated_act", &invariant_gated_act);
}
