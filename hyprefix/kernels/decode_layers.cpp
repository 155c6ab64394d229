// hyprefix::DecodeModel: a decoder of pre-norm attention + gated-MLP layers (the layout of Llama,
// Mistral, Qwen2/3, SmolLM3, Granite and Phi-3) with int8 or low-bit weights, set up once (its
// weights, its paged K/V caches, its embedding, final norm, LM head and RoPE tables), and a
// decode step over it in one call and one parallel region: hyprefix::decode_model_hidden (the
// hidden states) and hyprefix::decode_model_logits (the logits and their argmax). Each family
// describes its layers (models/llama.py's DecoderLayer: NoPE layers, residual multipliers); per
// layer, with res the residual stream (the rows' embeddings times embed_scale before the first
// layer) and s the layer's residual_scale (1 where the family has none):
//
//   res += out * s (the previous layer's);  h = rms_norm(res) * input_norm
//   q, k, v = split(h @ qkv^T + qkv_bias);  QK-norm per head (where given), rotate-half RoPE on
//   the first rotary_dim channels (unless a NoPE layer);  k, v written to the layer's paged
//   caches at slot_mapping
//   a = attention of q over each row's K/V through its block table (decode_attention.h)
//   res += (a @ o^T + o_bias) * s;  h = rms_norm(res) * post_norm
//   gate, up = split(h @ gate_up^T + gate_up_bias);  out = (silu(gate) * up) @ down^T + down_bias
//   (or, in a MoE layer, out = its sparse block of h: decode_moe.h)
//
// then hidden = out * s + res of the last layer, or logits = rms_norm(res + out * s) * final_norm
// @ head^T / logits_scale.
// That is the arithmetic, in the same float32 order, of the model run op by op (models/llama.py
// with the int8 kernel of int8_tiles.h and the attention of decode_attention.h), so the results
// agree to float32 rounding. What it saves is the time between those ops: a batch-1 decode step
// of a small model is ~150 kernel calls, and each call's dispatch, allocation and thread wake-up
// leaves the memory idle (one call a layer still left gaps between calls); and passing the
// hundreds of weight tensors on every call costs time, which holding them here saves.
//
// The threads stay in one region, six barriers a layer, one after each step whose result every
// thread reads: each thread computes its share of every matmul (even runs of 16-row tiles, not
// chunks taken from a shared counter, which were slower) and finishes its own columns at once
// (RoPE and the K/V write of its heads after q/k/v; silu(gate) * up and its int8 groups after
// gate_up, whose share is matching gate and up columns); attention tasks go to whichever thread
// is free, then each thread merges the heads of its int8 groups; and the small row-wide steps
// (the residual add, RMSNorm, the activations' int8 quantization) each thread does whole, on its
// own copy of res, rather than one thread while the others wait. While a thread runs attention
// tasks it also pulls its shares of the next weights (o_proj, then gate_up) into its L2, a few
// lines per K/V row: the attention waits on its loads' latency and leaves bandwidth idle. The
// budget stays well inside L2 (a larger one evicted what it fetched).
//
// Not traced by torch.compile: the K/V caches it writes are held here, not arguments.
#include "decode_attention.h"
#include "decode_moe.h"
#include "decode_rows.h"

#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <atomic>
#include <optional>

namespace {

struct Layer {
  const float *input_norm, *qk_norm, *post_norm;  // qk_norm: nullptr where none
  Matrix qkv, o, gate_up, down;  // gate_up, down: empty in a MoE layer
  std::shared_ptr<MoeBlock> moe;  // a sparse MoE block in place of the gated MLP (decode_moe.h), or null
  float *k_cache, *v_cache;
  size_t plan;  // its window's index in DecodeModel::windows
  bool rope;  // false: a NoPE layer (q and k not rotated)
  float residual_scale;  // each block's output times this before it joins res (1: none)
};

void check_vector(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n,
              "DecodeModel: ", name, " must be contiguous float32 of ", n, " values");
}

