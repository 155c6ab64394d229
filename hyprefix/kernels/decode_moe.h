// DecodeModel's sparse MoE block (decode_layers.cpp), in place of a layer's gated MLP: the block of
// models/moe.py's SparseMoE with Qwen3-MoE's routing (a float32 router, softmax over every expert,
// the top_k largest, their weights renormalised to sum to one where asked) and SiLU experts on
// stacked tiles (quant_moe.h's ExpertStack: a GGUF's blocks, or --quantization int8 / int4).
//
// Inside the step's one parallel region, with h the rows after the post-attention norm:
//   1. each thread computes its share of the experts' router logits for every row; a barrier;
//   2. each thread routes every row itself (the same arithmetic, so the same choice in each) and
//      groups the (row, expert) pairs by expert, experts increasing, each expert's rows in order
//      (quant_moe's order, so a row's result does not depend on the other rows);
//   3. per chosen expert, its gate and up tiles of the thread's columns (the dense MLP's split),
//      then SiLU(gate) * up of those columns and their int8 groups; a barrier;
//   4. per chosen expert, the down tiles of the thread's output columns; then each row's sum over
//      its experts (in that order, weight times output) of those columns into out.
// The arithmetic is quant_moe's (the same tiles, activation and order of the sum); the router's
// dot products and softmax are plain float32 loops, which may round differently from the op by
// op block's (tests/kernels/test_decode_layers.py bounds the difference).
#pragma once
#include "decode_rows.h"
#include "quant_moe.h"

#include <algorithm>
#include <memory>
#include <numeric>

namespace {

struct MoeBlock {
  const float* router = nullptr;  // [experts, hidden] float32
  int64_t experts = 0, top_k = 0, inter = 0;
  bool renormalize = false;
  std::unique_ptr<ExpertStack> gate_up, down;  // [experts * 2 inter, hidden], [experts * hidden, inter]
};

// The block of a router float32 [experts, hidden] (contiguous) and the experts' stacked tiles, one
// part each ([data, scales, extra]): gate_up_rows (2 * the intermediate size: gate rows, then up
// rows) and `hidden` rows an expert.
inline std::shared_ptr<MoeBlock> moe_block_of(const at::Tensor& router, int64_t top_k, bool renormalize,
                                              const std::vector<at::Tensor>& gate_up_w, int64_t gate_up_rows,
                                              const std::vector<at::Tensor>& down_w, int64_t hidden) {
  TORCH_CHECK(router.dim() == 2 && router.size(1) == hidden && router.scalar_type() == at::kFloat &&
                  router.is_contiguous() && top_k >= 1 && gate_up_rows % 32 == 0 && hidden % 16 == 0,
              "DecodeModel: the router must be contiguous float32 [experts, hidden], top_k >= 1, gate_up_rows whole "
              "32-row groups");
  auto b = std::make_shared<MoeBlock>();
  b->router = router.const_data_ptr<float>();
  b->experts = router.size(0);
  b->top_k = std::min(top_k, b->experts);
  b->renormalize = renormalize;
  b->inter = gate_up_rows / 2;
  b->gate_up = std::make_unique<ExpertStack>(gate_up_w, gate_up_rows, hidden);
  b->down = std::make_unique<ExpertStack>(down_w, hidden, b->inter);
  TORCH_CHECK(b->gate_up->whole.tiles == b->experts * gate_up_rows / 16 &&
                  b->down->whole.tiles == b->experts * hidden / 16,
              "DecodeModel: the expert stacks do not hold ", b->experts, " experts of ", gate_up_rows, " and ", hidden,
              " rows");
  return b;
}

// One step's routing of every row: each row's chosen experts and weights, and the chosen experts
// (items), increasing, each with the rows that chose it and where their results start.
struct MoeRoute {
  std::vector<int64_t> item_expert, item_first;  // item_first[i]: its first pair; the last entry: all pairs
  std::vector<int64_t> pair_row;                 // pairs by item, each item's rows increasing
  std::vector<float> pair_weight;
  std::vector<float> scores;
  std::vector<int64_t> order;  // a row's experts by score, then the pairs by expert
  std::vector<int64_t> pair_expert;
  std::vector<float> row_weight;

