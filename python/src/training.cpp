// dalle._dalle.train: a trainer of the dalle-train* tools, run in this process as the tool
// runs it (the same recipe, run directory and metrics), stoppable with Ctrl-C: the first
// SIGINT asks the trainer to stop, which writes a checkpoint; the call then says so and the
// package raises KeyboardInterrupt. Several ranks are the launchers' (dalle-train
// --nproc-per-node, torchrun), as for the tools.
#include <pybind11/stl.h>

#include "bindings.h"
#include "dalle/error.h"
#include "dalle/train/stop_request.h"
#include "dalle/train/trainers/bart_prior_trainer.h"
#include "dalle/train/trainers/clip_trainer.h"
#include "dalle/train/trainers/dvae_trainer.h"
#include "dalle/train/trainers/prior_trainer.h"
#include "dalle/train/trainers/superres_trainer.h"
#include "dalle/train/trainers/vqgan_trainer.h"

namespace py = pybind11;

namespace dalle::python {
namespace {

// How a run ended: every update made, or stopped (and by which signal).
struct Outcome {
  bool finished = false;
  int signal = 0;
};

template <class Config, class Trainer>
Outcome train_with(const ConfigSource& source, const std::string& out) {
  auto config = load_config<Config>(source);
  if (config.distributed.nproc_per_node > 1) {
    throw Error("train: distributed.nproc_per_node is " + std::to_string(config.distributed.nproc_per_node) +
                "; dalle.train runs one rank in this process: for several, launch the tool (dalle-train "
                "--nproc-per-node N, or torchrun)");
  }
  py::gil_scoped_release release;
  train::clear_stop_request();
  Outcome outcome;
  {
    train::StopOnSignals stop_on_signals;
    Trainer trainer(config, out);
    trainer.run();
    outcome.finished = trainer.step() >= config.run.steps;
  }
  outcome.signal = train::stop_requested() ? train::stop_signal() : 0;
  return outcome;
}

// `trainer` names the tool: prior (dalle-train; `kind: bart_prior` picks the BART prior), vae
// (dalle-train-vae; `kind: vqgan` picks the VQGAN), clip or superres.
Outcome train_recipe(const std::string& trainer, const ConfigSource& source, const std::string& out) {
  if (out.empty()) throw Error("train: `out`, the run directory, is required");
  if (trainer == "prior") {
    return peek_choice(source, "kind", "prior", {"prior", "bart_prior"}) == "bart_prior"
               ? train_with<train::BartPriorTrainConfig, train::BartPriorTrainer>(source, out)
               : train_with<train::PriorTrainConfig, train::PriorTrainer>(source, out);
  }
  if (trainer == "vae") {
    return peek_choice(source, "kind", "dvae", {"dvae", "vqgan"}) == "vqgan"
               ? train_with<train::VqganTrainConfig, train::VqganTrainer>(source, out)
               : train_with<train::DvaeTrainConfig, train::DvaeTrainer>(source, out);
  }
  if (trainer == "clip") return train_with<train::ClipTrainConfig, train::ClipTrainer>(source, out);
  if (trainer == "superres") return train_with<train::SuperResTrainConfig, train::SuperResTrainer>(source, out);
  throw Error("train: trainer '" + trainer + "' is none of prior, vae, clip, superres");
}

}  // namespace

void add_training(py::module_& module) {
  module.def(
      "train",
      [](const std::string& config, const std::string& out, const std::vector<std::string>& overrides,
         const std::string& trainer) {
        const auto outcome = train_recipe(trainer, config_source(config, overrides), out);
        return py::make_tuple(outcome.finished, outcome.signal);
      },
      py::arg("config"), py::arg("out"), py::arg("overrides"), py::arg("trainer"),
      "Trains into `out` (resuming it); (every update made, the stopping signal or 0).");
}

}  // namespace dalle::python
