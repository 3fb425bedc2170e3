// A Generate stream that is finished at once with an error: what a service in front of
// duet.v1.Duet answers a call it turns away (no API key, draining, ...).
#pragma once

#include <utility>

#include "duet/v1/duet.grpc.pb.h"
#include "grpcpp/support/server_callback.h"

namespace duet::router {

class RejectedStream final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  explicit RejectedStream(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

}  // namespace duet::router
