// hyprefix::quant_linear and its packing: low-bit weight tiles (quant_tiles.h has the formats and
// the arithmetic), built for AVX512-VNNI or for AVX2 like int8_linear.cpp.
//
//   quant_linear(x, parts, n): x [.., K] (float32 / bfloat16) @ the n-row matrix whose parts are
//     the flat list [data, scales, extra] * parts (each part whole tiles but the last).
//   quant_pack(q, scales, extra): a matrix unpacked (q uint8 [n, K]; Q4: float16 s and o [n, K/32];
//     Q4K: uint8 (sc, m) [n, K/32, 2] and float16 (d, dmin) [n, K/256, 2]; Q6: int8 scales [n, K/16]
//     and float16 d [n, K/256]) -> one part's (data, scales, extra).
//   quant_pack_gguf(raw, type, k, rows): the same from a GGUF tensor's bytes (uint8 [rows_in_file,
//     row_bytes], blocks of ggml type Q4_0, Q4_1, Q4_K, Q5_K or Q6_K), taking file row rows[i] as
//     row i (a row permutation such as Llama's q/k, applied while packing). Q4_0 and Q4_1 become Q4,
//     Q4_K Q4K, Q6_K Q6, all exactly; Q5_K's 5-bit groups are rounded to 4 bits in Q4 (whose bytes
//     stay within Q5_K's).
//   quant_rows(parts, n, k, ids): rows ids of the matrix dequantized to float32 [len(ids), K]
//     (embedding lookups; tests).
//   quant_moe(x, chosen, weights, gate_up, gate_up_rows, down, down_rows, activation, biases, alpha,
//     limit): a MoE block's experts on their stacked tiles (models/fused_moe.py), only the chosen
//     experts' tiles read.
//   quant_heads(x, stack, rows): x [T, H, K] times H stacked matrices, head by head (MLA's absorptions).
// Packing and unpacking run over ATen's threads, a tile per task.
#include "quant_codes.h"
#include "quant_moe.h"

