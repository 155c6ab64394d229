// The decay-weighted causal score matrix of a chunked recurrent scan (Mamba2's SSD scan and the
// chunked gated delta rule), in one pass instead of the five ops and four [H, Q, Q] temporaries
// of the eager code (difference, causal mask, exp, products).
//
// hyprefix::decay_scores
//   cs        [H, Q] float32: the cumulative log decay of each head from the chunk's start
//   scores    [Hs, Q, Q] float32, Hs divides H: head h reads scores[h / (H / Hs)] (a Mamba2
//             group's C B^T serves its heads)
//   row_scale [H, Q] float32 or None
//   strict    the mask keeps s < t (else s <= t)
//   -> [H, Q, Q] float32: out[h, t, s] = row_scale[h, t] * scores[h / (H / Hs), t, s]
//      * exp(cs[h, t] - cs[h, s]) inside the mask, 0 outside.
//
// The products run in the eager code's order ((scale * score) * exp); exp is ATen's vectorised
// exp (Sleef), where torch.exp may take MKL's: entries can differ from the eager code's in the
// last bit. One task per (head, row t); written on ATen's vector types: one build per CPU
// capability.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();

at::Tensor decay_scores(const at::Tensor& cs, const at::Tensor& scores, const std::optional<at::Tensor>& row_scale,
                        bool strict) {
  TORCH_CHECK(cs.dim() == 2 && cs.scalar_type() == at::kFloat && cs.is_contiguous(), "cs: [H, Q] float32");
  const int64_t heads = cs.size(0), q = cs.size(1);
  TORCH_CHECK(scores.dim() == 3 && scores.scalar_type() == at::kFloat && scores.is_contiguous() &&
                  scores.size(1) == q && scores.size(2) == q && scores.size(0) > 0 && heads % scores.size(0) == 0,
              "scores: [Hs, Q, Q] float32 with Hs dividing H");
  const float* scale = nullptr;
  if (row_scale.has_value()) {
    TORCH_CHECK(row_scale->scalar_type() == at::kFloat && row_scale->is_contiguous() &&
                    row_scale->sizes() == cs.sizes(), "row_scale: [H, Q] float32");
    scale = row_scale->data_ptr<float>();
  }
  const int64_t per_source = heads / scores.size(0);
  at::Tensor out = at::empty({heads, q, q}, cs.options());
  const float* c = cs.data_ptr<float>();
  const float* src = scores.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, heads * q, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t h = r / q, t = r % q;
      const float* ch = c + h * q;
      const float* in = src + ((h / per_source) * q + t) * q;
      float* o = dst + r * q;
      const int64_t kept = strict ? t : t + 1;  // s < kept inside the mask
      const float ct = ch[t];
      const Vec vt(ct);
      for (int64_t s = 0; s < kept; s += kW) {  // the last vector partial: exp stays ATen's for every entry
        const int64_t n = std::min(kW, kept - s);
        Vec weighted = Vec::loadu(in + s, n);
        if (scale != nullptr) weighted = Vec(scale[r]) * weighted;
        (weighted * (vt - Vec::loadu(ch + s, n)).exp()).store(o + s, n);
      }
      for (int64_t s = kept; s < q; ++s) o[s] = 0.0f;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hyprefix, m) {
  m.def("decay_scores(Tensor cs, Tensor scores, Tensor? row_scale, bool strict) -> Tensor");
}

TORCH_LIBRARY_IMPL(hyprefix, CPU, m) { m.impl("decay_scores", &decay_scores); }
