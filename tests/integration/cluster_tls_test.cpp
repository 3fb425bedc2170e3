// `duet serve` with TLS everywhere (issue 17): the router's HTTP and gRPC ports over TLS, mutual
// TLS between the router and its workers, the API key on gRPC health and reflection and on every
// /metrics (--api-key-on-health-and-metrics). The cluster serves end to end, over gRPC (TLS) and
// HTTPS (curl), greedy output equal to a plaintext cluster's; the workers turn away clients
// without the router's certificate. Certificates are made by the test (tests/tls/test_certs.h).
#include <chrono>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "duet/v1/duet.grpc.pb.h"
#include "duet/v1/worker.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "gtest/gtest.h"
#include "metrics/test_http_client.h"
#include "nlohmann/json.hpp"
#include "tests/integration/local_cluster.h"
#include "tests/integration/process.h"
#include "tests/tls/test_certs.h"

namespace duet {
namespace {

constexpr char kModel[] = DUET_MODELS_DIR "/tiny-code-llama";
constexpr char kKey[] = "sk-cluster-tls-test";
const std::vector<std::string> kPrompts = {"def fib(n):\n", "import os\n"};
constexpr int kMaxTokens = 12;

v1::GenerateRequest Greedy(const std::string& prompt) {
  v1::GenerateRequest r;
  r.set_text(prompt);
  r.mutable_sampling()->set_temperature(0.0f);
  r.mutable_sampling()->set_max_tokens(kMaxTokens);
  r.mutable_sampling()->set_ignore_eos(true);
  return r;
}

// "key=value key=value" → map.
std::map<std::string, std::string> Fields(const std::string& line) {
  std::map<std::string, std::string> out;
  for (absl::string_view field : absl::StrSplit(line, ' ', absl::SkipEmpty())) {
    const size_t eq = field.find('=');
    if (eq != absl::string_view::npos) out[std::string(field.substr(0, eq))] = std::string(field.substr(eq + 1));
  }
  return out;
}

std::shared_ptr<grpc::ChannelCredentials> Tls(const std::string& ca, const testing::TestCert* cert) {
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = ca;
  if (cert != nullptr) {
    options.pem_cert_chain = cert->cert_pem;
    options.pem_private_key = cert->key_pem;
  }
  return grpc::SslCredentials(options);
}

// GetStats on a worker with these credentials (and no token: a stranger's call).
grpc::StatusCode CallWorker(const std::string& address, const std::shared_ptr<grpc::ChannelCredentials>& credentials) {
  auto stub = v1::DecodeWorker::NewStub(grpc::CreateChannel(address, credentials));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::WorkerStats stats;
  return stub->GetStats(&ctx, v1::GetStatsRequest(), &stats).error_code();
}

TEST(ClusterTlsTest, ServeWithTlsEverywhereServesAndEqualsPlainGreedy) {
  const std::string dir = testing::MakeTempDir("cluster-tls");
  const testing::TestPki pki = testing::MakeTestPki();
  pki.WriteTo(dir);
  { std::ofstream(dir + "/api_key") << kKey << "\n"; }
  const std::string ca = dir + "/ca.pem", cert = dir + "/server.pem", key = dir + "/server.key";

  absl::StatusOr<std::unique_ptr<Subprocess>> serve = Subprocess::Start(
      {testing::DuetBinary(), "serve", "--model", kModel, "--backend", "cpu", "--grpc-port", "0", "--http-port", "0",
       "--metrics-port", "0", "--log-stats-interval", "0", "--ssl-certfile", cert, "--ssl-keyfile", key,
       "--internal-tls-certfile", cert, "--internal-tls-keyfile", key, "--internal-tls-ca-certs", ca,
       "--api-key-file", dir + "/api_key", "--api-key-on-health-and-metrics"});
  ASSERT_TRUE(serve.ok()) << serve.status();
  absl::StatusOr<std::string> decode = (*serve)->WaitForLine("DUET_WORKER role=decode index=0 ", std::chrono::seconds(120));
  ASSERT_TRUE(decode.ok()) << decode.status();
  absl::StatusOr<std::string> http_port = (*serve)->WaitForLine("DUET_HTTP_READY port=", std::chrono::seconds(120));
  ASSERT_TRUE(http_port.ok()) << http_port.status();
  absl::StatusOr<std::string> grpc_port = (*serve)->WaitForLine("DUET_READY grpc_port=", std::chrono::seconds(60));
  ASSERT_TRUE(grpc_port.ok()) << grpc_port.status();
  const std::map<std::string, std::string> decode_worker = Fields(*decode);
  const std::string decode_address = "127.0.0.1:" + decode_worker.at("port");
  const std::string router_address = "127.0.0.1:" + *grpc_port;

  // gRPC over TLS, with the key.
  auto router = v1::Duet::NewStub(grpc::CreateChannel(router_address, Tls(pki.ca_pem, nullptr)));
  std::vector<testing::StreamResult> tls_results;
  for (const std::string& prompt : kPrompts) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", std::string("Bearer ") + kKey);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    auto reader = router->Generate(&ctx, Greedy(prompt));
    testing::StreamResult result;
    v1::GenerateResponse msg;
    while (reader->Read(&msg)) {
      result.token_ids.insert(result.token_ids.end(), msg.token_ids().begin(), msg.token_ids().end());
      result.text += msg.text();
    }
    result.status = reader->Finish();
    ASSERT_TRUE(result.status.ok()) << result.status.error_message();
    ASSERT_EQ(result.token_ids.size(), size_t(kMaxTokens));
    tls_results.push_back(result);
  }