  int64_t items() const { return static_cast<int64_t>(item_expert.size()); }
  int64_t rows_of(int64_t i) const { return item_first[i + 1] - item_first[i]; }

  // logits [rows, experts] -> softmax, the top_k (the first of equal scores), renormalised; then
  // the pairs stably sorted by expert, as quant_moe orders them.
  void route(const float* logits, int64_t rows, const MoeBlock& b) {
    const int64_t e_count = b.experts, k = b.top_k;
    scores.resize(e_count);
    pair_expert.clear();
    row_weight.clear();
    for (int64_t r = 0; r < rows; ++r) {
      const float* x = logits + r * e_count;
      const float top = *std::max_element(x, x + e_count);
      float sum = 0.0f;
      for (int64_t e = 0; e < e_count; ++e) sum += scores[e] = std::exp(x[e] - top);
      for (int64_t e = 0; e < e_count; ++e) scores[e] /= sum;
      order.resize(e_count);
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t c) {
        return scores[a] > scores[c] || (scores[a] == scores[c] && a < c);
      });
      float chosen_sum = 0.0f;
      for (int64_t j = 0; j < k; ++j) chosen_sum += scores[order[j]];
      for (int64_t j = 0; j < k; ++j) {
        pair_expert.push_back(order[j]);
        row_weight.push_back(b.renormalize ? scores[order[j]] / chosen_sum : scores[order[j]]);
      }
    }
    const int64_t pairs = rows * k;
    order.resize(pairs);  // pair ids (row * k + slot), by expert, each expert's rows in order
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t c) { return pair_expert[a] < pair_expert[c]; });
    item_expert.clear();
    item_first.clear();
    pair_row.resize(pairs);
    pair_weight.resize(pairs);
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t id = order[p], expert = pair_expert[id];
      if (item_expert.empty() || item_expert.back() != expert) {
        item_expert.push_back(expert);
        item_first.push_back(p);
      }
      pair_row[p] = id / k;
      pair_weight[p] = row_weight[id];
    }
    item_first.push_back(pairs);
  }
};

// Rows `rows` of q (k columns each) into out, sized for them.
inline void gather_rows(const GroupedActivations& q, const int64_t* rows, int64_t count, int64_t k,
                        GroupedActivations& out) {
  const int64_t groups = k / kGroup;
  size_for(out, count, k);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t r = rows[i];
    std::copy_n(q.values.data() + r * k, k, out.values.data() + i * k);
    std::copy_n(q.scales.data() + r * groups, groups, out.scales.data() + i * groups);
    std::copy_n(q.starts.data() + r * groups, groups, out.starts.data() + i * groups);
    std::copy_n(q.halves.data() + 2 * r * groups, 2 * groups, out.halves.data() + 2 * i * groups);
    std::copy_n(q.sums.data() + r * groups, groups, out.sums.data() + i * groups);
  }
}

// The shared buffers of a step's MoE blocks, sized for `pairs` (row, expert) pairs at most.
struct MoeScratch {
  std::vector<float> logits, gate_up, act, down;
  std::vector<GroupedActivations> q_act;  // per item

  // An expert takes at most every row: each item's int8 groups are sized for all of them.
  void size(int64_t rows, int64_t pairs, int64_t experts, int64_t inter, int64_t hidden) {
    logits.resize(rows * experts);
    gate_up.resize(pairs * 2 * inter);
    act.resize(pairs * inter);
    down.resize(pairs * hidden);
    q_act.resize(pairs);
    for (GroupedActivations& q : q_act) size_for(q, rows, inter);
  }
};

// Step 1: router logits of experts [e0, e1) for every row of h [rows, hidden].
inline void router_logits(const MoeBlock& b, const float* h, int64_t rows, int64_t hidden, int64_t e0, int64_t e1,
                          float* logits) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = e0; e < e1; ++e)
      logits[r * b.experts + e] = at::vec::map2_reduce_all<float>(
          [](Vec x, Vec w) { return x * w; }, [](Vec a, Vec c) { return a + c; }, h + r * hidden,
          b.router + e * hidden, hidden);
}

