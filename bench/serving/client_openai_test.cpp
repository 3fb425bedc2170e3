#include "bench/serving/client_openai.h"

#include <future>
#include <thread>

#include "absl/strings/str_cat.h"
#include "boost/asio.hpp"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace duet::bench {
namespace {

TEST(SseParser, EventsSplitAcrossReads) {
  SseParser sse;
  EXPECT_TRUE(sse.Feed("data: {\"a\"").empty());
  EXPECT_TRUE(sse.Feed(":1}\n").empty());
  EXPECT_EQ(sse.Feed("\ndata: [DO"), std::vector<std::string>{"{\"a\":1}"});
  EXPECT_EQ(sse.Feed("NE]\n\n"), std::vector<std::string>{"[DONE]"});
}

TEST(SseParser, CrLfCommentsFieldsAndMultiLineData) {
  SseParser sse;
  const std::vector<std::string> events =
      sse.Feed(": keep-alive\r\n\r\nevent: message\r\ndata: one\r\ndata:two\r\nid: 7\r\n\r\ndata: x\n\ndata: y\n\n");
  EXPECT_EQ(events, (std::vector<std::string>{"one\ntwo", "x", "y"}));
}

TEST(CompletionStream, CompletionsChunksUsageAndDone) {
  CompletionStream stream(/*chat=*/false);
  auto chunk = [](const std::string& text) {
    return nlohmann::json{{"choices", {{{"index", 0}, {"text", text}, {"finish_reason", nullptr}}}}, {"usage", nullptr}}.dump();
  };
  EXPECT_TRUE(stream.OnEvent(chunk("def"), 0.1).ok());
  EXPECT_TRUE(stream.OnEvent(chunk(""), 0.12).ok());  // no output: not a chunk for TTFT/ITL
  EXPECT_TRUE(stream.OnEvent(chunk(" f(x)"), 0.2).ok());
  EXPECT_TRUE(stream.OnEvent(R"({"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17}})", 0.21).ok());
  EXPECT_FALSE(stream.done());
  EXPECT_TRUE(stream.OnEvent("[DONE]", 0.25).ok());
  EXPECT_TRUE(stream.done());
  const RequestResult r = stream.Finish(0.3, absl::OkStatus());
  EXPECT_TRUE(r.success) << r.error;
  EXPECT_EQ(r.chunk_times, (std::vector<double>{0.1, 0.2}));
  EXPECT_EQ(r.chunk_tokens, (std::vector<int>{1, 1}));
  EXPECT_EQ(r.output_text, "def f(x)");
  EXPECT_EQ(r.prompt_tokens, 12);
  EXPECT_EQ(r.output_tokens, 5);
  EXPECT_DOUBLE_EQ(r.latency, 0.25);
}

TEST(CompletionStream, ChatDeltas) {
  CompletionStream stream(/*chat=*/true);
  EXPECT_TRUE(stream.OnEvent(R"({"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]})", 0.1).ok());
  EXPECT_TRUE(stream.OnEvent(R"({"choices":[{"index":0,"delta":{"content":"Hello"}}]})", 0.2).ok());
  EXPECT_TRUE(stream.OnEvent(R"({"choices":[{"index":0,"delta":{},"finish_reason":"length"}]})", 0.3).ok());
  EXPECT_TRUE(stream.OnEvent(R"({"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}})", 0.3).ok());
  EXPECT_TRUE(stream.OnEvent("[DONE]", 0.31).ok());
  const RequestResult r = stream.Finish(0.31, absl::OkStatus());
  EXPECT_TRUE(r.success) << r.error;
  EXPECT_EQ(r.chunk_times, std::vector<double>{0.2});
  EXPECT_EQ(r.output_text, "Hello");
  EXPECT_EQ(r.output_tokens, 1);
}

