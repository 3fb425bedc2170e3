// The OpenAI API in-process: a Router with its HTTP server in front of fake workers.
#include <gtest/gtest.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>
#include <thread>

#include "duet/v1/duet.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "frontend/tokenizer/tokenizer.h"
#include "router/fake_workers.h"
#include "router/http_frontend.h"
#include "router/router.h"
#include "common/version.h"
#include "gmock/gmock.h"

#include <future>

namespace duet::router {
namespace {

namespace net = boost::asio;
using tcp = net::ip::tcp;
using nlohmann::json;
using testing::FakeDecodeWorker;
using testing::FakePrefillWorker;
using testing::FakeServer;

struct Response {
  int status = 0;
  std::string headers;
  std::string body;  // de-chunked
};

// One request per connection ("Connection: close"), reads to EOF, de-chunks.
class Client {
 public:
  explicit Client(int port) : socket_(ioc_) {
    socket_.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), static_cast<uint16_t>(port)));
  }
  void Send(const std::string& method, const std::string& path, const std::string& body,
            const std::string& extra_headers = "") {
    const std::string request = method + " " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + extra_headers +
                                "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
                                "\r\n\r\n" + body;
    net::write(socket_, net::buffer(request));
  }
  void SendRaw(const std::string& bytes) { net::write(socket_, net::buffer(bytes)); }
  // Reads until `needle` is in the raw bytes (or EOF).
  std::string ReadUntil(const std::string& needle) {
    while (raw_.find(needle) == std::string::npos) {
      char buf[4096];
      boost::system::error_code ec;
      size_t n = socket_.read_some(net::buffer(buf), ec);
      if (ec) break;
      raw_.append(buf, n);
    }
    return raw_;
  }
  Response ReadAll() {
    ReadUntil(std::string(1, '\0'));  // to EOF
    Response r;
    const size_t header_end = raw_.find("\r\n\r\n");
    if (header_end == std::string::npos) return r;
    r.headers = raw_.substr(0, header_end);
    r.status = std::stoi(raw_.substr(9, 3));
    std::string rest = raw_.substr(header_end + 4);
    if (r.headers.find("Transfer-Encoding: chunked") == std::string::npos) {
      r.body = rest;
      return r;
    }
    size_t pos = 0;
    while (pos < rest.size()) {
      const size_t line_end = rest.find("\r\n", pos);
      const size_t size = std::stoul(rest.substr(pos, line_end - pos), nullptr, 16);
      if (size == 0) break;
      r.body += rest.substr(line_end + 2, size);
      pos = line_end + 2 + size + 2;
    }
    return r;
  }
  void Close() { socket_.close(); }
  // Bytes the server sent that have not been read.
  size_t Available() { return raw_.size() + socket_.available(); }

 private:
  net::io_context ioc_;
  tcp::socket socket_;
  std::string raw_;
};

// The data: payloads of an SSE body, [DONE] left out.
std::vector<json> SseEvents(const std::string& body) {
  std::vector<json> events;
  size_t pos = 0;
  while (pos < body.size()) {
    const size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) break;
    const std::string data = body.substr(pos + 6, end - pos - 6);
    if (data != "[DONE]") events.push_back(json::parse(data));
    pos = end + 2;
  }
  return events;
}