  // duet complete over TLS with the key from a file: the text of the same request over gRPC;
  // without the key, or without TLS, it fails.
  std::string want;
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", std::string("Bearer ") + kKey);
    auto reader = router->Generate(&ctx, Greedy("def fib(n):"));
    for (v1::GenerateResponse msg; reader->Read(&msg);) want += msg.text();
    ASSERT_TRUE(reader->Finish().ok());
  }
  const std::string complete = absl::StrCat(testing::DuetBinary(), " complete --address localhost:", *grpc_port,
                                            " --prompt 'def fib(n):' --max-tokens ", kMaxTokens,
                                            " --ignore-eos --ssl-ca-certs ", ca);
  ASSERT_EQ(testing::RunCommand(absl::StrCat(complete, " --api-key-file ", dir, "/api_key > ", dir, "/complete.txt"),
                                dir + "/complete.log"),
            0)
      << testing::ReadText(dir + "/complete.log");
  EXPECT_EQ(testing::ReadText(dir + "/complete.txt"), want);
  EXPECT_NE(testing::RunCommand(complete + " > /dev/null", dir + "/complete_no_key.log"), 0);
  EXPECT_NE(testing::ReadText(dir + "/complete_no_key.log").find("API key"), std::string::npos)
      << testing::ReadText(dir + "/complete_no_key.log");
  EXPECT_NE(testing::RunCommand(absl::StrCat(testing::DuetBinary(), " complete --address localhost:", *grpc_port,
                                             " --prompt hi --max-tokens 2 --api-key-file ", dir, "/api_key > /dev/null"),
                                dir + "/complete_plain.log"),
            0);

  // HTTPS with curl, checking the certificate against the CA for "localhost" (a DNS SAN).
  const nlohmann::json body = {{"prompt", kPrompts[0]}, {"max_tokens", kMaxTokens}, {"temperature", 0},
                               {"ignore_eos", true}};
  { std::ofstream(dir + "/body.json") << body.dump(); }
  const std::string curl = absl::StrCat("curl -sS --fail-with-body --cacert ", ca, " -H 'Authorization: Bearer ", kKey,
                                        "' -H 'Content-Type: application/json' --data-binary @", dir,
                                        "/body.json https://localhost:", *http_port, "/v1/completions > ", dir,
                                        "/completion.json");
  ASSERT_EQ(testing::RunCommand(curl, dir + "/curl.log"), 0) << testing::ReadText(dir + "/curl.log");
  const nlohmann::json completion = nlohmann::json::parse(testing::ReadText(dir + "/completion.json"));
  EXPECT_EQ(completion["choices"][0]["text"], tls_results[0].text) << completion.dump();
  // duet-bench over TLS, gRPC and HTTPS, verifying the router against the CA; without it (the
  // system's CAs do not know this one) its warm-up request fails the handshake.
  const std::string bench = absl::StrCat(DUET_BIN_DIR, "/duet-bench --tokenizer ", kModel,
                                         " --dataset random --input-len 16 --output-len 4 --num-prompts 4 --ignore-eos "
                                         "--disable-tqdm --api-key ",
                                         kKey, " --model tiny-code-llama --result-json ", dir, "/bench.json");
  for (const std::string& target : {absl::StrCat("--backend duet-grpc --base-url localhost:", *grpc_port),
                                    absl::StrCat("--backend openai-completions --base-url https://localhost:", *http_port),
                                    absl::StrCat("--backend openai-chat --base-url https://127.0.0.1:", *http_port)}) {
    ASSERT_EQ(testing::RunCommand(absl::StrCat(bench, " ", target, " --ssl-ca-certs ", ca, " > ", dir, "/bench.txt"),
                                  dir + "/bench.log"),
              0)
        << target << ": " << testing::ReadText(dir + "/bench.log");
    const nlohmann::json result = nlohmann::json::parse(testing::ReadText(dir + "/bench.json"), nullptr, false);
    ASSERT_TRUE(result.is_object()) << target;
    EXPECT_EQ(result["completed"], 4) << target << ": " << result["errors"].dump();
    EXPECT_EQ(result["total_output_tokens"], 16) << target;
    EXPECT_NE(testing::RunCommand(absl::StrCat(bench, " ", target, " --tls > /dev/null"), dir + "/bench_untrusted.log"),
              0)
        << target;
    EXPECT_NE(testing::ReadText(dir + "/bench_untrusted.log").find("the warm-up request failed"), std::string::npos)
        << target << ": " << testing::ReadText(dir + "/bench_untrusted.log");
  }