TEST(CompletionStream, Failures) {
  {
    CompletionStream stream(false);
    absl::Status s = stream.OnEvent(R"({"error":{"message":"worker died","type":"server_error"}})", 0.1);
    EXPECT_NE(s.message().find("worker died"), absl::string_view::npos);
    const RequestResult r = stream.Finish(0.2, s);
    EXPECT_FALSE(r.success);
    EXPECT_NE(r.error.find("worker died"), std::string::npos);
    EXPECT_DOUBLE_EQ(r.latency, 0.2);
  }
  {
    CompletionStream stream(false);
    EXPECT_FALSE(stream.OnEvent("{not json", 0.1).ok());
  }
  {
    CompletionStream stream(false);  // no usage chunk
    EXPECT_TRUE(stream.OnEvent(R"({"choices":[{"text":"a"}]})", 0.1).ok());
    EXPECT_TRUE(stream.OnEvent("[DONE]", 0.2).ok());
    const RequestResult r = stream.Finish(0.2, absl::OkStatus());
    EXPECT_FALSE(r.success);
    EXPECT_NE(r.error.find("include_usage"), std::string::npos);
  }
  {
    CompletionStream stream(false);  // cut off before [DONE]
    EXPECT_TRUE(stream.OnEvent(R"({"choices":[{"text":"a"}]})", 0.1).ok());
    EXPECT_NE(stream.Finish(0.2, absl::OkStatus()).error.find("[DONE]"), std::string::npos);
  }
}

TEST(OpenAiClient, RequestBodies) {
  OpenAiClientOptions options;
  options.model = "tiny";
  ClientRequest request{.prompt = "x = ", .max_tokens = 9, .ignore_eos = true};
  nlohmann::json body = nlohmann::json::parse(OpenAiClient::RequestBody(options, request));
  EXPECT_EQ(body["model"], "tiny");
  EXPECT_EQ(body["prompt"], "x = ");
  EXPECT_EQ(body["max_tokens"], 9);
  EXPECT_EQ(body["temperature"], 0.0);
  EXPECT_EQ(body["stream"], true);
  EXPECT_EQ(body["stream_options"]["include_usage"], true);
  EXPECT_EQ(body["ignore_eos"], true);
  options.chat = true;
  request.ignore_eos = false;
  body = nlohmann::json::parse(OpenAiClient::RequestBody(options, request));
  EXPECT_EQ(body["messages"], nlohmann::json::parse(R"([{"role":"user","content":"x = "}])"));
  EXPECT_EQ(body["max_completion_tokens"], 9);
  EXPECT_FALSE(body.contains("prompt"));
  EXPECT_FALSE(body.contains("ignore_eos"));
  EXPECT_FALSE(body.contains("top_p"));
  // vLLM bench serve's sampling flags, then --extra-body over everything.
  options.sampling.temperature = 0.7;
  options.sampling.top_k = 5;
  options.sampling.repetition_penalty = 1.1;
  options.extra_body = nlohmann::json::parse(R"({"top_k": 7, "seed": 3})");
  body = nlohmann::json::parse(OpenAiClient::RequestBody(options, request));
  EXPECT_EQ(body["temperature"], 0.7);
  EXPECT_EQ(body["top_k"], 7);
  EXPECT_EQ(body["repetition_penalty"], 1.1);
  EXPECT_EQ(body["seed"], 3);
  EXPECT_FALSE(body.contains("min_p"));
  // A multi-turn chat sends its conversation.
  request.messages = {{"system", "be brief"}, {"user", "hi"}, {"assistant", "hello"}, {"user", "and?"}};
  body = nlohmann::json::parse(OpenAiClient::RequestBody(options, request));
  EXPECT_EQ(body["messages"], nlohmann::json::parse(R"([{"role":"system","content":"be brief"},
      {"role":"user","content":"hi"},{"role":"assistant","content":"hello"},{"role":"user","content":"and?"}])"));
}

TEST(OpenAiClient, BadSettings) {
  OpenAiClientOptions options;
  options.model = "m";
  for (const char* url : {"127.0.0.1:8000", "https://example.com", "http://:80", "http://host:99999", "http://host:x"}) {
    options.base_url = url;
    EXPECT_FALSE(OpenAiClient::Create(options).ok()) << url;
  }
  options.base_url = "http://127.0.0.1:8000";
  options.model.clear();
  EXPECT_FALSE(OpenAiClient::Create(options).ok());
}

