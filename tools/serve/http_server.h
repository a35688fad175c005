#pragma once
// dalle-serve's HTTP side, on GNU libmicrohttpd's event loop (one thread holds every
// connection, idle and slow ones included, within the config's limits): OpenAI's image
// generation API (POST /v1/images/generations, GET /v1/models), jobs that outlive their
// connection (/v1/images/jobs), the images asked for by URL, /health, /metrics (Prometheus)
// and a web page at /. Behind it one Scheduler feeds one Pipeline; a responder thread turns
// finished jobs into answers and wakes their connections, and enforces the deadlines.
#include <memory>
#include <string>

#include "dalle/generate/pipeline.h"
#include "serve/serve_config.h"

namespace dalle::serve {

class HttpServer {
 public:
  // Serves `pipeline` (which must outlive the server) under `model_id`; clients must send
  // `api_key` as a bearer token unless it is empty.
  HttpServer(const ServeConfig& config, generate::Pipeline& pipeline, std::string model_id, std::string api_key);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds config.host:config.port (port 0: any free port) and starts answering; the port
  // bound. Throws Error when it cannot (an address in use, say).
  int bind();
  // Blocks the calling thread until drain_and_stop() is done, then stops the event loop.
  void listen();
  // From any other thread (dalle-serve's signal thread): image requests are refused with 503
  // from now on, those admitted are answered, and then listen() returns.
  void drain_and_stop();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace dalle::serve
