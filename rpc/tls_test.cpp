#include "rpc/tls.h"

#include <stdlib.h>

#include <chrono>
#include <fstream>

#include "duet/v1/worker.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "rpc/internal_auth.h"
#include "rpc/rpc_util.h"
#include "tests/tls/test_certs.h"

namespace duet::rpc {
namespace {

using ::duet::testing::MakeTestPki;
using ::duet::testing::TestPki;

class TlsFilesTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // A directory of this process's own: ctest runs each test as a process, side by side.
    std::string pattern = ::testing::TempDir() + "/tls_files_test.XXXXXX";
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = new std::string(pattern);
    pki_ = new TestPki(MakeTestPki());
    pki_->WriteTo(*dir_);
    std::ofstream(*dir_ + "/garbage.pem") << "not a certificate\n";
  }
  static std::string Path(const std::string& name) { return *dir_ + "/" + name; }
  static TlsFiles ServerFiles() { return {Path("server.pem"), Path("server.key"), "", ClientCertMode::kNone}; }

  static std::string* dir_;
  static TestPki* pki_;
};
std::string* TlsFilesTest::dir_ = nullptr;
TestPki* TlsFilesTest::pki_ = nullptr;

TEST_F(TlsFilesTest, NoFilesIsNoTls) {
  absl::StatusOr<std::optional<TlsMaterial>> server = LoadServerTls({}, "--ssl-");
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_FALSE(server->has_value());
  absl::StatusOr<std::optional<TlsMaterial>> client = LoadClientTls({}, "--internal-tls-");
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_FALSE(client->has_value());
}

TEST_F(TlsFilesTest, AServerCertificateAndItsKey) {
  absl::StatusOr<std::optional<TlsMaterial>> tls = LoadServerTls(ServerFiles(), "--ssl-");
  ASSERT_TRUE(tls.ok()) << tls.status();
  ASSERT_TRUE(tls->has_value());
  EXPECT_EQ((*tls)->cert_chain_pem, pki_->server.cert_pem);
  EXPECT_EQ((*tls)->private_key_pem, pki_->server.key_pem);
  EXPECT_EQ((*tls)->ca_pem, "");
  TlsFiles with_ca = ServerFiles();
  with_ca.ca_certs = Path("ca.pem");
  with_ca.client_certs = ClientCertMode::kRequired;
  tls = LoadServerTls(with_ca, "--ssl-");
  ASSERT_TRUE(tls.ok()) << tls.status();
  EXPECT_EQ((*tls)->ca_pem, pki_->ca_pem);
  EXPECT_EQ((*tls)->client_certs, ClientCertMode::kRequired);
}

