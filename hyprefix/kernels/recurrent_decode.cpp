// One decode token per row through a recurrent mixer, fused: the conv window's shift and causal
// depthwise conv, the state update and readout, and the gated RMSNorm, for every row at once,
// updating the rows' live states in place. The models' eager code (models/gated_deltanet.py,
// models/mamba2.py) is the reference; this is the same arithmetic in float32 without the dozens
// of small ops and their temporaries a step made per layer.
//
// hyprefix::gdn_decode (Gated DeltaNet, Qwen3.5 / Qwen3-Next linear attention)
//   proj        [m, conv_dim + value_dim + 2 Hv]: in_proj's output per row, [q k v | z | b | a]
//   conv_state  [slots, conv_dim, K-1] (the model dtype), updated: its last K-1 conv inputs
//   conv_weight [conv_dim, 1, K]
//   matrix      [slots, Hv, Dk, Dv] float32 or bfloat16, updated: S per value head
//   slots       [m] int64: row i's live slot
//   -> [m, Hv * Dv] in proj's dtype: RMSNorm(o) * norm_weight * SiLU(z) per value head, where
//   q, k = L2-normalised SiLU(conv) (q scaled by Dk^-1/2; key head h / (Hv / Hk) serves value
//   head h), g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) and
//   S = exp(g) S + k (beta (v - exp(g) S^T k))^T,  o = S^T q.
//
// hyprefix::kda_decode (Kimi Delta Attention, Kimi-Linear's linear attention: Gated DeltaNet
// with one decay per key channel, models/kimi_delta.py)
//   proj        [m, 3 H D + 2 D + H]: in_proj's output per row, [q k v | f_a | g_a | b] (f_a and
//               g_a are not read: their second projections come as forget and gate)
//   forget      [m, H D]: f_b(f_a), the forget gate before dt_bias
//   gate        [m, H D]: g_b(g_a), the output gate
//   conv_state  [slots, 3 H D, K-1], conv_weight [3 H D, 1, K], matrix [slots, H, D, D], updated
//   -> [m, H D] in proj's dtype: RMSNorm(o) * norm_weight * sigmoid(gate) per head, where q, k are
//   as Gated DeltaNet's (one key head a value head), g = -exp(A_log[h]) softplus(forget +
//   dt_bias) per channel, beta = sigmoid(b) and S = diag(exp(g)) S + k (beta (v - (diag(exp(g))
//   S)^T k))^T,  o = S^T q.
//
// hyprefix::mamba2_decode (Mamba2: NemotronH, Bamba, Mamba2)
//   proj        [m, inner + conv_dim + H]: [z | x B C | dt]
//   conv_state  [slots, conv_dim, K-1], conv_weight [conv_dim, 1, K], conv_bias [conv_dim] or None
//   matrix      [slots, H, P, N] float32 or bfloat16, updated
//   -> [m, inner] in proj's dtype: norm_weight * RMSNorm_group(y * SiLU(z)) (groups of
//   inner / G channels), where x, B, C = SiLU(conv), dt = clamp(softplus(dt + dt_bias)),
//   S = exp(dt A) S + dt x B^T (head h reads group h / (H / G)'s B and C), y = S C + D x.
//
// Work: first each row's conv (one task a row), then each (row, head)'s state: a head's state is
// read once and written once (the delta rule's S^T k needs it before the update, so its first
// pass only reads; Gated DeltaNet and KDA share that step, delta_step), and the readout rides on
// the update. Written on ATen's vector types: one
// build per CPU capability.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

// A state row (n values) as float32: in place for a float32 state, else converted into buf.
template <typename S>
inline float* state_row(S* row, float* buf, int64_t n) {
  if constexpr (std::is_same_v<S, float>) {
    return row;
  } else {
    at::vec::convert(row, buf, n);
    return buf;
  }
}

template <typename S>
inline void store_state_row(S* row, const float* values, int64_t n) {
  if constexpr (!std::is_same_v<S, float>) at::vec::convert(values, row, n);
}

