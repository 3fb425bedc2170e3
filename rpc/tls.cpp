#include "rpc/tls.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "grpcpp/security/credentials.h"
#include "openssl/err.h"
#include "openssl/pem.h"
#include "openssl/x509.h"

namespace duet::rpc {
namespace {

using Bio = std::unique_ptr<BIO, decltype(&BIO_free)>;
using Cert = std::unique_ptr<X509, decltype(&X509_free)>;
using Key = std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)>;

std::string Flag(std::string_view prefix, std::string_view name) { return std::string(prefix) + std::string(name); }

absl::StatusOr<std::string> ReadFile(const std::string& path, const std::string& flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read ", flag, " ", path, ": ", std::strerror(errno)));
  }
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::NotFoundError(absl::StrCat("cannot read ", flag, " ", path));
  return text.str();
}

// The PEM certificates in `pem`, in order; none is an error.
absl::StatusOr<std::vector<Cert>> ParseCerts(const std::string& pem, const std::string& what) {
  Bio bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), &BIO_free);
  std::vector<Cert> certs;
  while (X509* cert = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) certs.emplace_back(cert, &X509_free);
  ERR_clear_error();  // the end of the input reads as an error
  if (certs.empty()) return absl::InvalidArgumentError(absl::StrCat(what, " holds no PEM certificate"));
  return certs;
}

absl::StatusOr<Key> ParseKey(const std::string& pem, const std::string& what) {
  Bio bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), &BIO_free);
  // An empty passphrase callback: an encrypted key is an error, not a prompt on the terminal.
  Key key(PEM_read_bio_PrivateKey(bio.get(), nullptr, [](char*, int, int, void*) { return 0; }, nullptr),
          &EVP_PKEY_free);
  ERR_clear_error();
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, " holds no PEM private key (an encrypted key is not supported)"));
  }
  return key;
}

void WarnIfNotValidNow(X509* cert, const std::string& what) {
  if (X509_cmp_current_time(X509_get0_notAfter(cert)) < 0) {
    DUET_LOG(WARNING) << what << ": the certificate has expired; peers will refuse it";
  } else if (X509_cmp_current_time(X509_get0_notBefore(cert)) > 0) {
    DUET_LOG(WARNING) << what << ": the certificate is not valid yet; peers will refuse it";
  }
}

// The certificate chain and its key, read and checked against each other.
absl::Status LoadCertAndKey(const TlsFiles& files, std::string_view prefix, TlsMaterial* out) {
  const std::string cert_flag = Flag(prefix, "certfile"), key_flag = Flag(prefix, "keyfile");
  if (files.certfile.empty() != files.keyfile.empty()) {
    return absl::InvalidArgumentError(files.certfile.empty() ? absl::StrCat(key_flag, " needs ", cert_flag)
                                                             : absl::StrCat(cert_flag, " needs ", key_flag));
  }
  if (files.certfile.empty()) return absl::OkStatus();
  absl::StatusOr<std::string> cert_pem = ReadFile(files.certfile, cert_flag);
  if (!cert_pem.ok()) return cert_pem.status();
  absl::StatusOr<std::string> key_pem = ReadFile(files.keyfile, key_flag);
  if (!key_pem.ok()) return key_pem.status();
  const std::string cert_what = absl::StrCat(cert_flag, " ", files.certfile);
  absl::StatusOr<std::vector<Cert>> chain = ParseCerts(*cert_pem, cert_what);
  if (!chain.ok()) return chain.status();
  absl::StatusOr<Key> key = ParseKey(*key_pem, absl::StrCat(key_flag, " ", files.keyfile));
  if (!key.ok()) return key.status();
  const bool match = X509_check_private_key(chain->front().get(), key->get()) == 1;
  ERR_clear_error();
  if (!match) {
    return absl::InvalidArgumentError(absl::StrCat("the private key in ", key_flag, " ", files.keyfile,
                                                   " does not match the certificate in ", cert_what));
  }
  WarnIfNotValidNow(chain->front().get(), cert_what);
  out->cert_chain_pem = *std::move(cert_pem);
  out->private_key_pem = *std::move(key_pem);
  return absl::OkStatus();
}