// The model: pointers into the tensors it holds (so they live as long as it does).
struct DecodeModel : torch::CustomClassHolder {
  std::vector<at::Tensor> held;
  std::vector<Layer> layers;
  int64_t hidden, vocab, num_heads, rotary_dim, max_positions;
  int64_t kv_heads = 0, dim = 0, block_size = 0, cache_slots = 0, intermediate = 0;
  double norm_eps, qk_norm_eps, scale;
  float embed_scale, logits_scale;  // res starts as embed_row * embed_scale; logits are divided by logits_scale
  const float *final_norm, *cos, *sin;  // cos, sin: [max_positions, rotary_dim]
  const float* embed = nullptr;  // a float32 table [vocab, hidden], or
  std::vector<TilePart> embed_parts;  // its low-bit tiles (a GGUF's quantized table, no float copy)
  std::optional<Matrix> head;
  std::vector<int64_t> cache_shape;
  std::vector<int64_t> windows;  // the layers' distinct sliding windows (0: none), one attention plan each

  // embed: [float32 table [vocab, hidden]] or its parts [data, scales, extra] * parts; head: its
  // tensors (``matrix``), or none (logits unavailable); cos, sin: float32 [max_positions,
  // rotary_dim] (models/layers.py's Rotary).
  DecodeModel(std::vector<at::Tensor> embed_, int64_t vocab_, int64_t hidden_, at::Tensor final_norm_,
              std::vector<at::Tensor> head_, at::Tensor cos_, at::Tensor sin_, int64_t num_heads_, double norm_eps_,
              double qk_norm_eps_, double scale_, double embed_scale_, double logits_scale_)
      : hidden(hidden_), vocab(vocab_), num_heads(num_heads_), rotary_dim(cos_.size(-1)),
        max_positions(cos_.size(0)), norm_eps(norm_eps_), qk_norm_eps(qk_norm_eps_), scale(scale_),
        embed_scale(static_cast<float>(embed_scale_)), logits_scale(static_cast<float>(logits_scale_)) {
    if (embed_.size() == 1) {
      TORCH_CHECK(embed_[0].device().is_cpu() && embed_[0].dim() == 2, "DecodeModel: embed must be [vocab, hidden] on CPU");
      check_vector(embed_[0], vocab * hidden, "embed");
      embed = embed_[0].const_data_ptr<float>();
    } else {
      embed_parts = parts_of(embed_, vocab, hidden, "DecodeModel embed");
    }
    check_vector(final_norm_, hidden, "final_norm");
    TORCH_CHECK(cos_.dim() == 2 && sin_.sizes() == cos_.sizes() && rotary_dim % 2 == 0,
                "DecodeModel: cos and sin must be [max_positions, rotary_dim]");
    check_vector(cos_, cos_.numel(), "cos");
    check_vector(sin_, sin_.numel(), "sin");
    if (!head_.empty()) {
      head = matrix(head_, std::nullopt, vocab, "head");
      TORCH_CHECK(head->k == hidden, "DecodeModel: the head takes ", head->k, " inputs, hidden is ", hidden);
      held.insert(held.end(), head_.begin(), head_.end());
    }
    held.insert(held.end(), embed_.begin(), embed_.end());
    held.insert(held.end(), {final_norm_, cos_, sin_});
    final_norm = final_norm_.const_data_ptr<float>();
    cos = cos_.const_data_ptr<float>();
    sin = sin_.const_data_ptr<float>();
  }

  // Row `id` of the embedding table, times embed_scale, into dst.
  void embed_row(int64_t id, float* dst) const {
    if (embed != nullptr) {
      std::copy_n(embed + id * hidden, hidden, dst);
    } else {
      matrix_row(embed_parts, id, hidden, dst);
    }
    if (embed_scale != 1.0f)
      for (int64_t j = 0; j < hidden; ++j) dst[j] *= embed_scale;
  }

