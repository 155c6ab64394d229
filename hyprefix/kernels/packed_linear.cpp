// hyprefix::packed_linear and hyprefix::packed_gate_up: oneDNN's matmuls over prepacked
// weights (mkldnn::_linear_pointwise, the eager path of models/layers.py) as ops a compiled
// batched decode step calls as extern kernels. Inductor lowers oneDNN's own op only for
// weights frozen into the graph as constants; through these ops the packed weights stay
// graph inputs, and the graph's C++ wrapper calls them through the dispatcher, without Python
// (ops registered from Python behind Inductor's Python wrapper lost to eager).
//
// Given a bfloat16 matrix's tiles too, a call of at most `tile_rows` rows (a decode batch)
// multiplies the tiles instead (hyprefix::bf16_linear, which streams the matrix once and is
// faster than oneDNN's GEMM at those sizes, as eager steps choose in models/weights.py): a graph
// with a symbolic row count cannot branch on it, so the op does.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

namespace {

c10::OperatorHandle op(const char* name, const char* overload) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
}

// x [..., K] @ packed^T + bias, with oneDNN's epilogue `attr` ("none", "swish", "gelu", ...)
// taking no scalars.
at::Tensor linear_pointwise(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                            c10::string_view attr, c10::string_view algorithm) {
  static const c10::OperatorHandle unary = op("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string(attr), c10::List<std::optional<at::Scalar>>(),
                          std::optional<std::string>(std::string(algorithm))};
  unary.callBoxed(&stack);
  return stack[0].toTensor();
}

bool takes_tiles(const at::Tensor& x, const std::optional<at::Tensor>& tiles, int64_t tile_rows) {
  return tiles.has_value() && x.numel() <= tile_rows * x.size(-1);
}

// x @ W^T + bias for the N-row matrix W held as bf16 tiles.
at::Tensor tiled_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t n, const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle bf16_linear = op("hyprefix::bf16_linear", "");
  torch::jit::Stack stack{x, tiles, n, bias};
  bf16_linear.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& tiles, int64_t tile_rows) {
  if (takes_tiles(x, tiles, tile_rows)) return tiled_linear(x, *tiles, packed.size(0), bias);
  return linear_pointwise(x, packed, bias, "none", "");
}

// act(x @ gate^T + gate_bias) * (x @ up^T + up_bias): the activation and the product in the
// two matmuls' epilogues, as GatedMLP runs them eagerly. `tiles`: the fused [gate; up] matrix's.
at::Tensor packed_gate_up(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up,
                          const std::optional<at::Tensor>& gate_bias, const std::optional<at::Tensor>& up_bias,
                          c10::string_view activation, c10::string_view algorithm,
                          const std::optional<at::Tensor>& tiles, int64_t tile_rows) {
  if (takes_tiles(x, tiles, tile_rows)) {
    const int64_t inter = gate.size(0);
    std::optional<at::Tensor> bias;
    if (gate_bias.has_value()) bias = at::cat({*gate_bias, *up_bias});
    std::vector<at::Tensor> halves = tiled_linear(x, *tiles, inter + up.size(0), bias).split(inter, -1);
    if (activation == "swish") return at::silu(halves[0]) * halves[1];
    TORCH_CHECK(activation == "gelu", "packed_gate_up: no tiled path for activation ", activation);
    return at::gelu(halves[0], algorithm == "tanh" ? "tanh" : "none") * halves[1];
  }
  static const c10::OperatorHandle binary = op("mkldnn::_linear_pointwise", "binary");
  at::Tensor h = linear_pointwise(x, gate, gate_bias, activation, algorithm);
  torch::jit::Stack stack{x, h, up, up_bias, std::string("mul")};
  binary.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hyprefix, m) {
  // No defaults: Inductor's C++ wrapper leaves out arguments equal to their defaults and the
  // boxed call then reads past its stack.
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, Tensor? tiles, int tile_rows) -> Tensor");
  m.def("packed_gate_up(Tensor x, Tensor gate, Tensor up, Tensor? gate_bias, Tensor? up_bias, str activation, "
        "str algorithm, Tensor? tiles, int tile_rows) -> Tensor");
}

// A packed weight may be an opaque oneDNN tensor: the call dispatches on its key as well.
TORCH_LIBRARY_IMPL(hyprefix, CPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("packed_gate_up", &packed_gate_up);
}

TORCH_LIBRARY_IMPL(hyprefix, MkldnnCPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("packed_gate_up", &packed_gate_up);
}