#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> quant_pack_gguf(const at::Tensor& raw, int64_t type, int64_t k,
                                                               const at::Tensor& rows) {
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.stride(1) == 1 && raw.device().is_cpu(),
              "quant_pack_gguf: raw must be uint8 [rows, row_bytes] with contiguous rows");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "quant_pack_gguf: rows must be int64 [n]");
  const bool k_quant = type == kTypeQ4_K || type == kTypeQ5_K || type == kTypeQ6_K;
  TORCH_CHECK(k % (k_quant ? 256 : 32) == 0, "quant_pack_gguf: ", k, " columns do not fill whole blocks");
  const int64_t block_bytes = type == kTypeQ4_0 ? 18 : type == kTypeQ4_1 ? 20 : type == kTypeQ4_K ? 144
                              : type == kTypeQ5_K ? 176 : type == kTypeMXFP4 ? 17 : 210;
  TORCH_CHECK(raw.size(1) == k / (k_quant ? 256 : 32) * block_bytes, "quant_pack_gguf: rows of ", raw.size(1),
              " bytes for ", k, " columns of type ", type);
  const int64_t n = rows.numel(), stride = raw.stride(0);
  const int64_t* index = rows.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(index[i] >= 0 && index[i] < raw.size(0), "quant_pack_gguf: row ", index[i], " outside the tensor");
  const TileFormat format = format_of_type(type);
  PackedPart p = allocate(n, k, format);
  const uint8_t* base = raw.const_data_ptr<uint8_t>();
  fill(p, n, k, format, [&](int64_t r, RowCodes& codes) { decode_row(base + index[r] * stride, type, k, codes); });
  return {p.data, p.scales, p.extra};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quant_pack(const at::Tensor& q, const at::Tensor& scales,
                                                          const at::Tensor& extra) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2, "quant_pack: q must be uint8 [n, K]");
  const int64_t n = q.size(0), k = q.size(1), groups = k / kGroup;
  const TileFormat format = scales.scalar_type() == at::kChar                         ? TileFormat::kQ6
                            : scales.scalar_type() == at::kByte && scales.dim() == 2 ? TileFormat::kMX4
                            : scales.scalar_type() == at::kByte                      ? TileFormat::kQ4K
                                                                                     : TileFormat::kQ4;
  const bool q6 = format == TileFormat::kQ6;
  TORCH_CHECK(k % kGroup == 0 && (format == TileFormat::kQ4 || format == TileFormat::kMX4 || k % 256 == 0),
              "quant_pack: K must be a multiple of 32 (Q4K, Q6: 256)");
  if (format == TileFormat::kMX4) {
    TORCH_CHECK(scales.sizes() == at::IntArrayRef({n, groups}) && extra.numel() == 0,
                "quant_pack: MX4 takes uint8 E8M0 scales [n, K/32] and an empty extra");
  } else if (format == TileFormat::kQ4K) {
    TORCH_CHECK(scales.sizes() == at::IntArrayRef({n, groups, 2}) && extra.scalar_type() == at::kHalf &&
                    extra.sizes() == at::IntArrayRef({n, k / 256, 2}),
                "quant_pack: Q4K takes uint8 (sc, m) [n, K/32, 2] and float16 (d, dmin) [n, K/256, 2]");
  } else if (q6) {
    TORCH_CHECK(scales.sizes() == at::IntArrayRef({n, k / 16}) && extra.scalar_type() == at::kHalf &&
                    extra.sizes() == at::IntArrayRef({n, k / 256}),
                "quant_pack: Q6 takes int8 scales [n, K/16] and float16 d [n, K/256]");
  } else {
    TORCH_CHECK(scales.scalar_type() == at::kHalf && extra.scalar_type() == at::kHalf &&
                    scales.sizes() == at::IntArrayRef({n, groups}) && extra.sizes() == scales.sizes(),
                "quant_pack: Q4 takes float16 scales and offsets [n, K/32]");
  }
  at::Tensor qc = q.contiguous(), sc = scales.contiguous(), ec = extra.contiguous();
  PackedPart p = allocate(n, k, format);
  fill(p, n, k, format, [&](int64_t r, RowCodes& codes) {
    std::copy_n(qc.const_data_ptr<uint8_t>() + r * k, k, codes.q.data());
    const uint16_t* e = reinterpret_cast<const uint16_t*>(ec.const_data_ptr<at::Half>());
    if (format == TileFormat::kMX4) {
      std::copy_n(sc.const_data_ptr<uint8_t>() + r * groups, groups, codes.sc4.data());
    } else if (format == TileFormat::kQ4K) {
      const uint8_t* sm = sc.const_data_ptr<uint8_t>() + r * groups * 2;
      for (int64_t g = 0; g < groups; ++g) {
        codes.sc4[g] = sm[2 * g];
        codes.m4[g] = sm[2 * g + 1];
      }
      for (int64_t b = 0; b < k / 256; ++b) {
        codes.d[b] = e[r * (k / 256) * 2 + 2 * b];
        codes.dmin[b] = e[r * (k / 256) * 2 + 2 * b + 1];
      }
    } else if (q6) {
      std::copy_n(sc.const_data_ptr<int8_t>() + r * (k / 16), k / 16, codes.sc.data());
      std::copy_n(e + r * (k / 256), k / 256, codes.d.data());
    } else {
      std::copy_n(reinterpret_cast<const uint16_t*>(sc.const_data_ptr<at::Half>()) + r * groups, groups, codes.s.data());
      std::copy_n(e + r * groups, groups, codes.o.data());
    }
  });
  return {p.data, p.scales, p.extra};
}

at::Tensor quant_rows(const std::vector<at::Tensor>& flat, int64_t n, int64_t k, const at::Tensor& ids) {
  TORCH_CHECK(ids.scalar_type() == at::kLong, "quant_rows: ids must be int64");
  const std::vector<TilePart> parts = parts_of(flat, n, k, "quant_rows");
  at::Tensor idc = ids.contiguous();
  const int64_t* id = idc.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < idc.numel(); ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < n, "quant_rows: row ", id[i], " outside the matrix of ", n);
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  at::Tensor out = at::empty(shape, ids.options().dtype(at::kFloat));
  float* o = out.mutable_data_ptr<float>();
  at::parallel_for(0, idc.numel(), 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) matrix_row(parts, id[i], k, o + i * k);
  });
  return out;
}