class OpenAiApiTest : public ::testing::Test {
 protected:
  void StartRouter(const std::string& api_key = "", int max_concurrent_requests = 256) {
    prefill_server_ = std::make_unique<FakeServer>(&prefill_);
    decode_server_ = std::make_unique<FakeServer>(&decode_);
    RouterOptions options;
    options.model_dir = DUET_MODELS_DIR "/tiny-code-llama";
    options.prefill_addresses = {prefill_server_->address()};
    options.decode_addresses = {decode_server_->address()};
    options.http_port = 0;
    options.api_key = api_key;
    options.api_key_on_health_and_metrics = api_key_on_health_and_metrics_;
    options.max_concurrent_requests = max_concurrent_requests;
    options.served_model_names = served_model_names_;
    options.enable_auto_tool_choice = !tool_call_parser_.empty();
    options.tool_call_parser = tool_call_parser_;
    options.metrics_body = [] { return std::string("duet:test 1\n"); };
    auto router = Router::Start(options);
    ASSERT_TRUE(router.ok()) << router.status();
    router_ = *std::move(router);
    ASSERT_GT(router_->http_port(), 0);
    // Serving once the registry has seen both workers up (its first poll runs in the background).
    const std::string key = api_key.empty() ? "" : "Authorization: Bearer " + api_key + "\r\n";
    for (int i = 0; i < 1000 && Call("GET", "/health", "", key).status != 200; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_EQ(Call("GET", "/health", "", key).status, 200);
  }
  void TearDown() override {
    if (router_) router_->Shutdown(0);
  }
  Response Call(const std::string& method, const std::string& path, const std::string& body,
                const std::string& headers = "") {
    Client c(router_->http_port());
    c.Send(method, path, body, headers);
    return c.ReadAll();
  }

  bool api_key_on_health_and_metrics_ = false;
  std::string tool_call_parser_;  // non-empty: --enable-auto-tool-choice --tool-call-parser <it>
  std::vector<std::string> served_model_names_;
  FakePrefillWorker prefill_;
  FakeDecodeWorker decode_;
  std::unique_ptr<FakeServer> prefill_server_, decode_server_;
  std::unique_ptr<Router> router_;
};

TEST_F(OpenAiApiTest, Completion) {
  StartRouter();
  Response r = Call("POST", "/v1/completions", R"({"model":"tiny-code-llama","prompt":"import os","max_tokens":3})");
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["id"].get<std::string>().rfind("cmpl-", 0), 0u);
  EXPECT_EQ(j["choices"][0]["text"], "t0 t1 t2 ");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["completion_tokens"], 3);
  EXPECT_GT(j["usage"]["prompt_tokens"], 0);
}

TEST_F(OpenAiApiTest, CompletionNAndEcho) {
  StartRouter();
  Response r = Call("POST", "/v1/completions", R"({"prompt":["a","b"],"n":2,"max_tokens":2,"echo":true,"seed":1})");
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body);
  ASSERT_EQ(j["choices"].size(), 4u);
  EXPECT_EQ(j["choices"][3]["index"], 3);
  EXPECT_EQ(j["choices"][3]["text"], "bt0 t1 ");
  EXPECT_EQ(j["usage"]["completion_tokens"], 8);
}

// echo + logprobs: the prompt's tokens (scored by the prefill worker) lead the choice's logprobs,
// whole and streamed; prompt_logprobs comes in vLLM's shape.
TEST_F(OpenAiApiTest, EchoWithLogprobsAndPromptLogprobs) {
  StartRouter();
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromModelDir(DUET_MODELS_DIR "/tiny-code-llama");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const std::vector<int32_t> prompt = (*tokenizer)->Encode("import os", /*add_special_tokens=*/true);
  ASSERT_GE(prompt.size(), 2u);
  Response r = Call("POST", "/v1/completions", R"({"prompt":"import os","max_tokens":2,"echo":true,"logprobs":1})");
  ASSERT_EQ(r.status, 200) << r.body;
  json l = json::parse(r.body)["choices"][0]["logprobs"];
  ASSERT_EQ(l["tokens"].size(), prompt.size() + 2) << l.dump();
  EXPECT_TRUE(l["token_logprobs"][0].is_null());
  EXPECT_TRUE(l["top_logprobs"][0].is_null());
  for (size_t i = 1; i < prompt.size(); ++i) {
    EXPECT_EQ(l["token_logprobs"][i], -double(i)) << i;  // the fake prefill worker's
    EXPECT_EQ(l["top_logprobs"][i].size(), 1u) << i;
  }
  EXPECT_EQ(l["token_logprobs"][prompt.size()], -0.5);  // the fake decode worker's
  EXPECT_EQ(l["text_offset"][0], 0);
  ASSERT_EQ(prefill_.last_prompt(), prompt);

  // Streamed: the first chunk has the echoed prompt and its logprobs, the next ones continue.
  r = Call("POST", "/v1/completions",
           R"({"prompt":"import os","max_tokens":2,"echo":true,"logprobs":1,"stream":true})");
  ASSERT_EQ(r.status, 200) << r.body;
  std::vector<json> events = SseEvents(r.body);
  ASSERT_GE(events.size(), 2u);
  json streamed_tokens = json::array(), streamed_offsets = json::array(), streamed_logprobs = json::array();
  for (const json& e : events) {
    const json& lp = e["choices"][0]["logprobs"];
    for (size_t i = 0; i < lp["tokens"].size(); ++i) {
      streamed_tokens.push_back(lp["tokens"][i]);
      streamed_offsets.push_back(lp["text_offset"][i]);
      streamed_logprobs.push_back(lp["token_logprobs"][i]);
    }
  }
  EXPECT_EQ(streamed_tokens, l["tokens"]);
  EXPECT_EQ(streamed_offsets, l["text_offset"]);
  EXPECT_EQ(streamed_logprobs, l["token_logprobs"]);
  EXPECT_EQ(events[0]["choices"][0]["text"].get<std::string>().rfind("import os", 0), 0u);

  // prompt_logprobs by name: vLLM's list on the choice (chat: on the response).
  r = Call("POST", "/v1/completions", R"({"prompt":"import os","max_tokens":1,"prompt_logprobs":2})");
  ASSERT_EQ(r.status, 200) << r.body;
  const json pl = json::parse(r.body)["choices"][0]["prompt_logprobs"];
  ASSERT_EQ(pl.size(), prompt.size());
  EXPECT_TRUE(pl[0].is_null());
  const json own = pl[1][std::to_string(prompt[1])];
  EXPECT_EQ(own["logprob"], -1.0);
  EXPECT_EQ(own["rank"], 2);
  EXPECT_EQ(own["decoded_token"], (*tokenizer)->Decode(std::vector<int32_t>{prompt[1]}, false));
  EXPECT_EQ(pl[1]["1"]["rank"], 2);  // top ids 0 and 1 from the fake worker
  r = Call("POST", "/v1/chat/completions",
           R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":1,"prompt_logprobs":0})");
  ASSERT_EQ(r.status, 200) << r.body;
  const json chat = json::parse(r.body);
  ASSERT_TRUE(chat["prompt_logprobs"].is_array()) << r.body;
  EXPECT_TRUE(chat["prompt_logprobs"][0].is_null());
  EXPECT_EQ(chat["prompt_logprobs"][1].size(), 1u);  // K = 0: the token's own entry alone

  r = Call("POST", "/v1/completions", R"({"prompt":"import os","prompt_logprobs":21})");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(json::parse(r.body)["error"]["param"], "prompt_logprobs");
}

