// The kernels' Python module (one per ISA build: ``kernels.packed_kernels``): the only file that
// includes the Python binding headers (~10 s of a build's compile; the kernels' files include ATen's
// core only), exporting what step.h declares. The two long calls (a step's attention, a whole forward)
// let go of the GIL while they run (they touch no Python object): a server's threads (the HTTP loop,
// the detokenizer) run beside a forward instead of waiting for it to end.
#include <torch/csrc/utils/pybind.h>

#include "step.h"

using vc_step::StepWeights;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend_packed", &attend_packed, "attention for every sequence of a step over all its parts",
        py::arg("q"), py::arg("hkv"), py::arg("seq_lens"), py::arg("part_ints"), py::arg("part_tensors"),
        py::arg("score_unit") = 0, py::arg("key_coding") = py::none(), py::arg("lse") = py::none(),
        py::arg("row_lse") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (row_ops.h)");
  m.def("guide_select", &guide_select, "a guided store's trades from a verification's attention (guide_select.cpp)");
  m.def("guide_trade", &guide_trade, "the same trades, applied to a plain store (guide_select.cpp)");
  m.def("silu_mul", &silu_mul, "SiLU(gate) x up of each row of a fused gate/up output (row_ops.h)");
  pybind11::class_<StepWeights>(m, "StepWeights", pybind11::module_local())   // one per ISA build
      .def(pybind11::init<int64_t, int64_t, int64_t, double, int64_t, int64_t, int64_t, int64_t>())
      .def("add_layer", &StepWeights::add_layer, py::arg("in_norm"), py::arg("post_norm"), py::arg("linears"),
           py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(), py::arg("key_coding") = py::none())
      .def("set_ends", &StepWeights::set_ends)
      .def("set_draft_head", &StepWeights::set_draft_head);
  m.def("forward_step", &forward_step, "a forward step in one call: embedding, every layer, the head",
        py::call_guard<py::gil_scoped_release>());
}