at::Tensor quant_linear(const at::Tensor& x, const std::vector<at::Tensor>& flat, int64_t n) {
  const int64_t k = x.size(-1);
  const std::vector<TilePart> parts = parts_of(flat, n, k, "quant_linear");
  return linear_output(x, n, k, "quant_linear", [&](const auto* xp, auto* op, int64_t rows) {
    GroupedActivations q = quantize_groups(xp, rows, k);
    const int64_t grain = std::max<int64_t>(1, (1 << 15) / (8 * k));
    at::parallel_for(0, (n + 15) / 16, grain, [&](int64_t t0, int64_t t1) { parts_span(parts, q, rows, n, k, op, t0, t1); });
  });
}

// quant_moe(x, chosen, weights, gate_up, gate_up_rows, down, down_rows, activation, gate_up_bias,
// down_bias, alpha, limit): the experts of a MoE block on their tiles (fused_moe.py). The (token,
// slot) pairs are ordered by expert (experts increasing, each expert's tokens in order) into one
// buffer (an expert with a single pair reads its token's row of x in place); per expert gate_up (+ its bias), the activation, down (+ its bias); each token's sum taken
// over its pairs in that order, so a row's result does not depend on the others. activation "silu":
// gated, silu(gate) * up of the gate rows then the up rows; "relu2": not gated, relu(up)^2
// (NemotronH), gate_up holding the up rows alone; "swiglu_oai": gpt-oss's clamped SwiGLU with alpha
// and limit. Between the two matmuls only plain loops run: at batch 1 the ATen ops the grouping
// took (index_select, cat, the activation's elementwise ops) cost a tenth of the op.
at::Tensor quant_moe(const at::Tensor& x, const at::Tensor& chosen, const at::Tensor& weights,
                     const std::vector<at::Tensor>& gate_up, int64_t gate_up_rows, const std::vector<at::Tensor>& down,
                     int64_t down_rows, c10::string_view activation, const std::optional<at::Tensor>& gate_up_bias,
                     const std::optional<at::Tensor>& down_bias, double alpha, double limit) {
  TORCH_CHECK(x.dim() == 2 && chosen.dim() == 2 && chosen.size(0) == x.size(0) && weights.sizes() == chosen.sizes() &&
                  chosen.scalar_type() == at::kLong && x.device().is_cpu(),
              "quant_moe: x [T, H], chosen and weights [T, k] (int64 ids) on the CPU");
  TORCH_CHECK(activation == "silu" || activation == "relu2" || activation == "swiglu_oai",
              "quant_moe: activation silu, relu2 or swiglu_oai, not ", activation);
  const Activation kind = activation == "silu" ? Activation::kSilu
                          : activation == "relu2" ? Activation::kRelu2 : Activation::kSwigluOai;
  const bool gated = kind != Activation::kRelu2;
  TORCH_CHECK(gate_up_rows % (gated ? 32 : 16) == 0 && down_rows % 16 == 0 && gate_up.size() == 3 && down.size() == 3 &&
                  down_rows == x.size(1),
              "quant_moe: one part a stack, expert rows in whole tiles (gate_up ", gate_up_rows, ", down ", down_rows, ")");
  const int64_t tokens = x.size(0), top = chosen.size(1), hidden = x.size(1), inter = gated ? gate_up_rows / 2 : gate_up_rows;
  const int64_t pairs = tokens * top;
  const ExpertStack up(gate_up, gate_up_rows, hidden), dn(down, down_rows, inter);
  const at::Tensor xf = x.to(at::kFloat).contiguous(), ids = chosen.contiguous();
  const at::Tensor wf = weights.to(at::kFloat).contiguous();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  std::vector<int64_t> order(pairs);  // pair ids (token * top + slot), by expert, each expert's in order
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return id[a] < id[b]; });
  at::Tensor buffer = at::empty({pairs * (hidden + gate_up_rows + inter + hidden)}, xf.options());
  float* rows_in = buffer.mutable_data_ptr<float>();
  float* gu = rows_in + pairs * hidden;
  float* act = gu + pairs * gate_up_rows;
  float* dn_out = act + pairs * inter;
  const float* xp = xf.const_data_ptr<float>();
  std::vector<int64_t> row_expert(pairs);
  for (int64_t r = 0; r < pairs; ++r) row_expert[r] = id[order[r]];
  std::vector<ExpertJob> jobs;
  for (int64_t r = 0; r < pairs;) {
    int64_t end = r;
    while (end < pairs && row_expert[end] == row_expert[r]) ++end;
    // An expert's rows gathered together; one pair reads its token's row of x in place, so
    // experts_matmul quantizes a decode token's row once for all its experts.
    const float* in = xp + order[r] / top * hidden;
    if (end - r > 1) {
      for (int64_t j = r; j < end; ++j)
        std::memcpy(rows_in + j * hidden, xp + order[j] / top * hidden, hidden * sizeof(float));
      in = rows_in + r * hidden;
    }
    jobs.push_back({row_expert[r], end - r, in, gu + r * gate_up_rows, act + r * inter, dn_out + r * hidden});
    r = end;
  }
  const at::Tensor up_bias = gate_up_bias ? gate_up_bias->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor out_bias = down_bias ? down_bias->to(at::kFloat).contiguous() : at::Tensor();
  run_experts(up, dn, jobs, {kind, static_cast<float>(alpha), static_cast<float>(limit),
                             gate_up_bias ? up_bias.const_data_ptr<float>() : nullptr, gate_up_rows, inter});
  at::Tensor out = at::zeros({tokens, hidden}, xf.options());
  float* o = out.mutable_data_ptr<float>();
  const float* w = wf.const_data_ptr<float>();
  const float* down_b = down_bias ? out_bias.const_data_ptr<float>() : nullptr;
  // Each output element sums its token's pairs in expert order: columns split between threads.
  at::parallel_for(0, hidden, std::max<int64_t>(16, (1 << 16) / std::max<int64_t>(1, pairs)), [&](int64_t j0, int64_t j1) {
    for (int64_t r = 0; r < pairs; ++r) {
      const float weight = w[order[r]];
      const float* d = dn_out + r * hidden;
      const float* b = down_b ? down_b + row_expert[r] * hidden : nullptr;
      float* dst = o + order[r] / top * hidden;
      for (int64_t j = j0; j < j1; ++j) dst[j] += weight * (d[j] + (b ? b[j] : 0.f));
    }
  });
  return out.to(x.scalar_type());
}

