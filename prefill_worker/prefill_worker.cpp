#include "prefill_worker/prefill_worker.h"

#include <memory>

#include "backends/executor_factory.h"
#include "rpc/serve_until_signal.h"

namespace duet {

int RunPrefillWorker(const PrefillWorkerOptions& options) {
  std::unique_ptr<PrefillService> service;  // lives until the process stops serving
  return rpc::ServeUntilSignal(
      {"prefill worker", options.host, options.port, options.metrics_port},
      [&]() -> absl::StatusOr<rpc::ServedService> {
        absl::StatusOr<std::unique_ptr<LlmEngine>> engine = CreateEngine(options.engine);
        if (!engine.ok()) return engine.status();
        absl::StatusOr<std::unique_ptr<PrefillService>> created = PrefillService::Create(std::move(*engine), options.service);
        if (!created.ok()) return created.status();
        service = std::move(*created);
        PrefillService* raw = service.get();
        return rpc::ServedService{raw, [raw] { return raw->RenderMetrics(); }};
      });
}

}  // namespace duet
