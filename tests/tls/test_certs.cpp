#include "tests/tls/test_certs.h"

#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>

#include "openssl/bn.h"
#include "openssl/evp.h"
#include "openssl/pem.h"
#include "openssl/rand.h"
#include "openssl/x509.h"
#include "openssl/x509v3.h"

namespace duet::testing {
namespace {

void Require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "test_certs: %s failed\n", what);
    std::abort();
  }
}

using Key = std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)>;
using Cert = std::unique_ptr<X509, decltype(&X509_free)>;

Key NewKey() {
  Key key(EVP_EC_gen("P-256"), &EVP_PKEY_free);
  Require(key != nullptr, "EVP_EC_gen");
  return key;
}

void AddExtension(X509* cert, X509* issuer, int nid, const char* value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
  Require(ext != nullptr, "X509V3_EXT_conf_nid");
  Require(X509_add_ext(cert, ext, -1) == 1, "X509_add_ext");
  X509_EXTENSION_free(ext);
}

// A certificate for `key` named `cn`, signed by `issuer_key` (`issuer` null: self-signed).
Cert NewCert(EVP_PKEY* key, const char* cn, X509* issuer, EVP_PKEY* issuer_key, bool ca, const char* extended_usage,
             const char* subject_alt_names) {
  Cert cert(X509_new(), &X509_free);
  Require(cert != nullptr, "X509_new");
  Require(X509_set_version(cert.get(), 2) == 1, "X509_set_version");
  unsigned char serial[16];
  Require(RAND_bytes(serial, sizeof(serial)) == 1, "RAND_bytes");
  serial[0] &= 0x7f;  // positive
  BIGNUM* bn = BN_bin2bn(serial, sizeof(serial), nullptr);
  Require(bn != nullptr && BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(cert.get())) != nullptr, "serial");
  BN_free(bn);
  Require(X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600) != nullptr, "notBefore");
  Require(X509_gmtime_adj(X509_getm_notAfter(cert.get()), 7L * 24 * 3600) != nullptr, "notAfter");
  X509_NAME* name = X509_get_subject_name(cert.get());
  Require(X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC, reinterpret_cast<const unsigned char*>("Duet tests"),
                                     -1, -1, 0) == 1 &&
              X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>(cn), -1,
                                         -1, 0) == 1,
          "subject");
  X509* signer = issuer != nullptr ? issuer : cert.get();
  Require(X509_set_issuer_name(cert.get(), X509_get_subject_name(signer)) == 1, "issuer");
  Require(X509_set_pubkey(cert.get(), key) == 1, "X509_set_pubkey");
  AddExtension(cert.get(), signer, NID_basic_constraints, ca ? "critical,CA:TRUE" : "critical,CA:FALSE");
  AddExtension(cert.get(), signer, NID_key_usage,
               ca ? "critical,keyCertSign,cRLSign" : "critical,digitalSignature,keyEncipherment");
  AddExtension(cert.get(), signer, NID_subject_key_identifier, "hash");
  if (issuer != nullptr) AddExtension(cert.get(), signer, NID_authority_key_identifier, "keyid:always");
  if (extended_usage != nullptr) AddExtension(cert.get(), signer, NID_ext_key_usage, extended_usage);
  if (subject_alt_names != nullptr) AddExtension(cert.get(), signer, NID_subject_alt_name, subject_alt_names);
  Require(X509_sign(cert.get(), issuer_key, EVP_sha256()) > 0, "X509_sign");
  return cert;
}

std::string CertPem(X509* cert) {
  BIO* bio = BIO_new(BIO_s_mem());
  Require(bio != nullptr && PEM_write_bio_X509(bio, cert) == 1, "PEM_write_bio_X509");
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  std::string pem(data, size_t(n));
  BIO_free(bio);
  return pem;
}

std::string KeyPem(EVP_PKEY* key) {
  BIO* bio = BIO_new(BIO_s_mem());
  Require(bio != nullptr && PEM_write_bio_PrivateKey(bio, key, nullptr, nullptr, 0, nullptr, nullptr) == 1,
          "PEM_write_bio_PrivateKey");
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  std::string pem(data, size_t(n));
  BIO_free(bio);
  return pem;
}

void WriteFile(const std::string& path, const std::string& text, bool secret) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    Require(out.good(), "writing a test certificate file");
  }
  if (secret) ::chmod(path.c_str(), 0600);
}

}  // namespace

TestPki MakeTestPki() {
  TestPki pki;
  Key ca_key = NewKey();
  Cert ca = NewCert(ca_key.get(), "Duet test CA", nullptr, ca_key.get(), true, nullptr, nullptr);
  pki.ca_pem = CertPem(ca.get());

  Key server_key = NewKey();
  Cert server = NewCert(server_key.get(), "duet-test-server", ca.get(), ca_key.get(), false, "serverAuth,clientAuth",
                        "IP:127.0.0.1,IP:::1,DNS:localhost");
  pki.server = {CertPem(server.get()), KeyPem(server_key.get())};

  Key client_key = NewKey();
  Cert client = NewCert(client_key.get(), "duet-test-client", ca.get(), ca_key.get(), false, "clientAuth", nullptr);
  pki.client = {CertPem(client.get()), KeyPem(client_key.get())};

  Key other_ca_key = NewKey();
  Cert other_ca = NewCert(other_ca_key.get(), "Another CA", nullptr, other_ca_key.get(), true, nullptr, nullptr);
  pki.other_ca_pem = CertPem(other_ca.get());
  Key other_key = NewKey();
  Cert other = NewCert(other_key.get(), "duet-test-stranger", other_ca.get(), other_ca_key.get(), false,
                       "serverAuth,clientAuth", "IP:127.0.0.1,IP:::1,DNS:localhost");
  pki.other_client = {CertPem(other.get()), KeyPem(other_key.get())};
  return pki;
}

void TestPki::WriteTo(const std::string& dir) const {
  WriteFile(dir + "/ca.pem", ca_pem, false);
  WriteFile(dir + "/server.pem", server.cert_pem, false);
  WriteFile(dir + "/server.key", server.key_pem, true);
  WriteFile(dir + "/client.pem", client.cert_pem, false);
  WriteFile(dir + "/client.key", client.key_pem, true);
  WriteFile(dir + "/other_ca.pem", other_ca_pem, false);
  WriteFile(dir + "/other_client.pem", other_client.cert_pem, false);
  WriteFile(dir + "/other_client.key", other_client.key_pem, true);
}

}  // namespace duet::testing