  // The next layer: its weights (int8 tiles and scales, optional biases), its norms (qk_norm:
  // float32 [(num_heads + kv_heads) * dim] or none), its caches (float32 [blocks, block_size,
  // kv_heads, dim], every layer's the same shape), its sliding window (0: none), whether it
  // rotates q and k, and the scale of its blocks' outputs.
  void add_layer(at::Tensor input_norm, std::vector<at::Tensor> qkv_w, std::optional<at::Tensor> qkv_bias,
                 std::optional<at::Tensor> qk_norm, std::vector<at::Tensor> o_w, std::optional<at::Tensor> o_bias,
                 at::Tensor post_norm, std::vector<at::Tensor> gate_up_w, std::optional<at::Tensor> gate_up_bias,
                 std::vector<at::Tensor> down_w, std::optional<at::Tensor> down_bias, at::Tensor k_cache,
                 at::Tensor v_cache, int64_t window, bool rope, double residual_scale) {
    TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                    v_cache.is_contiguous() && k_cache.scalar_type() == at::kFloat &&
                    v_cache.scalar_type() == at::kFloat && k_cache.device().is_cpu(),
                "DecodeModel: the caches must be contiguous float32 [blocks, block_size, kv_heads, dim] on CPU");
    if (layers.empty()) {
      cache_shape = k_cache.sizes().vec();
      kv_heads = k_cache.size(2);
      dim = k_cache.size(3);
      block_size = k_cache.size(1);
      cache_slots = k_cache.size(0) * block_size;
      TORCH_CHECK(num_heads % kv_heads == 0, "DecodeModel: ", num_heads, " heads over ", kv_heads, " KV heads");
      TORCH_CHECK(dim % 16 == 0 && rotary_dim <= dim, "DecodeModel: head dim ", dim,
                  " (a multiple of 16, at least rotary_dim ", rotary_dim, ")");
    }
    TORCH_CHECK(k_cache.sizes().vec() == cache_shape, "DecodeModel: every layer's caches must be one shape");
    check_vector(input_norm, hidden, "input_norm");
    check_vector(post_norm, hidden, "post_norm");
    if (qk_norm.has_value()) check_vector(*qk_norm, (num_heads + kv_heads) * dim, "qk_norm");
    const int64_t q_size = num_heads * dim, qkv_n = q_size + 2 * kv_heads * dim;
    Layer l;
    l.input_norm = input_norm.const_data_ptr<float>();
    l.post_norm = post_norm.const_data_ptr<float>();
    l.qk_norm = qk_norm ? qk_norm->const_data_ptr<float>() : nullptr;
    l.qkv = matrix(qkv_w, qkv_bias, qkv_n, "qkv");
    l.o = matrix(o_w, o_bias, hidden, "o_proj");
    const bool dense = !down_w.empty();  // else a MoE layer: set_moe gives its block
    if (dense && intermediate == 0) intermediate = matrix(down_w, std::nullopt, hidden, "down").k;
    if (dense) {
      l.gate_up = matrix(gate_up_w, gate_up_bias, 2 * intermediate, "gate_up");
      l.down = matrix(down_w, down_bias, hidden, "down");
    }
    TORCH_CHECK(l.qkv.k == hidden && l.o.k == q_size && (!dense || (l.gate_up.k == hidden && l.down.k == intermediate)),
                "DecodeModel: layer ", layers.size(), "'s weights do not fit hidden ", hidden, ", ", num_heads, " x ",
                dim, ", intermediate ", intermediate);
    l.k_cache = k_cache.mutable_data_ptr<float>();
    l.v_cache = v_cache.mutable_data_ptr<float>();
    l.plan = std::find(windows.begin(), windows.end(), window) - windows.begin();
    if (l.plan == windows.size()) windows.push_back(window);
    l.rope = rope;
    l.residual_scale = static_cast<float>(residual_scale);
    for (const auto& t : {input_norm, post_norm, k_cache, v_cache}) held.push_back(t);
    for (const auto* w : {&qkv_w, &o_w, &gate_up_w, &down_w}) held.insert(held.end(), w->begin(), w->end());
    for (const auto* t : {&qkv_bias, &qk_norm, &o_bias, &gate_up_bias, &down_bias})
      if (t->has_value()) held.push_back(**t);
    layers.push_back(l);
  }

  // The last layer added (with no gate_up or down) takes a sparse MoE block: router float32
  // [experts, hidden]; the experts' stacked tiles, one part each ([data, scales, extra]),
  // gate_up_rows (2 * its intermediate: gate rows, then up rows) and `hidden` rows an expert.
  void set_moe(at::Tensor router, int64_t top_k, bool renormalize, std::vector<at::Tensor> gate_up_w,
               int64_t gate_up_rows, std::vector<at::Tensor> down_w) {
    TORCH_CHECK(!layers.empty() && layers.back().down.n == 0 && !layers.back().moe,
                "DecodeModel: set_moe follows an add_layer with no gate_up or down");
    layers.back().moe = moe_block_of(router, top_k, renormalize, gate_up_w, gate_up_rows, down_w, hidden);
    held.push_back(router);
    held.insert(held.end(), gate_up_w.begin(), gate_up_w.end());
    held.insert(held.end(), down_w.begin(), down_w.end());
  }
};

