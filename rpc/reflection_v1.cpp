#include "rpc/reflection_v1.h"

#include <atomic>
#include <memory>
#include <string>

#include "grpcpp/generic/generic_stub.h"

namespace duet::rpc {
namespace {

constexpr char kReflectionV1AlphaMethod[] = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo";

class Unimplemented final : public grpc::ServerGenericBidiReactor {
 public:
  explicit Unimplemented(grpc::Status status) { Finish(status); }
  void OnDone() override { delete this; }
};

// One v1 stream (the server side) and the v1alpha stream it is relayed to (the client side), in
// lock step: the next request is read once the previous one is written on, the next reply read
// once the previous one is written back. The client side is held open until the server side has
// no request left to pass (its writes then done); its status finishes the server side. The object
// goes when both sides are done.
class Relay final : public grpc::ServerGenericBidiReactor {
 public:
  Relay(grpc::GenericCallbackServerContext* context, grpc::Server* server)
      : upstream_context_(grpc::ClientContext::FromCallbackServerContext(*context)), upstream_(this) {
    grpc::TemplatedGenericStub<grpc::ByteBuffer, grpc::ByteBuffer> stub(
        server->InProcessChannel(grpc::ChannelArguments()));
    stub.PrepareBidiStreamingCall(upstream_context_.get(), kReflectionV1AlphaMethod, grpc::StubOptions(), &upstream_);
    upstream_.AddHold();  // its writes come from this side's reactions
    upstream_.StartRead(&reply_);
    upstream_.StartCall();
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the v1 client is done asking (or gone)
      upstream_.StartWritesDone();
      upstream_.RemoveHold();
      return;
    }
    upstream_.StartWrite(&request_);
  }
  void OnWriteDone(bool ok) override {
    if (ok) {
      upstream_.StartRead(&reply_);
    } else {
      upstream_context_->TryCancel();  // nobody to pass replies to
    }
  }
  void OnCancel() override { upstream_context_->TryCancel(); }
  void OnDone() override { Release(); }

 private:
  class Upstream final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    explicit Upstream(Relay* relay) : relay_(relay) {}
    void OnWriteDone(bool ok) override {
      if (ok) {
        relay_->StartRead(&relay_->request_);
      } else {
        RemoveHold();  // the v1alpha side is gone: no more requests to pass
      }
    }
    void OnReadDone(bool ok) override {
      if (ok) relay_->StartWrite(&relay_->reply_);  // OnDone follows the last reply
    }
    void OnDone(const grpc::Status& status) override {
      relay_->Finish(status);
      relay_->Release();
    }

   private:
    Relay* const relay_;
  };

  void Release() {
    if (sides_left_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  std::shared_ptr<grpc::ClientContext> upstream_context_;
  Upstream upstream_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer reply_;
  std::atomic<int> sides_left_{2};
};

}  // namespace

grpc::ServerGenericBidiReactor* ReflectionV1Relay::CreateReactor(grpc::GenericCallbackServerContext* context) {
  if (context->method() != kReflectionV1Method) {
    return new Unimplemented(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, ""));
  }
  grpc::Server* server = server_.load(std::memory_order_acquire);
  if (server == nullptr) return new Unimplemented(grpc::Status(grpc::StatusCode::UNAVAILABLE, "starting"));
  return new Relay(context, server);
}

}  // namespace duet::rpc
