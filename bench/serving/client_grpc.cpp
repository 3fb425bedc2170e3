#include "bench/serving/client_grpc.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"

namespace duet::bench {
namespace {

using Clock = std::chrono::steady_clock;

// One Generate stream; deletes itself when the call is over.
class GenerateCall final : public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  GenerateCall(const ClientRequest& request, const GrpcClientOptions& options, std::function<void(RequestResult)> done)
      : done_(std::move(done)) {
    request_.set_text(request.prompt);
    v1::SamplingOptions* sampling = request_.mutable_sampling();
    const SamplingFlags& flags = options.sampling;
    sampling->set_temperature(static_cast<float>(flags.temperature.value_or(0)));
    if (flags.top_p) sampling->set_top_p(static_cast<float>(*flags.top_p));
    if (flags.top_k) sampling->set_top_k(*flags.top_k);
    if (flags.min_p) sampling->set_min_p(static_cast<float>(*flags.min_p));
    if (flags.frequency_penalty) sampling->set_frequency_penalty(static_cast<float>(*flags.frequency_penalty));
    if (flags.presence_penalty) sampling->set_presence_penalty(static_cast<float>(*flags.presence_penalty));
    if (flags.repetition_penalty) sampling->set_repetition_penalty(static_cast<float>(*flags.repetition_penalty));
    sampling->set_max_tokens(request.max_tokens);
    sampling->set_ignore_eos(request.ignore_eos);
    if (!options.api_key.empty()) context_.AddMetadata("authorization", absl::StrCat("Bearer ", options.api_key));
    for (const auto& [key, value] : options.headers) context_.AddMetadata(key, value);
  }

  void Start(v1::Duet::Stub& stub) {
    start_ = Clock::now();
    stub.async()->Generate(&context_, &request_, this);
    StartRead(&response_);
    StartCall();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream is over; OnDone follows
    const double now = SecondsSince(start_);
    if (response_.token_ids_size() > 0) {
      result_.chunk_times.push_back(now);
      result_.chunk_tokens.push_back(response_.token_ids_size());
      result_.output_tokens += response_.token_ids_size();
    }
    result_.output_text += response_.text();
    if (response_.prompt_token_ids_size() > 0) result_.prompt_tokens = response_.prompt_token_ids_size();
    if (response_.finished()) {
      finished_ = true;
      result_.latency = now;
      if (response_.usage().prompt_tokens() > 0) result_.prompt_tokens = response_.usage().prompt_tokens();
    }
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override {
    if (!status.ok()) {
      result_.error = absl::StrCat("gRPC ", status.error_code(), ": ", status.error_message());
    } else if (!finished_) {
      result_.error = "the stream ended without a finished message";
    } else {
      result_.success = true;
    }
    if (!result_.success) result_.latency = SecondsSince(start_);
    std::function<void(RequestResult)> done = std::move(done_);
    RequestResult result = std::move(result_);
    delete this;
    done(std::move(result));
  }

 private:
  grpc::ClientContext context_;
  v1::GenerateRequest request_;
  v1::GenerateResponse response_;
  std::function<void(RequestResult)> done_;
  RequestResult result_;
  Clock::time_point start_;
  bool finished_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcClient>> GrpcClient::Create(const GrpcClientOptions& options) {
  if (options.address.empty() || options.address.find("://") != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("the duet-grpc backend wants --base-url host:port, got '", options.address, "'"));
  }
  if (options.num_channels < 1) return absl::InvalidArgumentError("at least one gRPC channel");
  std::vector<std::unique_ptr<v1::Duet::Stub>> stubs;
  for (int i = 0; i < options.num_channels; ++i) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own per channel
    stubs.push_back(v1::Duet::NewStub(
        grpc::CreateCustomChannel(options.address,
                                  options.credentials != nullptr ? options.credentials : grpc::InsecureChannelCredentials(),
                                  args)));
  }
  return std::unique_ptr<GrpcClient>(new GrpcClient(options, std::move(stubs)));
}

void GrpcClient::Send(const ClientRequest& request, std::function<void(RequestResult)> done) {
  auto* call = new GenerateCall(request, options_, std::move(done));
  call->Start(*stubs_[next_stub_.fetch_add(1) % stubs_.size()]);
}

}  // namespace duet::bench