struct ThreadScratch {  // one thread's: its copy of res, its activations, its merged attention heads
  std::vector<float> res, h, attn, merged;
  GroupedActivations q, expert_rows;  // expert_rows: an expert's rows of q (decode_moe.h)
  Scratch attention;
  MoeRoute route;  // each thread routes every row itself
};

// Buffers of the calling thread, kept between calls (no allocation a step but the results).
struct StepScratch {
  std::vector<float> out, qkv, gate_up, act, best;
  std::vector<int64_t> best_index;
  GroupedActivations q_attn, q_act;  // o_proj's and down's inputs, each thread quantizing its groups
  std::vector<ThreadScratch> threads;
  MoeScratch moe;  // the MoE layers' (decode_moe.h)
};

// QK-norm (where given) and RoPE (in a layer that rotates) of heads [h0, h1) of each row's q, k, v
// (q heads, then k, then v), then their k and v into the caches at the rows' slots.
void finish_heads(const DecodeModel& m, const Layer& l, float* qkv, int64_t rows, const int64_t* positions,
                  const int64_t* slots, int64_t h0, int64_t h1) {
  const int64_t d = m.dim, half = m.rotary_dim / 2, kv_size = m.kv_heads * d;
  const int64_t qkv_n = (m.num_heads + 2 * m.kv_heads) * d, rotated = m.num_heads + m.kv_heads;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = qkv + r * qkv_n;
    const float *c = m.cos + positions[r] * m.rotary_dim, *s = m.sin + positions[r] * m.rotary_dim;
    for (int64_t head = h0; head < h1; ++head) {
      float* v = row + head * d;
      if (head < rotated) {
        if (l.qk_norm != nullptr) rms_norm(v, l.qk_norm + head * d, m.qk_norm_eps, d, v);
        for (int64_t j = 0; l.rope && j < half; ++j) {
          const float x1 = v[j], x2 = v[j + half];
          v[j] = x1 * c[j] - x2 * s[j];
          v[j + half] = x2 * c[j] + x1 * s[j];
        }
      }
      if (head >= m.num_heads) {
        const bool key = head < rotated;
        float* cache = key ? l.k_cache : l.v_cache;
        std::copy_n(v, d, cache + slots[r] * kv_size + (head - (key ? m.num_heads : rotated)) * d);
      }
    }
  }
}

// Int8 groups [g0, g1) (row-major over rows of q_size) of the attention output into q: each
// group's heads merged (DecodeWork::merge) into this thread's attn.
void merge_groups(const DecodeWork<float>& attention, int64_t q_size, int64_t dim, int64_t g0, int64_t g1,
                  ThreadScratch& mine, GroupedActivations& q) {
  const int64_t per_row = q_size / kGroup, heads = q_size / dim;
  int64_t done = -1;  // the last (row, head) merged, as row * heads + head
  float lse;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t r = g / per_row, col = g % per_row * kGroup;
    for (int64_t head = col / dim; head <= (col + kGroup - 1) / dim; ++head) {
      if (r * heads + head <= done) continue;
      attention.merge(r, head, mine.attn.data() + r * q_size + head * dim, &lse, mine.merged.data());
      done = r * heads + head;
    }
  }
  quantize_span(mine.attn.data(), g0, g1, q);
}

// Attention reads each row's keys in runs of this many tokens at fixed positions (DecodeWork's fixed
// plan), so a row's result is the same bits whatever else the step holds: how many rows, how long
// their contexts (the adaptive plan sizes its runs by the widest row and the thread count). A
// speculative verification (1 + k rows of one sequence) then decodes exactly as k + 1 steps of one
// row would, and a sequence's tokens do not depend on its batch. Short enough that a short context
// still makes a few tasks for the threads.
constexpr int64_t kFixedRunTokens = 256;

struct StepInputs {
  const int64_t *ids, *positions, *slots;
  int64_t rows;
};

