// `duet complete`: a minimal gRPC client for the router — sends one prompt (or, with --chat,
// one user message) to Generate and prints the streamed text as it arrives.
#include <cstdio>

#include "cli/commands.h"
#include "duet/v1/duet.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace duet {

int RunComplete(const CompleteOptions& options) {
  auto stub = v1::Duet::NewStub(grpc::CreateChannel(options.address, grpc::InsecureChannelCredentials()));
  v1::GenerateRequest request;
  if (options.chat) {
    if (!options.system.empty()) {
      v1::ChatMessage* system = request.mutable_chat()->add_messages();
      system->set_role("system");
      system->set_content(options.system);
    }
    v1::ChatMessage* user = request.mutable_chat()->add_messages();
    user->set_role("user");
    user->set_content(options.prompt);
  } else {
    request.set_text(options.prompt);
  }
  request.mutable_sampling()->set_max_tokens(options.max_tokens);
  request.mutable_sampling()->set_temperature(options.temperature);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(options.timeout_s));
  auto reader = stub->Generate(&ctx, request);
  v1::GenerateResponse msg;
  std::string finish_reason;
  int completion_tokens = 0;
  while (reader->Read(&msg)) {
    std::fputs(msg.text().c_str(), stdout);
    std::fflush(stdout);
    if (msg.finished()) {
      finish_reason = msg.finish_reason();
      completion_tokens = msg.usage().completion_tokens();
    }
  }
  grpc::Status status = reader->Finish();
  if (!status.ok()) {
    std::fprintf(stderr, "\nduet complete: %s (code %d)\n", status.error_message().c_str(), int(status.error_code()));
    return 1;
  }
  std::fprintf(stderr, "\n[finish_reason=%s, completion_tokens=%d]\n", finish_reason.c_str(), completion_tokens);
  return 0;
}

}  // namespace duet
