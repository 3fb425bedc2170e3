// `duet complete`: a minimal gRPC client for the router — sends one prompt (or, with --chat,
// one user message) to Generate and prints the streamed text as it arrives.
#include <cstdio>

#include "absl/status/statusor.h"
#include "cli/api_key.h"
#include "cli/commands.h"
#include "duet/v1/duet.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "rpc/tls.h"

namespace duet {
namespace {

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> Credentials(const CompleteOptions& options) {
  const rpc::TlsFiles& files = options.tls_files;
  if (!files.ca_certs.empty() || !files.certfile.empty() || !files.keyfile.empty()) {
    absl::StatusOr<std::optional<rpc::TlsMaterial>> tls = rpc::LoadClientTls(files, "--ssl-");
    if (!tls.ok()) return tls.status();
    return rpc::ChannelCredentials(**tls);
  }
  if (options.tls || !options.tls_server_name.empty()) return grpc::SslCredentials({});  // the system's roots
  return grpc::InsecureChannelCredentials();
}

}  // namespace

int RunComplete(const CompleteOptions& options) {
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials = Credentials(options);
  absl::StatusOr<std::string> api_key = LoadApiKey(options.api_key, options.api_key_file);
  for (const absl::Status& s : {credentials.status(), api_key.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "duet complete: %s\n", std::string(s.message()).c_str());
      return 2;
    }
  }
  grpc::ChannelArguments args;
  if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  auto stub = v1::Duet::NewStub(grpc::CreateCustomChannel(options.address, *credentials, args));
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
  request.mutable_sampling()->set_ignore_eos(options.ignore_eos);
  grpc::ClientContext ctx;
  if (!api_key->empty()) ctx.AddMetadata("authorization", "Bearer " + *api_key);
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