// The decode step over every layer; then hidden = out + res into `hidden` or, with `logits`, the
// LM head's logits [rows, vocab] and each row's argmax into `greedy`.
void run_step(const DecodeModel& m, const StepInputs& in, const at::Tensor& tables, const at::Tensor& context_lens,
              float* hidden, float* logits, int64_t* greedy) {
  const int64_t rows = in.rows, n = m.hidden, d = m.dim, q_size = m.num_heads * d;
  const int64_t qkv_n = q_size + 2 * m.kv_heads * d, inter = m.intermediate, vocab = m.vocab;
  const int threads_wanted = static_cast<int>(std::max<int64_t>(1, at::get_num_threads()));
  std::vector<DecodeWork<float>> plans;  // one per distinct window
  for (const int64_t window : m.windows) {
    const Shape shape{rows, m.num_heads, d, m.kv_heads, m.num_heads / m.kv_heads, m.block_size, tables.size(1),
                      qkv_n, d, tables.stride(0), window, static_cast<float>(m.scale)};
    plans.emplace_back(shape, nullptr, nullptr, nullptr, tables.const_data_ptr<int64_t>(),
                       context_lens.const_data_ptr<int64_t>(), nullptr, threads_wanted,
                       std::max<int64_t>(1, kFixedRunTokens / m.block_size), /*whole_rows=*/false);
  }
  static thread_local StepScratch scratch;
  StepScratch& w = scratch;  // the caller's, shared by the region's threads (each has its own thread_local)
  w.out.resize(rows * n);
  w.qkv.resize(rows * qkv_n);
  w.gate_up.resize(rows * 2 * inter);
  w.act.resize(rows * inter);
  size_for(w.q_attn, rows, q_size);
  size_for(w.q_act, rows, inter);
  w.threads.resize(threads_wanted);
  for (ThreadScratch& t : w.threads) {
    t.res.resize(rows * n);
    t.h.resize(rows * n);
    t.attn.resize(rows * q_size);
    t.merged.resize(d);
    size_for(t.q, rows, n);
  }
  int64_t most_experts = 0, most_top = 0, most_inter = 0;
  for (const Layer& l : m.layers)
    if (l.moe) {
      most_experts = std::max(most_experts, l.moe->experts);
      most_top = std::max(most_top, l.moe->top_k);
      most_inter = std::max(most_inter, l.moe->inter);
    }
  if (most_experts > 0) w.moe.size(rows, rows * most_top, most_experts, most_inter, n);
  w.best.resize(threads_wanted * rows);
  w.best_index.resize(threads_wanted * rows);
  float* out = w.out.data();
  std::atomic<int64_t> next{0};  // the attention's next task
  const int64_t heads_qkv = m.num_heads + 2 * m.kv_heads, groups_attn = rows * (q_size / kGroup);
  const int64_t groups_act = inter / kGroup, gate_tiles = inter / 16;

#pragma omp parallel num_threads(threads_wanted)
  {
    const int tid = omp_get_thread_num(), threads = omp_get_num_threads();
    ThreadScratch& mine = w.threads[tid];
    float* res = mine.res.data();
    for (int64_t r = 0; r < rows; ++r) m.embed_row(in.ids[r], res + r * n);
    const auto [h0, h1] = share(heads_qkv, tid, threads);
    const auto [a0, a1] = share(groups_attn, tid, threads);
    const auto [u0, u1] = share(groups_act, tid, threads);
    const auto [o0, o1] = share((n + 15) / 16, tid, threads);
    for (size_t i = 0; i < m.layers.size(); ++i) {
      const Layer& l = m.layers[i];
      DecodeWork<float>& attention = plans[l.plan];
      if (i > 0) add_scaled(res, out, m.layers[i - 1].residual_scale, rows * n);
      norm_rows(res, l.input_norm, m.norm_eps, rows, n, mine.h.data(), mine.q);
      matmul_tiles(l.qkv, mine.q, rows, w.qkv.data(), h0 * d / 16, h1 * d / 16);
      finish_heads(m, l, w.qkv.data(), rows, in.positions, in.slots, h0, h1);
      if (tid == 0) {  // the attention pointed at this layer
        attention.q = w.qkv.data();
        attention.k_cache = l.k_cache;
        attention.v_cache = l.v_cache;
        next = 0;
      }
#pragma omp barrier
      if (!attention.serial || tid == 0) {
        // this thread's o_proj tiles, then its gate and up tiles, as far as the budget goes
        // (a MoE layer's experts are not chosen yet: o_proj alone)
        Prefetcher& ahead = mine.attention.ahead;
        ahead.start(kAheadLinesPerRow);
        const int64_t o_bytes = std::min(ahead_budget(), l.o.bytes(o0, o1));
        ahead.add(0, l.o.tile(o0), o_bytes);
        if (!l.moe) {
          const int64_t gate_bytes = std::min((ahead_budget() - o_bytes) / 2,
                                              l.gate_up.bytes(2 * u0, std::min(2 * u1, gate_tiles)));
          const int64_t up_bytes = std::min((ahead_budget() - o_bytes) / 2,
                                            l.gate_up.bytes(gate_tiles + 2 * u0, gate_tiles + 2 * u1));
          ahead.add(1, l.gate_up.tile(2 * u0), gate_bytes);
          ahead.add(2, l.gate_up.tile(gate_tiles + 2 * u0), up_bytes);
        }
        for (int64_t t = next.fetch_add(1); t < attention.tasks; t = next.fetch_add(1))
          attention.task(t, mine.attention);
      }
#pragma omp barrier
      merge_groups(attention, q_size, d, a0, a1, mine, w.q_attn);
#pragma omp barrier
      matmul_tiles(l.o, w.q_attn, rows, out, o0, o1);
#pragma omp barrier
      add_scaled(res, out, l.residual_scale, rows * n);
      norm_rows(res, l.post_norm, m.norm_eps, rows, n, mine.h.data(), mine.q);
      if (l.moe) {
        moe_block(*l.moe, mine.h.data(), mine.q, mine.route, mine.expert_rows, w.moe, rows, n, tid, threads, o0, o1,
                  out);
        continue;
      }
      matmul_tiles(l.gate_up, mine.q, rows, w.gate_up.data(), 2 * u0, 2 * u1);
      matmul_tiles(l.gate_up, mine.q, rows, w.gate_up.data(), gate_tiles + 2 * u0, gate_tiles + 2 * u1);
      for (int64_t r = 0; r < rows; ++r) {  // silu(gate) * up of its columns, quantized
        const float* g = w.gate_up.data() + r * 2 * inter;
        const int64_t c0 = u0 * kGroup, c1 = u1 * kGroup;
        at::vec::map2([](Vec gate, Vec up) { return gate / (Vec(1.0f) + gate.neg().exp()) * up; },
                      w.act.data() + r * inter + c0, g + c0, g + inter + c0, c1 - c0);
        quantize_span(w.act.data(), r * groups_act + u0, r * groups_act + u1, w.q_act);
      }
#pragma omp barrier
      matmul_tiles(l.down, w.q_act, rows, out, o0, o1);
#pragma omp barrier
    }
    const float last_scale = m.layers.back().residual_scale;
    if (logits != nullptr) {
      add_scaled(res, out, last_scale, rows * n);
      norm_rows(res, m.final_norm, m.norm_eps, rows, n, mine.h.data(), mine.q);
      const auto [t0, t1] = share((vocab + 15) / 16, tid, threads);
      matmul_tiles(*m.head, mine.q, rows, logits, t0, t1);
      const int64_t c0 = std::min(t0 * 16, vocab), c1 = std::min(t1 * 16, vocab);
      for (int64_t r = 0; r < rows; ++r) {
        if (m.logits_scale != 1.0f)
          for (int64_t c = c0; c < c1; ++c) logits[r * vocab + c] /= m.logits_scale;
        w.best_index[tid * rows + r] = -1;
        argmax_span(logits + r * vocab + c0, c1 - c0, c0, w.best[tid * rows + r], w.best_index[tid * rows + r]);
      }
#pragma omp barrier
      if (tid == 0) {
        for (int64_t r = 0; r < rows; ++r) {
          float best = 0.0f;
          int64_t index = -1;
          for (int t = 0; t < threads; ++t) {
            const float v = w.best[t * rows + r];
            const int64_t at = w.best_index[t * rows + r];
            if (at >= 0 && (index < 0 || v > best || (std::isnan(v) && !std::isnan(best)))) {
              best = v;
              index = at;
            }
          }
          greedy[r] = index;
        }
      }
    } else if (tid == 0) {
      for (int64_t j = 0; j < rows * n; ++j) hidden[j] = (last_scale == 1.0f ? out[j] : out[j] * last_scale) + res[j];
    }
  }
}