// Row i's conv over its window (state then this token's input), through SiLU, into out (float);
// shifts the token into the state. The conv's sum is rounded to the model dtype, as the eager
// code's product and sum in that dtype end.
template <typename T>
void conv_row(const T* input, T* state, const T* weight, const T* bias, int64_t channels, int64_t width,
              float* out) {
  const int64_t k = width + 1;
  for (int64_t c = 0; c < channels; ++c) {
    T* st = state + c * width;
    const T* w = weight + c * k;
    float acc = 0.0f;
    for (int64_t j = 0; j < width; ++j) acc += to_float(st[j]) * to_float(w[j]);
    acc += to_float(input[c]) * to_float(w[width]);
    if (bias != nullptr) acc = to_float(T(acc)) + to_float(bias[c]);
    out[c] = silu(to_float(T(acc)));
    for (int64_t j = 0; j + 1 < width; ++j) st[j] = st[j + 1];
    if (width > 0) st[width - 1] = input[c];
  }
}

inline float sum_squares(const float* x, int64_t n) {
  Vec acc(0.0f);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const Vec v = Vec::loadu(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float total = at::vec::vec_reduce_all([](const Vec& a, const Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

inline void scale(float* x, float s, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) (Vec::loadu(x + i) * Vec(s)).store(x + i);
  for (; i < n; ++i) x[i] *= s;
}

struct GdnShape {
  int64_t rows, k_heads, v_heads, dk, dv, width;
  int64_t key_dim() const { return k_heads * dk; }
  int64_t value_dim() const { return v_heads * dv; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
  int64_t proj_dim() const { return conv_dim() + value_dim() + 2 * v_heads; }
};

// Every row's conv (one task a row) -> [rows, conv_dim] float32: SiLU(conv) with q (scaled by
// dk^-1/2) and k L2-normalised per key head. Row r's input is proj + r * stride.
template <typename T>
std::vector<float> delta_qkv(const GdnShape& s, const T* proj, int64_t stride, T* conv_state, const T* conv_weight,
                             const int64_t* slots) {
  const int64_t cd = s.conv_dim(), kd = s.key_dim();
  std::vector<float> conv(s.rows * cd);
  at::parallel_for(0, s.rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* c = conv.data() + r * cd;
      conv_row(proj + r * stride, conv_state + slots[r] * cd * s.width, conv_weight, static_cast<const T*>(nullptr),
               cd, s.width, c);
      const float q_scale = 1.0f / std::sqrt(static_cast<float>(s.dk));
      for (int64_t h = 0; h < s.k_heads; ++h) {
        float* q = c + h * s.dk;
        float* k = c + kd + h * s.dk;
        scale(q, q_scale / std::sqrt(sum_squares(q, s.dk) + 1e-6f), s.dk);
        scale(k, 1.0f / std::sqrt(sum_squares(k, s.dk) + 1e-6f), s.dk);
      }
    }
  });
  return conv;
}

// One head's gated delta step with a decay per key channel (decay [dk]; Gated DeltaNet's is one
// value repeated): S = diag(decay) S + k delta^T with delta = beta (v - (diag(decay) S)^T k), and
// o = S^T q [dv]. The state is read once before the update (S^T k) and once for it; mem and buf
// are scratch of dv floats.
template <typename S>
void delta_step(S* state, const float* q, const float* k, const float* v, const float* decay, float beta,
                int64_t dk, int64_t dv, float* mem, float* o, float* buf) {
  std::fill(mem, mem + dv, 0.0f);
  for (int64_t i = 0; i < dk; ++i) {  // mem = (diag(decay) S)^T k
    const float* row = state_row(state + i * dv, buf, dv);
    const float w = k[i] * decay[i];
    const Vec wi(w);
    int64_t j = 0;
    for (; j + kW <= dv; j += kW) at::vec::fmadd(Vec::loadu(row + j), wi, Vec::loadu(mem + j)).store(mem + j);
    for (; j < dv; ++j) mem[j] += row[j] * w;
  }
  for (int64_t j = 0; j < dv; ++j) mem[j] = (v[j] - mem[j]) * beta;  // the delta
  std::fill(o, o + dv, 0.0f);
  for (int64_t i = 0; i < dk; ++i) {  // S = diag(decay) S + k delta^T; o = S^T q
    S* dst = state + i * dv;
    float* row = state_row(dst, buf, dv);
    const Vec ki(k[i]), qi(q[i]), dec(decay[i]);
    int64_t j = 0;
    for (; j + kW <= dv; j += kW) {
      const Vec updated = at::vec::fmadd(Vec::loadu(row + j), dec, Vec::loadu(mem + j) * ki);
      updated.store(row + j);
      at::vec::fmadd(updated, qi, Vec::loadu(o + j)).store(o + j);
    }
    for (; j < dv; ++j) {
      row[j] = row[j] * decay[i] + mem[j] * k[i];
      o[j] += row[j] * q[i];
    }
    store_state_row(dst, row, dv);
  }
}

template <typename T, typename S>
void gdn(const GdnShape& s, const T* proj, T* conv_state, const T* conv_weight, S* matrix, const int64_t* slots,
         const T* a_log, const T* dt_bias, const T* norm_weight, float eps, T* out) {
  const int64_t cd = s.conv_dim(), pd = s.proj_dim(), kd = s.key_dim(), rep = s.v_heads / s.k_heads;
  const std::vector<float> conv = delta_qkv(s, proj, pd, conv_state, conv_weight, slots);
  at::parallel_for(0, s.rows * s.v_heads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> mem(s.dv), o(s.dv), buf(s.dv), decay(s.dk);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / s.v_heads, h = t % s.v_heads;
      const T* p = proj + r * pd;
      const float* c = conv.data() + r * cd;
      const float beta = 1.0f / (1.0f + std::exp(-to_float(p[cd + s.value_dim() + h])));
      const float a = to_float(p[cd + s.value_dim() + s.v_heads + h]);
      std::fill(decay.begin(), decay.end(), std::exp(-std::exp(to_float(a_log[h])) * softplus(a + to_float(dt_bias[h]))));
      delta_step(matrix + (slots[r] * s.v_heads + h) * s.dk * s.dv, c + (h / rep) * s.dk, c + kd + (h / rep) * s.dk,
                 c + 2 * kd + h * s.dv, decay.data(), beta, s.dk, s.dv, mem.data(), o.data(), buf.data());
      const float inv = 1.0f / std::sqrt(sum_squares(o.data(), s.dv) / static_cast<float>(s.dv) + eps);
      const T* z = p + cd + h * s.dv;
      T* dst = out + r * s.value_dim() + h * s.dv;
      for (int64_t j = 0; j < s.dv; ++j) dst[j] = T(to_float(norm_weight[j]) * (o[j] * inv) * silu(to_float(z[j])));
    }
  });
}

