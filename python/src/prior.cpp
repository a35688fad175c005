// dalle._dalle.Prior: a trained sparse transformer prior for a researcher's own loop: its
// forward takes and returns torch tensors (no copy at the boundary), its parameters are the
// model's own tensors, and autograd and torch.no_grad() apply as in Python (one libtorch).
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "bindings.h"
#include "dalle/device.h"
#include "dalle/models/prior.h"
#include "dalle/models/trained.h"

namespace py = pybind11;

namespace dalle::python {

void add_prior(py::module_& module) {
  py::class_<models::TrainedPrior>(module, "Prior", "A trained prior (see dalle.load_prior).")
      .def("forward",
           [](models::TrainedPrior& self, const torch::Tensor& tokens) {
             py::gil_scoped_release release;
             return self.model->forward(tokens);
           },
           py::arg("tokens"))
      .def("named_parameters",
           [](models::TrainedPrior& self) {
             std::vector<std::pair<std::string, torch::Tensor>> out;
             for (const auto& item : self.model->named_parameters()) out.emplace_back(item.key(), item.value());
             return out;
           })
      .def("to", [](models::TrainedPrior& self, const std::string& device) { self.model->to(torch::Device(device)); },
           py::arg("device"))
      .def("train", [](models::TrainedPrior& self, bool on) { self.model->train(on); }, py::arg("mode") = true)
      .def_property_readonly("config", [](models::TrainedPrior& self) { return flatten_config(visit_of(self.config)); })
      .def_readonly("tokenizer", &models::TrainedPrior::tokenizer)
      .def_readonly("image_tokenizer", &models::TrainedPrior::image_tokenizer)
      .def_readonly("checkpoint", &models::TrainedPrior::checkpoint);

  module.def(
      "load_prior",
      [](const std::string& path, const std::string& dtype) {
        py::gil_scoped_release release;
        auto prior = models::load_trained_prior(path, float_type_named(dtype));
        prior.model->eval();
        return prior;
      },
      py::arg("path"), py::arg("dtype") = "float32");
}

}  // namespace dalle::python
