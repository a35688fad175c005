// dalle-serve: one generation pipeline, loaded once, served over HTTP with OpenAI's image
// API (docs/serve.md). SIGTERM or SIGINT drains: new requests are refused with 503, those
// admitted are answered, and the server exits 0; a second signal ends it at once.
#include <pthread.h>

#include <csignal>
#include <cstdlib>
#include <thread>

#include "dalle/generate/pipeline.h"
#include "dalle/log.h"
#include "serve/http_server.h"
#include "serve/serve_config.h"
#include "tool_support.h"

using namespace dalle;

namespace {

// The stop signals, blocked in every thread (torch's and libmicrohttpd's threads inherit the
// mask of the thread that starts them): one thread waits for them with sigwait and drains.
sigset_t stop_signals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  return signals;
}

// Waits for the first stop signal and drains the server; a ^C after it ends the process. A
// repeated SIGTERM does not: `timeout` and service managers may deliver one twice.
void drain_on_signals(serve::HttpServer& server) {
  std::thread([&server] {
    const auto signals = stop_signals();
    int signal = 0;
    sigwait(&signals, &signal);
    log::info("serve: signal ", signal, ": draining (^C ends the server at once)");
    std::thread([signals] {
      int second = 0;
      while (second != SIGINT) sigwait(&signals, &second);
      std::_Exit(128 + second);
    }).detach();
    server.drain_and_stop();
  }).detach();
}

// The config: --config's server keys and pipeline, or --model's folder as the pipeline; then
// the command line's shorthands.
serve::ServeConfig read_config(const CLI::App& app, const tools::ConfigOptions& options,
                               const tools::PipelineShorthands& shorthands, const std::string& model_folder) {
  if (model_folder.empty()) {
    auto source = options.source();
    shorthands.apply(app, source, "pipeline.");
    return load_config<serve::ServeConfig>(source);
  }
  // The server's keys from --config and --set; the pipeline from the folder, with the
  // --set pipeline.* overrides and the shorthands.
  auto source = options.path.empty() ? ConfigSource::empty() : ConfigSource::from_file(options.path);
  if (names_key(source, "pipeline")) {
    throw tools::UsageError("--model and the config's `pipeline` both give the pipeline; give one (--set "
                            "pipeline.key=value still overrides a key of the folder's)");
  }
  auto folder = generate::read_model_folder(model_folder);
  auto pipeline = ConfigSource::from_string(config_to_yaml(visit_of(folder)),
                                            model_folder + "/" + generate::kModelFolderConfig);
  const std::string prefix = "pipeline.";
  for (const auto& assignment : options.overrides) {
    if (assignment.rfind(prefix, 0) == 0) {
      pipeline.set(assignment.substr(prefix.size()));
    } else {
      source.set(assignment);
    }
  }
  shorthands.apply(app, pipeline);
  auto config = load_config<serve::ServeConfig>(source);
  config.pipeline = load_config<generate::PipelineConfig>(pipeline);
  return config;
}

void check_limits(const serve::ServeConfig& config) {
  if (config.max_n > config.max_candidates) {
    throw tools::UsageError("max_n (" + std::to_string(config.max_n) + ") exceeds max_candidates (" +
                            std::to_string(config.max_candidates) + "): n images need n candidates");
  }
  if (config.pipeline.candidates > config.max_candidates) {
    throw tools::UsageError("pipeline.candidates (" + std::to_string(config.pipeline.candidates) +
                            "), the requests' default, exceeds max_candidates (" +
                            std::to_string(config.max_candidates) + ")");
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Serves a generation pipeline over HTTP with OpenAI's image API (POST /v1/images/generations), "
               "batching concurrent requests; a web page at /. SIGTERM drains and exits 0. docs/serve.md"};
  app.name("dalle-serve");
  tools::add_common_options(app);
  tools::ConfigOptions config_options;
  config_options.add_to(app, "server and its pipeline (configs/serve/*.yaml)");
  std::string model_folder, host, api_key_file;
  int64_t port = -1;
  app.add_option("--model", model_folder,
                 "a model folder (models/fashion-compose): its generate.yaml is the pipeline, in place of the "
                 "config's `pipeline`; the options below override it")
      ->check(CLI::ExistingDirectory);
  app.add_option("--host", host, "sets `host`: the address to listen on");
  app.add_option("--port", port, "sets `port` (0: any free port, logged)")->check(CLI::Range(0, 65535));
  app.add_option("--api-key-file", api_key_file, "sets `api_key_file`: clients must send its key as a bearer token");
  // A request brings its own seed, n and candidates; the rest set the pipeline's defaults.
  tools::PipelineShorthands shorthands;
  shorthands.add_to(app, {"-n", "--candidates", "--seed", "--image-prompt", "--image-prompt-rows",
                         "--image-prompt-mask"},
                    tools::PipelineShorthands::Adapters::named);

  return tools::run_tool(app, argc, argv, [&] {
    auto config = read_config(app, config_options, shorthands, model_folder);
    if (!host.empty()) config.host = host;
    if (port >= 0) config.port = port;
    if (!api_key_file.empty()) config.api_key_file = api_key_file;
    if (config_options.print_requested(visit_of(config))) return;
    check_limits(config);
    if (config.pipeline.prior.empty()) {
      throw tools::UsageError("no model: give --model FOLDER, --config with a `pipeline`, or --prior");
    }
    const auto api_key = serve::read_api_key(config.api_key_file);
    // Before any thread starts, so that every thread inherits the blocked stop signals.
    const auto signals = stop_signals();
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);
    generate::Pipeline pipeline(config.pipeline);
    const auto model_id = serve::served_model_id(config, model_folder);
    serve::HttpServer server(config, pipeline, model_id, api_key);
    const int bound = server.bind();
    log::info("serve: model ", model_id, " (", pipeline.image_size(true), "x", pipeline.image_size(true),
              " images) at http://", config.host, ":", bound, "/ ", api_key.empty() ? "without" : "with",
              " an API key; ", config.max_queue, " requests may wait");
    drain_on_signals(server);
    server.listen();
    log::info("serve: drained and stopped");
  });
}