// Kimi Delta Attention: Gated DeltaNet's shape with as many key heads as value heads, dk = dv = D.
template <typename T, typename S>
void kda(const GdnShape& s, const T* proj, T* conv_state, const T* conv_weight, S* matrix, const int64_t* slots,
         const T* forget, const T* gate, const T* a_log, const T* dt_bias, const T* norm_weight, float eps, T* out) {
  const int64_t d = s.dk, qd = s.key_dim(), cd = s.conv_dim(), pd = cd + 2 * d + s.v_heads;
  const std::vector<float> conv = delta_qkv(s, proj, pd, conv_state, conv_weight, slots);
  at::parallel_for(0, s.rows * s.v_heads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> mem(d), o(d), buf(d), decay(d);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / s.v_heads, h = t % s.v_heads;
      const float* c = conv.data() + r * cd;
      const float beta = 1.0f / (1.0f + std::exp(-to_float(proj[r * pd + cd + 2 * d + h])));
      const float a = std::exp(to_float(a_log[h]));
      const T* f = forget + r * qd + h * d;
      for (int64_t i = 0; i < d; ++i) decay[i] = std::exp(-a * softplus(to_float(f[i]) + to_float(dt_bias[h * d + i])));
      delta_step(matrix + (slots[r] * s.v_heads + h) * d * d, c + h * d, c + qd + h * d, c + 2 * qd + h * d,
                 decay.data(), beta, d, d, mem.data(), o.data(), buf.data());
      const float inv = 1.0f / std::sqrt(sum_squares(o.data(), d) / static_cast<float>(d) + eps);
      const T* g = gate + r * qd + h * d;
      T* dst = out + r * qd + h * d;
      for (int64_t j = 0; j < d; ++j)
        dst[j] = T(to_float(norm_weight[j]) * (o[j] * inv) / (1.0f + std::exp(-to_float(g[j]))));
    }
  });
}

struct MambaShape {
  int64_t rows, heads, head_dim, groups, state, width;
  int64_t inner() const { return heads * head_dim; }
  int64_t conv_dim() const { return inner() + 2 * groups * state; }
  int64_t proj_dim() const { return inner() + conv_dim() + heads; }
};

