// The duet.v1.Duet Generate stream as a benchmark backend. Asynchronous (gRPC's callback API):
// thousands of requests in flight cost no thread each. Output tokens are the streamed token ids.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/serving/client.h"
#include "duet/v1/duet.grpc.pb.h"
#include "grpcpp/security/credentials.h"

namespace duet::bench {

struct GrpcClientOptions {
  std::string address;   // host:port
  std::string api_key;   // sent as "authorization: Bearer <key>" when not empty
  // Streams are spread over this many channels (own connections), as one HTTP/2 connection
  // caps the streams in flight on it.
  int num_channels = 1;
  SamplingFlags sampling;
  Headers headers;  // metadata (keys in lower case)
  // The channels' credentials (TLS); null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
};

class GrpcClient final : public Client {
 public:
  static absl::StatusOr<std::unique_ptr<GrpcClient>> Create(const GrpcClientOptions& options);
  void Send(const ClientRequest& request, std::function<void(RequestResult)> done) override;

 private:
  GrpcClient(const GrpcClientOptions& options, std::vector<std::unique_ptr<v1::Duet::Stub>> stubs)
      : options_(options), stubs_(std::move(stubs)) {}
  GrpcClientOptions options_;
  std::vector<std::unique_ptr<v1::Duet::Stub>> stubs_;
  std::atomic<size_t> next_stub_{0};
};

}  // namespace duet::bench
