// hyprefix::decode_attention: one query token per row over its paged K/V, read in place
// through its block table (no gather, no padding, no mask tensor).
//
//   q            [B, H, D]                 float32 / bfloat16 / float16
//   k/v_cache    [blocks, block_size, KVH, D], contiguous, q's dtype; or both 8-bit packed rows
//                [blocks, block_size, KVH, D + 2] of int8 / float8_e4m3fn (see below)
//   tables       [B, W] int64: row b's key slot j lives in block tables[b, j / block_size]
//   context_lens [B] int64
//   first_pos    [B] int64 or None (0): slot j holds position j + first_pos[b]
//   window       0, or a sliding window: slot j is visible when its position is
//                < context_lens[b] and, with a window, >= context_lens[b] - window
//   v_dim        0, or each head's output is the first v_dim values of its attention
//   -> out [B, H, v_dim or D] in q's dtype, lse [B, H] float32 (-inf where a row sees no key, with out 0)
//
// A task is one row and one run of whole blocks of its visible keys, every KV head: a block's
// K (then V) rows of all heads lie together, so the task reads each block as one contiguous
// stretch of memory (software prefetch of the next block did not pay here). Per KV head, the
// group's query heads (GQA) share each K/V row load: scores q_g . k_j for the run (float32),
// their max, exp and sum, then sum_j p_gj v_j, with the query vectors and the output
// accumulators in registers for a head dim of 64, 128 or 256. Threads take runs from a shared
// counter; partial results merge through their max and sum (the log-sum-exp). A very short
// context runs on the calling thread.
//
// A latent cache (MLA: v_cache is k_cache, the same memory, and one KV head of D values,
// DeepSeek's [c, k_pe], 576) takes its own arithmetic in the same tasks and merge (latent_attention.h):
// each key row is read once for all H query heads, scores [H, n] = Q K^T and out[H, :v_dim] +=
// P K[:, :v_dim] as register-tiled GEMMs over chunks of rows with an online softmax between, and
// only the v_dim values (the latent c) are accumulated, merged and returned. Its runs hold at
// least latent::kRunWork (key, head) pairs: the work is compute, not load latency (the fixed
// runs of run_blocks > 0 as they are). Another cache with v_dim set computes every value and
// returns the first v_dim.
//
//   run_blocks   0: runs as above, sized by the thread count and the widest row; > 0 (the
//                batch-invariant mode): runs of that many blocks at fixed positions, so a row's
//                result is the same bits whatever the other rows, their number and the threads
//                (DecodeWork's fixed plan); with many rows a thread takes whole rows.
//
// An 8-bit cache (--kv-cache-dtype int8 / fp8_e4m3; hyprefix/models/kv_quant.py has the format):
// each (token, KV head) row is D codes and its float16 scale, read in place like any other row,
// each row dequantized as it is loaded into registers (code * scale in float32, exact:
// kv8_rows.h), then the same arithmetic, so the result is the float32 path's over
// kv_quant.dequantize_rows of the cache. A latent cache of packed rows dequantizes each chunk of
// rows it reads into its float32 scratch (latent_attention.h), with the same result.
#include "decode_attention.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <optional>

namespace {

template <typename T, typename C>
void attend(const Shape& s, const T* q, const C* k_cache, const C* v_cache, const int64_t* tables,
            const int64_t* context_lens, const int64_t* first_pos, int64_t run_blocks, T* out, float* lse) {
  const int64_t threads = at::get_num_threads();
  DecodeWork<T, C> work(s, q, k_cache, v_cache, tables, context_lens, first_pos, threads, run_blocks);
  if (work.per_row) {  // the last rows first: a prefill's later tokens see the most keys
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      Scratch w;
      for (int64_t i = next.fetch_add(1); i < s.rows; i = next.fetch_add(1)) {
        const int64_t b = s.rows - 1 - i;
        work.row(b, w, out + b * s.heads * s.vd(), lse + b * s.heads);
      }
    });
    return;
  }
  if (work.serial) {
    Scratch w;
    for (int64_t t = 0; t < work.tasks; ++t) work.task(t, w);
  } else {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      Scratch w;
      for (int64_t t = next.fetch_add(1); t < work.tasks; t = next.fetch_add(1)) work.task(t, w);
    });
  }
  std::vector<float> merged(s.vd());
  for (int64_t b = 0; b < s.rows; ++b)
    for (int64_t head = 0; head < s.heads; ++head)
      work.merge(b, head, out + (b * s.heads + head) * s.vd(), lse + b * s.heads + head, merged.data());
}