template <typename T, typename S>
void mamba(const MambaShape& s, const T* proj, T* conv_state, const T* conv_weight, const T* conv_bias, S* matrix,
           const int64_t* slots, const T* a_log, const T* dt_bias, const T* d_skip, const T* norm_weight,
           float dt_min, float dt_max, float eps, T* out) {
  const int64_t cd = s.conv_dim(), pd = s.proj_dim(), inner = s.inner(), n = s.state;
  const int64_t per_group = s.heads / s.groups;
  std::vector<float> conv(s.rows * cd), gated(s.rows * inner);
  at::parallel_for(0, s.rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      conv_row(proj + r * pd + inner, conv_state + slots[r] * cd * s.width, conv_weight, conv_bias, cd, s.width,
               conv.data() + r * cd);
  });
  at::parallel_for(0, s.rows * s.heads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(n);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / s.heads, h = t % s.heads, g = h / per_group;
      const T* p = proj + r * pd;
      const float* x = conv.data() + r * cd + h * s.head_dim;
      const float* b = conv.data() + r * cd + inner + g * n;
      const float* c = conv.data() + r * cd + inner + s.groups * n + g * n;
      const float dt = std::min(std::max(softplus(to_float(p[inner + cd + h]) + to_float(dt_bias[h])), dt_min), dt_max);
      const float decay = std::exp(-dt * std::exp(to_float(a_log[h])));
      const float skip = to_float(d_skip[h]);
      S* state = matrix + (slots[r] * s.heads + h) * s.head_dim * n;
      for (int64_t i = 0; i < s.head_dim; ++i) {  // S_i = decay S_i + dt x_i B; y_i = S_i . C
        S* dst = state + i * n;
        float* row = state_row(dst, buf.data(), n);
        const Vec dec(decay), xi(dt * x[i]);
        Vec acc(0.0f);
        int64_t j = 0;
        for (; j + kW <= n; j += kW) {
          const Vec updated = at::vec::fmadd(Vec::loadu(row + j), dec, Vec::loadu(b + j) * xi);
          updated.store(row + j);
          acc = at::vec::fmadd(updated, Vec::loadu(c + j), acc);
        }
        float y = at::vec::vec_reduce_all([](const Vec& u, const Vec& v) { return u + v; }, acc);
        for (; j < n; ++j) {
          row[j] = row[j] * decay + b[j] * dt * x[i];
          y += row[j] * c[j];
        }
        store_state_row(dst, row, n);
        const int64_t channel = h * s.head_dim + i;
        gated[r * inner + channel] = (y + skip * x[i]) * silu(to_float(p[channel]));
      }
    }
  });
  const int64_t width = inner / s.groups;
  at::parallel_for(0, s.rows * s.groups, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / s.groups, g = t % s.groups;
      const float* v = gated.data() + r * inner + g * width;
      const float inv = 1.0f / std::sqrt(sum_squares(v, width) / static_cast<float>(width) + eps);
      T* dst = out + r * inner + g * width;
      const T* w = norm_weight + g * width;
      for (int64_t j = 0; j < width; ++j) dst[j] = T(to_float(w[j]) * to_float(T(v[j] * inv)));
    }
  });
}

// The checks both ops share: proj [rows, proj_dim], the conv state and weight over conv_dim
// channels, a matrix state of matrix_per_slot values a slot, slots in range.
void check_common(const at::Tensor& proj, const at::Tensor& conv_state, const at::Tensor& conv_weight,
                  const at::Tensor& matrix, const at::Tensor& slots, int64_t proj_dim, int64_t conv_dim,
                  int64_t matrix_per_slot, const char* matrix_shape, const char* op) {
  TORCH_CHECK(proj.dim() == 2 && proj.is_contiguous(), op, ": proj must be a contiguous [rows, features] matrix");
  TORCH_CHECK(proj.size(1) == proj_dim, op, ": proj has ", proj.size(1), " features, the dims make ", proj_dim);
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.is_contiguous() && conv_state.size(1) == conv_dim &&
                  conv_state.scalar_type() == proj.scalar_type(),
              op, ": conv_state must be contiguous [slots, conv_dim, K-1] in proj's dtype");
  TORCH_CHECK(conv_weight.is_contiguous() && conv_weight.numel() == conv_dim * (conv_state.size(2) + 1) &&
                  conv_weight.scalar_type() == proj.scalar_type(),
              op, ": conv_weight must be contiguous [conv_dim, 1, K] in proj's dtype");
  TORCH_CHECK(matrix.is_contiguous() && matrix.size(0) == conv_state.size(0) &&
                  (matrix.scalar_type() == at::kFloat || matrix.scalar_type() == at::kBFloat16),
              op, ": matrix must be a contiguous float32 or bfloat16 [slots, ...] state");
  TORCH_CHECK(matrix.numel() == conv_state.size(0) * matrix_per_slot, op, ": matrix must be ", matrix_shape);
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == proj.size(0) && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(),
              op, ": slots must be int64 [rows]");
  if (slots.numel()) {
    const auto lo = slots.min().item<int64_t>(), hi = slots.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < conv_state.size(0), op, ": a slot is out of range");
  }
}

