// hyprefix::kv_write_8bit: a step's K or V rows quantized into an 8-bit paged cache
// (models/kv_quant.py has the format and the reference arithmetic this reproduces bit for bit).
//
//   rows   [T, KVH, D] float32 / bfloat16 / float16, the head dim contiguous
//   cache  [blocks, block_size, KVH, D + 2] int8 or float8_e4m3fn, contiguous (written in place)
//   slots  [T] int64: row t goes to flat slot slots[t] (block * block_size + offset)
//
// Per (token, head): scale = float16(max |x| / largest) (127; 448 for E4M3), codes = x times
// 1 / float(scale), rounded half to even (int8, clamped to +-127) or converted as torch converts
// to float8_e4m3fn (clamped to +-448 first), a zero row all zeros. The scale's float16 bits go in the
// row's last two bytes. One op, not torch ops in the step: Inductor fuses a float16 round trip
// away (so a compiled step's codes would differ from an eager step's), and the eager ops cost
// ~10 calls a layer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

template <typename T, typename Code>
void quantize_row(const T* x, int64_t d, uint8_t* dst) {
  constexpr float largest = std::is_same_v<Code, int8_t> ? 127.f : 448.f;
  float top = 0.f;
  for (int64_t i = 0; i < d; ++i) top = std::max(top, std::abs(static_cast<float>(x[i])));
  const c10::Half scale(top / largest);
  const float divisor = static_cast<float>(scale);
  const float inverse = divisor > 0.f ? 1.f / divisor : 0.f;
  for (int64_t i = 0; i < d; ++i) {
    const float v = static_cast<float>(x[i]) * inverse;
    if constexpr (std::is_same_v<Code, int8_t>) {
      const int8_t c = static_cast<int8_t>(std::clamp(std::nearbyint(v), -127.f, 127.f));
      std::memcpy(dst + i, &c, 1);
    } else {
      const c10::Float8_e4m3fn c(std::clamp(v, -largest, largest));
      std::memcpy(dst + i, &c, 1);
    }
  }
  const uint16_t bits = scale.x;
  std::memcpy(dst + d, &bits, 2);  // little-endian, as kv_quant reads it
}

void kv_write_8bit(const at::Tensor& rows, at::Tensor& cache, const at::Tensor& slots) {
  TORCH_CHECK(rows.dim() == 3 && cache.dim() == 4 && rows.device().is_cpu() && cache.device().is_cpu(),
              "kv_write_8bit: rows [T, KVH, D] and cache [blocks, block_size, KVH, D + 2] on the CPU");
  TORCH_CHECK(cache.scalar_type() == at::kChar || cache.scalar_type() == at::kFloat8_e4m3fn,
              "kv_write_8bit: the cache must be int8 or float8_e4m3fn");
  TORCH_CHECK(cache.is_contiguous() && cache.size(2) == rows.size(1) && cache.size(3) == rows.size(2) + 2,
              "kv_write_8bit: a contiguous cache of rows D + 2 wide for the rows' KVH and D");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.numel() == rows.size(0),
              "kv_write_8bit: slots must be int64 [T]");
  const int64_t tokens = rows.size(0), heads = rows.size(1), d = rows.size(2), width = d + 2;
  const int64_t capacity = cache.size(0) * cache.size(1);
  const at::Tensor rc = rows.contiguous(), sc = slots.contiguous();
  const int64_t* slot = sc.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "kv_write_8bit: slot ", slot[t], " outside the cache");
  uint8_t* base = static_cast<uint8_t*>(cache.data_ptr());
  const bool int8 = cache.scalar_type() == at::kChar;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* x = rc.const_data_ptr<T>();
    at::parallel_for(0, tokens * heads, std::max<int64_t>(1, 4096 / width), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        uint8_t* dst = base + (slot[r / heads] * heads + r % heads) * width;
        if (int8) {
          quantize_row<T, int8_t>(x + r * d, d, dst);
        } else {
          quantize_row<T, c10::Float8_e4m3fn>(x + r * d, d, dst);
        }
      }
    });
  };
  switch (rows.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "kv_write_8bit: rows must be float32, bfloat16 or float16");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hyprefix, m) { m.def("kv_write_8bit(Tensor rows, Tensor(a!) cache, Tensor slots) -> ()"); }

TORCH_LIBRARY_IMPL(hyprefix, CPU, m) { m.impl("kv_write_8bit", &kv_write_8bit); }
