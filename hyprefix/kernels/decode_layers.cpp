// hyprefix::decode_layers: every layer of a Llama-style decoder over decode rows (one token each)
// with int8 weights, in one call and one parallel region. Per layer, with res the residual
// stream (the embeddings x before the first layer):
//
//   res += out (the previous layer's);  h = rms_norm(res) * input_norm
//   q, k, v = split(h @ qkv^T + qkv_bias);  QK-norm per head (where given), rotate-half RoPE on
//   the first rotary_dim channels;  k, v written to the layer's paged caches at slot_mapping
//   a = attention of q over each row's K/V through its block table (decode_attention.h)
//   res += a @ o^T + o_bias;  h = rms_norm(res) * post_norm
//   gate, up = split(h @ gate_up^T + gate_up_bias);  out = (silu(gate) * up) @ down^T + down_bias
//
// and it returns out + res of the last layer. That is the arithmetic, in the same float32 order,
// of the layers run op by op (models/llama.py with the int8 kernel of int8_tiles.h and the
// attention of decode_attention.h), so the results agree to float32 rounding. What it saves
// is the time between those ops: a batch-1 decode step of a small model is ~150 kernel calls,
// and each call's dispatch, allocation and thread wake-up left the memory idle (SmolLM2-135M
// Q8_0 on a 2-core Zen 4: the worker thread spun 45 % of the step; one call a layer still left
// ~10 us between calls). Here the threads stay in one region: each matmul's 16-row tiles are
// split evenly among them (chunks taken from a shared counter measured 1.02-1.13x slower),
// attention tasks go to whichever thread is free, and the small steps between (norms, RoPE, the
// K/V write, SiLU, the activations' int8 quantization) run on thread 0 while the others wait at
// a barrier.
//
// float32 activations and caches only; the caller checks what this takes (decode_layers.py).
#include "decode_attention.h"
#include "int8_tiles.h"

#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <atomic>
#include <optional>

namespace {

struct Int8Matrix {  // a weight of int8_tiles.h: rows n, columns k
  const uint8_t* tiles;
  const void* scales;
  bool per_group;
  const float* bias;  // or nullptr
  int64_t n, k;
};

Int8Matrix matrix(const at::Tensor& tiles, const at::Tensor& scales, const at::Tensor* bias, int64_t n,
                  const char* name) {
  const bool per_group = check_tiles(tiles, scales, n, "decode_layers");
  TORCH_CHECK(tiles.is_contiguous() && scales.is_contiguous(), "decode_layers: ", name,
              " tiles and scales must be contiguous");
  const float* b = nullptr;
  if (bias != nullptr) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "decode_layers: ", name, " bias must be float32 [", n, "]");
    b = bias->const_data_ptr<float>();
  }
  return {tiles.const_data_ptr<uint8_t>(), scales.const_data_ptr(), per_group, b, n, tiles.size(1) * 4};
}

// This thread's share of the tiles of w times q's rows, into out [rows, w.n] (plus the bias).
void matmul_share(const Int8Matrix& w, const GroupedActivations& q, int64_t rows, float* out, int tid, int threads) {
  const int64_t tiles = (w.n + 15) / 16;
  const int64_t t0 = tiles * tid / threads, t1 = tiles * (tid + 1) / threads;
  if (t0 >= t1) return;
  if (w.per_group) {
    tile_span<true>(q, w.tiles, static_cast<const uint16_t*>(w.scales), rows, w.n, w.k, out, t0, t1);
  } else {
    tile_span<false>(q, w.tiles, static_cast<const float*>(w.scales), rows, w.n, w.k, out, t0, t1);
  }
  if (w.bias == nullptr) return;
  const int64_t c0 = t0 * 16, c1 = std::min(t1 * 16, w.n);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = c0; c < c1; ++c) out[r * w.n + c] += w.bias[c];
}

// dst = weight * (src * rsqrt(mean(src^2) + eps)) over n values, as models/fused.py's rms_norm.
void rms_norm(const float* src, const float* weight, float eps, int64_t n, float* dst) {
  const float ss = at::vec::map_reduce_all<float>([](Vec x) { return x * x; },
                                                  [](Vec a, Vec b) { return a + b; }, src, n);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  at::vec::map2([&](Vec x, Vec w) { return w * (x * Vec(r)); }, dst, src, weight, n);
}

