// The router's public ports under TLS and the API key (Router::Start in front of fake workers):
// gRPC over TLS and mutual TLS, HTTPS, the key on reflection, health and the metrics exporter,
// and the start-up errors of bad certificate files.
#include <stdlib.h>

#include <chrono>
#include <fstream>
#include <thread>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/ssl/context.hpp>
#include <boost/asio/ssl/stream.hpp>
#include <boost/asio/write.hpp>

#include "duet/v1/duet.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "gtest/gtest.h"
#include "metrics/test_http_client.h"
#include "router/api_key_gate.h"
#include "router/fake_workers.h"
#include "router/router.h"
#include "tests/tls/test_certs.h"

namespace duet::router {
namespace {

namespace net = boost::asio;
using ::testing::HasSubstr;
using testing::FakeDecodeWorker;
using testing::FakePrefillWorker;
using testing::FakeServer;

constexpr char kModelDir[] = DUET_MODELS_DIR "/tiny-code-llama";
constexpr char kKey[] = "sk-router-security";

TEST(ApiKeyGateTest, EveryMethodNeedsTheKeyHealthOnlyWhenAsked) {
  const std::string right_text = std::string("Bearer ") + kKey;
  const std::string_view right = right_text, wrong = "Bearer nope", bare = kKey;
  for (bool keyed_health : {false, true}) {
    ApiKeyGate gate(kKey, keyed_health);
    for (const char* method : {"/duet.v1.Duet/Generate", "/duet.v1.Duet/Abort", "/duet.v1.Duet/GetModelInfo",
                               "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                               "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", "/any/Other"}) {
      EXPECT_EQ(gate.Admit(method, nullptr).error_code(), grpc::StatusCode::UNAUTHENTICATED) << method;
      EXPECT_EQ(gate.Admit(method, &wrong).error_code(), grpc::StatusCode::UNAUTHENTICATED) << method;
      EXPECT_EQ(gate.Admit(method, &bare).error_code(), grpc::StatusCode::UNAUTHENTICATED) << method;
      EXPECT_TRUE(gate.Admit(method, &right).ok()) << method;
    }
    for (const char* method : {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"}) {
      EXPECT_EQ(gate.Admit(method, nullptr).ok(), !keyed_health) << method;
      EXPECT_TRUE(gate.Admit(method, &right).ok()) << method;
    }
  }
}

class RouterSecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // A directory of this process's own: ctest runs each test as a process, side by side.
    std::string pattern = ::testing::TempDir() + "/router_security_test.XXXXXX";
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = new std::string(pattern);
    pki_ = new duet::testing::TestPki(duet::testing::MakeTestPki());
    pki_->WriteTo(*dir_);
  }
  static std::string Path(const std::string& name) { return *dir_ + "/" + name; }

  RouterOptions Options() {
    prefill_server_ = std::make_unique<FakeServer>(&prefill_);
    decode_server_ = std::make_unique<FakeServer>(&decode_);
    RouterOptions options;
    options.model_dir = kModelDir;
    options.prefill_addresses = {prefill_server_->address()};
    options.decode_addresses = {decode_server_->address()};
    options.log_stats_interval_s = 0;
    return options;
  }
  void Start(const RouterOptions& options) {
    absl::StatusOr<std::unique_ptr<Router>> router = Router::Start(options);
    ASSERT_TRUE(router.ok()) << router.status();
    router_ = *std::move(router);
  }
  void TearDown() override {
    if (router_) router_->Shutdown(0);
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(router_->port()); }

  std::shared_ptr<grpc::ChannelCredentials> Tls(const duet::testing::TestCert* client = nullptr) const {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = pki_->ca_pem;
    if (client != nullptr) {
      options.pem_cert_chain = client->cert_pem;
      options.pem_private_key = client->key_pem;
    }
    return grpc::SslCredentials(options);
  }
  grpc::StatusCode ModelInfo(const std::shared_ptr<grpc::ChannelCredentials>& credentials, const char* key = nullptr) {
    auto stub = v1::Duet::NewStub(grpc::CreateChannel(address(), credentials));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (key != nullptr) context.AddMetadata("authorization", std::string("Bearer ") + key);
    v1::ModelInfo info;
    return stub->GetModelInfo(&context, v1::GetModelInfoRequest(), &info).error_code();
  }
  grpc::StatusCode Health(const char* key = nullptr) {
    auto stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel(address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (key != nullptr) context.AddMetadata("authorization", std::string("Bearer ") + key);
    grpc::health::v1::HealthCheckResponse response;
    return stub->Check(&context, grpc::health::v1::HealthCheckRequest(), &response).error_code();
  }
  // The services reflection lists (grpc.reflection.v1), or the call's error.
  grpc::StatusCode ListServices(const char* key, std::vector<std::string>* services = nullptr) {
    auto stub = grpc::reflection::v1::ServerReflection::NewStub(
        grpc::CreateChannel(address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (key != nullptr) context.AddMetadata("authorization", std::string("Bearer ") + key);
    auto stream = stub->ServerReflectionInfo(&context);
    grpc::reflection::v1::ServerReflectionRequest request;
    request.set_list_services("");
    stream->Write(request);
    stream->WritesDone();
    grpc::reflection::v1::ServerReflectionResponse response;
    while (stream->Read(&response)) {
      for (const auto& service : response.list_services_response().service()) {
        if (services != nullptr) services->push_back(service.name());
      }
    }
    return stream->Finish().error_code();
  }

  static std::string* dir_;
  static duet::testing::TestPki* pki_;
  FakePrefillWorker prefill_;
  FakeDecodeWorker decode_;
  std::unique_ptr<FakeServer> prefill_server_, decode_server_;
  std::unique_ptr<Router> router_;
};
std::string* RouterSecurityTest::dir_ = nullptr;
duet::testing::TestPki* RouterSecurityTest::pki_ = nullptr;

// A GET over HTTPS to 127.0.0.1:port, verifying the server against `ca`; the raw response.
std::string HttpsGet(int port, const std::string& ca, const std::string& target) {
  net::io_context ioc;
  net::ssl::context ctx(net::ssl::context::tls_client);
  ctx.add_certificate_authority(net::buffer(ca));
  ctx.set_verify_mode(net::ssl::verify_peer);
  net::ip::tcp::socket socket(ioc);
  socket.connect(net::ip::tcp::endpoint(net::ip::make_address("127.0.0.1"), static_cast<uint16_t>(port)));
  net::ssl::stream<net::ip::tcp::socket&> stream(socket, ctx);
  boost::system::error_code ec;
  stream.handshake(net::ssl::stream_base::client, ec);
  if (ec) return "handshake failed: " + ec.message();
  net::write(stream, net::buffer("GET " + target + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"), ec);
  std::string response;
  char buf[4096];
  for (;;) {
    const size_t n = stream.read_some(net::buffer(buf), ec);
    response.append(buf, n);
    if (ec) break;
  }
  return response;
}

// --ssl-certfile/--ssl-keyfile: the gRPC port and the HTTP port speak TLS with that certificate.
TEST_F(RouterSecurityTest, BothPortsServeTls) {
  RouterOptions options = Options();
  options.tls = {Path("server.pem"), Path("server.key"), "", rpc::ClientCertMode::kNone};
  options.http_port = 0;
  Start(options);
  EXPECT_EQ(ModelInfo(Tls()), grpc::StatusCode::OK);
  EXPECT_EQ(ModelInfo(Tls(&pki_->client)), grpc::StatusCode::OK);  // a certificate nobody asked for
  EXPECT_EQ(ModelInfo(grpc::InsecureChannelCredentials()), grpc::StatusCode::UNAVAILABLE);
  const std::string models = HttpsGet(router_->http_port(), pki_->ca_pem, "/v1/models");
  EXPECT_THAT(models, HasSubstr("HTTP/1.1 200 OK"));
  EXPECT_THAT(models, HasSubstr("\"tiny-code-llama\""));
  EXPECT_THAT(HttpsGet(router_->http_port(), pki_->other_ca_pem, "/v1/models"), HasSubstr("handshake failed"));
  // The plain-HTTP gRPC client left the server as it was.
  EXPECT_EQ(ModelInfo(Tls()), grpc::StatusCode::OK);
}

// --ssl-cert-reqs 2 with --ssl-ca-certs: gRPC clients need a certificate the CA signed.
TEST_F(RouterSecurityTest, ClientCertificatesOnTheGrpcPort) {
  RouterOptions options = Options();
  options.tls = {Path("server.pem"), Path("server.key"), Path("ca.pem"), rpc::ClientCertMode::kRequired};
  Start(options);
  EXPECT_EQ(ModelInfo(Tls(&pki_->client)), grpc::StatusCode::OK);
  EXPECT_EQ(ModelInfo(Tls()), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(ModelInfo(Tls(&pki_->other_client)), grpc::StatusCode::UNAVAILABLE);
}

// --api-key: reflection and the Duet service need the key; health stays open (for probes)
// unless --api-key-on-health-and-metrics, which also puts the metrics exporter under it.
TEST_F(RouterSecurityTest, TheApiKeyCoversReflectionAndOptionallyHealthAndMetrics) {
  RouterOptions options = Options();
  options.api_key = kKey;
  options.metrics_port = 0;
  Start(options);
  EXPECT_EQ(ModelInfo(grpc::InsecureChannelCredentials()), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(ModelInfo(grpc::InsecureChannelCredentials(), kKey), grpc::StatusCode::OK);
  EXPECT_EQ(ListServices(nullptr), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(ListServices("wrong"), grpc::StatusCode::UNAUTHENTICATED);
  std::vector<std::string> services;
  EXPECT_EQ(ListServices(kKey, &services), grpc::StatusCode::OK);
  EXPECT_THAT(services, ::testing::Contains("duet.v1.Duet"));
  EXPECT_EQ(Health(), grpc::StatusCode::OK);
  EXPECT_EQ(metrics::testing::HttpGet(uint16_t(router_->metrics_port()), "/metrics").status, 200);
  router_->Shutdown(0);

  options = Options();
  options.api_key = kKey;
  options.api_key_on_health_and_metrics = true;
  options.metrics_port = 0;
  Start(options);
  EXPECT_EQ(Health(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Health("wrong"), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Health(kKey), grpc::StatusCode::OK);
  EXPECT_EQ(ListServices(nullptr), grpc::StatusCode::UNAUTHENTICATED);
  const uint16_t metrics_port = uint16_t(router_->metrics_port());
  EXPECT_EQ(metrics::testing::HttpGet(metrics_port, "/metrics").status, 401);
  const std::string scrape = std::string("GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ") + kKey +
                             "\r\nConnection: close\r\n\r\n";
  EXPECT_EQ(metrics::testing::ParseResponse(metrics::testing::RawExchange(metrics_port, scrape)).status, 200);
}

// Certificate files are checked before anything starts: the error names the flag and the file.
TEST_F(RouterSecurityTest, BadCertificateFilesStopStartUp) {
  RouterOptions options = Options();
  options.tls = {Path("missing.pem"), Path("server.key"), "", rpc::ClientCertMode::kNone};
  absl::StatusOr<std::unique_ptr<Router>> router = Router::Start(options);
  ASSERT_FALSE(router.ok());
  EXPECT_THAT(std::string(router.status().message()), HasSubstr("cannot read --ssl-certfile " + Path("missing.pem")));
  options.tls = {Path("server.pem"), Path("client.key"), "", rpc::ClientCertMode::kNone};
  router = Router::Start(options);
  ASSERT_FALSE(router.ok());
  EXPECT_THAT(std::string(router.status().message()), HasSubstr("does not match the certificate"));
  options.tls = {};
  options.internal_tls = {Path("client.pem"), Path("client.key"), "", rpc::ClientCertMode::kNone};
  router = Router::Start(options);
  ASSERT_FALSE(router.ok());
  EXPECT_THAT(std::string(router.status().message()), HasSubstr("--internal-tls-ca-certs"));
}

}  // namespace
}  // namespace duet::router
