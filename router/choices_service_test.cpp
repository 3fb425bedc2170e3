// ChoicesDuetService in front of a scripted inner service: how n completions' failures,
// cancellations and Aborts end the client's request.
#include "router/choices_service.h"

#include <atomic>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rpc/rpc_util.h"

namespace duet::router {
namespace {

// The inner service: each Generate writes one message (2 prompt tokens, 1 token) and then, by
// the request id's suffix "-<index>": fails (index `fail_index`), ends without finishing
// (`unfinished_index`), or stays open until cancelled. Abort finds nothing.
class ScriptedInner final : public v1::Duet::CallbackService {
 public:
  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(grpc::CallbackServerContext* context,
                                                           const v1::GenerateRequest* request) override {
    const std::string& id = request->request_id();
    {
      absl::MutexLock lock(&mu_);
      requests_.push_back(*request);
      auto choice = context->client_metadata().find("duet-choice");
      choices_.insert(choice == context->client_metadata().end()
                          ? std::string()
                          : std::string(choice->second.data(), choice->second.size()));
    }
    if (absl::EndsWith(id, absl::StrCat("-", fail_index.load()))) return new Stream(this, Stream::kFail);
    if (absl::EndsWith(id, absl::StrCat("-", unfinished_index.load()))) return new Stream(this, Stream::kUnfinished);
    return new Stream(this, Stream::kHang);
  }
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context, const v1::AbortRequest*,
                                  v1::AbortResponse* response) override {
    ++num_aborts;
    response->set_found(false);
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  std::vector<v1::GenerateRequest> requests() {
    absl::MutexLock lock(&mu_);
    return requests_;
  }
  std::multiset<std::string> choices() {
    absl::MutexLock lock(&mu_);
    return choices_;
  }

  // Whether `n` streams have seen their cancellation within `timeout`.
  bool WaitCancelled(int n, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    std::pair<int*, int> count_and_target(&num_cancelled_, n);
    return mu_.AwaitWithTimeout(
        absl::Condition(+[](std::pair<int*, int>* c) { return *c->first >= c->second; }, &count_and_target), timeout);
  }
  int num_cancelled() {
    absl::MutexLock lock(&mu_);
    return num_cancelled_;
  }

  std::atomic<int> fail_index{-1};
  std::atomic<int> unfinished_index{-1};
  std::atomic<int> num_aborts{0};

 private:
  class Stream final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
   public:
    enum Mode { kFail, kUnfinished, kHang };
    Stream(ScriptedInner* inner, Mode mode) : inner_(inner), mode_(mode) {
      if (mode_ == kFail) {
        FinishOnce(grpc::Status(grpc::StatusCode::INTERNAL, "boom"));
        return;
      }
      message_.add_prompt_token_ids(1);
      message_.add_prompt_token_ids(2);
      message_.add_token_ids(7);
      message_.set_text("x");
      StartWrite(&message_);
    }
    void OnWriteDone(bool ok) override {
      if (mode_ == kUnfinished && ok) FinishOnce(grpc::Status::OK);
    }
    void OnCancel() override {
      {
        absl::MutexLock lock(&inner_->mu_);
        ++inner_->num_cancelled_;
      }
      FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
    }
    void OnDone() override { delete this; }

   private:
    // A cancellation may come after the stream has finished of itself.
    void FinishOnce(grpc::Status status) {
      if (!finished_.exchange(true)) Finish(std::move(status));
    }
    std::atomic<bool> finished_{false};
    ScriptedInner* const inner_;
    const Mode mode_;
    v1::GenerateResponse message_;
  };

  absl::Mutex mu_;
  std::vector<v1::GenerateRequest> requests_ ABSL_GUARDED_BY(mu_);
  std::multiset<std::string> choices_ ABSL_GUARDED_BY(mu_);
  int num_cancelled_ ABSL_GUARDED_BY(mu_) = 0;
};

class ChoicesServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { Serve(/*set_channel=*/true); }
  void Serve(bool set_channel) {
    service_ = std::make_unique<ChoicesDuetService>(&inner_);
    int port = 0;
    absl::StatusOr<std::unique_ptr<grpc::Server>> server = rpc::StartServer("127.0.0.1:0", {service_.get()}, &port);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    if (set_channel) service_->SetChannel(server_->InProcessChannel(grpc::ChannelArguments()));
    stub_ = v1::Duet::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override { Stop(); }
  void Stop() {
    server_->Shutdown(std::chrono::system_clock::now());
    server_->Wait();
    service_.reset();  // before the server (its channel)
    server_.reset();
  }

  static v1::GenerateRequest Request(int n, const std::string& id = "") {
    v1::GenerateRequest request;
    request.set_request_id(id);
    request.set_text("hi");
    request.set_n(n);
    return request;
  }

  ScriptedInner inner_;
  std::unique_ptr<ChoicesDuetService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Duet::Stub> stub_;
};

TEST_F(ChoicesServiceTest, OneCompletionPassesThroughUntouched) {
  inner_.unfinished_index = 9;  // "r-9" ends after its message
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, Request(1, "r-9"));
  v1::GenerateResponse message;
  while (reader->Read(&message)) {
  }
  EXPECT_TRUE(reader->Finish().ok());  // the inner service's own answer
  ASSERT_EQ(inner_.requests().size(), 1u);
  EXPECT_EQ(inner_.requests()[0].request_id(), "r-9");
  EXPECT_EQ(inner_.choices(), std::multiset<std::string>{""});
}