// Each mistake stops start-up with the flag and the file named.
TEST_F(TlsFilesTest, BadFilesAreClearErrors) {
  auto error = [](const TlsFiles& files) {
    absl::StatusOr<std::optional<TlsMaterial>> tls = LoadServerTls(files, "--ssl-");
    return tls.ok() ? std::string("ok") : std::string(tls.status().message());
  };
  TlsFiles files = ServerFiles();
  files.certfile = Path("missing.pem");
  EXPECT_EQ(LoadServerTls(files, "--ssl-").status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(error(files).find("cannot read --ssl-certfile " + Path("missing.pem")), std::string::npos) << error(files);

  files = ServerFiles();
  files.keyfile = Path("missing.key");
  EXPECT_NE(error(files).find("cannot read --ssl-keyfile"), std::string::npos) << error(files);

  files = ServerFiles();
  files.certfile = Path("garbage.pem");
  EXPECT_NE(error(files).find("--ssl-certfile " + Path("garbage.pem") + " holds no PEM certificate"),
            std::string::npos)
      << error(files);

  files = ServerFiles();
  files.keyfile = Path("server.pem");  // a certificate, not a key
  EXPECT_NE(error(files).find("holds no PEM private key"), std::string::npos) << error(files);

  files = ServerFiles();
  files.keyfile = Path("client.key");  // another certificate's key
  EXPECT_NE(error(files).find("does not match the certificate in --ssl-certfile"), std::string::npos) << error(files);

  files = ServerFiles();
  files.keyfile = "";
  EXPECT_EQ(error(files), "--ssl-certfile needs --ssl-keyfile");
  files = ServerFiles();
  files.certfile = "";
  EXPECT_EQ(error(files), "--ssl-keyfile needs --ssl-certfile");

  files = ServerFiles();
  files.client_certs = ClientCertMode::kOptional;
  EXPECT_NE(error(files).find("--ssl-cert-reqs 1 needs --ssl-ca-certs"), std::string::npos) << error(files);
  EXPECT_NE(error({"", "", "", ClientCertMode::kRequired}).find("--ssl-cert-reqs needs --ssl-certfile"),
            std::string::npos);
  EXPECT_NE(error({"", "", Path("ca.pem"), ClientCertMode::kNone}).find("--ssl-ca-certs needs --ssl-certfile"),
            std::string::npos);

  files = ServerFiles();
  files.ca_certs = Path("garbage.pem");
  EXPECT_NE(error(files).find("--ssl-ca-certs " + Path("garbage.pem") + " holds no PEM certificate"),
            std::string::npos)
      << error(files);
}

TEST_F(TlsFilesTest, AClientNeedsTheCaAndMayHaveACertificate) {
  absl::StatusOr<std::optional<TlsMaterial>> tls =
      LoadClientTls({Path("client.pem"), Path("client.key"), "", ClientCertMode::kNone}, "--internal-tls-");
  ASSERT_FALSE(tls.ok());
  EXPECT_NE(tls.status().message().find("--internal-tls-ca-certs"), std::string::npos) << tls.status();
  tls = LoadClientTls({"", "", Path("ca.pem"), ClientCertMode::kNone}, "--internal-tls-");
  ASSERT_TRUE(tls.ok()) << tls.status();
  EXPECT_EQ((*tls)->cert_chain_pem, "");
  tls = LoadClientTls({Path("client.pem"), Path("client.key"), Path("ca.pem"), ClientCertMode::kNone},
                      "--internal-tls-");
  ASSERT_TRUE(tls.ok()) << tls.status();
  EXPECT_EQ((*tls)->cert_chain_pem, pki_->client.cert_pem);
  tls = LoadClientTls({Path("client.pem"), Path("server.key"), Path("ca.pem"), ClientCertMode::kNone},
                      "--internal-tls-");
  EXPECT_NE(tls.status().message().find("does not match"), std::string::npos) << tls.status();
}

constexpr char kToken[] = "0123456789abcdef0123456789abcdef";

// A worker's port with internal TLS and a CA: only clients with a certificate the CA signed get
// through the handshake (health checks too); the token is still required after it.
class MutualTlsWorkerTest : public ::testing::Test {
 protected:
  void Start(bool with_ca) {
    server_tls_.cert_chain_pem = pki_.server.cert_pem;
    server_tls_.private_key_pem = pki_.server.key_pem;
    if (with_ca) {
      server_tls_.ca_pem = pki_.ca_pem;
      server_tls_.client_certs = ClientCertMode::kRequired;
    }
    int port = 0;
    auto server = StartServer("127.0.0.1:0", {&service_}, &port, gate_.Credentials(&server_tls_));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    address_ = "127.0.0.1:" + std::to_string(port);
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
  }
  // GetStats through a channel with these credentials: UNIMPLEMENTED once admitted (the service
  // here implements nothing).
  grpc::StatusCode Call(const std::shared_ptr<grpc::ChannelCredentials>& credentials, const std::string& token) {
    auto channel = grpc::experimental::CreateCustomChannelWithInterceptors(
        address_, credentials, grpc::ChannelArguments(), InternalTokenInterceptors(token));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::WorkerStats stats;
    return v1::PrefillWorker::NewStub(channel)->GetStats(&ctx, v1::GetStatsRequest(), &stats).error_code();
  }
  grpc::StatusCode Health(const std::shared_ptr<grpc::ChannelCredentials>& credentials) {
    auto stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel(address_, credentials));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckResponse response;
    return stub->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &response).error_code();
  }
  std::shared_ptr<grpc::ChannelCredentials> Tls(const std::string& ca, const testing::TestCert* cert) {
    TlsMaterial tls;
    tls.ca_pem = ca;
    if (cert != nullptr) {
      tls.cert_chain_pem = cert->cert_pem;
      tls.private_key_pem = cert->key_pem;
    }
    return ChannelCredentials(tls);
  }

  const TestPki pki_ = MakeTestPki();
  TlsMaterial server_tls_;
  WorkerCallGate gate_{kToken};
  v1::PrefillWorker::CallbackService service_;  // every method UNIMPLEMENTED
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

TEST_F(MutualTlsWorkerTest, OnlyClientsWithACertificateTheCaSignedGetIn) {
  Start(/*with_ca=*/true);
  EXPECT_EQ(Call(Tls(pki_.ca_pem, &pki_.client), kToken), grpc::StatusCode::UNIMPLEMENTED);  // admitted
  EXPECT_EQ(Call(Tls(pki_.ca_pem, &pki_.server), kToken), grpc::StatusCode::UNIMPLEMENTED);  // also clientAuth
  EXPECT_EQ(Call(Tls(pki_.ca_pem, &pki_.client), ""), grpc::StatusCode::UNAUTHENTICATED);   // the token still counts
  EXPECT_EQ(Call(Tls(pki_.ca_pem, nullptr), kToken), grpc::StatusCode::UNAVAILABLE);        // no certificate
  EXPECT_EQ(Call(Tls(pki_.ca_pem, &pki_.other_client), kToken), grpc::StatusCode::UNAVAILABLE);  // another CA's
  EXPECT_EQ(Call(grpc::InsecureChannelCredentials(), kToken), grpc::StatusCode::UNAVAILABLE);    // plaintext
  EXPECT_EQ(Health(Tls(pki_.ca_pem, &pki_.client)), grpc::StatusCode::OK);
  EXPECT_EQ(Health(Tls(pki_.ca_pem, nullptr)), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Health(grpc::InsecureChannelCredentials()), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(MutualTlsWorkerTest, WithoutACaAnyTlsClientWithTheTokenGetsIn) {
  Start(/*with_ca=*/false);
  EXPECT_EQ(Call(Tls(pki_.ca_pem, nullptr), kToken), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(Call(Tls(pki_.ca_pem, nullptr), "wrong"), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Call(grpc::InsecureChannelCredentials(), kToken), grpc::StatusCode::UNAVAILABLE);
  // A client that trusts another CA refuses the worker's certificate.
  EXPECT_EQ(Call(Tls(pki_.other_ca_pem, nullptr), kToken), grpc::StatusCode::UNAVAILABLE);
}

}  // namespace
}  // namespace duet::rpc