// A one-thread HTTP server for the client: answers each connection's first request with
// `responses[i]` (the i-th connection), then closes it.
class ScriptedServer {
 public:
  explicit ScriptedServer(std::vector<std::string> responses)
      : acceptor_(io_, {boost::asio::ip::make_address("127.0.0.1"), 0}),
        thread_([this, responses = std::move(responses)] {
          for (const std::string& response : responses) {
            boost::asio::ip::tcp::socket socket(io_);
            acceptor_.accept(socket);
            ReadRequest(socket);  // all of it: closing with unread bytes would reset the connection
            ++answered_;          // before the write: the client may check it once it has the answer
            boost::asio::write(socket, boost::asio::buffer(response));
          }
        }) {}
  ~ScriptedServer() { thread_.join(); }
  int port() const { return acceptor_.local_endpoint().port(); }
  int answered() const { return answered_; }

 private:
  static void ReadRequest(boost::asio::ip::tcp::socket& socket) {
    boost::asio::streambuf buffer;
    const size_t header_bytes = boost::asio::read_until(socket, buffer, "\r\n\r\n");
    const std::string header(boost::asio::buffers_begin(buffer.data()),
                             boost::asio::buffers_begin(buffer.data()) + std::ptrdiff_t(header_bytes));
    const size_t at = header.find("Content-Length: ");
    const size_t body_bytes = at == std::string::npos ? 0 : std::stoul(header.substr(at + 16));
    if (buffer.size() - header_bytes < body_bytes) {
      boost::asio::read(socket, buffer, boost::asio::transfer_exactly(body_bytes - (buffer.size() - header_bytes)));
    }
  }

  boost::asio::io_context io_;
  boost::asio::ip::tcp::acceptor acceptor_;
  std::atomic<int> answered_{0};
  std::thread thread_;
};

std::string Chunked(const std::string& payload) {
  std::string out;
  for (size_t at = 0; at < payload.size(); at += 40) {
    const std::string piece = payload.substr(at, 40);
    out += absl::StrCat(absl::Hex(piece.size()), "\r\n", piece, "\r\n");
  }
  return out + "0\r\n\r\n";
}

RequestResult SendAndWait(OpenAiClient& client, const ClientRequest& request) {
  std::promise<RequestResult> result;
  client.Send(request, [&](RequestResult r) { result.set_value(std::move(r)); });
  return result.get_future().get();
}

TEST(OpenAiClient, StreamsThenRetriesAClosedKeptAliveConnectionAndReportsHttpErrors) {
  const std::string sse = absl::StrCat(
      "data: {\"choices\":[{\"index\":0,\"text\":\"def\"}]}\n\n",
      "data: {\"choices\":[{\"index\":0,\"text\":\" f\"}]}\n\n",
      "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":2}}\n\n", "data: [DONE]\n\n");
  const std::string error = R"({"error":{"message":"too busy","type":"rate_limit_error"}})";
  ScriptedServer server({
      "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
      "Connection: keep-alive\r\n\r\n" + Chunked(sse),
      absl::StrCat("HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nContent-Length: ",
                   error.size(), "\r\nConnection: close\r\n\r\n", error),
  });
  OpenAiClientOptions options;
  options.base_url = absl::StrCat("http://127.0.0.1:", server.port());
  options.model = "tiny";
  auto client = OpenAiClient::Create(options);
  ASSERT_TRUE(client.ok()) << client.status();
  const ClientRequest request{.prompt = "x", .max_tokens = 2};

  const RequestResult first = SendAndWait(**client, request);
  ASSERT_TRUE(first.success) << first.error;
  EXPECT_EQ(first.output_tokens, 2);
  EXPECT_EQ(first.prompt_tokens, 4);
  EXPECT_EQ(first.chunk_times.size(), 2u);
  // The server closed the kept-alive connection: the client notices and sends on a new one.
  const RequestResult second = SendAndWait(**client, request);
  EXPECT_FALSE(second.success);
  EXPECT_EQ(second.error, absl::StrCat("HTTP 429: ", error));
  EXPECT_EQ(server.answered(), 2);
}

}  // namespace
}  // namespace duet::bench
