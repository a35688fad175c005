#pragma once
// The parts of the extension module `dalle._dalle`, each defined in its own file and added to
// the module by module.cpp. The Python package (python/dalle/) wraps them in its API.
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "dalle/config.h"

namespace dalle::python {

// A config file (or none: the defaults) with `key=value` assignments over it.
ConfigSource config_source(const std::string& path, const std::vector<std::string>& overrides);

void add_errors(pybind11::module_& module);
void add_pipeline(pybind11::module_& module);
void add_training(pybind11::module_& module);
void add_plan(pybind11::module_& module);
void add_prior(pybind11::module_& module);

}  // namespace dalle::python
