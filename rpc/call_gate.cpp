#include "rpc/call_gate.h"

#include <cstdlib>
#include <string>

#include "grpc/grpc_security.h"

namespace duet::rpc {
namespace {

std::string_view View(const grpc_slice& s) {
  return std::string_view(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(s)), GRPC_SLICE_LENGTH(s));
}

// Runs before any handler, on the transport's thread (it never blocks, so that is allowed).
void ProcessCall(void* state, grpc_auth_context*, const grpc_metadata* md, size_t num_md,
                 grpc_process_auth_metadata_done_cb done, void* user_data) {
  const auto* gate = static_cast<const CallGate*>(state);
  std::string_view method;
  std::string_view credential;
  const grpc_metadata* credential_md = nullptr;
  for (size_t i = 0; i < num_md; ++i) {
    const std::string_view key = View(md[i].key);
    if (key == ":path") method = View(md[i].value);
    if (credential_md == nullptr && key == gate->credential_key()) {
      credential = View(md[i].value);
      credential_md = &md[i];
    }
  }
  const grpc::Status verdict = gate->Admit(method, credential_md != nullptr ? &credential : nullptr);
  if (!verdict.ok()) {
    done(user_data, nullptr, 0, nullptr, 0, static_cast<grpc_status_code>(verdict.error_code()),
         verdict.error_message().c_str());
    return;
  }
  const bool consume = credential_md != nullptr && !gate->passes_credential_on();
  done(user_data, consume ? credential_md : nullptr, consume ? 1 : 0, nullptr, 0, GRPC_STATUS_OK, nullptr);
}

// The core's credentials with the gate's processor. gRPC 1.51's C++ InsecureServerCredentials()
// refuses an AuthMetadataProcessor, while the core's insecure and SSL credentials both take one:
// these add the port with those.
class GatedCredentials final : public grpc::ServerCredentials {
 public:
  GatedCredentials(const CallGate* gate, const TlsMaterial* tls) : gate_(gate), tls_(tls) {}
  void SetAuthMetadataProcessor(const std::shared_ptr<grpc::AuthMetadataProcessor>&) override {
    std::abort();  // the gate is the processor
  }

 private:
  int AddPortToServer(const std::string& address, grpc_server* server) override {
    grpc_server_credentials* creds =
        tls_ != nullptr ? CoreServerCredentials(*tls_) : grpc_insecure_server_credentials_create();
    if (gate_ != nullptr) {
      grpc_server_credentials_set_auth_metadata_processor(creds, {&ProcessCall, nullptr, const_cast<CallGate*>(gate_)});
    }
    const int port = grpc_server_add_http2_port(server, address.c_str(), creds);
    grpc_server_credentials_release(creds);
    return port;
  }

  const CallGate* const gate_;
  const TlsMaterial* const tls_;
};

}  // namespace

std::shared_ptr<grpc::ServerCredentials> GatedServerCredentials(const CallGate* gate, const TlsMaterial* tls) {
  return std::make_shared<GatedCredentials>(gate, tls);
}

}  // namespace duet::rpc
