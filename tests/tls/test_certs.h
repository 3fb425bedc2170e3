// Certificates for TLS tests, made when a test runs (OpenSSL's C API; no key is checked in): a
// CA, a leaf it signs for 127.0.0.1, ::1 and localhost that serves as server and as client
// certificate, a second client certificate, and an unrelated CA with a client certificate of
// its own (a "wrong" client). EC P-256 keys: fast to make.
#pragma once

#include <string>

namespace duet::testing {

struct TestCert {
  std::string cert_pem;  // the certificate alone (its issuer is the CA)
  std::string key_pem;   // its private key, PKCS#8
};

struct TestPki {
  std::string ca_pem;
  TestCert server;  // CN duet-test-server; SANs IP:127.0.0.1, IP:::1, DNS:localhost; serverAuth + clientAuth
  TestCert client;  // CN duet-test-client, signed by the CA; clientAuth
  std::string other_ca_pem;
  TestCert other_client;  // signed by other_ca, unknown to ca

  // Writes ca.pem, server.pem, server.key, client.pem, client.key, other_ca.pem, other_client.pem
  // and other_client.key into `dir` (which exists); keys are mode 0600.
  void WriteTo(const std::string& dir) const;
};

// A fresh set each call (new keys and serial numbers). Aborts if OpenSSL fails.
TestPki MakeTestPki();

}  // namespace duet::testing