absl::Status LoadCa(const TlsFiles& files, std::string_view prefix, TlsMaterial* out) {
  if (files.ca_certs.empty()) return absl::OkStatus();
  const std::string flag = Flag(prefix, "ca-certs");
  absl::StatusOr<std::string> pem = ReadFile(files.ca_certs, flag);
  if (!pem.ok()) return pem.status();
  if (absl::StatusOr<std::vector<Cert>> cas = ParseCerts(*pem, absl::StrCat(flag, " ", files.ca_certs)); !cas.ok()) {
    return cas.status();
  }
  out->ca_pem = *std::move(pem);
  return absl::OkStatus();
}

bool NoFiles(const TlsFiles& files) {
  return files.certfile.empty() && files.keyfile.empty() && files.ca_certs.empty();
}

}  // namespace

absl::StatusOr<std::optional<TlsMaterial>> LoadServerTls(const TlsFiles& files, std::string_view flag_prefix) {
  if (NoFiles(files)) {
    if (files.client_certs != ClientCertMode::kNone) {
      return absl::InvalidArgumentError(
          absl::StrCat(Flag(flag_prefix, "cert-reqs"), " needs ", Flag(flag_prefix, "certfile"), " and ",
                       Flag(flag_prefix, "ca-certs")));
    }
    return std::nullopt;
  }
  if (files.certfile.empty() && files.keyfile.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(Flag(flag_prefix, "ca-certs"), " needs ",
                                                   Flag(flag_prefix, "certfile"), " and ",
                                                   Flag(flag_prefix, "keyfile")));
  }
  if (files.client_certs != ClientCertMode::kNone && files.ca_certs.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(Flag(flag_prefix, "cert-reqs"), " ",
                                                   static_cast<int>(files.client_certs), " needs ",
                                                   Flag(flag_prefix, "ca-certs"),
                                                   " (the CAs client certificates are verified against)"));
  }
  TlsMaterial tls;
  tls.client_certs = files.client_certs;
  if (absl::Status s = LoadCertAndKey(files, flag_prefix, &tls); !s.ok()) return s;
  if (absl::Status s = LoadCa(files, flag_prefix, &tls); !s.ok()) return s;
  return tls;
}

absl::StatusOr<std::optional<TlsMaterial>> LoadClientTls(const TlsFiles& files, std::string_view flag_prefix) {
  if (NoFiles(files)) return std::nullopt;
  if (files.ca_certs.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TLS to the workers needs ", Flag(flag_prefix, "ca-certs"), " (the CAs their certificates are verified against)"));
  }
  TlsMaterial tls;
  if (absl::Status s = LoadCertAndKey(files, flag_prefix, &tls); !s.ok()) return s;
  if (absl::Status s = LoadCa(files, flag_prefix, &tls); !s.ok()) return s;
  return tls;
}

grpc_server_credentials* CoreServerCredentials(const TlsMaterial& tls) {
  const grpc_ssl_pem_key_cert_pair pair = {tls.private_key_pem.c_str(), tls.cert_chain_pem.c_str()};
  grpc_ssl_server_certificate_config* config =
      grpc_ssl_server_certificate_config_create(tls.ca_pem.empty() ? nullptr : tls.ca_pem.c_str(), &pair, 1);
  grpc_ssl_client_certificate_request_type request = GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
  if (tls.client_certs == ClientCertMode::kOptional) request = GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY;
  if (tls.client_certs == ClientCertMode::kRequired) {
    request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  // The options take the config, the credentials the options.
  return grpc_ssl_server_credentials_create_with_options(
      grpc_ssl_server_credentials_create_options_using_config(request, config));
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const TlsMaterial& tls) {
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = tls.ca_pem;
  options.pem_private_key = tls.private_key_pem;
  options.pem_cert_chain = tls.cert_chain_pem;
  return grpc::SslCredentials(options);
}

}  // namespace duet::rpc