void quantize_rows(const float* x, int64_t rows, int64_t k, GroupedActivations& q) {
  size_for(q, rows, k);
  quantize_span(x, 0, rows * (k / kGroup), q);
}

// Every row's norm of res [rows, n], quantized into q for the next matmul; h: scratch.
void norm_rows(const float* res, const float* weight, float eps, int64_t rows, int64_t n, float* h,
               GroupedActivations& q) {
  for (int64_t r = 0; r < rows; ++r) rms_norm(res + r * n, weight, eps, n, h + r * n);
  quantize_rows(h, rows, n, q);
}

struct Layer {
  const float *input_norm, *qk_norm, *post_norm;  // qk_norm: nullptr where none
  Int8Matrix qkv, o, gate_up, down;
  float *k_cache, *v_cache;
  size_t plan;  // which of the step's attention plans (one per distinct window)
};

// Buffers of the calling thread, kept between calls (no allocation a step but the result).
struct StepScratch {
  std::vector<float> res, out, h, qkv, attn, gate_up, act;
  GroupedActivations q;
};

const at::Tensor* optional_at(const std::vector<at::Tensor>& list, size_t i, size_t layers, const char* name) {
  TORCH_CHECK(list.empty() || list.size() == layers, "decode_layers: ", name, " must be empty or one a layer");
  return list.empty() ? nullptr : &list[i];
}