// The caches' shapes and dtypes against q's: q's dtype, or 8-bit packed rows (kv8_rows.h).
void check_caches(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "decode_attention: q must be [rows, heads, dim] and the caches [blocks, block_size, kv_heads, dim]");
  const at::ScalarType cache_type = k_cache.scalar_type();
  const bool packed = cache_type == at::kChar || cache_type == at::kFloat8_e4m3fn;
  TORCH_CHECK(v_cache.scalar_type() == cache_type,
              "decode_attention: k_cache and v_cache must share a dtype (", cache_type, " and ",
              v_cache.scalar_type(), ")");
  TORCH_CHECK(packed || q.scalar_type() == cache_type,
              "decode_attention: q and the caches must share a dtype, or the caches hold 8-bit packed rows "
              "(int8 / float8_e4m3fn)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && q.stride(2) == 1,
              "decode_attention: the caches must be contiguous and q's head dim too");
  // A packed row: D codes, then the scale's two bytes.
  const int64_t extra = packed ? 2 : 0;
  TORCH_CHECK(q.size(2) + extra == k_cache.size(3),
              "decode_attention: head dims do not match (q's ", q.size(2), ", the caches' rows ", k_cache.size(3),
              packed ? ": packed 8-bit rows hold head dim + 2 elements)" : ")");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "decode_attention: head counts do not match (", q.size(1),
              " query heads over ", k_cache.size(2), " KV heads)");
}

std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                    const at::Tensor& v_cache, const at::Tensor& tables,
                                                    const at::Tensor& context_lens,
                                                    const std::optional<at::Tensor>& first_pos, double scale,
                                                    int64_t window, int64_t run_blocks, int64_t v_dim) {
  TORCH_CHECK(run_blocks >= 0, "decode_attention: run_blocks must be >= 0");
  check_caches(q, k_cache, v_cache);
  TORCH_CHECK(v_dim >= 0 && v_dim <= q.size(2), "decode_attention: v_dim must be in [0, head dim]");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) && tables.stride(1) == 1 &&
                  tables.scalar_type() == at::kLong,
              "decode_attention: tables must be int64 [rows, width] with contiguous rows");
  TORCH_CHECK(context_lens.is_contiguous() && context_lens.numel() == q.size(0) &&
                  context_lens.scalar_type() == at::kLong,
              "decode_attention: context_lens must be int64 [rows]");
  const int64_t* first = nullptr;
  if (first_pos.has_value()) {
    TORCH_CHECK(first_pos->is_contiguous() && first_pos->numel() == q.size(0) &&
                    first_pos->scalar_type() == at::kLong,
                "decode_attention: first_pos must be int64 [rows]");
    first = first_pos->const_data_ptr<int64_t>();
  }
  Shape s{q.size(0), q.size(1), q.size(2), k_cache.size(2), q.size(1) / k_cache.size(2), k_cache.size(1),
          tables.size(1), q.stride(0), q.stride(1), tables.stride(0), window, static_cast<float>(scale)};
  // K is V (the same memory) with one KV head: a latent cache, whose rows every head reads once.
  s.latent = k_cache.data_ptr() == v_cache.data_ptr() && s.kv_heads == 1;
  s.value_dim = v_dim;
  const int64_t width = v_dim > 0 ? v_dim : s.dim;
  at::Tensor out = at::empty({s.rows, s.heads, s.vd()}, q.options());
  at::Tensor lse = at::empty({s.rows, s.heads}, q.options().dtype(at::kFloat));
  if (s.rows == 0) return {at::empty({0, s.heads, width}, q.options()), lse};
  // T: q's type; C: the caches' element, T or a packed code (its bytes read as that type).
  auto run = [&](auto q_tag, auto cache_tag) {
    using T = decltype(q_tag);
    using C = decltype(cache_tag);
    attend(s, q.const_data_ptr<T>(), static_cast<const C*>(k_cache.const_data_ptr()),
           static_cast<const C*>(v_cache.const_data_ptr()), tables.const_data_ptr<int64_t>(),
           context_lens.const_data_ptr<int64_t>(), first, run_blocks, out.mutable_data_ptr<T>(),
           lse.mutable_data_ptr<float>());
  };
  auto with_cache = [&](auto q_tag) {
    using T = decltype(q_tag);
    switch (k_cache.scalar_type()) {
      case at::kChar: run(q_tag, Int8Code{}); break;
      case at::kFloat8_e4m3fn: run(q_tag, E4m3Code{}); break;
      default: run(q_tag, T{});
    }
  };
  switch (q.scalar_type()) {
    case at::kFloat: with_cache(float{}); break;
    case at::kBFloat16: with_cache(c10::BFloat16{}); break;
    case at::kHalf: with_cache(c10::Half{}); break;
    default: TORCH_CHECK(false, "decode_attention: q must be float32, bfloat16 or float16");
  }
  if (s.vd() != width) out = out.narrow(2, 0, width).contiguous();  // another cache: its heads' first v_dim
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hyprefix, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor context_lens, "
        "Tensor? first_pos, float scale, int window, int run_blocks=0, int v_dim=0) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hyprefix, CPU, m) { m.impl("decode_attention", &decode_attention); }
