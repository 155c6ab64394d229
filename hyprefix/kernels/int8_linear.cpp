// hyprefix::int8_linear: x [.., K] (float32 or bfloat16) @ int8 weight [N, K]^T, built for
// AVX512-VNNI or for AVX2 (one build per ISA, picked by the flags it is compiled with).
//
// The activations are quantized to int8 per group of 32 (scale = max|x| / 127, rounded to
// nearest even), as llama.cpp does for its Q8_0 dot products; the weight keeps its own scales
// (one per row, or one per group of 32: GGUF Q8_0's blocks).
//
// The weight is packed in tiles of 16 rows: uint8 [N/16, K/4, 16, 4], so one 64-byte line is
// 4 consecutive k of 16 rows; the bytes are w + 128 for VNNI, w itself (in [-127, 127]) for
// AVX2. Scales are float16 [N/16, K/32, 16] per group (Q8_0's own precision), or float32
// [N/16 * 16] per row (applied at the end). Each group of 32 is summed exactly in int32, then
// scaled (activation scale times the 16 rows' weight scales) and summed in float.
//
// AVX512-VNNI: one VPDPBUSD with the 4 activation bytes broadcast adds a line into the 16
// rows' own int32 lanes; a group is 8 such instructions into one accumulator, which starts
// at -128 * sum(x_q) of the group (the + 128 of the weight bytes, taken back exactly).
// AVX2 (no int8 dot product): each 32-byte half of a line (8 rows) is multiplied by VPMADDUBSW
// as |x| (unsigned, shared by every tile) times w with x's sign (VPSIGNB), whose pairs (at most
// 2 * 127 * 127) cannot saturate int16, then VPMADDWD adds the pairs into the 8 rows' int32
// lanes. w's sign flip would wrap at -128, so those tiles hold no -128 (``pack`` makes it -127,
// a value neither llama.cpp's Q8_0 nor ``quantize_int8`` writes).
//
// Tiles are split over ATen's intra-op threads; up to 4 activation rows share each weight
// load, so prefill-sized calls run as an int8 GEMM.
#include "int8_tiles.h"

#include <torch/library.h>

namespace {

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales, int64_t n) {
  TORCH_CHECK(tiles.device().is_cpu() && scales.device().is_cpu(), "int8_linear: CPU tensors only");
  const bool per_group = check_tiles(tiles, scales, n, "int8_linear");
  const int64_t k = tiles.size(1) * 4;
  at::Tensor pc = tiles.contiguous(), sc = scales.contiguous();
  return linear_output(x, n, k, "int8_linear", [&](const auto* xp, auto* op, int64_t rows) {
    GroupedActivations q = quantize_groups(xp, rows, k);
    if (per_group) {
      run_tiles<true>(q, pc.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(sc.data_ptr<at::Half>()), rows,
                      n, k, op);
    } else {
      run_tiles<false>(q, pc.data_ptr<uint8_t>(), sc.data_ptr<float>(), rows, n, k, op);
    }
  });
}

}  // namespace

TORCH_LIBRARY(hyprefix, m) {
  m.def("int8_linear(Tensor x, Tensor tiles, Tensor scales, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(hyprefix, CPU, m) {
  m.impl("int8_linear", &int8_linear);
}
