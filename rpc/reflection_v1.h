// grpc.reflection.v1 for Debian's gRPC 1.51, whose reflection library serves only
// grpc.reflection.v1alpha (v1 came in later releases). The two protocols are the same messages
// under another package name (same fields, same numbers: the same bytes on the wire), so each
// v1 ServerReflectionInfo stream is relayed, message by message, to the server's own v1alpha
// service through its in-process channel. Clients that ask for v1 first (grpcurl, grpcui,
// Postman) get their answers from v1; v1alpha stays served as before.
//
// Registered as the server's generic service: methods no other service serves reach it, and every
// one but v1's ServerReflectionInfo is answered UNIMPLEMENTED, as without it.
#pragma once

#include <atomic>

#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/server.h"

namespace duet::rpc {

inline constexpr char kReflectionV1Method[] = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo";

class ReflectionV1Relay final : public grpc::CallbackGenericService {
 public:
  // The server whose v1alpha service answers; set once it is built, before it takes calls that
  // matter (a v1 call before then is UNAVAILABLE). It must outlive the relay's calls.
  void SetServer(grpc::Server* server) { server_.store(server, std::memory_order_release); }

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override;

 private:
  std::atomic<grpc::Server*> server_{nullptr};
};

}  // namespace duet::rpc
