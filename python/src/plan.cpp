// dalle._dalle.plan: dalle-plan's capacity plan of a prior recipe on a cluster, as JSON.
#include <pybind11/stl.h>

#include "bindings.h"
#include "dalle/error.h"
#include "dalle/train/capacity_plan.h"

namespace py = pybind11;

namespace dalle::python {

void add_plan(py::module_& module) {
  py::class_<train::ClusterShape>(module, "ClusterShape")
      .def(py::init<>())
      .def_readwrite("nodes", &train::ClusterShape::nodes)
      .def_readwrite("gpus_per_node", &train::ClusterShape::gpus_per_node)
      .def_readwrite("gpu_memory_gib", &train::ClusterShape::gpu_memory_gib)
      .def_readwrite("peak_tflops", &train::ClusterShape::peak_tflops)
      .def_readwrite("mfu", &train::ClusterShape::mfu)
      .def_readwrite("link_within_gbps", &train::ClusterShape::link_within_gbps)
      .def_readwrite("link_across_gbps", &train::ClusterShape::link_across_gbps);

  module.def(
      "plan",
      [](const std::string& config, const std::vector<std::string>& overrides, const train::ClusterShape& cluster) {
        const auto source = config_source(config, overrides);
        if (peek_choice(source, "kind", "prior", {"prior", "bart_prior"}) != "prior") {
          throw Error("plan: the capacity plan is the sparse transformer prior's (kind: prior), not bart_prior's");
        }
        const auto recipe = load_config<train::PriorTrainConfig>(source);
        cluster.validate();
        return train::capacity_plan_json(train::plan_capacity(recipe, cluster));
      },
      py::arg("config"), py::arg("overrides"), py::arg("cluster"));
}

}  // namespace dalle::python
