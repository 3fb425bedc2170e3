// TLS flags (rpc/tls.h): vLLM's --ssl-* for the router's public ports (`duet router`, `duet
// serve`), and --internal-tls-* for the RPCs between the router and its workers (every role, and
// `duet serve`, which hands them to the processes it starts).
#pragma once

#include <string>

#include "CLI/CLI.hpp"
#include "rpc/tls.h"

namespace duet {

// --ssl-certfile, --ssl-keyfile, --ssl-ca-certs, --ssl-cert-reqs, as vLLM's.
inline void AddSslFlags(CLI::App* cmd, rpc::TlsFiles* files) {
  cmd->add_option("--ssl-certfile", files->certfile,
                  "PEM certificate (chain) of the HTTP and gRPC ports: both serve TLS with it (default: plaintext)");
  cmd->add_option("--ssl-keyfile", files->keyfile, "PEM private key of --ssl-certfile");
  cmd->add_option("--ssl-ca-certs", files->ca_certs, "PEM CA certificates that client certificates are verified against");
  cmd->add_option_function<int>(
         "--ssl-cert-reqs", [files](int mode) { files->client_certs = static_cast<rpc::ClientCertMode>(mode); },
         "Client certificates (needs --ssl-ca-certs): 0 not asked for, 1 optional (verified when sent), 2 required")
      ->check(CLI::Range(0, 2))
      ->default_str("0");
}

enum class InternalTlsRole { kRouter, kWorker, kServe };

// --internal-tls-certfile, --internal-tls-keyfile, --internal-tls-ca-certs of `role`.
inline void AddInternalTlsFlags(CLI::App* cmd, rpc::TlsFiles* files, InternalTlsRole role) {
  switch (role) {
    case InternalTlsRole::kRouter:
      cmd->add_option("--internal-tls-ca-certs", files->ca_certs,
                      "PEM CA certificates: calls to the workers use TLS and verify the workers' certificates "
                      "against them (default: plaintext)");
      cmd->add_option("--internal-tls-certfile", files->certfile,
                      "PEM client certificate the router presents to workers that require one");
      cmd->add_option("--internal-tls-keyfile", files->keyfile, "PEM private key of --internal-tls-certfile");
      return;
    case InternalTlsRole::kWorker:
      cmd->add_option("--internal-tls-certfile", files->certfile,
                      "PEM certificate (chain) of the gRPC port: it serves TLS with it (default: plaintext); it must "
                      "name the address the router uses (an IP SAN for host:port) or the router's "
                      "--internal-tls-server-name");
      cmd->add_option("--internal-tls-keyfile", files->keyfile, "PEM private key of --internal-tls-certfile");
      cmd->add_option("--internal-tls-ca-certs", files->ca_certs,
                      "PEM CA certificates: every client needs a certificate they signed (mutual TLS, health "
                      "checks included)");
      return;
    case InternalTlsRole::kServe:
      cmd->add_option("--internal-tls-certfile", files->certfile,
                      "Mutual TLS between the router and its workers (default: plaintext on loopback): PEM "
                      "certificate every worker serves and the router presents; for 127.0.0.1 (an IP SAN), usable "
                      "as server and client certificate");
      cmd->add_option("--internal-tls-keyfile", files->keyfile, "PEM private key of --internal-tls-certfile");
      cmd->add_option("--internal-tls-ca-certs", files->ca_certs,
                      "PEM CA certificates that signed --internal-tls-certfile (both sides verify against them)");
      return;
  }
}

// A worker's --api-key, --api-key-file and --api-key-on-health-and-metrics: with the switch its
// /metrics port needs the key (the router's public key, as Prometheus sends it to the router).
inline constexpr char kWorkerApiKeyHelp[] =
    "With --api-key-on-health-and-metrics, /metrics needs \"Authorization: Bearer <key>\" (visible in ps: prefer "
    "--api-key-file or DUET_API_KEY)";
inline constexpr char kWorkerApiKeyOnMetricsHelp[] =
    "/metrics needs the API key (default: public, as the router's /metrics)";

}  // namespace duet
