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
// Packing and unpacking run over ATen's threads, a tile per task.
#include "quant_tiles.h"

#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstring>
#include <map>

namespace {

constexpr int64_t kTypeQ4_0 = 2, kTypeQ4_1 = 3, kTypeQ5_K = 13, kTypeQ4_K = 12, kTypeQ6_K = 14;

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline uint16_t half_bits(float v) { return c10::Half(v).x; }

// One row unpacked: q per column, and per group (Q4: s, o as float16 bits; Q4K: sc, m codes) or per
// run of 16 (Q6: int8 scales) and per 256 (Q6: float16 d bits; Q4K: d and dmin bits).
struct RowCodes {
  std::vector<uint8_t> q;
  std::vector<uint16_t> s, o;    // Q4 per 32
  std::vector<uint8_t> sc4, m4;  // Q4K per 32
  std::vector<int8_t> sc;        // Q6 per 16
  std::vector<uint16_t> d, dmin;  // Q6 (d) and Q4K per 256
};

// The tile format a GGUF type is packed into.
inline TileFormat format_of_type(int64_t type) {
  return type == kTypeQ6_K ? TileFormat::kQ6 : type == kTypeQ4_K ? TileFormat::kQ4K : TileFormat::kQ4;
}

// Q4_K / Q5_K's 6-bit scale and min of sub-block j from the 12 packed bytes.
inline void scale_min_k4(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Group g of a row (32 values s * q5 + o with q5 < 32) to 4 bits: the span of its codes mapped onto 0..15.
inline void round_q5_group(uint8_t* q, float s, float o, RowCodes& out, int64_t g) {
  int lo = 31, hi = 0;
  for (int i = 0; i < 32; ++i) {
    lo = std::min<int>(lo, q[i]);
    hi = std::max<int>(hi, q[i]);
  }
  const float step = hi - lo <= 15 ? 1.0f : static_cast<float>(hi - lo) / 15.0f;
  for (int i = 0; i < 32; ++i) q[i] = static_cast<uint8_t>(std::lround((q[i] - lo) / step));
  out.s[g] = half_bits(s * step);
  out.o[g] = half_bits(o + s * static_cast<float>(lo));
}

// Decodes one GGUF row of k values of `type` into codes (q, s, o for Q4; q, sc, d for Q6).
void decode_row(const uint8_t* row, int64_t type, int64_t k, RowCodes& out) {
  uint8_t* q = out.q.data();
  if (type == kTypeQ4_0 || type == kTypeQ4_1) {
    const int64_t bytes = type == kTypeQ4_0 ? 18 : 20;
    for (int64_t b = 0; b < k / 32; ++b) {
      const uint8_t* blk = row + b * bytes;
      const float d = half_at(blk);
      const uint8_t* qs = blk + (type == kTypeQ4_0 ? 2 : 4);
      for (int j = 0; j < 16; ++j) {
        q[b * 32 + j] = qs[j] & 0xF;
        q[b * 32 + j + 16] = qs[j] >> 4;
      }
      out.s[b] = half_bits(d);
      out.o[b] = type == kTypeQ4_0 ? half_bits(-8.0f * d) : half_bits(half_at(blk + 2));
    }
    return;
  }
  if (type == kTypeQ4_K || type == kTypeQ5_K) {
    const int64_t bytes = type == kTypeQ4_K ? 144 : 176;
    for (int64_t b = 0; b < k / 256; ++b) {
      const uint8_t* blk = row + b * bytes;
      const float d = half_at(blk), dmin = half_at(blk + 2);
      if (type == kTypeQ4_K) {
        std::memcpy(&out.d[b], blk, 2);
        std::memcpy(&out.dmin[b], blk + 2, 2);
      }
      const uint8_t* scales = blk + 4;
      const uint8_t* qh = blk + 16;  // Q5_K only
      const uint8_t* qs = blk + (type == kTypeQ4_K ? 16 : 48);
      for (int c = 0; c < 4; ++c) {
        for (int half = 0; half < 2; ++half) {
          const int j = 2 * c + half;
          int sc, m;
          scale_min_k4(j, scales, &sc, &m);
          uint8_t* dst = q + b * 256 + j * 32;
          for (int l = 0; l < 32; ++l) {
            int v = half ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 0xF;
            if (type == kTypeQ5_K) v += ((qh[l] >> j) & 1) << 4;
            dst[l] = static_cast<uint8_t>(v);
          }
          const int64_t g = b * 8 + j;
          if (type == kTypeQ4_K) {
            out.sc4[g] = static_cast<uint8_t>(sc);
            out.m4[g] = static_cast<uint8_t>(m);
          } else {
            round_q5_group(dst, d * static_cast<float>(sc), -dmin * static_cast<float>(m), out, g);
          }
        }
      }
    }
    return;
  }
  TORCH_CHECK(type == kTypeQ6_K, "quant_pack_gguf: ggml type ", type, " is not one of Q4_0, Q4_1, Q4_K, Q5_K, Q6_K");
  for (int64_t b = 0; b < k / 256; ++b) {
    const uint8_t* blk = row + b * 210;
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    out.d[b] = half_bits(half_at(blk + 208));
    for (int j = 0; j < 16; ++j) out.sc[b * 16 + j] = sc[j];
    uint8_t* y = q + b * 256;
    for (int n = 0; n < 2; ++n) {  // halves of 128: ql 64 bytes, qh 32 bytes each
      for (int l = 0; l < 32; ++l) {
        y[l] = (ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4);
        y[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
        y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
        y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
      }
      y += 128;
      ql += 64;
      qh += 32;
    }
  }
}

// Row r of a tile (of format Q4, Q4K or Q6) from its codes: the data bytes of the row, and its
// scales and extras into the tile's (scales, extra).
void place_row(const RowCodes& codes, TileFormat format, int64_t k, int64_t r, uint8_t* tile, void* tile_scales,
               uint16_t* tile_extra) {
  const int64_t groups = k / kGroup;
  const bool q6 = format == TileFormat::kQ6;
  const uint8_t* q = codes.q.data();
  for (int64_t g = 0; g < groups; ++g) {
    uint8_t* wg = tile + g * (q6 ? 384 : 256);
    const uint8_t* qg = q + g * kGroup;
    for (int p = 0; p < 4; ++p)
      for (int b = 0; b < 4; ++b)
        wg[p * 64 + r * 4 + b] = (qg[8 * p + b] & 0xF) | ((qg[8 * p + 4 + b] & 0xF) << 4);
    if (q6) {
      for (int c = 0; c < 2; ++c)
        for (int b = 0; b < 4; ++b) {
          uint8_t v = 0;
          for (int i = 0; i < 4; ++i) v |= ((qg[16 * c + 4 * i + b] >> 4) & 3) << (2 * i);
          wg[(4 + c) * 64 + r * 4 + b] = v;
        }
      int8_t* sc = static_cast<int8_t*>(tile_scales);
      sc[(2 * g) * 16 + r] = codes.sc[2 * g];
      sc[(2 * g + 1) * 16 + r] = codes.sc[2 * g + 1];
    } else if (format == TileFormat::kQ4K) {
      uint8_t* sm = static_cast<uint8_t*>(tile_scales) + g * 32;
      sm[r] = codes.sc4[g];
      sm[16 + r] = codes.m4[g];
    } else {
      static_cast<uint16_t*>(tile_scales)[g * 16 + r] = codes.s[g];
      tile_extra[g * 16 + r] = codes.o[g];
    }
  }
  if (q6)
    for (int64_t b = 0; b < k / 256; ++b) tile_extra[b * 16 + r] = codes.d[b];
  if (format == TileFormat::kQ4K)
    for (int64_t b = 0; b < k / 256; ++b) {
      tile_extra[b * 32 + r] = codes.d[b];
      tile_extra[b * 32 + 16 + r] = codes.dmin[b];
    }
}

struct PackedPart {
  at::Tensor data, scales, extra;
};

PackedPart allocate(int64_t n, int64_t k, TileFormat format) {
  const int64_t tiles = (n + 15) / 16, groups = k / kGroup;
  auto bytes = at::TensorOptions().dtype(at::kByte);
  PackedPart p;
  p.data = at::zeros({tiles, groups, format == TileFormat::kQ6 ? 6 : 4, 64}, bytes);
  if (format == TileFormat::kQ6) {
    p.scales = at::zeros({tiles, 2 * groups, 16}, bytes.dtype(at::kChar));
    p.extra = at::zeros({tiles, k / 256, 16}, bytes.dtype(at::kHalf));
  } else if (format == TileFormat::kQ4K) {
    p.scales = at::zeros({tiles, groups, 32}, bytes);
    p.extra = at::zeros({tiles, k / 256, 32}, bytes.dtype(at::kHalf));
  } else {
    p.scales = at::zeros({tiles, groups, 16}, bytes.dtype(at::kHalf));
    p.extra = at::zeros({tiles, groups, 16}, bytes.dtype(at::kHalf));
  }
  return p;
}

// Fills p's tiles, a task per tile, with decode(row, codes) giving each row's codes.
template <typename Decode>
void fill(PackedPart& p, int64_t n, int64_t k, TileFormat format, const Decode& decode) {
  const int64_t groups = k / kGroup;
  uint8_t* data = p.data.mutable_data_ptr<uint8_t>();
  uint8_t* scales = static_cast<uint8_t*>(p.scales.mutable_data_ptr());
  uint16_t* extra = reinterpret_cast<uint16_t*>(p.extra.mutable_data_ptr<at::Half>());
  at::parallel_for(0, p.data.size(0), 1, [&](int64_t t0, int64_t t1) {
    RowCodes codes;
    codes.q.resize(k);
    codes.s.resize(groups);
    codes.o.resize(groups);
    codes.sc4.resize(groups);
    codes.m4.resize(groups);
    codes.sc.resize(2 * groups);
    codes.d.resize(k / 256 + 1);
    codes.dmin.resize(k / 256 + 1);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t r = 0; r < 16 && t * 16 + r < n; ++r) {
        decode(t * 16 + r, codes);
        place_row(codes, format, k, r, data + t * groups * group_bytes(format),
                  scales + t * scale_bytes_per_tile(format, k), extra + t * extra_per_tile(format, k));
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quant_pack_gguf(const at::Tensor& raw, int64_t type, int64_t k,
                                                               const at::Tensor& rows) {
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.stride(1) == 1 && raw.device().is_cpu(),
              "quant_pack_gguf: raw must be uint8 [rows, row_bytes] with contiguous rows");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "quant_pack_gguf: rows must be int64 [n]");
  const bool k_quant = type == kTypeQ4_K || type == kTypeQ5_K || type == kTypeQ6_K;
  TORCH_CHECK(k % (k_quant ? 256 : 32) == 0, "quant_pack_gguf: ", k, " columns do not fill whole blocks");
  const int64_t block_bytes = type == kTypeQ4_0 ? 18 : type == kTypeQ4_1 ? 20 : type == kTypeQ4_K ? 144
                              : type == kTypeQ5_K ? 176 : 210;
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
  const TileFormat format = scales.scalar_type() == at::kChar   ? TileFormat::kQ6
                            : scales.scalar_type() == at::kByte ? TileFormat::kQ4K
                                                                : TileFormat::kQ4;
  const bool q6 = format == TileFormat::kQ6;
  TORCH_CHECK(k % kGroup == 0 && (format == TileFormat::kQ4 || k % 256 == 0),
              "quant_pack: K must be a multiple of 32 (Q4K, Q6: 256)");
  if (format == TileFormat::kQ4K) {
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
    if (format == TileFormat::kQ4K) {
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

// One projection of stacked experts (a single part, each expert's rows whole tiles): expert e's tiles.
std::vector<TilePart> expert_part(const std::vector<at::Tensor>& stack, int64_t e, int64_t rows, int64_t k) {
  const int64_t tiles = rows / 16;
  std::vector<at::Tensor> slice;
  for (const at::Tensor& t : stack) slice.push_back(t.numel() ? t.narrow(0, e * tiles, tiles) : t);
  return parts_of(slice, rows, k, "quant_moe");
}

// Every used expert's rows of one projection: out_e [n_e, n] = in_e [n_e, k] @ expert_e^T, the
// activations quantized per expert, all experts' tiles as the tasks of one parallel loop.
void experts_matmul(const std::vector<at::Tensor>& stack, int64_t n, int64_t k, const std::vector<int64_t>& experts,
                    const std::vector<at::Tensor>& inputs, std::vector<at::Tensor>& outputs) {
  std::vector<std::vector<TilePart>> parts;
  std::vector<GroupedActivations> q;
  for (size_t i = 0; i < experts.size(); ++i) {
    parts.push_back(expert_part(stack, experts[i], n, k));
    q.push_back(quantize_groups(inputs[i].const_data_ptr<float>(), inputs[i].size(0), k));
    outputs.push_back(at::empty({inputs[i].size(0), n}, inputs[i].options()));
  }
  const int64_t tiles = n / 16, tasks = static_cast<int64_t>(experts.size()) * tiles;
  at::parallel_for(0, tasks, std::max<int64_t>(1, (1 << 15) / (8 * k)), [&](int64_t a, int64_t b) {
    for (int64_t task = a; task < b;) {  // a run of one expert's tiles
      const int64_t i = task / tiles, t0 = task % tiles, t1 = std::min(tiles, t0 + (b - task));
      parts_span(parts[i], q[i], inputs[i].size(0), n, k, outputs[i].mutable_data_ptr<float>(), t0, t1);
      task += t1 - t0;
    }
  });
}

// One expert's activation on its gate_up rows' results gu [n_e, gate_up_rows] (fused_moe.py's activate).
at::Tensor expert_activation(const at::Tensor& gu, c10::string_view activation, int64_t inter, double alpha,
                             double limit) {
  if (activation == "relu2") return at::square(at::relu(gu));
  const at::Tensor gate = gu.narrow(1, 0, inter), up = gu.narrow(1, inter, inter);
  if (activation == "silu") return (at::silu(gate) * up).contiguous();
  const at::Tensor g = gate.clamp_max(limit);  // swiglu_oai (gpt-oss)
  return ((up.clamp(-limit, limit) + 1) * (g * at::sigmoid(g * alpha))).contiguous();
}

// quant_moe(x, chosen, weights, gate_up, gate_up_rows, down, down_rows, activation, gate_up_bias,
// down_bias, alpha, limit): the experts of a MoE block on their tiles (fused_moe.py). Pairs grouped
// by expert (experts in increasing order, each expert's tokens in order); per expert gate_up (+ its
// bias), the activation, down (+ its bias); each token's sum taken over its pairs in expert order,
// so a row's result does not depend on the others. activation "silu": gated, silu(gate) * up of the
// gate rows then the up rows; "relu2": not gated, relu(up)^2 (NemotronH), gate_up holding the up
// rows alone; "swiglu_oai": gpt-oss's clamped SwiGLU with alpha and limit.
at::Tensor quant_moe(const at::Tensor& x, const at::Tensor& chosen, const at::Tensor& weights,
                     const std::vector<at::Tensor>& gate_up, int64_t gate_up_rows, const std::vector<at::Tensor>& down,
                     int64_t down_rows, c10::string_view activation, const std::optional<at::Tensor>& gate_up_bias,
                     const std::optional<at::Tensor>& down_bias, double alpha, double limit) {
  TORCH_CHECK(x.dim() == 2 && chosen.dim() == 2 && chosen.size(0) == x.size(0) && weights.sizes() == chosen.sizes() &&
                  chosen.scalar_type() == at::kLong && x.device().is_cpu(),
              "quant_moe: x [T, H], chosen and weights [T, k] (int64 ids) on the CPU");
  TORCH_CHECK(activation == "silu" || activation == "relu2" || activation == "swiglu_oai",
              "quant_moe: activation silu, relu2 or swiglu_oai, not ", activation);
  const bool gated = activation != "relu2";
  TORCH_CHECK(gate_up_rows % (gated ? 32 : 16) == 0 && down_rows % 16 == 0 && gate_up.size() == 3 && down.size() == 3 &&
                  down_rows == x.size(1),
              "quant_moe: one part a stack, expert rows in whole tiles (gate_up ", gate_up_rows, ", down ", down_rows, ")");
  const int64_t tokens = x.size(0), top = chosen.size(1), hidden = x.size(1), inter = gated ? gate_up_rows / 2 : gate_up_rows;
  const at::Tensor xf = x.to(at::kFloat).contiguous(), ids = chosen.contiguous();
  const at::Tensor wf = weights.to(at::kFloat).contiguous();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  std::map<int64_t, std::vector<int64_t>> pairs;  // expert -> its pairs (token * top + slot), in order
  for (int64_t p = 0; p < tokens * top; ++p) pairs[id[p]].push_back(p);
  std::vector<int64_t> experts;
  std::vector<at::Tensor> rows_in, gate_up_out, act, down_out;
  for (const auto& [e, list] : pairs) {
    experts.push_back(e);
    std::vector<int64_t> token_ids;
    for (const int64_t p : list) token_ids.push_back(p / top);
    rows_in.push_back(xf.index_select(0, at::tensor(token_ids, ids.options())));
  }
  experts_matmul(gate_up, gate_up_rows, hidden, experts, rows_in, gate_up_out);
  const std::optional<at::Tensor> up_bias = gate_up_bias ? std::optional(gate_up_bias->to(at::kFloat)) : std::nullopt;
  const std::optional<at::Tensor> out_bias = down_bias ? std::optional(down_bias->to(at::kFloat)) : std::nullopt;
  for (size_t i = 0; i < experts.size(); ++i) {
    if (up_bias) gate_up_out[i].add_((*up_bias)[experts[i]]);
    act.push_back(expert_activation(gate_up_out[i], activation, inter, alpha, limit));
  }
  experts_matmul(down, down_rows, inter, experts, act, down_out);
  if (out_bias)
    for (size_t i = 0; i < experts.size(); ++i) down_out[i].add_((*out_bias)[experts[i]]);
  at::Tensor out = at::zeros({tokens, hidden}, xf.options());
  float* o = out.mutable_data_ptr<float>();
  const float* w = wf.const_data_ptr<float>();
  for (size_t i = 0; i < experts.size(); ++i) {
    const float* d = down_out[i].const_data_ptr<float>();
    const std::vector<int64_t>& list = pairs[experts[i]];
    for (size_t r = 0; r < list.size(); ++r)
      for (int64_t j = 0; j < hidden; ++j) o[list[r] / top * hidden + j] += w[list[r]] * d[r * hidden + j];
  }
  return out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hyprefix, m) {
  m.def("quant_linear(Tensor x, Tensor[] parts, int n) -> Tensor");
  m.def("quant_moe(Tensor x, Tensor chosen, Tensor weights, Tensor[] gate_up, int gate_up_rows, Tensor[] down, "
        "int down_rows, str activation, Tensor? gate_up_bias, Tensor? down_bias, float alpha, float limit) -> Tensor");
  m.def("quant_pack(Tensor q, Tensor scales, Tensor extra) -> (Tensor, Tensor, Tensor)");
  m.def("quant_pack_gguf(Tensor raw, int type, int k, Tensor rows) -> (Tensor, Tensor, Tensor)");
  m.def("quant_rows(Tensor[] parts, int n, int k, Tensor ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(hyprefix, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_moe", &quant_moe);
  m.impl("quant_pack", &quant_pack);
  m.impl("quant_pack_gguf", &quant_pack_gguf);
  m.impl("quant_rows", &quant_rows);
}
