#include "decode_worker/decode_worker.h"

#include <pthread.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <memory>

#include "absl/strings/str_cat.h"
#include "metrics/http_exporter.h"
#include "proto/rpc_util.h"

namespace duet {
namespace {

std::string HostPort(const std::string& host, int port) {
  if (host.find(':') != std::string::npos && host.front() != '[') return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

}  // namespace

int RunDecodeWorker(const DecodeWorkerOptions& options) {
  // Signals are taken synchronously by sigwait below; every thread started from here on
  // inherits the mask, so none of them is interrupted.
  sigset_t signals, previous;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, &previous);

  int exit_code = 1;
  {
    absl::StatusOr<std::unique_ptr<LlmEngine>> engine = LlmEngine::Create(options.engine);
    if (!engine.ok()) {
      std::fprintf(stderr, "decode worker: cannot load the model: %s\n", engine.status().ToString().c_str());
    } else {
      absl::StatusOr<std::unique_ptr<DecodeService>> service =
          DecodeService::Create(std::move(*engine), options.service);
      if (!service.ok()) {
        std::fprintf(stderr, "decode worker: %s\n", service.status().ToString().c_str());
      } else {
        DecodeService* svc = service->get();
        std::unique_ptr<metrics::HttpExporter> exporter;
        if (options.metrics_port >= 0) {
          metrics::HttpExporter::Options exporter_options;
          exporter_options.host = options.host;
          exporter_options.port = uint16_t(options.metrics_port);
          absl::StatusOr<std::unique_ptr<metrics::HttpExporter>> started =
              metrics::HttpExporter::Start([svc] { return svc->RenderMetrics(); }, exporter_options);
          if (!started.ok()) {
            std::fprintf(stderr, "decode worker: cannot serve metrics: %s\n", started.status().ToString().c_str());
            pthread_sigmask(SIG_SETMASK, &previous, nullptr);
            return 1;
          }
          exporter = *std::move(started);
          std::printf("DUET_METRICS_READY port=%d\n", int(exporter->port()));
          std::fflush(stdout);
        }
        int port = 0;
        absl::StatusOr<std::unique_ptr<grpc::Server>> server =
            rpc::StartServer(HostPort(options.host, options.port), {service->get()}, &port);
        if (!server.ok()) {
          std::fprintf(stderr, "decode worker: %s\n", server.status().ToString().c_str());
        } else {
          std::printf("DUET_READY port=%d\n", port);
          std::fflush(stdout);
          int signal_number = 0;
          sigwait(&signals, &signal_number);
          std::fprintf(stderr, "decode worker: signal %d, shutting down\n", signal_number);
          (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
          (*server)->Wait();
          if (exporter != nullptr) exporter->Stop();
          exit_code = 0;
        }
      }
    }
  }
  pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  return exit_code;
}

}  // namespace duet
