// hyprefix::kv_write_8bit and kv_write_8bit_stored: a step's K or V rows quantized into an 8-bit
// paged cache (models/kv_quant.py has the format and the reference arithmetic this reproduces bit
// for bit).
//
//   rows   [T, KVH, D] float32 / bfloat16 / float16, the head dim contiguous
//   cache  [blocks, block_size, KVH, D + 2] int8 or float8_e4m3fn, contiguous (written in place)
//   slots  [W] int64: the W rows written go to flat slots slots[w] (block * block_size + offset)
//   index  (the _stored op; optional) [W] int64: which of the T rows those are (None: W == T, in order)
//
// Per (token, head): scale = float16(max |x| / largest) (127; 448 for E4M3), codes = x times
// 1 / float(scale), rounded half to even (int8, clamped to +-127) or converted as torch converts
// to float8_e4m3fn (clamped to +-448 first), a zero row all zeros. The scale's float16 bits go in the
// row's last two bytes. kv_write_8bit_stored also returns every row of ``rows`` as the cache holds it,
// read back (code * float(scale), float32 [T, KVH, D]): what a prefill's attention reads of its own
// rows, in the same pass (kv_quant.as_stored in torch ops cost a prefill ~10 calls a layer).
// One op, not torch ops in the step: Inductor fuses a float16 round trip away (so a compiled step's
// codes would differ from an eager step's). Built per ISA on ATen's vector types (build.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// max |x| of x[0, d): exact in any order (a max rounds nothing)
float largest_magnitude(const float* x, int64_t d) {
  int64_t i = 0;
  float top = 0.f;
  if (d >= Vec::size()) {
    Vec acc(0.f);
    for (; i + Vec::size() <= d; i += Vec::size()) acc = at::vec::maximum(acc, Vec::loadu(x + i).abs());
    float lanes[Vec::size()];
    acc.store(lanes);
    for (int64_t j = 0; j < Vec::size(); ++j) top = std::max(top, lanes[j]);
  }
  for (; i < d; ++i) top = std::max(top, std::abs(x[i]));
  return top;
}

// int8 codes of x * inverse, rounded half to even and clamped, into codes; the values they
// stand for (code * divisor) into stored where it is not null
void int8_codes(const float* x, int64_t d, float inverse, float divisor, int8_t* codes, float* stored) {
  const Vec inv(inverse), low(-127.f), high(127.f), div(divisor);
  int64_t i = 0;
  float rounded[Vec::size()];
  for (; i + Vec::size() <= d; i += Vec::size()) {
    const Vec r = at::vec::clamp((Vec::loadu(x + i) * inv).round(), low, high);
    if (stored != nullptr) (r * div).store(stored + i);
    r.store(rounded);
    for (int64_t j = 0; j < Vec::size(); ++j) codes[i + j] = static_cast<int8_t>(rounded[j]);
  }
  for (; i < d; ++i) {
    const float r = std::clamp(std::nearbyint(x[i] * inverse), -127.f, 127.f);
    codes[i] = static_cast<int8_t>(r);
    if (stored != nullptr) stored[i] = r * divisor;
  }
}

void e4m3_codes(const float* x, int64_t d, float inverse, float divisor, uint8_t* codes, float* stored) {
  for (int64_t i = 0; i < d; ++i) {
    const c10::Float8_e4m3fn c(std::clamp(x[i] * inverse, -448.f, 448.f));
    std::memcpy(codes + i, &c, 1);
    if (stored != nullptr) stored[i] = static_cast<float>(c) * divisor;
  }
}

// One (token, head) row x (float32) packed into dst (D codes, then the scale's bits); its
// values as stored into stored where not null.
void quantize_row(const float* x, int64_t d, bool int8, uint8_t* dst, float* stored) {
  const float largest = int8 ? 127.f : 448.f;
  const c10::Half scale(largest_magnitude(x, d) / largest);
  const float divisor = static_cast<float>(scale);
  const float inverse = divisor > 0.f ? 1.f / divisor : 0.f;
  if (int8) {
    int8_codes(x, d, inverse, divisor, reinterpret_cast<int8_t*>(dst), stored);
  } else {
    e4m3_codes(x, d, inverse, divisor, dst, stored);
  }
  const uint16_t bits = scale.x;
  std::memcpy(dst + d, &bits, 2);  // little-endian, as kv_quant reads it
}

