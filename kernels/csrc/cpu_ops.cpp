// The Python module of the CPU ops in cpu_ops_impl.h (see kernels/cpu_ops.py).

#include "cpu_ops_impl.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &cpuops::rms_norm, "RMSNorm with an optional residual add (see rms_norm.py)",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("rope", &cpuops::rope, "rotary embedding of one tensor of heads (see rope.py)",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode", &cpuops::paged_decode, "paged decode attention (see cpu_ops.py)",
        py::arg("q"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("isa"), py::arg("window") = 0,
        py::arg("softcap") = 0.0, py::arg("sinks") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_prefill", &cpuops::paged_prefill,
        "paged attention of prefill tokens, each as a decode step (see cpu_ops.py)",
        py::arg("q"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("token_seqs"), py::arg("token_lens"), py::arg("scale"), py::arg("isa"),
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("read_words", &cpuops::read_words,
        "XOR of a uint8 tensor's 8-byte words: a streaming read (bench/compute/memory_bandwidth.py)",
        py::call_guard<py::gil_scoped_release>());
  m.def("isa_supported", &cpuops::isa_supported, "whether this CPU runs instruction set code (0: AVX2 "
        "and FMA, 1: AVX-512 F/BW/VL too)");
}