StepInputs check_step(const DecodeModel& m, const at::Tensor& input_ids, const at::Tensor& positions,
                      const at::Tensor& slot_mapping, const at::Tensor& tables, const at::Tensor& context_lens) {
  TORCH_CHECK(!m.layers.empty(), "DecodeModel: no layers");
  for (const Layer& l : m.layers)
    TORCH_CHECK(l.down.n > 0 || l.moe, "DecodeModel: a layer added without gate_up or down has no set_moe");
  const int64_t rows = input_ids.numel();
  for (const auto* t : {&input_ids, &positions, &slot_mapping, &context_lens})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == rows,
                "DecodeModel: input_ids, positions, slot_mapping and context_lens must be contiguous int64 [rows]");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == rows && tables.stride(1) == 1 &&
                  tables.scalar_type() == at::kLong,
              "DecodeModel: tables must be int64 [rows, width] with contiguous rows");
  StepInputs in{input_ids.const_data_ptr<int64_t>(), positions.const_data_ptr<int64_t>(),
                slot_mapping.const_data_ptr<int64_t>(), rows};
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(in.ids[r] >= 0 && in.ids[r] < m.vocab, "DecodeModel: token id ", in.ids[r], " outside the vocabulary");
    TORCH_CHECK(in.positions[r] >= 0 && in.positions[r] < m.max_positions, "DecodeModel: position ",
                in.positions[r], " outside the RoPE tables");
    TORCH_CHECK(in.slots[r] >= 0 && in.slots[r] < m.cache_slots, "DecodeModel: slot ", in.slots[r],
                " outside the caches");
  }
  return in;
}