void check(const at::Tensor& rows, const at::Tensor& cache, const at::Tensor& slots,
           const std::optional<at::Tensor>& index) {
  TORCH_CHECK(rows.dim() == 3 && cache.dim() == 4 && rows.device().is_cpu() && cache.device().is_cpu(),
              "kv_write_8bit: rows [T, KVH, D] and cache [blocks, block_size, KVH, D + 2] on the CPU");
  TORCH_CHECK(cache.scalar_type() == at::kChar || cache.scalar_type() == at::kFloat8_e4m3fn,
              "kv_write_8bit: the cache must be int8 or float8_e4m3fn");
  TORCH_CHECK(cache.is_contiguous() && cache.size(2) == rows.size(1) && cache.size(3) == rows.size(2) + 2,
              "kv_write_8bit: a contiguous cache of rows D + 2 wide for the rows' KVH and D");
  TORCH_CHECK(rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kBFloat16 ||
                  rows.scalar_type() == at::kHalf,
              "kv_write_8bit: rows must be float32, bfloat16 or float16");
  const int64_t written = index.has_value() ? index->numel() : rows.size(0);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.numel() == written,
              "kv_write_8bit: slots must be int64 [W], one per row written");
  if (index.has_value())
    TORCH_CHECK(index->scalar_type() == at::kLong && index->dim() == 1, "kv_write_8bit: index must be int64 [W]");
}

// Each row's slot (-1: not written), checked against the cache and the rows.
std::vector<int64_t> slot_of_rows(const at::Tensor& slots, const std::optional<at::Tensor>& index, int64_t tokens,
                                  int64_t capacity) {
  const at::Tensor sc = slots.contiguous();
  const int64_t* slot = sc.const_data_ptr<int64_t>();
  std::vector<int64_t> out(tokens, index.has_value() ? -1 : 0);
  const at::Tensor ic = index.has_value() ? index->contiguous() : at::Tensor();
  for (int64_t w = 0; w < sc.numel(); ++w) {
    TORCH_CHECK(slot[w] >= 0 && slot[w] < capacity, "kv_write_8bit: slot ", slot[w], " outside the cache");
    const int64_t t = index.has_value() ? ic.const_data_ptr<int64_t>()[w] : w;
    TORCH_CHECK(t >= 0 && t < tokens, "kv_write_8bit: index ", t, " outside the rows");
    out[t] = slot[w];
  }
  return out;
}

at::Tensor write(const at::Tensor& rows, at::Tensor& cache, const at::Tensor& slots,
                 const std::optional<at::Tensor>& index, bool want_stored) {
  check(rows, cache, slots, index);
  const int64_t tokens = rows.size(0), heads = rows.size(1), d = rows.size(2), width = d + 2;
  const std::vector<int64_t> slot = slot_of_rows(slots, index, tokens, cache.size(0) * cache.size(1));
  const at::Tensor values = rows.to(at::kFloat).contiguous();  // no copy for float32 rows
  at::Tensor stored = want_stored ? at::empty({tokens, heads, d}, rows.options().dtype(at::kFloat)) : at::Tensor();
  const float* x = values.const_data_ptr<float>();
  float* back = want_stored ? stored.data_ptr<float>() : nullptr;
  uint8_t* base = static_cast<uint8_t*>(cache.data_ptr());
  const bool int8 = cache.scalar_type() == at::kChar;
  at::parallel_for(0, tokens * heads, std::max<int64_t>(1, 16384 / width), [&](int64_t r0, int64_t r1) {
    std::vector<uint8_t> scratch(width);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t s = slot[r / heads];
      if (s < 0 && back == nullptr) continue;
      uint8_t* dst = s >= 0 ? base + (s * heads + r % heads) * width : scratch.data();
      quantize_row(x + r * d, d, int8, dst, back == nullptr ? nullptr : back + r * d);
    }
  });
  return stored;
}

void kv_write_8bit(const at::Tensor& rows, at::Tensor& cache, const at::Tensor& slots) {
  write(rows, cache, slots, std::nullopt, false);
}

at::Tensor kv_write_8bit_stored(const at::Tensor& rows, at::Tensor& cache, const at::Tensor& slots,
                                const std::optional<at::Tensor>& index) {
  return write(rows, cache, slots, index, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hyprefix, m) {
  m.def("kv_write_8bit(Tensor rows, Tensor(a!) cache, Tensor slots) -> ()");
  m.def("kv_write_8bit_stored(Tensor rows, Tensor(a!) cache, Tensor slots, Tensor? index) -> Tensor");
}

TORCH_LIBRARY_IMPL(hyprefix, CPU, m) {
  m.impl("kv_write_8bit", &kv_write_8bit);
  m.impl("kv_write_8bit_stored", &kv_write_8bit_stored);
}
