// The experts of hyprefix::quant_moe (quant_linear.cpp): one projection's matmul over the chosen
// experts' tiles, the activation between the projections, and a block run projection by projection.
// Included by quant_linear.cpp after quant_tiles.h; its ATen vector loops take the build's
// CPU_CAPABILITY (quant_linear.py's flags).
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <vector>

namespace {

// Expert e's tiles of one projection's stack (`whole`: the stack's one part, each expert's rows whole
// tiles): pointers into it, no tensor made.
inline std::vector<TilePart> expert_part(const TilePart& whole, int64_t e, int64_t rows, int64_t k) {
  const int64_t tiles = rows / 16, t0 = e * tiles, extra = extra_per_tile(whole.format, k);
  TilePart part = whole;
  part.data += t0 * whole.tile_bytes(k);
  part.scales = static_cast<const uint8_t*>(whole.scales) + t0 * scale_bytes_per_tile(whole.format, k);
  part.extra = extra ? static_cast<const uint16_t*>(whole.extra) + t0 * extra : whole.extra;  // none: may be null
  part.tile0 = 0;
  part.tiles = tiles;
  return {part};
}

// One expert's rows of a projection: in [rows, k] float32 -> out [rows, n] (raw rows of the caller's buffers).
struct ExpertRows {
  int64_t expert;
  const float* in;
  int64_t rows;
  float* out;
};

// One projection's stack (n rows an expert, k columns) as its one part, checked.
struct ExpertStack {
  TilePart whole;
  int64_t n, k;

  ExpertStack(const std::vector<at::Tensor>& stack, int64_t n, int64_t k) : n(n), k(k) {
    TORCH_CHECK(stack.size() == 3 && stack[0].dim() >= 1, "quant_moe: one part a stack");
    whole = parts_of(stack, stack[0].size(0) * 16, k, "quant_moe")[0];
  }

  std::vector<TilePart> expert(int64_t e) const {
    TORCH_CHECK(e >= 0 && (e + 1) * (n / 16) <= whole.tiles, "quant_moe: expert ", e, " outside the stack");
    return expert_part(whole, e, n, k);
  }
};

// Every item's rows times its expert's matrix of one projection, the activations quantized once per
// distinct input (a decode token's experts all read its one row), all items' tiles as the tasks of
// one parallel loop.
inline void experts_matmul(const ExpertStack& stack, const std::vector<ExpertRows>& items) {
  const int64_t n = stack.n, k = stack.k;
  std::vector<std::vector<TilePart>> parts;
  std::vector<GroupedActivations> q;
  std::vector<size_t> input_of;  // item -> its quantized input in q
  for (size_t i = 0; i < items.size(); ++i) {
    parts.push_back(stack.expert(items[i].expert));
    size_t same = 0;
    while (same < i && !(items[same].in == items[i].in && items[same].rows == items[i].rows)) ++same;
    if (same < i) {
      input_of.push_back(input_of[same]);
    } else {
      input_of.push_back(q.size());
      q.push_back(quantize_groups(items[i].in, items[i].rows, k));
    }
  }
  const int64_t tiles = n / 16, tasks = static_cast<int64_t>(items.size()) * tiles;
  at::parallel_for(0, tasks, std::max<int64_t>(1, (1 << 15) / (8 * k)), [&](int64_t a, int64_t b) {
    for (int64_t task = a; task < b;) {  // a run of one item's tiles
      const int64_t i = task / tiles, t0 = task % tiles, t1 = std::min(tiles, t0 + (b - task));
      parts_span(parts[i], q[input_of[i]], items[i].rows, n, k, items[i].out, t0, t1);
      task += t1 - t0;
    }
  });
}

enum class Activation { kSilu, kRelu2, kSwigluOai };

// What runs between the projections (fused_moe.py's activate): its kind, gpt-oss's alpha and limit,
// and the gate_up bias per expert ([E, gate_up_rows] float32, or null).
struct ExpertActivation {
  Activation kind;
  float alpha, limit;
  const float* bias;
  int64_t gate_up_rows, inter;
};

// silu(gate) * up over n values (out may be gate): the gated experts' activation, one definition
// for quant_moe and DecodeModel's MoE blocks (decode_moe.h), so both compute the same bits.
inline void silu_times_up(const float* gate, const float* up, float* out, int64_t n) {
  using Vec = at::vec::Vectorized<float>;
  at::vec::map2([](Vec g, Vec u) { return g / (Vec(1.f) + (Vec(0.f) - g).exp_u20()) * u; }, out, gate, up, n);
}

// The activation on `rows` rows of gate_up results gu [rows, gate_up_rows] of expert `expert` into
// act [rows, inter]: ATen's vector loops (at batch 1 the scalar exp alone was 3% of the block).
inline void activate_rows(const float* gu, float* act, int64_t rows, int64_t expert, const ExpertActivation& a) {
  using Vec = at::vec::Vectorized<float>;
  const int64_t inter = a.inter, width = a.gate_up_rows;
  std::vector<float> biased;
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * width;
    if (a.bias) {  // this row plus its expert's bias, then as without one
      biased.resize(width);
      at::vec::map2([](Vec v, Vec b) { return v + b; }, biased.data(), g, a.bias + expert * width, width);
      g = biased.data();
    }
    float* o = act + r * inter;
    if (a.kind == Activation::kRelu2) {
      at::vec::map([](Vec u) { const Vec p = at::vec::maximum(u, Vec(0.f)); return p * p; }, o, g, inter);
    } else if (a.kind == Activation::kSilu) {
      silu_times_up(g, g + inter, o, inter);
    } else {  // swiglu_oai (gpt-oss): (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
      const Vec alpha(a.alpha), limit(a.limit), low(-a.limit), one(1.f);
      at::vec::map2([&](Vec gate, Vec up) {
        const Vec gc = at::vec::minimum(gate, limit);
        return (at::vec::clamp(up, low, limit) + one) * (gc / (one + (Vec(0.f) - alpha * gc).exp_u20()));
      }, o, g, g + inter, inter);
    }
  }
}

// One expert's share of a block: its rows of the block's input [rows, hidden], and where its gate_up
// results [rows, gate_up_rows], activations [rows, inter] and down results [rows, hidden] go.
struct ExpertJob {
  int64_t expert, rows;
  const float* in;
  float *gate_up, *act, *out;
};

// A block's experts into the jobs' out rows, projection by projection, every expert's tiles split
// between the threads. (Whole experts per thread at decode, with no barrier between the
// projections, measured no faster: docs/perf-log.md.)
inline void run_experts(const ExpertStack& up, const ExpertStack& down, const std::vector<ExpertJob>& jobs,
                        const ExpertActivation& a) {
  const int64_t count = static_cast<int64_t>(jobs.size());
  int64_t most_rows = 0;
  for (const ExpertJob& job : jobs) most_rows = std::max(most_rows, job.rows);
  std::vector<ExpertRows> ups, downs;
  for (const ExpertJob& job : jobs) {
    ups.push_back({job.expert, job.in, job.rows, job.gate_up});
    downs.push_back({job.expert, job.act, job.rows, job.out});
  }
  experts_matmul(up, ups);
  at::parallel_for(0, count, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, a.inter * most_rows)), [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) activate_rows(jobs[j].gate_up, jobs[j].act, jobs[j].rows, jobs[j].expert, a);
  });
  experts_matmul(down, downs);
}

}  // namespace
