// TLS for Duet's listeners and for the router's channels to its workers: the certificate files,
// read and checked once at start-up (so a missing file, a key that does not match its
// certificate or a CA bundle with no certificate stops the process with a clear error, not the
// first handshake), and the gRPC credentials made from them. The HTTP server builds its OpenSSL
// context from the same TlsMaterial (router/http_server.h).
//
// Public listeners (the router's HTTP and gRPC ports) take vLLM's flags --ssl-certfile,
// --ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs; the internal RPCs between router and workers
// take --internal-tls-certfile, --internal-tls-keyfile and --internal-tls-ca-certs (mutual TLS:
// a worker given a CA requires a client certificate it signed).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "grpc/grpc_security.h"
#include "grpcpp/security/credentials.h"

namespace duet::rpc {

// What a TLS server asks of its clients' certificates: vLLM's --ssl-cert-reqs, Python's
// ssl.CERT_NONE (0), CERT_OPTIONAL (1: verified against the CA when sent) and CERT_REQUIRED (2).
enum class ClientCertMode { kNone = 0, kOptional = 1, kRequired = 2 };

// Paths as given on the command line; all empty: no TLS.
struct TlsFiles {
  std::string certfile;  // PEM: this side's certificate, then any intermediates
  std::string keyfile;   // PEM: its private key (unencrypted)
  std::string ca_certs;  // PEM: the CAs the peers' certificates are verified against
  ClientCertMode client_certs = ClientCertMode::kNone;  // servers only
};

// The files' contents, checked.
struct TlsMaterial {
  std::string cert_chain_pem;   // empty: a client without a certificate of its own
  std::string private_key_pem;  // with cert_chain_pem
  std::string ca_pem;           // empty: no CA (a server that asks for no client certificate)
  ClientCertMode client_certs = ClientCertMode::kNone;
};

// A server's TLS from `files`, or nullopt when every path is empty (and client_certs is kNone).
// A certificate needs its key and the other way round; client_certs other than kNone needs a CA;
// a CA without a certificate is an error. `flag_prefix` ("--ssl-" or "--internal-tls-") names the
// flags in errors (--ssl-certfile, --ssl-keyfile, --ssl-ca-certs, --ssl-cert-reqs).
absl::StatusOr<std::optional<TlsMaterial>> LoadServerTls(const TlsFiles& files, std::string_view flag_prefix);

// A client's TLS (the router calling its workers): nullopt when every path is empty; else the CA
// is required (the servers' certificates are verified against it) and a certificate with its key
// is optional (presented to servers that ask for one).
absl::StatusOr<std::optional<TlsMaterial>> LoadClientTls(const TlsFiles& files, std::string_view flag_prefix);

// gRPC core server credentials for `tls` (client certificates requested as tls.client_certs
// says, verified against tls.ca_pem); the caller releases them.
grpc_server_credentials* CoreServerCredentials(const TlsMaterial& tls);

// Channel credentials that verify the server against tls.ca_pem and present tls' certificate
// when it has one.
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const TlsMaterial& tls);

}  // namespace duet::rpc