// Step 3: the thread's gate/up columns (activation groups [u0, u1) of each row) of every chosen
// expert, their SiLU(gate) * up and its int8 groups into s.q_act; q: the block's input rows,
// gathered into `mine` per expert where the expert takes fewer than all of them.
inline void experts_up(const MoeBlock& b, const MoeRoute& route, const GroupedActivations& q, int64_t rows,
                       int64_t hidden, int64_t u0, int64_t u1, GroupedActivations& mine, MoeScratch& s) {
  const int64_t inter = b.inter, gate_tiles = inter / 16, groups = inter / kGroup;
  for (int64_t i = 0; i < route.items(); ++i) {
    const int64_t first = route.item_first[i], count = route.rows_of(i);
    const GroupedActivations* in = &q;
    if (count != rows) {
      gather_rows(q, route.pair_row.data() + first, count, hidden, mine);
      in = &mine;
    }
    const std::vector<TilePart> parts = b.gate_up->expert(route.item_expert[i]);
    float* gu = s.gate_up.data() + first * 2 * inter;
    parts_span(parts, *in, count, 2 * inter, hidden, gu, 2 * u0, 2 * u1);
    parts_span(parts, *in, count, 2 * inter, hidden, gu, gate_tiles + 2 * u0, gate_tiles + 2 * u1);
    float* act = s.act.data() + first * inter;
    for (int64_t r = 0; r < count; ++r) {
      const float* g = gu + r * 2 * inter;
      const int64_t c0 = u0 * kGroup, c1 = u1 * kGroup;
      silu_times_up(g + c0, g + inter + c0, act + r * inter + c0, c1 - c0);
      quantize_span(act, r * groups + u0, r * groups + u1, s.q_act[i]);
    }
  }
}

// Step 4: the down tiles [o0, o1) of every chosen expert, then each row's weighted sum over its
// experts of those columns into out [rows, hidden].
inline void experts_down(const MoeBlock& b, const MoeRoute& route, int64_t rows, int64_t hidden, int64_t o0,
                         int64_t o1, MoeScratch& s, float* out) {
  for (int64_t i = 0; i < route.items(); ++i) {
    const int64_t first = route.item_first[i];
    parts_span(b.down->expert(route.item_expert[i]), s.q_act[i], route.rows_of(i), hidden, b.inter,
               s.down.data() + first * hidden, o0, o1);
  }
  const int64_t c0 = std::min(o0 * 16, hidden), c1 = std::min(o1 * 16, hidden);
  for (int64_t r = 0; r < rows; ++r) std::fill(out + r * hidden + c0, out + r * hidden + c1, 0.0f);
  for (int64_t p = 0; p < route.item_first.back(); ++p) {
    const float weight = route.pair_weight[p];
    const float* d = s.down.data() + p * hidden;
    float* o = out + route.pair_row[p] * hidden;
    for (int64_t c = c0; c < c1; ++c) o[c] += weight * d[c];
  }
}

// A MoE layer's block (the steps above) on the rows after the post-attention norm (h, quantized in
// q) into out [rows, hidden], this thread's output columns the tiles [o0, o1); route and
// expert_rows are the thread's own. Every thread of the region calls it; it ends at a barrier, as
// the dense MLP does.
inline void moe_block(const MoeBlock& b, const float* h, const GroupedActivations& q, MoeRoute& route,
                      GroupedActivations& expert_rows, MoeScratch& s, int64_t rows, int64_t hidden, int tid,
                      int threads, int64_t o0, int64_t o1, float* out) {
  const auto [e0, e1] = share(b.experts, tid, threads);
  router_logits(b, h, rows, hidden, e0, e1, s.logits.data());
#pragma omp barrier
  route.route(s.logits.data(), rows, b);
  const auto [u0, u1] = share(b.inter / kGroup, tid, threads);
  experts_up(b, route, q, rows, hidden, u0, u1, expert_rows, s);
#pragma omp barrier
  experts_down(b, route, rows, hidden, o0, o1, s, out);
#pragma omp barrier
}

}  // namespace
