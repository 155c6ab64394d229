// hyprefix::packed_linear and hyprefix::packed_gate_up: oneDNN's matmuls over prepacked
// weights (mkldnn::_linear_pointwise, the eager path of models/layers.py) as ops a compiled
// batched decode step calls as extern kernels. Inductor lowers oneDNN's own op only for
// weights frozen into the graph as constants; through these ops the packed weights stay
// graph inputs, and the graph's C++ wrapper calls them through the dispatcher, without Python
// (ops registered from Python behind Inductor's Python wrapper lost to eager).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string>

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

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  return linear_pointwise(x, packed, bias, "none", "");
}

// act(x @ gate^T + gate_bias) * (x @ up^T + up_bias): the activation and the product in the
// two matmuls' epilogues, as GatedMLP runs them eagerly.
at::Tensor packed_gate_up(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up,
                          const std::optional<at::Tensor>& gate_bias, const std::optional<at::Tensor>& up_bias,
                          c10::string_view activation, c10::string_view algorithm) {
  static const c10::OperatorHandle binary = op("mkldnn::_linear_pointwise", "binary");
  at::Tensor h = linear_pointwise(x, gate, gate_bias, activation, algorithm);
  torch::jit::Stack stack{x, h, up, up_bias, std::string("mul")};
  binary.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hyprefix, m) {
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("packed_gate_up(Tensor x, Tensor gate, Tensor up, Tensor? gate_bias, Tensor? up_bias, str activation, "
        "str algorithm) -> Tensor");
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