TEST_F(ChoicesServiceTest, RequestsCarryTheirChoiceAndClearN) {
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, Request(2));
  v1::GenerateResponse message;
  ASSERT_TRUE(reader->Read(&message));  // one message of each: both reached the inner service
  ASSERT_TRUE(reader->Read(&message));
  context.TryCancel();
  while (reader->Read(&message)) {
  }
  reader->Finish();
  EXPECT_EQ(inner_.choices(), (std::multiset<std::string>{"0/2", "1/2"}));
  for (const v1::GenerateRequest& r : inner_.requests()) {
    EXPECT_EQ(r.n(), 0);
    EXPECT_THAT(r.request_id(), ::testing::MatchesRegex("cmpl-[0-9a-f]{32}-[01]"));
  }
}

// The other completions never end by themselves here: the answer comes once they are cancelled.
TEST_F(ChoicesServiceTest, AFailingCompletionEndsTheRequestAndCancelsTheOthers) {
  inner_.fail_index = 1;
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, Request(3));
  v1::GenerateResponse message;
  while (reader->Read(&message)) {
  }
  grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_EQ(status.error_message(), "boom");
}

TEST_F(ChoicesServiceTest, ACompletionEndingWithoutFinishingIsInternal) {
  inner_.unfinished_index = 0;
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, Request(2));
  v1::GenerateResponse message;
  while (reader->Read(&message)) {
  }
  grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_EQ(status.error_message(), "completion 0 ended without a finish reason");
}

TEST_F(ChoicesServiceTest, ClientCancelReachesEveryCompletion) {
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, Request(2));
  v1::GenerateResponse message;
  ASSERT_TRUE(reader->Read(&message));
  ASSERT_TRUE(reader->Read(&message));
  context.TryCancel();
  while (reader->Read(&message)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(inner_.WaitCancelled(2, absl::Seconds(10))) << inner_.num_cancelled();
}

// Abort while the inner service knows no request of the id (not registered there yet): the
// completions are stopped here and end with "abort" and what they had produced.
TEST_F(ChoicesServiceTest, AbortNotFoundInsideStopsTheCompletionsHere) {
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, Request(2, "mine"));
  std::map<int, v1::GenerateResponse> last;
  v1::GenerateResponse message;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(reader->Read(&message));
    EXPECT_EQ(message.request_id(), "mine");
    last[message.index()] = message;
  }
  EXPECT_EQ(last.size(), 2u);
  grpc::ClientContext abort_context;
  v1::AbortRequest abort;
  abort.set_request_id("mine");
  v1::AbortResponse found;
  ASSERT_TRUE(stub_->Abort(&abort_context, abort, &found).ok());
  EXPECT_TRUE(found.found());
  while (reader->Read(&message)) last[message.index()] = message;
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(inner_.num_aborts, 2);
  EXPECT_TRUE(inner_.WaitCancelled(2, absl::Seconds(10))) << inner_.num_cancelled();
  for (const auto& [index, m] : last) {
    EXPECT_TRUE(m.finished()) << index;
    EXPECT_EQ(m.request_id(), "mine");
    EXPECT_EQ(m.finish_reason(), "abort");
    EXPECT_EQ(m.finish_reason_code(), v1::FINISH_REASON_ABORT);
    EXPECT_EQ(m.usage().prompt_tokens(), 2);
    EXPECT_EQ(m.usage().completion_tokens(), 1);
  }
  const auto& metadata = context.GetServerInitialMetadata();
  auto id = metadata.find("x-request-id");
  ASSERT_NE(id, metadata.end());
  EXPECT_EQ(std::string(id->second.data(), id->second.size()), "mine");
}

TEST_F(ChoicesServiceTest, NIsUnavailableWithoutAChannel) {
  Stop();
  Serve(/*set_channel=*/false);
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, Request(2));
  v1::GenerateResponse message;
  EXPECT_FALSE(reader->Read(&message));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
}

}  // namespace
}  // namespace duet::router
