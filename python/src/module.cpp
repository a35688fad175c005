// dalle._dalle: the library's generation, training, planning and prior, for Python. Built
// against the torch wheel's LibTorch and pybind11, so tensors cross without a copy; imported
// by the `dalle` package after `import torch`.
#include <c10/util/Exception.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "dalle/error.h"

namespace py = pybind11;

namespace dalle::python {

ConfigSource config_source(const std::string& path, const std::vector<std::string>& overrides) {
  auto source = path.empty() ? ConfigSource::empty() : ConfigSource::from_file(path);
  source.set_all(overrides);
  return source;
}

void add_errors(py::module_& module) {
  // dalle.Error for what the library refuses, dalle.ConfigError (also a ValueError) for a bad
  // key or value of a config, each with the library's message; torch's errors as RuntimeError
  // without the C++ backtrace. Held for the process's life, as the module is.
  static PyObject* const error = PyErr_NewException("dalle.Error", PyExc_RuntimeError, nullptr);
  static PyObject* const config_error = [] {
    const auto bases = py::make_tuple(py::handle(error), py::handle(PyExc_ValueError));
    return PyErr_NewException("dalle.ConfigError", bases.ptr(), nullptr);
  }();
  module.attr("Error") = py::handle(error);
  module.attr("ConfigError") = py::handle(config_error);
  py::register_exception_translator([](std::exception_ptr thrown) {
    try {
      if (thrown) std::rethrow_exception(thrown);
    } catch (const ConfigError& caught) {
      PyErr_SetString(config_error, caught.what());
    } catch (const Error& caught) {
      PyErr_SetString(error, caught.what());
    } catch (const c10::Error& caught) {
      PyErr_SetString(PyExc_RuntimeError, caught.what_without_backtrace());
    }
  });
}

}  // namespace dalle::python

PYBIND11_MODULE(_dalle, module) {
  module.doc() = "The dalle library's C++ core; use the `dalle` package, which wraps it.";
  dalle::python::add_errors(module);
  dalle::python::add_pipeline(module);
  dalle::python::add_training(module);
  dalle::python::add_plan(module);
  dalle::python::add_prior(module);
}