// The model dtype (proj's) and the state's dtype, as C++ types.
template <typename F>
void dispatch(const at::Tensor& proj, const at::Tensor& matrix, const char* op, F&& run) {
  auto with_state = [&](auto t) {
    if (matrix.scalar_type() == at::kFloat) {
      run(t, float{});
    } else {
      run(t, c10::BFloat16{});
    }
  };
  switch (proj.scalar_type()) {
    case at::kFloat: with_state(float{}); break;
    case at::kBFloat16: with_state(c10::BFloat16{}); break;
    case at::kHalf: with_state(c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": float32, bfloat16 or float16 inputs only");
  }
}

template <typename T>
const T* param(const at::Tensor& t, int64_t numel, const char* name, const char* op) {
  TORCH_CHECK(t.is_contiguous() && t.numel() == numel, op, ": ", name, " must hold ", numel, " contiguous values");
  return t.const_data_ptr<T>();
}

at::Tensor gdn_decode(const at::Tensor& proj, at::Tensor& conv_state, const at::Tensor& conv_weight, at::Tensor& matrix,
                      const at::Tensor& slots, const at::Tensor& a_log, const at::Tensor& dt_bias,
                      const at::Tensor& norm_weight, int64_t k_heads, int64_t v_heads, int64_t dk, int64_t dv,
                      double eps) {
  const char* op = "gdn_decode";
  GdnShape s{proj.size(0), k_heads, v_heads, dk, dv, conv_state.size(2)};
  TORCH_CHECK(k_heads > 0 && v_heads % k_heads == 0, op, ": value heads must be a multiple of key heads");
  check_common(proj, conv_state, conv_weight, matrix, slots, s.proj_dim(), s.conv_dim(), v_heads * dk * dv,
               "[slots, Hv, Dk, Dv]", op);
  at::Tensor out = at::empty({s.rows, s.value_dim()}, proj.options());
  if (s.rows == 0) return out;
  dispatch(proj, matrix, op, [&](auto t, auto st) {
    using T = decltype(t);
    using S = decltype(st);
    gdn<T, S>(s, proj.const_data_ptr<T>(), conv_state.mutable_data_ptr<T>(), conv_weight.const_data_ptr<T>(),
              matrix.mutable_data_ptr<S>(), slots.const_data_ptr<int64_t>(), param<T>(a_log, v_heads, "A_log", op),
              param<T>(dt_bias, v_heads, "dt_bias", op), param<T>(norm_weight, dv, "norm_weight", op),
              static_cast<float>(eps), out.mutable_data_ptr<T>());
  });
  return out;
}