TEST_F(OpenAiApiTest, ChatStreamFraming) {
  StartRouter();
  Response r = Call("POST", "/v1/chat/completions",
                    R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"stream":true,
                        "stream_options":{"include_usage":true}})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_NE(r.headers.find("Content-Type: text/event-stream"), std::string::npos);
  // Events: "data: {...}\n\n" ... "data: [DONE]\n\n".
  std::vector<std::string> events;
  size_t pos = 0;
  while (pos < r.body.size()) {
    const size_t end = r.body.find("\n\n", pos);
    ASSERT_NE(end, std::string::npos) << r.body;
    const std::string event = r.body.substr(pos, end - pos);
    ASSERT_EQ(event.rfind("data: ", 0), 0u) << event;
    events.push_back(event.substr(6));
    pos = end + 2;
  }
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.back(), "[DONE]");
  json first = json::parse(events[0]);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  json usage = json::parse(events[events.size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 2);
  std::string text;
  for (size_t i = 0; i + 2 < events.size(); ++i) {
    json e = json::parse(events[i]);
    if (e["choices"][0]["delta"].contains("content")) text += e["choices"][0]["delta"]["content"];
  }
  EXPECT_EQ(text, "t0 t1 ");
}

TEST_F(OpenAiApiTest, ErrorsAndEndpoints) {
  StartRouter();
  Response r = Call("POST", "/v1/completions", R"({"model":"gpt-4","prompt":"x"})");
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(json::parse(r.body)["error"]["code"], "model_not_found");
  r = Call("POST", "/v1/completions", R"({"prompt":"x","max_tokens":100000000})");
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(json::parse(r.body)["error"]["code"], "context_length_exceeded");
  r = Call("POST", "/v1/completions", R"({"prompt":[999999999]})");
  EXPECT_EQ(r.status, 400) << r.body;
  r = Call("POST", "/v1/completions", "{bad json");
  EXPECT_EQ(r.status, 400);
  r = Call("GET", "/v1/completions", "");
  EXPECT_EQ(r.status, 405);
  r = Call("GET", "/nope", "");
  EXPECT_EQ(r.status, 404);
  r = Call("GET", "/health", "");
  EXPECT_EQ(r.status, 200);
  r = Call("GET", "/metrics", "");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "duet:test 1\n");
  r = Call("GET", "/v1/models", "");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(json::parse(r.body)["data"][0]["id"], "tiny-code-llama");
  // When the server started, as vLLM's model cards: a recent Unix time, not 0.
  const int64_t now = openai::UnixSecondsNow();
  const int64_t created = json::parse(r.body)["data"][0]["created"].get<int64_t>();
  EXPECT_LE(created, now);
  EXPECT_GT(created, now - 600);
  r = Call("POST", "/tokenize", R"({"prompt":"hello"})");
  EXPECT_EQ(r.status, 200);
  // Overloaded: the decode worker has no room → 429.
  decode_.kv_full = true;
  r = Call("POST", "/v1/completions", R"({"prompt":"x"})");
  EXPECT_EQ(r.status, 429) << r.body;
  EXPECT_NE(r.headers.find("\r\nRetry-After: 1"), std::string::npos) << r.headers;
  decode_.kv_full = false;
  r = Call("POST", "/v1/completions", R"({"prompt":"x","max_tokens":1})");
  EXPECT_EQ(r.status, 200);
}