at::Tensor decode_model_hidden(const c10::intrusive_ptr<DecodeModel>& m, const at::Tensor& input_ids,
                               const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& tables,
                               const at::Tensor& context_lens) {
  const StepInputs in = check_step(*m, input_ids, positions, slot_mapping, tables, context_lens);
  at::Tensor hidden = at::empty({in.rows, m->hidden}, input_ids.options().dtype(at::kFloat));
  if (in.rows > 0) run_step(*m, in, tables, context_lens, hidden.mutable_data_ptr<float>(), nullptr, nullptr);
  return hidden;
}

std::tuple<at::Tensor, at::Tensor> decode_model_logits(const c10::intrusive_ptr<DecodeModel>& m,
                                                       const at::Tensor& input_ids, const at::Tensor& positions,
                                                       const at::Tensor& slot_mapping, const at::Tensor& tables,
                                                       const at::Tensor& context_lens) {
  TORCH_CHECK(m->head.has_value(), "DecodeModel: no quantized head, so no logits (decode_model_hidden gives the states)");
  const StepInputs in = check_step(*m, input_ids, positions, slot_mapping, tables, context_lens);
  at::Tensor logits = at::empty({in.rows, m->vocab}, input_ids.options().dtype(at::kFloat));
  at::Tensor greedy = at::empty({in.rows}, input_ids.options());
  if (in.rows > 0)
    run_step(*m, in, tables, context_lens, nullptr, logits.mutable_data_ptr<float>(), greedy.mutable_data_ptr<int64_t>());
  return {logits, greedy};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hyprefix, m) {
  m.class_<DecodeModel>("DecodeModel")
      .def(torch::init<std::vector<at::Tensor>, int64_t, int64_t, at::Tensor, std::vector<at::Tensor>, at::Tensor,
                       at::Tensor, int64_t, double, double, double, double, double>())
      .def("add_layer", &DecodeModel::add_layer)
      .def("set_moe", &DecodeModel::set_moe);
  m.def("decode_model_hidden(__torch__.torch.classes.hyprefix.DecodeModel model, Tensor input_ids, Tensor positions, "
        "Tensor slot_mapping, Tensor tables, Tensor context_lens) -> Tensor");
  m.def("decode_model_logits(__torch__.torch.classes.hyprefix.DecodeModel model, Tensor input_ids, Tensor positions, "
        "Tensor slot_mapping, Tensor tables, Tensor context_lens) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hyprefix, CPU, m) {
  m.impl("decode_model_hidden", &decode_model_hidden);
  m.impl("decode_model_logits", &decode_model_logits);
}