at::Tensor decode_layers(
    const at::Tensor& x, const std::vector<at::Tensor>& input_norms, const std::vector<at::Tensor>& qkv_tiles,
    const std::vector<at::Tensor>& qkv_scales, const std::vector<at::Tensor>& qkv_biases,
    const std::vector<at::Tensor>& qk_norms, const at::Tensor& cos, const at::Tensor& sin,
    const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
    const at::Tensor& slot_mapping, const at::Tensor& tables, const at::Tensor& context_lens,
    const std::vector<at::Tensor>& o_tiles, const std::vector<at::Tensor>& o_scales,
    const std::vector<at::Tensor>& o_biases, const std::vector<at::Tensor>& post_norms,
    const std::vector<at::Tensor>& gate_up_tiles, const std::vector<at::Tensor>& gate_up_scales,
    const std::vector<at::Tensor>& gate_up_biases, const std::vector<at::Tensor>& down_tiles,
    const std::vector<at::Tensor>& down_scales, const std::vector<at::Tensor>& down_biases, int64_t num_heads,
    int64_t rotary_dim, at::IntArrayRef windows, double norm_eps, double qk_norm_eps, double scale) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "decode_layers: x must be contiguous float32 [rows, hidden] on CPU");
  const size_t num_layers = input_norms.size();
  for (const auto* list : {&qkv_tiles, &qkv_scales, &k_caches, &v_caches, &o_tiles, &o_scales, &post_norms,
                           &gate_up_tiles, &gate_up_scales, &down_tiles, &down_scales}) {
    TORCH_CHECK(list->size() == num_layers, "decode_layers: every weight list must hold one a layer");
  }
  TORCH_CHECK(num_layers > 0 && windows.size() == num_layers, "decode_layers: one window a layer (0: none)");
  const int64_t rows = x.size(0), hidden = x.size(1);
  const at::Tensor& cache0 = k_caches[0];
  TORCH_CHECK(cache0.dim() == 4, "decode_layers: the caches must be [blocks, block_size, kv_heads, dim]");
  const int64_t kv_heads = cache0.size(2), dim = cache0.size(3);
  TORCH_CHECK(num_heads % kv_heads == 0, "decode_layers: ", num_heads, " heads over ", kv_heads, " KV heads");
  const int64_t q_size = num_heads * dim, kv_size = kv_heads * dim, qkv_n = q_size + 2 * kv_size;
  const int64_t intermediate = down_tiles[0].size(1) * 4;
  auto check_vector = [&](const at::Tensor& t, int64_t n, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n,
                "decode_layers: ", name, " must be contiguous float32 of ", n, " values");
  };
  const int64_t half = rotary_dim / 2;
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= dim, "decode_layers: rotary_dim ", rotary_dim, " for dim ", dim);
  check_vector(cos, rows * half, "cos");
  check_vector(sin, rows * half, "sin");
  auto check_index = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.numel() == rows,
                "decode_layers: ", name, " must be contiguous int64 [rows]");
  };
  check_index(slot_mapping, "slot_mapping");
  check_index(context_lens, "context_lens");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == rows && tables.stride(1) == 1 && tables.scalar_type() == at::kLong,
              "decode_layers: tables must be int64 [rows, width] with contiguous rows");

  const int threads_wanted = static_cast<int>(std::max<int64_t>(1, at::get_num_threads()));
  std::vector<DecodeWork<float>> plans;  // one per distinct window
  std::vector<Layer> layers(num_layers);
  for (size_t i = 0; i < num_layers; ++i) {
    const at::Tensor &kc = k_caches[i], &vc = v_caches[i];
    TORCH_CHECK(kc.sizes() == cache0.sizes() && vc.sizes() == cache0.sizes() && kc.is_contiguous() &&
                    vc.is_contiguous() && kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat,
                "decode_layers: every cache must be contiguous float32 of the first one's shape");
    check_vector(input_norms[i], hidden, "input_norm");
    check_vector(post_norms[i], hidden, "post_norm");
    const at::Tensor* qk_norm = optional_at(qk_norms, i, num_layers, "qk_norms");
    if (qk_norm != nullptr) check_vector(*qk_norm, (num_heads + kv_heads) * dim, "qk_norm");
    Layer& l = layers[i];
    l.input_norm = input_norms[i].const_data_ptr<float>();
    l.post_norm = post_norms[i].const_data_ptr<float>();
    l.qk_norm = qk_norm ? qk_norm->const_data_ptr<float>() : nullptr;
    l.qkv = matrix(qkv_tiles[i], qkv_scales[i], optional_at(qkv_biases, i, num_layers, "qkv_biases"), qkv_n, "qkv");
    l.o = matrix(o_tiles[i], o_scales[i], optional_at(o_biases, i, num_layers, "o_biases"), hidden, "o_proj");
    l.gate_up = matrix(gate_up_tiles[i], gate_up_scales[i], optional_at(gate_up_biases, i, num_layers, "gate_up_biases"),
                       2 * intermediate, "gate_up");
    l.down = matrix(down_tiles[i], down_scales[i], optional_at(down_biases, i, num_layers, "down_biases"), hidden,
                    "down");
    TORCH_CHECK(l.qkv.k == hidden && l.o.k == q_size && l.gate_up.k == hidden && l.down.k == intermediate,
                "decode_layers: layer ", i, "'s weights do not fit hidden ", hidden, ", ", num_heads, " x ", dim);
    l.k_cache = kc.mutable_data_ptr<float>();
    l.v_cache = vc.mutable_data_ptr<float>();
    l.plan = std::find_if(plans.begin(), plans.end(), [&](const auto& p) { return p.s.window == windows[i]; }) -
             plans.begin();
    if (l.plan == plans.size()) {
      const Shape shape{rows, num_heads, dim, kv_heads, num_heads / kv_heads, cache0.size(1), tables.size(1),
                        qkv_n, dim, tables.stride(0), windows[i], static_cast<float>(scale)};
      plans.emplace_back(shape, nullptr, nullptr, nullptr, tables.const_data_ptr<int64_t>(),
                         context_lens.const_data_ptr<int64_t>(), nullptr, threads_wanted);
    }
  }

  at::Tensor result = at::empty({rows, hidden}, x.options());
  if (rows == 0) return result;
  static thread_local StepScratch scratch;
  StepScratch& w = scratch;  // the caller's, shared by the region's threads (each has its own thread_local)
  w.res.assign(x.const_data_ptr<float>(), x.const_data_ptr<float>() + rows * hidden);
  w.out.assign(rows * hidden, 0.0f);
  w.h.resize(rows * hidden);
  w.qkv.resize(rows * qkv_n);
  w.attn.resize(rows * q_size);
  w.gate_up.resize(rows * 2 * intermediate);
  w.act.resize(rows * intermediate);
  const float *cos_p = cos.const_data_ptr<float>(), *sin_p = sin.const_data_ptr<float>();
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  float *res = w.res.data(), *out = w.out.data();
  std::atomic<int64_t> next{0};  // the attention's next task