TEST_F(OpenAiApiTest, ApiKey) {
  StartRouter("sekret");
  EXPECT_EQ(Call("GET", "/v1/models", "").status, 401);
  EXPECT_EQ(Call("GET", "/v1/models", "", "Authorization: Bearer wrong\r\n").status, 401);
  EXPECT_EQ(Call("GET", "/v1/models", "", "Authorization: Bearer sekret\r\n").status, 200);
  EXPECT_EQ(Call("POST", "/v1/completions", R"({"prompt":"x","max_tokens":1})", "Authorization: Bearer sekret\r\n").status,
            200);
  EXPECT_EQ(Call("GET", "/health", "").status, 200);  // not under /v1
  // gRPC: the key as metadata.
  auto stub = v1::Duet::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(router_->port()),
                                                    grpc::InsecureChannelCredentials()));
  v1::ModelInfo info;
  grpc::ClientContext no_key;
  EXPECT_EQ(stub->GetModelInfo(&no_key, v1::GetModelInfoRequest(), &info).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  grpc::ClientContext with_key;
  with_key.AddMetadata("authorization", "Bearer sekret");
  EXPECT_TRUE(stub->GetModelInfo(&with_key, v1::GetModelInfoRequest(), &info).ok());
}

TEST_F(OpenAiApiTest, DisconnectAbortsTheRequest) {
  StartRouter();
  decode_.token_delay_ms = 20;
  Client c(router_->http_port());
  c.Send("POST", "/v1/completions", R"({"prompt":"x","max_tokens":500,"stream":true})");
  c.ReadUntil("data: ");  // streaming has begun
  c.Close();
  for (int i = 0; i < 500 && decode_.aborted().empty() && decode_.num_cancelled == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(!decode_.aborted().empty() || decode_.num_cancelled > 0);
  EXPECT_LT(decode_.num_tokens_sent.load(), 500);
  // Still healthy.
  decode_.token_delay_ms = 0;
  EXPECT_EQ(Call("POST", "/v1/completions", R"({"prompt":"x","max_tokens":1})").status, 200);
}

std::string RawRequest(const std::string& method, const std::string& path, const std::string& body,
                       const std::string& extra_headers = "") {
  return method + " " + path + " HTTP/1.1\r\nHost: x\r\n" + extra_headers +
         "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

// Splits back-to-back responses with Content-Length bodies.
std::vector<Response> SplitResponses(const std::string& raw) {
  std::vector<Response> out;
  size_t pos = 0;
  while (pos < raw.size()) {
    const size_t header_end = raw.find("\r\n\r\n", pos);
    if (header_end == std::string::npos) break;
    Response r;
    r.headers = raw.substr(pos, header_end - pos);
    r.status = std::stoi(raw.substr(pos + 9, 3));
    const size_t length_at = r.headers.find("Content-Length: ");
    if (length_at == std::string::npos) break;
    const size_t length = std::stoul(r.headers.substr(length_at + 16));
    r.body = raw.substr(header_end + 4, length);
    out.push_back(r);
    pos = header_end + 4 + length;
  }
  return out;
}

// Three requests pipelined on one connection while the first (a completion) is generating: all
// three answered, in order.
TEST_F(OpenAiApiTest, PipelinedRequestsAreAnsweredInOrder) {
  StartRouter();
  decode_.token_delay_ms = 20;
  Client c(router_->http_port());
  c.SendRaw(RawRequest("POST", "/v1/completions", R"({"prompt":"x","max_tokens":5})") +
            RawRequest("GET", "/v1/models", "") +
            RawRequest("POST", "/v1/completions", R"({"prompt":"y","max_tokens":2})", "Connection: close\r\n"));
  const std::vector<Response> responses = SplitResponses(c.ReadUntil(std::string(1, '\0')));
  ASSERT_EQ(responses.size(), 3u);
  ASSERT_EQ(responses[0].status, 200) << responses[0].body;
  EXPECT_EQ(json::parse(responses[0].body)["choices"][0]["text"], "t0 t1 t2 t3 t4 ");
  ASSERT_EQ(responses[1].status, 200) << responses[1].body;
  EXPECT_EQ(json::parse(responses[1].body)["object"], "list");
  ASSERT_EQ(responses[2].status, 200) << responses[2].body;
  EXPECT_EQ(json::parse(responses[2].body)["choices"][0]["text"], "t0 t1 ");
}

// Clients that pipeline a second request behind a long completion and then close the socket:
// their generations are cancelled and give their places back, so --max-concurrent-requests is
// not used up by work nobody waits for.
TEST_F(OpenAiApiTest, OrphanedPipelinedRequestsDoNotExhaustConcurrency) {
  constexpr int kMax = 16;
  StartRouter("", kMax);
  decode_.token_delay_ms = 10;  // 2000 tokens: 20 s each
  std::vector<std::unique_ptr<Client>> orphans;
  for (int i = 0; i < kMax + 2; ++i) {
    orphans.push_back(std::make_unique<Client>(router_->http_port()));
    orphans.back()->SendRaw(RawRequest("POST", "/v1/completions", R"({"prompt":"x","max_tokens":2000})") +
                            RawRequest("GET", "/v1/models", ""));
  }
  ASSERT_TRUE([&] {
    for (int i = 0; i < 500 && decode_.num_decodes < kMax; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return decode_.num_decodes == kMax;
  }()) << decode_.num_decodes;
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  for (auto& c : orphans) c->Close();
  const auto closed_at = std::chrono::steady_clock::now();
  // The two queued orphans may reach the decode worker before their closed sockets are noticed
  // (under load); then they are cancelled too. Every generation started must end cancelled.
  const auto all_started_cancelled = [&] {
    return decode_.num_cancelled >= kMax && decode_.num_cancelled == decode_.num_decodes;
  };
  for (int i = 0; i < 300 && !all_started_cancelled(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_TRUE(all_started_cancelled()) << "the orphans' generations kept running: " << decode_.num_cancelled
                                       << " cancelled of " << decode_.num_decodes << " started";
  EXPECT_LE(decode_.num_decodes.load(), kMax + 2);
  // Room again: every new request is served.
  decode_.token_delay_ms = 0;
  for (int i = 0; i < kMax; ++i) {
    Response r = Call("POST", "/v1/completions", R"({"prompt":"x","max_tokens":1})");
    EXPECT_EQ(r.status, 200) << r.body;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - closed_at, std::chrono::seconds(5));
}

// A client's request id (X-Request-Id, or request_id in the body, as vLLM takes them) names the
// response ("cmpl-<id>"); one longer than 256 bytes is a 400 that does not repeat it.
TEST_F(OpenAiApiTest, RequestIdIsTakenAndItsLengthLimited) {
  StartRouter();
  Response r = Call("POST", "/v1/completions", R"({"prompt":"x","max_tokens":1})", "X-Request-Id: my-id-1\r\n");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["id"], "cmpl-my-id-1");
  r = Call("POST", "/v1/chat/completions",
           R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":1,"request_id":"body-id"})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["id"], "chatcmpl-body-id");
  const std::string longest(256, 'a');
  r = Call("POST", "/v1/completions", R"({"prompt":"x","max_tokens":1,"stream":true})",
           "X-Request-Id: " + longest + "\r\n");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_NE(r.body.find("\"id\":\"cmpl-" + longest + "\""), std::string::npos) << r.body;

  const std::string too_long(257, 'b');
  r = Call("POST", "/v1/completions", R"({"prompt":"x","max_tokens":1})", "X-Request-Id: " + too_long + "\r\n");
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(r.body.find(too_long), std::string::npos);
  EXPECT_LT(r.body.size(), 400u) << r.body;
  const std::string huge(1 << 20, 'c');
  r = Call("POST", "/v1/completions", R"({"prompt":"x","max_tokens":200,"stream":true,"request_id":")" + huge + "\"}");
  EXPECT_EQ(r.status, 400);
  EXPECT_LT(r.body.size(), 400u);
  EXPECT_EQ(json::parse(r.body)["error"]["param"], "request_id");
  EXPECT_EQ(decode_.num_decodes, 3);
}

// The header value of `name` in a response's headers, or empty.
std::string HeaderValue(const Response& r, const std::string& name) {
  const size_t at = r.headers.find("\r\n" + name + ": ");
  if (at == std::string::npos) return "";
  const size_t start = at + name.size() + 4;
  return r.headers.substr(start, r.headers.find("\r\n", start) - start);
}

// Every response carries X-Request-Id: the client's, else a new one that also names the
// completion ("cmpl-<it>").
TEST_F(OpenAiApiTest, XRequestIdIsEchoedOrMade) {
  StartRouter();
  Response r = Call("POST", "/v1/completions", R"({"prompt":"x","max_tokens":1})", "X-Request-Id: my-id-7\r\n");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(HeaderValue(r, "X-Request-Id"), "my-id-7");
  r = Call("POST", "/v1/chat/completions", R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":1,"stream":true})");
  ASSERT_EQ(r.status, 200) << r.body;
  const std::string made = HeaderValue(r, "X-Request-Id");
  EXPECT_THAT(made, ::testing::MatchesRegex("[0-9a-f]{32}"));
  EXPECT_NE(r.body.find("\"id\":\"chatcmpl-" + made + "\""), std::string::npos) << r.body;
  for (const auto& [method, path] : std::vector<std::pair<std::string, std::string>>{
           {"GET", "/v1/models"}, {"GET", "/nope"}, {"POST", "/v1/completions"}}) {
    r = Call(method, path, "{", "X-Request-Id: other\r\n");
    EXPECT_EQ(HeaderValue(r, "X-Request-Id"), "other") << path;
  }
  // An id that cannot be echoed as it is (too long) gets a new one; the request is a 400.
  r = Call("POST", "/v1/completions", R"({"prompt":"x"})", "X-Request-Id: " + std::string(300, 'a') + "\r\n");
  EXPECT_EQ(r.status, 400);
  EXPECT_THAT(HeaderValue(r, "X-Request-Id"), ::testing::MatchesRegex("[0-9a-f]{32}"));
}

TEST_F(OpenAiApiTest, VersionAndServedModelNames) {
  served_model_names_ = {"first", "second"};
  StartRouter();
  Response r = Call("GET", "/version", "");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(json::parse(r.body)["version"], DuetVersion());
  r = Call("GET", "/v1/models", "");
  ASSERT_EQ(r.status, 200);
  const json data = json::parse(r.body)["data"];
  ASSERT_EQ(data.size(), 2u);
  EXPECT_EQ(data[0]["id"], "first");
  EXPECT_EQ(data[1]["id"], "second");
  EXPECT_EQ(Call("GET", "/v1/models/second", "").status, 200);
  EXPECT_EQ(Call("GET", "/v1/models/tiny-code-llama", "").status, 404);
  r = Call("POST", "/v1/completions", R"({"model":"second","prompt":"x","max_tokens":1})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["model"], "first");
  EXPECT_EQ(Call("POST", "/v1/completions", R"({"model":"tiny-code-llama","prompt":"x"})").status, 404);
}

// stop_reason: the stop token that ended a choice (stop strings: the SDK test on the real model).
TEST_F(OpenAiApiTest, StopReasonNamesTheStopToken) {
  StartRouter();
  decode_.SetScript({"a", "b", "c"}, "stop");  // tokens 1000, 1001, 1002
  Response r = Call("POST", "/v1/completions", R"({"prompt":"x","max_tokens":8,"stop_token_ids":[1002]})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["choices"][0]["stop_reason"], 1002);
  r = Call("POST", "/v1/chat/completions",
           R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":8,"stream":true,"stop_token_ids":[1002]})");
  ASSERT_EQ(r.status, 200) << r.body;
  const std::vector<json> events = SseEvents(r.body);
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events.back()["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(events.back()["choices"][0]["stop_reason"], 1002);
  EXPECT_FALSE(events[events.size() - 2]["choices"][0].contains("stop_reason"));
  decode_.SetScript({"a"}, "stop");  // EOS
  r = Call("POST", "/v1/completions", R"({"prompt":"x","max_tokens":8,"stop_token_ids":[1002]})");
  EXPECT_TRUE(json::parse(r.body)["choices"][0]["stop_reason"].is_null()) << r.body;
}

// Requests the HTTP server refuses before the API sees them count in http_requests_total too.
TEST_F(OpenAiApiTest, RequestsRefusedBeforeRoutingAreCounted) {
  StartRouter();
  Client c(router_->http_port());
  c.SendRaw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n");
  EXPECT_EQ(c.ReadAll().status, 413);
  const std::string metrics = router_->RenderMetrics();
  EXPECT_NE(metrics.find(R"(http_requests_total{handler="/v1/completions",method="POST",status="413"} 1)"),
            std::string::npos)
      << metrics;
}

// --api-key covers /tokenize and /detokenize too; /health and /metrics stay public (as in vLLM)
// unless api_key_on_health_and_metrics.
TEST_F(OpenAiApiTest, ApiKeyCoversTokenizeAndDetokenize) {
  StartRouter("sekret");
  const std::string key = "Authorization: Bearer sekret\r\n";
  EXPECT_EQ(Call("POST", "/tokenize", R"({"prompt":"hello"})").status, 401);
  EXPECT_EQ(Call("POST", "/detokenize", R"({"tokens":[1,2]})").status, 401);
  EXPECT_EQ(Call("POST", "/tokenize", R"({"prompt":"hello"})", key).status, 200);
  EXPECT_EQ(Call("POST", "/detokenize", R"({"tokens":[1,2]})", key).status, 200);
  EXPECT_EQ(Call("GET", "/health", "").status, 200);
  EXPECT_EQ(Call("GET", "/metrics", "").status, 200);
}

TEST_F(OpenAiApiTest, ApiKeyOnHealthAndMetricsWhenConfigured) {
  api_key_on_health_and_metrics_ = true;
  StartRouter("sekret");
  const std::string key = "Authorization: Bearer sekret\r\n";
  EXPECT_EQ(Call("GET", "/health", "").status, 401);
  EXPECT_EQ(Call("GET", "/metrics", "").status, 401);
  EXPECT_EQ(Call("GET", "/health", "", key).status, 200);
  EXPECT_EQ(Call("GET", "/metrics", "", key).status, 200);
}

// 429 (overloaded) and 503 (not serving) tell the client when to retry.
TEST_F(OpenAiApiTest, RetryAfterOn429And503) {
  StartRouter();
  decode_.kv_full = true;
  Response r = Call("POST", "/v1/completions", R"({"prompt":"x"})");
  EXPECT_EQ(r.status, 429) << r.body;
  EXPECT_NE(r.headers.find("\r\nRetry-After: 1"), std::string::npos) << r.headers;
  decode_.kv_full = false;
  router_->StartDraining();
  r = Call("POST", "/v1/completions", R"({"prompt":"x"})");
  EXPECT_EQ(r.status, 503) << r.body;
  EXPECT_NE(r.headers.find("\r\nRetry-After: 1"), std::string::npos) << r.headers;
  r = Call("GET", "/v1/models", "");
  EXPECT_EQ(r.headers.find("Retry-After"), std::string::npos) << r.headers;
}

// A prompt over 4 MiB is the client's error (HTTP 413, gRPC INVALID_ARGUMENT), not an overload
// (429 / RESOURCE_EXHAUSTED, which says "retry later").
TEST_F(OpenAiApiTest, OversizedPromptIs413AndInvalidArgument) {
  StartRouter();
  const std::string prompt((4u << 20) + 1000, 'a');
  Response r = Call("POST", "/v1/completions", json{{"prompt", prompt}, {"max_tokens", 1}}.dump());
  EXPECT_EQ(r.status, 413) << r.body.substr(0, 300);
  EXPECT_EQ(json::parse(r.body)["error"]["code"], "request_too_large");
  auto stub = v1::Duet::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(router_->port()),
                                                    grpc::InsecureChannelCredentials()));
  v1::GenerateRequest request;
  request.set_text(prompt);
  request.mutable_sampling()->set_max_tokens(1);
  grpc::ClientContext context;
  auto reader = stub->Generate(&context, request);
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
  }
  const grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_EQ(decode_.num_decodes, 0);
}

// tool_choice "auto" with the hermes parser: the calls in the model's text come back as
// tool_calls, whole and as streaming deltas, with finish_reason "tool_calls".
TEST_F(OpenAiApiTest, AutoToolCallsAreParsedWholeAndStreaming) {
  tool_call_parser_ = "hermes";
  StartRouter();
  decode_.SetScript({"Sure.", "\n<tool", "_call>\n{\"name\": \"get_weather\", ",
                     "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>", "\n"},
                    "stop");
  const std::string body =
      R"({"messages":[{"role":"user","content":"Weather in Paris?"}],"max_tokens":20,
          "tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object"}}}]})";
  Response r = Call("POST", "/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  const json whole = json::parse(r.body)["choices"][0];
  EXPECT_EQ(whole["finish_reason"], "tool_calls");
  EXPECT_EQ(whole["message"]["content"], "Sure.");
  ASSERT_EQ(whole["message"]["tool_calls"].size(), 1u) << r.body;
  EXPECT_EQ(whole["message"]["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(whole["message"]["tool_calls"][0]["function"]["arguments"], R"({"city":"Paris"})");

  r = Call("POST", "/v1/chat/completions", body.substr(0, body.size() - 1) + R"(,"stream":true})");
  ASSERT_EQ(r.status, 200) << r.body;
  std::string content;
  std::vector<json> calls;
  json finish;
  for (const json& e : SseEvents(r.body)) {
    const json& delta = e["choices"][0]["delta"];
    if (delta.contains("content")) content += delta["content"].get<std::string>();
    if (delta.contains("tool_calls")) {
      for (const json& c : delta["tool_calls"]) calls.push_back(c);
    }
    if (!e["choices"][0]["finish_reason"].is_null()) finish = e["choices"][0]["finish_reason"];
  }
  EXPECT_EQ(content, "Sure.");
  ASSERT_EQ(calls.size(), 1u) << r.body;
  EXPECT_EQ(calls[0]["index"], 0);
  EXPECT_EQ(calls[0]["id"].get<std::string>().rfind("chatcmpl-tool-", 0), 0u);
  EXPECT_EQ(calls[0]["type"], "function");
  EXPECT_EQ(calls[0]["function"]["name"], "get_weather");
  EXPECT_EQ(calls[0]["function"]["arguments"], R"({"city":"Paris"})");
  EXPECT_EQ(finish, "tool_calls");
}

TEST(RouterToolOptionsTest, AutoToolChoiceNeedsAParser) {
  RouterOptions options;
  options.model_dir = DUET_MODELS_DIR "/tiny-code-llama";
  options.prefill_addresses = {"127.0.0.1:1"};
  options.decode_addresses = {"127.0.0.1:1"};
  options.enable_auto_tool_choice = true;
  EXPECT_FALSE(Router::Start(options).ok());
  options.tool_call_parser = "pythonic";
  EXPECT_FALSE(Router::Start(options).ok());
}

// Tokenizing is not done on the HTTP io threads: while a big /tokenize waits for (or runs on)
// the work pool, /health on the one io thread is answered; the tokenize is answered after.
TEST(HttpFrontendTest, HealthIsAnsweredWhileABigTokenizeIsInFlight) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromModelDir(DUET_MODELS_DIR "/tiny-code-llama");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  absl::StatusOr<LoadedChatTemplate> chat = LoadChatTemplate(DUET_MODELS_DIR "/tiny-code-llama");
  ASSERT_TRUE(chat.ok()) << chat.status();
  HttpFrontendOptions options;
  options.num_threads = 1;
  options.work_threads = 1;
  options.chat_template = &*chat;
  options.model_name = "tiny-code-llama";
  options.max_model_len = 2048;
  // No generation here: the channel is never used.
  auto frontend = HttpFrontend::Start(options, tokenizer->get(),
                                      grpc::CreateChannel("127.0.0.1:1", grpc::InsecureChannelCredentials()));
  ASSERT_TRUE(frontend.ok()) << frontend.status();
  WorkPool* pool = (*frontend)->api()->work_pool();
  // The pool's one thread is held: the tokenize stays in flight until it is released.
  std::promise<void> held, release;
  std::shared_future<void> released = release.get_future().share();
  ASSERT_TRUE(pool->TrySubmit([&] {
    held.set_value();
    released.wait();
  }));
  held.get_future().wait();

  std::string text;
  while (text.size() < (1u << 20)) text += "hello world, def f(x): return x ";
  Client tokenize((*frontend)->port());
  tokenize.Send("POST", "/tokenize", json{{"prompt", text}}.dump());
  while (pool->num_queued() == 0) std::this_thread::yield();  // read, parsed and queued

  Client health((*frontend)->port());
  health.Send("GET", "/health", "");
  EXPECT_EQ(health.ReadAll().status, 200);
  EXPECT_EQ(tokenize.Available(), 0u) << "the tokenize was answered on the io thread";

  release.set_value();
  Response r = tokenize.ReadAll();
  ASSERT_EQ(r.status, 200) << r.body.substr(0, 200);
  EXPECT_GT(json::parse(r.body)["count"].get<int>(), 100000);
  (*frontend)->Stop();
}

}  // namespace
}  // namespace duet::router