// quant_heads(x, stack, rows): x [T, H, K] times a stack of H matrices (one part, each `rows` rows
// of whole tiles, [H * rows, K]): out[:, h] = x[:, h] @ matrix_h^T, [T, H, rows] in x's dtype. MLA's
// per-head absorptions (models/deepseek.py: W_UK^T into the query, W_UV out of the latent), every
// head's tiles the tasks of one parallel loop, as quant_moe's experts.
at::Tensor quant_heads(const at::Tensor& x, const std::vector<at::Tensor>& stack, int64_t rows) {
  TORCH_CHECK(x.dim() == 3 && x.device().is_cpu() && rows % 16 == 0 && stack.size() == 3,
              "quant_heads: x [T, H, K] on the CPU, one part of whole 16-row tiles per head");
  const int64_t tokens = x.size(0), heads = x.size(1), k = x.size(2);
  const at::Tensor xh = x.to(at::kFloat).transpose(0, 1).contiguous();  // [H, T, K]: a head's rows together
  at::Tensor out = at::empty({heads, tokens, rows}, xh.options());
  std::vector<ExpertRows> items;
  for (int64_t h = 0; h < heads; ++h)
    items.push_back({h, xh.const_data_ptr<float>() + h * tokens * k, tokens, out.mutable_data_ptr<float>() + h * tokens * rows});
  experts_matmul(ExpertStack(stack, rows, k), items);
  return out.transpose(0, 1).to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hyprefix, m) {
  m.def("quant_linear(Tensor x, Tensor[] parts, int n) -> Tensor");
  m.def("quant_moe(Tensor x, Tensor chosen, Tensor weights, Tensor[] gate_up, int gate_up_rows, Tensor[] down, "
        "int down_rows, str activation, Tensor? gate_up_bias, Tensor? down_bias, float alpha, float limit) -> Tensor");
  m.def("quant_pack(Tensor q, Tensor scales, Tensor extra) -> (Tensor, Tensor, Tensor)");
  m.def("quant_pack_gguf(Tensor raw, int type, int k, Tensor rows) -> (Tensor, Tensor, Tensor)");
  m.def("quant_rows(Tensor[] parts, int n, int k, Tensor ids) -> Tensor");
  m.def("quant_heads(Tensor x, Tensor[] stack, int rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(hyprefix, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_moe", &quant_moe);
  m.impl("quant_pack", &quant_pack);
  m.impl("quant_pack_gguf", &quant_pack_gguf);
  m.impl("quant_rows", &quant_rows);
  m.impl("quant_heads", &quant_heads);
}