#pragma omp parallel num_threads(threads_wanted)
  {
    const int tid = omp_get_thread_num(), threads = omp_get_num_threads();
    for (size_t i = 0; i < num_layers; ++i) {
      const Layer& l = layers[i];
      DecodeWork<float>& attention = plans[l.plan];
      if (tid == 0) {
        if (i > 0)
          for (int64_t j = 0; j < rows * hidden; ++j) res[j] += out[j];
        norm_rows(res, l.input_norm, norm_eps, rows, hidden, w.h.data(), w.q);
      }
#pragma omp barrier
      matmul_share(l.qkv, w.q, rows, w.qkv.data(), tid, threads);
#pragma omp barrier
      if (tid == 0) {  // QK-norm, RoPE, the K/V write; the attention pointed at this layer
        for (int64_t r = 0; r < rows; ++r) {
          float* row = w.qkv.data() + r * qkv_n;
          const float *c = cos_p + r * half, *s = sin_p + r * half;
          for (int64_t head = 0; head < num_heads + kv_heads; ++head) {
            float* v = row + head * dim;
            if (l.qk_norm != nullptr) rms_norm(v, l.qk_norm + head * dim, qk_norm_eps, dim, v);
            for (int64_t j = 0; j < half; ++j) {
              const float x1 = v[j], x2 = v[j + half];
              v[j] = x1 * c[j] - x2 * s[j];
              v[j + half] = x2 * c[j] + x1 * s[j];
            }
          }
          std::copy_n(row + q_size, kv_size, l.k_cache + slots[r] * kv_size);
          std::copy_n(row + q_size + kv_size, kv_size, l.v_cache + slots[r] * kv_size);
        }
        attention.q = w.qkv.data();
        attention.k_cache = l.k_cache;
        attention.v_cache = l.v_cache;
        next = 0;
      }
#pragma omp barrier
      if (!attention.serial || tid == 0) {
        Scratch buffers;
        for (int64_t t = next.fetch_add(1); t < attention.tasks; t = next.fetch_add(1)) attention.task(t, buffers);
      }
#pragma omp barrier
      if (tid == 0) {  // the heads merged, quantized for o_proj
        float lse;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t head = 0; head < num_heads; ++head)
            attention.merge(r, head, w.attn.data() + (r * num_heads + head) * dim, &lse, w.h.data());
        quantize_rows(w.attn.data(), rows, q_size, w.q);
      }
#pragma omp barrier
      matmul_share(l.o, w.q, rows, out, tid, threads);
#pragma omp barrier
      if (tid == 0) {  // res += o; its norm, quantized for gate_up
        for (int64_t j = 0; j < rows * hidden; ++j) res[j] += out[j];
        norm_rows(res, l.post_norm, norm_eps, rows, hidden, w.h.data(), w.q);
      }
#pragma omp barrier
      matmul_share(l.gate_up, w.q, rows, w.gate_up.data(), tid, threads);
#pragma omp barrier
      if (tid == 0) {  // silu(gate) * up, quantized for down
        for (int64_t r = 0; r < rows; ++r) {
          const float* g = w.gate_up.data() + r * 2 * intermediate;
          at::vec::map2([](Vec gate, Vec up) { return gate / (Vec(1.0f) + gate.neg().exp()) * up; },
                        w.act.data() + r * intermediate, g, g + intermediate, intermediate);
        }
        quantize_rows(w.act.data(), rows, intermediate, w.q);
      }
#pragma omp barrier
      matmul_share(l.down, w.q, rows, out, tid, threads);
#pragma omp barrier
    }
  }
  float* dst = result.mutable_data_ptr<float>();
  for (int64_t j = 0; j < rows * hidden; ++j) dst[j] = out[j] + res[j];
  return result;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hyprefix, m) {
  m.def("decode_layers(Tensor x, Tensor[] input_norms, Tensor[] qkv_tiles, Tensor[] qkv_scales, "
        "Tensor[] qkv_biases, Tensor[] qk_norms, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor slot_mapping, Tensor tables, Tensor context_lens, Tensor[] o_tiles, "
        "Tensor[] o_scales, Tensor[] o_biases, Tensor[] post_norms, Tensor[] gate_up_tiles, "
        "Tensor[] gate_up_scales, Tensor[] gate_up_biases, Tensor[] down_tiles, Tensor[] down_scales, "
        "Tensor[] down_biases, int num_heads, int rotary_dim, int[] windows, float norm_eps, float qk_norm_eps, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(hyprefix, CPU, m) { m.impl("decode_layers", &decode_layers); }
