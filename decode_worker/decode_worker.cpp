#include "decode_worker/decode_worker.h"

#include <memory>

#include "backends/executor_factory.h"
#include "rpc/serve_until_signal.h"

namespace duet {

int RunDecodeWorker(const DecodeWorkerOptions& options) {
  std::unique_ptr<DecodeService> service;  // lives until the process stops serving
  return rpc::ServeUntilSignal(
      {"decode worker", options.host, options.port, options.metrics_port},
      [&]() -> absl::StatusOr<rpc::ServedService> {
        absl::StatusOr<std::unique_ptr<LlmEngine>> engine = CreateEngine(options.engine);
        if (!engine.ok()) return engine.status();
        absl::StatusOr<std::unique_ptr<DecodeService>> created = DecodeService::Create(std::move(*engine), options.service);
        if (!created.ok()) return created.status();
        service = std::move(*created);
        DecodeService* raw = service.get();
        return rpc::ServedService{raw, [raw] { return raw->RenderMetrics(); }};
      });
}

}  // namespace duet