at::Tensor kda_decode(const at::Tensor& proj, at::Tensor& conv_state, const at::Tensor& conv_weight, at::Tensor& matrix,
                      const at::Tensor& slots, const at::Tensor& forget, const at::Tensor& gate,
                      const at::Tensor& a_log, const at::Tensor& dt_bias, const at::Tensor& norm_weight, int64_t heads,
                      int64_t head_dim, double eps) {
  const char* op = "kda_decode";
  GdnShape s{proj.size(0), heads, heads, head_dim, head_dim, conv_state.size(2)};
  const int64_t qd = s.key_dim();
  check_common(proj, conv_state, conv_weight, matrix, slots, s.conv_dim() + 2 * head_dim + heads, s.conv_dim(),
               heads * head_dim * head_dim, "[slots, H, D, D]", op);
  for (const at::Tensor* t : {&forget, &gate})
    TORCH_CHECK(t->dim() == 2 && t->is_contiguous() && t->size(0) == s.rows && t->size(1) == qd &&
                    t->scalar_type() == proj.scalar_type(),
                op, ": forget and gate must be contiguous [rows, heads * head_dim] in proj's dtype");
  at::Tensor out = at::empty({s.rows, qd}, proj.options());
  if (s.rows == 0) return out;
  dispatch(proj, matrix, op, [&](auto t, auto st) {
    using T = decltype(t);
    using S = decltype(st);
    kda<T, S>(s, proj.const_data_ptr<T>(), conv_state.mutable_data_ptr<T>(), conv_weight.const_data_ptr<T>(),
              matrix.mutable_data_ptr<S>(), slots.const_data_ptr<int64_t>(), forget.const_data_ptr<T>(),
              gate.const_data_ptr<T>(), param<T>(a_log, heads, "A_log", op), param<T>(dt_bias, qd, "dt_bias", op),
              param<T>(norm_weight, head_dim, "norm_weight", op), static_cast<float>(eps), out.mutable_data_ptr<T>());
  });
  return out;
}

at::Tensor mamba2_decode(const at::Tensor& proj, at::Tensor& conv_state, const at::Tensor& conv_weight,
                         const std::optional<at::Tensor>& conv_bias, at::Tensor& matrix, const at::Tensor& slots,
                         const at::Tensor& a_log, const at::Tensor& dt_bias, const at::Tensor& d_skip,
                         const at::Tensor& norm_weight, int64_t heads, int64_t head_dim, int64_t groups, int64_t state,
                         double dt_min, double dt_max, double eps) {
  const char* op = "mamba2_decode";
  MambaShape s{proj.size(0), heads, head_dim, groups, state, conv_state.size(2)};
  TORCH_CHECK(groups > 0 && heads % groups == 0, op, ": heads must be a multiple of groups");
  check_common(proj, conv_state, conv_weight, matrix, slots, s.proj_dim(), s.conv_dim(), heads * head_dim * state,
               "[slots, H, P, N]", op);
  at::Tensor out = at::empty({s.rows, s.inner()}, proj.options());
  if (s.rows == 0) return out;
  dispatch(proj, matrix, op, [&](auto t, auto st) {
    using T = decltype(t);
    using S = decltype(st);
    const T* bias = conv_bias.has_value() ? param<T>(*conv_bias, s.conv_dim(), "conv_bias", op) : nullptr;
    mamba<T, S>(s, proj.const_data_ptr<T>(), conv_state.mutable_data_ptr<T>(), conv_weight.const_data_ptr<T>(), bias,
                matrix.mutable_data_ptr<S>(), slots.const_data_ptr<int64_t>(), param<T>(a_log, heads, "A_log", op),
                param<T>(dt_bias, heads, "dt_bias", op), param<T>(d_skip, heads, "D", op),
                param<T>(norm_weight, s.inner(), "norm_weight", op), static_cast<float>(dt_min),
                static_cast<float>(dt_max), static_cast<float>(eps), out.mutable_data_ptr<T>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hyprefix, m) {
  m.def("gdn_decode(Tensor proj, Tensor(a!) conv_state, Tensor conv_weight, Tensor(b!) matrix, Tensor slots, "
        "Tensor A_log, Tensor dt_bias, Tensor norm_weight, int k_heads, int v_heads, int k_dim, int v_dim, "
        "float eps) -> Tensor");
  m.def("kda_decode(Tensor proj, Tensor(a!) conv_state, Tensor conv_weight, Tensor(b!) matrix, Tensor slots, "
        "Tensor forget, Tensor gate, Tensor A_log, Tensor dt_bias, Tensor norm_weight, int heads, int head_dim, "
        "float eps) -> Tensor");
  m.def("mamba2_decode(Tensor proj, Tensor(a!) conv_state, Tensor conv_weight, Tensor? conv_bias, "
        "Tensor(b!) matrix, Tensor slots, Tensor A_log, Tensor dt_bias, Tensor D, Tensor norm_weight, int heads, "
        "int head_dim, int groups, int state, float dt_min, float dt_max, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(hyprefix, CPU, m) {
  m.impl("gdn_decode", &gdn_decode);
  m.impl("kda_decode", &kda_decode);
  m.impl("mamba2_decode", &mamba2_decode);
}