  // Plain HTTP on the HTTPS port: a clear 400, and the router goes on.
  EXPECT_EQ(testing::RunCommand(absl::StrCat("curl -s http://127.0.0.1:", *http_port, "/health > ", dir, "/plain.txt"),
                                dir + "/plain.log"),
            0);
  EXPECT_NE(testing::ReadText(dir + "/plain.txt").find("this port speaks HTTPS"), std::string::npos);
  EXPECT_EQ(testing::RunCommand(absl::StrCat("curl -sS --fail --cacert ", ca, " -H 'Authorization: Bearer ", kKey,
                                             "' https://127.0.0.1:", *http_port, "/health"),
                                dir + "/health.log"),
            0)
      << testing::ReadText(dir + "/health.log");

  // The API key on gRPC health and reflection (--api-key-on-health-and-metrics), and on /metrics.
  {
    auto health = grpc::health::v1::Health::NewStub(grpc::CreateChannel(router_address, Tls(pki.ca_pem, nullptr)));
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckResponse response;
    EXPECT_EQ(health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &response).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    grpc::ClientContext keyed;
    keyed.AddMetadata("authorization", std::string("Bearer ") + kKey);
    EXPECT_TRUE(health->Check(&keyed, grpc::health::v1::HealthCheckRequest(), &response).ok());
    auto reflection =
        grpc::reflection::v1::ServerReflection::NewStub(grpc::CreateChannel(router_address, Tls(pki.ca_pem, nullptr)));
    grpc::ClientContext reflection_ctx;
    auto stream = reflection->ServerReflectionInfo(&reflection_ctx);
    grpc::reflection::v1::ServerReflectionRequest list;
    list.set_list_services("");
    stream->Write(list);
    stream->WritesDone();
    grpc::reflection::v1::ServerReflectionResponse ignored;
    while (stream->Read(&ignored)) {
    }
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  const uint16_t metrics_port = uint16_t(std::stoi(decode_worker.at("metrics_port")));
  EXPECT_EQ(metrics::testing::HttpGet(metrics_port, "/metrics").status, 401);
  EXPECT_EQ(metrics::testing::ParseResponse(
                metrics::testing::RawExchange(metrics_port, absl::StrCat("GET /metrics HTTP/1.1\r\nHost: x\r\n"
                                                                         "Authorization: Bearer ",
                                                                         kKey, "\r\nConnection: close\r\n\r\n")))
                .status,
            200);

  // A worker takes only TLS clients with a certificate the cluster's CA signed: not plaintext, not
  // a client without a certificate, not one another CA signed. (With the CA's, the token decides.)
  EXPECT_EQ(CallWorker(decode_address, grpc::InsecureChannelCredentials()), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(CallWorker(decode_address, Tls(pki.ca_pem, nullptr)), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(CallWorker(decode_address, Tls(pki.ca_pem, &pki.other_client)), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(CallWorker(decode_address, Tls(pki.ca_pem, &pki.client)), grpc::StatusCode::UNAUTHENTICATED);
  (*serve)->Stop(std::chrono::seconds(30));

  // The same requests on a plaintext cluster.
  testing::LocalCluster plain({1, 1});
  ASSERT_TRUE(plain.ok()) << plain.error();
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    testing::StreamResult want = testing::RunGenerate(plain.router(), Greedy(kPrompts[i]));
    ASSERT_TRUE(want.status.ok()) << want.status.error_message();
    EXPECT_EQ(tls_results[i].token_ids, want.token_ids) << kPrompts[i];
    EXPECT_EQ(tls_results[i].text, want.text) << kPrompts[i];
  }
}

}  // namespace
}  // namespace duet
